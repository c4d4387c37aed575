"""XLA auto-clustering and the mixed-precision graph rewrite on a synchronized 2-tower graph.

``graph_rewrites_case``: every path of the library in one small model
(``sync_batch_norm``, ``fused=False`` tf.layers, ``tf1_syncbn.moments``),
two SGD steps. With a rewrite on, the graph builds, runs, keeps its 12
all-reduces per step (``CollectiveReduce`` in the rewritten partition
graphs), the audit reports every layer synchronized, and the losses and
variables equal the run without the rewrite (in the test process):

* XLA auto-clustering, in fresh processes (TensorFlow reads
  ``TF_XLA_FLAGS`` once; on CPU, clusters need ``--tf_xla_cpu_global_jit``):
  ``global_jit_level = ON_1`` in the session config, and
  ``TF_XLA_FLAGS=--tf_xla_auto_jit=2`` together with
  ``TF_ENABLE_AUTO_MIXED_PRECISION_GRAPH_REWRITE=1`` and
  ``enable_mixed_precision_graph_rewrite`` (which on a machine without a GPU
  wraps the optimizer in loss scaling; TensorFlow skips the float16 rewrite
  itself). On the stock kernels, XLA's clusters deadlocked the towers'
  all-reduces before the library kept its ops out of clusters (every step
  ended at the collective timeout, 60 s here).
* The float16 rewrite, in Grappler's CPU emulation of it
  (``auto_mixed_precision_cpu``): casts to float16 appear, the all-reduces
  stay float32/float64 and the compiled kernels float32; the losses agree
  to float16's precision.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import graph_rewrites_case as case
import tf_behavior

#: The case script the subprocesses run.
SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'support',
                       'for_compute')
XLA_CASES = [
    ('custom', 'session-config', {'jit': True}, '--tf_xla_cpu_global_jit', {}),
    ('stock', 'TF_XLA_FLAGS+AMP', {'amp_api': True}, '--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit',
     {'TF_ENABLE_AUTO_MIXED_PRECISION_GRAPH_REWRITE': '1'}),
]


@pytest.fixture(scope='module')
def plain():
    return case.run()


def _check_synchronized(result, plain):
    assert result['ops']['CollectiveReduce'] == plain['ops']['CollectiveReduce'] == 12
    assert result['audit'] == {'bn1': True, 'bn2': True, 'hand': True}, result['audit']
    assert result['audit_ok']


@pytest.mark.parametrize('kernels,name,kwargs,flags,env', tf_behavior.pick(
    XLA_CASES, XLA_CASES[1:]), ids=[c[0] + '-' + c[1] for c in tf_behavior.pick(
        XLA_CASES, XLA_CASES[1:])])
def test_xla_auto_clustering_runs_synchronized_and_equal(plain, kernels, name, kwargs, flags,
                                                          env):
    del name
    environ = dict(os.environ, TF_XLA_FLAGS=flags, TF1_SYNCBN_TIMEOUT='60', **env)
    if kernels == 'stock':
        environ['TF1_SYNCBN_KERNELS'] = '0'
    proc = subprocess.run([sys.executable, os.path.join(SUPPORT, 'graph_rewrites_case.py'),
                           json.dumps(kwargs)], env=environ, capture_output=True, text=True,
                          timeout=280)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('RESULT ')]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len('RESULT '):])
    assert result['ops'].get('_XlaRun', 0) > 0, 'XLA clustered nothing: %s' % result['ops']
    assert result['sync_op_dtypes'] == ([] if kernels == 'stock' else ['float32'])
    if kwargs.get('amp_api'):
        assert result['ops'].get('IsFinite', 0) > 0, 'no loss scaling'
    _check_synchronized(result, plain)
    np.testing.assert_allclose(result['losses'], plain['losses'], rtol=1e-5)
    for key, value in plain['variables'].items():
        np.testing.assert_allclose(result['variables'][key], value, rtol=1e-5, atol=1e-6,
                                   err_msg=key)


def test_float16_rewrite_keeps_the_synchronization_in_float32(plain):
    result = case.run(amp_cpu=True)
    assert result['half_casts'] > 0, 'the rewrite did nothing'
    assert set(result['collective_dtypes']) <= {'float32', 'float64'}
    assert result['sync_op_dtypes'] == ['float32']
    _check_synchronized(result, plain)
    np.testing.assert_allclose(result['losses'], plain['losses'], rtol=2e-3)
    for key, value in plain['variables'].items():
        np.testing.assert_allclose(result['variables'][key], value, rtol=5e-3, atol=5e-3,
                                   err_msg=key)


@pytest.mark.parametrize('layer', ['sync_batch_norm', 'moments'])
def test_every_op_in_a_tensor_training_branch_stays_out_of_xla_clusters(graph, layer):
    """With a tensor ``is_training`` the layer's ops are in a ``tf.cond``'s branches: in TF2
    behaviour those are function graphs of their own (inlined before XLA clusters the graph),
    which the attribute scope entered around the call does not reach. Each op of the layer,
    in the graph or in a branch, carries ``_XlaCompile=False``."""
    import tensorflow as tf  # noqa: PLC0415
    import tf1_syncbn  # noqa: PLC0415
    tf1 = tf.compat.v1
    training = tf1.placeholder_with_default(True, [])
    for i in range(2):
        with tf.device('/cpu:%d' % i), tf1.name_scope('tower_%d' % i):
            x = tf1.placeholder(tf.float32, [None, 3, 3, 4])
            if layer == 'moments':
                tf1_syncbn.moments(x, [0, 1, 2], training=training, num_dev=2)
            else:
                tf1_syncbn.sync_batch_norm(x, is_training=training, num_dev=2, scope='bn',
                                           reuse=i > 0)
    definition = graph.as_graph_def()
    nodes = [(None, n) for n in definition.node if n.name.startswith('tower_')] + [
        (f.signature.name, n) for f in definition.library.function for n in f.node_def]
    assert any(where is not None for where, _ in nodes) == (not tf_behavior.is_v1()), \
        'TF2 behaviour builds the branches as functions, TF1 behaviour in the graph'
    loose = ['%s/%s' % (where, n.name) if where else n.name for where, n in nodes
             if n.op not in ('Placeholder', 'NoOp') and
             not ('_XlaCompile' in n.attr and n.attr['_XlaCompile'].b is False)]
    assert not loose, loose

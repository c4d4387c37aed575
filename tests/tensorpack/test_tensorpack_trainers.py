"""tensorpack 0.11's own trainers and predictor with tf1_syncbn's layers plugged in.

``tests/support/tensorpack_harness.py`` runs, in one subprocess with legacy Keras:
tensorpack's ``SimpleTrainer`` with tensorpack's own ``BatchNorm`` on the
whole batch (the reference), and tensorpack's ``SyncMultiGPUTrainerParameterServer``
and ``SyncMultiGPUTrainerReplicated`` on 2 and 4 virtual-CPU towers with
``tf1_syncbn.BatchNorm(sync_statistics='collective')``, plus a model written
with ``argscope`` and ``LinearWrap`` that calls tensorpack's ``BatchNorm`` by
name, switched by ``tf1_syncbn.patch_tensorpack()``. Then tensorpack's
``OfflinePredictor`` scores a batch from the trained checkpoint. The only
override of tensorpack puts its hard-coded ``'/gpu:k'`` towers on ``'/cpu:k'``
(see ``_towers_on_virtual_cpus`` there).

Every run is made for both layouts (``channels_last``, and the layer on
``channels_first``) and twice: on the compiled CPU kernels in one subprocess,
and on the stock kernels with TensorFlow's oneDNN rewrites off
(``TF_ENABLE_ONEDNN_OPTS=0 TF1_SYNCBN_KERNELS=0``: the CPU stand-in for GPU
towers, read at process start) in another. (The harness can also run the
stock kernels with oneDNN on: ``kernel_sets`` of ``PROCESSES``.) The
reference (tensorpack's own layer) runs in each subprocess.
"""

import json
import os

import numpy as np
import pytest

import tf_behavior
from legacy_reference import run_reference

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'support')
# The TF1-behaviour pass (tf_behavior.pick): 2 towers, the stock kernels with oneDNN off.
TOWERS = tf_behavior.pick([2, 4], [2])
CONFIG = {'towers': TOWERS, 'steps': 4, 'global_batch': 8,
          'data_formats': ['channels_last', 'channels_first'], 'hang_seconds': 240}
EPS = 1e-5
#: subprocess -> (its extra environment, the kernel sets it runs).
PROCESSES = {
    'onednn-on': ({'TF1_SYNCBN_KERNELS': '1'}, ['custom']),
    'onednn-off': ({'TF1_SYNCBN_KERNELS': '0', 'TF_ENABLE_ONEDNN_OPTS': '0'}, ['stock']),
}
KERNEL_SETS = tf_behavior.pick([('onednn-on', 'custom'), ('onednn-off', 'stock')],
                               [('onednn-off', 'stock')])
SUFFIX = {'custom': '', 'stock': '@stock'}


@pytest.fixture(scope='module')
def harness_process(tmp_path_factory):
    """``harness_process(name)``: that subprocess's ``(arrays, info)``, run once.

    A training run that fails (for example on one layout) is recorded by the
    harness and fails that run's test with its error.
    """
    done = {}

    def get(process):
        if process not in done:
            env, kernel_sets = PROCESSES[process]
            out = tmp_path_factory.mktemp('tensorpack_harness_' + process)
            with open(os.path.join(SUPPORT, 'tensorpack_harness.py')) as f:
                code = f.read()
            # A collective that waits for a member fails after 60 s instead of 600 s.
            config = dict(CONFIG, kernel_sets=kernel_sets)
            run_reference(code, out, args=[str(out), json.dumps(config)],
                          env=dict(env, TF1_SYNCBN_TIMEOUT='60'), timeout=300)
            with open(out / 'result.json') as f:
                info = json.load(f)
            done[process] = (np.load(out / 'result.npz'), info)
        return done[process]

    return get


@pytest.fixture(params=KERNEL_SETS, ids=['%s-%s' % k for k in KERNEL_SETS])
def harness(request, harness_process):
    """``(arrays, info, kernel set, run-name suffix)`` for one kernel set."""
    process, kernel_set = request.param
    result, info = harness_process(process)
    return result, info, kernel_set, SUFFIX[kernel_set]


def _variables(result, run):
    prefix = 'var/%s/' % run
    return {k[len(prefix):]: result[k] for k in result.files if k.startswith(prefix)}


RUNS = ['%s%d%s' % (kind, n, suffix) for suffix in ('', '-nchw') for n in TOWERS
        for kind in ('ps', 'replicated', 'patched')]


@pytest.mark.parametrize('run', RUNS)
def test_trainer_equals_tensorpack_on_one_device(harness, run):
    result, info, kernel_set, kernel_suffix = harness
    towers = int(run.split('-')[0].lstrip('pscrelitdah'))
    suffix = run[len(run.split('-')[0]):]
    run += kernel_suffix
    for name in ('reference' + suffix, run):
        if 'error' in info[name]:
            pytest.fail('%s kernels: the %s run failed: %s' % (kernel_set, name,
                                                               info[name]['error']))
    assert info[run]['towers_with_cost'] == towers
    # The synchronized layer was built: one all-reduce forward and one backward per tower.
    assert info[run]['collectives'] == 2 * towers
    if kernel_set == 'custom':
        assert info[run]['kernel_ops'] > 0, info['kernels']
    else:
        assert info[run]['kernel_ops'] == 0, info['kernels']
    np.testing.assert_allclose(result['losses/' + run], result['losses/reference' + suffix],
                               rtol=1e-5, atol=1e-6)
    reference = _variables(result, 'reference' + suffix)
    ours = _variables(result, run)
    for name, value in reference.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    assert sorted(ours) == sorted(reference)
    owned = info[run]['tower_bn_variables']
    if run.startswith('replicated'):
        # Each tower k > 0 owns tower<k>/ copies (local variables, which tensorpack
        # syncs itself and does not save); the layer did not impose sharing.
        expected = ['tower%d/bn/%s' % (k, v) for k in range(1, towers)
                    for v in ('beta', 'gamma', 'mean/EMA', 'variance/EMA')]
        assert owned == sorted(expected)
    else:
        assert owned == []
    # The moving statistics moved from their initial values.
    assert not np.allclose(ours['bn/mean/EMA'], 0.0)


def test_tensorpack_argscope_accepts_our_layer(harness):
    # with argscope([Conv2D, tf1_syncbn.BatchNorm], data_format='channels_first'):
    # an [N, 5, 4, 4] input then has 5 channels.
    _, info, _, _ = harness
    assert info['argscope'] == {'gamma_shape': [5], 'use_scope': True}


def test_patch_tensorpack_switches_calls_by_name_and_is_restored(harness):
    _, info, _, _ = harness
    assert '__main__' in info['patched_modules']          # the script's own imported name
    assert 'tensorpack.models' in info['patched_modules']
    assert info['restored']


def test_offline_predictor_uses_and_keeps_the_moving_statistics(harness):
    result, info, _, _ = harness
    run = info['predicted_run']   # (the checkpoint of its subprocess's first kernel set)
    mean, var = result['var/%s/bn/mean/EMA' % run], result['var/%s/bn/variance/EMA' % run]
    gamma, beta = result['var/%s/bn/gamma' % run], result['var/%s/bn/beta' % run]
    conv = result['predict/conv'].astype(np.float64)
    expected = (conv - mean) / np.sqrt(var + EPS) * gamma + beta
    np.testing.assert_allclose(result['predict/bn'], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(result['predict/bn_again'], result['predict/bn'])
    np.testing.assert_array_equal(result['predict/ema_mean'], mean)
    np.testing.assert_array_equal(result['predict/ema_var'], var)

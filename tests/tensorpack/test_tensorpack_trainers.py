"""tensorpack 0.11's own trainers and predictor with tf1_syncbn's layers plugged in.

``tests/support/for_tensorpack/tensorpack_harness.py`` runs, in one subprocess with legacy Keras:
tensorpack's ``SimpleTrainer`` with tensorpack's own ``BatchNorm`` on the
whole batch (the reference), and tensorpack's ``SyncMultiGPUTrainerParameterServer``
and ``SyncMultiGPUTrainerReplicated`` on 2 and 4 virtual-CPU towers with
``tf1_syncbn.BatchNorm(sync_statistics='collective')``, plus a model written
with ``argscope`` and ``LinearWrap`` that calls tensorpack's ``BatchNorm`` by
name, switched by ``tf1_syncbn.patch_tensorpack()``. Then tensorpack's
``OfflinePredictor`` scores a batch from the trained checkpoint. The only
override of tensorpack puts its hard-coded ``'/gpu:k'`` towers on ``'/cpu:k'``
(see ``_towers_on_virtual_cpus`` there).

The runs are made for both layouts (``channels_last``, and the layer on
``channels_first``), on the compiled CPU kernels in one subprocess, and on the
stock kernels with TensorFlow's oneDNN rewrites off
(``TF_ENABLE_ONEDNN_OPTS=0 TF1_SYNCBN_KERNELS=0``: the CPU stand-in for GPU
towers, read at process start) in another: ``make test`` a covering set of
trainer x layout x towers x kernel set (``COVERING``), ``make test-full``
every run. (The harness can also run the
stock kernels with oneDNN on: ``kernel_sets`` of ``PROCESSES``.) The
reference (tensorpack's own layer) runs in each subprocess.
"""

import json
import os

import numpy as np
import pytest

import suite_scope
import tf_behavior
from legacy_reference import run_reference

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'support',
                       'for_tensorpack')
KINDS = ('ps', 'replicated', 'patched')
FORMATS = ('channels_last', 'channels_first')
KERNEL_SET_NAMES = ('custom', 'stock')
#: The training runs: (trainer kind, layout, towers, kernel set).
PRODUCT = [(kind, fmt, towers, kernels) for kernels in KERNEL_SET_NAMES for fmt in FORMATS
           for towers in (2, 4) for kind in KINDS]
# make test runs an all-pairs covering set of the kind x layout x towers x
# kernel set product (suite_scope.covering; make test-full all 24): 6 runs, 3
# per subprocess, in which every value of each factor meets every value of each
# other: each trainer (parameter server, replicated, patched by name) on both
# layouts, with 2 and 4 towers and on both kernel sets; each layout with both
# tower counts on both kernel sets. A triple adds no path: the trainer decides
# where variables live and how gradients and tower copies are synced (the same
# for any layout and kernel set), the layout and the kernel set decide the
# layer's ops (the same under any trainer), and the number of towers the group
# the layer synchronizes over, which each pair checks with each of the others.
COVERING = suite_scope.pairwise(KINDS, FORMATS, (2, 4), KERNEL_SET_NAMES)
# The TF1-behaviour pass: the stock kernels with oneDNN off (one subprocess):
# every trainer with reference variables (the parameter server's shared ones,
# the replicated trainer's tower copies and its sync ops, the layer's moving
# averages assigned in the layer), both layouts (Dimension shapes).
V1_COVERING = [run for run in COVERING if run[3] == 'stock']
RUN_CASES = tf_behavior.pick(suite_scope.covering(PRODUCT, COVERING), V1_COVERING)
CONFIG = {'steps': 4, 'global_batch': 8, 'data_formats': list(FORMATS), 'hang_seconds': 240}
EPS = 1e-5
#: subprocess -> (its extra environment, the kernel sets it runs).
PROCESSES = {
    'onednn-on': ({'TF1_SYNCBN_KERNELS': '1'}, ['custom']),
    'onednn-off': ({'TF1_SYNCBN_KERNELS': '0', 'TF_ENABLE_ONEDNN_OPTS': '0'}, ['stock']),
}
KERNEL_SETS = [(process, kernels) for process, kernels in (('onednn-on', 'custom'),
                                                           ('onednn-off', 'stock'))
               if any(run[3] == kernels for run in RUN_CASES)]
PROCESS_OF = {kernels: process for process, kernels in KERNEL_SETS}
SUFFIX = {'custom': '', 'stock': '@stock', 'channels_last': '', 'channels_first': '-nchw'}


def run_name(kind, fmt, towers, kernels=None):
    """``ps2``, ``replicated4-nchw``, ...; with ``kernels``, ``@stock`` for the stock ones."""
    return '%s%d%s%s' % (kind, towers, SUFFIX[fmt], SUFFIX[kernels] if kernels else '')


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
            runs = [[kind, towers, fmt, kernels] for kind, fmt, towers, kernels in RUN_CASES
                    if kernels in kernel_sets]
            config = dict(CONFIG, kernel_sets=kernel_sets, runs=runs)
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


@pytest.mark.parametrize('kind,fmt,towers,kernel_set', RUN_CASES,
                         ids=['%s-%s-%s' % (PROCESS_OF[run[3]], run[3], run_name(*run[:3]))
                              for run in RUN_CASES])
def test_trainer_equals_tensorpack_on_one_device(harness_process, kind, fmt, towers, kernel_set):
    result, info = harness_process(PROCESS_OF[kernel_set])
    suffix = SUFFIX[fmt]
    run = run_name(kind, fmt, towers, kernel_set)
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

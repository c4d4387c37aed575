"""tensorpack 0.11's own trainers and predictor with tf1_syncbn's layers plugged in.

``tests/tensorpack_harness.py`` runs, in one subprocess with legacy Keras:
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
``channels_first``) and three times, once per kernel set: the compiled CPU
kernels, the stock kernels (``TF1_SYNCBN_KERNELS=0``), and the stock kernels
with TensorFlow's oneDNN rewrites off (``TF_ENABLE_ONEDNN_OPTS=0`` too: the
CPU stand-in for GPU towers). The reference (tensorpack's own layer) runs in
each of them.
"""

import json
import os

import numpy as np
import pytest

from legacy_reference import run_reference

HERE = os.path.dirname(os.path.abspath(__file__))
TOWERS = [2, 4]
CONFIG = {'towers': TOWERS, 'steps': 4, 'global_batch': 8,
          'data_formats': ['channels_last', 'channels_first'], 'hang_seconds': 240}
EPS = 1e-5
KERNEL_SETS = {
    'custom': {},
    'stock': {'TF1_SYNCBN_KERNELS': '0'},
    'stock-onednn-off': {'TF1_SYNCBN_KERNELS': '0', 'TF_ENABLE_ONEDNN_OPTS': '0'},
}


@pytest.fixture(scope='module', params=sorted(KERNEL_SETS))
def harness(request, tmp_path_factory):
    """The harness's results on one kernel set: ``(arrays, info, kernel set)``.

    A run that fails (as the stock set with oneDNN off fails today on
    channels_first) fails every test of its kernel set with its output.
    """
    kernel_set = request.param
    out = tmp_path_factory.mktemp('tensorpack_harness_' + kernel_set)
    with open(os.path.join(HERE, 'tensorpack_harness.py')) as f:
        code = f.read()
    # A collective that waits for a member fails after 60 s instead of the default 600 s.
    env = dict(KERNEL_SETS[kernel_set], TF1_SYNCBN_TIMEOUT='60')
    if kernel_set == 'custom':
        env['TF1_SYNCBN_KERNELS'] = '1'
    run_reference(code, out, args=[str(out), json.dumps(CONFIG)], env=env, timeout=300)
    with open(out / 'result.json') as f:
        info = json.load(f)
    return np.load(out / 'result.npz'), info, kernel_set


def _variables(result, run):
    prefix = 'var/%s/' % run
    return {k[len(prefix):]: result[k] for k in result.files if k.startswith(prefix)}


RUNS = ['%s%d%s' % (kind, n, suffix) for suffix in ('', '-nchw') for n in TOWERS
        for kind in ('ps', 'replicated', 'patched')]


@pytest.mark.parametrize('run', RUNS)
def test_trainer_equals_tensorpack_on_one_device(harness, run):
    result, info, kernel_set = harness
    towers = int(run.split('-')[0].lstrip('pscrelitdah'))
    suffix = run[len(run.split('-')[0]):]
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
    _, info, _ = harness
    assert info['argscope'] == {'gamma_shape': [5], 'use_scope': True}


def test_patch_tensorpack_switches_calls_by_name_and_is_restored(harness):
    _, info, _ = harness
    assert '__main__' in info['patched_modules']          # the script's own imported name
    assert 'tensorpack.models' in info['patched_modules']
    assert info['restored']


def test_offline_predictor_uses_and_keeps_the_moving_statistics(harness):
    result, _, _ = harness
    run = 'ps%d' % TOWERS[0]
    mean, var = result['var/%s/bn/mean/EMA' % run], result['var/%s/bn/variance/EMA' % run]
    gamma, beta = result['var/%s/bn/gamma' % run], result['var/%s/bn/beta' % run]
    conv = result['predict/conv'].astype(np.float64)
    expected = (conv - mean) / np.sqrt(var + EPS) * gamma + beta
    np.testing.assert_allclose(result['predict/bn'], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(result['predict/bn_again'], result['predict/bn'])
    np.testing.assert_array_equal(result['predict/ema_mean'], mean)
    np.testing.assert_array_equal(result['predict/ema_var'], var)

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
"""

import json
import os

import numpy as np
import pytest

from legacy_reference import run_reference

HERE = os.path.dirname(os.path.abspath(__file__))
TOWERS = [2, 4]
CONFIG = {'towers': TOWERS, 'steps': 4, 'global_batch': 8}
EPS = 1e-5


@pytest.fixture(scope='module')
def harness(tmp_path_factory):
    out = tmp_path_factory.mktemp('tensorpack_harness')
    with open(os.path.join(HERE, 'tensorpack_harness.py')) as f:
        code = f.read()
    # A collective that waits for a member fails after 60 s instead of the default 600 s.
    run_reference(code, out, args=[str(out), json.dumps(CONFIG)],
                  env={'TF1_SYNCBN_TIMEOUT': '60'}, timeout=900)
    with open(out / 'result.json') as f:
        info = json.load(f)
    return np.load(out / 'result.npz'), info


def _variables(result, run):
    prefix = 'var/%s/' % run
    return {k[len(prefix):]: result[k] for k in result.files if k.startswith(prefix)}


RUNS = ['%s%d' % (kind, n) for n in TOWERS for kind in ('ps', 'replicated', 'patched')]


@pytest.mark.parametrize('run', RUNS)
def test_trainer_equals_tensorpack_on_one_device(harness, run):
    result, info = harness
    towers = int(run.lstrip('pscrelitdah'))
    assert info[run]['towers_with_cost'] == towers
    # The synchronized layer was built: one all-reduce forward and one backward per tower.
    assert info[run]['collectives'] == 2 * towers
    np.testing.assert_allclose(result['losses/' + run], result['losses/reference'],
                               rtol=1e-5, atol=1e-6)
    reference = _variables(result, 'reference')
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
    _, info = harness
    assert info['argscope'] == {'gamma_shape': [5], 'use_scope': True}


def test_patch_tensorpack_switches_calls_by_name_and_is_restored(harness):
    _, info = harness
    assert '__main__' in info['patched_modules']          # the script's own imported name
    assert 'tensorpack.models' in info['patched_modules']
    assert info['restored']


def test_offline_predictor_uses_and_keeps_the_moving_statistics(harness):
    result, _ = harness
    run = 'ps%d' % TOWERS[0]
    mean, var = result['var/%s/bn/mean/EMA' % run], result['var/%s/bn/variance/EMA' % run]
    gamma, beta = result['var/%s/bn/gamma' % run], result['var/%s/bn/beta' % run]
    conv = result['predict/conv'].astype(np.float64)
    expected = (conv - mean) / np.sqrt(var + EPS) * gamma + beta
    np.testing.assert_allclose(result['predict/bn'], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(result['predict/bn_again'], result['predict/bn'])
    np.testing.assert_array_equal(result['predict/ema_mean'], mean)
    np.testing.assert_array_equal(result['predict/ema_var'], var)

"""tensorpack's own ``HorovodTrainer`` with this library's BatchNorm, under ``horovodrun``.

``tensorpack_horovod_worker.py`` runs, in 2 processes with legacy Keras (which
tensorpack 0.11 needs on TF 2.21), tensorpack's ``HorovodTrainer`` on the
conv net of ``tests/support/for_tensorpack/tensorpack_harness.py``, each process fed its half of
every global batch, with ``tf1_syncbn.BatchNorm(sync_statistics='horovod')``
(channels last and first) and with tensorpack's own ``BatchNorm`` switched by
``tf1_syncbn.patch_tensorpack(sync_statistics='horovod')``: the losses of
every step and the saved variables (moving statistics included) equal
tensorpack's ``BatchNorm`` under ``SimpleTrainer`` on one device with the
whole batch, as the in-graph trainers do (``test_harness_tensorpack.py``).
tensorpack's own ``BatchNorm`` under ``HorovodTrainer`` (per-process
statistics) is the control that differs.
"""

import json

import numpy as np
import pytest

from .horovod_run import horovodrun

pytestmark = pytest.mark.timeout(600)

CONFIG = {'steps': 4, 'global_batch': 8, 'hang_seconds': 240}
RUNS = ['horovod', 'horovod-nchw', 'patched']


@pytest.fixture(scope='module')
def job(tmp_path_factory):
    """``[(arrays, info)]`` per process."""
    out = tmp_path_factory.mktemp('tensorpack_horovod')
    horovodrun('tensorpack_horovod_worker.py', [out, json.dumps(CONFIG)],
               env={'TF_USE_LEGACY_KERAS': '1'}, timeout=500).check()
    ranks = []
    for rank in range(2):
        with open(out / ('rank%d' % rank) / 'result.json') as f:
            info = json.load(f)
        ranks.append((np.load(out / ('rank%d' % rank) / 'result.npz'), info))
    return ranks


def _variables(result, run):
    prefix = 'var/%s/' % run
    return {k[len(prefix):]: result[k] for k in result.files if k.startswith(prefix)}


def _losses(job, run):
    """The global batch's loss per step: the mean of the processes' (equal shares)."""
    for _, info in job:
        if 'error' in info[run]:
            pytest.fail('the %s run failed: %s' % (run, info[run]['error']))
    return np.mean([result['losses/' + run] for result, _ in job], axis=0)


@pytest.mark.parametrize('run', RUNS)
def test_horovod_trainer_equals_tensorpack_on_one_device(job, run):
    result, info = job[0]
    assert [i['size'] for _, i in job] == [2, 2]
    if 'error' in info['reference']:
        pytest.fail('the reference run failed: %s' % info['reference']['error'])
    for _, process_info in job:
        assert process_info[run]['towers_with_cost'] == 1
        assert process_info[run]['kernel_ops'] > 0      # this library's layer was built
    np.testing.assert_allclose(_losses(job, run), result['losses/reference'],
                               rtol=1e-5, atol=1e-6)
    reference = _variables(result, 'reference')
    ours = _variables(result, run)
    assert sorted(ours) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    assert not np.allclose(ours['bn/mean/EMA'], 0.0)    # the moving statistics moved


def test_per_process_statistics_differ_from_one_device(job):
    """The control: tensorpack's own BatchNorm under HorovodTrainer normalizes each half alone."""
    result, _ = job[0]
    losses = _losses(job, 'unsynced')
    assert not np.allclose(losses, result['losses/reference'], rtol=1e-4, atol=1e-5)
    ours = _variables(result, 'unsynced')
    assert not np.allclose(ours['bn/mean/EMA'], _variables(result, 'reference')['bn/mean/EMA'],
                           rtol=1e-4, atol=1e-5)


def test_patch_tensorpack_is_restored(job):
    assert all(info['restored'] for _, info in job)

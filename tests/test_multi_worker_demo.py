"""The main job (examples/train_multitower.py) on several workers, and its resume."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, 'examples', 'train_multitower.py')
STEPS = 30
COMMON = ['--steps', str(STEPS), '--eval-every', '10', '--save-every', '10', '--min-accuracy', '0']

# tf-slim's pooling and flatten layers wrap deprecated tf.layers classes.
pytestmark = pytest.mark.filterwarnings(
    r'ignore:`(layer\.apply|tf\.layers\.flatten)` is deprecated:UserWarning')

sys.path.insert(0, os.path.join(ROOT, 'examples'))
try:
    import train_multitower as demo
finally:
    sys.path.pop(0)


def metrics(out_dir):
    with open(os.path.join(out_dir, 'metrics.json')) as f:
        return json.load(f)


@pytest.fixture(scope='module')
def one_worker(tmp_path_factory):
    """1 worker x 4 towers, in this process."""
    out = str(tmp_path_factory.mktemp('one_worker'))
    assert demo.main(COMMON + ['--towers', '4', '--out-dir', out]) == 0
    return metrics(out)


def test_batches_follow_the_step():
    n, batch = 10, 4
    steps = [demo.batch_indices(s, batch, n, seed=3) for s in range(5)]
    np.testing.assert_array_equal(steps[2], demo.batch_indices(2, batch, n, seed=3))
    stream = np.concatenate(steps)
    assert sorted(stream[:10]) == list(range(10))          # epoch 0 is a permutation
    assert sorted(stream[10:20]) == list(range(10))        # and so is epoch 1
    assert not np.array_equal(stream[:10], stream[10:20])
    assert not np.array_equal(steps[0], demo.batch_indices(0, batch, n, seed=4))


def test_two_workers_of_two_towers_follow_one_worker_of_four(one_worker, tmp_path):
    out = str(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.run([sys.executable, DEMO, '--workers', '2', '--towers', '2',
                           '--out-dir', out] + COMMON,
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    text = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, text
    two = metrics(out)
    assert (two['workers'], two['towers'], two['global_batch']) == (2, 2, 8)
    assert (one_worker['workers'], one_worker['global_batch']) == (1, 8)
    for name in ('sync', 'per_tower'):
        assert len(two['runs'][name]['loss']) == STEPS
        assert 0 <= two['runs'][name]['held_out_accuracy'] <= 1
    # Step by step. Per-tower batch norm on 2 examples amplifies rounding
    # differences (here: the order of the gradient sums) about 100x per step,
    # so its losses only agree over the first steps; SyncBN's stay within 1e-5.
    np.testing.assert_allclose(two['runs']['sync']['loss'], one_worker['runs']['sync']['loss'],
                               rtol=1e-3)
    np.testing.assert_allclose(two['runs']['per_tower']['loss'][:4],
                               one_worker['runs']['per_tower']['loss'][:4], rtol=1e-3)
    # The launcher prints the verdict, and so does every worker.
    assert 'PASS: SyncBN held-out accuracy' in proc.stdout.split('Starting')[-1], text
    worker_1 = [l for l in proc.stdout.splitlines() if l.startswith('[worker 1]')]
    assert any('PASS: SyncBN held-out accuracy' in l for l in worker_1), text


def test_resume_after_a_crash_continues_as_the_uninterrupted_run(one_worker, tmp_path,
                                                                  monkeypatch):
    out = str(tmp_path)
    crash_at = 25       # in the sync run, after the checkpoint of step 20
    original = demo.batch_indices

    def crashing(step, *args):
        if step == crash_at:
            raise KeyboardInterrupt('simulated crash')
        return original(step, *args)

    monkeypatch.setattr(demo, 'batch_indices', crashing)
    with pytest.raises(KeyboardInterrupt):
        demo.main(COMMON + ['--towers', '4', '--out-dir', out])
    assert not os.path.exists(os.path.join(out, 'metrics.json'))
    monkeypatch.setattr(demo, 'batch_indices', original)
    assert demo.main(COMMON + ['--towers', '4', '--out-dir', out, '--resume']) == 0
    resumed = metrics(out)
    assert resumed['runs']['sync']['start_step'] == 20
    assert resumed['runs']['per_tower']['start_step'] == 0
    for name in ('sync', 'per_tower'):
        for key in ('loss', 'accuracy', 'eval_step', 'eval_accuracy'):
            np.testing.assert_allclose(resumed['runs'][name][key], one_worker['runs'][name][key],
                                       rtol=1e-6, err_msg='%s %s' % (name, key))
        assert resumed['runs'][name]['held_out_accuracy'] == \
            one_worker['runs'][name]['held_out_accuracy']

"""The main job (examples/train_multitower.py) on several workers, its resume and its files."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import tf_behavior

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, 'examples', 'train_multitower.py')
#: Why the demo's runs are the TF2-behaviour pass's only (time): in TF1 behaviour,
#: test_multi_worker_training.py runs 2 workers x 2 towers against 1 x 4, and
#: test_resume_demo.py resumes the demo.
ONCE = 'the TF1-behaviour pass runs 2 workers in test_multi_worker_training.py'
STEPS = 30
# 30 steps take SyncBN to 75% held-out accuracy (per-tower BN: about 35%).
MIN_ACCURACY = 0.6
COMMON = ['--steps', str(STEPS), '--eval-every', '10', '--save-every', '10',
          '--min-accuracy', str(MIN_ACCURACY)]

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


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        f.write(text)


@pytest.fixture(scope='module')
def one_worker(tmp_path_factory):
    """1 worker x 4 towers, in this process, over a stale earlier run (--overwrite)."""
    out = str(tmp_path_factory.mktemp('one_worker'))
    stale = [os.path.join(out, 'sync', 'model.ckpt-999.index'),
             os.path.join(out, 'per_tower', 'model.ckpt-999.meta'),
             os.path.join(out, 'metrics.json')]
    for path in stale:
        write(path, 'stale')
    assert demo.main(COMMON + ['--towers', '4', '--out-dir', out, '--overwrite']) == 0
    return dict(metrics(out), stale=stale, out=out)


def _two_by_two_order(tower_grads, sparse_as_dense):
    """One worker's gradient average, summed in the order of 2 workers x 2 towers.

    ``((g0 + g1) + (g2 + g3)) / 4``: each worker sums its two towers, the
    cross-worker all-reduce adds the two sums, then the average divides by 4.
    """
    import tensorflow as tf
    del sparse_as_dense
    out = []
    for pairs in zip(*tower_grads):
        g = [p[0] for p in pairs]
        total = tf.add_n([tf.add_n(g[:2]), tf.add_n(g[2:])])
        out.append((total * tf.cast(0.25, total.dtype), pairs[0][1]))
    return out


@pytest.fixture(scope='module')
def one_worker_in_two_by_two_order(tmp_path_factory):
    """1 worker x 4 towers whose gradients are summed as 2 x 2 sums them."""
    from tf1_syncbn.distributed import collectives
    out = str(tmp_path_factory.mktemp('one_worker_2x2_order'))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(collectives, '_average_local', _two_by_two_order)
        assert demo.main(COMMON + ['--towers', '4', '--out-dir', out]) == 0
    return metrics(out)


@pytest.fixture(scope='module')
def two_workers(tmp_path_factory):
    """2 workers x 2 towers: worker processes started by the demo's launcher."""
    out = str(tmp_path_factory.mktemp('two_workers'))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.run([sys.executable, DEMO, '--workers', '2', '--towers', '2',
                           '--out-dir', out] + COMMON + tf_behavior.flag(),
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    text = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, text
    return dict(metrics(out), stdout=proc.stdout, text=text)


def test_batches_follow_the_step():
    n, batch = 10, 4
    steps = [demo.batch_indices(s, batch, n, seed=3) for s in range(5)]
    np.testing.assert_array_equal(steps[2], demo.batch_indices(2, batch, n, seed=3))
    stream = np.concatenate(steps)
    assert sorted(stream[:10]) == list(range(10))          # epoch 0 is a permutation
    assert sorted(stream[10:20]) == list(range(10))        # and so is epoch 1
    assert not np.array_equal(stream[:10], stream[10:20])
    assert not np.array_equal(steps[0], demo.batch_indices(0, batch, n, seed=4))


@pytest.mark.once(reason=ONCE)
def test_two_workers_of_two_towers_follow_one_worker_of_four(two_workers, one_worker,
                                                             one_worker_in_two_by_two_order):
    two, plain, same_order = two_workers, one_worker, one_worker_in_two_by_two_order
    assert (two['workers'], two['towers'], two['global_batch']) == (2, 2, 8)
    assert (plain['workers'], plain['global_batch']) == (1, 8)
    for name in ('sync', 'per_tower'):
        assert len(two['runs'][name]['loss']) == STEPS
    # With the gradients summed in the same order, 1 x 4 *is* 2 x 2: every
    # step's loss to float32 rounding of the reported mean (the two layouts
    # average the tower losses in different orders), for both runs, and the
    # same held-out accuracies.
    for name in ('sync', 'per_tower'):
        np.testing.assert_allclose(two['runs'][name]['loss'], same_order['runs'][name]['loss'],
                                   rtol=1e-6, err_msg=name)
        assert two['runs'][name]['eval_accuracy'] == same_order['runs'][name]['eval_accuracy']
        assert two['runs'][name]['held_out_accuracy'] == \
            same_order['runs'][name]['held_out_accuracy']
    # 1 x 4 sums its towers' gradients as ((g0 + g1) + g2) + g3: the rounding
    # differs from 2 x 2's, and training amplifies it. SyncBN's losses agree
    # within 1e-5 over the first 10 steps and 1e-3 over all 30; per-tower BN
    # (statistics of 2 examples) amplifies it about 100x per step, so its
    # losses agree only over the first steps.
    np.testing.assert_allclose(two['runs']['sync']['loss'][:10],
                               plain['runs']['sync']['loss'][:10], rtol=1e-5)
    np.testing.assert_allclose(two['runs']['sync']['loss'], plain['runs']['sync']['loss'],
                               rtol=1e-3)
    np.testing.assert_allclose(two['runs']['per_tower']['loss'][:3],
                               plain['runs']['per_tower']['loss'][:3], rtol=1e-5)
    # SyncBN learns: the verdict is PASS against a real threshold, from the
    # launcher and from every worker.
    assert two['runs']['sync']['held_out_accuracy'] >= MIN_ACCURACY
    assert two['runs']['sync']['held_out_accuracy'] > two['runs']['per_tower']['held_out_accuracy']
    assert 'PASS: SyncBN held-out accuracy' in two['stdout'].split('Starting')[-1], two['text']
    worker_1 = [l for l in two['stdout'].splitlines() if l.startswith('[worker 1]')]
    assert any('PASS: SyncBN held-out accuracy' in l for l in worker_1), two['text']


def test_overwrite_deletes_the_earlier_run(one_worker):
    assert not any(os.path.exists(p) for p in one_worker['stale'][:2])
    assert one_worker['runs']['sync']['start_step'] == 0      # metrics.json is the new one
    assert sorted(f for f in os.listdir(os.path.join(one_worker['out'], 'sync'))
                  if f.startswith('model.ckpt-'))[-1].startswith('model.ckpt-30.')


def test_verdict_fails_below_the_minimum_accuracy():
    passed, lines = demo.verdict({'sync': 0.5, 'per_tower': 0.9}, 0.6, 'auto')
    assert not passed and lines[-1].startswith('FAIL: SyncBN held-out accuracy 50.00% is below')


@pytest.mark.parametrize('extra', [[], ['--workers', '2', '--towers', '2']])
def test_an_earlier_run_is_never_replaced_without_resume_or_overwrite(tmp_path, capsys, extra,
                                                                    monkeypatch):
    monkeypatch.delenv('TF_CONFIG', raising=False)
    out = str(tmp_path / 'out')
    checkpoint = os.path.join(out, 'per_tower', 'model.ckpt-5.index')
    write(checkpoint, 'earlier run')
    assert demo.main(['--out-dir', out] + extra) == 2
    message = capsys.readouterr().err
    assert out in message and '--resume' in message and '--overwrite' in message, message
    assert 'per_tower/model.ckpt-5.index' in message
    with open(checkpoint) as f:
        assert f.read() == 'earlier run'
    # Output that is not the demo's does not count as an earlier run.
    assert demo.earlier_run(str(tmp_path)) == []


@pytest.mark.parametrize('environ, task, chief', [
    ({}, None, True),
    ({}, 0, True),
    ({}, 1, False),
    ({'TF_CONFIG': '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", '
                   '"index": 0}}'}, None, True),
    ({'TF_CONFIG': '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", '
                   '"index": 1}}'}, None, False),
    ({'TF_CONFIG': '{"cluster": {"chief": ["c:0"], "worker": ["a:1"]}, "task": {"type": '
                   '"worker", "index": 0}}'}, None, False),
    ({'TF_CONFIG': '{"cluster": {"chief": ["c:0"], "worker": ["a:1"]}, "task": {"type": '
                   '"chief", "index": 0}}'}, None, True),
])
def test_only_the_chief_checks_for_an_earlier_run(monkeypatch, environ, task, chief):
    monkeypatch.delenv('TF_CONFIG', raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    args = demo.parse_args(['--hosts', 'a:1,b:2', '--task', str(task)] if task is not None
                           else [])
    assert demo._will_be_chief(args) is chief


def test_json_files_are_replaced_atomically(tmp_path, monkeypatch):
    path = str(tmp_path / 'metrics.json')
    demo.write_json(path, {'old': 1})
    real_dump = json.dump

    def dump_then_die(value, f, **kwargs):
        f.write('{"new": ')
        raise KeyboardInterrupt('killed while writing')

    monkeypatch.setattr(demo, 'json', types.SimpleNamespace(dump=dump_then_die))
    with pytest.raises(KeyboardInterrupt):
        demo.write_json(path, {'new': 2})
    with open(path) as f:
        assert json.load(f) == {'old': 1}
    assert os.listdir(str(tmp_path)) == ['metrics.json']     # no temporary file left
    monkeypatch.setattr(demo, 'json', types.SimpleNamespace(dump=real_dump))
    demo.write_json(path, {'new': 2})
    with open(path) as f:
        assert json.load(f) == {'new': 2}


@pytest.mark.once(reason=ONCE)
def test_resume_after_a_crash_continues_as_the_uninterrupted_run(one_worker, tmp_path,
                                                                  monkeypatch):
    out = str(tmp_path)
    history_path = os.path.join(out, 'sync', 'history.json')
    real_dump = json.dump

    # The process dies in the middle of writing the sync run's history of step
    # 20, before its checkpoint of step 20.
    def dump(value, f, **kwargs):
        if isinstance(value, dict) and value.get('step') and value['step'][-1] == 20:
            f.write('{"step": [1, 2')
            raise KeyboardInterrupt('simulated kill while history.json is written')
        return real_dump(value, f, **kwargs)

    monkeypatch.setattr(demo, 'json', types.SimpleNamespace(dump=dump, load=json.load,
                                                            loads=json.loads))
    with pytest.raises(KeyboardInterrupt):
        demo.main(COMMON + ['--towers', '4', '--out-dir', out])
    monkeypatch.setattr(demo, 'json', json)
    assert not os.path.exists(os.path.join(out, 'metrics.json'))
    with open(history_path) as f:
        assert json.load(f)['step'] == list(range(1, 11))     # the step-10 file, intact
    assert not [f for f in os.listdir(os.path.dirname(history_path)) if f.endswith('.tmp')]
    # Restarting without --resume refuses, and keeps the checkpoints.
    assert demo.main(COMMON + ['--towers', '4', '--out-dir', out]) == 2
    assert os.path.exists(os.path.join(out, 'sync', 'checkpoint'))
    assert demo.main(COMMON + ['--towers', '4', '--out-dir', out, '--resume']) == 0
    resumed = metrics(out)
    assert resumed['runs']['sync']['start_step'] == 10
    assert resumed['runs']['per_tower']['start_step'] == 0
    for name in ('sync', 'per_tower'):
        for key in ('loss', 'accuracy', 'eval_step', 'eval_accuracy'):
            np.testing.assert_allclose(resumed['runs'][name][key], one_worker['runs'][name][key],
                                       rtol=1e-6, err_msg='%s %s' % (name, key))
        assert resumed['runs'][name]['held_out_accuracy'] == \
            one_worker['runs'][name]['held_out_accuracy']

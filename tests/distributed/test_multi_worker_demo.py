"""The main job (examples/train_multitower.py) on several workers, its resume and its files."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import tf_behavior

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


#: Where the test SIGKILLs a worker of the restarting job: when the chief prints
#: this progress line (after the checkpoint of step 10, so that the steps
#: after it are trained twice), the worker with this task index.
KILLS = (('sync      step 15/%d' % STEPS, 1), ('per_tower step 15/%d' % STEPS, 0))


@pytest.fixture(scope='module')
def killed_twice(tmp_path_factory):
    """2 workers x 2 towers with --max-restarts 2; two workers SIGKILLed (KILLS)."""
    import re
    import signal
    out = str(tmp_path_factory.mktemp('killed_twice'))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.Popen([sys.executable, DEMO, '--workers', '2', '--towers', '2',
                             '--max-restarts', '2', '--out-dir', out] + COMMON +
                            tf_behavior.flag(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines, pids, kills, all_pids = [], {}, list(KILLS), []
    for line in proc.stdout:
        lines.append(line.rstrip('\n'))
        started = re.match(r'\[launcher\] worker (\d): pid (\d+)', line)
        if started:
            pids[int(started.group(1))] = int(started.group(2))
            all_pids.append(int(started.group(2)))
        if kills and line.startswith('[worker 0] ' + kills[0][0]):
            os.kill(pids[kills.pop(0)[1]], signal.SIGKILL)
    status = proc.wait(timeout=60)
    text = '\n'.join(lines)
    assert status == 0 and not kills, text[-6000:]
    return dict(metrics(out), lines=lines, text=text, out=out, pids=all_pids)


class _Supervisor(object):
    """Plays an outside supervisor (a Kubernetes restartPolicy, a node agent) for each worker.

    Worker 0 runs the demo with ``--hosts ... --task 0``, worker 1 with
    ``TF_CONFIG``, always on the same two addresses, both with
    ``--auto-resume``. A worker that fails (a non-zero status, a signal) is
    started again, up to ``max_restarts`` times: at once, or, when it was
    killed by a signal, ``late`` seconds later, as a node that takes longer to
    come back. ``kill`` = (marker, worker): SIGKILL that worker, once, when
    the chief prints a line starting with marker.
    """

    def __init__(self, out, kill, max_restarts=1, late=5.0):
        import threading
        from tf1_syncbn.launch import free_ports, tf_config
        addresses = ['localhost:%d' % p for p in free_ports(2)]
        argv = [sys.executable, DEMO, '--towers', '2', '--out-dir', out,
                '--auto-resume'] + COMMON + tf_behavior.flag()
        self.argv = [argv + ['--hosts', ','.join(addresses), '--task', '0'], argv]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT,
                                                           os.environ.get('PYTHONPATH', '')]))
        self.envs = [env, dict(env, TF_CONFIG=tf_config(addresses, 1))]
        self.kill, self.max_restarts, self.late = kill, max_restarts, late
        self.starts = [[], []]        # per worker, the time of each start
        self.lines = [[], []]         # per worker, per attempt, its lines
        self.codes = [[], []]
        self.procs = [None, None]
        self._lock = threading.Lock()

    def _run(self, rank, deadline):
        import signal
        import time
        for attempt in range(self.max_restarts + 1):
            lines = []
            with self._lock:
                self.starts[rank].append(time.time())
                self.lines[rank].append(lines)
                self.procs[rank] = subprocess.Popen(
                    self.argv[rank], env=self.envs[rank], text=True, cwd=ROOT,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
                proc = self.procs[rank]
            for line in proc.stdout:
                lines.append(line.rstrip('\n'))
                if rank == 0 and self.kill and line.startswith(self.kill[0]):
                    with self._lock:
                        os.kill(self.procs[self.kill[1]].pid, signal.SIGKILL)
                        self.kill = None
            self.codes[rank].append(proc.wait())
            if self.codes[rank][-1] == 0 or time.time() > deadline:
                return
            if self.codes[rank][-1] < 0:
                time.sleep(self.late)

    def run(self, timeout):
        import signal
        import threading
        import time
        deadline = time.time() + timeout
        threads = [threading.Thread(target=self._run, args=(rank, deadline), daemon=True)
                   for rank in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, deadline - time.time()))
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        return self

    def text(self):
        return '\n'.join('[worker %d, start %d] %s' % (rank, a, line)
                         for rank in range(2) for a, lines in enumerate(self.lines[rank])
                         for line in lines)[-8000:]


@pytest.fixture(scope='module')
def supervised(tmp_path_factory):
    """The chief, under its supervisor, SIGKILLed after the sync run's step 15."""
    out = str(tmp_path_factory.mktemp('supervised'))
    supervisor = _Supervisor(out, kill=(KILLS[0][0], 0)).run(timeout=400)
    return dict(supervisor=supervisor, out=out)


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


@pytest.mark.once(reason=ONCE)
@pytest.mark.timeout(600)
def test_a_job_killed_twice_restarts_and_equals_the_uninterrupted_run(two_workers,
                                                                     killed_twice):
    from test_multi_worker_launch import wait_gone
    killed, out = killed_twice, killed_twice['out']
    # Every step's loss and accuracy, the held-out curve and the final
    # accuracy are the uninterrupted run's, bit for bit, for both runs, though
    # steps 11 to 15 or so of each were trained twice (killed after the
    # progress line of step 15, resumed from the checkpoint of step 10).
    for name in ('sync', 'per_tower'):
        for key in ('loss', 'accuracy', 'eval_step', 'eval_accuracy', 'held_out_accuracy'):
            np.testing.assert_array_equal(killed['runs'][name][key], two_workers['runs'][name][key],
                                          err_msg='%s %s' % (name, key))
    assert killed['runs']['sync']['resumed_at'] == [10, STEPS]
    assert killed['runs']['per_tower']['resumed_at'] == [10]
    assert killed['restart_count'] == 2
    # metrics.json records each restart: the worker, its exit cause, and where
    # the chief resumed each run; the launcher logged the same.
    sync, per_tower = (os.path.join(out, name, 'model.ckpt-%d') for name in ('sync', 'per_tower'))
    restarts = killed['restarts']
    assert [(r['restart'], r['worker'], r['cause'], r['exit_status']) for r in restarts] == [
        (1, 1, 'killed by SIGKILL', 137), (2, 0, 'killed by SIGKILL', 137)]
    assert [[(s['step'], s['checkpoint']) for s in r['resumed']] for r in restarts] == [
        [(10, sync % 10), (0, None)], [(STEPS, sync % STEPS), (10, per_tower % 10)]]
    for line in ('[launcher] restart 1 of 2: worker 1 killed by SIGKILL; every worker is stopped',
                 '[launcher] restart 1: worker 0 resumed at step 10 from %s' % (sync % 10),
                 '[launcher] restart 1: worker 0 started at step 0 (no checkpoint in %s)'
                 % os.path.join(out, 'per_tower'),
                 '[launcher] restart 2 of 2: worker 0 killed by SIGKILL; every worker is stopped',
                 '[launcher] restart 2: worker 0 resumed at step 10 from %s' % (per_tower % 10)):
        assert any(l.startswith(line) for l in killed['lines']), (line, killed['text'][-6000:])
    assert 'PASS: SyncBN held-out accuracy' in killed['text'].split('Restart 2:')[-1]
    assert len(killed['pids']) == 6 and wait_gone(killed['pids']) == []


def _checkpoint_state(run_dir, steps, saved):
    """A ``checkpoint`` state file listing ``steps``; index files for those in ``saved``."""
    os.makedirs(run_dir, exist_ok=True)
    names = ['model.ckpt-%d' % s for s in steps]
    with open(os.path.join(run_dir, 'checkpoint'), 'w') as f:
        f.write('model_checkpoint_path: "%s"\n' % names[-1])
        f.writelines('all_model_checkpoint_paths: "%s"\n' % n for n in names)
    for s in saved:
        write(os.path.join(run_dir, 'model.ckpt-%d.index' % s), '')


@pytest.mark.once(reason='command-line logic, before any graph is built')
def test_auto_resume_resumes_when_a_checkpoint_is_there_else_starts_afresh(tmp_path,
                                                                         monkeypatch):
    from tf1_syncbn.launch.restarts import RESTART_COUNT_ENV
    monkeypatch.delenv(RESTART_COUNT_ENV, raising=False)
    out = str(tmp_path / 'out')
    argv = COMMON + ['--out-dir', out]
    args = demo.parse_args(argv + ['--auto-resume'])
    assert demo.apply_auto_resume(args) == '--overwrite' and args.overwrite and not args.resume
    # What an interrupted first start leaves (no checkpoint yet) is replaced,
    # not refused as an earlier run.
    write(os.path.join(out, 'sync', 'history.json'), '{}')
    write(os.path.join(out, 'initial_weights.npz'), '')
    assert demo.refusal(demo.parse_args(argv)) is not None
    args = demo.parse_args(argv + ['--auto-resume'])
    assert demo.apply_auto_resume(args) == '--overwrite'
    assert demo.refusal(args) is None and demo.resume_problem(args) is None
    # A checkpoint whose newest entry is half-written (no index): --resume
    # from the older one, which is what the run has trained.
    _checkpoint_state(os.path.join(out, 'per_tower'), [10, 20], saved=[10])
    args = demo.parse_args(argv + ['--auto-resume'])
    assert demo.apply_auto_resume(args) == '--resume' and args.resume and not args.overwrite
    assert demo.resume_problem(args) is None
    assert demo.resume_problem(demo.parse_args(argv + ['--resume', '--steps', '5'])).startswith(
        '--resume: the run in %s has trained 10 steps already' % out)
    # Without the option: only a worker restarted by --max-restarts does it.
    assert demo.apply_auto_resume(demo.parse_args(argv)) is None
    monkeypatch.setenv(RESTART_COUNT_ENV, '0')
    assert demo.apply_auto_resume(demo.parse_args(argv)) is None
    monkeypatch.setenv(RESTART_COUNT_ENV, '1')
    args = demo.parse_args(argv)
    assert demo.apply_auto_resume(args) == '--resume' and args.resume


@pytest.mark.once(reason=ONCE)
@pytest.mark.timeout(600)
def test_workers_restarted_by_a_supervisor_rejoin_and_equal_the_uninterrupted_run(
        two_workers, supervised):
    supervisor, out = supervised['supervisor'], supervised['out']
    text = supervisor.text()
    # The chief was killed; worker 1 lost it (status 1); both came back and
    # finished. The chief came back 5 s after worker 1, which waited for it
    # (its group leader) at the start-up rendezvous.
    assert supervisor.codes == [[-9, 0], [1, 0]], text
    assert supervisor.starts[0][1] - supervisor.starts[1][1] > 4, text
    assert 'FAIL: worker 1 (localhost:' in '\n'.join(supervisor.lines[1][0]), text
    assert '--auto-resume: --resume (a checkpoint in %s)' % out in supervisor.lines[0][1], text
    assert 'sync      resumed at step 10 from %s' % os.path.join(out, 'sync', 'model.ckpt-10') \
        in supervisor.lines[0][1], text
    resumed = metrics(out)
    for name in ('sync', 'per_tower'):
        for key in ('loss', 'accuracy', 'eval_step', 'eval_accuracy', 'held_out_accuracy'):
            np.testing.assert_array_equal(resumed['runs'][name][key],
                                          two_workers['runs'][name][key],
                                          err_msg='%s %s' % (name, key))
    assert resumed['runs']['sync']['resumed_at'] == [10]
    assert resumed['runs']['per_tower']['resumed_at'] == []

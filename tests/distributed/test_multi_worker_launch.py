"""tf1_syncbn.launch with plain Python workers (no TensorFlow in them: fast)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tf1_syncbn.launch import Launcher, launch, tf_config
from tf1_syncbn.launch.restarts import Restart, describe_exit, exit_status

#: Processes without TensorFlow: the TF2-behaviour pass only.
pytestmark = pytest.mark.once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The launcher run by its path, without the package (its folder: python runs __main__.py).
LAUNCH = os.path.join(ROOT, 'tf1_syncbn', 'launch')

# Worker 1 fails at once; worker 0 starts a grandchild in its process group and
# then sleeps (or ignores SIGTERM); both print their pid and TF_CONFIG task.
WORKER = r'''
import json, os, signal, subprocess, sys, time
task = json.loads(os.environ['TF_CONFIG'])['task']['index']
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])
print('task %d pid %d child %d' % (task, os.getpid(), child.pid), flush=True)
if task == int(sys.argv[1]):
    time.sleep(0.5)
    sys.exit(3)
if len(sys.argv) > 2:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(300)
'''


def pids_in(lines):
    out = []
    for line in lines:
        if line.startswith('task '):
            words = line.split()
            out += [int(words[3]), int(words[5])]
    return out


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of a process we do not own (reaped by init later) counts as gone.
    try:
        with open('/proc/%d/stat' % pid) as f:
            return f.read().split(')')[-1].split()[0] != 'Z'
    except OSError:
        return False


def wait_gone(pids, seconds=10):
    deadline = time.time() + seconds
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_tf_config_is_the_standard_format():
    config = json.loads(tf_config(['a:1', 'b:2'], 1))
    assert config == {'cluster': {'worker': ['a:1', 'b:2']}, 'task': {'type': 'worker', 'index': 1}}


@pytest.mark.parametrize('ignore_sigterm', [False, True])
def test_a_failed_worker_stops_the_others_and_their_children(ignore_sigterm):
    argv = [sys.executable, '-c', WORKER, '1'] + (['ignore'] if ignore_sigterm else [])
    launcher = Launcher(argv, 2, output=None, grace=0.5, kill_after=1.0).start()
    started = time.time()
    status = launcher.wait(timeout=60)
    assert status == 3
    assert launcher.failed == (1, 3)
    assert launcher.exit_codes[0] == (-signal.SIGKILL if ignore_sigterm else -signal.SIGTERM)
    # Worker 0 was stopped by the launcher: not a failure of its own.
    assert launcher.exits[0].stopped and not launcher.exits[0].failed
    assert launcher.exits[1].failed and not launcher.exits[1].stopped
    assert time.time() - started < 20
    pids = pids_in(launcher.lines[0] + launcher.lines[1])
    assert len(pids) == 4
    assert wait_gone(pids) == []


def test_every_worker_gets_its_own_tf_config():
    argv = [sys.executable, '-c', 'import os; print(os.environ["TF_CONFIG"])']
    launcher = Launcher(argv, 3, output=None, addresses=['localhost:1', 'localhost:2', 'h:3'])
    assert launcher.start().wait(timeout=60) == 0
    for i in range(3):
        assert json.loads(launcher.lines[i][-1]) == json.loads(
            tf_config(['localhost:1', 'localhost:2', 'h:3'], i))


def test_timeout_stops_every_worker():
    argv = [sys.executable, '-c', WORKER, '-1']
    launcher = Launcher(argv, 2, output=None, kill_after=1.0).start()
    while sum(len(l) for l in launcher.lines) < 2:
        time.sleep(0.05)
    assert launcher.wait(timeout=0.5) == 124
    assert wait_gone(pids_in(launcher.lines[0] + launcher.lines[1])) == []
    # The workers the launcher stopped did not fail: there is no root cause.
    assert launcher.failed is None and all(e.stopped for e in launcher.exits)


def _start_cli(tmp_path):
    out = open(str(tmp_path / 'out.txt'), 'w')
    proc = subprocess.Popen([sys.executable, LAUNCH, '--workers', '2', '--kill-after', '1', '--',
                             sys.executable, '-c', WORKER, '-1'], stdout=out,
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while True:
        with open(str(tmp_path / 'out.txt')) as f:
            lines = [l.split('] ', 1)[1] for l in f.read().splitlines() if l.startswith('[worker')]
        if len(pids_in(lines)) == 4:
            return proc, pids_in(lines)
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path):
    proc, pids = _start_cli(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert wait_gone(pids) == []


def test_workers_die_with_a_killed_launcher(tmp_path):
    if not sys.platform.startswith('linux'):
        pytest.skip('PR_SET_PDEATHSIG is Linux only')
    proc, pids = _start_cli(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    # The workers die with the launcher; their own children are orphans of
    # their process group only in this case (documented), so check the workers.
    assert wait_gone(pids[0::2]) == []
    for pid in pids[1::2]:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_launch_returns_the_status_and_restores_signal_handlers():
    before = signal.getsignal(signal.SIGTERM)
    assert launch([sys.executable, '-c', 'import sys; sys.exit(0)'], 2, output=None) == 0
    assert launch([sys.executable, '-c', 'import sys; sys.exit(5)'], 1, output=None) == 5
    assert signal.getsignal(signal.SIGTERM) is before


def test_bad_arguments():
    with pytest.raises(ValueError, match='num_workers'):
        Launcher(['x'], 0)
    with pytest.raises(ValueError, match='argv'):
        Launcher('python x.py', 2)
    with pytest.raises(ValueError, match='tasks'):
        Launcher(['x'], 2, tasks=[2])


def test_a_worker_killed_by_a_signal_makes_the_launcher_exit_with_128_plus_it():
    # Worker 1 kills itself with SIGUSR1 (default action: terminate); worker 0
    # sleeps until the launcher stops it. The command-line launcher's status
    # is the killed worker's: 128 + SIGUSR1.
    worker = ('import json, os, signal, time\n'
              'if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:\n'
              '    os.kill(os.getpid(), signal.SIGUSR1)\n'
              'time.sleep(300)\n')
    proc = subprocess.run([sys.executable, LAUNCH, '--workers', '2', '--grace', '0.2',
                           '--kill-after', '1', '--', sys.executable, '-c', worker],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGUSR1, proc.stdout + proc.stderr
    assert '[launcher] worker 1 killed by SIGUSR1' in proc.stdout, proc.stdout


SHOW_GPUS = 'import os; print(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))'


@pytest.mark.parametrize('visible, expected', [
    (None, ['0,1', '2,3', '4,5']),
    ('7,5,3,1,0,2', ['7,5', '3,1', '0,2']),          # a slice of the launcher's own list
])
def test_gpus_per_worker_gives_each_worker_its_own_gpus(visible, expected):
    env = {k: v for k, v in os.environ.items() if k != 'CUDA_VISIBLE_DEVICES'}
    if visible is not None:
        env['CUDA_VISIBLE_DEVICES'] = visible
    launcher = Launcher([sys.executable, '-c', SHOW_GPUS], 3, env=env, output=None,
                        gpus_per_worker=2)
    assert launcher.start().wait(timeout=60) == 0
    assert [lines[-1] for lines in launcher.lines] == expected
    # Without the option, the workers inherit the launcher's environment as it is.
    launcher = Launcher([sys.executable, '-c', SHOW_GPUS], 2, env=env, output=None)
    assert launcher.start().wait(timeout=60) == 0
    assert [lines[-1] for lines in launcher.lines] == [visible or 'unset'] * 2


def test_gpus_per_worker_from_the_command_line():
    env = {k: v for k, v in os.environ.items() if k != 'CUDA_VISIBLE_DEVICES'}
    proc = subprocess.run([sys.executable, LAUNCH, '--workers', '2', '--gpus-per-worker', '3',
                           '--', sys.executable, '-c', SHOW_GPUS],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert '[worker 0] 0,1,2' in proc.stdout and '[worker 1] 3,4,5' in proc.stdout, proc.stdout
    env['CUDA_VISIBLE_DEVICES'] = '0,1,2'
    proc = subprocess.run([sys.executable, LAUNCH, '--workers', '2', '--gpus-per-worker', '2',
                           '--', sys.executable, '-c', SHOW_GPUS],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert "need 4 GPUs, but CUDA_VISIBLE_DEVICES='0,1,2' lists 3" in proc.stderr, proc.stderr
    assert '[worker' not in proc.stdout            # nothing was started


def test_gpus_per_worker_must_be_a_positive_int():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match='gpus_per_worker must be a positive int'):
            Launcher(['x'], 2, gpus_per_worker=bad)


# --max-restarts. Worker 1 fails in attempts 0 .. FAILS-1 (SIGKILL in even
# attempts, status 3 after printing 'boom' in odd ones); worker 0 prints the
# start line of a chief that resumed at step 10 * attempt, its TF_CONFIG and
# restart variables, then waits to be stopped; in attempt FAILS both exit 0.
RESTARTING = r'''
import json, os, signal, sys, time
task = json.loads(os.environ['TF_CONFIG'])['task']['index']
attempt = int(os.environ['TF1_SYNCBN_RESTART_COUNT'])
print('task %d pid %d attempt %d of %s config %s' % (
    task, os.getpid(), attempt, os.environ['TF1_SYNCBN_MAX_RESTARTS'], os.environ['TF_CONFIG']),
    flush=True)
if task == 0:
    sys.stderr.write('tf1_syncbn: worker 0 (x:1) resumed at step %d from /c/model.ckpt-%d\n'
                     % (10 * attempt, 10 * attempt))
    sys.stderr.flush()
if attempt == int(sys.argv[1]):
    sys.exit(0)
if task == 1:
    time.sleep(0.2)
    if attempt % 2 == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    print('boom', flush=True)
    sys.exit(3)
time.sleep(300)
'''


def test_max_restarts_restarts_every_worker_until_the_job_succeeds():
    restarts, out = [], _Lines()
    started = time.time()
    status = launch([sys.executable, '-c', RESTARTING, '2'], 2, timeout=60, max_restarts=3,
                    restarts=restarts, output=out, grace=0.2, kill_after=1.0)
    text = '\n'.join(out.lines)
    assert status == 0, text
    # Every worker ran 3 times, with its attempt in its environment; each
    # attempt had new ports, and no process of a failed attempt is left.
    starts = [l.split('] ', 1)[1].split() for l in out.lines if '] task ' in l]
    assert sorted((int(s[1]), int(s[5])) for s in starts) == [(0, 0), (0, 1), (0, 2), (1, 0),
                                                              (1, 1), (1, 2)], text
    assert all(s[7] == '3' for s in starts)
    assert len({' '.join(s[9:]) for s in starts if s[1] == '0'}) == 3, text
    assert wait_gone([int(s[3]) for s in starts]) == []
    # Each restart: the worker, its exit cause, when it ended, the step the chief
    # resumed at; worker 0 was stopped by the launcher, not a consequence.
    assert [type(r) for r in restarts] == [Restart, Restart]
    assert started < restarts[0].ended_at < restarts[1].ended_at < time.time()
    assert [r.to_dict() for r in restarts] == [
        {'restart': 1, 'worker': 1, 'cause': 'killed by SIGKILL', 'exit_status': 137,
         'last_line': restarts[0].last_line,
         'resumed': [{'step': 10, 'checkpoint': '/c/model.ckpt-10', 'directory': None}],
         'ended_at': restarts[0].ended_at, 'consequences': []},
        {'restart': 2, 'worker': 1, 'cause': 'exited with status 3', 'exit_status': 3,
         'last_line': 'boom',
         'resumed': [{'step': 20, 'checkpoint': '/c/model.ckpt-20', 'directory': None}],
         'ended_at': restarts[1].ended_at, 'consequences': []}]
    for line in ('[launcher] restart 1 of 3: worker 1 killed by SIGKILL; every worker is '
                 'stopped and starts again',
                 '[launcher] restart 1: worker 0 resumed at step 10 from /c/model.ckpt-10',
                 "[launcher] restart 2 of 3: worker 1 exited with status 3 (its last line: "
                 "'boom')",
                 '[launcher] restart 2: worker 0 resumed at step 20 from /c/model.ckpt-20'):
        assert any(l.startswith(line) for l in out.lines), (line, text)


class _Lines(object):
    """A launcher's ``output`` that keeps its lines."""

    def __init__(self):
        self.lines = []

    def write(self, text):
        self.lines += text.splitlines()

    def flush(self):
        pass


def test_a_job_that_keeps_dying_fails_after_max_restarts_naming_each_cause():
    proc = subprocess.run([sys.executable, LAUNCH, '--workers', '2', '--grace', '0.2',
                           '--kill-after', '1', '--max-restarts', '2', '--',
                           sys.executable, '-c', RESTARTING, '99'],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stdout + proc.stderr
    assert proc.stdout.count('] task 1 ') == 3, proc.stdout
    error = [l for l in proc.stdout.splitlines() if l.startswith('[launcher] error:')]
    assert error == [
        "[launcher] error: the job failed 3 times, and --max-restarts is 2: restart 1 after "
        "worker 1 killed by SIGKILL (the chief resumed at step 10 from /c/model.ckpt-10); "
        "restart 2 after worker 1 exited with status 3 (its last line: 'boom') (the chief "
        "resumed at step 20 from /c/model.ckpt-20); then worker 1 killed by SIGKILL."], \
        proc.stdout


def test_a_stopped_job_is_never_restarted(tmp_path):
    # SIGTERM to the launcher, and the job's timeout: no restart.
    proc = subprocess.Popen([sys.executable, LAUNCH, '--workers', '2', '--kill-after', '1',
                             '--max-restarts', '5', '--', sys.executable, '-c', WORKER, '-1'],
                            stdout=subprocess.PIPE, text=True)
    lines = []
    while len([l for l in lines if l.startswith('[worker')]) < 2:
        lines.append(proc.stdout.readline())
        assert lines[-1], ''.join(lines)        # the launcher ended before its workers spoke
    proc.send_signal(signal.SIGTERM)
    out = ''.join(lines) + proc.stdout.read()
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM, out
    assert '[launcher] restart' not in out and out.count('[launcher] worker 0: pid') == 1, out
    out = _Lines()
    assert launch([sys.executable, '-c', WORKER, '-1'], 2, timeout=1, max_restarts=5,
                  output=out, kill_after=1) == 124
    assert not [l for l in out.lines if 'restart' in l], out.lines


# The root cause of a failed attempt. Both workers wait; SIGUSR1 makes one fail
# by itself (status 3), SIGUSR2 makes one fail as a peer that lost a worker does
# (status 1); each first prints a long line. In a restarted attempt both exit 0.
PEERS = r"""
import json, os, signal, sys, time
task = json.loads(os.environ['TF_CONFIG'])['task']['index']
if os.environ.get('TF1_SYNCBN_RESTART_COUNT') == '1':
    sys.exit(0)
def fail(status, line):
    def handler(signum, frame):
        print(line, flush=True)
        sys.exit(status)
    return handler
signal.signal(signal.SIGUSR1, fail(3, %r %% task))
signal.signal(signal.SIGUSR2, fail(1, %r %% (task, 1 - task)))
print('ready', flush=True)
time.sleep(300)
"""
BOOM = ('Traceback: worker %d: ValueError: cannot parse record 1234 of '
        '/data/train-00017-of-00100.tfrecord: feature "label" should be an int64 list, got a '
        'bytes list; check the converter that wrote this shard, or skip bad records with '
        'ignore_errors()')
LOST = ('ERROR worker %d (localhost:1111): a worker was lost during training '
        '(UnavailableError: Collective ops is aborted by: failed to connect to all addresses; '
        'last error: Connection refused; not answering: worker %d (localhost:2222)). Every '
        'worker stops: restart the job, which resumes from the chief\'s latest checkpoint.')
PEERS = PEERS % (BOOM, LOST)


def _ended(pid):
    """Waits until ``pid`` has ended (a zombie counts), then up to 3 s until it is reaped."""
    assert wait_gone([pid]) == []
    deadline = time.time() + 3
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def _fail_in_turn(pids, victim, how):
    """Worker ``victim`` fails (SIGKILL, or status 3); once it has ended, the other exits 1."""
    os.kill(pids[victim], signal.SIGKILL if how == 'SIGKILL' else signal.SIGUSR1)
    _ended(pids[victim])
    time.sleep(0.2)
    os.kill(pids[1 - victim], signal.SIGUSR2)
    _ended(pids[1 - victim])


@pytest.mark.parametrize('victim, how', [(1, 'SIGKILL'), (0, 'SIGKILL'), (1, 'status 3')])
def test_the_root_cause_is_the_first_worker_to_end_however_late_the_launcher_looks(victim,
                                                                                   how):
    # The launcher looks only once both workers have ended (nothing polls it
    # before wait()): its index order must not decide which one it blames.
    out = _Lines()
    launcher = Launcher([sys.executable, '-c', PEERS], 2, output=out, grace=5,
                        kill_after=1).start()
    deadline = time.time() + 60
    while not all(lines[-1:] == ['ready'] for lines in launcher.lines):
        assert time.time() < deadline, launcher.lines
        time.sleep(0.02)
    _fail_in_turn(launcher.pids, victim, how)
    status = launcher.wait(timeout=60)
    text = '\n'.join(out.lines)
    code, other = (-signal.SIGKILL if how == 'SIGKILL' else 3), 1 - victim
    cause = describe_exit(code)
    # The log: the root cause (nothing left running), then the other as its consequence.
    ended = [l for l in out.lines if re.match(r'\[launcher\] worker \d (?!:)', l)]
    assert len(ended) == 2, text
    assert ended[0] == '[launcher] worker %d %s' % (victim, cause), text
    consequence = re.match(r'\[launcher\] worker %d exited with status 1, (\d+\.\d\d) s after '
                           r'worker %d %s$' % (other, victim, re.escape(
                               ('was ' if code < 0 else '') + cause)), ended[1])
    assert consequence and float(consequence.group(1)) >= 0.15, text
    assert launcher.failed == (victim, code), text
    assert status == exit_status(code)
    # The record of a restart (metrics.json's) names the same, and the consequence.
    record = Restart.of_attempt(1, launcher.exits).to_dict()
    assert (record['worker'], record['cause'], record['exit_status']) == \
        (victim, cause, exit_status(code))
    assert record['last_line'] == ('ready' if code < 0 else BOOM % victim)
    assert [(c['worker'], c['cause'], c['exit_status'], c['last_line'])
            for c in record['consequences']] == [(other, 'exited with status 1', 1,
                                                  LOST % (other, victim))]
    assert record['consequences'][0]['seconds_after'] == pytest.approx(
        launcher.exits[other].ended_at - record['ended_at'], abs=1e-3)
    assert record['consequences'][0]['seconds_after'] >= 0.15


def test_a_paused_launcher_names_the_root_cause_and_restarts_for_it():
    # The command-line launcher, paused (SIGSTOP) while worker 1 fails by itself
    # and worker 0 then exits 1; it resumes once both have ended. Attempt 1 passes.
    proc = subprocess.Popen([sys.executable, LAUNCH, '--workers', '2', '--grace', '5',
                             '--kill-after', '1', '--max-restarts', '1', '--',
                             sys.executable, '-c', PEERS], stdout=subprocess.PIPE, text=True)
    lines, pids = [], {}
    while len([l for l in lines if l.startswith('[worker') and 'ready' in l]) < 2:
        lines.append(proc.stdout.readline())
        assert lines[-1], ''.join(lines)        # the launcher ended before its workers spoke
        started = re.match(r'\[launcher\] worker (\d): pid (\d+)', lines[-1])
        if started:
            pids[int(started.group(1))] = int(started.group(2))
    proc.send_signal(signal.SIGSTOP)
    try:
        _fail_in_turn(pids, 1, 'status 3')
    finally:
        proc.send_signal(signal.SIGCONT)
    out = ''.join(lines) + proc.stdout.read()
    assert proc.wait(timeout=60) == 0, out
    launcher = [l for l in out.splitlines() if l.startswith('[launcher] ')]
    assert launcher[2:4] == ['[launcher] worker 1 exited with status 3', launcher[3]], out
    assert re.match(r'\[launcher\] worker 0 exited with status 1, \d+\.\d\d s after worker 1 '
                    r'exited with status 3$', launcher[3]), out
    assert launcher[4].startswith(
        "[launcher] restart 1 of 1: worker 1 exited with status 3 (its last line: 'Traceback: "
        "worker 1: ValueError: cannot parse record 1234 of ... should be an int64 list, got a "
        "bytes list; check the converter that wrote this shard, or skip bad records with "
        "ignore_errors()'); every worker is stopped and starts again"), out


def test_long_lines_are_cut_at_word_boundaries_with_an_ellipsis():
    from tf1_syncbn.launch.restarts import shorten
    # 313 characters: a third of the width for the start, the rest for the end.
    assert shorten(LOST % (0, 1)) == (
        'ERROR worker 0 (localhost:1111): a worker was lost during ... not answering: worker 1 '
        '(localhost:2222)). Every worker stops: restart the job, which resumes from the '
        'chief\'s latest checkpoint.')
    assert shorten(LOST % (0, 1), 60) == 'ERROR worker 0 ... from the chief\'s latest checkpoint.'
    assert shorten('short enough', 12) == 'short enough'
    assert shorten('a' * 30 + ' b', 20) == 'aaaaa ... b'    # a word longer than its part: cut


def test_a_failure_noticed_after_a_later_one_becomes_the_root_cause():
    # The launcher's bookkeeping driven directly, with made-up end times: worker 0
    # (status 1 at t=10.5) is noticed first, then worker 1 (SIGKILL at t=10.0),
    # then worker 2, which the launcher had stopped.
    from tf1_syncbn.launch.restarts import WorkerExit
    out = _Lines()
    launcher = Launcher(['x'], 3, output=out, addresses=['a:1', 'b:2', 'c:3'], grace=7)
    for k, record in enumerate([WorkerExit(0, 1, 10.5), WorkerExit(1, -9, 10.0),
                                WorkerExit(2, -15, 12.0, stopped=True)]):
        launcher.exits[k] = record
        launcher._announce([k])
    assert out.lines == [
        '[launcher] worker 0 exited with status 1; the others get 7 s to exit on their own, '
        'then they are stopped',
        '[launcher] worker 1 killed by SIGKILL; it ended 0.50 s before worker 0 failed, which '
        'is then a consequence',
        '[launcher] worker 2 stopped by the launcher (killed by SIGTERM)']
    assert launcher.failed == (1, -9)
    record = Restart.of_attempt(1, launcher.exits)
    assert (record.worker, record.code, record.ended_at) == (1, -9, 10.0)
    assert [c.to_dict(WorkerExit(1, -9, 10.0)) for c in record.consequences] == [
        {'worker': 0, 'cause': 'exited with status 1', 'exit_status': 1, 'ended_at': 10.5,
         'last_line': None, 'seconds_after': 0.5}]

"""tf1_syncbn.launch with plain Python workers (no TensorFlow in them: fast)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tf1_syncbn.launch import Launcher, launch, tf_config

#: Processes without TensorFlow: the TF2-behaviour pass only.
pytestmark = pytest.mark.once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, 'tf1_syncbn', 'launch.py')

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

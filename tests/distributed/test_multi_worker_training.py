"""Multi-worker training with real worker processes on localhost (2 workers x 2 towers).

The job is ``tests/support/for_distributed/multi_worker_job.py`` (a tiny model with sync_batch_norm,
dense and sparse gradients, momentum), started by :class:`tf1_syncbn.launch.Launcher`.
The reference is the same job on one worker with 4 towers, run in this
process, whose gradients go through ``tower.average_gradients``.

Six launches in all, shared between the checks through module fixtures:
the uninterrupted run (whose chief pauses between two steps for longer than
the other run's collective timeout) and, at the same time, the same run with
that shorter timeout; the run whose worker 1 is killed; the run that resumes
from the killed run's checkpoint (with a chief whose restore takes longer than
the start-up timeout); and (at the same time) two lone workers whose leader is
missing or does not speak gRPC.
"""

import os
import signal
import socket
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
from tf1_syncbn.launch import Launcher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, 'tests', 'support', 'for_distributed', 'multi_worker_job.py')
STEPS = 6
SAVE_EVERY = 3
COLLECTIVE_TIMEOUT = 8.0
META = ('steps', 'start_step', 'local_loss', 'global_loss')
# The chief pauses PAUSE seconds after step PAUSE_AFTER (as a long save would).
# The same run passes with a collective timeout above the pause and fails with
# SHORT_TIMEOUT below it: the deadline covers the peers' time between steps.
PAUSE, PAUSE_AFTER, SHORT_TIMEOUT, LONG_TIMEOUT = 6.0, 2, 3.0, 20.0

#: Why the failure and resume cases run in the TF2-behaviour pass only (time): they test
#: the launcher's and the watchdog's handling of processes; the TF1-behaviour pass runs
#: the 2-worker training equality and the broadcast.
ONCE = 'process failure handling; the TF1-behaviour pass runs the training equality'


def job_argv(*extra, timeout=COLLECTIVE_TIMEOUT):
    return [sys.executable, JOB, '--towers', '2', '--collective-timeout',
            str(timeout)] + [str(e) for e in extra]


def job_env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]),
                TF_CPP_MIN_LOG_LEVEL='2')


def run_job(args, timeout=240, **kwargs):
    launcher = Launcher(job_argv(*args), 2, env=job_env(), output=None, **kwargs).start()
    status = launcher.wait(timeout=timeout)
    return launcher, status


def output(launcher):
    return '\n'.join('[worker %d] %s' % (i, line)
                     for i, lines in enumerate(launcher.lines) for line in lines)[-6000:]


def load(out_dir, rank):
    return dict(np.load(os.path.join(out_dir, 'worker%d.npz' % rank)))


def variable_names(results):
    return sorted(k for k in results if k not in META and
                  not k.startswith(('init/', 'start/', 'extra_')))


def line_time(launcher, worker, marker):
    """(arrival time, line) of the first line of ``worker`` containing ``marker``."""
    found = [(t, line) for t, line in zip(launcher.times[worker], launcher.lines[worker])
             if marker in line]
    assert found, 'worker %d printed no %r:\n%s' % (worker, marker, output(launcher))
    return found[0]


def assert_no_process_left(launcher):
    for pid in launcher.pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)     # nothing left in the worker's process group


@pytest.fixture(scope='module')
def reference():
    """One worker, 4 towers, in this process (tower.average_gradients)."""
    import multi_worker_job as job
    from tf1_syncbn.distributed import setup_cluster
    opts = job.parse_args(['--towers', '4', '--steps', str(STEPS)])
    return job.train(opts, setup_cluster(towers=4))


@pytest.fixture(scope='module')
def paused(tmp_path_factory):
    """The chief pauses PAUSE s after step PAUSE_AFTER; two runs at the same time.

    ``long``: collective timeout LONG_TIMEOUT > PAUSE, the uninterrupted run;
    ``short``: SHORT_TIMEOUT < PAUSE (only test_the_step_deadline_covers_a_peers_pause_...
    uses it, a TF2-behaviour-pass test: the TF1-behaviour pass does not start it).
    """
    out = str(tmp_path_factory.mktemp('uninterrupted'))
    pause = ['--pause', PAUSE, '--pause-after', PAUSE_AFTER]
    launchers = {
        'short': Launcher(job_argv('--steps', STEPS, *pause, timeout=SHORT_TIMEOUT), 2,
                          env=job_env(), output=None, grace=3),
        'long': Launcher(job_argv('--steps', STEPS, '--differ-seeds', '--out', out, *pause,
                                  timeout=LONG_TIMEOUT), 2, env=job_env(), output=None)}
    if tf_behavior.is_v1():
        del launchers['short']
    for launcher in launchers.values():
        launcher.start()
    statuses = {name: launcher.wait(timeout=240) for name, launcher in launchers.items()}
    return dict(launchers=launchers, statuses=statuses, out=out)


@pytest.fixture(scope='module')
def uninterrupted(paused):
    launcher = paused['launchers']['long']
    assert paused['statuses']['long'] == 0, output(launcher)
    return [load(paused['out'], 0), load(paused['out'], 1)]


@pytest.fixture(scope='module')
def killed(tmp_path_factory):
    """Worker 1 is killed with SIGKILL after the chief's first checkpoint."""
    # Each worker gets its own checkpoint directory: only the chief's may fill.
    ckpt = os.path.join(str(tmp_path_factory.mktemp('killed')), 'ckpt{rank}')
    launcher = Launcher(job_argv('--steps', 1000, '--save-every', SAVE_EVERY, '--step-delay', 0.3,
                                 '--differ-seeds', '--checkpoint-dir', ckpt),
                        2, env=job_env(), output=None, grace=60).start()
    saved = 'model.ckpt-%d' % SAVE_EVERY
    deadline = time.time() + 180
    while not any(saved in line for line in list(launcher.lines[0])):
        assert time.time() < deadline and launcher.procs[0].poll() is None, output(launcher)
        time.sleep(0.02)
    killed_at = time.time()
    os.kill(launcher.pids[1], signal.SIGKILL)
    status = launcher.wait(timeout=120)
    return dict(launcher=launcher, status=status, killed_at=killed_at, checkpoint_dir=ckpt)


def test_two_workers_of_two_towers_equal_one_worker_of_four_towers(reference, uninterrupted):
    names = variable_names(reference)
    assert {'BatchNorm/moving_mean', 'BatchNorm/moving_variance', 'embedding', 'bag',
            'dense/kernel/Momentum', 'global_step'} <= set(names)
    for rank, result in enumerate(uninterrupted):
        np.testing.assert_allclose(result['global_loss'], reference['global_loss'], rtol=1e-5)
        assert variable_names(result) == names
        for name in names:
            np.testing.assert_allclose(result[name], reference[name], rtol=1e-5, atol=1e-6,
                                       err_msg='worker %d: %s' % (rank, name))
    # The workers' own (tower-mean) losses average to the global loss.
    local_losses = uninterrupted[0]['local_loss'] + uninterrupted[1]['local_loss']
    np.testing.assert_allclose(local_losses / 2, reference['global_loss'], rtol=1e-5)
    # Every worker holds exactly the same variables.
    for name in names:
        np.testing.assert_array_equal(uninterrupted[0][name], uninterrupted[1][name], err_msg=name)


def test_average_across_workers_is_the_mean_over_workers(uninterrupted):
    first, second = uninterrupted
    np.testing.assert_allclose(first['global_loss'], (first['local_loss'] + second['local_loss'])
                               / 2.0, rtol=1e-6)
    for i, shape in enumerate([(STEPS, 3), (STEPS,)]):
        mine = [w['extra_local/%d' % i].astype(np.float64) for w in uninterrupted]
        assert mine[0].shape == shape
        assert not np.array_equal(mine[0], mine[1])      # the workers' values differ
        expected = (mine[0] + mine[1]) / 2.0
        for rank, result in enumerate(uninterrupted):
            got = result['extra_mean/%d' % i]
            assert got.dtype == np.float32 and got.shape == shape
            np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg='worker %d' % rank)


@pytest.mark.once(reason=ONCE)
def test_the_step_deadline_covers_a_peers_pause_between_steps(paused):
    # Short timeout: worker 1's step after the pause waits for the paused chief
    # and fails once it has lasted SHORT_TIMEOUT s, while the chief still sleeps.
    short = paused['launchers']['short']
    text = output(short)
    assert paused['statuses']['short'] == 1, text
    assert short.failed == (1, 1), text
    paused_at, _ = line_time(short, 0, 'pausing %g s after step %d' % (PAUSE, PAUSE_AFTER))
    line_time(short, 1, 'step %d loss' % PAUSE_AFTER)          # the steps before it passed
    failed_at, error = line_time(short, 1, 'ERROR')
    assert 'a worker was lost during training' in error, text
    assert 'every peer still accepts connections' in error, text
    assert 'spent longer between two steps (saving, evaluating) than the collective timeout ' \
           'of %g s allows' % SHORT_TIMEOUT in error, text
    assert failed_at - paused_at > SHORT_TIMEOUT - 0.5, text
    assert not any('step %d loss' % (PAUSE_AFTER + 1) in line for line in short.lines[1]), text
    # Long timeout: the same run passes (status 0, checked by `uninterrupted`),
    # and worker 1's step after the pause lasted longer than the short timeout.
    long = paused['launchers']['long']
    assert paused['statuses']['long'] == 0, output(long)
    before, _ = line_time(long, 1, 'step %d loss' % PAUSE_AFTER)
    after, _ = line_time(long, 1, 'step %d loss' % (PAUSE_AFTER + 1))
    assert after - before > PAUSE - 0.5 > SHORT_TIMEOUT, output(long)


def test_broadcast_makes_differently_seeded_workers_identical(uninterrupted):
    first, second = uninterrupted
    inits = [k[len('init/'):] for k in first if k.startswith('init/')]
    assert len(inits) == 6
    for name in inits:
        if name != 'logits/bias':      # zeros whatever the seed
            assert np.abs(first['init/' + name] - second['init/' + name]).max() > 0.1, name
        np.testing.assert_array_equal(first['start/' + name], first['init/' + name])
        np.testing.assert_array_equal(second['start/' + name], first['init/' + name])


@pytest.mark.once(reason=ONCE)
def test_a_killed_worker_fails_the_others_within_the_timeout_and_nothing_is_left(killed):
    launcher = killed['launcher']
    text = output(launcher)
    assert killed['status'] != 0, text
    assert launcher.failed == (1, -signal.SIGKILL), text
    # The chief failed on its own (status 1), it was not stopped by the launcher.
    assert launcher.exit_codes[0] == 1, text
    errors = [(t, line) for t, line in zip(launcher.times[0], launcher.lines[0])
              if line.startswith('ERROR')]
    assert errors and 'a worker was lost' in errors[0][1], text
    assert 'not answering: worker 1 (%s)' % launcher.addresses[1] in errors[0][1], text
    assert errors[0][0] - killed['killed_at'] < COLLECTIVE_TIMEOUT + 10, text
    assert_no_process_left(launcher)


@pytest.mark.once(reason=ONCE)
def test_resume_from_the_chiefs_checkpoint_equals_the_uninterrupted_run(killed, uninterrupted,
                                                                        tmp_path):
    ckpt = killed['checkpoint_dir']
    chief_dir, other_dir = ckpt.format(rank=0), ckpt.format(rank=1)
    saved = tf.train.latest_checkpoint(chief_dir)
    step = int(saved.rsplit('-', 1)[1])
    assert SAVE_EVERY <= step < STEPS, saved
    # Only the chief wrote, into its own directory; worker 1's was never created.
    assert all(name.startswith(('model.ckpt', 'checkpoint')) for name in os.listdir(chief_dir))
    assert not os.path.exists(other_dir)
    # The chief's restore takes longer than the start-up timeout: worker 1
    # waits for it in the start-up broadcast (startup_timeout + restore_timeout).
    out = str(tmp_path)
    startup, delay = 3.0, 6.0
    launcher, status = run_job(['--steps', STEPS, '--differ-seeds', '--checkpoint-dir', ckpt,
                                '--out', out, '--startup-timeout', startup,
                                '--chief-start-delay', delay])
    text = output(launcher)
    assert status == 0, text
    assert any('restored' in line for line in launcher.lines[0]), text
    line_time(launcher, 0, 'restore took')
    waiting, _ = line_time(launcher, 1, 'starting the session')
    started, _ = line_time(launcher, 1, 'started at step %d' % step)
    assert started - waiting > startup, text
    assert not os.path.exists(other_dir)
    for rank in range(2):
        resumed = load(out, rank)
        assert int(resumed['start_step']) == step
        np.testing.assert_allclose(resumed['global_loss'],
                                   uninterrupted[rank]['global_loss'][step:], rtol=1e-6)
        for name in variable_names(uninterrupted[rank]):
            np.testing.assert_allclose(resumed[name], uninterrupted[rank][name], rtol=1e-6,
                                       atol=1e-7, err_msg='worker %d: %s' % (rank, name))


STARTUP_TIMEOUT = 3.0
HANG_TIMEOUT = 6.0


@pytest.fixture(scope='module')
def startup_failures():
    """Worker 1 alone, twice at the same time: its leader (worker 0) is

    * ``missing``: not listening at all;
    * ``mute``: a TCP listener that accepts connections but never speaks gRPC,
      so the peer check passes and TensorFlow then waits forever (as when the
      leader dies right after the check): the watchdog must end the process.
    """
    from tf1_syncbn.launch import free_ports
    mute = socket.socket()
    mute.bind(('localhost', 0))
    mute.listen(8)
    try:
        launchers = {
            'missing': Launcher(job_argv('--startup-timeout', STARTUP_TIMEOUT), 2,
                                env=job_env(), output=None, tasks=[1]),
            # The watchdog's limit: hang_timeout + restore_timeout = HANG_TIMEOUT.
            'mute': Launcher(job_argv('--startup-timeout', STARTUP_TIMEOUT, '--hang-timeout',
                                      HANG_TIMEOUT - 2, '--restore-timeout', 2), 2,
                             env=job_env(),
                             output=None, tasks=[1],
                             addresses=['localhost:%d' % mute.getsockname()[1],
                                        'localhost:%d' % free_ports(1)[0]])}
        for launcher in launchers.values():
            launcher.start()
        statuses = {name: launcher.wait(timeout=120) for name, launcher in launchers.items()}
    finally:
        mute.close()
    return {name: (launchers[name], statuses[name]) for name in launchers}


def _elapsed_until(launcher, marker):
    """Seconds from worker 1's 'starting the session' line to its first line containing marker."""
    lines, times = launcher.lines[1], launcher.times[1]
    started = [t for t, line in zip(times, lines) if 'starting the session' in line]
    found = [(t, line) for t, line in zip(times, lines) if marker in line]
    assert started and found, output(launcher)
    return found[0][0] - started[0], found[0][1]


@pytest.mark.once(reason=ONCE)
def test_a_worker_missing_at_startup_is_named_within_the_startup_timeout(startup_failures):
    launcher, status = startup_failures['missing']
    assert status == 1, output(launcher)
    elapsed, line = _elapsed_until(launcher, 'ERROR')
    assert 'worker 0 (%s) did not answer' % launcher.addresses[0] in line, output(launcher)
    assert elapsed < STARTUP_TIMEOUT + 5, output(launcher)
    assert_no_process_left(launcher)


@pytest.mark.once(reason=ONCE)
def test_a_start_up_that_tensorflow_blocks_ends_by_the_watchdog(startup_failures):
    from tf1_syncbn.distributed import EXIT_STARTUP_HANG
    launcher, status = startup_failures['mute']
    assert status == EXIT_STARTUP_HANG, output(launcher)
    elapsed, line = _elapsed_until(launcher, 'session start-up still blocked')
    assert HANG_TIMEOUT - 0.5 < elapsed < HANG_TIMEOUT + 5, output(launcher)
    assert_no_process_left(launcher)


@pytest.fixture(scope='module')
def stale_leader():
    """Worker 1 killed, and restarted at once while the chief still runs the first start.

    The chief pauses between steps 1 and 2 (as a long save would), so it
    has not noticed the loss when the restarted worker 1 reaches it (an
    outside supervisor that restarts a worker at once).
    """
    first = Launcher(job_argv('--steps', STEPS, '--pause', 60, '--pause-after', 1), 2,
                     env=job_env(), output=None, grace=1, kill_after=1).start()
    deadline = time.time() + 180
    while not any('pausing' in line for line in list(first.lines[0])):
        assert time.time() < deadline and first.procs[0].poll() is None, output(first)
        time.sleep(0.05)
    os.kill(first.pids[1], signal.SIGKILL)
    restarted = Launcher(job_argv('--steps', STEPS), 2, env=job_env(), output=None,
                         addresses=first.addresses, tasks=[1]).start()
    status = restarted.wait(timeout=120)
    chief_alive = first.procs[0].poll() is None
    first.request_stop(('the test ends it', 0))
    first.wait(timeout=30)
    return dict(launcher=restarted, status=status, chief_alive=chief_alive)


@pytest.mark.once(reason=ONCE)
def test_a_restarted_worker_that_meets_the_previous_chief_fails_naming_it(stale_leader):
    launcher = stale_leader['launcher']
    text = output(launcher)
    assert stale_leader['chief_alive'] and stale_leader['status'] == 1, text
    elapsed, line = _elapsed_until(launcher, 'ERROR')
    assert ('worker 0 (%s) still runs the previous start of the job' % launcher.addresses[0]
            in line), text
    assert elapsed < 30, text
    assert_no_process_left(launcher)

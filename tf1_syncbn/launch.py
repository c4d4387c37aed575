"""Starts local worker processes, each with its own ``TF_CONFIG``, and never leaves one behind.

Command line (any program that reads ``TF_CONFIG``, for example one that calls
:func:`tf1_syncbn.distributed.setup_cluster`)::

    python -m tf1_syncbn.launch --workers 2 -- python train.py --towers 2

Each worker gets a free localhost port and ``TF_CONFIG`` =
``{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": i}}``,
and runs in its own process group. Its output is relayed line by line,
prefixed with ``[worker i]``.

With ``--gpus-per-worker K``, worker ``i`` also gets ``CUDA_VISIBLE_DEVICES``
= GPUs ``i*K`` to ``i*K+K-1``, so that local workers never share a GPU
(:func:`tf1_syncbn.distributed.setup_cluster` with ``device_type='GPU'`` then
uses the first ``towers`` of them). When the launcher's own environment sets
``CUDA_VISIBLE_DEVICES``, the workers split that list instead (positions
``i*K`` to ``i*K+K-1`` of it), and a list too short for every worker is an
error before any worker starts.

When a worker exits with a non-zero status (or is killed), the others get
``--grace`` seconds (default 30) to fail on their own (they do within their
collective timeout, and say which worker was lost); then every process group
still alive gets SIGTERM and, ``--kill-after`` seconds later (default 5),
SIGKILL. SIGINT, SIGTERM or
SIGHUP to the launcher stop every worker the same way. On Linux each worker
also gets SIGKILL if the launcher itself dies (``PR_SET_PDEATHSIG``). The exit
status is 0 when every worker exited with 0, else the first failure's status
(128 + signal number for a signal; 124 when ``--timeout`` seconds, which
bound the whole job, expired). ``--gpus-per-worker K`` is described above.

With ``--max-restarts N`` (default 0), a failed worker makes the launcher
stop the others as above and then start every worker again, up to ``N``
times (:mod:`tf1_syncbn.restarts`): each worker's environment then also has
``TF1_SYNCBN_RESTART_COUNT`` (0 at the first start, ``k`` at the ``k``-th
restart) and ``TF1_SYNCBN_MAX_RESTARTS``, and workers started on free ports
get new ones. The restarted workers resume from the chief's latest complete
checkpoint (:class:`tf1_syncbn.distributed.WorkerSession`). The launcher
logs each restart (the worker, its exit cause, and the step and checkpoint
the chief resumed from); once the job has failed ``N + 1`` times it stops
with an error naming every restart's cause, and the last failure's status.
A stop (a signal to the launcher, ``--timeout``) is never followed by a
restart. See docs/restarts.md.

This module imports nothing from TensorFlow; ``python path/to/launch.py``
works without importing the package.
"""

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

if __package__:
    from tf1_syncbn.restarts import RestartLoop, describe_exit, exit_status, restart_env
else:   # python path/to/launch.py: the module next to this file, without the package
    from restarts import RestartLoop, describe_exit, exit_status, restart_env

__all__ = ['Launcher', 'launch', 'free_ports', 'tf_config', 'gpu_assignment', 'main']

DEFAULT_GRACE = 30.0
DEFAULT_KILL_AFTER = 5.0
EXIT_TIMEOUT = 124


def free_ports(n, host='localhost'):
    """``n`` TCP ports that are free on ``host`` now (the OS picks them)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(addresses, index):
    """The ``TF_CONFIG`` string of worker ``index`` in a cluster of ``addresses``."""
    return json.dumps({'cluster': {'worker': list(addresses)},
                       'task': {'type': 'worker', 'index': index}})


def gpu_assignment(num_workers, gpus_per_worker, visible=None):
    """The ``CUDA_VISIBLE_DEVICES`` value of each of ``num_workers`` local workers.

    Args:
      num_workers: how many workers.
      gpus_per_worker: GPUs per worker (``K``).
      visible: the launcher's own ``CUDA_VISIBLE_DEVICES`` (None when unset):
        worker ``i`` gets entries ``i*K`` to ``i*K+K-1`` of it; without it,
        GPUs ``i*K`` to ``i*K+K-1``.

    Returns:
      A list of strings such as ``['0,1', '2,3']``.

    Raises:
      ValueError: ``gpus_per_worker`` not a positive int, or ``visible``
        lists fewer than ``num_workers * gpus_per_worker`` GPUs.
    """
    k = gpus_per_worker
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError('Launcher: gpus_per_worker must be a positive int, got %r.' % (k,))
    needed = num_workers * k
    if visible is None:
        ids = [str(i) for i in range(needed)]
    else:
        ids = [v.strip() for v in visible.split(',') if v.strip()]
        if len(ids) < needed:
            raise ValueError(
                'Launcher: %d workers x %d GPUs per worker need %d GPUs, but '
                'CUDA_VISIBLE_DEVICES=%r lists %d. Lower --gpus-per-worker or --workers, or '
                'unset CUDA_VISIBLE_DEVICES.' % (num_workers, k, needed, visible, len(ids)))
    return [','.join(ids[i * k:(i + 1) * k]) for i in range(num_workers)]


def _die_with_parent(parent):
    """preexec_fn: SIGKILL this child when the launcher dies (Linux)."""
    def set_pdeathsig():
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:   # the launcher died before prctl
            os._exit(1)
    return set_pdeathsig


class Launcher(object):
    """Runs ``argv`` as ``num_workers`` local workers (see the module docstring).

    Args:
      argv: the command of every worker (a list of strings).
      num_workers: how many workers.
      env: the base environment (default ``os.environ``); each worker adds its
        ``TF_CONFIG`` and ``PYTHONUNBUFFERED=1``.
      cwd: the workers' working directory.
      grace: seconds the other workers get to exit on their own after one fails.
      kill_after: seconds between SIGTERM and SIGKILL.
      output: where relayed lines go (default ``sys.stdout``); None keeps them
        only in :attr:`lines`.
      addresses: ``host:port`` of each worker; default: free localhost ports.
      tasks: the workers to start (default all); the others are expected to
        be started elsewhere (or, in tests, to be missing).
      gpus_per_worker: None, or K: worker ``i`` (its task index) gets
        ``CUDA_VISIBLE_DEVICES`` from :func:`gpu_assignment` (GPUs ``i*K`` to
        ``i*K+K-1``, or that slice of the base environment's own
        ``CUDA_VISIBLE_DEVICES``).
      on_line: None, or ``on_line(worker, line)``, called (from a reader
        thread) for each line a worker prints.

    Attributes:
      lines: per worker, every line it printed (stdout and stderr together).
      times: per worker, the ``time.time()`` at which each line arrived.
      exit_codes: per started worker (in the order of ``tasks``), its
        ``returncode`` once it exited.
      failed: ``(worker, returncode)`` of the first failure, or None.
      stopped: ``(reason, exit status)`` when :meth:`wait` stopped the workers
        (:meth:`request_stop`, or its timeout), else None.
    """

    def __init__(self, argv, num_workers, env=None, cwd=None, grace=DEFAULT_GRACE,
                 kill_after=DEFAULT_KILL_AFTER, output=sys.stdout, addresses=None, tasks=None,
                 gpus_per_worker=None, on_line=None):
        if isinstance(argv, str) or not argv:
            raise ValueError('Launcher: argv must be a non-empty list of strings, got %r.'
                             % (argv,))
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError('Launcher: num_workers must be a positive int, got %r.'
                             % (num_workers,))
        self.argv = list(argv)
        self.num_workers = num_workers
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.grace = float(grace)
        self.kill_after = float(kill_after)
        self.output = output
        self.addresses = list(addresses) if addresses else \
            ['localhost:%d' % p for p in free_ports(num_workers)]
        if len(self.addresses) != num_workers:
            raise ValueError('Launcher: %d addresses for %d workers.'
                             % (len(self.addresses), num_workers))
        self.tasks = list(range(num_workers)) if tasks is None else list(tasks)
        if not self.tasks or any(not 0 <= t < num_workers for t in self.tasks):
            raise ValueError('Launcher: tasks must be a non-empty list of indices in [0, %d), '
                             'got %r.' % (num_workers, tasks))
        self.gpus = None
        if gpus_per_worker is not None:
            self.gpus = gpu_assignment(num_workers, gpus_per_worker,
                                       self.env.get('CUDA_VISIBLE_DEVICES'))
        self.procs = []
        self.lines = [[] for _ in range(num_workers)]
        self.times = [[] for _ in range(num_workers)]
        self.exit_codes = [None] * len(self.tasks)
        self.failed = None
        self.stopped = None
        self.on_line = on_line
        self._lock = threading.Lock()
        self._readers = []
        self._stop_reason = None

    @property
    def pids(self):
        """The process ids, in the order of ``tasks``."""
        return [p.pid for p in self.procs]

    def say(self, text):
        self._emit('[launcher] %s' % text)

    def _emit(self, line):
        if self.output is not None:
            with self._lock:
                self.output.write(line + '\n')
                self.output.flush()

    def start(self):
        """Starts every worker; returns self."""
        parent = os.getpid()
        for i in self.tasks:
            env = dict(self.env, TF_CONFIG=tf_config(self.addresses, i), PYTHONUNBUFFERED='1')
            if self.gpus is not None:
                env['CUDA_VISIBLE_DEVICES'] = self.gpus[i]
            preexec = _die_with_parent(parent) if sys.platform.startswith('linux') else None
            proc = subprocess.Popen(self.argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=preexec)
            self.procs.append(proc)
            reader = threading.Thread(target=self._relay, args=(i, proc), daemon=True)
            reader.start()
            self._readers.append(reader)
            self.say('worker %d: pid %d, %s%s' % (
                i, proc.pid, self.addresses[i],
                ', CUDA_VISIBLE_DEVICES=%s' % self.gpus[i] if self.gpus is not None else ''))
        return self

    def _relay(self, i, proc):
        for raw in iter(proc.stdout.readline, b''):
            line = raw.decode('utf-8', 'replace').rstrip('\n')
            self.times[i].append(time.time())
            self.lines[i].append(line)
            self._emit('[worker %d] %s' % (i, line))
            if self.on_line is not None:
                self.on_line(i, line)
        proc.stdout.close()

    def request_stop(self, reason):
        """Asks :meth:`wait` to stop every worker (safe from a signal handler)."""
        self._stop_reason = reason

    def _poll(self):
        for k, proc in enumerate(self.procs):
            i = self.tasks[k]
            if self.exit_codes[k] is None and proc.poll() is not None:
                code = proc.returncode
                self.exit_codes[k] = code
                if code != 0 and self.failed is None:
                    self.failed = (i, code)
                    others = [j for j, c in enumerate(self.exit_codes) if c is None]
                    self.say('worker %d %s%s' % (
                        i, describe_exit(code),
                        '; the others get %g s to exit on their own, then they are stopped'
                        % self.grace if others else ''))
                elif code == 0:
                    self.say('worker %d exited with status 0' % i)
        return all(c is not None for c in self.exit_codes)

    def _signal_groups(self, sig, only_alive=True):
        for i, proc in enumerate(self.procs):
            if only_alive and self.exit_codes[i] is not None:
                continue
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self):
        """SIGTERM to every live worker's process group, SIGKILL after ``kill_after`` s."""
        if self._poll():
            return
        self._signal_groups(signal.SIGTERM)
        self._signal_groups(signal.SIGCONT)   # a stopped (frozen) worker can then act on it
        deadline = time.time() + self.kill_after
        while time.time() < deadline:
            if self._poll():
                return
            time.sleep(0.05)
        self._signal_groups(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        self._poll()

    def wait(self, timeout=None):
        """Waits for every worker; stops the rest when one fails. Returns the exit status."""
        deadline = None if timeout is None else time.time() + timeout
        failed_at = None
        stopped = None
        while not self._poll():
            now = time.time()
            if self._stop_reason is not None:
                stopped = self._stop_reason
                self.say('%s: stopping every worker' % stopped[0])
                break
            if deadline is not None and now >= deadline:
                stopped = ('timeout of %g s expired' % timeout, EXIT_TIMEOUT)
                self.say('%s: stopping every worker' % stopped[0])
                break
            if self.failed is not None:
                failed_at = failed_at or now
                if now - failed_at >= self.grace:
                    self.say('stopping the workers still running %g s after worker %d failed'
                             % (self.grace, self.failed[0]))
                    break
            time.sleep(0.05)
        self.stopped = stopped
        self.stop()
        # Anything a worker left in its process group (it had its own session).
        self._signal_groups(signal.SIGKILL, only_alive=False)
        for reader in self._readers:
            reader.join(timeout=5)
        if stopped is not None:
            return stopped[1]
        if self.failed is not None:
            return exit_status(self.failed[1]) or 1
        return 0


def launch(argv, num_workers, timeout=None, max_restarts=0, restarts=None, **kwargs):
    """Starts ``num_workers`` workers running ``argv`` and waits for them.

    In the main thread, SIGINT/SIGTERM/SIGHUP stop every worker and the
    launcher returns 128 + the signal number.

    Args:
      argv, num_workers, **kwargs: as :class:`Launcher` (a new one per
        attempt: without ``addresses``, each attempt gets new free ports).
      timeout: seconds before every worker is stopped (status 124), every
        restart included; None waits.
      max_restarts: how many times every worker is started again after a
        failure (see the module docstring and :mod:`tf1_syncbn.restarts`).
      restarts: None, or a list that receives a
        :class:`~tf1_syncbn.restarts.Restart` per restart.

    Returns:
      The exit status (see the module docstring).
    """
    base_env = dict(os.environ if kwargs.get('env') is None else kwargs['env'])

    def start_attempt(attempt, on_line):
        env = dict(base_env, **restart_env(attempt, max_restarts)) if max_restarts else base_env
        return Launcher(argv, num_workers, on_line=on_line, **dict(kwargs, env=env)).start()

    job = RestartLoop(start_attempt, max_restarts, timeout=timeout)
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        def on_signal(signum, frame):
            del frame
            job.request_stop(('received %s' % signal.Signals(signum).name, 128 + signum))
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, on_signal)
    try:
        return job.run()
    finally:
        job.stop()
        if restarts is not None:
            restarts.extend(job.restarts)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def build_parser():
    """The command line's parser (also for its ``--help`` before the package loads)."""
    parser = argparse.ArgumentParser(
        prog='python -m tf1_syncbn.launch',
        description='Run a command as N local workers, each with its own TF_CONFIG; stop all '
                    'of them when one fails.')
    parser.add_argument('--workers', type=int, required=True, help='number of local workers')
    parser.add_argument('--grace', type=float, default=DEFAULT_GRACE,
                        help='seconds the others get to exit on their own after one fails')
    parser.add_argument('--kill-after', type=float, default=DEFAULT_KILL_AFTER,
                        help='seconds between SIGTERM and SIGKILL')
    parser.add_argument('--timeout', type=float,
                        help='stop every worker after this many s (restarts included)')
    parser.add_argument('--max-restarts', type=int, default=0, metavar='N',
                        help='when a worker fails, stop the others and start every worker '
                             'again, up to N times (they resume from the chief\'s latest '
                             'checkpoint)')
    parser.add_argument('--gpus-per-worker', type=int, metavar='K',
                        help='give worker i the GPUs i*K..i*K+K-1 (CUDA_VISIBLE_DEVICES; a '
                             'slice of the launcher\'s own CUDA_VISIBLE_DEVICES when set)')
    parser.add_argument('command', nargs=argparse.REMAINDER,
                        help='the worker command (after --)')
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ['--'] else args.command
    if not command:
        parser.error('give the worker command after --')
    if args.workers < 1:
        parser.error('--workers must be at least 1')
    if args.max_restarts < 0:
        parser.error('--max-restarts must be at least 0')
    if args.gpus_per_worker is not None:
        try:
            gpu_assignment(args.workers, args.gpus_per_worker,
                           os.environ.get('CUDA_VISIBLE_DEVICES'))
        except ValueError as e:
            parser.error(str(e).replace('Launcher: ', '').replace('gpus_per_worker',
                                                                 '--gpus-per-worker'))
    return launch(command, args.workers, timeout=args.timeout, max_restarts=args.max_restarts,
                  grace=args.grace,
                  kill_after=args.kill_after, gpus_per_worker=args.gpus_per_worker)


if __name__ == '__main__':
    sys.exit(main())

"""The launcher: ``num_workers`` local worker processes, each under its supervisor.

See :mod:`tf1_syncbn.launch` for what it does; :class:`Launcher` runs one
attempt of the job, :func:`launch` the whole job (its restarts:
:mod:`~tf1_syncbn.launch.restarts`); each worker's process is started and
watched by :mod:`~tf1_syncbn.launch.supervisor`. The standard library only.
"""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

if __package__:
    from tf1_syncbn.launch.restarts import (EXIT_TIMEOUT, RestartLoop, WorkerExit,
                                            describe_exit, exit_status, first_failure,
                                            restart_env)
    from tf1_syncbn.launch import supervisor
else:   # run by path (python path/to/tf1_syncbn/launch): the modules next to this file
    from restarts import (EXIT_TIMEOUT, RestartLoop, WorkerExit, describe_exit, exit_status,
                          first_failure, restart_env)
    import supervisor

__all__ = ['Launcher', 'launch', 'free_ports', 'tf_config', 'gpu_assignment',
           'DEFAULT_GRACE', 'DEFAULT_KILL_AFTER', 'SUPERVISOR_START_TIMEOUT', 'REPORT_TIMEOUT']

DEFAULT_GRACE = 30.0
DEFAULT_KILL_AFTER = 5.0
#: Seconds a supervisor gets to start its worker and report the worker's pid.
SUPERVISOR_START_TIMEOUT = 60.0
#: Seconds the launcher waits for the report of a worker that has ended.
REPORT_TIMEOUT = 5.0


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


def _killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _ended(pid):
    """Whether process ``pid`` has ended: gone, or a zombie not reaped yet (Linux; False
    elsewhere, where only the supervisor's report tells)."""
    if not sys.platform.startswith('linux'):
        return False
    try:
        with open('/proc/%d/stat' % pid) as f:
            return f.read().rsplit(')', 1)[-1].split()[0] in ('Z', 'X')
    except (OSError, IndexError):
        return True         # reaped


class Launcher(object):
    """Runs ``argv`` as ``num_workers`` local workers (see :mod:`tf1_syncbn.launch`).

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
      exits: per started worker (in the order of ``tasks``), its
        :class:`~tf1_syncbn.launch.restarts.WorkerExit` once it exited (how, when,
        whether the launcher had stopped it; its last line once :meth:`wait`
        returned), else None.
      failed: ``(worker, returncode)`` of the root cause: of the workers that
        failed on their own (not stopped by the launcher), the first to end
        (:func:`~tf1_syncbn.launch.restarts.first_failure` of ``exits``); None when
        none failed.
      stopped: ``(reason, exit status)`` when :meth:`wait` stopped the workers
        (:meth:`request_stop`, or its timeout), else None.
      procs: the ``Popen`` of each worker's supervisor (in the order of
        ``tasks``); ``poll()`` is None while the worker runs.
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
        self.exits = [None] * len(self.tasks)
        self.failed = None
        self.stopped = None
        self.on_line = on_line
        self._lock = threading.Lock()
        self._readers = []
        self._stop_reason = None
        self._worker_pids = []
        self._reports = []          # per worker: the read end of its supervisor's report pipe
        self._reported = []         # per worker: what was read from it so far
        self._stop_sent = [None] * len(self.tasks)
        self._started = None

    @property
    def pids(self):
        """The workers' process ids (each its process group's too), in the order of ``tasks``."""
        return list(self._worker_pids)

    def say(self, text):
        self._emit('[launcher] %s' % text)

    def _emit(self, line):
        if self.output is not None:
            with self._lock:
                self.output.write(line + '\n')
                self.output.flush()

    def start(self):
        """Starts every worker, each under its supervisor; returns self.

        Raises:
          OSError: the command cannot be run (as ``subprocess.Popen`` raises
            it: ``FileNotFoundError``, ...); no worker is left running.
          RuntimeError: a supervisor did not report its worker's pid within
            :data:`SUPERVISOR_START_TIMEOUT` s, or ended before.

        Hangs: up to :data:`SUPERVISOR_START_TIMEOUT` s.
        """
        parent = os.getpid()
        self._started = time.time()
        try:
            for i in self.tasks:        # every supervisor starts, then each reports its pid
                env = dict(self.env, TF_CONFIG=tf_config(self.addresses, i),
                           PYTHONUNBUFFERED='1')
                if self.gpus is not None:
                    env['CUDA_VISIBLE_DEVICES'] = self.gpus[i]
                self._start_supervisor(i, env, parent)
            for k, i in enumerate(self.tasks):
                self._worker_pids.append(self._read_pid(k))
                self.say('worker %d: pid %d, %s%s' % (
                    i, self._worker_pids[-1], self.addresses[i],
                    ', CUDA_VISIBLE_DEVICES=%s' % self.gpus[i] if self.gpus is not None else ''))
        except BaseException:
            for pid in self._worker_pids:
                _killpg(pid, signal.SIGKILL)
            for proc, report in zip(self.procs, self._reports):
                _killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                os.close(report)
            raise
        return self

    def _start_supervisor(self, i, env, parent):
        preexec = supervisor.die_with_parent(parent) if sys.platform.startswith('linux') else None
        report, write_end = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, '-E', '-S', supervisor.PATH, str(write_end), '--'] +
                self.argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=preexec, pass_fds=(write_end,))
        except BaseException:
            os.close(report)
            raise
        finally:
            os.close(write_end)
        self.procs.append(proc)
        self._reports.append(report)
        self._reported.append(b'')
        reader = threading.Thread(target=self._relay, args=(i, proc), daemon=True)
        reader.start()
        self._readers.append(reader)

    def _read_pid(self, k):
        """The pid that the ``k``-th started worker's supervisor reported (:func:`supervise`)."""
        report, i = self._reports[k], self.tasks[k]
        deadline = self._started + SUPERVISOR_START_TIMEOUT
        while b'\n' not in self._reported[k]:
            left = deadline - time.time()
            if left <= 0 or not select.select([report], [], [], left)[0]:
                raise RuntimeError('Launcher: the supervisor of worker %d did not start it within '
                                   '%g s.' % (i, SUPERVISOR_START_TIMEOUT))
            chunk = os.read(report, 4096)
            if not chunk:
                break
            self._reported[k] += chunk
        words = self._reported[k].split(b'\n', 1)[0].decode('utf-8', 'replace').split(' ', 2)
        if words[0] == 'pid':
            return int(words[1])
        if words[0] == 'error' and len(words) == 3:
            if int(words[1]):
                raise OSError(int(words[1]), words[2], self.argv[0])
            raise RuntimeError('Launcher: cannot start worker %d (%r): %s'
                               % (i, self.argv, words[2]))
        raise RuntimeError('Launcher: the supervisor of worker %d ended (%s) before it started '
                           'the worker; its output is above.'
                           % (i, describe_exit(self.procs[k].wait())))

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
        """Records the workers that ended since the last call, logs them; True when all have."""
        seen = time.time()
        new = [k for k, proc in enumerate(self.procs)
               if self.exits[k] is None and proc.poll() is not None]
        for k in new:
            self._record(k, seen)
        if any(self.exits[k].failed for k in new):
            new += self._settle()
        if new:
            self._announce(new)
        return all(e is not None for e in self.exits)

    def _record(self, k, seen):
        """Records the ``k``-th worker's :class:`WorkerExit` from its supervisor's report (the
        supervisor has ended: its pipe holds the rest); ``seen``: when the launcher noticed."""
        report = self._reports[k]
        os.set_blocking(report, False)
        try:
            while True:
                chunk = os.read(report, 4096)
                if not chunk:
                    break
                self._reported[k] += chunk
        except BlockingIOError:     # a writer left (never, unless killed mid-fork): no more
            pass
        os.close(report)
        code, ended, exact = self.procs[k].returncode, seen, False
        for line in self._reported[k].decode('utf-8', 'replace').splitlines():
            words = line.split()
            if len(words) == 3 and words[0] == 'exit':
                code, ended, exact = int(words[1]), float(words[2]), True
        stop = self._stop_sent[k]
        self.exit_codes[k] = code
        self.exits[k] = WorkerExit(self.tasks[k], code, ended, exact=exact,
                                   stopped=stop is not None and ended >= stop)

    def _settle(self):
        """Records every worker that has ended but whose supervisor has not reported yet."""
        late = []
        for k, proc in enumerate(self.procs):
            if self.exits[k] is None and _ended(self._worker_pids[k]):
                try:
                    proc.wait(REPORT_TIMEOUT)
                except subprocess.TimeoutExpired:
                    continue
                self._record(k, time.time())
                late.append(k)
        return late

    def _announce(self, new):
        """Logs the workers ``new`` that ended: the root cause first, then consequences."""
        root = first_failure(self.exits)
        announced = self.failed
        if root is not None:
            self.failed = (root.worker, root.code)
        for k in sorted(new, key=lambda k: (self.exits[k].ended_at, self.exits[k].worker)):
            e = self.exits[k]
            if e.stopped:
                self.say('worker %d stopped by the launcher (%s)' % (e.worker, e.cause))
            elif not e.failed:
                self.say('worker %d exited with status 0' % e.worker)
            elif e is not root:
                self.say(e.after(root))
            elif announced is None:
                running = any(x is None for x in self.exits)
                self.say('%s%s' % (e.describe(), '; the others get %g s to exit on their own, '
                                   'then they are stopped' % self.grace if running else ''))
            else:       # noticed after a failure that ended later: the root cause after all
                self.say('%s; it ended %.2f s before worker %d failed, which is then a '
                         'consequence' % (e.describe(), self.exits[self.tasks.index(
                             announced[0])].ended_at - e.ended_at, announced[0]))

    def _signal_groups(self, sig, only_alive=True):
        """``sig`` to each worker's process group (alive ones only: marked stopped, but
        for SIGCONT, which also goes to the supervisors, in case they were frozen)."""
        now = time.time()
        for k, pid in enumerate(self._worker_pids):
            if only_alive and self.exits[k] is not None:
                continue
            if only_alive and sig != signal.SIGCONT and self._stop_sent[k] is None:
                self._stop_sent[k] = now
            _killpg(pid, sig)
            if sig == signal.SIGCONT:
                _killpg(self.procs[k].pid, sig)

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
            try:
                proc.wait(max(self.kill_after, 1.0))    # the supervisor reports, then ends
            except subprocess.TimeoutExpired:
                _killpg(proc.pid, signal.SIGKILL)
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
        for e in self.exits:
            if e is not None:
                lines = self.lines[e.worker]
                e.last_line = lines[-1] if lines else None
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
        failure (see :mod:`tf1_syncbn.launch` and :mod:`~tf1_syncbn.launch.restarts`).
      restarts: None, or a list that receives a
        :class:`~tf1_syncbn.launch.restarts.Restart` per restart.

    Returns:
      The exit status (see :mod:`tf1_syncbn.launch`).
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

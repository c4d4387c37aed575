"""Restarts of a multi-worker job: ``python -m tf1_syncbn.launch --max-restarts N``.

When a worker fails (a non-zero exit status, or a signal), the launcher
stops the others, then starts every worker again, up to ``N`` times; the
restarted workers resume from the chief's latest complete checkpoint
(:class:`tf1_syncbn.distributed.WorkerSession` restores it on the chief and
broadcasts it). After ``N`` restarts the next failure ends the job with an
error that names the cause of every restart. This module holds the policy,
not the processes (those are :class:`tf1_syncbn.launch.Launcher`'s):

* :class:`RestartLoop` runs one attempt after another until one succeeds,
  the launcher is stopped (a signal, the job's timeout) or the restarts run
  out;
* each worker's environment names its attempt (:func:`restart_env`):
  ``TF1_SYNCBN_RESTART_COUNT`` (0 at the first start, ``k`` at the ``k``-th
  restart) and ``TF1_SYNCBN_MAX_RESTARTS``, as torchrun's
  ``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_MAX_RESTARTS``;
* with these set, the chief's :class:`~tf1_syncbn.distributed.WorkerSession`
  prints a :func:`start_line` at every start (the step and checkpoint it
  resumed from), which the launcher logs for each restart
  (:func:`parse_start_line`) and records in :attr:`Restart.resumed`;
* which worker caused a failed attempt (:func:`first_failure`): the one
  that *ended* first, by the end time each worker's supervisor recorded
  (:class:`WorkerExit`), not the one the launcher happened to notice first.
  When one worker dies, its peers fail on their own within seconds (their
  collectives abort); those are :func:`consequences`, named as such
  (:meth:`WorkerExit.after`). Each :class:`Restart` records both.

This module imports nothing (no TensorFlow, no other module of the package).
"""

import dataclasses
import os
import re
import signal
import time
import typing

__all__ = ['RestartLoop', 'Restart', 'WorkerExit', 'restart_env', 'restart_count',
           'start_line', 'parse_start_line', 'exit_status', 'describe_exit', 'first_failure',
           'consequences', 'shorten', 'RESTART_COUNT_ENV', 'MAX_RESTARTS_ENV']

#: The attempt of this process: 0 at the first start, ``k`` at the ``k``-th restart.
RESTART_COUNT_ENV = 'TF1_SYNCBN_RESTART_COUNT'
#: The launcher's ``--max-restarts``.
MAX_RESTARTS_ENV = 'TF1_SYNCBN_MAX_RESTARTS'
#: The exit status of a job stopped by its timeout (``--timeout``), as ``timeout(1)``'s.
EXIT_TIMEOUT = 124

_START = re.compile(r'^tf1_syncbn: (?P<worker>.+?) (?:resumed|started) at step (?P<step>\d+)'
                    r'(?: from (?P<checkpoint>.+)|: no checkpoint(?: in (?P<directory>.+))?)$')


def exit_status(code):
    """The exit status of a ``Popen.returncode``: a signal ``s`` (``-s``) becomes ``128 + s``."""
    return 128 - code if code < 0 else code


def describe_exit(code):
    """``'killed by SIGKILL'`` or ``'exited with status 3'``, from a ``Popen.returncode``."""
    if code < 0:
        try:
            return 'killed by %s' % signal.Signals(-code).name
        except ValueError:
            return 'killed by signal %d' % -code
    return 'exited with status %d' % code


def shorten(line, width=200):
    """``line``, or its start and end joined by ``' ... '`` when it is longer than ``width``.

    Each part is cut at a word boundary (a word longer than its part is the
    only thing ever cut inside). A third of ``width`` goes to the start (an
    error's type, which worker speaks), the rest to the end (an error's
    details: ``not answering: worker 1 (localhost:1234)``).
    """
    if len(line) <= width:
        return line
    keep = max(width - 5, 2)
    head, tail = line[:keep // 3], line[len(line) - (keep - keep // 3):]
    if not line[len(head)].isspace() and any(c.isspace() for c in head[1:]):
        head = head[:max(i for i, c in enumerate(head) if c.isspace())]
    if not line[len(line) - len(tail) - 1].isspace() and any(c.isspace() for c in tail[:-1]):
        tail = tail[min(i for i, c in enumerate(tail) if c.isspace()):]
    return '%s ... %s' % (head.rstrip(), tail.lstrip())


@dataclasses.dataclass(eq=False)
class WorkerExit:
    """How and when one worker of an attempt ended.

    Attributes:
      worker: its task index.
      code: its ``Popen.returncode`` (``-9`` for SIGKILL).
      ended_at: the ``time.time()`` at which it ended: as its supervisor
        recorded it (``exact``), else when the launcher noticed it.
      exact: whether ``ended_at`` is the supervisor's record (it is unless
        the supervisor itself was killed).
      stopped: whether the launcher had signalled it to stop (a failure
        elsewhere, ``--timeout``, a signal to the launcher) before it ended:
        then it did not fail on its own.
      last_line: its last line of output (None when it printed none, or
        before the launcher has read it all).
    """

    worker: int
    code: int
    ended_at: float
    exact: bool = True
    stopped: bool = False
    last_line: typing.Optional[str] = None

    @property
    def cause(self):
        """``'killed by SIGKILL'``, ``'exited with status 1'``, ..."""
        return describe_exit(self.code)

    @property
    def exit_status(self):
        return exit_status(self.code)

    @property
    def failed(self):
        """A non-zero status or a signal, not caused by the launcher's stop."""
        return self.code != 0 and not self.stopped

    def describe(self):
        """``'worker 1 killed by SIGKILL'``."""
        return 'worker %d %s' % (self.worker, self.cause)

    def after(self, root):
        """``'worker 0 exited with status 1, 0.84 s after worker 1 was killed by SIGKILL'``."""
        return '%s, %.2f s after worker %d %s' % (
            self.describe(), self.ended_at - root.ended_at, root.worker,
            'was ' + root.cause if root.code < 0 else root.cause)

    def to_dict(self, root=None):
        """JSON-ready: ``worker``, ``cause``, ``exit_status``, ``ended_at``, ``last_line``, and
        ``seconds_after`` the ``root`` cause when one is given."""
        out = {'worker': self.worker, 'cause': self.cause, 'exit_status': self.exit_status,
               'ended_at': self.ended_at, 'last_line': self.last_line}
        if root is not None:
            out['seconds_after'] = round(self.ended_at - root.ended_at, 3)
        return out

    def __repr__(self):
        return 'WorkerExit(%d, %d, %.3f%s%s)' % (self.worker, self.code, self.ended_at,
                                                 '' if self.exact else ', exact=False',
                                                 ', stopped=True' if self.stopped else '')


def first_failure(exits):
    """The root cause of a failed attempt: of the workers that failed on their own, the one
    that ended first (the lower task index on a tie); None when none failed.

    Args:
      exits: :class:`WorkerExit` records (None for a worker still running).
    """
    failures = [e for e in exits if e is not None and e.failed]
    return min(failures, key=lambda e: (e.ended_at, e.worker)) if failures else None


def consequences(exits, root):
    """The other workers that failed on their own after ``root`` (in the order they ended)."""
    return sorted((e for e in exits if e is not None and e.failed and e is not root),
                  key=lambda e: (e.ended_at, e.worker))


def restart_env(attempt, max_restarts):
    """The environment variables of every worker of ``attempt`` (0: the first start)."""
    return {RESTART_COUNT_ENV: str(attempt), MAX_RESTARTS_ENV: str(max_restarts)}


def restart_count(environ=None):
    """This process's attempt (``TF1_SYNCBN_RESTART_COUNT``): 0 when unset or not a count."""
    value = (os.environ if environ is None else environ).get(RESTART_COUNT_ENV, '')
    return int(value) if value.strip().isdigit() else 0


def start_line(worker, step, checkpoint=None, directory=None):
    """The line a chief prints at start-up under a restarting launcher.

    Args:
      worker: ``'worker 0 (host:port)'``.
      step: the global step it starts at.
      checkpoint: the checkpoint it restored, or None.
      directory: where it looked for one (None: no checkpoint directory).
    """
    if checkpoint:
        return 'tf1_syncbn: %s resumed at step %d from %s' % (worker, step, checkpoint)
    return 'tf1_syncbn: %s started at step %d: no checkpoint%s' % (
        worker, step, ' in %s' % directory if directory else '')


def parse_start_line(line):
    """``{'step', 'checkpoint', 'directory'}`` of a :func:`start_line`, or None."""
    match = _START.match(line.strip())
    if match is None:
        return None
    return {'step': int(match.group('step')), 'checkpoint': match.group('checkpoint'),
            'directory': match.group('directory')}


class Restart(object):
    """One restart of the job: the failure that caused it and where the chief resumed.

    Attributes:
      number: 1 for the first restart.
      worker: the task index of the worker whose failure caused it (the
        first to fail in its attempt).
      code: that worker's ``Popen.returncode`` (``-9`` for SIGKILL).
      cause: ``'killed by SIGKILL'``, ``'exited with status 1'``, ...
      last_line: the worker's last line of output (None when it printed none).
      resumed: every :func:`parse_start_line` of the chief in the restarted
        attempt, in order (one per :class:`~tf1_syncbn.distributed.WorkerSession`).
      ended_at: the ``time.time()`` at which that worker ended (None when
        unknown).
      consequences: the :class:`WorkerExit` of each other worker that then
        failed on its own (in the order they ended), not stopped by the
        launcher: typically peers whose collectives aborted.
    """

    def __init__(self, number, worker, code, last_line=None, ended_at=None, consequences=()):
        self.number = number
        self.worker = worker
        self.code = code
        self.cause = describe_exit(code)
        self.last_line = last_line
        self.ended_at = ended_at
        self.consequences = list(consequences)
        self.resumed = []

    @classmethod
    def of_attempt(cls, number, exits):
        """The restart caused by an attempt that ended with ``exits`` (its
        :func:`first_failure` and :func:`consequences`), or None when none failed."""
        root = first_failure(exits)
        if root is None:
            return None
        return cls(number, root.worker, root.code, root.last_line, root.ended_at,
                   consequences(exits, root))

    @property
    def exit_status(self):
        return exit_status(self.code)

    def describe(self):
        """``'worker 1 killed by SIGKILL'``, with its last line after an exit status."""
        text = 'worker %d %s' % (self.worker, self.cause)
        if self.code > 0 and self.last_line:
            text += ' (its last line: %r)' % shorten(self.last_line)
        return text

    def to_dict(self):
        """The record as JSON-ready values (the demo writes it into ``metrics.json``).

        ``restart``, ``worker``, ``cause``, ``exit_status``, ``last_line`` and
        ``resumed`` describe the first worker to fail; ``ended_at`` is when it
        ended, and ``consequences`` lists the workers that then failed on their
        own (``worker``, ``cause``, ``exit_status``, ``ended_at``,
        ``seconds_after`` it, ``last_line``).
        """
        root = None if self.ended_at is None else WorkerExit(self.worker, self.code,
                                                             self.ended_at)
        return {'restart': self.number, 'worker': self.worker, 'cause': self.cause,
                'exit_status': self.exit_status, 'last_line': self.last_line,
                'resumed': list(self.resumed), 'ended_at': self.ended_at,
                'consequences': [c.to_dict(root) for c in self.consequences]}


def _describe_start(start):
    if start['checkpoint']:
        return 'resumed at step %d from %s' % (start['step'], start['checkpoint'])
    return 'started at step %d (no checkpoint%s)' % (
        start['step'], ' in %s' % start['directory'] if start['directory'] else '')


def exhausted_message(restarts, final, max_restarts):
    """The error of a job that failed once more after ``max_restarts`` restarts."""
    parts = []
    for r in restarts:
        resumed = ', then '.join(_describe_start(s) for s in r.resumed) or 'no start reported'
        parts.append('restart %d after %s (the chief %s)' % (r.number, r.describe(), resumed))
    return ('the job failed %d times, and --max-restarts is %d: %s%s%s.'
            % (len(restarts) + 1, max_restarts, '; '.join(parts), '; then ' if parts else '',
               final.describe()))


class RestartLoop(object):
    """Runs attempts of a job until one succeeds, the job is stopped, or restarts run out.

    Args:
      start_attempt: ``start_attempt(attempt, on_line)`` starts every worker of
        attempt ``attempt`` (0, 1, ...) and returns the started
        :class:`~tf1_syncbn.launch.Launcher`, which calls ``on_line(worker,
        line)`` for each line a worker prints; once it has waited, its
        ``exits`` (:class:`WorkerExit`, last lines included) say which worker
        failed first.
      max_restarts: how many times every worker may be restarted (>= 0).
      timeout: seconds for the whole job, every attempt included; None waits.

    Attributes:
      restarts: a :class:`Restart` per restart, in order.
      error: the message of a job that failed after ``max_restarts`` restarts, or None.
      current: the launcher of the running (or last) attempt.

    Hangs: never with a ``timeout``; without one, as long as an attempt runs.
    """

    def __init__(self, start_attempt, max_restarts, timeout=None):
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or \
                max_restarts < 0:
            raise ValueError('RestartLoop: max_restarts must be an int >= 0, got %r.'
                             % (max_restarts,))
        self.start_attempt = start_attempt
        self.max_restarts = max_restarts
        self.timeout = timeout
        self.restarts = []
        self.error = None
        self.current = None
        self._stop_reason = None

    def request_stop(self, reason):
        """Stops the running attempt, and restarts none (safe from a signal handler)."""
        self._stop_reason = reason
        if self.current is not None:
            self.current.request_stop(reason)

    def stop(self):
        """Stops every worker of the running attempt now (see ``Launcher.stop``)."""
        if self.current is not None:
            self.current.stop()

    def _say(self, text):
        if self.current is not None:
            self.current.say(text)

    def _on_line(self, attempt):
        def on_line(worker, line):
            if attempt == 0 or worker != 0:
                return
            start = parse_start_line(line)
            if start is not None:
                self.restarts[attempt - 1].resumed.append(start)
                self._say('restart %d: worker 0 %s' % (attempt, _describe_start(start)))
        return on_line

    def run(self):
        """Runs the job; returns its exit status (the last attempt's)."""
        deadline = None if self.timeout is None else time.time() + self.timeout
        attempt = 0
        while True:
            if attempt and self._stop_reason is not None:     # a signal between attempts
                self._say('%s: no restart' % self._stop_reason[0])
                return self._stop_reason[1]
            self.current = self.start_attempt(attempt, self._on_line(attempt))
            if self._stop_reason is not None:       # a signal during the start
                self.current.request_stop(self._stop_reason)
            left = None if deadline is None else max(0.0, deadline - time.time())
            status = self.current.wait(left)
            final = Restart.of_attempt(attempt + 1, self.current.exits)
            if status == 0 or final is None or self.current.stopped is not None:
                return status
            if attempt >= self.max_restarts:
                if self.max_restarts:
                    self.error = exhausted_message(self.restarts, final, self.max_restarts)
                    self._say('error: %s' % self.error)
                return status
            if deadline is not None and time.time() >= deadline:
                self._say('%s; the job\'s timeout of %g s has expired: no restart'
                          % (final.describe(), self.timeout))
                return EXIT_TIMEOUT
            self.restarts.append(final)
            attempt += 1
            self._say('restart %d of %d: %s; every worker is stopped and starts again, '
                      'resuming from the chief\'s latest checkpoint'
                      % (attempt, self.max_restarts, final.describe()))

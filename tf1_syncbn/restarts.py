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
  (:func:`parse_start_line`) and records in :attr:`Restart.resumed`.

This module imports nothing (no TensorFlow, no other module of the package).
"""

import os
import re
import signal
import time

__all__ = ['RestartLoop', 'Restart', 'restart_env', 'restart_count', 'start_line',
           'parse_start_line', 'exit_status', 'describe_exit', 'RESTART_COUNT_ENV',
           'MAX_RESTARTS_ENV']

#: The attempt of this process: 0 at the first start, ``k`` at the ``k``-th restart.
RESTART_COUNT_ENV = 'TF1_SYNCBN_RESTART_COUNT'
#: The launcher's ``--max-restarts``.
MAX_RESTARTS_ENV = 'TF1_SYNCBN_MAX_RESTARTS'
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
    """

    def __init__(self, number, worker, code, last_line=None):
        self.number = number
        self.worker = worker
        self.code = code
        self.cause = describe_exit(code)
        self.last_line = last_line
        self.resumed = []

    @property
    def exit_status(self):
        return exit_status(self.code)

    def describe(self):
        """``'worker 1 killed by SIGKILL'``, with its last line after an exit status."""
        text = 'worker %d %s' % (self.worker, self.cause)
        if self.code > 0 and self.last_line:
            text += ' (its last line: %r)' % self.last_line[-200:]
        return text

    def to_dict(self):
        """The record as JSON-ready values (the demo writes it into ``metrics.json``)."""
        return {'restart': self.number, 'worker': self.worker, 'cause': self.cause,
                'exit_status': self.exit_status, 'last_line': self.last_line,
                'resumed': list(self.resumed)}


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
        line)`` for each line a worker prints.
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
            failed = self.current.failed
            if status == 0 or failed is None or self.current.stopped is not None:
                return status
            worker, code = failed
            lines = self.current.lines[worker]
            final = Restart(attempt + 1, worker, code, lines[-1] if lines else None)
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

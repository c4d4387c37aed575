"""The per-worker supervisor: runs one worker, and reports how and when it ended.

The launcher (:class:`tf1_syncbn.launch.Launcher`) starts every worker under
a supervisor of its own, this file run by its path::

    python -E -S path/to/tf1_syncbn/launch/supervisor.py FD -- command...

(the standard library only: neither the package nor TensorFlow is imported,
and the interpreter's site and environment are left out). :func:`supervise`
starts ``command`` in a session of its own, waits for it, and writes its pid,
then its exit status and the ``time.time()`` at which it ended, to the pipe
``FD`` that the launcher reads. Being a process of its own, it records the
time even while the launcher is paused; being the worker's parent, it records
a SIGKILL too (the worker itself could not). It ignores SIGTERM, SIGINT and
SIGHUP (the launcher signals the worker's process group, not the
supervisor), dies with the launcher, and takes the worker with it
(``PR_SET_PDEATHSIG``, Linux).
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

if __package__:
    from tf1_syncbn.launch.restarts import exit_status
else:   # run by its path: the module next to this file, without the package
    from restarts import exit_status

__all__ = ['supervise', 'die_with_parent', 'PATH']

#: This file: ``python -E -S PATH FD -- command...`` runs :func:`supervise`.
PATH = os.path.abspath(__file__)


def die_with_parent(parent):
    """A ``preexec_fn``: the child gets SIGKILL when ``parent`` dies (Linux).

    The launcher's supervisors die with the launcher, and each worker with its
    supervisor.
    """
    def set_pdeathsig():
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:   # the launcher died before prctl
            os._exit(1)
    return set_pdeathsig


def _ignore(signum, frame):
    del signum, frame


def _write_line(fd, text):
    os.write(fd, (text.replace('\n', ' ') + '\n').encode('utf-8', 'replace'))


def supervise(report_fd, argv):
    """Runs one worker and reports how and when it ended (the launcher's per-worker supervisor).

    The launcher starts ``python -E -S supervisor.py FD -- command...`` per
    worker (see the module docstring). This starts
    ``command`` in a session of its own (so that its process group holds the
    worker and what it starts), then writes to file descriptor ``report_fd``,
    one line each: ``pid <the worker's pid>`` (or ``error <errno> <message>``
    when it cannot be started), and, once the worker has ended, ``exit
    <Popen.returncode> <time.time() when it ended>``. The time is taken
    before the worker is reaped, so a worker whose pid is gone (not even a
    zombie) has its time recorded. SIGTERM, SIGINT and
    SIGHUP are ignored here (the worker gets the launcher's signals through
    its process group); on Linux the worker gets SIGKILL if this process dies.

    Args:
      report_fd: a file descriptor the launcher reads (a pipe).
      argv: the worker's command.

    Returns:
      The worker's exit status (128 + the signal number for a signal), 127
      when it could not be started.

    Hangs: as long as the worker runs.
    """
    os.set_inheritable(report_fd, False)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _ignore)     # reset to the default in the worker by exec
    preexec = die_with_parent(os.getpid()) if sys.platform.startswith('linux') else None
    try:
        worker = subprocess.Popen(argv, start_new_session=True, preexec_fn=preexec)
    except Exception as e:      # noqa: BLE001 - reported to the launcher, which raises it
        _write_line(report_fd, 'error %d %s' % (getattr(e, 'errno', None) or 0,
                                                getattr(e, 'strerror', None) or
                                                '%s: %s' % (type(e).__name__, e)))
        return 127
    _write_line(report_fd, 'pid %d' % worker.pid)
    if hasattr(os, 'waitid'):
        # The time first, then reap: a worker whose pid is gone has its time recorded.
        os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)
    ended = time.time()
    code = worker.wait()
    _write_line(report_fd, 'exit %d %r' % (code, ended))
    return exit_status(code)


def _main(argv):
    if len(argv) < 3 or argv[1] != '--' or not argv[0].isdigit():
        sys.stderr.write('usage: python -E -S %s FD -- command... (started by the launcher, '
                         'tf1_syncbn.launch)\n' % os.path.basename(PATH))
        return 2
    return supervise(int(argv[0]), argv[2:])


if __name__ == '__main__':
    sys.exit(_main(sys.argv[1:]))

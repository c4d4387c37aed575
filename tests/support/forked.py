"""Processes forked from one interpreter that has imported TensorFlow.

Starting Python and importing TensorFlow costs seconds of CPU per process
(measured on the slow CI CPU: about 5 s on 2.21, 14 s on 2.15). Tests that
need many processes in which tf1_syncbn is imported for the first time fork
them from one import instead:

- :func:`fork` and :func:`wait` run a function in forked children, each in a
  process group of its own, its output in a file or inherited;
- :class:`Zygote` is a server process that runs scripts as ``python
  script.py`` would, each in a child forked for it; :func:`run_python` keeps
  one per test process and environment (the README's blocks,
  tests/project/test_readme.py; every reference run of the replaced
  libraries, legacy_reference.py).

What a child shares with the parent: the modules imported before the fork
(TensorFlow and the standard library; never tf1_syncbn or tower, asserted).
Nothing has created a session, a server or an eager context before a fork,
and the child sets its own environment (``os.environ`` also sets the C
environment TensorFlow's runtime reads). Variables TensorFlow may read
*while it is imported* (``TF_USE_LEGACY_KERAS=1`` before ``import
tensorflow``, ``TF_CPP_MIN_LOG_LEVEL``) are the zygote's own:
:func:`run_python` starts one zygote per set of them.
"""

import atexit
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback


def fork(body, log=None, errors=None):
    """Forks a child that runs ``body()``, in its own process group.

    Args:
      body: called in the child; the child exits 0 when it returns, with the
        status of a ``SystemExit`` it raises, 1 (traceback printed) on any
        other exception.
      log: a file path for the child's stdout (and its stderr, unless
        ``errors`` is given), or None to keep the parent's.
      errors: a file path for the child's stderr.

    Returns:
      The child's pid (also its process group's id).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        os.setsid()
        for path, fd in ((log, 1), (errors or log, 2)):
            if path is not None:
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        body()
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child reports and exits
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def wait(pids, deadline):
    """Waits for forked children, at most ``deadline`` seconds for all.

    Children still running then are SIGKILLed with their process groups.

    Returns:
      Each child's exit status, in the order of ``pids`` (negative: the
      signal that ended it).
    """
    statuses, end = {}, time.time() + deadline
    while len(statuses) < len(pids) and time.time() < end:
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for pid in pids:
        if pid not in statuses:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            statuses[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return [statuses[pid] for pid in pids]


def _run_script(argv, cwd, env):
    """In a forked child: what ``python argv...`` in ``cwd`` with ``env`` would do."""
    import runpy  # noqa: PLC0415
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # sys.path as a fresh interpreter would start it: the script's folder, then PYTHONPATH.
    paths = [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p]
    sys.path[:] = ([os.path.dirname(os.path.abspath(argv[0]))] + paths +
                   [p for p in sys.path[1:] if p not in paths])
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name='__main__')


def _children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


#: CPU seconds of this process's zygotes: their imports and the scripts they
#: ran (a zygote's children are not this process's: getrusage does not count
#: them here until the zygote ends).
_SCRIPTS_CPU = [0.0]


def scripts_cpu_seconds():
    """The CPU time of this process's zygotes' imports and of every script they ran."""
    return _SCRIPTS_CPU[0]


def _serve():
    """The zygote: imports TensorFlow, then forks one child per request on stdin."""
    import tensorflow  # noqa: F401, PLC0415 - the import the children share
    ours = [m for m in sys.modules if m.split('.')[0] in ('tf1_syncbn', 'tower')]
    if ours:
        raise RuntimeError('the zygote imported %s before its forks' % ours)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print('READY %.3f' % (usage.ru_utime + usage.ru_stime), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = fork(lambda request=request: _run_script(
            request['argv'], request['cwd'], request['env']),
            log=request['stdout'], errors=request['stderr'])
        before = _children_cpu()
        status, = wait([pid], request['timeout'])
        print('STATUS %d %d %.3f' % (request['id'], status, _children_cpu() - before),
              flush=True)


class Zygote:
    """Runs scripts as fresh interpreters would, each forked from one TensorFlow import.

    Scripts run one at a time (one caller at a time: :func:`run_python`
    hands a busy zygote's callers another); :meth:`close` stops it.
    """

    def __init__(self, env, python=sys.executable):
        # Without the runner's switch: where the package is installed, its start-up hook
        # (tf1_syncbn_run.pth) would install the runner in the zygote itself, which must
        # import TensorFlow alone. A script that runs under the runner starts it (startup.py).
        env = {k: v for k, v in env.items() if k != 'TF1_SYNCBN_RUN'}
        self._proc = subprocess.Popen(
            [python, os.path.abspath(__file__), '--serve'], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=os.path.dirname(__file__))
        ready = self._proc.stdout.readline()
        if not ready.startswith('READY '):
            self.close()
            raise RuntimeError('the zygote did not start (exit %s): %r' % (
                self._proc.returncode, ready))
        _SCRIPTS_CPU[0] += float(ready.split()[1])      # its TensorFlow import
        self._requests = 0
        #: Held by whoever runs a script on it (:func:`run_python`).
        self.busy = threading.Lock()

    def run(self, argv, cwd, env, timeout):
        """Runs ``python argv...`` in ``cwd`` with environment ``env``, forked.

        Returns:
          ``(returncode, stdout, stderr)``: the exit status (negative: the
          signal, ``-9`` past ``timeout``) and the script's output.
        """
        logs = []
        for stream in ('stdout', 'stderr'):
            fd, path = tempfile.mkstemp(suffix='.log', prefix='forked-%s-' % stream)
            os.close(fd)
            logs.append(path)
        self._requests += 1
        self._proc.stdin.write(json.dumps(
            {'id': self._requests, 'argv': [str(a) for a in argv], 'cwd': str(cwd),
             'env': dict(env), 'stdout': logs[0], 'stderr': logs[1],
             'timeout': timeout}) + '\n')
        self._proc.stdin.flush()
        while True:
            # (A reply to an earlier request, whose caller stopped waiting, is passed over.)
            reply = self._proc.stdout.readline().split()
            if not reply or reply[0] != 'STATUS':
                raise RuntimeError('the zygote stopped (exit %s)' % self._proc.poll())
            _SCRIPTS_CPU[0] += float(reply[3])
            if int(reply[1]) == self._requests:
                break
        outputs = []
        for path in logs:
            with open(path, encoding='utf-8', errors='replace') as f:
                outputs.append(f.read())
            os.remove(path)
        return (int(reply[2]),) + tuple(outputs)

    def close(self):
        if self._proc.stdin:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


#: What TensorFlow, Python and the libraries below them may read while TensorFlow
#: is imported: a zygote serves only scripts whose variables with these
#: prefixes are its own.
_READ_AT_IMPORT = ('TF_', 'PYTHON', 'KERAS', 'CUDA', 'LD_', 'OMP_', 'MKL', 'XLA_')
_ZYGOTES = {}          # key -> [Zygote]: the idle ones and those at work
_POOL = threading.Lock()


def run_python(argv, cwd, env, timeout):
    """Runs ``python argv...`` in ``cwd`` with ``env``, forked from a zygote of this process.

    Zygotes are kept per distinct set of the variables read at import
    (``_READ_AT_IMPORT``), started on first use and stopped when this
    process exits; a script whose such variables differ gets a zygote of
    its own. A zygote runs one script at a time: scripts run from several
    threads at once (a test's thread pool) each get one.

    Returns:
      ``(returncode, stdout, stderr)``, as :meth:`Zygote.run`.
    """
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(_READ_AT_IMPORT)))
    with _POOL:
        if not _ZYGOTES:
            atexit.register(_close_all)
        zygotes = _ZYGOTES.setdefault(key, [])
        zygote = next((z for z in zygotes if z.busy.acquire(blocking=False)), None)
    if zygote is None:
        zygote = Zygote(env)
        zygote.busy.acquire()
        with _POOL:
            zygotes.append(zygote)
    try:
        return zygote.run(argv, cwd, env, timeout)
    finally:
        zygote.busy.release()


def _close_all():
    with _POOL:
        for zygote in (z for zygotes in _ZYGOTES.values() for z in zygotes):
            zygote.close()
        _ZYGOTES.clear()


if __name__ == '__main__' and sys.argv[1:] == ['--serve']:
    _serve()

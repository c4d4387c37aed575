"""Starts a script (or a command) under ``horovodrun --gloo`` on this machine, as a user would.

``horovodrun -np N -H localhost:N --gloo python SCRIPT ARGS`` with this
interpreter; the job runs in its own process group, killed whole when it
outlives its timeout. Workers inherit the environment: ``PYTHONPATH`` (set by
``tests/conftest.py``: ``tests/`` and the repository) and the TF behaviour
(``TF1_SYNCBN_TEST_BEHAVIOR``).
"""

import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
#: The ``horovodrun`` installed with Horovod beside this interpreter.
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), 'horovodrun')


class Job(object):
    """A finished job: ``returncode`` (None: killed), ``output`` (stdout, stderr), ``seconds``."""

    def __init__(self, command, returncode, output, seconds):
        self.command = command
        self.returncode = returncode
        self.output = output
        self.seconds = seconds

    def tail(self, chars=6000):
        return self.output[-chars:]

    def check(self):
        """Raises ``RuntimeError`` with the job's output when it failed; returns self."""
        if self.returncode != 0:
            raise RuntimeError('horovodrun exited with %s after %.0f s: %s\n%s'
                               % (self.returncode, self.seconds, ' '.join(self.command),
                                  self.tail()))
        return self


def horovodrun(script, args=(), np=2, env=None, timeout=300, horovodrun_args=(), cwd=None):
    """Runs ``script`` (a path, or a name in this directory) under ``horovodrun --gloo``.

    Args:
      script: the worker script.
      args: its arguments.
      np: the number of processes (all on localhost).
      env: more environment variables for the job.
      timeout: seconds; past it, the job's whole process group is killed and
        the returned job has ``returncode`` None.
      horovodrun_args: more arguments for ``horovodrun`` itself.
      cwd: the job's working directory (default: this process's).

    Returns:
      A :class:`Job` (call ``check()`` to require success).
    """
    if not os.path.isabs(script):
        script = os.path.join(HERE, script)
    return run_command([sys.executable, script] + [str(a) for a in args], np=np, env=env,
                       timeout=timeout, horovodrun_args=horovodrun_args, cwd=cwd)


def run_command(command, np=2, env=None, timeout=300, horovodrun_args=(), cwd=None):
    """Runs ``command`` (``[python, '-m', module, ...]``) under ``horovodrun --gloo``.

    Args:
      command: the command line each process runs.
      np, env, timeout, horovodrun_args, cwd: as :func:`horovodrun`'s (``env`` is
        added to this process's environment, overriding it).

    Returns:
      A :class:`Job` (call ``check()`` to require success).
    """
    command = [HOROVODRUN, '-np', str(np), '-H', 'localhost:%d' % np, '--gloo'] + \
        list(horovodrun_args) + list(command)
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONUNBUFFERED='1')
    full_env.update(env or {})
    start = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=full_env, start_new_session=True, text=True,
                            cwd=cwd)
    try:
        output, _ = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += '\n[killed by the test after %d s]' % timeout
        returncode = None
    return Job(command, returncode, output, time.time() - start)

"""Running the commands of ``make gpu-check``: output shown as it comes, a time limit, a result.

Standard library only (see ``tools/gpu_check.py``).
"""

import collections
import os
import re
import subprocess
import sys
import threading
import time

#: The repository: every command runs there.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The result of one command: exit status, output (stdout and stderr), seconds.
Result = collections.namedtuple('Result', ['rc', 'output', 'seconds'])


def run_command(cmd, env=None, timeout=None, echo=True):
    """Runs ``cmd`` in the repository, shows its output as it comes, returns a :class:`Result`.

    After ``timeout`` seconds its whole process group is killed (exit status
    124). A command that cannot start gives exit status 127.
    """
    start = time.time()
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, universal_newlines=True,
                                start_new_session=True)
    except OSError as e:
        return Result(127, 'cannot run %s: %s' % (cmd[0], e), time.time() - start)
    expired = []

    def stop():
        expired.append(True)
        try:
            os.killpg(proc.pid, 9)
        except OSError:
            pass

    timer = threading.Timer(timeout, stop) if timeout else None
    if timer:
        timer.start()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if echo:
            sys.stdout.write('    ' + line)
            sys.stdout.flush()
    rc = proc.wait()
    if timer:
        timer.cancel()
    if expired:
        lines.append('[gpu-check: stopped after %d s]\n' % timeout)
        rc = 124
    return Result(rc, ''.join(lines), time.time() - start)


def shell_words(cmd):
    """``cmd`` as one would type it (for the report)."""
    words = [os.path.relpath(w, ROOT) if os.path.isabs(w) and w.startswith(ROOT) else w
             for w in cmd]
    return ' '.join(w if re.match(r'^[\w@%+=:,./-]+$', w) else "'%s'" % w for w in words)

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
status is 0 when every worker exited with 0, else the root cause's status
(128 + signal number for a signal; 124 when ``--timeout`` seconds, which
bound the whole job, expired). ``--gpus-per-worker K`` is described above.

The root cause is the worker that failed *first*, by the time it ended, not
the first the launcher notices: when one worker dies, its peers fail on their
own within seconds, and a launcher that looks late (a busy machine, a
launcher paused by SIGSTOP) finds several ended at once. So each worker runs
under a tiny supervisor process (:mod:`~tf1_syncbn.launch.supervisor`), which
records when it ended, SIGKILL included. The launcher names the root cause
(``worker 1 killed by SIGKILL; the others get 30 s ...``) and each other
worker that then failed on its own as a consequence (``worker 0 exited with
status 1, 0.84 s after worker 1 was killed by SIGKILL``); a worker it stopped
itself is ``stopped by the launcher``. Before naming a root cause it waits
(up to :data:`~tf1_syncbn.launch.launcher.REPORT_TIMEOUT` s) for the report of
every worker that has ended but whose supervisor has not written yet. The
logged pid, :attr:`Launcher.pids` and the process group the launcher signals
are the worker's.

With ``--max-restarts N`` (default 0), a failed worker makes the launcher
stop the others as above and then start every worker again, up to ``N``
times (:mod:`~tf1_syncbn.launch.restarts`; its old path ``tf1_syncbn.restarts``
still imports it): each worker's environment then also has
``TF1_SYNCBN_RESTART_COUNT`` (0 at the first start, ``k`` at the ``k``-th
restart) and ``TF1_SYNCBN_MAX_RESTARTS``, and workers started on free ports
get new ones. The restarted workers resume from the chief's latest complete
checkpoint (:class:`tf1_syncbn.distributed.WorkerSession`). The launcher
logs each restart (the worker, its exit cause, and the step and checkpoint
the chief resumed from); once the job has failed ``N + 1`` times it stops
with an error naming every restart's cause, and the last failure's status.
A stop (a signal to the launcher, ``--timeout``) is never followed by a
restart. See docs/restarts.md.

The modules: :mod:`~tf1_syncbn.launch.launcher` (:class:`Launcher`,
:func:`launch`), :mod:`~tf1_syncbn.launch.supervisor`,
:mod:`~tf1_syncbn.launch.restarts` (the restart policy), and
:mod:`~tf1_syncbn.launch.command` (:func:`main`). None imports TensorFlow or
anything else of the package: ``python path/to/tf1_syncbn/launch`` (the
folder) runs the launcher without importing the package.
"""

from tf1_syncbn.launch.command import build_parser, main
from tf1_syncbn.launch.launcher import (DEFAULT_GRACE, DEFAULT_KILL_AFTER, REPORT_TIMEOUT,
                                        SUPERVISOR_START_TIMEOUT, Launcher, free_ports,
                                        gpu_assignment, launch, tf_config)
from tf1_syncbn.launch.restarts import EXIT_TIMEOUT
from tf1_syncbn.launch.supervisor import supervise

__all__ = ['Launcher', 'launch', 'free_ports', 'tf_config', 'gpu_assignment', 'main',
           'supervise', 'build_parser', 'DEFAULT_GRACE', 'DEFAULT_KILL_AFTER', 'EXIT_TIMEOUT',
           'REPORT_TIMEOUT', 'SUPERVISOR_START_TIMEOUT']

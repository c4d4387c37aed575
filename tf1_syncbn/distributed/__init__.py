"""Multi-worker data-parallel training for TF1 graphs on TensorFlow's collective runtime.

The counterpart of Horovod's ``DistributedOptimizer`` on TensorFlow's own
engine (gRPC servers and collective ops, as under
``MultiWorkerMirroredStrategy``): no MPI, no extra transport. Every worker
process runs the same script and builds the same graph with ``T`` in-graph
towers on its own devices.

* :func:`setup_cluster`: the cluster from ``TF_CONFIG`` (TensorFlow's own
  ``TFConfigClusterResolver``) or from a host list and a task index. Returns a
  :class:`Cluster`: the started server, the session config (collective group
  leader, device filters, one device per tower; with GPUs, this worker's own
  GPUs) and the tower devices.
* :func:`all_reduce_gradients` / :class:`DistributedOptimizer`: towers sum
  their gradients locally, then one collective all-reduce per bucket of packed
  gradients crosses the workers; the result is the average over every tower
  of every worker.
* :func:`broadcast_variables`: worker 0's values to every worker (collective
  broadcast), so no worker depends on identical seeds.
* :class:`WorkerSession`: checks that every peer answers, creates the session,
  initializes, restores the chief's latest checkpoint, broadcasts, and turns
  collective failures into :class:`WorkerLostError`. Only the chief saves.

Collective keys: the group key of every cross-worker collective here is
``stable_hash('tf1_syncbn/workers/<device type>/<workers>')``, distinct from
the batch-norm groups of :class:`~tf1_syncbn.CollectiveBackend`. Instance keys
hash a name, the kind of collective, a bucket index and a per-process graph
generation (0 for the first graph that builds collectives of this module, 1
for the next, ...). Every worker must therefore build its graphs in the same
order, as it does when all workers run the same script.

Hang conditions, and what turns each into an error:

* A peer that is not listening at start-up: :func:`wait_for_peers` (called by
  :class:`WorkerSession`) raises :class:`PeerMissingError` naming it after
  ``startup_timeout`` seconds.
* A peer that stops before the first collective: the start-up broadcast has
  ``startup_timeout`` as its collective timeout on the chief, and
  ``startup_timeout + restore_timeout`` on the other workers, which wait
  there while the chief restores its checkpoint (or runs ``init_fn``).
* The group leader (worker 0) disappearing between the peer check and the
  first step makes TensorFlow retry ``GetStepSequence`` forever inside
  ``Session.run``, a wait no TensorFlow timeout covers. A watchdog thread ends
  the process (status :data:`EXIT_STARTUP_HANG`) when session start-up is
  still blocked ``hang_timeout + restore_timeout`` seconds later (by default
  ``hang_timeout`` is twice the start-up timeout plus 30 s), because that C++
  wait cannot be interrupted from Python.
* A peer that dies or freezes during training: each step of each worker has
  the cluster's ``collective_timeout`` as its deadline, counted from the
  step's start on that worker, so the next step fails within it (a dead
  peer's connection usually fails within a second); :meth:`WorkerSession.run`
  raises :class:`WorkerLostError`. TensorFlow then aborts the process's
  collective executor: the process must exit (see :func:`hard_exit`).
* The same deadline also covers the time a step waits for peers that are
  still busy *between* steps (the chief's :meth:`WorkerSession.save`, an
  evaluation, a slow first step): ``collective_timeout`` must exceed the
  longest step plus the longest pause of any worker between two steps, or a
  healthy job fails with :class:`WorkerLostError`.
Modules: :mod:`~tf1_syncbn.distributed.cluster` (set-up, ``TF_CONFIG``,
session config), :mod:`~tf1_syncbn.distributed.peers` (start-up checks),
:mod:`~tf1_syncbn.distributed.collectives` (gradients, gathers, broadcast,
metrics), :mod:`~tf1_syncbn.distributed.optimizer`,
:mod:`~tf1_syncbn.distributed.session` (``WorkerSession``) and
:mod:`~tf1_syncbn.distributed.errors`.
"""

from tf1_syncbn.distributed.cluster import (COMMUNICATION_HINTS, DEFAULT_STARTUP_TIMEOUT,
                                            Cluster, local_rank, session_config, setup_cluster)
from tf1_syncbn.distributed.collectives import (DEFAULT_BUCKET_BYTES, all_reduce_gradients,
                                                average_across_workers, broadcast_variables)
from tf1_syncbn.distributed.errors import (EXIT_STARTUP_HANG, ClusterError, PeerMissingError,
                                           WorkerLostError, hard_exit)
from tf1_syncbn.distributed.optimizer import DistributedOptimizer
from tf1_syncbn.distributed.peers import unreachable_peers, wait_for_peers
from tf1_syncbn.distributed.session import DEFAULT_RESTORE_TIMEOUT, WorkerSession

__all__ = ['Cluster', 'setup_cluster', 'session_config', 'local_rank', 'unreachable_peers',
           'all_reduce_gradients', 'DistributedOptimizer', 'broadcast_variables',
           'average_across_workers', 'WorkerSession', 'wait_for_peers', 'ClusterError',
           'PeerMissingError', 'WorkerLostError', 'hard_exit', 'DEFAULT_BUCKET_BYTES',
           'DEFAULT_STARTUP_TIMEOUT', 'DEFAULT_RESTORE_TIMEOUT', 'EXIT_STARTUP_HANG',
           'COMMUNICATION_HINTS']

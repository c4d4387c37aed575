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
"""

import collections
import logging
import math
import numbers
import os
import socket
import sys
import threading
import time
import weakref

import tensorflow as tf

from tf1_syncbn.backends import CollectiveBackend, op_timeout, stable_hash
from tf1_syncbn.timeouts import validate_timeout
from tower.context import get_current_tower_context
from tower.training import check_tower_grads

tf1 = tf.compat.v1
log = logging.getLogger(__name__)

__all__ = ['Cluster', 'setup_cluster', 'session_config', 'local_rank', 'unreachable_peers',
           'all_reduce_gradients', 'DistributedOptimizer', 'broadcast_variables', 'average_across_workers', 'WorkerSession', 'wait_for_peers',
           'ClusterError', 'PeerMissingError', 'WorkerLostError', 'hard_exit',
           'DEFAULT_BUCKET_BYTES', 'DEFAULT_STARTUP_TIMEOUT', 'DEFAULT_RESTORE_TIMEOUT',
           'EXIT_STARTUP_HANG', 'COMMUNICATION_HINTS']

#: Bytes of gradients packed into one cross-worker all-reduce.
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
#: Seconds to wait for every peer at start-up.
DEFAULT_STARTUP_TIMEOUT = 120.0
#: Seconds the other workers allow the chief, at start-up, to restore its
#: checkpoint or run ``init_fn`` (see :class:`WorkerSession`). Generous on
#: purpose: a limit that is too short fails every restart of a job whose
#: restore is slow, so that it can never resume; one that is too long only
#: delays the error when the chief freezes during start-up.
DEFAULT_RESTORE_TIMEOUT = 600.0
#: Exit status of a process whose session start-up stayed blocked (see the module docstring).
EXIT_STARTUP_HANG = 75
#: Values of ``communication_hint`` (TensorFlow's collective implementations).
COMMUNICATION_HINTS = ('auto', 'ring', 'nccl')

_TRAINING_JOBS = ('chief', 'worker')


class ClusterError(RuntimeError):
    """A multi-worker failure: a peer missing at start-up or lost during training."""


class PeerMissingError(ClusterError):
    """A peer did not answer at start-up. ``missing`` lists ``'worker <i> (<address>)'``."""

    def __init__(self, message, missing=()):
        super().__init__(message)
        self.missing = list(missing)


class WorkerLostError(ClusterError):
    """A collective failed during training: a worker died, froze or was stopped."""


class Cluster(object):
    """This worker's view of the cluster; built by :func:`setup_cluster`.

    Attributes:
      server: the started ``tf.distribute.Server``, or None with one worker.
      target: the session target (``server.target``, or ``''``).
      config: the ``ConfigProto`` for every session of this worker.
      addresses: ``host:port`` of every worker, in rank order (chief first).
      jobs: ``(job name, task index)`` of every worker, in rank order.
      rank: this worker's index in ``addresses`` (0 is the chief).
      num_workers: ``len(addresses)``.
      towers: in-graph towers per worker.
      tower_devices: this worker's tower devices, one per tower.
      device_type: ``'CPU'`` or ``'GPU'``.
      collective_timeout: the deadline of each step, in seconds, counted from
        the step's start on this worker (0: none); see :func:`setup_cluster`.
      startup_timeout: seconds to wait for every peer at start-up.
      communication_hint: the collective implementation asked of TensorFlow
        (``'auto'``, ``'ring'`` or ``'nccl'``) by every cross-worker
        collective and by :meth:`backend`.
      local_rank: this worker's position among the workers on its own host
        (the addresses with the same host part, in rank order).
    """

    def __init__(self, server, config, addresses, jobs, rank, towers, tower_devices,
                 device_type, collective_timeout, startup_timeout, communication_hint='auto',
                 local_rank=0):
        _check_communication_hint(communication_hint, device_type, 'Cluster')
        self.server = server
        self.target = server.target if server is not None else ''
        self.config = config
        self.addresses = list(addresses)
        self.jobs = list(jobs)
        self.rank = rank
        self.num_workers = len(self.addresses) if self.addresses else 1
        self.towers = towers
        self.tower_devices = list(tower_devices)
        self.device_type = device_type
        self.collective_timeout = collective_timeout
        self.startup_timeout = startup_timeout
        self.communication_hint = communication_hint
        self.local_rank = local_rank

    @property
    def is_chief(self):
        """True on worker 0, the only one that writes checkpoints."""
        return self.rank == 0

    @property
    def num_towers(self):
        """Towers across all workers: ``towers * num_workers``."""
        return self.towers * self.num_workers

    @property
    def reduce_device(self):
        """The device of the cross-worker collectives (this worker's first tower)."""
        return self.tower_devices[0]

    @property
    def group_key(self):
        """The collective group key of the cross-worker collectives of this module."""
        return stable_hash('tf1_syncbn/workers/%s/%d' % (self.device_type, self.num_workers))

    def describe(self, rank):
        """``'worker <rank> (<address>)'``, for messages."""
        return _describe(self.addresses, self.jobs, rank)

    def backend(self, timeout=None, communication_hint=None):
        """A :class:`~tf1_syncbn.CollectiveBackend` synchronizing batch norm over all workers.

        Args:
          timeout: the collective timeout; None uses ``collective_timeout``.
          communication_hint: None uses the cluster's ``communication_hint``.
        """
        return CollectiveBackend(
            timeout=self.collective_timeout if timeout is None else timeout,
            communication_hint=(self.communication_hint if communication_hint is None
                                else communication_hint),
            num_workers=self.num_workers)

    def __repr__(self):
        return ('Cluster(rank=%d, num_workers=%d, towers=%d, devices=%r, target=%r)'
                % (self.rank, self.num_workers, self.towers, self.tower_devices, self.target))


def _describe(addresses, jobs, rank):
    if not addresses:
        return 'worker %d' % rank
    job, task = jobs[rank]
    name = 'worker %d' % rank
    if job != 'worker' or task != rank:
        name += ' = %s:%d' % (job, task)
    return '%s (%s)' % (name, addresses[rank])


def _check_communication_hint(hint, device_type, owner):
    if not isinstance(hint, str) or hint not in COMMUNICATION_HINTS:
        raise ValueError("%s: communication_hint must be 'auto', 'ring' or 'nccl', got %r."
                         % (owner, hint))
    if hint == 'nccl' and device_type != 'GPU':
        raise ValueError(
            "%s: communication_hint='nccl' needs device_type='GPU', got device_type=%r: NCCL "
            "runs only between GPUs, and TensorFlow would quietly use its ring implementation "
            "on CPUs. Use communication_hint='auto' or 'ring' on CPUs." % (owner, device_type))


def _check_seconds(value, owner, name, allow_zero):
    """A finite number of seconds (> 0, or >= 0 with ``allow_zero``), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            math.isnan(value) or math.isinf(value) or value < 0 or \
            (value == 0 and not allow_zero):
        raise ValueError('%s: %s must be a finite number of seconds %s, got %r.'
                         % (owner, name, '>= 0' if allow_zero else '> 0', value))
    return float(value)


def _parse_address(address, what):
    if not isinstance(address, str) or ':' not in address:
        raise ValueError('%s: expected "host:port", got %r.' % (what, address))
    host, _, port = address.rpartition(':')
    if not host or not port.isdigit():
        raise ValueError('%s: expected "host:port", got %r.' % (what, address))
    return host.strip('[]'), int(port)


_LOOPBACK = ('localhost', '127.0.0.1', '::1')


def _host_of(address):
    """The host part of ``address``, lower-cased; every loopback spelling is ``'localhost'``."""
    host = _parse_address(address, 'address')[0].lower()
    return 'localhost' if host in _LOOPBACK else host


def local_rank(addresses, rank):
    """The position of worker ``rank`` among the workers on its own host.

    Workers are on the same host when the host parts of their addresses are
    spelled the same (case-insensitive; ``localhost``, ``127.0.0.1`` and
    ``::1`` count as one). Names are not resolved: ``h0`` and its IP address
    count as two hosts.

    Args:
      addresses: ``host:port`` of every worker, in rank order (empty for one
        worker).
      rank: the worker's index in ``addresses``.

    Returns:
      An int: 0 for the first worker of its host, 1 for the second, ...
    """
    if not addresses:
        return 0
    host = _host_of(addresses[rank])
    return sum(1 for address in addresses[:rank] if _host_of(address) == host)


def _cluster_from_tf_config():
    """(cluster dict, job, task index) from TF_CONFIG; None when it names no cluster."""
    from tensorflow.python.distribute.cluster_resolver import TFConfigClusterResolver
    resolver = TFConfigClusterResolver()
    spec = resolver.cluster_spec().as_dict()
    if not spec:
        return None
    job, task = resolver.task_type, resolver.task_id
    if 'ps' in spec:
        raise ValueError('setup_cluster: TF_CONFIG lists a "ps" job; parameter servers are not '
                         'supported (every worker holds the variables). List only "chief" and '
                         '"worker" tasks.')
    if job not in _TRAINING_JOBS:
        raise ValueError('setup_cluster: TF_CONFIG task type %r is not a training worker; '
                         'run this process only for "chief" and "worker" tasks.' % (job,))
    if task is None:
        raise ValueError('setup_cluster: TF_CONFIG has no task index.')
    return {k: v for k, v in spec.items() if k in _TRAINING_JOBS}, job, int(task)


def _tower_devices(jobs, rank, towers, device_type, local):
    if local:
        return ['/device:%s:%d' % (device_type, i) for i in range(towers)]
    job, task = jobs[rank]
    return ['/job:%s/replica:0/task:%d/device:%s:%d' % (job, task, device_type, i)
            for i in range(towers)]


def _select_gpus(towers, worker, local, config, environ, physical_gpus):
    """The ``visible_device_list`` of a GPU worker; raises when it cannot have its GPUs.

    Args:
      towers: GPUs this worker needs (one per tower).
      worker: ``'worker <rank> (<address>)'``, for messages.
      local: this worker's local rank (:func:`local_rank`).
      config: the user's ``ConfigProto`` or None; a ``visible_device_list``
        set there is kept.
      environ: the environment (``CUDA_VISIBLE_DEVICES``).
      physical_gpus: how many GPUs this process sees.

    Returns:
      The ``visible_device_list`` string.
    """
    fixes = ('Give each worker GPUs of its own: set CUDA_VISIBLE_DEVICES per worker (python -m '
             'tf1_syncbn.launch --gpus-per-worker %d does), start fewer workers on this host, '
             'or use fewer towers.' % towers)
    user_list = config.gpu_options.visible_device_list if config is not None else ''
    if user_list:
        try:
            chosen = [int(i) for i in user_list.split(',')]
        except ValueError:
            raise ValueError('setup_cluster: config.gpu_options.visible_device_list=%r is not a '
                             'comma-separated list of GPU indices.' % (user_list,)) from None
        source = 'config.gpu_options.visible_device_list=%r' % user_list
        if len(chosen) < towers:
            raise ValueError('setup_cluster: %s with towers=%d needs %d GPUs, but %s lists %d.'
                             % (worker, towers, towers, source, len(chosen)))
    elif 'CUDA_VISIBLE_DEVICES' in environ:
        # The launcher (or the user) already chose this worker's GPUs.
        chosen = list(range(towers))
        source = 'CUDA_VISIBLE_DEVICES=%r' % environ['CUDA_VISIBLE_DEVICES']
    else:
        chosen = list(range(local * towers, (local + 1) * towers))
        source = ('local rank %d: worker %d on its host, so GPUs %d to %d'
                  % (local, local, chosen[0], chosen[-1]))
    needed = max(chosen) + 1
    if physical_gpus < needed:
        if physical_gpus == 0:
            fixes = ('A TensorFlow build without GPU support sees none, and so does a process '
                     'whose CUDA_VISIBLE_DEVICES names a GPU that does not exist (CUDA then '
                     'hides the GPUs listed after it). ' + fixes)
        raise ValueError(
            "setup_cluster: %s with device_type='GPU' and towers=%d needs %d GPUs (%s), but "
            "this process sees %d. %s" % (worker, towers, needed, source, physical_gpus, fixes))
    return ','.join(str(i) for i in chosen)


def setup_cluster(towers=1, hosts=None, task=None, device_type='CPU', collective_timeout=None,
                  startup_timeout=DEFAULT_STARTUP_TIMEOUT, config=None, communication_hint='auto',
                  gpu_memory_growth=None):
    """Starts this worker's TensorFlow server and returns its :class:`Cluster`.

    The cluster comes from ``hosts`` and ``task`` when given, else from the
    ``TF_CONFIG`` environment variable, read with TensorFlow's own
    ``TFConfigClusterResolver`` (jobs ``"chief"`` and ``"worker"``; the chief,
    if any, is worker 0). With neither, or with a single worker, nothing is
    started: the cluster is this process alone and every function of this
    module reduces to in-graph towers.

    The session config (``Cluster.config``) sets
    ``experimental.collective_group_leader`` to worker 0 and
    ``device_filters`` to this task, so that each worker's session sees only
    its own devices and its creation never waits for the other workers; with
    ``device_type='CPU'`` it also asks for ``towers`` (virtual) CPU devices.

    With ``device_type='GPU'``, each worker gets GPUs of its own through
    ``gpu_options.visible_device_list`` (which TensorFlow renumbers, so the
    towers are ``GPU:0`` to ``GPU:towers-1`` in every process):

    * without ``CUDA_VISIBLE_DEVICES``: the worker with local rank ``r`` (the
      ``r``-th worker of its host in the address list, see
      :func:`local_rank`) gets GPUs ``r * towers`` to ``r * towers + towers - 1``;
    * with ``CUDA_VISIBLE_DEVICES`` set (for example by
      ``python -m tf1_syncbn.launch --gpus-per-worker``), the variable is
      taken to have selected this worker's GPUs already: it gets the first
      ``towers`` of them;
    * a ``visible_device_list`` already set in ``config`` is kept.

    The process must see enough GPUs (``tf.config.list_physical_devices``),
    or this raises ``ValueError``.

    Args:
      towers: in-graph towers on this worker (every worker must use the same
        number).
      hosts: ``host:port`` of every worker, the same list (in the same order)
        on every worker; worker 0 is the chief.
      task: this worker's index in ``hosts``.
      device_type: ``'CPU'`` (virtual CPU devices) or ``'GPU'`` (one GPU per
        tower).
      collective_timeout: the deadline of every training step, in seconds,
        counted from the step's start on this worker, for the collectives of
        this module and of :meth:`Cluster.backend` (kept by one watchdog
        thread per process, see :class:`tf1_syncbn.CollectiveBackend`). The
        step waits there for the other workers to reach the same step, so the
        deadline covers this worker's step *and* whatever its peers do
        between steps (the chief's checkpoint save, an evaluation, a slow
        first step): it must exceed the longest step plus the longest pause of
        any worker between two steps. None uses
        :data:`tf1_syncbn.timeouts.DEFAULT_TIMEOUT`; 0 or ``float('inf')``
        means no deadline (a lost worker then hangs the others); checked by
        :func:`tf1_syncbn.timeouts.validate_timeout`.
      startup_timeout: seconds :class:`WorkerSession` waits for every peer at
        start-up (finite, > 0).
      config: a ``ConfigProto`` to start from (copied, not modified).
      communication_hint: the collective implementation TensorFlow should
        use for the cross-worker collectives and :meth:`Cluster.backend`:
        ``'auto'``, ``'ring'`` or ``'nccl'`` (``device_type='GPU'`` only).
      gpu_memory_growth: with GPUs, sets ``gpu_options.allow_growth``: True
        allocates GPU memory as needed, False lets TensorFlow take nearly all
        of each visible GPU at start-up. None (default) keeps ``config``'s
        setting, which is TensorFlow's default, False: each worker has GPUs
        of its own, and taking their memory at once fails at start-up, not
        in the middle of training, when another process uses them. Set True
        when processes must share GPUs.

    Returns:
      A :class:`Cluster`.

    Raises:
      ValueError: on a malformed argument or TF_CONFIG, or when a GPU worker
        does not see the GPUs it needs (messages name the worker and the
        argument).

    Hangs: never; it starts the server and returns. See
    :class:`WorkerSession` for the start-up waits.
    """
    if isinstance(towers, bool) or not isinstance(towers, int) or towers < 1:
        raise ValueError('setup_cluster: towers must be a positive int, got %r.' % (towers,))
    if device_type not in ('CPU', 'GPU'):
        raise ValueError("setup_cluster: device_type must be 'CPU' or 'GPU', got %r."
                         % (device_type,))
    if collective_timeout is None:
        from tf1_syncbn.timeouts import DEFAULT_TIMEOUT
        collective_timeout = DEFAULT_TIMEOUT
    collective_timeout = validate_timeout(collective_timeout, 'setup_cluster',
                                          'collective_timeout')
    startup_timeout = _check_seconds(startup_timeout, 'setup_cluster', 'startup_timeout',
                                     allow_zero=False)
    _check_communication_hint(communication_hint, device_type, 'setup_cluster')
    if gpu_memory_growth is not None and not isinstance(gpu_memory_growth, bool):
        raise ValueError('setup_cluster: gpu_memory_growth must be True, False or None, got %r.'
                         % (gpu_memory_growth,))

    spec, job, job_task = _resolve(hosts, task)
    if spec is None:
        addresses, jobs, rank = [], [('worker', 0)], 0
    else:
        jobs = [(j, i) for j in _TRAINING_JOBS for i in range(len(spec.get(j, [])))]
        addresses = [spec[j][i] for j, i in jobs]
        rank = jobs.index((job, job_task))
    local = len(addresses) <= 1
    me = _describe(addresses if not local else [], jobs, rank)
    my_local_rank = local_rank(addresses, rank)
    gpus = None
    if device_type == 'GPU':
        gpus = _select_gpus(towers, me, my_local_rank, config, os.environ,
                            len(tf.config.list_physical_devices('GPU')))
    new_config = session_config(towers, device_type, None if local else jobs, rank, config,
                                visible_gpus=gpus, gpu_memory_growth=gpu_memory_growth)
    server = None
    if not local:
        server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job,
                                      task_index=job_task, config=new_config, start=True)
        log.info('worker %d of %d (%s:%d) serving on %s', rank, len(addresses), job, job_task,
                 addresses[rank])
    return Cluster(server, new_config, addresses, jobs, rank, towers,
                   _tower_devices(jobs, rank, towers, device_type, local), device_type,
                   collective_timeout, startup_timeout, communication_hint, my_local_rank)


def _resolve(hosts, task):
    """(cluster dict or None, job, task index) from ``hosts``/``task`` or TF_CONFIG."""
    if hosts is not None:
        if isinstance(hosts, str):
            hosts = [h for h in hosts.split(',') if h]
        hosts = list(hosts)
        if not hosts:
            raise ValueError('setup_cluster: hosts is empty.')
        for h in hosts:
            _parse_address(h, 'setup_cluster: hosts')
        if isinstance(task, bool) or not isinstance(task, int) or not 0 <= task < len(hosts):
            raise ValueError('setup_cluster: task must be an int in [0, %d) with hosts=%r, got %r.'
                             % (len(hosts), hosts, task))
        return {'worker': hosts}, 'worker', task
    if task is not None:
        raise ValueError('setup_cluster: task=%r needs hosts.' % (task,))
    resolved = _cluster_from_tf_config()
    if resolved is None:
        return None, 'worker', 0
    spec, job, job_task = resolved
    if job_task >= len(spec.get(job, [])):
        raise ValueError('setup_cluster: TF_CONFIG task %s:%d is not in its cluster %r.'
                         % (job, job_task, spec))
    return resolved


def session_config(towers, device_type, jobs=None, rank=0, config=None, visible_gpus=None,
                   gpu_memory_growth=None):
    """The ``ConfigProto`` of a worker's sessions (what :func:`setup_cluster` returns).

    Args:
      towers: towers per worker; with ``device_type='CPU'`` at least this many
        CPU devices are asked for.
      device_type: ``'CPU'`` or ``'GPU'``.
      jobs: ``(job, task)`` of every worker in rank order, or None for one worker.
      rank: this worker's index in ``jobs``.
      config: a ``ConfigProto`` to start from (copied).
      visible_gpus: ``gpu_options.visible_device_list`` (``'2,3'``), or None
        to leave it as ``config`` has it.
      gpu_memory_growth: ``gpu_options.allow_growth``, or None to leave it.

    Returns:
      A ``ConfigProto`` with, for several workers,
      ``experimental.collective_group_leader`` set to worker 0 and
      ``device_filters`` set to this task (each session sees only its own
      devices, so creating it never waits for the other workers).
    """
    new_config = tf1.ConfigProto()
    if config is not None:
        new_config.CopyFrom(config)
    if device_type == 'CPU':
        new_config.device_count['CPU'] = max(towers, new_config.device_count.get('CPU', 1))
    if visible_gpus is not None:
        new_config.gpu_options.visible_device_list = visible_gpus
    if gpu_memory_growth is not None:
        new_config.gpu_options.allow_growth = gpu_memory_growth
    if jobs is not None and len(jobs) > 1:
        leader_job, leader_task = jobs[0]
        job, job_task = jobs[rank]
        new_config.experimental.collective_group_leader = \
            '/job:%s/replica:0/task:%d' % (leader_job, leader_task)
        del new_config.device_filters[:]
        new_config.device_filters.append('/job:%s/task:%d' % (job, job_task))
    return new_config


def _reachable(address, timeout=1.0):
    host, port = _parse_address(address, 'address')
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def unreachable_peers(cluster, settle=0.0):
    """The peers (``Cluster.describe`` strings) whose server does not accept connections.

    Args:
      cluster: a :class:`Cluster`.
      settle: while every peer still answers, probe again for up to this many
        seconds (a killed process's port closes only when its exit completes).
    """
    deadline = time.time() + settle
    while True:
        missing = [cluster.describe(r) for r in range(len(cluster.addresses))
                   if r != cluster.rank and not _reachable(cluster.addresses[r])]
        if missing or time.time() >= deadline:
            return missing
        time.sleep(0.25)


def wait_for_peers(cluster, timeout=None):
    """Waits until every peer's server accepts connections.

    Args:
      cluster: a :class:`Cluster`.
      timeout: seconds; None uses ``cluster.startup_timeout``.

    Raises:
      PeerMissingError: naming every worker that did not answer in time.
    """
    if cluster.num_workers <= 1:
        return
    timeout = cluster.startup_timeout if timeout is None else timeout
    deadline = time.time() + timeout
    pending = [r for r in range(cluster.num_workers) if r != cluster.rank]
    while True:
        pending = [r for r in pending if not _reachable(cluster.addresses[r])]
        if not pending:
            return
        if time.time() >= deadline:
            missing = [cluster.describe(r) for r in pending]
            raise PeerMissingError(
                '%s: %s did not answer within the start-up timeout of %g s. Start every worker '
                '(same host list, each with its own task index), or raise startup_timeout.'
                % (cluster.describe(cluster.rank), ', '.join(missing), timeout), missing)
        time.sleep(0.2)


def hard_exit(code):
    """Flushes stdout/stderr and ends the process now with ``os._exit(code)``.

    Use it after a :class:`ClusterError`: TensorFlow's server cannot be
    stopped and its collective executor stays aborted, and a normal
    interpreter shutdown with a server whose peers are gone may block or crash.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed streams must not keep us alive
            pass
    logging.shutdown()
    os._exit(code)


# --- collective keys -------------------------------------------------------------------

_GENERATIONS = weakref.WeakKeyDictionary()
_USED_KEYS = weakref.WeakKeyDictionary()
_NEXT_GENERATION = [0]
_LOCK = threading.Lock()


def _instance_key(graph, name, kind):
    """A key for one collective, unique in ``graph``; equal on every worker for the same build."""
    with _LOCK:
        if graph not in _GENERATIONS:
            _GENERATIONS[graph] = _NEXT_GENERATION[0]
            _NEXT_GENERATION[0] += 1
            _USED_KEYS[graph] = set()
        text = 'tf1_syncbn/workers/g%d/%s/%s' % (_GENERATIONS[graph], name, kind)
        if text in _USED_KEYS[graph]:
            raise ValueError('tf1_syncbn.distributed: the collective name %r is already used in '
                             'this graph; pass a distinct name= to each call.' % (name,))
        _USED_KEYS[graph].add(text)
    return stable_hash(text)


def _buckets(items, bucket_bytes):
    """Splits ``(key, tensor)`` items into runs of one dtype of at most ``bucket_bytes``.

    Items keep their order within a dtype; one tensor larger than a bucket gets
    its own bucket.
    """
    by_dtype = collections.OrderedDict()
    for item in items:
        by_dtype.setdefault(item[1].dtype.base_dtype, []).append(item)
    buckets = []
    for dtype, group in by_dtype.items():
        current, size = [], 0
        for item in group:
            nbytes = item[1].shape.num_elements() * dtype.size
            if current and size + nbytes > bucket_bytes:
                buckets.append((dtype, current))
                current, size = [], 0
            current.append(item)
            size += nbytes
        if current:
            buckets.append((dtype, current))
    return buckets


def _all_reduce_packed(tensors, cluster, key):
    """Sum over workers of a list of same-dtype tensors, with one packed all-reduce."""
    from tensorflow.python.ops import collective_ops
    with tf.control_dependencies(_step_watchdog(cluster)):
        flat = [tf.reshape(t, [-1]) for t in tensors]
        packed = flat[0] if len(flat) == 1 else tf.concat(flat, 0)
    summed = collective_ops.all_reduce(packed, cluster.num_workers, cluster.group_key, key,
                                       merge_op='Add', final_op='Id',
                                       communication_hint=cluster.communication_hint,
                                       timeout=op_timeout(cluster.collective_timeout))
    return summed


def _step_watchdog(cluster):
    """The step watchdog of this worker (see ``SyncRegistry.watchdog``), as control inputs."""
    from tf1_syncbn import _engine  # noqa: PLC0415
    return _engine.get_registry().watchdog(cluster.reduce_device, cluster.collective_timeout)


def _unpack(packed, shapes):
    sizes = [s.num_elements() for s in shapes]
    parts = [packed] if len(sizes) == 1 else tf.split(packed, sizes)
    return [tf.reshape(p, s) for p, s in zip(parts, shapes)]


def _check_static(tensor, what):
    if not tensor.shape.is_fully_defined():
        raise ValueError('tf1_syncbn.distributed: %s has the partly unknown shape %s; '
                         'cross-worker packing needs static shapes.' % (what, tensor.shape))


# --- gradients -------------------------------------------------------------------------

def _local_sum(grads, sparse_as_dense):
    """Sum of one variable's tower gradients: a Tensor, an IndexedSlices or None."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return None
    if not sparse_as_dense and all(isinstance(g, tf.IndexedSlices) for g in grads):
        if len(grads) == 1:
            return grads[0]
        return tf.IndexedSlices(tf.concat([g.values for g in grads], 0),
                                tf.concat([g.indices for g in grads], 0), grads[0].dense_shape)
    dense = [tf.convert_to_tensor(g) for g in grads]
    return dense[0] if len(dense) == 1 else tf.math.add_n(dense)


def _gather_slices(slices, cluster, name, index):
    """All-gathers an IndexedSlices over workers (padded when its length is dynamic)."""
    from tensorflow.python.ops import collective_ops
    graph = tf1.get_default_graph()
    w, gk, timeout = cluster.num_workers, cluster.group_key, op_timeout(cluster.collective_timeout)
    guard = _step_watchdog(cluster)

    def gather(t, kind):
        key = _instance_key(graph, name, '%s/%d' % (kind, index))
        with tf.control_dependencies(guard):
            t = tf.identity(t)
        return collective_ops.all_gather(t, w, gk, key,
                                         communication_hint=cluster.communication_hint,
                                         timeout=timeout)

    values, indices = slices.values, slices.indices
    if values.shape[:1].is_fully_defined():
        # Same static length on every worker (same graph): no padding needed.
        return tf.IndexedSlices(gather(values, 'values'), gather(indices, 'indices'),
                                slices.dense_shape)
    length = tf.shape(indices, out_type=tf.int32)[:1]
    lengths = gather(length, 'lengths')
    longest = tf.reduce_max(lengths)
    pad = longest - length[0]
    padded_values = tf.pad(values, [[0, pad]] + [[0, 0]] * (values.shape.rank - 1))
    padded_indices = tf.pad(indices, [[0, pad]])
    all_values = gather(padded_values, 'values')
    all_indices = gather(padded_indices, 'indices')
    keep = tf.reshape(tf.range(longest)[None, :] < lengths[:, None], [-1])
    return tf.IndexedSlices(tf.boolean_mask(all_values, keep),
                            tf.boolean_mask(all_indices, keep), slices.dense_shape)


def all_reduce_gradients(tower_grads, cluster=None, name='gradients',
                         bucket_bytes=DEFAULT_BUCKET_BYTES, sparse_as_dense=False):
    """Averages gradients over every tower of every worker.

    Each worker first sums its towers' gradients (in-graph), then packs the
    dense sums into buckets of at most ``bucket_bytes`` per dtype and runs one
    collective all-reduce per bucket across the workers (not one per
    variable), and finally divides by the number of towers of the whole
    cluster. With one worker this is :func:`tower.average_gradients`.

    ``IndexedSlices`` (sparse gradients, for example of ``tf.gather`` or an
    embedding lookup) stay sparse: the towers' slices are concatenated, then
    values and indices are all-gathered across workers (padded to the longest
    worker when their length is only known at run time, and the padding
    dropped), as Horovod does for sparse gradients. Repeated indices are
    summed by the optimizer, as for any ``IndexedSlices``. With
    ``sparse_as_dense=True`` they are densified and packed with the dense
    gradients instead, which is cheaper when the slices cover a large part of
    the variable.

    Args:
      tower_grads: one list of ``(gradient, variable)`` pairs per tower of
        this worker, as ``Optimizer.compute_gradients`` returns them, with
        the same variables in the same order in every tower (and on every
        worker). A gradient that is None on every tower stays None (the
        optimizer skips it); None on some towers counts as zero.
      cluster: the :class:`Cluster`; None for a single worker.
      name: distinguishes several calls in one graph (part of the collective
        instance keys).
      bucket_bytes: the most bytes of one packed all-reduce.
      sparse_as_dense: densify ``IndexedSlices`` before the all-reduce.

    Returns:
      A list of ``(gradient, variable)`` pairs: the average over
      ``cluster.num_towers`` towers.

    Raises:
      ValueError: when towers list different variables, when a dense gradient
        has no static shape (needed to pack it), or when ``name`` is used twice
        in the graph.

    Every collective carries ``cluster.communication_hint``.

    Hangs: the all-reduce waits for every worker; a worker that does not run
    the same step fails the others once their step has lasted
    ``cluster.collective_timeout`` seconds, counted from its start on each
    worker (``DeadlineExceededError``; :class:`WorkerSession` turns it into
    :class:`WorkerLostError`). A peer that pauses between steps (saving,
    evaluating) for longer than that fails the others the same way. With
    ``collective_timeout=0`` it waits forever.
    """
    tower_grads = check_tower_grads(tower_grads, 'all_reduce_gradients')
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError('all_reduce_gradients: bucket_bytes must be a positive int, got %r.'
                         % (bucket_bytes,))
    workers = 1 if cluster is None else cluster.num_workers
    num_towers = len(tower_grads) * workers
    variables = [v for _, v in tower_grads[0]]
    if workers == 1:
        return _average_local(tower_grads, sparse_as_dense)

    graph = tf1.get_default_graph()
    result = [None] * len(variables)
    with tf.device(cluster.reduce_device), tf1.name_scope('all_reduce_' + name):
        summed = [_local_sum([g[i][0] for g in tower_grads], sparse_as_dense)
                  for i in range(len(variables))]
        dense = []
        for i, s in enumerate(summed):
            if s is None:
                continue
            if isinstance(s, tf.IndexedSlices):
                gathered = _gather_slices(s, cluster, name, i)
                scale = tf.cast(1.0 / num_towers, gathered.values.dtype)
                result[i] = tf.IndexedSlices(gathered.values * scale, gathered.indices,
                                             gathered.dense_shape)
            else:
                if not s.shape.is_fully_defined() and variables[i].shape.is_fully_defined():
                    s = tf.reshape(s, variables[i].shape)
                _check_static(s, 'the gradient of %s' % variables[i].op.name)
                dense.append((i, s))
        for b, (dtype, bucket) in enumerate(_buckets(dense, bucket_bytes)):
            key = _instance_key(graph, name, 'bucket/%s/%d' % (dtype.name, b))
            packed = _all_reduce_packed([t for _, t in bucket], cluster, key)
            packed = packed * tf.cast(1.0 / num_towers, dtype)
            for (i, _), part in zip(bucket, _unpack(packed, [t.shape for _, t in bucket])):
                result[i] = part
    return list(zip(result, variables))


def _average_local(tower_grads, sparse_as_dense):
    """One worker: the classic in-graph average (``tower.average_gradients``)."""
    from tower import average_gradients
    if not sparse_as_dense:
        return average_gradients(tower_grads)
    densified = [[(None if g is None else tf.convert_to_tensor(g), v) for g, v in grads]
                 for grads in tower_grads]
    return average_gradients(densified)


def average_across_workers(values, cluster, name='metrics'):
    """The mean over workers of float tensors (losses, accuracies), in one all-reduce.

    Args:
      values: a list of float tensors with static shapes (cast to float32).
      cluster: the :class:`Cluster`; None or one worker returns ``values``
        cast to float32.
      name: distinguishes several calls in one graph.

    Returns:
      A list of float32 tensors, the element-wise mean over workers.

    Hangs: as :func:`all_reduce_gradients`.
    """
    values = [tf.cast(v, tf.float32) for v in values]
    if cluster is None or cluster.num_workers == 1:
        return values
    for v in values:
        _check_static(v, 'average_across_workers value %s' % v.name)
    with tf.device(cluster.reduce_device), tf1.name_scope('average_' + name):
        key = _instance_key(tf1.get_default_graph(), name, 'mean')
        packed = _all_reduce_packed(values, cluster, key) / float(cluster.num_workers)
        return _unpack(packed, [v.shape for v in values])


def broadcast_variables(variables, cluster, root=0, name='broadcast', timeout=None,
                        bucket_bytes=DEFAULT_BUCKET_BYTES):
    """An op that copies worker ``root``'s values of ``variables`` to every worker.

    Variables are packed per dtype into buckets of at most ``bucket_bytes``;
    each bucket is one collective broadcast (``CollectiveBcastSend`` on the
    root, ``CollectiveBcastRecv`` elsewhere). Run it on every worker at the
    same time, after initialization (and, on the root, after restoring a
    checkpoint); :class:`WorkerSession` does.

    Args:
      variables: the variables, in the same order on every worker (for
        example ``tf.compat.v1.global_variables()``); their shapes must be
        static.
      cluster: the :class:`Cluster`.
      root: the rank whose values are sent.
      name: distinguishes several calls in one graph.
      timeout: seconds the broadcast waits for the other workers (TensorFlow's
        per-op timeout, from the moment this worker's broadcast starts); None
        uses ``cluster.collective_timeout``; 0 or ``float('inf')`` wait forever.
      bucket_bytes: the most bytes of one broadcast.

    Every collective carries ``cluster.communication_hint``.

    Returns:
      An op (a no-op with one worker).

    Hangs: the broadcast waits for every worker, up to ``timeout``.
    """
    variables = list(variables)
    if cluster is None or cluster.num_workers == 1 or not variables:
        return tf.no_op(name='broadcast_' + name)
    if not 0 <= root < cluster.num_workers:
        raise ValueError('broadcast_variables: root must be in [0, %d), got %r.'
                         % (cluster.num_workers, root))
    from tensorflow.python.ops import collective_ops
    timeout = cluster.collective_timeout if timeout is None else validate_timeout(
        timeout, 'broadcast_variables')
    graph = tf1.get_default_graph()
    ops = []
    with tf.device(cluster.reduce_device), tf1.name_scope('broadcast_' + name):
        for v in variables:
            if not v.shape.is_fully_defined():
                raise ValueError('broadcast_variables: %s has the partly unknown shape %s.'
                                 % (v.op.name, v.shape))
        buckets = _buckets([(v, _ShapeOnly(v)) for v in variables], bucket_bytes)
        for b, (dtype, bucket) in enumerate(buckets):
            key = _instance_key(graph, name, 'bcast/%s/%d' % (dtype.name, b))
            shapes = [v.shape for v, _ in bucket]
            size = sum(s.num_elements() for s in shapes)
            if cluster.rank == root:
                flat = [tf.reshape(tf.convert_to_tensor(v), [-1]) for v, _ in bucket]
                packed = flat[0] if len(flat) == 1 else tf.concat(flat, 0)
                ops.append(collective_ops.broadcast_send(
                    packed, packed.shape, dtype, cluster.num_workers, cluster.group_key, key,
                    communication_hint=cluster.communication_hint, timeout=timeout))
            else:
                packed = collective_ops.broadcast_recv(
                    [size], dtype, cluster.num_workers, cluster.group_key, key,
                    communication_hint=cluster.communication_hint, timeout=timeout)
                for (v, _), value in zip(bucket, _unpack(packed, shapes)):
                    ops.append(tf1.assign(v, value))
        return tf.group(*ops)


class _ShapeOnly(object):
    """Stands in for a tensor in :func:`_buckets` (dtype and shape of a variable)."""

    def __init__(self, variable):
        self.dtype = variable.dtype.base_dtype
        self.shape = variable.shape


# --- optimizer -------------------------------------------------------------------------

def _is_tower_list(grads_and_vars):
    """True when ``grads_and_vars`` is a list of per-tower ``(grad, var)`` lists."""
    if not grads_and_vars:
        return False
    first = grads_and_vars[0]
    return isinstance(first, (list, tuple)) and len(first) > 0 and \
        isinstance(first[0], (list, tuple))


class DistributedOptimizer(tf1.train.Optimizer):
    """Wraps any ``tf.compat.v1.train.Optimizer`` to average gradients across workers.

    The counterpart of Horovod's ``DistributedOptimizer``, for in-graph towers:

    * one tower per worker (no :class:`tower.TowerContext`, or a context with
      one tower): ``compute_gradients`` returns gradients already averaged over
      the workers, so ``minimize`` works as with the wrapped optimizer;
    * several towers per worker: call ``compute_gradients`` in each tower (it
      returns the tower's own gradients) and pass the list of every tower's
      lists to ``apply_gradients``, which runs :func:`all_reduce_gradients`
      then the wrapped optimizer's ``apply_gradients``::

          opt = DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), cluster)
          tower_grads = call_for_each_tower(lambda: opt.compute_gradients(loss_fn()),
                                            cluster.tower_devices)
          train_op = opt.apply_gradients(tower_grads, global_step=global_step)

    To clip or otherwise transform the averaged gradients, call
    :func:`all_reduce_gradients` yourself and pass the result to the wrapped
    optimizer.

    Slots and variables are the wrapped optimizer's (``get_slot``,
    ``get_slot_names``, ``variables``), so checkpoints are the same.

    Args:
      optimizer: the ``tf.compat.v1.train.Optimizer`` to wrap.
      cluster: the :class:`Cluster`; None for a single worker.
      name: the name of the collectives (see :func:`all_reduce_gradients`);
        defaults to ``'Distributed' + optimizer.get_name()``.
      bucket_bytes, sparse_as_dense: as in :func:`all_reduce_gradients`.

    Hangs: as :func:`all_reduce_gradients`.
    """

    def __init__(self, optimizer, cluster=None, name=None, bucket_bytes=DEFAULT_BUCKET_BYTES,
                 sparse_as_dense=False):
        if not isinstance(optimizer, tf1.train.Optimizer):
            raise TypeError('DistributedOptimizer: optimizer must be a '
                            'tf.compat.v1.train.Optimizer, got %r.' % (optimizer,))
        name = name or 'Distributed' + optimizer.get_name()
        super().__init__(use_locking=False, name=name)
        self._optimizer = optimizer
        self._cluster = cluster
        self._bucket_bytes = bucket_bytes
        self._sparse_as_dense = sparse_as_dense
        self._tower_grads_pending = False
        self._calls = 0

    def _reduce(self, tower_grads):
        name = self.get_name() if self._calls == 0 else '%s_%d' % (self.get_name(), self._calls)
        self._calls += 1
        return all_reduce_gradients(tower_grads, self._cluster, name=name,
                                    bucket_bytes=self._bucket_bytes,
                                    sparse_as_dense=self._sparse_as_dense)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients: the tower's own inside towers, else averaged."""
        grads = self._optimizer.compute_gradients(*args, **kwargs)
        context = get_current_tower_context()
        if context is not None and context.total > 1:
            self._tower_grads_pending = True
            return grads
        return self._reduce([grads])

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Applies averaged gradients; a list of per-tower lists is all-reduced first."""
        grads_and_vars = list(grads_and_vars)
        if _is_tower_list(grads_and_vars):
            grads_and_vars = self._reduce(grads_and_vars)
        elif self._tower_grads_pending:
            raise ValueError(
                'DistributedOptimizer.apply_gradients: compute_gradients was called inside '
                'towers, which returns each tower\'s own gradients; pass the list of every '
                'tower\'s (gradient, variable) lists to apply_gradients so that they are '
                'averaged over towers and workers.')
        self._tower_grads_pending = False
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                               name=name)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self):
        return self._optimizer.variables()


# --- session ---------------------------------------------------------------------------

class _Watchdog(object):
    """Ends the process when a blocking call is still running after its deadline."""

    def __init__(self):
        self._cond = threading.Condition()
        self._deadline = None
        self._message = None
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, name='tf1_syncbn-watchdog',
                                        daemon=True)
        self._thread.start()

    def arm(self, seconds, message):
        with self._cond:
            self._deadline = time.time() + seconds
            self._message = message
            self._cond.notify()

    def disarm(self):
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def stop(self):
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()

    def _watch(self):
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.time()
                if left > 0:
                    self._cond.wait(left)
                    continue
                message = self._message() if callable(self._message) else self._message
                sys.stderr.write('tf1_syncbn: %s\n' % message)
                hard_exit(EXIT_STARTUP_HANG)


_NOISE = ('Graph execution error', 'Detected at node', 'File "', 'Node:', 'Original stack',
          'Recent warning', 'Additional GRPC', '[[', 'The error could be')
_KEYWORDS = ('ollective', 'ocket', 'onnect', 'timed out', 'eer', 'vailable', 'bort', 'ancel')


def _summarize(error):
    """One line of a TensorFlow error: its type and the line that says what happened."""
    lines = [l.strip() for l in str(getattr(error, 'message', error)).splitlines()]
    lines = [l for l in lines if l and not l.startswith(_NOISE) and not l.startswith('From /job')]
    best = next((l for l in lines if any(k in l for k in _KEYWORDS)), lines[0] if lines else '')
    return '%s: %s' % (type(error).__name__, best[:300])


_LOST_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                tf.errors.AbortedError, tf.errors.CancelledError)


class WorkerSession(object):
    """A session for one worker: start-up checks, identical start, chief-only checkpoints.

    On construction, in this order:

    1. builds, in ``graph``, the initializer, a :func:`broadcast_variables`
       op for ``variables`` (from worker 0) and a ``Saver`` when
       ``checkpoint_dir`` is given;
    2. waits until every peer's server accepts connections
       (:func:`wait_for_peers`; :class:`PeerMissingError` after
       ``cluster.startup_timeout`` seconds, naming the missing workers);
    3. creates the session on ``cluster.target`` and runs the initializer;
    4. on the chief only, restores the latest checkpoint in
       ``checkpoint_dir`` when there is one (and ``restore`` is True), or else
       calls ``init_fn(session)`` when given;
    5. runs the broadcast on every worker: every variable, the global step
       and optimizer slots included, becomes the chief's. So only the chief
       needs the checkpoint directory (no shared file system), and no worker
       depends on its seeds. The other workers reach it while the chief is
       still in step 4, so they wait for it up to ``startup_timeout +
       restore_timeout`` seconds, the chief up to ``startup_timeout``; past
       that, :class:`PeerMissingError`.

    Steps 3 to 5 run under a watchdog that ends the process with status
    :data:`EXIT_STARTUP_HANG` when they are still blocked ``hang_timeout +
    restore_timeout`` seconds later (TensorFlow waits forever for a group
    leader that disappeared after step 2, see the module docstring).

    :attr:`start_step` is the global step after start-up (the restored step,
    or 0): a job that feeds data by step resumes exactly where it stopped.

    Args:
      cluster: the :class:`Cluster` (one worker works too: no server).
      checkpoint_dir: where the chief saves (:meth:`save`) and restores from;
        None for no checkpoints.
      saver: the ``Saver``; None builds ``tf.compat.v1.train.Saver(max_to_keep=...)``
        over all saveable variables when ``checkpoint_dir`` is given.
      variables: the variables to broadcast; None means every global variable.
      init_op: None runs the global and local variable initializers.
      graph: the graph; None is the default graph.
      max_to_keep: checkpoints kept by the default saver.
      restore: False starts from the initializer (and ``init_fn``) even when
        ``checkpoint_dir`` holds a checkpoint.
      init_fn: called as ``init_fn(session)`` on the chief when nothing was
        restored, after the initializer and before the broadcast (for example
        to load pre-trained weights); the broadcast then carries its values.
      hang_timeout: seconds after which a start-up (steps 3 to 5) that is
        still blocked ends the process, plus ``restore_timeout``; None means
        ``2 * startup_timeout + 30``. Finite, > 0.
      restore_timeout: seconds the chief may spend in step 4 (restoring its
        checkpoint, or ``init_fn``) beyond ``startup_timeout`` before the
        other workers give up on it; finite, >= 0. Default
        :data:`DEFAULT_RESTORE_TIMEOUT` (600 s): too short a limit fails every
        restart of a job whose restore is slow, too long a one only delays the
        error when the chief freezes during start-up.

    Raises:
      ValueError: ``hang_timeout`` or ``restore_timeout`` not a finite number
        of seconds.
      PeerMissingError: see steps 2 and 5.

    Hangs: never; every start-up wait is bounded as above: at most
    ``startup_timeout`` (step 2), then ``hang_timeout + restore_timeout``
    (steps 3 to 5).
    """

    def __init__(self, cluster, checkpoint_dir=None, saver=None, variables=None, init_op=None,
                 graph=None, max_to_keep=5, restore=True, init_fn=None, hang_timeout=None,
                 restore_timeout=DEFAULT_RESTORE_TIMEOUT):
        if hang_timeout is not None:
            hang_timeout = _check_seconds(hang_timeout, 'WorkerSession', 'hang_timeout',
                                          allow_zero=False)
        self.restore_timeout = _check_seconds(restore_timeout, 'WorkerSession',
                                              'restore_timeout', allow_zero=True)
        self.cluster = cluster
        self._restore = restore
        self._init_fn = init_fn
        self.checkpoint_dir = checkpoint_dir
        self.graph = graph if graph is not None else tf1.get_default_graph()
        self.restored_from = None
        self.hang_limit = (2 * cluster.startup_timeout + 30 if hang_timeout is None
                           else hang_timeout) + self.restore_timeout
        self._session = None
        self._watchdog = None
        with self.graph.as_default():
            if init_op is None:
                init_op = tf.group(tf1.global_variables_initializer(),
                                   tf1.local_variables_initializer())
            if variables is None:
                variables = tf1.global_variables()
            self._broadcast = broadcast_variables(variables, cluster, name='initial_values',
                                                  timeout=self.broadcast_timeout)
            if saver is None and checkpoint_dir is not None:
                saver = tf1.train.Saver(max_to_keep=max_to_keep)
            self._saver = saver
            self._global_step = tf1.train.get_global_step()
        self._init_op = init_op
        self._watchdog = _Watchdog()
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def broadcast_timeout(self):
        """Seconds this worker's start-up broadcast waits for the others.

        ``startup_timeout`` on the chief; ``startup_timeout + restore_timeout``
        on the other workers, which wait there while the chief restores.
        """
        if self.cluster.is_chief:
            return self.cluster.startup_timeout
        return self.cluster.startup_timeout + self.restore_timeout

    def _start(self):
        cluster = self.cluster
        me = cluster.describe(cluster.rank)
        started = time.time()
        wait_for_peers(cluster)

        def stuck():
            missing = unreachable_peers(cluster)
            return ('%s: session start-up still blocked after %.0f s (%s). TensorFlow cannot '
                    'interrupt this wait; exiting with status %d.'
                    % (me, time.time() - started,
                       'not answering: ' + ', '.join(missing) if missing else
                       'every peer accepts connections', EXIT_STARTUP_HANG))

        self._watchdog.arm(self.hang_limit, stuck)
        restore_seconds = 0.0
        try:
            self._session = tf1.Session(cluster.target, graph=self.graph, config=cluster.config)
            self._session.run(self._init_op)
            if cluster.is_chief:
                restore_started = time.time()
                latest = None
                if self._restore and self.checkpoint_dir and self._saver is not None:
                    latest = tf1.train.latest_checkpoint(self.checkpoint_dir)
                if latest:
                    self._saver.restore(self._session, latest)
                    self.restored_from = latest
                    log.info('%s restored %s', me, latest)
                elif self._init_fn is not None:
                    self._init_fn(self._session)
                restore_seconds = time.time() - restore_started
            try:
                self._session.run(self._broadcast)
            except _LOST_ERRORS as e:
                if cluster.num_workers == 1:
                    raise
                missing = unreachable_peers(cluster)
                if cluster.is_chief:
                    within = 'the start-up timeout of %g s' % cluster.startup_timeout
                    if restore_seconds > self.restore_timeout:
                        within += (' (this worker spent %.0f s restoring its checkpoint or in '
                                   'init_fn, more than restore_timeout=%g s, so the others '
                                   'stopped waiting for it: raise restore_timeout)'
                                   % (restore_seconds, self.restore_timeout))
                else:
                    within = ('%g s (startup_timeout=%g s + restore_timeout=%g s allowed for the '
                              'chief\'s restore or init_fn)'
                              % (self.broadcast_timeout, cluster.startup_timeout,
                                 self.restore_timeout))
                raise PeerMissingError(
                    '%s: the other workers did not all join the start-up broadcast within %s '
                    '(%s; %s).'
                    % (me, within, _summarize(e),
                       'not answering now: ' + ', '.join(missing) if missing else
                       'every peer accepts connections'), missing) from None
        finally:
            self._watchdog.disarm()
        self.start_step = self.global_step() or 0

    @property
    def session(self):
        """The underlying ``tf.compat.v1.Session``."""
        return self._session

    def global_step(self):
        """The value of the graph's global step, or None without one."""
        if self._global_step is None:
            return None
        return int(self._session.run(self._global_step))

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """``Session.run``; a failed collective raises :class:`WorkerLostError`.

        Raises:
          WorkerLostError: a collective of this step failed or timed out (a
            worker died, froze, did not run the same step, or paused between
            two steps longer than the step deadline allows). The process's
            collective executor is then aborted: exit (:func:`hard_exit`) and
            restart the job, which resumes from the chief's checkpoint.

        Hangs: never with ``collective_timeout > 0``: the step fails once it
        has lasted ``collective_timeout`` seconds on this worker while a
        collective of it still waits, which includes the time a peer spends
        between its previous step and this one.
        """
        try:
            return self._session.run(fetches, feed_dict, options, run_metadata)
        except _LOST_ERRORS as e:
            if self.cluster.num_workers == 1:
                raise
            missing = unreachable_peers(self.cluster, settle=2.0)
            raise WorkerLostError(
                '%s: a worker was lost during training (%s; %s). Every worker stops: restart '
                'the job, which resumes from the chief\'s latest checkpoint.'
                % (self.cluster.describe(self.cluster.rank), _summarize(e),
                   'not answering: ' + ', '.join(missing) if missing else
                   'every peer still accepts connections, so one is frozen, stopped, failed '
                   'its step, or spent longer between two steps (saving, evaluating) than the '
                   'collective timeout of %g s allows' % self.cluster.collective_timeout)) from None

    def save(self, global_step=None):
        """Saves a checkpoint on the chief; does nothing elsewhere.

        Args:
          global_step: the step in the file name; None reads the global step.

        Returns:
          The checkpoint path on the chief, None on the other workers (or
          without ``checkpoint_dir``).
        """
        if not self.cluster.is_chief or self._saver is None or not self.checkpoint_dir:
            return None
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        step = self.global_step() if global_step is None else global_step
        return self._saver.save(self._session, os.path.join(self.checkpoint_dir, 'model.ckpt'),
                                global_step=step)

    def close(self):
        """Closes the session and stops the watchdog thread."""
        if self._session is not None:
            self._session.close()
            self._session = None
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

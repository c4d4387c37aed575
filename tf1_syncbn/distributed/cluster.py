"""This worker's view of the cluster: ``TF_CONFIG`` or a host list, its server, its session config.

:func:`setup_cluster` resolves the cluster (TensorFlow's own
``TFConfigClusterResolver``, or ``hosts`` and ``task``), picks this worker's
devices (with GPUs, its own GPUs among the workers of its host) and starts
its ``tf.distribute.Server``; :func:`session_config` is the ``ConfigProto``
every session of the worker uses."""

import logging
import math
import numbers
import os

import tensorflow as tf

from tf1_syncbn.backends import CollectiveBackend, stable_hash
from tf1_syncbn.distributed.gpus import local_rank, select_gpus
from tf1_syncbn.timeouts import validate_timeout

tf1 = tf.compat.v1
log = logging.getLogger('tf1_syncbn.distributed')

__all__ = ['Cluster', 'setup_cluster', 'session_config', 'local_rank',
           'DEFAULT_STARTUP_TIMEOUT', 'COMMUNICATION_HINTS']

#: Seconds to wait for every peer at start-up.
DEFAULT_STARTUP_TIMEOUT = 120.0
#: Values of ``communication_hint`` (TensorFlow's collective implementations).
COMMUNICATION_HINTS = ('auto', 'ring', 'nccl')

_TRAINING_JOBS = ('chief', 'worker')


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
            num_workers=self.num_workers, rank=self.rank)

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


def check_seconds(value, owner, name, allow_zero):
    """A finite number of seconds (> 0, or >= 0 with ``allow_zero``), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            math.isnan(value) or math.isinf(value) or value < 0 or \
            (value == 0 and not allow_zero):
        raise ValueError('%s: %s must be a finite number of seconds %s, got %r.'
                         % (owner, name, '>= 0' if allow_zero else '> 0', value))
    return float(value)


def parse_address(address, what):
    """``(host, port)`` of ``'host:port'`` (``[::1]:port`` too); ``what`` names it in errors."""
    if not isinstance(address, str) or ':' not in address:
        raise ValueError('%s: expected "host:port", got %r.' % (what, address))
    host, _, port = address.rpartition(':')
    if not host or not port.isdigit():
        raise ValueError('%s: expected "host:port", got %r.' % (what, address))
    return host.strip('[]'), int(port)


def _cluster_from_tf_config():
    """(cluster dict, job, task index) from TF_CONFIG; None when it names no cluster."""
    from tensorflow.python.distribute.cluster_resolver import (  # noqa: PLC0415 - TF-internal
        TFConfigClusterResolver)
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
        from tf1_syncbn.timeouts import DEFAULT_TIMEOUT  # noqa: PLC0415 - read at call time
        collective_timeout = DEFAULT_TIMEOUT
    collective_timeout = validate_timeout(collective_timeout, 'setup_cluster',
                                          'collective_timeout')
    startup_timeout = check_seconds(startup_timeout, 'setup_cluster', 'startup_timeout',
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
        gpus = select_gpus(towers, me, my_local_rank, config, os.environ,
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
            parse_address(h, 'setup_cluster: hosts')
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

"""All-reduce backends for synchronized statistics.

Each backend is one small object with the same two methods:

* ``group_size(towers)``: how many members the all-reduce has, given the
  number of towers built in this graph;
* ``all_reduce(tensor, key, direction)``: the element-wise sum of ``tensor``
  over every member, built on ``key.device``.

``key`` is a :class:`SyncKey`; ``direction`` is ``'forward'``, or
``'backward'`` for the first gradient built of the call and ``'backward/<k>'``
for the k-th after it (``tf1_syncbn._plan.backward_direction``). Every member
of a group must build the same keys, in any order; names and keys are derived
from layer names and directions, never from counters that differ between
towers or processes.

Choose a backend with the ``sync_statistics`` argument of the layers: a string
(``'collective'``, ``'nccl'``, ``'horovod'``, ``'auto'``), None, or a backend
object such as ``CollectiveBackend(timeout=30)``.
"""

import re
import warnings

import tensorflow as tf

from tf1_syncbn._keys import SyncKey, group_label, stable_hash
from tf1_syncbn.timeouts import (DEFAULT_TIMEOUT, op_timeout, stall_shutdown_seconds,
                                 validate_timeout)

__all__ = ['SyncBackend', 'SyncKey', 'CollectiveBackend', 'NcclBackend', 'HorovodBackend',
           'stable_hash', 'DEFAULT_TIMEOUT', 'op_timeout']


def device_type(device):
    """'GPU', 'CPU', ... for a canonical device string ('' when unplaced)."""
    return tf.DeviceSpec.from_string(device or '').device_type or ''


def physical_gpu_count():
    """The number of GPUs this process sees (after ``CUDA_VISIBLE_DEVICES``)."""
    return len(tf.config.list_physical_devices('GPU'))


def gpus_present():
    """Whether this process sees a physical GPU."""
    return physical_gpu_count() > 0


def local_gpu_count():
    """The GPU devices of this process: ``/gpu:0`` to ``/gpu:<count - 1>``.

    A physical GPU that ``tf.config.set_logical_device_configuration`` splits
    into ``k`` logical GPUs counts ``k`` times (one GPU can then hold several
    towers; give sessions the same split in
    ``gpu_options.experimental.virtual_devices``). Reading the configuration
    does not initialize the GPUs.
    """
    extra = 0
    for gpu in tf.config.list_physical_devices('GPU'):
        extra += max(len(tf.config.get_logical_device_configuration(gpu) or ()) - 1, 0)
    return physical_gpu_count() + extra


def _is_local(device):
    """Whether ``device`` names this process (no job, or ``/job:localhost``)."""
    job = tf.DeviceSpec.from_string(device or '').job
    return job in (None, 'localhost')


def check_local_gpu(layer, device, backend_name):
    """Raises ``ValueError`` when ``device`` names a GPU of this process that does not exist.

    The GPUs are counted by :func:`local_gpu_count` (logical GPUs included).

    With soft placement TensorFlow would quietly put such a tower on another
    device, where it shares the device of another member (the all-reduce
    would abort or wait for its timeout). Towers of other worker processes
    (``/job:...``) are not checked here: their process checks its own.
    """
    if device_type(device) != 'GPU' or not _is_local(device):
        return
    present = local_gpu_count()
    if not present:
        raise _missing_gpu_error(layer, device, backend_name)
    index = tf.DeviceSpec.from_string(device).device_index or 0
    if index >= present:
        raise ValueError(
            '%s: the tower is on %s, but this process sees %d GPU%s (GPU:0 to GPU:%d). Soft '
            'placement would put it on another device, where it cannot synchronize with the '
            "tower already there. Place tower i on '/gpu:<i>' with i < %d (check "
            'CUDA_VISIBLE_DEVICES), build fewer towers, or split a GPU into logical GPUs '
            '(tf.config.set_logical_device_configuration, and the same virtual_devices in '
            'the session config).'
            % (layer, device, present, '' if present == 1 else 's', present - 1, present))


def _missing_gpu_error(layer, device, backend_name):
    return ValueError(
        "%s: sync_statistics=%r, and the tower is on %s, but this machine has no GPU. "
        "Soft placement would put every tower on CPU:0, where towers cannot synchronize "
        "(the all-reduce would wait for its timeout). Place the towers on CPUs "
        "('/cpu:<i>', with tower.virtual_cpu_config(N) as the session config), run on "
        "a machine with GPUs, or pass sync_statistics=None for per-tower statistics."
        % (layer, backend_name, device))


class SyncBackend(object):
    """Interface of an all-reduce backend (see the module docstring)."""

    #: The string that selects this backend in ``sync_statistics``.
    name = None

    #: Whether a layer built outside any tower context, without ``num_dev``,
    #: may take itself for the only tower of its process (Horovod's
    #: one-process-per-device convention). Otherwise such a layer raises
    #: ``ValueError`` rather than guess the group and fall back to per-tower
    #: statistics.
    implicit_single_tower = False

    def group_size(self, towers):
        """Number of all-reduce members when ``towers`` towers are in this graph."""
        return towers

    def check(self, key):
        """Raises ``ValueError`` at graph build when ``key`` cannot work here."""
        del key

    def worker_rank(self):
        """This worker's rank (0 with one worker; None if unknown), for sync groups' numbering."""
        return 0

    def all_reduce_workers(self, tensor, key, direction):
        """The sum of ``tensor`` over one member per worker (each worker's main tower).

        Sync groups use it for the moving statistics of worker 0's group
        (:meth:`tf1_syncbn._plan.SyncPlan.main_group_statistics`).
        """
        raise NotImplementedError

    def step_timeout(self):
        """Seconds a step may run while one of this backend's all-reduces waits (0: no bound).

        The layers arm the step watchdog (:mod:`tf1_syncbn._guards`) with it
        before the step's first all-reduce; past it, the step fails with
        ``DeadlineExceededError``. Only collective ops can be aborted so: other
        backends return 0.
        """
        return 0.0

    def all_reduce(self, tensor, key, direction):
        """Returns the sum of ``tensor`` over all members."""
        raise NotImplementedError

    def __repr__(self):
        return '%s()' % type(self).__name__


class CollectiveBackend(SyncBackend):
    """TensorFlow collective ops (``CollectiveReduce``): CPU, GPU, and across workers.

    The group key is derived from the device type and the group size, the
    instance keys from the layer names, so that every tower (and every worker
    process running the same graph) agrees on them without communication.

    Args:
      timeout: seconds a training step may wait in its all-reduces before it
        fails with ``tf.errors.DeadlineExceededError``; this turns every
        mismatch that the graph builder cannot see (a tower that skips a layer
        at run time, update ops run without the forward pass of the other
        towers, a lost worker) into an error instead of a hang. The clock
        starts when the step starts on this host and is kept by one watchdog
        thread for the whole process (:mod:`tf1_syncbn.kernels`); without the
        compiled library, every collective op carries TensorFlow's own timeout
        instead (two sleeping threads per collective execution while it runs,
        which a network with hundreds of layers turns into thousands). None
        uses :data:`tf1_syncbn.timeouts.DEFAULT_TIMEOUT` (600 s, or
        ``$TF1_SYNCBN_TIMEOUT``); 0 or ``float('inf')`` wait forever; finite
        values are clamped to :data:`tf1_syncbn.timeouts.MAX_TIMEOUT`
        (see :func:`tf1_syncbn.timeouts.validate_timeout`).
      communication_hint: passed to TensorFlow (``'auto'``, ``'ring'`` or
        ``'nccl'``).
      num_workers: the number of worker processes that each build the same
        towers (multi-worker training); the group then spans
        ``towers * num_workers`` members. The session must be configured for
        collectives across processes (``experimental.collective_group_leader``).
      rank: this worker's rank (0 to ``num_workers - 1``, chief first), which
        sync groups (the layers' ``group_size``) need to number the towers
        globally; ``Cluster.backend()`` passes it. Not needed with one worker.
    """

    name = 'collective'

    def __init__(self, timeout=None, communication_hint='auto', num_workers=1, rank=None):
        timeout = DEFAULT_TIMEOUT if timeout is None else validate_timeout(
            timeout, 'CollectiveBackend')
        if communication_hint not in ('auto', 'ring', 'nccl'):
            raise ValueError("CollectiveBackend: communication_hint must be 'auto', 'ring' or "
                             "'nccl', got %r." % (communication_hint,))
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError('CollectiveBackend: num_workers must be a positive int, got %r.'
                             % (num_workers,))
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or
                                 not 0 <= rank < num_workers):
            raise ValueError('CollectiveBackend: rank must be an int in [0, num_workers=%d), '
                             'got %r.' % (num_workers, rank))
        self.timeout = timeout
        self.communication_hint = communication_hint
        self.num_workers = num_workers
        self.rank = rank

    def group_size(self, towers):
        return towers * self.num_workers

    def worker_rank(self):
        return 0 if self.num_workers == 1 else self.rank

    def group_key(self, key):
        return stable_hash('tf1_syncbn/group/%s/%d%s' % (device_type(key.device), key.group_size,
                                                         group_label(key)))

    def instance_key(self, key, direction):
        # Not the group's: a worker's session derives its collectives' step ids
        # from its graph's instance keys, which must match across workers.
        return stable_hash('tf1_syncbn/instance/%s/%s' % (key.name, direction))

    def all_reduce_workers(self, tensor, key, direction):
        # The group of every worker's tower of this index (one per worker).
        return self.all_reduce(tensor, key._replace(group_size=self.num_workers, members=None,
                                                    group=None), direction)

    def check(self, key):
        if key.group_size > 1 and not key.device:
            raise ValueError(
                "%s: sync_statistics='collective' needs each tower on its own device, but this "
                "tower has no device. Build towers under tf.device (for example with "
                "tower.call_for_each_tower)." % key.layer)
        if key.group_size > 1:
            check_local_gpu(key.layer, key.device, self.name)

    def step_timeout(self):
        return self.timeout

    def all_reduce(self, tensor, key, direction):
        from tensorflow.python.ops import collective_ops  # noqa: PLC0415 - TF-internal
        with tf.device(key.device):
            return collective_ops.all_reduce(
                tensor, key.group_size, self.group_key(key), self.instance_key(key, direction),
                merge_op='Add', final_op='Id', communication_hint=self.communication_hint,
                timeout=op_timeout(self.timeout))

    def __repr__(self):
        rank = ', rank=%d' % self.rank if self.rank is not None else ''
        return 'CollectiveBackend(timeout=%r, num_workers=%d%s)' % (self.timeout, self.num_workers,
                                                                    rank)


class NcclBackend(SyncBackend):
    """``NcclAllReduce`` between the GPUs of one process.

    Shared names are the layer names with tower prefixes stripped. NCCL has no
    CPU kernel and no timeout: a tower that does not run the layer makes the
    others wait forever. Statistics are packed in float64 and gradients in
    float32, so bfloat16 inputs work although NCCL has no bfloat16 reduction.
    """

    name = 'nccl'

    def check(self, key):
        if key.group_size <= 1:
            return
        if device_type(key.device) != 'GPU':
            raise ValueError(
                "%s: sync_statistics='nccl' needs every tower on a GPU, but this tower is on "
                "%r (NCCL has no CPU kernel). Use sync_statistics='collective' instead."
                % (key.layer, key.device or 'no device'))
        check_local_gpu(key.layer, key.device, self.name)

    def shared_name(self, key, direction):
        return re.sub(r'[^A-Za-z0-9_./-]', '_', 'tf1_syncbn/%s/%s%s' % (key.name, direction,
                                                                         group_label(key)))

    def all_reduce(self, tensor, key, direction):
        from tensorflow.python.ops import gen_nccl_ops  # noqa: PLC0415 - NCCL backend only
        with tf.device(key.device):
            return gen_nccl_ops.nccl_all_reduce(
                input=tensor, reduction='sum', num_devices=key.group_size,
                shared_name=self.shared_name(key, direction))


class HorovodBackend(SyncBackend):
    """``horovod.tensorflow.allreduce`` across the processes of a Horovod job.

    The group is every tower of every Horovod process (``hvd.size()``
    processes, each building the same ``towers`` towers; one, Horovod's
    convention, when the layer is built outside any tower). Horovod matches
    an all-reduce across processes by the op's full name, tower scope
    included, so with several towers per process tower ``t`` would meet only
    tower ``t`` of the other processes. The towers of a process therefore
    first sum over themselves with a collective op on their devices (one
    ``CollectiveReduce`` each way, as :class:`CollectiveBackend` builds it;
    each tower on its own device), and each tower then all-reduces that local
    sum across processes: every tower gets the sum over all towers of all
    processes. One tower per process: one ``HorovodAllreduce`` each way.

    Hangs: Horovod has no timeout, and the step watchdog cannot abort its
    ops (:meth:`step_timeout` is 0). A process that never submits an
    all-reduce that the others wait in (a layer skipped at run time, update
    ops run without the forward pass, different graphs) leaves them waiting
    until Horovod's stall inspector shuts Horovod down, which it does only
    when ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` is set (``horovodrun
    --stall-check-shutdown-time-seconds``; at least
    ``HOROVOD_STALL_CHECK_TIME_SECONDS``, default 60): every pending op then
    fails, after about the check time plus the shutdown time. Unset (Horovod's
    default), it logs the missing ranks and op names every check time and
    waits forever; the backend warns about that once per process. A process
    that exits or dies ends the job under ``horovodrun``, which terminates
    the others. The local collective of several towers carries
    :data:`DEFAULT_TIMEOUT` per op.
    """

    name = 'horovod'
    implicit_single_tower = True
    _warned_stall = False

    def __init__(self):
        try:
            import horovod.tensorflow as hvd  # noqa: PLC0415 - optional dependency
        except ImportError as e:
            raise ValueError("sync_statistics='horovod' needs horovod.tensorflow, which does "
                             "not import here (%s). Install horovod (make horovod) or choose "
                             "another backend." % e)
        self._hvd = hvd
        self._local = CollectiveBackend()
        if not HorovodBackend._warned_stall and not stall_shutdown_seconds():
            HorovodBackend._warned_stall = True
            warnings.warn(
                "sync_statistics='horovod': Horovod's stall shutdown is off, so a process "
                "that skips a synchronized layer leaves the others waiting forever (Horovod "
                "only logs the stall). Set HOROVOD_STALL_SHUTDOWN_TIME_SECONDS >= "
                "HOROVOD_STALL_CHECK_TIME_SECONDS (horovodrun "
                "--stall-check-shutdown-time-seconds) to turn it into an error.", UserWarning,
                stacklevel=2)

    def group_size(self, towers):
        return self._hvd.size() * towers

    def worker_rank(self):
        return self._hvd.rank()

    def check_groups(self, layer, groups, towers):
        """Raises ``ValueError`` for sync groups that span Horovod processes.

        Groups within one process are collectives among its towers (no
        Horovod op); groups across processes would need Horovod process sets,
        which must be registered when ``hvd.init`` runs, before the graph.
        """
        for members in groups:
            if len({m // towers for m in members}) > 1:
                raise ValueError(
                    "%s: sync_statistics='horovod' cannot synchronize the group of towers %s: "
                    'it spans Horovod processes (%d towers per process), and a group across '
                    'processes would need a Horovod process set, which hvd.init must register '
                    'before any graph is built. Use a group_size that divides the %d towers '
                    'of each process (each group is then a collective among its towers), '
                    'or run the workers with tf1_syncbn.distributed and CollectiveBackend, '
                    'whose groups may span workers.'
                    % (layer, list(members), towers, towers))

    def towers(self, key):
        """The number of towers per process in ``key``'s group."""
        return key.group_size // self._hvd.size()

    def check(self, key):
        if key.members is not None:
            self._local.check(key)
        elif self.towers(key) > 1:
            self._local.check(key._replace(group_size=self.towers(key)))

    def all_reduce_workers(self, tensor, key, direction):
        name = re.sub(r'[^A-Za-z0-9_.-]', '_', 'tf1_syncbn.%s.%s' % (key.name, direction))
        with tf.device(key.device):
            return self._hvd.allreduce(tensor, op=self._hvd.Sum, name=name)

    def all_reduce(self, tensor, key, direction):
        if key.members is not None:     # a group within this process (check_groups)
            return self._local.all_reduce(tensor, key._replace(name='horovod/' + key.name),
                                          direction)
        towers = self.towers(key)
        if towers > 1:
            local = key._replace(name='horovod/' + key.name, group_size=towers)
            tensor = self._local.all_reduce(tensor, local, direction)
        name = re.sub(r'[^A-Za-z0-9_.-]', '_', 'tf1_syncbn.%s.%s' % (key.name, direction))
        with tf.device(key.device):
            return self._hvd.allreduce(tensor, op=self._hvd.Sum, name=name)


_BY_NAME = {
    'collective': CollectiveBackend,
    'nccl': NcclBackend,
    'horovod': HorovodBackend,
}

VALID_NAMES = (None, 'auto') + tuple(_BY_NAME)


def resolve(spec, layer, device, towers, workers=1):
    """Turns a ``sync_statistics`` value into a backend object or None.

    Args:
      spec: None, a backend name, ``'auto'`` or a :class:`SyncBackend`.
      layer: the layer's name, for messages.
      device: this tower's canonical device string.
      towers: the number of members of the group, over every worker.
      workers: the number of worker processes the group spans (a
        ``tf.distribute`` multi-worker strategy; 1 elsewhere).

    Returns:
      A :class:`SyncBackend`, or None for per-tower statistics.

    ``'auto'`` picks None for a single member; across workers, collective
    ops (with the NCCL implementation on GPUs); within one process, ``'nccl'``
    when this tower is on a GPU *and* this process sees a physical GPU, and
    ``'collective'`` otherwise.
    """
    if spec is None or isinstance(spec, SyncBackend):
        return spec
    if not isinstance(spec, str):
        raise TypeError('%s: sync_statistics must be None, a string or a SyncBackend, got %r.'
                        % (layer, spec))
    name = spec.lower()
    on_gpu = device_type(device) == 'GPU' and gpus_present()
    if name == 'auto':
        if towers <= 1:
            return None
        if workers > 1:
            return CollectiveBackend(num_workers=workers,
                                     communication_hint='nccl' if on_gpu else 'auto')
        name = 'nccl' if on_gpu else 'collective'
    if name not in _BY_NAME:
        raise ValueError('%s: unknown sync_statistics=%r; use one of %s or a SyncBackend '
                         'object.' % (layer, spec, ', '.join(repr(v) for v in VALID_NAMES)))
    if name == 'collective':
        return CollectiveBackend(num_workers=workers)
    return _BY_NAME[name]()

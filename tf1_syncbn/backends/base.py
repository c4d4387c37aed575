"""What every all-reduce backend is and shares: :class:`SyncBackend`, :class:`SyncKey`.

Also the device helpers the backends check towers with; :class:`SyncKey`,
:func:`stable_hash` and :func:`group_label` (keys every process agrees on)
are defined in :mod:`tf1_syncbn.backends.keys`.
"""

import tensorflow as tf

from tf1_syncbn.backends.keys import SyncKey, deprecated_count, group_label, stable_hash

__all__ = ['SyncBackend', 'SyncKey', 'stable_hash', 'group_label', 'device_type',
           'physical_gpu_count', 'gpus_present', 'local_gpu_count', 'check_local_gpu']


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
    """Interface of an all-reduce backend (see :mod:`tf1_syncbn.backends`).

    A subclass defines :meth:`all_reduce` (and :meth:`all_reduce_workers` for
    sync groups across workers); :meth:`num_members`, :meth:`check`,
    :meth:`worker_rank` and :meth:`step_timeout` have defaults.

    Deprecated: the member count was called ``group_size`` before
    (``group_size(towers)``, ``group_size_attributes``, ``key.group_size``).
    A backend written against those names still works: the library calls its
    ``group_size(towers)`` where it does not define ``num_members``, reads its
    ``group_size_attributes`` where it does not set ``num_members_attributes``,
    and warns once, when the class is defined, with a ``DeprecationWarning``;
    calling ``backend.group_size(towers)`` warns and returns
    :meth:`num_members`.
    """

    #: The string that selects this backend in ``sync_statistics`` (also the
    #: audit's label of its all-reduces).
    name = None

    #: The TensorFlow op types of the all-reduce this backend builds itself.
    #: The layers' gradients treat them as constants
    #: (:mod:`tf1_syncbn._compute.gradients`), the audit recognizes a
    #: synchronized layer by them (:mod:`tf1_syncbn.audit.layers`).
    op_types = frozenset()

    #: ``{op type: attribute}`` of the op types that record their number of members
    #: (``CollectiveReduce``'s ``group_size``, ``NcclAllReduce``'s ``num_devices``).
    num_members_attributes = {}

    #: What every op type of the communication library behind it starts with
    #: (``'Collective'``): an exported inference graph holds none
    #: (:mod:`tf1_syncbn.export`), since none runs without this process.
    op_type_prefix = None

    #: Whether a layer built outside any tower context, without ``num_dev``,
    #: may take itself for the only tower of its process (Horovod's
    #: one-process-per-device convention). Otherwise such a layer raises
    #: ``ValueError`` rather than guess the group and fall back to per-tower
    #: statistics.
    implicit_single_tower = False

    def __init_subclass__(cls, **kwargs):
        """Keeps both names of the member count working in every subclass (see the class)."""
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if 'group_size' in own and 'num_members' not in own:
            deprecated_count('%s.group_size(towers)' % cls.__name__)
            cls.num_members = _calling(own['group_size'], None)
        elif 'num_members' in own and 'group_size' not in own:
            cls.group_size = _calling(own['num_members'], cls.__name__)
        if 'group_size_attributes' in own and 'num_members_attributes' not in own:
            deprecated_count('%s.group_size_attributes' % cls.__name__)
            cls.num_members_attributes = own['group_size_attributes']

    def num_members(self, towers):
        """Number of all-reduce members when ``towers`` towers are in this graph."""
        return towers

    def group_size(self, towers):
        """Deprecated: :meth:`num_members`."""
        deprecated_count('%s.group_size(towers)' % type(self).__name__)
        return SyncBackend.num_members(self, towers)

    @property
    def group_size_attributes(self):
        """Deprecated: :attr:`num_members_attributes`."""
        deprecated_count('%s.group_size_attributes' % type(self).__name__)
        return self.num_members_attributes

    def check(self, key):
        """Raises ``ValueError`` at graph build when ``key`` cannot work here."""
        del key

    def worker_rank(self):
        """This worker's rank (0 with one worker; None if unknown), for sync groups' numbering."""
        return 0

    def all_reduce_workers(self, tensor, key, direction):
        """The sum of ``tensor`` over one member per worker (each worker's main tower).

        Sync groups use it for the moving statistics of worker 0's group
        (:meth:`tf1_syncbn._sync.plan.SyncPlan.main_group_statistics`).
        """
        raise NotImplementedError

    def step_timeout(self):
        """Seconds a step may run while one of this backend's all-reduces waits (0: no bound).

        The layers arm the step watchdog (:mod:`tf1_syncbn._sync.guards`) with it
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


def _calling(method, deprecated):
    """``method`` under the member count's other name (deprecated: with its class's name).

    A class's old ``group_size`` serves as its ``num_members``; a class's
    ``num_members`` answers its deprecated ``group_size``, so that an old
    override's ``super().group_size(towers)`` reaches its parent's count.
    """
    def count(self, towers):
        if deprecated is not None:
            deprecated_count('%s.group_size(towers)' % deprecated)
        return method(self, towers)

    count.__name__ = 'group_size' if deprecated is not None else 'num_members'
    count.__doc__ = 'Deprecated: :meth:`num_members`.' if deprecated is not None else \
        method.__doc__
    return count

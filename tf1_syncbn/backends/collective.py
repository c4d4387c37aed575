"""The backend of TensorFlow's collective ops: :class:`CollectiveBackend`."""

import tensorflow as tf

from tf1_syncbn.backends.base import SyncBackend, check_local_gpu, device_type
from tf1_syncbn.backends.keys import group_label, stable_hash
from tf1_syncbn.timeouts import DEFAULT_TIMEOUT, op_timeout, validate_timeout

__all__ = ['CollectiveBackend']


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
    op_types = frozenset(['CollectiveReduce', 'CollectiveReduceV2'])
    num_members_attributes = {'CollectiveReduce': 'group_size'}
    op_type_prefix = 'Collective'

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

    def num_members(self, towers):
        return towers * self.num_workers

    def worker_rank(self):
        return 0 if self.num_workers == 1 else self.rank

    def group_key(self, key):
        return stable_hash('tf1_syncbn/group/%s/%d%s' % (device_type(key.device), key.num_members,
                                                         group_label(key)))

    def instance_key(self, key, direction):
        # Not the group's: a worker's session derives its collectives' step ids
        # from its graph's instance keys, which must match across workers.
        return stable_hash('tf1_syncbn/instance/%s/%s' % (key.name, direction))

    def all_reduce_workers(self, tensor, key, direction):
        # The group of every worker's tower of this index (one per worker).
        return self.all_reduce(tensor, key._replace(num_members=self.num_workers, members=None,
                                                    group=None), direction)

    def check(self, key):
        if key.num_members > 1 and not key.device:
            raise ValueError(
                "%s: sync_statistics='collective' needs each tower on its own device, but this "
                "tower has no device. Build towers under tf.device (for example with "
                "tower.call_for_each_tower)." % key.layer)
        if key.num_members > 1:
            check_local_gpu(key.layer, key.device, self.name)

    def step_timeout(self):
        return self.timeout

    def all_reduce(self, tensor, key, direction):
        from tensorflow.python.ops import collective_ops  # noqa: PLC0415 - TF-internal
        with tf.device(key.device):
            return collective_ops.all_reduce(
                tensor, key.num_members, self.group_key(key), self.instance_key(key, direction),
                merge_op='Add', final_op='Id', communication_hint=self.communication_hint,
                timeout=op_timeout(self.timeout))

    def __repr__(self):
        rank = ', rank=%d' % self.rank if self.rank is not None else ''
        return 'CollectiveBackend(timeout=%r, num_workers=%d%s)' % (self.timeout, self.num_workers,
                                                                    rank)

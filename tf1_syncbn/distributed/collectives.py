"""Cross-worker collectives: packed gradient all-reduce, sparse gathers, broadcast, metrics.

Every collective here waits for this worker's step watchdog
(:mod:`tf1_syncbn._sync.guards`), which bounds the step by the cluster's
``collective_timeout``; without the compiled library each collective carries
TensorFlow's per-op timeout instead."""

import collections
import threading
import weakref

import tensorflow as tf

from tf1_syncbn._sync import guards as _guards
from tf1_syncbn.backends import stable_hash
from tf1_syncbn.timeouts import op_timeout, validate_timeout, watched
from tower.training import average_gradients, check_tower_grads

tf1 = tf.compat.v1

__all__ = ['all_reduce_gradients', 'average_across_workers', 'broadcast_variables',
           'DEFAULT_BUCKET_BYTES']

#: Bytes of gradients packed into one cross-worker all-reduce.
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024

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
    from tensorflow.python.ops import collective_ops  # noqa: PLC0415 - TF-internal
    flat = [tf.reshape(t, [-1]) for t in tensors]
    packed = flat[0] if len(flat) == 1 else tf.concat(flat, 0)
    guards = _step_watchdog(cluster)
    with tf.control_dependencies(guards), watched(bool(guards)):
        return collective_ops.all_reduce(packed, cluster.num_workers, cluster.group_key, key,
                                         merge_op='Add', final_op='Id',
                                         communication_hint=cluster.communication_hint,
                                         timeout=op_timeout(cluster.collective_timeout))


def _step_watchdog(cluster):
    """The step watchdog of this worker (:func:`tf1_syncbn._sync.guards.step_watchdog`), as ops.

    Empty without the compiled library or a timeout: the collectives then
    carry TensorFlow's per-op timeout (see :func:`tf1_syncbn.timeouts.op_timeout`).
    """
    return _guards.step_watchdog(cluster.reduce_device, cluster.collective_timeout)


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
    from tensorflow.python.ops import collective_ops  # noqa: PLC0415 - TF-internal
    graph = tf1.get_default_graph()
    guards = _step_watchdog(cluster)

    def gather(t, kind):
        key = _instance_key(graph, name, '%s/%d' % (kind, index))
        with tf.control_dependencies(guards), watched(bool(guards)):
            return collective_ops.all_gather(t, cluster.num_workers, cluster.group_key, key,
                                             communication_hint=cluster.communication_hint,
                                             timeout=op_timeout(cluster.collective_timeout))

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
    from tensorflow.python.ops import collective_ops  # noqa: PLC0415 - TF-internal
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

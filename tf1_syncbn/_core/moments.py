"""``tf1_syncbn.moments`` and ``weighted_moments``: ``tf.nn``'s, over every tower's batch.

For hand-written batch norm (``tf.nn.moments`` + ``tf.nn.batch_normalization``
or a formula of one's own, one's own ``gamma``/``beta`` and moving averages):
replacing ``tf.nn.moments`` by :func:`moments` makes the layer normalize with
the statistics of the global batch, as one device with the concatenated batch
would. The call goes through the core as a layer call does: its tower and
group (:func:`tf1_syncbn._sync.group.find_group`), its plan
(:func:`tf1_syncbn._sync.plan.plan_sync`: the registry, the run-time check, the
watchdog), the float64 combine of :mod:`tf1_syncbn._compute.math` and the
differentiable all-reduce of :func:`tf1_syncbn._compute.engine.all_reduce_with_gradient`.

Each tower reduces its batch around a shift taken from its own data (its
first element along the reduced axes: exact moments for data whose mean is
far larger than its spread), packs ``[n, n*mu, M2 + n*mu^2]`` in float64 and
all-reduces it once forward (and once backward: the gradient reaches every
tower's input). Empty towers add zeros. Every tower must all-reduce one
shape: towers whose kept dimensions differ are refused at graph build, or
fail the step before the all-reduce when the dimensions are not static
(:func:`tf1_syncbn._sync.member_shapes.checked_dims`). A bool tensor
``training`` puts the all-reduce in a ``tf.cond``: a run with it False
computes each tower's own moments, so it may fetch one tower alone. The
ops are built in a name scope
``moments`` (``weighted_moments``), as ``tf.nn``'s, where
:func:`tf1_syncbn.audit_graph` finds them and counts them to the layer of
the enclosing scope.
"""

import numpy as np
import tensorflow as tf

from tf1_syncbn._compute import math as _math
from tf1_syncbn._compute.engine import all_reduce_with_gradient
from tf1_syncbn._compute.xla import outside_xla_clusters
from tf1_syncbn._core.options import check_graph_mode, check_options
from tf1_syncbn._sync.group import check_untowered_copies, find_group
from tf1_syncbn._sync.member_shapes import RESTART, Messages, checked_dims
from tf1_syncbn._sync.plan import plan_sync
from tower.graph_state import full_name_scope

tf1 = tf.compat.v1

__all__ = ['moments', 'weighted_moments']

_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_SHAPES_SLOT = 'tf1_syncbn.moments_shapes'


@tf.autograph.experimental.do_not_convert     # (see tf1_syncbn._core)
def moments(x, axes, shift=None, keepdims=None, name=None, keep_dims=None, *, training=True,
            sync_statistics='auto', num_dev=None, group_size=None):
    """``tf.nn.moments``, with the mean and variance of the global batch over the towers.

    The same arguments and return values as ``tf.nn.moments``, in its (TF2)
    order ``(x, axes, shift, keepdims, name)``, and ``tf.compat.v1.nn.moments``'
    keyword ``keep_dims``; plus the layers' ``training``, ``sync_statistics``
    and ``num_dev``. When ``axes`` holds the batch axis 0, the mean and
    (biased) variance are those of the concatenation of every tower's batch
    along axis 0, as ``tf.nn.moments`` computes them on one device: uneven
    and empty towers included. Their gradients reach every tower's input
    (each tower's gradient is built with one all-reduce). Without axis 0
    nothing is synchronized: each example's statistics are its own, as on
    one device.

    The tower and its group are found as the layers find them: a
    :class:`tower.TowerContext` (``call_for_each_tower``), tensorpack's
    towers, a ``tf.distribute`` replica, or a ``tower_<i>`` / ``clone_<i>``
    name scope with ``num_dev``. Outside any tower (one device) it is
    ``tf.nn.moments``. It never falls back to one tower's statistics, silently
    or after a warning; at graph build, these raise: ``num_dev`` that
    disagrees with the towers, a backend asked for where the number of towers
    is unknown, ``'auto'`` in a tower name scope above ``tower_0`` without
    ``num_dev``, and the copies of one hand-written layer in a device loop the
    call cannot see (``tf.device`` with ``tf.variable_scope(..., reuse=i >
    0)``, no tower name scope, no ``num_dev``). Those copies are the training
    calls under one variable scope with one name (``bn/moments``: the same in
    every copy of a layer whose variable scope the loop reuses, while their
    name scopes differ): the one on a second device raises. ``num_dev=1``
    says they are one model split across devices on purpose,
    ``sync_statistics=None`` asks for per-device statistics.

    Args:
      x: a float16, bfloat16, float32 or float64 tensor of known rank; axis 0
        is the batch axis the towers split.
      axes: the axes to reduce (ints, negative from the end).
      shift: not used, as in ``tf.nn.moments`` (each tower shifts its data by
        a value of its own batch).
      keepdims: keep the reduced axes with length 1 (a bool or None).
      name: the name scope of the ops (default ``'moments'``). The audit
        recognizes the default, ``'moments'`` and ``'moments_<n>'``.
      keep_dims: TF1's name of ``keepdims`` (keyword only in practice:
        ``tf.compat.v1.nn.moments``' positional order differs).
      training: True (default): the statistics of the global batch; False:
        this tower's own (``tf.nn.moments``, no all-reduce); a scalar bool
        tensor chooses at run time (a ``tf.cond`` around the all-reduce), so
        that a run with it False (evaluation) may fetch one tower's output
        alone. Pass the layer's ``is_training`` tensor.
      sync_statistics: ``'auto'`` (default: synchronize over the towers it
        is built in, nothing with one tower), ``'collective'``, ``'nccl'``,
        ``'horovod'``, None (this tower's statistics, ``tf.nn.moments``) or a
        :class:`tf1_syncbn.SyncBackend`.
      num_dev: the number of towers, for ``tower_<i>`` / ``clone_<i>`` name
        scopes without a tower context.
      group_size: None (over every tower), or the statistics of each group of
        that many consecutive global towers, or explicit groups (lists of
        global tower indices); as for :func:`tf1_syncbn.sync_batch_norm`.

    Returns:
      ``(mean, variance)`` in the dtype of ``x`` (statistics computed in
      float32, float64 for float64 inputs, and combined in float64).

    Raises:
      TypeError: a non-float input; ``keepdims`` / ``keep_dims`` that are not
        bools or ``name`` that is not a string (TF1's positional order,
        ``tf.compat.v1.nn.moments(x, axes, shift, name, keep_dims)``: the
        message says what to pass by keyword); ``training`` that is neither
        a bool nor a scalar bool tensor.
      ValueError: ``keepdims`` and ``keep_dims`` that disagree; an unknown
        rank, an axis out of range; towers whose static non-reduced
        dimensions differ; and the layers' errors about towers and backends
        (naming ``tf1_syncbn.moments(<scope>)``).
      RuntimeError: eagerly or inside a ``tf.function``.

    At run time, towers whose non-reduced dimensions differ (not all known
    statically) fail the step with ``InvalidArgumentError`` naming the call
    and every tower's dimensions, before the all-reduce.

    Hangs: a synchronized call waits in its all-reduce for every tower of its
    group, and its gradient in a second one: every tower must run it in the
    same ``session.run`` (and build the same gradients through it); a run
    that fetches one tower's output alone waits for the others unless
    ``training`` is False in it. The collective backend's timeout turns a
    missing tower into an error (docs/timeouts.md).
    """
    keepdims = _check_positional('moments', keepdims, name, keep_dims)
    return _sync_moments('moments', x, axes, None, keepdims, name, training,
                         sync_statistics, num_dev, group_size)


@tf.autograph.experimental.do_not_convert     # (see tf1_syncbn._core)
def weighted_moments(x, axes, frequency_weights, keepdims=None, name=None, keep_dims=None, *,
                     training=True, sync_statistics='auto', num_dev=None, group_size=None):
    """``tf.nn.weighted_moments``, over the global batch of the towers.

    As :func:`moments`, with ``frequency_weights`` (each tower's, broadcastable
    to its ``x``): the weighted mean ``sum(w * x) / sum(w)`` and variance
    ``sum(w * (x - mean)**2) / sum(w)`` of every tower's data together, 0
    where the total weight is 0 (as ``tf.nn.weighted_moments``). Gradients
    reach every tower's input and weights. The order is TF2's,
    ``(x, axes, frequency_weights, keepdims, name)``; TF1's
    ``tf.compat.v1.nn.weighted_moments(x, axes, frequency_weights, name,
    keep_dims)`` is refused as for :func:`moments`.

    Args:
      x, axes, keepdims, name, keep_dims, training, sync_statistics, num_dev, group_size:
        as for :func:`moments` (the default name is ``'weighted_moments'``).
      frequency_weights: a tensor broadcastable to ``x``.

    Returns:
      ``(weighted_mean, weighted_variance)`` in the dtype of ``x``.

    Raises:
      As :func:`moments`.

    Hangs: as :func:`moments`.
    """
    keepdims = _check_positional('weighted_moments', keepdims, name, keep_dims)
    return _sync_moments('weighted_moments', x, axes, frequency_weights, keepdims, name,
                         training, sync_statistics, num_dev, group_size)


#: Each function's positional order: TF2's (``tf.nn``, this module's) and TF1's.
_ORDERS = {
    'moments': ('x, axes, shift, keepdims, name', 'x, axes, shift, name, keep_dims'),
    'weighted_moments': ('x, axes, frequency_weights, keepdims, name',
                         'x, axes, frequency_weights, name, keep_dims'),
}
_BOOLS = (bool, np.bool_)


def _check_positional(kind, keepdims, name, keep_dims):
    """``keepdims`` as a bool, after refusing TF1's positional order.

    ``tf.compat.v1.nn.moments(x, axes, shift, name, keep_dims)`` puts the name
    where TF2's order has ``keepdims`` and ``keep_dims`` where it has the
    name: a string ``keepdims`` or a bool ``name`` is that order.
    """
    scope = full_name_scope()
    label = 'tf1_syncbn.%s(%s)' % (kind, '%s/%s' % (scope, kind) if scope else kind)
    tf2_order, tf1_order = _ORDERS[kind]
    orders = ('tf1_syncbn.%s takes TF2\'s order, tf.nn.%s(%s), not TF1\'s '
              'tf.compat.v1.nn.%s(%s)' % (kind, kind, tf2_order, kind, tf1_order))
    first = tf2_order.rsplit(', keepdims', 1)[0]
    if keepdims is not None and not isinstance(keepdims, _BOOLS):
        fix = ('name=%r' % (keepdims,) if isinstance(keepdims, str) else 'name=...') + (
            '' if name is None else ', keep_dims=%r' % (name,))
        raise TypeError(
            '%s: keepdims=%r is not a bool: %s, where the fourth positional argument is the '
            'name. Pass the name (and keep_dims) by keyword: tf1_syncbn.%s(%s, %s).'
            % (label, keepdims, orders, kind, first, fix))
    if keep_dims is not None and not isinstance(keep_dims, _BOOLS):
        raise TypeError('%s: keep_dims=%r is not a bool (keep_dims is TF1\'s name of keepdims).'
                        % (label, keep_dims))
    if name is not None and not isinstance(name, str):
        raise TypeError(
            '%s: name=%r is not a string: %s, where the fifth positional argument is '
            'keep_dims. Pass keep_dims (and the name) by keyword: tf1_syncbn.%s(%s, '
            'keep_dims=%r, name=...).' % (label, name, orders, kind, first, name))
    if keepdims is not None and keep_dims is not None and bool(keepdims) != bool(keep_dims):
        raise ValueError('%s: keepdims=%r and keep_dims=%r disagree (keep_dims is TF1\'s name of '
                         'keepdims): pass one of them.' % (label, keepdims, keep_dims))
    return bool(keepdims if keepdims is not None else keep_dims)


def _check_axes(label, axes, rank):
    axes = [axes] if isinstance(axes, int) else list(axes)
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
        raise TypeError('%s: axes must be ints, got %r.' % (label, axes))
    normalized = sorted({a + rank if a < 0 else a for a in axes})
    if any(not 0 <= a < rank for a in normalized) or len(normalized) != len(axes):
        raise ValueError('%s: invalid axes %r for an input of rank %d: each must lie in '
                         '[-%d, %d) and appear once.' % (label, axes, rank, rank, rank))
    return normalized


def _sync_moments(kind, x, axes, weights, keepdims, name, training, sync_statistics, num_dev,
                  group_size=None):
    check_graph_mode('tf1_syncbn.%s' % kind)
    with tf1.name_scope(name, kind, [x] + ([weights] if weights is not None else [])), \
            outside_xla_clusters():
        label = 'tf1_syncbn.%s(%s)' % (kind, full_name_scope() or kind)
        if isinstance(training, np.bool_):
            training = bool(training)
        options = check_options(label, arg_names={'is_training': 'training'},
                                is_training=training, num_dev=num_dev,
                                sync_statistics=sync_statistics, group_size=group_size)
        x = tf.convert_to_tensor(x)
        if x.dtype.base_dtype not in _DTYPES:
            raise TypeError('%s: x has dtype %s; moments need a float16, bfloat16, float32 or '
                            'float64 tensor (cast integers with tf.cast first).'
                            % (label, x.dtype.name))
        rank = x.shape.ndims
        if rank is None:
            raise ValueError('%s: x has an undefined rank; give it a static rank (for example '
                             'with tf.ensure_shape).' % label)
        axes = _check_axes(label, axes, rank)
        plan = None
        if 0 in axes and training is not False:
            # The variable scope names the call for the towers (it creates nothing).
            with tf1.variable_scope(name or kind, auxiliary_name_scope=False) as scope:
                group = find_group(options)
                plan = plan_sync(options, group)
        kept_axes = [a for a in range(rank) if a not in axes]
        kept = [tf.compat.dimension_value(x.shape[a]) for a in kept_axes]
        compute = tf.float64 if x.dtype.base_dtype == tf.float64 else tf.float32
        xc = tf.cast(x, compute)
        wc = None if weights is None else tf.cast(weights, compute) + tf.zeros_like(xc)
        count, shift, mean_s, m2 = _local(xc, axes, wc)
        if 0 in axes and training is not False:  # copies of one layer in an unnamed loop
            check_untowered_copies(options, group, scope.name, count, hand_written=True)
        reduced_shape = tf.shape(shift)          # the kept axes, 1 in the reduced ones
        size = tf.size(shift) if None in kept else _product(kept)
        flat = [tf.reshape(t, [-1]) for t in (count, shift, mean_s, m2)]
        packed = _math.pack_counted_moments(*flat)
        if plan is not None:
            def synchronized():
                with outside_xla_clusters():      # again in a tf.cond branch's graph
                    checked = checked_dims(plan, _SHAPES_SLOT, packed, kept,
                                           lambda: tf.gather(tf.shape(x), kept_axes),
                                           _shape_messages(label, axes), 'kept_shape')
                    return all_reduce_with_gradient(checked, plan)

            # A tensor `training`: the all-reduce runs only when it is True, so a
            # run with it False may fetch one tower alone (evaluation).
            packed = synchronized() if training is True else tf.cond(
                training, synchronized, lambda: tf.identity(packed), name='training')
        _, mean, variance = _math.unpack_counted_moments(packed, size)
        if keepdims:
            out_shape = reduced_shape
        else:
            out_shape = tf.gather(tf.shape(x), kept_axes)
        static = [1 if a in axes else tf.compat.dimension_value(x.shape[a]) for a in range(rank)]
        static = static if keepdims else kept
        outs = []
        for t, out_name in ((mean, 'mean'), (variance, 'variance')):
            t = tf.reshape(tf.cast(t, x.dtype.base_dtype), out_shape, name=out_name)
            t.set_shape(static)
            outs.append(t)
        return tuple(outs)


def _product(dims):
    out = 1
    for d in dims:
        out *= d
    return out


def _local(x, axes, weights):
    """This tower's count, shift, shifted mean and M2 over ``axes`` (kept axes of length 1).

    The shift is the first element along the reduced axes (zeros for an
    empty batch), without gradient; a zero count gives zeros.
    """
    first = x[tuple(slice(0, 1) if a in axes else slice(None) for a in range(x.shape.ndims))]
    shift = tf.stop_gradient(tf.reduce_sum(first, axes, keepdims=True))
    xs = x - shift
    if weights is None:
        dims = tf.gather(tf.shape(x), axes)
        count = tf.cast(tf.reduce_prod(dims), x.dtype) * tf.ones_like(shift)
        weighted = xs
    else:
        count = tf.reduce_sum(weights, axes, keepdims=True)
        weighted = weights * xs
    safe = tf.where(count > 0, count, tf.ones_like(count))
    mean_s = tf.where(count > 0, tf.reduce_sum(weighted, axes, keepdims=True) / safe,
                      tf.zeros_like(count))
    squares = tf.math.squared_difference(xs, mean_s)
    m2 = tf.reduce_sum(squares if weights is None else weights * squares, axes, keepdims=True)
    return count, shift, mean_s, m2


def _shape_messages(label, axes):
    """The messages of :func:`~tf1_syncbn._sync.member_shapes.checked_dims` for the kept dimensions.

    Every member all-reduces one statistic per kept position: the towers'
    dimensions outside ``axes`` must agree.
    """
    what = ('%s: the towers reduce inputs whose kept dimensions (those not in axes=%s) differ'
            % (label, axes))
    fix = ('The statistics of the global batch need the same dimensions in every tower except '
           'the batch axis 0, which the towers split: give every tower inputs of one shape '
           'apart from axis 0, or pass sync_statistics=None for each tower\'s own moments.')

    def refuse(first_tower, first_static, tower, static):
        return ValueError('%s: %s in tower %d, %s in tower %d. %s'
                          % (what, first_static, first_tower, static, tower, fix))

    def local(first_tower, first_static, tower, dims):
        return ['%s: tower %d has %s (static) and tower %d has:'
                % (what, first_tower, first_static, tower), dims,
                '%s %s' % (fix, RESTART % 'shapes')]

    def reduced(listed, row, per_member):
        data = ['%s in this step; their kept dimensions, %s:' % (what, listed)]
        for member, dims in enumerate(tf.unstack(tf.cast(per_member, tf.int64))):
            data += ['%s %d:' % (row, member), dims]
        return data + ['%s %s' % (fix, RESTART % 'shapes')]

    return Messages(refuse, local, reduced)

"""The moments of the global batch, for hand-written batch norm: :func:`global_moments`.

What :func:`tf1_syncbn.nn.moments` and ``weighted_moments`` (the front-end,
which checks the user's arguments) build through the core, as a layer call
does: its call site and group (:func:`tf1_syncbn._sync.group.find_call_site`),
its plan (:func:`tf1_syncbn._sync.plan.plan_sync`: the registry, the run-time
check, the watchdog), the float64 combine of :mod:`tf1_syncbn._compute.math`
and the differentiable all-reduce of
:func:`tf1_syncbn._compute.engine.all_reduce_with_gradient`.

Each tower reduces its batch around a shift taken from its own data (its
first element along the reduced axes: exact moments for data whose mean is
far larger than its spread), packs ``[n, n*mu, M2 + n*mu^2]`` in float64 and
all-reduces it once forward (and once backward: the gradient reaches every
tower's input). Empty towers add zeros. Every tower must all-reduce one
shape: towers whose kept dimensions differ are refused at graph build, or
fail the step before the all-reduce when the dimensions are not static
(:func:`tf1_syncbn._sync.member_shapes.checked_dims`). A bool tensor
``training`` puts the all-reduce in a ``tf.cond``: a run with it False
computes each tower's own moments, so it may fetch one tower alone.
"""

import contextlib

import tensorflow as tf

from tf1_syncbn._compute import math as _math
from tf1_syncbn._compute.engine import all_reduce_with_gradient
from tf1_syncbn._compute.xla import outside_xla_clusters
from tf1_syncbn._sync.group import check_untowered_copies, find_call_site
from tf1_syncbn._sync.member_shapes import RESTART, Messages, checked_dims
from tf1_syncbn._sync.plan import plan_sync

tf1 = tf.compat.v1

__all__ = ['moments_scope', 'global_moments']

_SHAPES_SLOT = 'tf1_syncbn.moments_shapes'


@contextlib.contextmanager
def moments_scope(name, default_name, values):
    """The name scope of a moments call (``'moments'`` as ``tf.nn``'s), outside XLA's clusters.

    Every op of the call, its checks' included, is built in it
    (:mod:`tf1_syncbn._compute.xla`).
    """
    with tf1.name_scope(name, default_name, values), outside_xla_clusters():
        yield


def global_moments(x, axes, weights, keepdims, options, label, scope_name):
    """The mean and variance of ``x`` over ``axes`` and, with axis 0, over every tower's batch.

    Built inside :func:`moments_scope`, from checked arguments.

    Args:
      x: a float tensor of known rank (float16, bfloat16, float32, float64).
      axes: the reduced axes, sorted, non-negative.
      weights: per-element frequency weights broadcastable to ``x``, or None.
      keepdims: a Python bool.
      options: the call's :class:`~tf1_syncbn._core.options.Options`
        (``is_training``: True, False or a scalar bool tensor).
      label: the call's name in messages (``'tf1_syncbn.moments(bn/moments)'``).
      scope_name: the variable scope that names the call for the towers
        (``name``, or ``'moments'``); it creates nothing.

    Returns:
      ``(mean, variance)`` in the dtype of ``x``.

    Raises:
      ValueError: towers whose static kept dimensions differ; the layers'
        errors about towers and backends.

    Hangs: a synchronized call waits in its all-reduce for every tower of its
      group, and its gradient in a second one (see :mod:`tf1_syncbn._sync.guards`).
    """
    training = options.is_training
    rank = x.shape.ndims
    plan = None
    if 0 in axes and training is not False:
        # The variable scope names the call for the towers (it creates nothing).
        with tf1.variable_scope(scope_name, auxiliary_name_scope=False) as scope:
            site = find_call_site(options)
            plan = plan_sync(options, site)
    kept_axes = [a for a in range(rank) if a not in axes]
    kept = [tf.compat.dimension_value(x.shape[a]) for a in kept_axes]
    compute = tf.float64 if x.dtype.base_dtype == tf.float64 else tf.float32
    xc = tf.cast(x, compute)
    wc = None if weights is None else tf.cast(weights, compute) + tf.zeros_like(xc)
    count, shift, mean_s, m2 = _local(xc, axes, wc)
    if 0 in axes and training is not False:  # copies of one layer in an unnamed loop
        check_untowered_copies(options, site, scope.name, count, hand_written=True)
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
        def local():
            with outside_xla_clusters():      # (as synchronized)
                return tf.identity(packed)

        packed = synchronized() if training is True else tf.cond(
            training, synchronized, local, name='training')
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

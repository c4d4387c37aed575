"""The synchronized computations: the fused op, and the differentiable all-reduce.

Every function here takes a :class:`~tf1_syncbn._plan.SyncPlan` (or None for
this tower's statistics alone) and builds its collectives with
:meth:`~tf1_syncbn._plan.SyncPlan.all_reduce`, after the step's guards.

* :func:`sync_normalize`, the fast path: one op with a custom gradient.
  Forward: local moments -> **one packed all-reduce** -> normalize. Backward:
  local ``sum(dy)``, ``sum(dy * xhat)`` -> **one packed all-reduce** (built on
  the forward op's device) -> input gradient. The per-tower steps come from
  the tower device's kernel set (:mod:`tf1_syncbn.kernel_sets`).
* :func:`global_moments`, for the options the fused op does not cover
  (batch weights, renorm, adjustment, ``fused=False``): differentiable global
  moments through :func:`all_reduce_with_gradient`, still one packed
  all-reduce each way.
* :func:`ghost_moments`, ghost batch norm: every virtual batch's moments in
  one packed all-reduce.
"""

import collections

import tensorflow as tf

from tf1_syncbn import _math
from tf1_syncbn._gradients import with_gradient

__all__ = ['sync_normalize', 'all_reduce_with_gradient', 'global_moments', 'ghost_moments',
           'GlobalMoments']


def _all_reduce(tensor, plan, direction):
    return tensor if plan is None else plan.all_reduce(tensor, direction)


def sync_normalize(x4, fmt, gamma, beta, epsilon, plan, kernels):
    """Batch norm with the statistics of the global batch, and its gradient.

    Args:
      x4: canonical 4-D view of the input (see :func:`_math.canonical_view`).
      fmt: ``'NHWC'`` or ``'NCHW'``.
      gamma, beta: float32 ``[C]`` tensors (ones/zeros when not learned).
      epsilon: Python float.
      plan: the call's :class:`~tf1_syncbn._plan.SyncPlan`, or None for this
        tower's batch alone.
      kernels: the tower device's kernel set (:func:`tf1_syncbn.kernel_sets.kernels_for`).

    Returns:
      ``(y4, moments)``: the normalized view and the global
      :class:`~tf1_syncbn._math.Moments` (no gradient). The gradient of
      ``y4`` reaches ``x4`` through both the normalization and the global
      statistics; ``gamma`` and ``beta`` receive this tower's share of their
      gradient (summing over towers gives the global gradient).

    Hangs: the all-reduces wait for every member of the plan's group (see
    :class:`~tf1_syncbn._plan.SyncPlan`).
    """
    device = plan.device if plan is not None else x4.device
    packed = kernels.moments(x4, fmt)
    packed_sum = _all_reduce(packed, plan, 'forward')
    y4, moments, saved = kernels.normalize(x4, packed_sum, gamma, beta, epsilon, fmt)

    def grad(dy4):
        with tf.device(device):
            grads, dgamma, dbeta, state = kernels.backward_local(dy4, x4, gamma, saved,
                                                                 epsilon, fmt)
            grads_sum = _all_reduce(grads, plan, 'backward')
            dx = kernels.backward_finish(state, dy4, x4, gamma, saved, grads_sum, epsilon,
                                         fmt)
        return dx, dgamma, dbeta

    y4, = with_gradient([y4], [x4, gamma, beta], grad, name='sync_batch_norm')
    return y4, moments


def all_reduce_with_gradient(tensor, plan):
    """A sum all-reduce whose gradient is the sum all-reduce of the incoming gradient.

    The backward all-reduce is keyed from the same call name and its build
    (:func:`tf1_syncbn._plan.backward_direction`), so every tower agrees on
    it. Without a plan, ``tensor`` itself.
    """
    if plan is None:
        return tensor

    def grad(dy):
        return [plan.all_reduce(dy, 'backward')]

    out, = with_gradient([plan.all_reduce(tensor, 'forward')], [tensor], grad,
                         name='all_reduce')
    return out


GlobalMoments = collections.namedtuple('GlobalMoments', ['mean', 'variance', 'count'])
GlobalMoments.__doc__ = """Global moments that carry gradients.

Attributes:
  mean: float32 ``[C]``, the global mean.
  variance: float32 ``[C]``, the global biased (weighted) variance.
  count: float32 scalar, the global element count (or total weight).
"""


def global_moments(x4, fmt, weights, plan, before=()):
    """Global (optionally weighted) moments built from differentiable ops.

    The caller normalizes with separate ops and TensorFlow differentiates
    through the moments, the float64 packing and
    :func:`all_reduce_with_gradient` (one packed all-reduce forward and one
    backward).

    Args:
      x4, fmt: the canonical view and its layout.
      weights: per-example weights, or None.
      plan: the call's :class:`~tf1_syncbn._plan.SyncPlan`, or None.
      before: tensors that must be computed before this tower's all-reduce
        starts (renorm's reads of its statistics: the main tower updates them
        only after the all-reduce, so after every tower has read them).

    Returns:
      :class:`GlobalMoments`.
    """
    channels = _math.channels_of(x4, fmt)
    shift = _math.batch_shift(x4, fmt)
    # Shift in float32: x - shift would round in float16/bfloat16.
    x32 = x4 if x4.dtype == _math.STAT_DTYPE else tf.cast(x4, _math.STAT_DTYPE)
    xs4 = x32 - tf.reshape(shift, _math.broadcast_shape(fmt, channels))
    count, mean_s, m2 = _math.weighted_local_moments(xs4, fmt, weights)
    with tf.control_dependencies(before):
        packed = _math.pack_moments(count, shift, mean_s, m2)
    packed = all_reduce_with_gradient(packed, plan)
    n64, mean64, var64 = _math.unpack_moments(packed, channels)
    return GlobalMoments(tf.cast(mean64, _math.STAT_DTYPE), tf.cast(var64, _math.STAT_DTYPE),
                         tf.cast(n64, _math.STAT_DTYPE))


def ghost_moments(x4, fmt, per_member, groups, plan, epsilon, strided=False):
    """Normalizes each virtual batch of ``x4`` by its own (global) statistics.

    This tower's batch is cut into ``groups`` virtual batches of
    ``per_member`` examples each: runs of consecutive examples (tensorpack's
    layout), or with ``strided`` every ``groups``-th example (example ``j``
    is in virtual batch ``j % groups``, tf.layers' layout). Virtual batch
    ``k`` spans the ``k``-th of every member of the plan's group. All groups'
    moments travel in one packed all-reduce.

    Returns:
      ``(mean, var, xhat4)``: per-virtual-batch mean and biased variance
      (``[groups, C]``, float32) and the normalized view.
    """
    channels = _math.channels_of(x4, fmt)
    dyn = tf.shape(x4)
    outer = [per_member, groups] if strided else [groups, per_member]
    batch_axis = 0 if strided else 1         # the axis that runs through one virtual batch
    if fmt == 'NHWC':
        spatial = dyn[1] * dyn[2]
        xg = tf.reshape(x4, tf.stack(outer + [spatial, channels]))
        axes = [batch_axis, 2]
        first = xg[0, :, 0, :] if strided else xg[:, 0, 0, :]
        gshape = tf.stack(([1, groups] if strided else [groups, 1]) + [1, channels])
    else:
        spatial = dyn[2] * dyn[3]
        xg = tf.reshape(x4, tf.stack(outer + [channels, spatial]))
        axes = [batch_axis, 3]
        first = xg[0, :, :, 0] if strided else xg[:, 0, :, 0]
        gshape = tf.stack(([1, groups] if strided else [groups, 1]) + [channels, 1])
    shift = tf.stop_gradient(tf.cast(first, _math.STAT_DTYPE))             # [G, C]
    xs = tf.cast(xg, _math.STAT_DTYPE) - tf.reshape(shift, gshape)
    count = tf.cast(per_member * spatial, _math.STAT_DTYPE)
    mean_s = tf.reduce_mean(xs, axes)                                      # [G, C]
    m2 = tf.reduce_sum(tf.square(xs - tf.reshape(mean_s, gshape)), axes)   # [G, C]
    n64 = tf.cast(count, _math.PACK_DTYPE) * tf.ones_like(tf.cast(mean_s[:, :1],
                                                                   _math.PACK_DTYPE))
    mu = tf.cast(shift, _math.PACK_DTYPE) + tf.cast(mean_s, _math.PACK_DTYPE)
    packed = tf.concat([n64, n64 * mu, tf.cast(m2, _math.PACK_DTYPE) + n64 * mu * mu], 1)
    packed = all_reduce_with_gradient(tf.reshape(packed, [-1]), plan)
    packed = tf.reshape(packed, tf.stack([groups, 1 + 2 * channels]))
    n = tf.maximum(packed[:, :1], 1.0)
    mean64 = packed[:, 1:1 + channels] / n
    var64 = tf.maximum(packed[:, 1 + channels:] / n - mean64 * mean64, 0.0)
    mean_rel = tf.cast(mean64 - tf.cast(shift, _math.PACK_DTYPE), _math.STAT_DTYPE)
    inv = tf.math.rsqrt(tf.cast(var64, _math.STAT_DTYPE) + epsilon)
    xhat = (xs - tf.reshape(mean_rel, gshape)) * tf.reshape(inv, gshape)
    xhat4 = tf.reshape(tf.cast(xhat, x4.dtype), dyn)
    return tf.cast(mean64, _math.STAT_DTYPE), tf.cast(var64, _math.STAT_DTYPE), xhat4

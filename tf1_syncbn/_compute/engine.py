"""The synchronized computations: the fused op, and the differentiable all-reduce.

Every function here takes a :class:`~tf1_syncbn._sync.plan.SyncPlan` (or None for
this tower's statistics alone) and builds its collectives with
:meth:`~tf1_syncbn._sync.plan.SyncPlan.all_reduce`, after the step's guards.

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

Gradients of every order. The all-reduce of :func:`all_reduce_with_gradient`
is differentiable to any order (its gradient is the same all-reduce of the
incoming gradient, itself differentiable), so the slow and ghost paths are,
through TensorFlow's own gradients of the other ops. The fast path's
gradient runs kernels without gradients; a gradient *of* that gradient (a
gradient penalty, WGAN-GP or R1, differentiating an input gradient again)
goes through a differentiable twin of the fast path instead
(:func:`_second_order`), built only when such a gradient is.
"""

import collections

import tensorflow as tf
from tensorflow.python.framework import func_graph

from tf1_syncbn._compute import math as _math
from tf1_syncbn._compute.gradients import with_gradient

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
      plan: the call's :class:`~tf1_syncbn._sync.plan.SyncPlan`, or None for this
        tower's batch alone.
      kernels: the tower device's kernel set (:func:`tf1_syncbn.kernel_sets.kernels_for`).

    Returns:
      ``(y4, moments)``: the normalized view and the global
      :class:`~tf1_syncbn._compute.math.Moments` (no gradient). The gradient of
      ``y4`` reaches ``x4`` through both the normalization and the global
      statistics; ``gamma`` and ``beta`` receive this tower's share of their
      gradient (summing over towers gives the global gradient).

    Hangs: the all-reduces wait for every member of the plan's group (see
    :class:`~tf1_syncbn._sync.plan.SyncPlan`).
    """
    # In a TF2 tf.cond branch, the gradient refers to the branch's own copies
    # of outer tensors (a gradient of the gradient loses track of outer ones).
    x4, gamma, beta = _in_this_graph(x4, gamma, beta)
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

        def grad_of_grad(inputs, ddx, ddgamma, ddbeta):
            dy4_, x4_, gamma_, beta_, packed_sum_ = inputs
            return _second_order(x4_, fmt, gamma_, beta_, epsilon, plan, packed_sum_, device,
                                 dy4_, (ddx, ddgamma, ddbeta)) + [None, None]

        return with_gradient([dx, dgamma, dbeta], [dy4, x4, gamma, beta, packed_sum],
                             grad_of_grad, name='sync_batch_norm_grad', with_inputs=True)

    y4, = with_gradient([y4], [x4, gamma, beta], grad, name='sync_batch_norm')
    return y4, moments


def _in_this_graph(*tensors):
    """``tensors``, captured into the current graph where it is a function graph (a TF2 branch)."""
    graph = tf.compat.v1.get_default_graph()
    if not isinstance(graph, func_graph.FuncGraph):
        return tensors
    return tuple(t if t.graph is graph else graph.capture(t) for t in tensors)


def _second_order(x4, fmt, gamma, beta, epsilon, plan, packed_sum, device, dy4, upstream):
    """The gradient of the fast path's gradient, through a differentiable twin of the fast path.

    The twin normalizes as :func:`sync_normalize` does, from separate ops and
    the differentiable all-reduce: its value reuses the forward all-reduce's
    result (``packed_sum``: no collective runs again), its gradients build
    backward all-reduces of their own. The fast path's gradient
    ``(dx, dgamma, dbeta)`` is the twin's vector-Jacobian product with
    ``dy4``; this differentiates that product.

    Args:
      upstream: the incoming gradients of ``(dx, dgamma, dbeta)``, None where
        none flows.

    Returns:
      The gradients of ``dy4``, ``x4`` and ``gamma``.

    Hangs: as :func:`sync_normalize`: every member builds the same gradients
      (each gradient build gets keys of its own, :func:`tf1_syncbn._sync.plan.backward_direction`).
    """
    with tf.device(device):
        # Partial derivatives: the twin is built on copies of dy4, x4 and gamma
        # with no path back to them. (dy4 itself depends on x4 and gamma through
        # the layer's output; the caller's gradient follows that path, once.)
        dy_c, x_c, gamma_c, beta_c = [tf.identity(tf.stop_gradient(t))
                                      for t in (dy4, x4, gamma, beta)]
        channels = _math.channels_of(x_c, fmt)
        moments = global_moments(x_c, fmt, None, plan, reduced=packed_sum)
        bshape = _math.broadcast_shape(fmt, channels)
        scale = tf.math.rsqrt(moments.variance + epsilon) * gamma_c
        xf = tf.cast(x_c, _math.STAT_DTYPE)
        y4 = (xf - tf.reshape(moments.mean, bshape)) * tf.reshape(scale, bshape) + \
            tf.reshape(beta_c, bshape)
        firsts = tf.gradients(y4, [x_c, gamma_c, beta_c], grad_ys=tf.cast(dy_c, y4.dtype),
                              unconnected_gradients='zero')
        pairs = [(first, dd) for first, dd in zip(firsts, upstream) if dd is not None]
        if not pairs:
            return [None, None, None]
        seconds = tf.gradients([first for first, _ in pairs], [dy_c, x_c, gamma_c],
                               grad_ys=[tf.cast(dd, first.dtype) for first, dd in pairs],
                               unconnected_gradients='zero')
        return [tf.cast(g, t.dtype) for g, t in zip(seconds, (dy4, x4, gamma))]


def _summed(tensor, plan, direction, reduced=None):
    """The sum all-reduce of ``tensor``, differentiable to every order.

    Its gradient is the sum all-reduce of the incoming gradient, built the
    same way, so a gradient of a gradient all-reduces again. ``reduced``: a
    sum of ``tensor`` over the group that is already computed (its value is
    returned, and no forward all-reduce is built).
    """
    def grad(dy):
        return [_summed(dy, plan, 'backward')]

    value = plan.all_reduce(tensor, direction) if reduced is None else reduced
    out, = with_gradient([value], [tensor], grad, name='all_reduce')
    return out


def all_reduce_with_gradient(tensor, plan, reduced=None):
    """A sum all-reduce whose gradient is the sum all-reduce of the incoming gradient.

    The backward all-reduces (of every order: the gradient is differentiable
    too) are keyed from the same call name and their build
    (:func:`tf1_syncbn._sync.plan.backward_direction`), so every tower agrees on
    them. Without a plan, ``tensor`` itself (or ``reduced``, with the
    gradient of ``tensor``).

    Args:
      tensor: the local tensor.
      plan: the call's :class:`~tf1_syncbn._sync.plan.SyncPlan`, or None.
      reduced: the group's sum of ``tensor``, when it is already computed:
        returned with ``tensor``'s gradient, and no forward all-reduce is built.
    """
    if plan is None:
        if reduced is None:
            return tensor
        out, = with_gradient([reduced], [tensor], lambda dy: [dy], name='local_sum')
        return out
    return _summed(tensor, plan, 'forward', reduced)


GlobalMoments = collections.namedtuple('GlobalMoments', ['mean', 'variance', 'count'])
GlobalMoments.__doc__ = """Global moments that carry gradients.

Attributes:
  mean: float32 ``[C]``, the global mean.
  variance: float32 ``[C]``, the global biased (weighted) variance.
  count: float32 scalar, the global element count (or total weight).
"""


def global_moments(x4, fmt, weights, plan, before=(), reduced=None):
    """Global (optionally weighted) moments built from differentiable ops.

    The caller normalizes with separate ops and TensorFlow differentiates
    through the moments, the float64 packing and
    :func:`all_reduce_with_gradient` (one packed all-reduce forward and one
    backward).

    Args:
      x4, fmt: the canonical view and its layout.
      weights: per-example weights, or None.
      plan: the call's :class:`~tf1_syncbn._sync.plan.SyncPlan`, or None.
      before: tensors that must be computed before this tower's all-reduce
        starts (renorm's reads of its statistics: the main tower updates them
        only after the all-reduce, so after every tower has read them).
      reduced: the group's packed moments, when an all-reduce already summed
        them (the fast path's): their value is used, with the gradient of
        these local moments (:func:`all_reduce_with_gradient`).

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
    packed = all_reduce_with_gradient(packed, plan, reduced)
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

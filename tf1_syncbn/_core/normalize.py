"""The computations of one call: training (fast, slow, ghost, renorm) and inference.

:func:`train` picks the path for the options and computes the output with
batch statistics of the plan's group; :func:`infer` computes it with the
moving statistics. Both take the input and the variables as arguments; the
synchronization comes in as a :class:`~tf1_syncbn._sync.plan.SyncPlan` (or None),
which every training path receives.

* fast: the fused synchronized op of :func:`tf1_syncbn._compute.engine.sync_normalize`
  (one packed all-reduce each way), or one ``FusedBatchNormV3`` without
  synchronization;
* slow (batch weights, renorm, adjustment, ``fused=False``): differentiable
  global moments and separate ops;
* ghost (``virtual_batch_size``): every virtual batch by its own statistics.

Gradients handed out. The gradient each tower hands to ``gamma`` and
``beta`` is a buffer that no other op of the step reads (see
:func:`_own_gradient_buffer`): TensorFlow sums the towers' gradients of a
variable with ``AddN``, whose order of summation, and so its last bit,
depends on which of its inputs no other op still holds when it runs.
"""

import collections

import tensorflow as tf

from tf1_syncbn import kernel_sets
from tf1_syncbn._compute import engine as _engine
from tf1_syncbn._compute import math as _math
from tf1_syncbn._core.variables import read
from tf1_syncbn._sync import ghost_batches as _ghost_batches

tf1 = tf.compat.v1

__all__ = ['BatchStats', 'train', 'infer', 'needs_slow_path']


class BatchStats(collections.namedtuple('BatchStats', ['mean', 'variance', 'count', 'renorm',
                                                       'bessel'])):
    """What one training step feeds the moving averages (no gradient).

    Attributes:
      mean: float32 ``[C]``, the global batch mean.
      variance: float32 ``[C]``, the global batch variance: Bessel-corrected
        when ``bessel``, else biased (or weighted).
      count: float32 scalar, elements per channel in the global batch (or
        total weight); 0 means an empty global batch: nothing is updated.
      renorm: ``(mean, stddev)`` for the renorm statistics, or None.
      bessel: whether ``variance`` is already the unbiased one.
    """


def needs_slow_path(options, weights):
    """Whether the options need separate ops (the fused op does not cover them)."""
    return (weights is not None or options.fused is False or options.renorm or
            options.adjustment is not None)


def _restore(y4, x):
    """Reshapes a canonical view back to the shape of ``x`` (free when rank 4)."""
    if y4.shape.ndims == x.shape.ndims:
        return y4
    y = tf.reshape(y4, tf.shape(x))
    y.set_shape(x.shape)
    return y


def _vector(value, default):
    """A float32 [C] tensor for an optional variable (beta/gamma)."""
    return default if value is None else read(value)


_OWN_BUFFER_GRADIENT = 'Tf1SyncbnOwnBufferGradient'


@tf.RegisterGradient(_OWN_BUFFER_GRADIENT)
def _own_buffer_gradient(op, grad):
    del op
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.convert_to_tensor(grad)
    # Snapshot copies a buffer that another op still holds, and hands on one
    # that nothing else holds as it is (no copy): its output is always its own.
    # Its derivative is Identity's (a gradient of this gradient goes through).
    with tf1.get_default_graph().gradient_override_map({'Snapshot': 'Identity'}):
        return tf.raw_ops.Snapshot(input=grad, name='own_buffer')


def _own_gradient_buffer(vector):
    """``vector``, whose gradient is a buffer that no other op reads.

    On the slow path, ``beta``'s gradient is the gradient of ``offset * gamma
    + beta``, one buffer that the gradient of ``gamma`` reads too. TensorFlow
    sums the towers' gradients of a variable (``tf.gradients`` over a loss
    of every tower, ``average_gradients``, ``Optimizer.compute_gradients``)
    with ``AddN``, which accumulates into the first input that no other op
    still holds and moves it to the front: with 3 towers or more, the order
    of summation then depends on which ops ran first, and identical steps
    gave gradients a rounding apart (1 ulp of ``beta``'s gradient, in both
    TF behaviours, whenever anything else ran in the same step, such as an
    optimizer's updates). A copy where the buffer is shared (none where it
    is not) makes every tower's gradient a buffer of its own, so ``AddN``
    always sums in the order of its inputs. (``gamma``'s gradient, the sum
    of its two uses, is a buffer of its own already; it goes through the
    same, so that a change of the formula cannot bring the race back.)
    """
    with tf1.get_default_graph().gradient_override_map({'Identity': _OWN_BUFFER_GRADIENT}):
        return tf.identity(vector, name='own_gradient')


def _gamma_beta(layout, params):
    ones = tf.ones([layout.channels], tf.float32)
    zeros = tf.zeros([layout.channels], tf.float32)
    return _vector(params.gamma, ones), _vector(params.beta, zeros)


def train(x, layout, options, params, plan, weights=None, renorm_reads=None):
    """The output with batch statistics of the plan's group (or this tower's).

    Args:
      x: the input (checked by :func:`tf1_syncbn._core.options.check_inputs`).
      layout: its :class:`~tf1_syncbn._core.options.Layout`.
      options: the call's :class:`~tf1_syncbn._core.options.Options`.
      params: the layer's :class:`~tf1_syncbn._core.variables.Params`.
      plan: a :class:`~tf1_syncbn._sync.plan.SyncPlan`, or None.
      weights: per-example ``batch_weights``, or None.
      renorm_reads: with ``options.renorm``, ``(renorm_mean, renorm_stddev)``
        as :func:`tf1_syncbn._core.updates.read_renorm_statistics` read them.

    Returns:
      ``(y, stats)``: the output (shape and dtype of ``x``) and the
      :class:`BatchStats` that feed the moving averages.
    """
    x4, fmt = _math.canonical_view(x, layout.channels_last)
    gamma, beta = _gamma_beta(layout, params)
    if options.virtual_batch_size is not None:
        return _ghost(x, x4, fmt, layout, options, gamma, beta, plan)
    if needs_slow_path(options, weights):
        return _slow(x, x4, fmt, layout, options, gamma, beta, plan, weights, renorm_reads)
    if plan is None:
        y4, mean, var_unbiased = _math.fused_train(x4, gamma, beta, options.epsilon, fmt)
        count = _math.count_per_channel(x4, fmt)
        return (_restore(y4, x), BatchStats(tf.stop_gradient(mean),
                                            tf.stop_gradient(var_unbiased), count, None, True))
    y4, moments = _engine.sync_normalize(x4, fmt, gamma, beta, options.epsilon, plan,
                                         kernel_sets.kernels_for(plan.device))
    return (_restore(y4, x),
            BatchStats(moments.mean, moments.variance, moments.count, None, False))


def _slow(x, x4, fmt, layout, options, gamma, beta, plan, weights, renorm_reads):
    """Differentiable global moments through a differentiable all-reduce, separate ops.

    The output is ``(x - mean) * (rsqrt(var + eps) * scale) + offset``, the
    formula of :func:`infer` with ``fused=False``: once the moving statistics
    equal the batch's, training and inference outputs agree to the last bit
    (slim's ``testNoneUpdatesCollectionIsTrainingVariable``). ``x - mean`` is
    exact for data near the mean; the moments themselves are computed around
    a shift (:func:`tf1_syncbn._compute.engine.global_moments`).
    """
    gamma, beta = _own_gradient_buffer(gamma), _own_gradient_buffer(beta)
    # The renorm statistics are read before this tower's all-reduce (and before
    # every update of them: read_renorm_statistics).
    moments = _engine.global_moments(x4, fmt, weights, plan, before=renorm_reads or ())
    oshape = _math.layout_broadcast_shape(layout.rank, layout.channels_last, layout.channels)
    scale = tf.ones(oshape, tf.float32)
    offset = tf.zeros(oshape, tf.float32)
    renorm_stats = None
    if options.renorm:
        r, d, renorm_stats = _renorm_correction(options, renorm_reads, moments.mean,
                                                moments.variance)
        scale, offset = tf.reshape(r, oshape), tf.reshape(d, oshape)
    if options.adjustment is not None:
        adj_scale, adj_bias = options.adjustment(tf.shape(x))
        adj_scale = tf.cast(adj_scale, tf.float32)
        adj_bias = tf.cast(adj_bias, tf.float32)
        scale, offset = scale * adj_scale, offset * adj_scale + adj_bias
    g = tf.reshape(gamma, oshape)
    # Named as tf.nn.batch_normalization names it (slim's _testCreateOp(fused=False)).
    with tf.name_scope('batchnorm'):
        inv = tf.reshape(tf.math.rsqrt(moments.variance + options.epsilon), oshape)
        scale, offset = inv * scale * g, offset * g + tf.reshape(beta, oshape)
        # float16/bfloat16 inputs are normalized in float32 (and the gradients
        # of gamma and beta summed in float32), then rounded once.
        xf = x if x.dtype == tf.float32 else tf.cast(x, tf.float32)
        y = (xf - tf.reshape(moments.mean, oshape)) * scale + offset
        if y.dtype != x.dtype:
            y = tf.cast(y, x.dtype)
    # (With batch_weights the count is the total weight: zero updates nothing.)
    return y, BatchStats(tf.stop_gradient(moments.mean), tf.stop_gradient(moments.variance),
                         tf.stop_gradient(moments.count), renorm_stats, False)


def _ghost(x, x4, fmt, layout, options, gamma, beta, plan):
    """Ghost batch norm: each virtual batch is normalized by its own statistics.

    With a group of ``N`` members, every member contributes ``virtual_batch_size
    / N`` examples to each virtual batch, so it holds ``virtual_batch_size``
    examples in all; every member must then have the same local batch size.
    Two styles (``options.virtual_batch_style``):

    * ``'runs'`` (tensorpack): virtual batch ``k`` is the ``k``-th run of
      consecutive examples of every member; the moving statistics are the mean
      and (biased) variance of the first virtual batch;
    * ``'strided'`` (tf.layers): example ``j`` of a member is in virtual
      batch ``j % groups``, which over equal members is tf.layers' reshape of
      the concatenated batch to ``[virtual_batch_size, -1, ...]``; the moving
      statistics are the means over the virtual batches of their means and
      (biased) variances.
    """
    members = plan.num_members if plan is not None else 1
    vbs = options.virtual_batch_size
    name = options.arg('virtual_batch_size')
    if vbs % members:
        raise options.error('%s=%d is not a multiple of the %d members of the sync group; '
                            'each member contributes %s / %d examples to every virtual '
                            'batch.' % (name, vbs, members, name, members))
    per_member = vbs // members
    static_batch = tf.compat.dimension_value(x4.shape[0])
    if static_batch is not None and static_batch % per_member:
        if members == 1:
            raise options.error('%s=%d does not divide the batch size %d.'
                                % (name, vbs, static_batch))
        raise options.error('%s=%d does not divide the batch size %d: each of the %d '
                            'members of the sync group contributes %s / %d = %d examples to '
                            'every virtual batch, so its batch must be a multiple of %d.'
                            % (name, vbs, static_batch, members, name, members, per_member,
                               per_member))
    if plan is not None:
        x4 = _ghost_batches.checked_batch(options, plan, x4)
    batch = tf.shape(x4)[0]
    check = tf.debugging.assert_equal(
        tf.math.floormod(batch, per_member), 0,
        message='%s: %s=%d needs a local batch size divisible by %d'
        % (options.layer, name, vbs, per_member))
    with tf.control_dependencies([check]):
        x4 = tf.identity(x4)
    groups = batch // per_member
    strided = options.virtual_batch_style == 'strided'
    mean, var, xhat4 = _engine.ghost_moments(x4, fmt, per_member, groups, plan,
                                             options.epsilon, strided=strided)
    bshape = _math.broadcast_shape(fmt, layout.channels)
    y4 = xhat4 * tf.cast(tf.reshape(gamma, bshape), xhat4.dtype) + \
        tf.cast(tf.reshape(beta, bshape), xhat4.dtype)
    # Every member has the same batch size: an empty local batch is an empty
    # global one (count 0: nothing is updated).
    count = tf.cast(groups, tf.float32)
    if strided:
        moving_mean = tf.reduce_sum(mean, 0) / tf.maximum(count, 1.0)
        moving_var = tf.reduce_sum(var, 0) / tf.maximum(count, 1.0)
    else:      # the first virtual batch, or zeros when there is none
        zeros = tf.zeros([1, layout.channels], tf.float32)
        moving_mean = tf.concat([mean, zeros], 0)[0]
        moving_var = tf.concat([var, zeros], 0)[0]
    return (_restore(y4, x), BatchStats(tf.stop_gradient(moving_mean),
                                        tf.stop_gradient(moving_var), count, None, False))


def _renorm_correction(options, renorm_reads, mean, var):
    """Batch Renormalization's ``r`` and ``d`` (no gradient) from global moments.

    Args:
      renorm_reads: the values of ``renorm_mean`` and ``renorm_stddev`` read
        before the all-reduce.
    """
    stddev = tf.sqrt(var + options.epsilon)
    renorm_mean, renorm_stddev = renorm_reads
    renorm_stddev = tf.maximum(renorm_stddev, tf.sqrt(tf.constant(options.epsilon, tf.float32)))
    r = stddev / renorm_stddev
    d = (mean - renorm_mean) / renorm_stddev
    clip = options.renorm_clipping
    rmin, rmax, dmax = clip.get('rmin'), clip.get('rmax'), clip.get('dmax')
    if rmin is not None:
        r = tf.maximum(r, tf.cast(rmin, r.dtype))
    if rmax is not None:
        r = tf.minimum(r, tf.cast(rmax, r.dtype))
    if dmax is not None:
        dmax = tf.cast(dmax, d.dtype)
        d = tf.clip_by_value(d, -dmax, dmax)
    r, d = tf.stop_gradient(r), tf.stop_gradient(d)
    # The renorm statistics are updated in the same step: read them first.
    with tf.control_dependencies([r, d]):
        new_stats = (tf.identity(tf.stop_gradient(mean)), tf.identity(tf.stop_gradient(stddev)))
    return r, d, new_stats


def infer(x, layout, options, params):
    """The output with the moving statistics: one fused kernel (``fused=False``: separate ops)."""
    gamma, beta = _gamma_beta(layout, params)
    mean = read(params.moving_mean)
    variance = read(params.moving_variance)
    if options.fused is False:
        shape = _math.layout_broadcast_shape(layout.rank, layout.channels_last, layout.channels)
        with tf.name_scope('batchnorm'):     # as tf.nn.batch_normalization (and so slim)
            scale = tf.math.rsqrt(variance + options.epsilon) * gamma
            return ((x - tf.cast(tf.reshape(mean, shape), x.dtype)) *
                    tf.cast(tf.reshape(scale, shape), x.dtype) +
                    tf.cast(tf.reshape(beta, shape), x.dtype))
    x4, fmt = _math.canonical_view(x, layout.channels_last)
    # Named as tf.nn.fused_batch_norm (and so slim) names it.
    y4, _ = _math.normalize(x4, gamma, beta, mean, variance, options.epsilon, fmt,
                            name='FusedBatchNormV3')
    return _restore(y4, x)

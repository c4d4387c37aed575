"""Pure batch-norm math: statistics, their combination, normalize, backward.

Nothing here creates variables, reads a tower context or communicates. Every
function works on a *canonical view* of the input: a 4-D tensor in ``NHWC``
(channels last) or ``NCHW`` (channels first) layout, which the layer obtains by
a free reshape (see :func:`canonical_view`), so that TensorFlow's fused
kernels serve every rank and data format.

Numerics. Each tower shifts its data by a per-channel value taken from its
own batch (its first example) before computing moments, so that the moments
of data whose mean is far larger than its spread keep their precision. The
per-tower moments are then packed *in float64* as ``[n, n*mean, M2 + n*mean^2]``
for a single all-reduce (sum), which combines them without the catastrophic
cancellation of ``E[x^2] - E[x]^2`` in float32.
"""

import collections

import tensorflow as tf
from tensorflow.python.ops import gen_nn_ops

STAT_DTYPE = tf.float32
PACK_DTYPE = tf.float64


def canonical_view(x, channels_last):
    """Reshapes ``x`` (rank 2 to 5) to a 4-D view with the channels kept in place.

    Args:
      x: the input tensor, ``[N, ..., C]`` when ``channels_last`` else ``[N, C, ...]``.
      channels_last: the layout of ``x``; rank-2 inputs are always ``[N, C]``.

    Returns:
      ``(x4, fmt)``: a ``[N, S, 1, C]`` (``fmt='NHWC'``) or ``[N, C, S, 1]``
      (``fmt='NCHW'``) tensor, where ``S`` is the product of the spatial
      dimensions. No data moves: only the shape changes.
    """
    rank = x.shape.ndims
    if rank == 4:
        return x, ('NHWC' if channels_last else 'NCHW')
    dyn = tf.shape(x)
    static = x.shape.as_list()
    if rank == 2 or channels_last:
        chan = static[-1]
        spatial = static[1:-1]
        s = _prod(spatial, dyn[1:-1])
        return tf.reshape(x, tf.stack([dyn[0], s, 1, chan])), 'NHWC'
    chan = static[1]
    s = _prod(static[2:], dyn[2:])
    return tf.reshape(x, tf.stack([dyn[0], chan, s, 1])), 'NCHW'


def _prod(static_dims, dynamic_dims):
    if all(d is not None for d in static_dims):
        out = 1
        for d in static_dims:
            out *= d
        return out
    return tf.reduce_prod(dynamic_dims)


def channel_axis(fmt):
    """The channel axis of a canonical 4-D view."""
    return 3 if fmt == 'NHWC' else 1


def reduction_axes(fmt):
    """The axes reduced for per-channel statistics of a canonical view."""
    return [0, 1, 2] if fmt == 'NHWC' else [0, 2, 3]


def count_per_channel(x4, fmt):
    """Number of elements per channel of ``x4``, as a float32 scalar."""
    dyn = tf.shape(x4)
    axes = reduction_axes(fmt)
    return tf.cast(tf.reduce_prod(tf.gather(dyn, axes)), STAT_DTYPE)


def first_example(x4, fmt):
    """The first element of every channel, as a ``[1, 1, 1, C]`` / ``[1, C, 1, 1]`` slice.

    One ``StridedSlice``; for an empty batch the slice is empty too. Used as
    a per-channel shift: subtracting a value of the batch itself keeps the
    moments exact when ``|mean| >> std`` (Sterbenz), without a ``tf.cond``.
    """
    if fmt == 'NHWC':
        return x4[:1, :1, :1, :]
    return x4[:1, :, :1, :1]


def batch_shift(x4, fmt):
    """The first element of every channel as a float32 ``[C]`` vector, or zeros if empty.

    Returns:
      A float32 vector of shape ``[C]`` with no gradient.
    """
    first = tf.cast(first_example(x4, fmt), STAT_DTYPE)
    # Summing the (at most one-element) slice gives zeros for an empty batch.
    return tf.stop_gradient(tf.reduce_sum(first, [a for a in range(4) if a != channel_axis(fmt)]))


def channels_of(x4, fmt):
    """The static number of channels of a canonical view, as an int (None if unknown).

    Reads the dimension as an int in both TF behaviours (TF1 behaviour's
    ``Dimension`` objects are not hashable, nor usable as a shape entry).
    """
    return tf.compat.dimension_value(x4.shape[channel_axis(fmt)])


def vector_length(v):
    """The static length of a ``[C]`` vector, as an int."""
    return tf.compat.dimension_value(v.shape[0])


def broadcast_shape(fmt, channels):
    """The shape a ``[C]`` vector takes to broadcast against a canonical view."""
    return [1, 1, 1, channels] if fmt == 'NHWC' else [1, channels, 1, 1]


def shifted_moments(xs4, fmt):
    """Mean and Bessel-corrected variance of a shifted view, with one fused kernel.

    ``FusedBatchNormV3`` in training mode accumulates in float32 for
    float16/bfloat16 inputs, on every device and layout. For an empty batch
    its statistics are NaN: :func:`pack_shifted_moments` masks them.

    Returns:
      ``(mean, variance)``: float32 ``[C]``, the variance ``M2 / max(n - 1, 1)``.
    """
    channels = channels_of(xs4, fmt)
    ones = tf.ones([channels], STAT_DTYPE)
    zeros = tf.zeros([channels], STAT_DTYPE)
    empty = tf.zeros([0], STAT_DTYPE)
    _, mean, var, _, _, _ = gen_nn_ops.fused_batch_norm_v3(
        xs4, ones, zeros, empty, empty, epsilon=0.0, data_format=fmt, is_training=True,
        name='local_moments')
    return mean, var


def pack_shifted_moments(first, mean, var, size, fmt):
    """Packs a tower's moments, measured around its first example, for the sum all-reduce.

    A small-vector function (no full-size tensor): the portable kernel set
    compiles it with XLA into one op.

    Args:
      first: the first example's slice (:func:`first_example`), any float dtype;
        empty for an empty batch.
      mean: float32 ``[C]``, the mean of the data minus ``first``.
      var: float32 ``[C]``, their variance ``M2 / max(n - 1, 1)`` (NaN when empty).
      size: int scalar, the number of elements of the tower's canonical view.
      fmt: the canonical view's layout.

    Returns:
      The float64 vector of :func:`pack_moments`: ``[n, n*mu, M2 + n*mu^2]``,
      zeros for an empty batch.
    """
    channels = vector_length(mean)
    n = tf.cast(size, PACK_DTYPE) / float(channels)
    shift = tf.reduce_sum(tf.cast(first, PACK_DTYPE),
                          [a for a in range(4) if a != channel_axis(fmt)])
    mu = shift + tf.cast(mean, PACK_DTYPE)
    m2 = tf.cast(var, PACK_DTYPE) * tf.maximum(n - 1.0, 1.0)
    nonempty = n > 0.0
    zeros = tf.zeros_like(mu)
    sums = tf.where(nonempty, n * mu, zeros)
    squares = tf.where(nonempty, tf.maximum(m2, 0.0) + n * mu * mu, zeros)
    return tf.concat([tf.reshape(n, [1]), sums, squares], 0)


def pack_moments(count, shift, mean, m2):
    """Packs local moments for one sum all-reduce, in float64.

    Args:
      count: float32 scalar, elements per channel.
      shift: float32 ``[C]``, the shift that was subtracted from the data.
      mean: float32 ``[C]``, the mean of the shifted data.
      m2: float32 ``[C]``, the sum of squared deviations from the mean.

    Returns:
      A float64 vector ``[n, n*mu, M2 + n*mu^2]`` of length ``1 + 2C``, where
      ``mu = shift + mean`` is the local mean of the unshifted data.
    """
    n = tf.cast(count, PACK_DTYPE)
    mu = tf.cast(shift, PACK_DTYPE) + tf.cast(mean, PACK_DTYPE)
    return tf.concat([tf.reshape(n, [1]), n * mu, tf.cast(m2, PACK_DTYPE) + n * mu * mu], 0,
                     name='packed_moments')


def unpack_moments(packed, channels):
    """Inverse of the sum of :func:`pack_moments` over towers.

    Returns:
      ``(count, mean, var)`` in float64: the global count, mean and biased
      variance (``M2 / n``), never negative. An empty global batch gives mean 0
      and variance 0.
    """
    n = packed[0]
    safe_n = tf.maximum(n, 1.0)
    mean = packed[1:1 + channels] / safe_n
    var = tf.maximum(packed[1 + channels:] / safe_n - mean * mean, 0.0)
    return n, mean, var


Moments = collections.namedtuple('Moments', ['mean', 'variance', 'count'])
Moments.__doc__ = """Global batch statistics (float32, no gradient).

Attributes:
  mean: ``[C]`` mean over the global batch.
  variance: ``[C]`` biased variance (``M2 / n``), the one used to normalize.
  count: scalar, number of elements per channel in the global batch.
"""


def global_statistics(packed_sum, channels):
    """The global statistics from the summed packed moments, as float32.

    A small-vector function: the portable kernel set compiles it with XLA.

    Returns:
      ``(mean, variance, count)``: float32 ``[C]``, ``[C]`` (biased) and a
      scalar (elements per channel in the global batch).
    """
    n64, mean64, var64 = unpack_moments(packed_sum, channels)
    return (tf.cast(mean64, STAT_DTYPE), tf.cast(var64, STAT_DTYPE),
            tf.cast(n64, STAT_DTYPE))


def bessel_correct(var, count):
    """``var * n / (n - 1)``, the unbiased variance (``n <= 1`` leaves it as is)."""
    return var * count / tf.maximum(count - 1.0, 1.0)


def normalize(x4, gamma, beta, mean, var, epsilon, fmt, name='normalize'):
    """``(x - mean) * rsqrt(var + eps) * gamma + beta`` with one fused kernel.

    Args:
      x4: canonical view (float16, bfloat16 or float32).
      gamma, beta, mean, var: float32 ``[C]`` vectors.
      epsilon: Python float.
      fmt: layout of ``x4``.
      name: the op's name.

    Returns:
      ``(y4, reserve)`` where ``reserve`` holds the kernel's reserve spaces,
      which its gradient kernel takes.
    """
    y, _, _, r1, r2, r3 = gen_nn_ops.fused_batch_norm_v3(
        x4, gamma, beta, mean, var, epsilon=epsilon, data_format=fmt, is_training=False,
        name=name)
    return y, (r1, r2, r3)


def frozen_gradient(dy4, x4, gamma, mean, var, reserve, epsilon, fmt):
    """The gradient of :func:`normalize` with the statistics held constant.

    One ``FusedBatchNormGradV3`` in inference mode, which TensorFlow implements
    for ``NHWC`` only (on CPUs without oneDNN and on GPUs alike): callers
    with ``NCHW`` views use :func:`gradient_sums` instead. The statistics go
    in as ``reserve_space_1``/``reserve_space_2``, where the kernel reads them
    in inference mode on every device.

    Returns:
      ``(dx_partial, dgamma, dbeta)``: ``dy * gamma * r`` (``r = rsqrt(var +
      eps)``), ``sum(dy * xhat)`` and ``sum(dy)`` over the local batch (float32).
    """
    dx, dgamma, dbeta, _, _ = gen_nn_ops.fused_batch_norm_grad_v3(
        dy4, x4, gamma, mean, var, reserve[2], epsilon=epsilon,
        data_format=fmt, is_training=False, name='backward_local')
    return dx, dgamma, dbeta


def gradient_sums(dy4, x4, mean, var, epsilon, fmt):
    """``sum(dy * xhat)`` and ``sum(dy)`` over the local batch, for any layout.

    ``xhat`` comes from one fused inference kernel on float32 data (``x -
    mean`` is formed in float32 inside it, so it keeps its precision when
    ``|mean| >> std``; float16/bfloat16 inputs are widened first, as the fused
    gradient kernel does internally); the sums accumulate in float32.

    Returns:
      ``(dgamma, dbeta)``: two float32 ``[C]`` vectors.
    """
    channels = channels_of(x4, fmt)
    x = x4 if x4.dtype == STAT_DTYPE else tf.cast(x4, STAT_DTYPE)
    xhat, _ = normalize(x, tf.ones([channels], STAT_DTYPE), tf.zeros([channels], STAT_DTYPE),
                        mean, var, epsilon, fmt, name='xhat')
    dy = dy4 if dy4.dtype == STAT_DTYPE else tf.cast(dy4, STAT_DTYPE)
    axes = reduction_axes(fmt)
    return tf.reduce_sum(dy * xhat, axes), tf.reduce_sum(dy, axes)


def gradient_coefficients(gamma, var, count, grads_sum, epsilon, fmt, dtype=tf.float32):
    """The per-channel coefficients of the input gradient, from the global sums.

    With global ``dgamma = sum(dy * xhat)`` and ``dbeta = sum(dy)`` over
    ``n`` elements per channel::

        dx = gamma * r * (dy - dbeta / n - xhat * dgamma / n)
           = dy * dy_scale + xhat * xhat_scale + offset

    A small-vector function: the portable kernel set compiles it with XLA.

    Args:
      gamma, var: float32 ``[C]``; count: float32 scalar.
      grads_sum: float32 ``[2C]``, the all-reduced ``[dgamma, dbeta]``.
      epsilon: Python float.
      fmt: the layout ``dy_scale`` is shaped for.
      dtype: the dtype of ``dy`` (that of ``dy_scale``).

    Returns:
      ``(dy_scale, xhat_scale, offset)``: ``dy_scale`` shaped to broadcast
      against the canonical view, in ``dtype``; the other two float32 ``[C]``.
    """
    channels = vector_length(gamma)
    dgamma, dbeta = grads_sum[:channels], grads_sum[channels:]
    scale = gamma * tf.math.rsqrt(var + epsilon)
    inv_n = 1.0 / tf.maximum(count, 1.0)
    return (tf.cast(tf.reshape(scale, broadcast_shape(fmt, channels)), dtype),
            -scale * dgamma * inv_n, -scale * dbeta * inv_n)


def layout_broadcast_shape(rank, channels_last, channels):
    """The shape a ``[C]`` vector takes to broadcast against an input of ``rank``."""
    shape = [1] * rank
    shape[-1 if channels_last or rank == 2 else 1] = channels
    return shape


def fused_train(x4, gamma, beta, epsilon, fmt):
    """Per-tower (unsynchronized) batch norm: exactly one fused training kernel.

    The op is named ``FusedBatchNormV3``, as ``tf.nn.fused_batch_norm`` (and so
    slim) names it.

    Returns:
      ``(y4, mean, unbiased_variance)``; TensorFlow's registered gradient
      applies.
    """
    empty = tf.zeros([0], STAT_DTYPE)
    y, mean, var, _, _, _ = gen_nn_ops.fused_batch_norm_v3(
        x4, gamma, beta, empty, empty, epsilon=epsilon, data_format=fmt, is_training=True,
        name='FusedBatchNormV3')
    return y, mean, var


def weighted_local_moments(xs4, fmt, weights=None):
    """Differentiable local moments with optional per-example weights.

    Args:
      xs4: shifted canonical view.
      fmt: its layout.
      weights: None, or a ``[N]`` tensor of per-example weights; every element
        of example ``i`` has weight ``weights[i]``.

    Returns:
      ``(count, mean, m2)`` float32: total weight (or element count) per
      channel, weighted mean and weighted sum of squared deviations. All zero
      for an empty batch (or a zero total weight).
    """
    axes = reduction_axes(fmt)
    x = tf.cast(xs4, STAT_DTYPE)
    if weights is None:
        count = count_per_channel(xs4, fmt)
        total = tf.reduce_sum(x, axes)
        safe = tf.maximum(count, 1.0)
        mean = total / safe
        m2 = tf.reduce_sum(tf.math.squared_difference(
            x, tf.reshape(mean, broadcast_shape(fmt, channels_of(xs4, fmt)))), axes)
        return count, mean, m2
    w = tf.reshape(tf.cast(weights, STAT_DTYPE), [-1, 1, 1, 1])
    per_example = tf.cast(tf.reduce_prod(tf.gather(tf.shape(xs4), axes[1:])), STAT_DTYPE)
    count = tf.reduce_sum(w) * per_example
    safe = tf.where(count > 0, count, tf.ones_like(count))
    mean = tf.reduce_sum(w * x, axes) / safe
    bshape = broadcast_shape(fmt, channels_of(xs4, fmt))
    m2 = tf.reduce_sum(w * tf.square(x - tf.reshape(mean, bshape)), axes)
    return count, mean, m2




def pack_counted_moments(count, shift, mean, m2):
    """Packs local moments with a count per position, for one sum all-reduce, in float64.

    The form of :func:`pack_moments` for statistics of any shape, each with
    its own count (or total weight): ``tf1_syncbn.moments`` and
    ``weighted_moments`` over arbitrary axes.

    Args:
      count, shift, mean, m2: ``[P]`` vectors (float32 or float64): the count
        (or total weight), the shift subtracted from the data, the mean of the
        shifted data and the sum of (weighted) squared deviations from it.

    Returns:
      A float64 vector ``[n, n*mu, M2 + n*mu^2]`` of length ``3P``, where
      ``mu = shift + mean``.
    """
    n = tf.cast(count, PACK_DTYPE)
    mu = tf.cast(shift, PACK_DTYPE) + tf.cast(mean, PACK_DTYPE)
    return tf.concat([n, n * mu, tf.cast(m2, PACK_DTYPE) + n * mu * mu], 0,
                     name='packed_moments')


def unpack_counted_moments(packed, size):
    """Inverse of the sum of :func:`pack_counted_moments` over towers.

    Args:
      packed: the summed float64 vector of length ``3 * size``.
      size: ``P``, an int or a scalar int tensor.

    Returns:
      ``(count, mean, var)`` in float64 ``[P]``: the global count, mean and
      biased variance (``M2 / n``, never negative); mean and variance 0 where
      the count is 0 (as ``tf.math.divide_no_nan``).
    """
    n = packed[:size]
    nonzero = n > 0.0
    safe_n = tf.where(nonzero, n, tf.ones_like(n))
    mean = tf.where(nonzero, packed[size:2 * size] / safe_n, tf.zeros_like(n))
    var = tf.where(nonzero, tf.maximum(packed[2 * size:] / safe_n - mean * mean, 0.0),
                   tf.zeros_like(n))
    return n, mean, var

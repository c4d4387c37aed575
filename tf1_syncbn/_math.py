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


def batch_shift(x4, fmt):
    """A per-channel value from the batch itself (its first element), or 0 if empty.

    Subtracting it before computing moments is exact for data near the shift
    (Sterbenz) and keeps the moments accurate when ``|mean| >> std``.

    Returns:
      A float32 vector of shape ``[C]`` with no gradient.
    """
    def first():
        if fmt == 'NHWC':
            return x4[0, 0, 0, :]
        return x4[0, :, 0, 0]

    def zero():
        return tf.zeros([x4.shape[channel_axis(fmt)]], x4.dtype)

    nonempty = tf.greater(tf.size(x4), 0)
    return tf.stop_gradient(tf.cast(tf.cond(nonempty, first, zero), STAT_DTYPE))


def broadcast_shape(fmt, channels):
    """The shape a ``[C]`` vector takes to broadcast against a canonical view."""
    return [1, 1, 1, channels] if fmt == 'NHWC' else [1, channels, 1, 1]


def local_moments(xs4, fmt):
    """Per-channel mean and sum of squared deviations of the (shifted) local batch.

    Uses one ``FusedBatchNormV3`` training-mode kernel, which accumulates in
    float32 for float16/bfloat16 inputs.

    Args:
      xs4: shifted canonical view.
      fmt: its layout.

    Returns:
      ``(count, mean, m2)`` float32 tensors: a scalar and two ``[C]`` vectors.
      For an empty batch, all three are zero.
    """
    channels = xs4.shape[channel_axis(fmt)]
    ones = tf.ones([channels], STAT_DTYPE)
    zeros = tf.zeros([channels], STAT_DTYPE)
    empty = tf.zeros([0], STAT_DTYPE)
    _, mean, var, _, _, _ = gen_nn_ops.fused_batch_norm_v3(
        xs4, ones, zeros, empty, empty, epsilon=0.0, data_format=fmt, is_training=True,
        name='local_moments')
    count = count_per_channel(xs4, fmt)
    # The kernel's variance is Bessel-corrected: var = M2 / max(n - 1, 1).
    m2 = var * tf.maximum(count - 1.0, 1.0)
    nonempty = tf.greater(count, 0.0)
    mean = tf.where(nonempty, mean, zeros)
    m2 = tf.where(nonempty, tf.maximum(m2, 0.0), zeros)
    return count, mean, m2


#: Above this ratio |mean| / std (in any channel) a tower recomputes its
#: moments on data shifted by its own mean, where float32 sums stay exact.
SHIFT_THRESHOLD = 4.0


def robust_local_moments(x4, fmt, threshold=SHIFT_THRESHOLD):
    """Local moments that stay accurate when ``|mean| >> std``.

    One fused kernel computes the moments of ``x4``. If some channel has
    ``|mean| > threshold * std``, where the kernel's float32 sums lose
    precision, the moments are computed again on ``x4 - mean`` (a rounded
    mean is an exact shift: ``x - shift`` is exact for data near the shift).
    Well-conditioned data, the common case, pays for one kernel only.

    Returns:
      ``(count, shift, mean, m2)`` float32: the count, the shift (zeros unless
      recomputed), and the mean (relative to the shift) and sum of squared
      deviations of the local batch.
    """
    count, mean, m2 = local_moments(x4, fmt)
    channels = x4.shape[channel_axis(fmt)]
    var = m2 / tf.maximum(count, 1.0)
    ill = tf.reduce_any(tf.square(mean) > (threshold * threshold) * var)

    def shifted():
        xs4 = x4 - tf.reshape(tf.cast(mean, x4.dtype), broadcast_shape(fmt, channels))
        shift = tf.cast(tf.cast(mean, x4.dtype), STAT_DTYPE)
        _, mean_s, m2_s = local_moments(xs4, fmt)
        return shift, mean_s, m2_s

    def plain():
        return tf.zeros_like(mean), mean, m2

    shift, mean, m2 = tf.cond(ill, shifted, plain, name='shift_if_ill_conditioned')
    return count, shift, mean, m2


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
      ``(y4, reserve)`` where ``reserve`` holds what :func:`backward_local` needs.
    """
    y, _, _, r1, r2, r3 = gen_nn_ops.fused_batch_norm_v3(
        x4, gamma, beta, mean, var, epsilon=epsilon, data_format=fmt, is_training=False,
        name=name)
    return y, (r1, r2, r3)


def backward_local(dy4, x4, gamma, mean, var, reserve, epsilon, fmt):
    """Local part of the backward pass of :func:`normalize` with batch statistics.

    The gradient kernel runs in inference mode, where it reads the statistics
    from its ``reserve_space_1``/``reserve_space_2`` inputs. They are given
    ``mean`` and ``var`` directly: the forward kernel's own reserve-space
    outputs are not the statistics on every CPU build (for float16 inputs
    they are left uninitialized).

    Returns:
      ``(dx_partial, dgamma, dbeta)`` where ``dx_partial = dy * gamma * r``
      (with ``r = rsqrt(var + eps)``), ``dgamma = sum(dy * xhat)`` and
      ``dbeta = sum(dy)`` over the local batch (float32).
    """
    dx, dgamma, dbeta, _, _ = gen_nn_ops.fused_batch_norm_grad_v3(
        dy4, x4, gamma, mean, var, reserve[2], epsilon=epsilon,
        data_format=fmt, is_training=False, name='backward_local')
    return dx, dgamma, dbeta


def backward_finish(x4, dx_partial, gamma, mean, var, dgamma, dbeta, count, epsilon, fmt):
    """Adds the statistics' contribution to the input gradient.

    With global sums ``dgamma = sum(dy * xhat)`` and ``dbeta = sum(dy)`` over
    ``n`` elements per channel::

        dx = gamma * r * (dy - dbeta / n - xhat * dgamma / n)
           = dx_partial + xhat * (-gamma * r * dgamma / n) + (-gamma * r * dbeta / n)

    The last two terms are a per-channel affine function of ``xhat``, computed
    by one more fused kernel on ``x4`` (so ``x - mean`` is formed first and
    keeps its precision).
    """
    r = tf.math.rsqrt(var + epsilon)
    inv_n = 1.0 / tf.maximum(count, 1.0)
    scale = -gamma * r * dgamma * inv_n
    offset = -gamma * r * dbeta * inv_n
    corr, _, _, _, _, _ = gen_nn_ops.fused_batch_norm_v3(
        x4, scale, offset, mean, var, epsilon=epsilon, data_format=fmt, is_training=False,
        name='stats_grad')
    return tf.add(dx_partial, corr, name='dx')


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
            x, tf.reshape(mean, broadcast_shape(fmt, xs4.shape[channel_axis(fmt)]))), axes)
        return count, mean, m2
    w = tf.reshape(tf.cast(weights, STAT_DTYPE), [-1, 1, 1, 1])
    per_example = tf.cast(tf.reduce_prod(tf.gather(tf.shape(xs4), axes[1:])), STAT_DTYPE)
    count = tf.reduce_sum(w) * per_example
    safe = tf.where(count > 0, count, tf.ones_like(count))
    mean = tf.reduce_sum(w * x, axes) / safe
    bshape = broadcast_shape(fmt, xs4.shape[channel_axis(fmt)])
    m2 = tf.reduce_sum(w * tf.square(x - tf.reshape(mean, bshape)), axes)
    return count, mean, m2


# --------------------------------------------------------------------------
# Kernel sets: two implementations of the four steps of a synchronized training
# step, chosen per tower device by :func:`kernels_for`. The engine runs
#
#   packed = moments(x4)                   -> all-reduce (sum) -> packed_sum
#   y4, moments, saved = normalize(x4, packed_sum, gamma, beta)
#   grads, dgamma, dbeta, state = backward_local(dy4, x4, gamma, saved)
#                                          -> all-reduce (sum) -> grads_sum
#   dx = backward_finish(state, dy4, x4, gamma, saved, grads_sum)
#
# ``packed`` is :func:`pack_moments`' float64 vector; ``grads`` is the float32
# vector ``[sum(dy * xhat), sum(dy)]`` of length ``2C``.

Moments = collections.namedtuple('Moments', ['mean', 'variance', 'count'])
Moments.__doc__ = """Global batch statistics (float32, no gradient).

Attributes:
  mean: ``[C]`` mean over the global batch.
  variance: ``[C]`` biased variance (``M2 / n``), the one used to normalize.
  count: scalar, number of elements per channel in the global batch.
"""


class StockKernels(object):
    """TensorFlow's own kernels (any device): fused kernels and small ops around them."""

    name = 'stock'

    def moments(self, x4, fmt):
        """The packed float64 moments of the local batch (see robust_local_moments)."""
        return pack_moments(*robust_local_moments(x4, fmt))

    def normalize(self, x4, packed_sum, gamma, beta, epsilon, fmt):
        """``(y4, moments, saved)``: the output, the global :class:`Moments`, and
        what the backward steps need."""
        channels = x4.shape[channel_axis(fmt)]
        n64, mean64, var64 = unpack_moments(packed_sum, channels)
        mean = tf.cast(mean64, STAT_DTYPE)
        var = tf.cast(var64, STAT_DTYPE)
        count = tf.cast(n64, STAT_DTYPE)
        y4, reserve = normalize(x4, gamma, beta, mean, var, epsilon, fmt)
        moments = Moments(tf.stop_gradient(mean), tf.stop_gradient(var),
                          tf.stop_gradient(count))
        return y4, moments, (mean, var, count, reserve)

    def backward_local(self, dy4, x4, gamma, saved, epsilon, fmt):
        """``(grads, dgamma, dbeta, state)``: the local sums, packed and apart, and
        what backward_finish needs."""
        mean, var, _, reserve = saved
        dx_partial, dgamma, dbeta = backward_local(dy4, x4, gamma, mean, var, reserve,
                                                   epsilon, fmt)
        return tf.concat([dgamma, dbeta], 0, name='packed_grads'), dgamma, dbeta, dx_partial

    def backward_finish(self, state, dy4, x4, gamma, saved, grads_sum, epsilon, fmt):
        """The input gradient from the global sums."""
        del dy4
        mean, var, count, _ = saved
        channels = x4.shape[channel_axis(fmt)]
        return backward_finish(x4, state, gamma, mean, var, grads_sum[:channels],
                               grads_sum[channels:], count, epsilon, fmt)


class CustomCpuKernels(object):
    """The compiled CPU kernels of :mod:`tf1_syncbn.kernels`: one op, one pass per step.

    Their statistics outputs have no gradient (registered as such), like the
    stock set's ``stop_gradient``.
    """

    name = 'custom'

    def __init__(self, ops):
        self._ops = ops

    def moments(self, x4, fmt):
        return self._ops.sync_bn_moments(x4, data_format=fmt, name='local_moments')

    def normalize(self, x4, packed_sum, gamma, beta, epsilon, fmt):
        y4, mean, var, count, inv_std = self._ops.sync_bn_normalize(
            x4, packed_sum, gamma, beta, epsilon=epsilon, data_format=fmt, name='normalize')
        return y4, Moments(mean, var, count), (mean, inv_std, count)

    def backward_local(self, dy4, x4, gamma, saved, epsilon, fmt):
        del gamma, epsilon
        mean, inv_std, _ = saved
        grads, dgamma, dbeta = self._ops.sync_bn_grad_sums(dy4, x4, mean, inv_std,
                                                           data_format=fmt,
                                                           name='backward_local')
        return grads, dgamma, dbeta, None

    def backward_finish(self, state, dy4, x4, gamma, saved, grads_sum, epsilon, fmt):
        del state, epsilon
        mean, inv_std, count = saved
        return self._ops.sync_bn_grad_input(dy4, x4, mean, inv_std, gamma, grads_sum, count,
                                            data_format=fmt, name='dx')


def kernels_for(device):
    """The kernel set for a tower on ``device`` (a canonical device string)."""
    from tf1_syncbn import kernels  # noqa: PLC0415 - compiled lazily, on first use
    device_type = tf.DeviceSpec.from_string(device or '').device_type
    on_cpu = device_type == 'CPU' or (
        not device_type and not tf.config.list_physical_devices('GPU'))
    ops = kernels.load() if on_cpu else None
    return CustomCpuKernels(ops) if ops is not None else StockKernels()

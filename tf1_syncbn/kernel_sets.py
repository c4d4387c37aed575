"""Kernel sets: how one tower computes a synchronized batch-norm step, per device type.

A synchronized training step splits batch norm at its two all-reduces. Every
kernel set implements the same four steps, and the engine
(:mod:`tf1_syncbn._compute.engine`) runs them around the backend's all-reduces::

    packed = moments(x4)                      -> all-reduce (sum) -> packed_sum
    y4, moments, saved = normalize(x4, packed_sum, gamma, beta)
    grads, dgamma, dbeta, state = backward_local(dy4, x4, gamma, saved)
                                              -> all-reduce (sum) -> grads_sum
    dx = backward_finish(state, dy4, x4, gamma, saved, grads_sum)

``packed`` is the float64 vector ``[n, n*mu, M2 + n*mu^2]`` of
:func:`tf1_syncbn._compute.math.pack_moments`; ``grads`` the float32 vector
``[sum(dy * xhat), sum(dy)]``. ``x4``/``dy4`` are canonical 4-D views
(``NHWC`` or ``NCHW``) of any rank and data format.

The sets, chosen per tower device by :func:`kernels_for`:

* :class:`CompiledCpuKernels` (CPU towers, when :mod:`tf1_syncbn.kernels`
  can be built): four compiled ops, one pass over the data each.
* :class:`PortableKernels` (GPU towers, and CPU towers without a compiler or
  with ``TF1_SYNCBN_KERNELS=0``): TensorFlow's fused batch-norm kernels
  (cuDNN on GPUs) for the full-size tensors, and the per-channel vector math
  between them compiled with XLA into one op per step
  (``TF1_SYNCBN_XLA=0`` builds it from separate ops instead). No step reads
  a device value on the host: there is no ``tf.cond`` on a computed
  predicate, so a GPU stream never waits for the host.

Another set (CUDA kernels, say) plugs in with :func:`register_kernel_set`.
"""

import os
import threading

import tensorflow as tf

from tf1_syncbn._compute import math as _math
from tf1_syncbn._graph.cache import graph_cache

__all__ = ['CompiledCpuKernels', 'PortableKernels', 'kernels_for', 'register_kernel_set',
           'kernel_set_factories']


class CompiledCpuKernels(object):
    """The compiled CPU kernels of :mod:`tf1_syncbn.kernels`: one op, one pass per step.

    Their statistics outputs have no gradient (registered as such).
    """

    name = 'compiled-cpu'

    def __init__(self, ops):
        self._ops = ops

    @classmethod
    def create(cls):
        """The set, or None when the library is disabled or cannot be built."""
        from tf1_syncbn import kernels  # noqa: PLC0415 - compiled lazily, on first use
        ops = kernels.load()
        return cls(ops) if ops is not None else None

    def moments(self, x4, fmt):
        return self._ops.sync_bn_moments(x4, data_format=fmt, name='local_moments')

    def normalize(self, x4, packed_sum, gamma, beta, epsilon, fmt):
        y4, mean, var, count, inv_std = self._ops.sync_bn_normalize(
            x4, packed_sum, gamma, beta, epsilon=epsilon, data_format=fmt, name='normalize')
        return y4, _math.Moments(mean, var, count), (mean, inv_std, count)

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


class PortableKernels(object):
    """TensorFlow's own kernels, for any device and layout; vector math compiled by XLA.

    Per tower and layer: ``StridedSlice`` + ``Sub`` + one fused kernel + ``Size``
    + one XLA op for the local moments; one XLA op + one fused kernel to
    normalize; backward, one fused gradient kernel (``NHWC``) or a fused
    kernel and two sums (``NCHW``, which TensorFlow's inference-mode gradient
    kernel does not take), then one XLA op and one fused kernel for the input
    gradient.

    Each tower shifts float32 data by its own first example before the
    moments, so that data whose mean is far larger than its spread keeps its
    precision, without a ``tf.cond`` on the data (float16/bfloat16 data are
    not shifted: the subtraction would round in their precision).

    Args:
      xla: compile the vector math with XLA (None: unless ``TF1_SYNCBN_XLA=0``).
    """

    name = 'portable'

    def __init__(self, xla=None):
        self.xla = xla_enabled() if xla is None else bool(xla)

    @classmethod
    def create(cls):
        return cls()

    def _vector_math(self, fn, *static):
        return vector_math(fn, static, self.xla)

    def moments(self, x4, fmt):
        if x4.dtype == tf.float32:
            first = _math.first_example(x4, fmt)
            xs4 = x4 - first
        else:
            # x - first would round in float16/bfloat16; their fused kernel
            # accumulates in float32, and the inputs' own rounding dominates.
            channels = _math.channels_of(x4, fmt)
            first = tf.zeros([0] + _math.broadcast_shape(fmt, channels)[1:], x4.dtype)
            xs4 = x4
        mean, var = _math.shifted_moments(xs4, fmt)
        pack = self._vector_math(_math.pack_shifted_moments, fmt)
        return pack(first, mean, var, tf.size(x4))

    def normalize(self, x4, packed_sum, gamma, beta, epsilon, fmt):
        channels = _math.channels_of(x4, fmt)
        mean, var, count = self._vector_math(_math.global_statistics, channels)(packed_sum)
        y4, reserve = _math.normalize(x4, gamma, beta, mean, var, epsilon, fmt)
        return y4, _math.Moments(mean, var, count), (mean, var, count, reserve)

    def backward_local(self, dy4, x4, gamma, saved, epsilon, fmt):
        mean, var, _, reserve = saved
        if fmt == 'NHWC':
            dx_partial, dgamma, dbeta = _math.frozen_gradient(dy4, x4, gamma, mean, var,
                                                              reserve, epsilon, fmt)
            state = dx_partial
        else:
            state = None
            dgamma, dbeta = _math.gradient_sums(dy4, x4, mean, var, epsilon, fmt)
        return tf.concat([dgamma, dbeta], 0, name='packed_grads'), dgamma, dbeta, state

    def backward_finish(self, state, dy4, x4, gamma, saved, grads_sum, epsilon, fmt):
        mean, var, count, _ = saved
        coefficients = self._vector_math(_math.gradient_coefficients, epsilon, fmt,
                                         dy4.dtype)
        dy_scale, xhat_scale, offset = coefficients(gamma, var, count, grads_sum)
        # xhat * xhat_scale + offset, with x - mean formed in float32 by the kernel.
        correction, _ = _math.normalize(x4, xhat_scale, offset, mean, var, epsilon, fmt,
                                        name='stats_grad')
        if fmt == 'NHWC':
            dx_partial = state          # dy * gamma * r, from the fused gradient kernel
        else:
            dx_partial = dy4 * dy_scale
        return tf.add(dx_partial, correction, name='dx')


def xla_enabled():
    """Whether the portable set compiles its vector math with XLA (``TF1_SYNCBN_XLA``)."""
    return os.environ.get('TF1_SYNCBN_XLA', '1') != '0'


def vector_math(fn, static, xla):
    """``fn`` with its trailing static arguments bound, as one XLA op or as plain ops.

    With ``xla``, the function is a ``tf.function(jit_compile=True)`` kept in
    the graph's state (one per graph, function and static arguments, so it
    goes away with its graph), which the graph calls as one op; XLA compiles
    it once per device and session.
    """
    def bound(*args):
        return fn(*(args + tuple(static)))

    def named(*args):
        with tf.name_scope(fn.__name__):
            if xla and getattr(tf.compat.v1.get_default_graph(), 'outer_graph', None) is not None:
                # In a tf.cond branch (or its gradient), capture the arguments
                # first: TensorFlow's cond gradient cannot find forward-branch
                # tensors that an XLA call captures itself.
                args = tuple(tf.identity(a) for a in args)
            return compiled(*args)

    if not xla:
        compiled = bound
        return named
    table = graph_cache().slot('tf1_syncbn.vector_math', dict)
    key = (fn.__name__, tuple(static))
    compiled = table.get(key)
    if compiled is None:
        bound.__name__ = 'tf1_syncbn_%s' % fn.__name__
        compiled = table[key] = tf.function(bound, jit_compile=True, autograph=False)
    return named


_LOCK = threading.Lock()
_FACTORIES = {
    'CPU': [CompiledCpuKernels.create, PortableKernels.create],
    'GPU': [PortableKernels.create],
}


def register_kernel_set(device_type, factory):
    """Makes ``factory()`` the first kernel set tried for towers on ``device_type``.

    Args:
      device_type: ``'CPU'``, ``'GPU'``, ...
      factory: a callable returning a kernel set (an object with the four
        methods above), or None when it cannot serve (the next is tried).
    """
    if not callable(factory):
        raise TypeError('register_kernel_set: factory must be callable, got %r.' % (factory,))
    with _LOCK:
        _FACTORIES.setdefault(device_type.upper(), [PortableKernels.create]).insert(0, factory)


def kernel_set_factories(device_type):
    """The factories tried, in order, for towers on ``device_type``."""
    with _LOCK:
        return list(_FACTORIES.get(device_type.upper(), [PortableKernels.create]))


def kernels_for(device):
    """The kernel set for a tower on ``device`` (a canonical device string).

    An unplaced tower ('') runs where TensorFlow puts it: on a GPU when the
    process sees one, else on the CPU.
    """
    device_type = tf.DeviceSpec.from_string(device or '').device_type
    if not device_type:
        device_type = 'GPU' if tf.config.list_physical_devices('GPU') else 'CPU'
    for factory in kernel_set_factories(device_type):
        kernel_set = factory()
        if kernel_set is not None:
            return kernel_set
    return PortableKernels()

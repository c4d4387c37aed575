"""Any channel axes, as a view the core normalizes: Keras' (and tf.layers') every axis form.

The core (:func:`tf1_syncbn._core.call.batch_norm`) normalizes the channels of one
axis, 1 or the last. tf-keras' ``BatchNormalization`` (and so tf.layers')
``axis`` may also be a middle axis (``axis=2`` on ``[N, H, W, C]``) or a list
of axes normalized together (``[1, 2]`` on ``[N, A, B]``: one statistic per
``(a, b)``). A front-end with such an ``axis`` hands the core a *view* of its
input instead, in which the normalized axes are one channel axis:

* contiguous axes that end at the last axis: ``[N, S, 1, C]`` (NHWC), a
  free reshape;
* contiguous axes that start at axis 1: ``[N, C, S, 1]`` (NCHW), free;
* contiguous axes in the middle, ``[N, P, C, Q]``: ``[N * P, C, Q, 1]``
  (NCHW), free, except with ghost batches (``keep_batch``), which need the
  batch alone on axis 0;
* anything else (axes apart, ``[1, 3]`` on ``[N, A, B, C]``; a middle block
  with ghost batches): a transpose to ``[N, <the other axes>, <the channel
  axes>]``, then ``[N, S, 1, C]``.

``C`` is the product of the normalized axes' sizes, flattened in row-major
order of the axes in increasing order: the order in which a variable of
tf-keras' shape for several axes (the input's shape with 1 in every other
axis) flattens, which is how the core reads variables
(:func:`tf1_syncbn._core.variables.read`) and assigns their updates. The view
keeps every element, so statistics, outputs and gradients are those of the
input; the output is mapped back by the inverse reshape (and transpose).

One channel axis that is 1 or the last needs no view (:func:`needs_view`):
the core's own free reshape serves it, with no extra op.
"""

import collections

import tensorflow as tf

__all__ = ['ChannelView', 'needs_view', 'plan_view', 'to_view', 'from_view', 'adjustment_in_view',
           'parameter_shape']

_ChannelView = collections.namedtuple(
    'ChannelView', ['rank', 'axes', 'perm', 'fold', 'channels_last', 'channels'])


class ChannelView(_ChannelView):
    """How an input of ``rank`` becomes a 4-D view with the ``axes`` as one channel axis.

    Attributes:
      rank: the input's rank (2 to 5).
      axes: the normalized axes, increasing (never 0).
      perm: the transpose applied first, or None (the view is a reshape).
      fold: the leading axes (0 up to the first channel axis) folded into the
        view's axis 0; ``1`` when the batch alone stays there.
      channels_last: the view is ``[M, S, 1, C]`` (NHWC) if True, else
        ``[M, C, S, 1]`` (NCHW).
      channels: ``C``, the product of the normalized axes' sizes.
    """

    @property
    def axis(self):
        """The view's channel axis, for the core's options (1 or -1)."""
        return -1 if self.channels_last else 1


def needs_view(rank, axes):
    """Whether ``axes`` (normalized) of an input of ``rank`` need a view: not one axis 1 or last."""
    return not (len(axes) == 1 and axes[0] in (1, rank - 1))


def plan_view(rank, axes, dims, keep_batch):
    """The view of an input of ``rank`` with channel ``axes``.

    Args:
      rank: the input's rank.
      axes: the normalized channel axes (any order, no 0, no repeats).
      dims: the input's static shape (a list of ints and None); the channel
        axes' sizes must be known.
      keep_batch: the view must keep the batch alone on axis 0 (ghost batches).

    Returns:
      A :class:`ChannelView`.
    """
    axes = sorted(axes)
    channels = 1
    for a in axes:
        channels *= dims[a]
    contiguous = axes == list(range(axes[0], axes[-1] + 1))
    if contiguous and axes[-1] == rank - 1:
        return ChannelView(rank, tuple(axes), None, 1, True, channels)
    if contiguous and (axes[0] == 1 or not keep_batch):
        return ChannelView(rank, tuple(axes), None, axes[0], False, channels)
    others = [i for i in range(1, rank) if i not in axes]
    return ChannelView(rank, tuple(axes), tuple([0] + others + axes), 1, True, channels)


def _product(static, dynamic, indices):
    """The product of some dimensions: an int where all are static, else a scalar tensor."""
    if all(static[i] is not None for i in indices):
        out = 1
        for i in indices:
            out *= static[i]
        return out
    return tf.reduce_prod(tf.gather(dynamic, list(indices))) if indices else 1


def to_view(x, view):
    """``x`` as the 4-D view (a reshape, after a transpose where ``view.perm`` says).

    Returns:
      A tensor of rank 4 whose channel axis (1 or 3) has ``view.channels``
      elements.
    """
    if view.perm is not None:
        x = tf.transpose(x, view.perm)
    static = x.shape.as_list()
    dynamic = tf.shape(x)
    rank = view.rank
    if view.channels_last:       # (always so after a transpose)
        first = len(static) - len(view.axes)          # the channel axes are last
        outer = _product(static, dynamic, [0])
        spatial = _product(static, dynamic, range(1, first))
        shape = [outer, spatial, 1, view.channels]
    else:
        last = view.fold + len(view.axes)             # one past the channel axes
        outer = _product(static, dynamic, range(view.fold))
        spatial = _product(static, dynamic, range(last, rank))
        shape = [outer, view.channels, spatial, 1]
    if all(isinstance(d, int) for d in shape):
        return tf.reshape(x, shape)
    x4 = tf.reshape(x, tf.stack(shape))
    x4.set_shape([None, None, 1, view.channels] if view.channels_last
                 else [None, view.channels, None, 1])
    return x4


def from_view(y4, x, view):
    """The view ``y4`` back in the shape of ``x`` (inverse reshape, inverse transpose)."""
    if view.perm is None:
        y = tf.reshape(y4, tf.shape(x))
    else:
        static = x.shape.as_list()
        moved = [static[i] for i in view.perm]
        shape = moved if all(d is not None for d in moved) else \
            tf.gather(tf.shape(x), list(view.perm))
        inverse = [view.perm.index(i) for i in range(view.rank)]
        y = tf.transpose(tf.reshape(y4, shape), inverse)
    y.set_shape(x.shape)
    return y


def adjustment_in_view(adjustment, x, view):
    """A Keras ``adjustment`` for the view of ``x``: the core then applies it as Keras does.

    Keras calls ``adjustment(tf.shape(inputs))`` and broadcasts the ``(scale,
    bias)`` it returns against the input; the core broadcasts them against
    what it normalizes, the view. The returned function calls ``adjustment``
    with the input's shape and maps both values, broadcast to the input's
    shape, into the view (the core calls it where it builds the training
    branch).
    """
    if adjustment is None:
        return None

    def in_view(_):
        shape = tf.shape(x)
        scale, bias = adjustment(shape)
        return tuple(to_view(tf.broadcast_to(tf.cast(v, tf.float32), shape), view)
                     for v in (scale, bias))

    return in_view


def parameter_shape(dims, axes, ghost):
    """Keras' shape of ``gamma``, ``beta`` and the statistics for channel ``axes``.

    One axis without ghost batches: ``[C]``. Several axes, or ghost batches:
    the input's shape with 1 in every other axis, and with ghost batches a
    1 inserted at index 1 (Keras reshapes the batch to ``[virtual_batch_size,
    -1, ...]`` and keeps the variables in that rank).

    Args:
      dims: the input's static shape (the channel axes' sizes known).
      axes: the normalized channel axes.
      ghost: ``virtual_batch_size`` is set.
    """
    if len(axes) == 1 and not ghost:
        return [dims[axes[0]]]
    shape = [dims[i] if i in axes else 1 for i in range(len(dims))]
    if ghost:
        shape.insert(1, 1)
    return shape

"""tf.layers' rules for batch normalization, as :mod:`tf1_syncbn.layers` translates them.

What tf-keras' legacy ``BatchNormalization`` (``tf.compat.v1.layers``) decides
from its arguments before it computes anything: its names for the core's
options (:data:`ARG_NAMES`), which axis holds the channels,
whether it runs TensorFlow's fused kernel, how it names unnamed layers, which
initializers, regularizers and constraints it accepts. Errors name the layer
(with its scope) and the argument as the user spelled it.
"""

import numbers

import numpy as np
import tensorflow as tf

from tf1_syncbn._frontend.building import graph_cache, replaced_layer_is_fused

__all__ = ['ARG_NAMES', 'BASE_NAME', 'DTYPES', 'tf_layers_runs_fused_kernel', 'unique_layer_name',
           'check_axis_type', 'check_callable', 'channel_axes',
           'training_value', 'check_rank_of_reuse']

tf1 = tf.compat.v1

#: The core's option -> tf.layers' argument, where they differ.
ARG_NAMES = {'is_training': 'training'}
#: The variable scope (and name) of unnamed layers: ``batch_normalization``, ``_1``, ...
BASE_NAME = 'batch_normalization'
#: The input types the layer takes (and its ``dtype`` argument).
DTYPES = (tf.float16, tf.bfloat16, tf.float32)
#: Keras' names for the initializers that make sense for batch norm.
_INITIALIZER_NAMES = {'zeros': tf1.zeros_initializer, 'ones': tf1.ones_initializer}


def tf_layers_runs_fused_kernel(fused, rank, axes, renorm, virtual_batch_size, adjustment):
    """Where tf.layers' ``BatchNormalization`` (tf-keras' legacy layer) runs the fused kernel.

    Its rule (``BatchNormalizationBase`` with V1 behaviour, ``build``):
    ``fused=None`` means True, and the fused kernel runs on inputs of rank 4
    and 5 with one channel axis, 1 or the last (``axis=1``, ``3``/``-1`` on
    rank 4, ``4``/``-1`` on rank 5), and neither ``renorm``,
    ``virtual_batch_size`` nor ``adjustment``; ``fused=True`` anywhere else
    (a middle axis, several axes, ...) quietly takes the non-fused path, as
    in tf.layers. There the moving
    variance tracks the Bessel-corrected batch variance and ``1 - momentum``
    is computed in float32; on the non-fused path, the biased variance and
    ``1 - momentum`` in double, and 16-bit inputs are computed in float32.

    Args:
      fused: the ``fused`` argument.
      rank: the input's rank.
      axes: the normalized channel axes (:func:`channel_axes`).
      renorm, virtual_batch_size, adjustment: the arguments.

    Returns:
      See :func:`tf1_syncbn._core.options.replaced_layer_is_fused`.
    """
    one_axis = len(axes) == 1 and axes[0] in (1, rank - 1)
    return one_axis and replaced_layer_is_fused(fused, rank, (4, 5),
                                                (renorm, virtual_batch_size, adjustment))


def unique_layer_name(graph):
    """``batch_normalization_<n>``, numbered per graph from 1, as Keras names unnamed layers."""
    counter = graph_cache(graph).slot('tf1_syncbn.layers.names', lambda: [0])
    counter[0] += 1
    return '%s_%d' % (BASE_NAME, counter[0])


def _is_axis(value):
    """An integer of any kind (numpy's too), but no bool (``axis=True`` is surely a mistake)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_axis_type(layer, axis):
    """``axis`` as tf.layers takes it: an int, or a non-empty list/tuple of ints (as a list).

    Numpy integers are taken as ints (``axis=np.int32(1)``, ``[np.int64(3)]``).
    """
    if isinstance(axis, (list, tuple)) and axis and all(_is_axis(a) for a in axis):
        return [int(a) for a in axis]
    if _is_axis(axis):
        return int(axis)
    raise TypeError("%s: expected an int or a list/tuple of ints for the argument 'axis', "
                    "but received: %r" % (layer, axis))


def training_value(training):
    """tf.layers' ``training`` for Python values: None is False, integers are bools."""
    if training is None:
        return False
    if isinstance(training, (numbers.Integral, np.bool_)):
        return bool(training)
    return training


def check_rank_of_reuse(layer, built_rank, rank):
    """tf.layers' input spec: a layer object keeps the rank of its first input."""
    if rank != built_rank:
        raise ValueError('%s: the layer was built on inputs of rank %d (ndim=%d) and is now '
                         'applied to inputs of rank %d; build another layer object for them.'
                         % (layer, built_rank, built_rank, rank))


def check_callable(layer, name, value, initializer=False):
    """An initializer (a callable, ``'zeros'``, ``'ones'``), or a regularizer / constraint."""
    if value is None and not initializer:
        return None
    if initializer and isinstance(value, str) and value in _INITIALIZER_NAMES:
        return _INITIALIZER_NAMES[value]()
    if callable(value):
        return value
    raise TypeError("%s: %s must be a callable%s, got %r." % (
        layer, name, " (or 'zeros', 'ones')" if initializer else ' or None', value))


def channel_axes(layer, axis, rank, virtual_batch_size=None):
    """tf.layers' ``axis`` for an input of ``rank``: the normalized axes, non-negative.

    Any axis but the batch axis, or any list of them, as tf.layers takes it
    (``validate_axis``): negative values count from the end; the list keeps
    the caller's order (as tf.layers' ``layer.axis``).

    Args:
      layer: the layer's name for messages.
      axis: the ``axis`` argument (an int or a list of ints).
      rank: the input's rank, or None.
      virtual_batch_size: the argument, for the message about axis 0.

    Returns:
      A list of ints in ``[1, rank)``; None for an unknown rank or one outside
      2 to 5 (``check_inputs`` names that problem).

    Raises:
      ValueError: for axes out of range or repeated (as tf.layers), and for
        the batch axis 0: tf.layers rejects it with ``virtual_batch_size``;
        without, it normalizes every example by its own statistics, with
        variables the size of the batch, which no towers can share (a
        deliberate difference).
    """
    if rank is None or not 2 <= rank <= 5:
        return None
    axes = axis if isinstance(axis, list) else [axis]
    normalized = [a + rank if a < 0 else a for a in axes]
    if any(not 0 <= a < rank for a in normalized) or len(set(normalized)) != len(axes):
        raise ValueError('%s: invalid axis=%r for inputs of rank %d: every axis must lie in '
                         '[-%d, %d) and appear once.' % (layer, axis, rank, rank, rank))
    if 0 in normalized:
        if virtual_batch_size is not None:
            raise ValueError('%s: axis=%r: when using `virtual_batch_size`, the batch '
                             'dimension must be 0 and thus axis cannot include 0.'
                             % (layer, axis))
        raise ValueError('%s: axis=%r includes the batch axis 0: that normalizes each example '
                         'by its own statistics, with variables the size of the batch, '
                         'which towers of other sizes cannot share; this layer normalizes '
                         'over the batch. Pass the channel axis or axes (1 to %d).'
                         % (layer, axis, rank - 1))
    return normalized

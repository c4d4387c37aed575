"""tf-slim's rules for ``batch_norm``, as :mod:`tf1_syncbn.slim` translates them.

What ``slim.batch_norm`` (tf-slim 1.1) decides from its arguments before it
computes anything: its names for the core's options (:data:`ARG_NAMES`, so
that errors name the argument as the user spelled it), the keys its
``param_initializers`` / ``param_regularizers`` take, and where it runs
TensorFlow's fused kernel (:func:`slim_runs_fused_kernel`: which batch
variance the moving variance tracks).
"""

import tensorflow as tf

from tf1_syncbn._frontend.building import replaced_layer_is_fused

__all__ = ['ARG_NAMES', 'PARAM_INITIALIZER_KEYS', 'PARAM_REGULARIZER_KEYS',
           'slim_runs_fused_kernel']

tf1 = tf.compat.v1

#: The core's option -> slim's argument, where they differ.
ARG_NAMES = {'momentum': 'decay', 'renorm_momentum': 'renorm_decay',
             'zero_debias': 'zero_debias_moving_mean'}
#: The keys ``param_initializers`` takes.
PARAM_INITIALIZER_KEYS = ('beta', 'gamma', 'moving_mean', 'moving_variance')
#: The keys ``param_regularizers`` takes.
PARAM_REGULARIZER_KEYS = ('beta', 'gamma')


def slim_runs_fused_kernel(fused, rank, batch_weights, renorm, adjustment, zero_debias,
                           updates_collections):
    """Where ``slim.batch_norm`` (tf-slim 1.1) runs TensorFlow's fused kernel.

    slim's rule (``tf_slim/layers/layers.py``): ``fused=None`` means True;
    inputs of rank 2 or 4 without ``batch_weights``, ``renorm`` or
    ``adjustment`` go to its fused function when ``zero_debias_moving_mean``,
    rank 2 or an ``updates_collections`` other than ``UPDATE_OPS`` (compared by
    identity, as slim does) ask for it; otherwise, without ``batch_weights``
    and ``zero_debias_moving_mean`` and with the default collection, it runs
    Keras' ``BatchNormalization``, which is fused on rank 4 and 5 (and not with
    renorm or adjustment); everything else takes slim's ``tf.nn.moments``
    path.

    Returns:
      ``(fused, keras_fused)``: whether the fused kernel runs (see
      :func:`tf1_syncbn._core.options.replaced_layer_is_fused`), and whether it
      runs inside Keras' layer, which computes ``1 - decay`` in float32.
    """
    keras_path = updates_collections is tf1.GraphKeys.UPDATE_OPS and not zero_debias
    is_fused = replaced_layer_is_fused(fused, rank, (2, 4, 5) if keras_path else (2, 4),
                                       (batch_weights, renorm, adjustment))
    return is_fused, is_fused and keras_path and rank in (4, 5)

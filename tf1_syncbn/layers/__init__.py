"""``tf.compat.v1.layers``' batch normalization, synchronized: a drop-in for tf.layers code.

* :func:`batch_normalization`: the signature of
  ``tf.compat.v1.layers.batch_normalization`` (tf-keras' legacy layer), plus
  ``sync_statistics`` and ``num_dev``;
* :class:`BatchNormalization`: the layer object, with tf.layers' object API
  (``apply``, ``updates``, ``variables``, ``gamma``, ``moving_mean``, ...).

Both translate tf.layers' arguments, defaults, variable scopes and rules into
one call of the shared core (:func:`tf1_syncbn._core.call.batch_norm`). The
variables, their scopes and automatic names (``batch_normalization``,
``batch_normalization_1``, reuse through ``name`` plus ``reuse`` or the
enclosing variable scope), the update ops in ``UPDATE_OPS`` and the
regularization losses are tf.layers', so checkpoints written by tf.layers
code restore unchanged. :func:`tf1_syncbn.patch_tf_layers` makes
``tf.compat.v1.layers`` hand these out.

Where each part lives: :mod:`~tf1_syncbn.layers.layer` (the two names),
:mod:`~tf1_syncbn.layers.rules` (tf.layers' rules, in small functions),
:mod:`~tf1_syncbn.layers.patch` (:func:`~tf1_syncbn.patch_tf_layers`, also
reached here).
"""

from tf1_syncbn.layers.layer import BatchNormalization, batch_normalization
from tf1_syncbn.layers.patch import patch_tf_layers  # noqa: F401 - also tf1_syncbn.patch_tf_layers

__all__ = ['BatchNormalization', 'batch_normalization']

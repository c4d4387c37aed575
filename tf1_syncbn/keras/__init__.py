"""Keras 2's ``BatchNormalization``, synchronized, for Keras models in TF1 graphs.

Keras 2 is tf-keras (the package ``tf_keras``), or on TensorFlow 2.15 the
``keras`` 2.15 that ``tf.keras`` is there (``tf1_syncbn.keras.KERAS_PACKAGE``; below,
"tf-keras" stands for either).

* :class:`BatchNormalization`: ``tf_keras.layers.BatchNormalization`` (what
  ``tf.keras.layers.BatchNormalization`` is with ``TF_USE_LEGACY_KERAS=1``),
  plus ``sync_statistics`` and ``num_dev``;
* :class:`BatchNormalizationV1`: tf-keras' v1 layer
  (``tf.compat.v1.keras.layers.BatchNormalization``, what
  ``tf_keras.applications`` build under ``disable_v2_behavior()``), likewise;
* :func:`patch_keras` (also ``tf1_syncbn.patch_keras``): existing Keras code
  builds these (see :mod:`tf1_syncbn.keras.patch`).

Each is a subclass of tf-keras' own class that keeps its constructor,
``build`` (the weights, their names, order, dtypes and aggregation; but with
sync groups, the moving statistics read replica 0's copy under a
``tf.distribute`` strategy: :func:`~tf1_syncbn.keras.rules.statistics_aggregation`),
``get_config`` and training rules, and replaces the computation of ``call``
with one call of the shared core (:func:`tf1_syncbn._core.call.batch_norm`): the
towers, groups, backends, guards, shared updates and the variance rule are
the other front-ends'. The layers need tf-keras (``pip install --no-deps
"tf-keras~=<TensorFlow's major.minor>.0"``); ``import tf1_syncbn`` never
imports it.

Where each part lives: :mod:`~tf1_syncbn.keras.layer` (the classes),
:mod:`~tf1_syncbn.keras.rules` (tf-keras' rules, in small functions),
:mod:`~tf1_syncbn.keras.patch` (:func:`patch_keras`).
"""

from tf1_syncbn.keras.layer import (  # noqa: F401 - KERAS_*: what the classes subclass
    KERAS_BATCH_NORMALIZATION, KERAS_BATCH_NORMALIZATION_V1, KERAS_PACKAGE, BatchNormalization,
    BatchNormalizationV1)
from tf1_syncbn.keras.patch import patch_keras

__all__ = ['BatchNormalization', 'BatchNormalizationV1', 'patch_keras']

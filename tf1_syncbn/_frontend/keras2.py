"""What the Keras 2 front-ends share: which package, the versions in use, tf-keras' ghost rule.

The tf.layers front-end (:mod:`tf1_syncbn.layers`) and the Keras one
(:mod:`tf1_syncbn.keras`) both replace tf-keras' ``BatchNormalizationBase``;
the patches name the versions in their errors.

TensorFlow hands out Keras through a lazy loader (``tf.keras``,
``tf.compat.v1.keras``, ``tf.compat.v1.layers``) that picks the package when
first used, by the same rule from 2.15 to 2.21:

* ``TF_USE_LEGACY_KERAS=1`` (or ``true``): ``tf_keras`` (tf-keras, Keras 2);
* otherwise the ``keras`` package: Keras 2 on TensorFlow 2.15 (``keras``
  2.15), Keras 3 from 2.16 on.

:func:`package` applies that rule without importing anything: the Keras 2
package is the one ``tf.keras`` is, or ``tf_keras`` where ``tf.keras`` is
Keras 3 (code then uses ``tf_keras`` by name). Both Keras 2 packages lay out
their sources alike (``<package>.src.layers.normalization``,
``<package>.src.legacy_tf_layers``, ...).

:func:`ghost_batches_in_training`: when tf-keras' layer normalizes ghost
batches (``virtual_batch_size``), a rule both front-ends follow.
"""

import importlib.metadata
import os
import sys
import types

import tensorflow as tf

from tf1_syncbn._frontend.modules import namespace

__all__ = ['package', 'tf_keras_is_keras3', 'versions', 'ghost_batches_in_training']

#: The values of ``TF_USE_LEGACY_KERAS`` that TensorFlow's loader takes as true.
_LEGACY_VALUES = ('true', 'True', '1')


def _installed(name):
    """The version of the installed distribution ``name``, or None; imports nothing."""
    module = sys.modules.get(name)
    version = getattr(module, '__version__', None) if module is not None else None
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(name.replace('_', '-'))
    except importlib.metadata.PackageNotFoundError:
        return None


def legacy_keras_requested():
    """Whether ``TF_USE_LEGACY_KERAS`` asks TensorFlow for tf-keras (as its loader reads it)."""
    return os.environ.get('TF_USE_LEGACY_KERAS') in _LEGACY_VALUES


def _chosen():
    """What TensorFlow's ``tf.keras`` already is, when it has chosen: ``'keras_3'``,
    ``'keras_2'``, ``'tf_keras'``; else None. Reads the loader's namespace, so that
    nothing is imported."""
    space = namespace(sys.modules.get('tensorflow'))
    keras = space.get('keras') if space is not None else None
    loader = namespace(keras)
    if loader is None:
        return None
    chosen = loader.get('_tfll_keras_version', loader.get('_keras_version'))
    if chosen is not None:
        return chosen                         # the loader, initialized
    name = loader.get('__name__') if isinstance(keras, types.ModuleType) else None
    if not isinstance(name, str) or name in ('keras', 'tensorflow.keras'):
        return None                           # the loader, not initialized yet
    if name.startswith('tf_keras'):
        return 'tf_keras'
    return 'keras_3' if name.startswith('keras._tf_keras') else 'keras_2'


def tf_keras_is_keras3():
    """Whether ``tf.keras`` is (or will be) Keras 3 (TF 2.16+ without ``TF_USE_LEGACY_KERAS``)."""
    chosen = _chosen()
    if chosen is not None:
        return chosen == 'keras_3'
    if legacy_keras_requested():
        return False
    version = _installed('keras')
    return version is not None and version.startswith('3.')


def package():
    """``'keras'`` or ``'tf_keras'``: the Keras 2 package that existing code reaches.

    ``keras`` where ``tf.keras`` is it (TensorFlow 2.15's Keras 2), else
    ``tf_keras``.
    """
    chosen = _chosen()
    if chosen is not None:
        return 'keras' if chosen == 'keras_2' else 'tf_keras'
    if legacy_keras_requested():
        return 'tf_keras'
    version = _installed('keras')
    if version is not None and version.startswith('2.'):
        return 'keras'
    return 'tf_keras'


def versions():
    """``'TensorFlow 2.15.1, keras 2.15.0, tf-keras 2.15.1'``: what a message names.

    TensorFlow's version as imported; Keras' as installed (nothing is imported).
    """
    tf = sys.modules.get('tensorflow')
    parts = ['TensorFlow %s' % (getattr(tf, '__version__', None) or _installed('tensorflow')
                                or _installed('tensorflow-cpu'))]
    for name, label in (('keras', 'keras'), ('tf_keras', 'tf-keras')):
        version = _installed(name)
        if version is not None:
            parts.append('%s %s' % (label, version))
    parts.append('TF_USE_LEGACY_KERAS=%s' % os.environ.get('TF_USE_LEGACY_KERAS', '(unset)'))
    return ', '.join(parts)


def ghost_batches_in_training(training):
    """Whether tf.layers normalizes ghost batches in training, with ``virtual_batch_size`` set.

    tf-keras' ``BatchNormalizationBase.call`` reshapes the batch into virtual
    batches by a rule that depends on the TF behaviour the graph is built in
    (``tf.__internal__.tf2.enabled()``, which ``disable_v2_behavior()``
    turns off):

    * TF2 behaviour: only for a Python ``True`` ``training``; a tensor
      ``training`` reshapes to ``[-1, 1, ...]``, so the whole batch is one
      virtual batch;
    * TF1 behaviour: always ("preserve incorrect legacy behavior"), so a
      tensor ``training`` normalizes ghost batches in its training branch.

    Args:
      training: a Python bool or a scalar bool tensor.

    Returns:
      A Python bool (False for a Python ``False``: inference uses the moving
      statistics either way).
    """
    if training is True:
        return True
    if training is False:
        return False
    return not tf.__internal__.tf2.enabled()

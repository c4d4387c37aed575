"""Which Keras 2 package the Keras front-end and the patches work with, and the versions in use.

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
"""

import importlib.metadata
import os
import sys
import types

from tf1_syncbn._modules import namespace

__all__ = ['package', 'tf_keras_is_keras3', 'versions']

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

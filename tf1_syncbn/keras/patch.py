""":func:`patch_keras`, and how it switches tf-keras' classes: the one adapter place.

Existing Keras code reaches tf-keras' ``BatchNormalization`` in many ways:
``tf_keras.layers.BatchNormalization``, ``tf.keras.layers.BatchNormalization``
(with ``TF_USE_LEGACY_KERAS=1``, TensorFlow's lazy loader hands out
``tf_keras.api._v2.keras``), ``tf.compat.v1.keras.layers.BatchNormalization``
(tf-keras' v1 class), names that modules imported (``from tf_keras.layers
import BatchNormalization as BN``), and, in ``tf_keras.applications`` and
model deserialization, a per-thread table that tf-keras fills from its
layer modules (``tf_keras.src.layers.serialization.LOCAL.ALL_OBJECTS``,
read by ``VersionAwareLayers``). On TensorFlow 2.15 the same holds for Keras
2.15 (the package ``keras``, what ``tf.keras`` is there). :class:`ClassPatch`
replaces:

* every attribute, in every loaded module (and the module a TensorFlow
  module wrapper wraps), that *is* one of the original classes, under any
  name; this library's own modules keep them;
* that table: a fresh ``threading.local`` stands in for it while the patch is
  active, so every thread fills it again from the patched modules.

:meth:`ClassPatch.restore` undoes each replacement and also puts the
originals back where a module imported while the patch was active holds a
replacement. This module imports tf-keras (through :mod:`tf1_syncbn.keras.layer`).
"""

import importlib
import sys
import threading
import warnings

import tensorflow as tf

from tf1_syncbn._frontend.patching import (Name, Patch, failures, getattr_path, keras_versions,
                                           loaded_modules, namespace, tf_keras_is_keras3)
from tf1_syncbn.errors import SyncBNWarning
from tf1_syncbn.keras.layer import (KERAS_BATCH_NORMALIZATION, KERAS_BATCH_NORMALIZATION_V1,
                                    KERAS_PACKAGE, BatchNormalization, BatchNormalizationV1,
                                    _keras_bn)

__all__ = ['patch_keras', 'ClassPatch', 'class_with_defaults']

#: Modules that keep the original classes (this library's own references).
_OWN = ('tf1_syncbn.', 'tf1_syncbn')


def _own(name):
    return name == _OWN[1] or name.startswith(_OWN[0])


def class_with_defaults(cls, defaults):
    """A subclass of ``cls`` whose constructor defaults ``defaults`` (explicit arguments win).

    It keeps the class's name, module and documentation, so that Keras
    serializes its layers as ``cls``'s.
    """
    def __init__(self, *args, **kwargs):
        for key, value in defaults.items():
            kwargs.setdefault(key, value)
        super(patched, self).__init__(*args, **kwargs)

    patched = type(cls.__name__, (cls,), {'__init__': __init__, '__doc__': cls.__doc__,
                                          '__module__': cls.__module__})
    patched.__qualname__ = cls.__qualname__
    return patched


class ClassPatch(Patch):
    """Replaces classes across loaded modules until :meth:`restore`; a context manager.

    Args:
      api: the patching function's name, for messages.
      replacements: ``{original class: replacement class}``.
      serialization_module: the name of the module whose ``LOCAL`` caches the
        Keras package's layer classes per thread
        (``'tf_keras.src.layers.serialization'``).
      names: the :class:`~tf1_syncbn._frontend.patching.Name` objects that
        :meth:`verify` checks once the classes are replaced.
      instead: what to do where the patch cannot take effect.
    """

    target = 'tf-keras'

    def __init__(self, api, replacements, serialization_module, names=(), instead=None):
        super().__init__()
        self.api = api
        self.instead = instead
        self._replacements = dict(replacements)
        self._serialization_module = serialization_module
        self._names = list(names)

    def user_names(self):
        return self._names

    def _apply(self):
        # Runs last on restore: modules imported while the patch was active
        # hold replacements too.
        self._on_undo(self._put_back)
        originals = {id(original): replacement
                     for original, replacement in self._replacements.items()}
        for name, module in loaded_modules():
            if _own(name):
                continue
            for attribute, value in list(namespace(module).items()):
                if id(value) in originals:
                    self._set(module, attribute, originals[id(value)], direct=True)
        serialization = sys.modules.get(self._serialization_module)
        if serialization is not None:
            self._set(serialization, 'LOCAL', threading.local(), direct=True)

    def _put_back(self):
        back = {id(replacement): original
                for original, replacement in self._replacements.items()}
        for name, module in loaded_modules():
            if _own(name):
                continue
            space = namespace(module)
            for attribute, value in list(space.items()):
                if id(value) in back:
                    space[attribute] = back[id(value)]


def patch_keras(sync_statistics='auto', num_dev=None, group_size=None):
    """Makes tf-keras' ``BatchNormalization`` this library's, in loaded modules and new models.

    After this call, code that builds tf-keras' layer builds
    :class:`BatchNormalization` (tf-keras' v1 class: :class:`BatchNormalizationV1`)
    instead: ``tf_keras.layers.BatchNormalization``,
    ``tf.keras.layers.BatchNormalization`` and
    ``tf.compat.v1.keras.layers.BatchNormalization`` with
    ``TF_USE_LEGACY_KERAS=1``, the names your modules imported it as (``from
    tf_keras.layers import BatchNormalization as BN`` included), the
    ``tf_keras.applications`` models and models deserialized from a config::

        import tf1_syncbn.keras
        tf1_syncbn.keras.patch_keras(num_dev=4)     # before the model is built
        model = tf_keras.applications.ResNet50(weights=None, classes=10)

    Weights keep tf-keras' names, so tf-keras checkpoints and weight files
    load unchanged. Layers built before the call stay tf-keras'. The patch is
    process-wide (do not build another model in another thread meanwhile);
    undo it with ``restore()`` or a ``with`` block.

    Args:
      sync_statistics: the layers' default ``sync_statistics`` while the patch
        is active (``'auto'``: synchronize over the towers they are called in).
      num_dev: the layers' default ``num_dev`` (the number of towers of a
        script whose towers are ``tower_<i>`` name scopes).
      group_size: the layers' default ``group_size`` (docs/sync-groups.md).

    Returns:
      A handle with ``restore()``, usable as a context manager.

    The patch checks that those names (``tf.keras`` and ``tf.compat.v1.keras``
    where they are Keras 2) are this library's classes; where a TensorFlow/Keras
    release hands them out some other way, it undoes itself and raises. It
    warns (:class:`tf1_syncbn.SyncBNWarning`) about the Keras it leaves alone:
    ``tf.keras`` where it is Keras 3, and ``tf_keras`` where it is imported
    beside TensorFlow 2.15's Keras 2.15 (which this module then subclasses).

    Raises:
      RuntimeError: when a patch is already active.
      tf1_syncbn.PatchError: when a name above is not this library's class
        after the patch (the message names the TensorFlow and Keras versions);
        build :class:`BatchNormalization` directly instead.
    """
    defaults = {'sync_statistics': sync_statistics, 'num_dev': num_dev, 'group_size': group_size}
    v2 = class_with_defaults(BatchNormalization, defaults)
    v1 = class_with_defaults(BatchNormalizationV1, defaults)
    names = _user_names(v2, v1)
    failures(names)         # loads the modules the names go through, so that they are patched
    patch = ClassPatch('patch_keras', {KERAS_BATCH_NORMALIZATION: v2,
                                       KERAS_BATCH_NORMALIZATION_V1: v1},
                       KERAS_PACKAGE + '.src.layers.serialization', names,
                       'build tf1_syncbn.keras.BatchNormalization (or BatchNormalizationV1) in '
                       'place of Keras\' layer').apply()
    _warn_about_other_keras()
    return patch


def _warn_about_other_keras():
    """Says which Keras the patch leaves alone: Keras 3 as tf.keras, or tf-keras beside
    TensorFlow 2.15's Keras 2.15 (a layer of one Keras cannot go into a model of the other)."""
    if tf_keras_is_keras3():
        left, name = 'tf.keras is Keras 3, which does not build TF1 graphs', 'tf.keras'
    elif KERAS_PACKAGE != 'tf_keras' and 'tf_keras' in sys.modules:
        left, name = 'tf_keras is imported beside %s, which tf.keras is' % KERAS_PACKAGE, \
            'tf_keras'
    else:
        return
    warnings.warn(
        'patch_keras: %s (%s). The patch switches %s\'s BatchNormalization only: models built '
        'with %s.layers keep its own layer, with per-tower statistics. To switch tf-keras, set '
        'TF_USE_LEGACY_KERAS=1 before TensorFlow is imported (tf.keras is then tf-keras).'
        % (left, keras_versions(), KERAS_PACKAGE, name), SyncBNWarning, stacklevel=3)


def _user_names(v2, v1):
    """The names existing Keras code reaches Keras 2's layer by (see ``_frontend.patching``).

    ``tf.keras`` and ``tf.compat.v1.keras`` only where they are this Keras 2 package.
    """
    def package():
        return importlib.import_module(KERAS_PACKAGE)

    def module():
        return _keras_bn

    def applications():
        return importlib.import_module(KERAS_PACKAGE + '.src.layers').VersionAwareLayers()

    names = [
        Name(KERAS_PACKAGE + '.layers.BatchNormalization',
             getattr_path(package, 'layers.BatchNormalization'), lambda c: c is v2),
        Name(_keras_bn.__name__ + '.BatchNormalization',
             getattr_path(module, 'BatchNormalization'), lambda c: c is v2),
        Name('the layers of %s.applications (VersionAwareLayers)' % KERAS_PACKAGE,
             getattr_path(applications, 'BatchNormalization'), lambda c: c is v2 or c is v1)]
    if not tf_keras_is_keras3():
        names += [
            Name('tf.keras.layers.BatchNormalization',
                 getattr_path(lambda: tf, 'keras.layers.BatchNormalization'), lambda c: c is v2),
            Name('tf.compat.v1.keras.layers.BatchNormalization',
                 getattr_path(lambda: tf, 'compat.v1.keras.layers.BatchNormalization'),
                 lambda c: c is v1)]
    return names

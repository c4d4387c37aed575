"""How :func:`tf1_syncbn.keras.patch_keras` switches tf-keras' classes: the one adapter place.

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
replacement. Nothing here imports tf-keras: the caller (the module that
defines the replacements) has.
"""

import sys
import threading

from tf1_syncbn._modules import loaded_modules, namespace

__all__ = ['ClassPatch', 'class_with_defaults']

#: Modules that keep the original classes (this library's own references).
_OWN = ('tf1_syncbn.', 'tf1_syncbn')
_LOCK = threading.Lock()
_ACTIVE = []      # the active patch, if any


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


class ClassPatch(object):
    """Replaces classes across loaded modules until :meth:`restore`; a context manager.

    Args:
      api: the patching function's name, for messages.
      replacements: ``{original class: replacement class}``.
      serialization_module: the name of the module whose ``LOCAL`` caches the
        Keras package's layer classes per thread
        (``'tf_keras.src.layers.serialization'``).
    """

    def __init__(self, api, replacements, serialization_module):
        self._api = api
        self._replacements = dict(replacements)
        self._serialization_module = serialization_module
        self._undo = []                        # callables, run in reverse by restore()
        self._active = False

    @property
    def active(self):
        return self._active

    def _set(self, namespace, attribute, value):
        previous = namespace.get(attribute)
        namespace[attribute] = value

        def undo():
            namespace[attribute] = previous
        self._undo.append(undo)

    def apply(self):
        """Replaces the classes everywhere; raises ``RuntimeError`` when a patch is active.

        Returns:
          self.
        """
        with _LOCK:
            if _ACTIVE:
                raise RuntimeError('%s: tf-keras is already patched; restore the active patch '
                                   'first.' % self._api)
            self._active = True
            try:
                self._replace()
            except BaseException:
                self._undo_all()
                raise
            _ACTIVE.append(self)
        return self

    def _replace(self):
        originals = {id(original): replacement
                     for original, replacement in self._replacements.items()}
        for name, module in loaded_modules():
            if _own(name):
                continue
            space = namespace(module)
            for attribute, value in list(space.items()):
                if id(value) in originals:
                    self._set(space, attribute, originals[id(value)])
        serialization = sys.modules.get(self._serialization_module)
        if serialization is not None:
            self._set(vars(serialization), 'LOCAL', threading.local())

    def _undo_all(self):
        self._active = False
        while self._undo:
            self._undo.pop()()
        # Modules imported while the patch was active hold replacements too.
        back = {id(replacement): original
                for original, replacement in self._replacements.items()}
        for name, module in loaded_modules():
            if _own(name):
                continue
            space = namespace(module)
            for attribute, value in list(space.items()):
                if id(value) in back:
                    space[attribute] = back[id(value)]

    def restore(self):
        """Puts tf-keras' classes back where they were; idempotent."""
        with _LOCK:
            if not self._active:
                return
            self._undo_all()
            _ACTIVE.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False

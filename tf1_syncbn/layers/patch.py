"""``patch_tf_layers``: ``tf.compat.v1.layers``' batch normalization becomes this library's.

The one place that knows how TensorFlow hands out ``tf.compat.v1.layers``:

* On TensorFlow 2.16+ with Keras 3 (no ``TF_USE_LEGACY_KERAS``),
  ``tf.compat.v1.layers`` is a ``KerasLazyLoader`` that refuses every name
  (``AttributeError: `batch_normalization` is not available with Keras 3``).
  The patch puts this library's two names into the loader itself, so that
  ``tf.compat.v1.layers.batch_normalization`` and ``.BatchNormalization``
  work; every other tf.layers name still fails as before.
* With tf-keras and ``TF_USE_LEGACY_KERAS=1`` the loader imports tf-keras'
  legacy layers on first use (``tf_keras.api._v1.keras.__internal__.legacy.
  layers``) and copies that module's names into itself. The patch replaces
  the two names in the loader, in that module and wherever a loaded module
  holds tf-keras' objects (names your modules imported included), and, when
  tf-keras is not loaded yet, once it is: tf-keras is never imported here.
  ``conv2d``, ``dense`` and the rest stay tf-keras'.

* A script (or a module it imports) may also import the submodule itself,
  ``from tensorflow.compat.v1.layers import batch_normalization`` or
  ``import tensorflow.compat.v1.layers``: Python then loads a module of
  that name, which replaces the loader as ``tf.compat.v1.layers``. While the
  patch is active, an import hook puts this library's two names into that
  module as it loads (with or without tf-keras).

* On TensorFlow 2.15 without ``TF_USE_LEGACY_KERAS`` the loader hands out
  Keras 2.15's legacy layers (``keras.src.legacy_tf_layers``), and keeps the
  submodule it stands for as ``_submodule`` (``_tfll_submodule`` from 2.16):
  the same, with Keras 2.15's objects.

Once applied, the patch looks the names up as a script does and raises
:class:`tf1_syncbn.PatchError` (after undoing itself) where one is not this
library's (:mod:`tf1_syncbn._frontend.patching`).

Keras' and TensorFlow's own modules (``tf_keras.src``, ``keras.src``,
``tensorflow.python``) keep Keras' layer, so ``slim.batch_norm``, which
builds it internally, is unchanged (use :func:`tf1_syncbn.sync_arg_scope`).
"""

import functools
import importlib
import importlib.abc
import sys
import types

from tf1_syncbn._frontend.patching import Name, Patch, getattr_path, loaded_modules, namespace
from tf1_syncbn.layers import layer as layers

__all__ = ['patch_tf_layers']

_NAMES = ('batch_normalization', 'BatchNormalization')
#: The modules that define the replaced objects (they also hold aliases): tf-keras'
#: and, on TensorFlow 2.15, Keras 2.15's (``tf.compat.v1.layers`` without
#: ``TF_USE_LEGACY_KERAS``).
_KERAS_MODULES = ('tf_keras.src.legacy_tf_layers.normalization',
                  'keras.src.legacy_tf_layers.normalization')
#: Modules whose own references stay Keras' (the libraries' internals).
_INTERNAL = ('tf_keras.src.', 'keras.src.', 'tensorflow.python.')
#: The submodule TensorFlow's lazy loader of ``tf.compat.v1.layers`` resolves.
_LOADER_SUBMODULE = '__internal__.legacy.layers'
#: Where the loader keeps it: ``_tfll_submodule`` from TensorFlow 2.16, ``_submodule`` on 2.15.
_LOADER_SUBMODULE_ATTRIBUTES = ('_tfll_submodule', '_submodule')
#: The module an import statement loads in the loader's place.
_IMPORTED_MODULE = 'tensorflow.compat.v1.layers'


def _is_layers_loader(value):
    """Whether ``value`` is TensorFlow's lazy loader of ``tf.compat.v1.layers``."""
    space = namespace(value) if isinstance(value, types.ModuleType) else None
    return space is not None and any(space.get(attribute) == _LOADER_SUBMODULE
                                     for attribute in _LOADER_SUBMODULE_ATTRIBUTES)


class _ImportHook(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder: calls ``on_import(module)`` when ``name`` has been loaded.

    It finds nothing itself: it asks the finders after it, and wraps the
    loader of their spec so that ``on_import`` runs right after the module's
    code (before the import statement binds any name from it).
    """

    def __init__(self, name, on_import):
        self._name = name
        self._on_import = on_import
        self._finding = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self._name or self._finding:
            return None
        self._finding = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, 'find_spec'):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._finding = False
        if spec.loader is not None and hasattr(spec.loader, 'exec_module'):
            spec.loader = _NotifyingLoader(spec.loader, self._on_import)
        return spec


class _NotifyingLoader(importlib.abc.Loader):
    """``loader``, then ``on_import(module)`` once the module's code has run."""

    def __init__(self, loader, on_import):
        self._loader = loader
        self._on_import = on_import

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._on_import(module)


class _TfLayersPatch(Patch):
    """The handle :func:`patch_tf_layers` returns: a context manager, or call :meth:`restore`."""

    api = 'patch_tf_layers'
    target = 'tf.compat.v1.layers'

    def __init__(self, replacements):
        super().__init__()
        self._replacements = replacements      # {name: this library's object}
        self.instead = _INSTEAD

    def _apply(self):
        self._replace()
        loaded = sys.modules.get(_IMPORTED_MODULE)
        if loaded is not None and not _is_layers_loader(loaded):
            for name in _NAMES:            # imported as a module before the patch
                self._set(loaded, name, self._replacements[name])
        self._watch_imports()

    def user_names(self):
        return _user_names(self._replacements)

    def _watch_imports(self):
        """Patches ``tensorflow.compat.v1.layers`` when an import statement loads it as a module."""
        def on_import(module):
            with self._lock:
                if not self.active:
                    return
                for name in _NAMES:
                    self._set(module, name, self._replacements[name])
                self._replace()
            self.verify(_names_in(module, self._replacements,
                                  'from tensorflow.compat.v1.layers import %s'))

        hook = _ImportHook(_IMPORTED_MODULE, on_import)
        sys.meta_path.insert(0, hook)

        def undo():
            if hook in sys.meta_path:
                sys.meta_path.remove(hook)
        self._on_undo(undo)

    def _replace(self):
        """Replaces tf-keras' objects in every loaded module and ``tf.compat.v1.layers``."""
        originals = {}
        for keras in filter(None, map(sys.modules.get, _KERAS_MODULES)):
            for alias, name in (('batch_normalization', 'batch_normalization'),
                                ('batch_norm', 'batch_normalization'),
                                ('BatchNormalization', 'BatchNormalization'),
                                ('BatchNorm', 'BatchNormalization')):
                original = vars(keras).get(alias)
                if original is not None:
                    originals[id(original)] = self._replacements[name]
        # A yielding patch that stepped aside for this one (python -m tf1_syncbn.run's): the
        # names a module imported while it was active are its objects.
        for waiting in self._waiting_patches:
            for name, replacement in waiting._replacements.items():  # noqa: SLF001 - same kind
                originals[id(replacement)] = self._replacements[name]
        loaders = {}
        for name, space in loaded_modules():
            internal = name.startswith(_INTERNAL)
            for attribute, value in list(vars(space).items()):
                if _is_layers_loader(value):
                    loaders[id(value)] = value
                elif not internal and id(value) in originals:
                    self._set(space, attribute, originals[id(value)])
        # A lazy loader is written to directly: its setattr would import the
        # module it stands for.
        for loader in loaders.values():
            for attribute, value in list(vars(loader).items()):
                if id(value) in originals:
                    self._set(loader, attribute, originals[id(value)], direct=True)
            for name in _NAMES:
                self._set(loader, name, self._replacements[name], direct=True)
            if '_load' not in vars(loader):
                self._hook(loader)

    def _hook(self, loader):
        """Re-applies the patch once ``loader`` imports tf-keras (its ``_load`` copies names)."""
        def load():
            module = type(loader)._load(loader)  # noqa: SLF001 - the loader's own method
            with self._lock:
                if self.active:
                    self._replace()
            return module

        self._set(loader, '_load', load, direct=True)


#: What to do where the patch cannot take effect.
_INSTEAD = ('call tf1_syncbn.layers.batch_normalization or tf1_syncbn.layers.BatchNormalization '
            'directly (tf.layers\' arguments, plus num_dev for tower_<i> loops)')


def _names_in(space, replacements, spelling):
    """The two names as user code reads them from ``space`` (a module or TensorFlow's loader)."""
    def resolve(name):
        return lambda: getattr(space, name)
    return [Name(spelling % name, resolve(name), lambda value, name=name:
                 value is replacements[name]) for name in _NAMES]


def _user_names(replacements):
    """Every way a script reaches tf.layers' batch normalization (see ``_patch_check``)."""
    def tensorflow():
        return importlib.import_module('tensorflow')

    def compat_v1():
        return importlib.import_module('tensorflow.compat.v1')

    names = []
    for name in _NAMES:
        def ours(value, name=name):
            return value is replacements[name]
        names.append(Name('tf.compat.v1.layers.' + name,
                          getattr_path(tensorflow, 'compat.v1.layers.' + name), ours))
        names.append(Name('tf.layers.%s (import tensorflow.compat.v1 as tf)' % name,
                          getattr_path(compat_v1, 'layers.' + name), ours))
    imported = sys.modules.get(_IMPORTED_MODULE)
    if imported is not None and not _is_layers_loader(imported):
        names += _names_in(imported, replacements, 'from tensorflow.compat.v1.layers import %s')
    return names


def _replacements(sync_statistics, num_dev, group_size=None):
    """This library's two objects, with the patch's defaults for its own arguments."""
    defaults = {'sync_statistics': sync_statistics, 'num_dev': num_dev,
                'group_size': group_size}

    @functools.wraps(layers.batch_normalization)
    def batch_normalization(inputs, *args, **kwargs):
        return layers.batch_normalization(inputs, *args, **dict(defaults, **kwargs))

    class BatchNormalization(layers.BatchNormalization):
        __doc__ = layers.BatchNormalization.__doc__

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **dict(defaults, **kwargs))

    BatchNormalization.__qualname__ = 'BatchNormalization'
    BatchNormalization.__module__ = layers.BatchNormalization.__module__
    return {'batch_normalization': batch_normalization, 'BatchNormalization': BatchNormalization}


def patch_tf_layers(sync_statistics='auto', num_dev=None, group_size=None):
    """Makes ``tf.compat.v1.layers``' batch normalization this library's.

    After this call, ``tf.compat.v1.layers.batch_normalization`` and
    ``tf.compat.v1.layers.BatchNormalization`` (also reached as ``tf.layers``
    with ``import tensorflow.compat.v1 as tf``, and under any name your modules
    imported them as) are :func:`tf1_syncbn.layers.batch_normalization` and a
    subclass of :class:`tf1_syncbn.layers.BatchNormalization`: an unmodified
    tf.layers script runs, on plain TensorFlow 2.16+ as with tf-keras and
    ``TF_USE_LEGACY_KERAS=1``, and synchronizes where its towers are built
    (a ``TowerContext``, tensorpack's trainers, a tf.distribute strategy, or
    ``tower_<i>`` / ``clone_<i>`` name scopes with ``num_dev``)::

        import tf1_syncbn
        tf1_syncbn.patch_tf_layers(num_dev=4)      # before the model is built
        ...                                       # the script, unchanged

    Variables keep tf.layers' names, so existing checkpoints restore. The
    patch is process-wide (do not build another model in another thread
    meanwhile); undo it with ``restore()`` or a ``with`` block.

    Args:
      sync_statistics: the layers' default ``sync_statistics`` while the patch
        is active (``'auto'``: synchronize over the towers they are built in).
      num_dev: the layers' default ``num_dev`` (the number of towers of a
        script whose towers are ``tower_<i>`` name scopes).
      group_size: the layers' default ``group_size`` (synchronize within
        groups of that many consecutive global towers; None: every tower).

    Returns:
      A handle with ``restore()``, usable as a context manager.

    The patch checks that ``tf.compat.v1.layers.batch_normalization``,
    ``.BatchNormalization`` (``tf.layers`` with ``import tensorflow.compat.v1
    as tf``) and, once imported, ``from tensorflow.compat.v1.layers import
    ...`` are this library's; where a TensorFlow/Keras release hands them out
    some other way, it undoes itself and raises (the import raises, for an
    import after the patch) instead of leaving the script on per-tower
    statistics.

    Raises:
      RuntimeError: when a patch is already active.
      tf1_syncbn.PatchError: when a name above is not this library's layer
        after the patch: the message names the TensorFlow and Keras versions;
        call :func:`tf1_syncbn.layers.batch_normalization` directly instead.
    """
    return _TfLayersPatch(_replacements(sync_statistics, num_dev, group_size)).apply()

"""``patch_tensorpack``: code written for tensorpack's ``BatchNorm``/``BatchRenorm`` builds
this library's (by imported name, through ``argscope`` and through ``LinearWrap``).

tensorpack is imported only when :func:`patch_tensorpack` is called.
"""

import importlib
import inspect

from tf1_syncbn._frontend.patching import Name, Patch, getattr_path, loaded_modules, namespace
from tf1_syncbn.tensorpack.rules import _DEFAULTS, _LAYER_NAMES, _LAYERS, _LOCK

__all__ = ['patch_tensorpack']


class _TensorpackPatch(Patch):
    """The handle :func:`patch_tensorpack` returns: a context manager, or call :meth:`restore`."""

    api = 'patch_tensorpack'
    target = 'tensorpack'
    instead = ("call tf1_syncbn.BatchNorm / tf1_syncbn.BatchRenorm (tensorpack's arguments, "
               "plus sync_statistics='auto') in place of tensorpack's")

    def __init__(self, sync_statistics, defaults):
        super().__init__()
        layer_defaults = dict(defaults)
        layer_defaults['sync_statistics'] = sync_statistics
        self._defaults = {name: dict(layer_defaults) for name in _LAYER_NAMES}
        self._keys = list(defaults)
        self._replaced = []                # [(module, attribute, original)]
        # The layers register themselves (rules.tensorpack_layer) when
        # tf1_syncbn.tensorpack.layer is imported (importing tf1_syncbn does):
        # no import of that module here.
        self._ours = {name: _LAYERS[name] for name in _LAYER_NAMES}

    @property
    def patched_modules(self):
        """The names of the modules whose attributes were replaced."""
        return sorted({module.__name__ for module, _, _ in self._replaced})

    def _apply(self):
        from tensorpack.models import batch_norm as tp_batch_norm  # noqa: PLC0415
        from tensorpack.models import registry as tp_registry  # noqa: PLC0415

        ours = self._ours
        theirs = {name: getattr(tp_batch_norm, name) for name in _LAYER_NAMES}
        if any(f is ours[name] for name, f in theirs.items()):
            raise RuntimeError('patch_tensorpack: tensorpack is already patched; restore the '
                               'active patch first.')
        replaced = _attributes_holding(theirs)
        for key in self._keys:
            for name, layer in ours.items():
                if key not in inspect.signature(layer).parameters:
                    raise TypeError('patch_tensorpack: %s has no argument %r.' % (name, key))
        for module, attribute, original in replaced:
            self._set(module, attribute, ours[_name_of(original, theirs)])
        self._replaced = replaced
        registry = tp_registry._LAYER_REGISTRY  # noqa: SLF001 - what LinearWrap reads
        for name in _LAYER_NAMES:
            self._set_item(registry, name, ours[name])
        with _LOCK:
            _DEFAULTS.update(self._defaults)
        self._on_undo(self._drop_defaults)

    def _drop_defaults(self):
        with _LOCK:
            for name in _LAYER_NAMES:
                stack = _DEFAULTS.get(name)
                if stack is not None and stack is self._defaults.get(name):
                    del _DEFAULTS[name]

    def user_names(self):
        return _user_names(self._ours)


def _attributes_holding(originals):
    """``[(module, attribute, original)]``: every module attribute that *is* one of ``originals``.

    Found by identity, under any name: ``from tensorpack.models import
    BatchNorm as BN`` is replaced as ``BN``. Module namespaces are read as
    dicts, so no module's attribute hooks run.
    """
    by_id = {id(f): f for f in originals.values()}
    found = []
    for _, module in loaded_modules():
        for attribute, value in list(namespace(module).items()):
            if id(value) in by_id and value is by_id[id(value)]:
                found.append((module, attribute, value))
    return found


def _name_of(original, originals):
    return next(name for name, f in originals.items() if f is original)


def patch_tensorpack(sync_statistics=None, **defaults):
    """Makes code written for tensorpack's ``BatchNorm``/``BatchRenorm`` build this library's.

    Call it once, before the model is built (a trainer builds it in
    ``launch_train_with_config`` / ``setup_graph``)::

        from tensorpack import *
        import tf1_syncbn
        tf1_syncbn.patch_tensorpack(sync_statistics='auto')   # every BatchNorm is synchronized

        launch_train_with_config(config, SyncMultiGPUTrainerReplicated(8))

    What it changes, until :meth:`restore` (or the end of a ``with`` block):

    * tensorpack's layer registry, which ``LinearWrap(x).BatchNorm('bn')``
      looks layers up in;
    * every attribute, in every loaded module, that *is* tensorpack's
      ``BatchNorm`` or ``BatchRenorm`` function, under any name:
      ``tensorpack.BatchNorm``, ``tensorpack.models.BatchNorm``, and the
      names your own modules imported (``from tensorpack import *`` before
      this call included, and aliases such as ``from tensorpack.models import
      BatchNorm as BN``). Nothing else is touched: an attribute is replaced
      only when it is the very function object tensorpack defines, and
      :meth:`restore` puts back exactly those;
    * while active, the layers default to the given keyword arguments
      (``sync_statistics`` and ``**defaults``); explicit arguments and
      ``argscope`` still win.

    ``argscope([Conv2D, BatchNorm], ...)`` applies to both layers in any case
    (tensorpack keys argscopes by name). The patch is process-wide: do not
    build another model in another thread at the same time.

    Variables keep tensorpack's names (``beta``, ``gamma``, ``mean/EMA``,
    ``variance/EMA``), so existing checkpoints restore.

    Args:
      sync_statistics: the default ``sync_statistics`` of the layers while the
        patch is active: None (tensorpack's default, per-tower statistics),
        ``'auto'``, ``'collective'``, ``'nccl'``, ``'horovod'`` or a
        :class:`tf1_syncbn.SyncBackend`.
      **defaults: other default keyword arguments of both layers, for example
        ``epsilon=1e-5``, ``num_dev=<towers>`` for towers built under
        ``tower_<i>`` name scopes without a tower context (a plain ``tower_%d``
        loop; tensorpack's trainers need none), or ``group_size=2`` (with a
        ``sync_statistics`` other than None: the layers refuse ``group_size``
        with None).

    Returns:
      A handle with ``restore()``, usable as a context manager.

    The patch checks that ``tensorpack.BatchNorm``, ``tensorpack.models.BatchNorm``
    and the layer ``LinearWrap`` finds (``BatchRenorm`` likewise) are this
    library's; where a tensorpack/TensorFlow release hands them out some other
    way, it undoes itself and raises.

    Raises:
      ImportError: when tensorpack is not installed.
      RuntimeError: when a patch is already active.
      TypeError: when a default is not an argument of both layers.
      tf1_syncbn.PatchError: when a name above is not this library's layer after
        the patch (the message names the TensorFlow and Keras versions); call
        :func:`tf1_syncbn.BatchNorm` directly instead.
    """
    return _TensorpackPatch(sync_statistics, defaults).apply()


def _user_names(ours):
    """How tensorpack code reaches its layers: ``tensorpack.BatchNorm``, ``tensorpack.models``,
    the defining module, and the registry ``LinearWrap(x).BatchNorm(...)`` looks layers up in."""
    def module(name):
        return lambda: importlib.import_module(name)

    names = []
    for name, layer in ours.items():
        def accept(value, layer=layer):
            return value is layer
        for where in ('tensorpack', 'tensorpack.models', 'tensorpack.models.batch_norm'):
            names.append(Name('%s.%s' % (where, name), getattr_path(module(where), name), accept))
        names.append(Name('LinearWrap(x).%s' % name,
                          lambda name=name: importlib.import_module(
                              'tensorpack.models.registry').get_registered_layer(name), accept))
    return names

"""Switch tf-slim models from ``slim.batch_norm`` to :func:`sync_batch_norm`.

This is the TF1 / tf-slim counterpart of PyTorch's
``nn.SyncBatchNorm.convert_sync_batchnorm`` and Paddle's
``convert_sync_batchnorm``: a model written for ``slim.batch_norm`` (the
``tf_slim.nets`` ResNets, Inception, or your own slim code) is built with
synchronized batch norm without editing it::

    from tf_slim.nets import resnet_v1
    from tf1_syncbn import sync_arg_scope

    def tower_fn():
        with slim.arg_scope(resnet_v1.resnet_arg_scope()):
            with sync_arg_scope():
                logits, _ = resnet_v1.resnet_v1_50(images, num_classes=10)

    tower.call_for_each_tower(tower_fn, ['/gpu:0', '/gpu:1'])

Models reach batch norm in three ways, and :func:`sync_arg_scope` covers each:

1. ``normalizer_fn=slim.batch_norm`` with ``normalizer_params`` in an
   ``arg_scope`` of ``conv2d`` / ``fully_connected`` (every ``*_arg_scope`` of
   ``tf_slim.nets``): the arg scope is rewritten by :func:`convert_arg_scope`
   so that ``normalizer_fn`` is :func:`sync_batch_norm`, with the same
   ``normalizer_params`` plus ``sync_statistics`` and your overrides.
2. ``slim.arg_scope([slim.batch_norm], **params)`` (``resnet_arg_scope`` sets
   the batch-norm parameters this way too): the parameters are copied to
   :func:`sync_batch_norm`'s entry of the arg scope.
3. Direct calls ``layers.batch_norm(...)`` made while the model is built
   (``resnet_v2``'s pre-activations), and arg scopes that the model opens
   itself while it is built (``arg_scope([layers.batch_norm],
   is_training=is_training)`` in ``resnet_v1``, ``resnet_v2`` and
   ``inception_v3``): these look the function up by name at call time, so
   while the ``with`` block is open :func:`sync_arg_scope` **patches** the
   module attribute ``batch_norm`` to :func:`sync_batch_norm` in

   * ``tf_slim`` (``slim.batch_norm``),
   * ``tf_slim.layers`` (``slim.layers.batch_norm``),
   * ``tf_slim.layers.layers`` (the module that ``tf_slim.nets`` imports as
     ``layers`` / ``layers_lib``),
   * every other loaded ``tf_slim.*`` module whose ``batch_norm`` attribute is
     slim's batch norm, and the extra modules you pass in ``modules``.

   The original functions are restored when the block exits, also on an
   exception. Without the patch, case 3 would build ``slim.batch_norm``
   (which fails on recent TF, 2.21 included) and the model's ``is_training``
   would not reach the converted layers.

What is *not* converted: a reference to ``slim.batch_norm`` that was copied
into another name before the block (``bn = slim.batch_norm``) or into a module
that is not listed; ``tf.compat.v1.layers.batch_normalization`` and Keras
layers. The patch changes module attributes for the whole process while a block is
open. It is reference-counted: blocks opened in several threads at once (the
replica threads of ``tf.distribute.MirroredStrategy``, which build the
replicas in turns) keep the patch until the last of them exits, so no replica
builds ``slim.batch_norm`` because another one left its block first. Another
model built at the same time in another thread, outside any block, would see
the patch too.

:func:`patch_slim` is the process-wide switch, in the shape of
:func:`tf1_syncbn.patch_tf_layers` (``python -m tf1_syncbn.run`` uses it):
``slim.batch_norm`` becomes :func:`sync_batch_norm`, with the patch's
``num_dev`` / ``sync_statistics`` / ``group_size`` as defaults, in every
loaded module that holds it (copies made before the patch included), until
``restore()``.
"""

import contextlib
import functools
import importlib
import inspect
import sys

from tf_slim.ops import arg_scope as slim_arg_scope

from tf1_syncbn._frontend.patching import (Name, Patch, getattr_path, loaded_modules, namespace,
                                           verify)
from tf1_syncbn.slim.layer import sync_batch_norm

__all__ = ['sync_arg_scope', 'convert_arg_scope', 'patch_slim_batch_norm',
           'is_slim_batch_norm', 'patch_slim']

_SLIM_LAYERS_MODULE = 'tf_slim.layers.layers'


_ORIGINAL_BATCH_NORM = importlib.import_module(_SLIM_LAYERS_MODULE).batch_norm
_PATCHED = {}      # id(module) -> [module, original batch_norm, open blocks]
_SYNC_KEY = slim_arg_scope.arg_scope_func_key(sync_batch_norm)
_SLIM_KEY = slim_arg_scope.arg_scope_func_key(_ORIGINAL_BATCH_NORM)


def _is(fn, function, key):
    """Whether ``fn`` is ``function``, or what arg scopes key as it (``key``)."""
    if fn is None:
        return False
    if fn is function:
        return True
    try:
        return slim_arg_scope.arg_scope_func_key(fn) == key
    except (TypeError, AttributeError):
        return False


def is_slim_batch_norm(fn):
    """True when ``fn`` is tf-slim's ``batch_norm`` (under any of its module names)."""
    return _is(fn, _ORIGINAL_BATCH_NORM, _SLIM_KEY)


def _is_sync_batch_norm(fn):
    return _is(fn, sync_batch_norm, _SYNC_KEY)


def _check_scope(scope, what):
    if not isinstance(scope, dict):
        raise TypeError('%s: scope must be a slim arg_scope dict (what slim.arg_scope(...) '
                        'yields or a *_arg_scope() function returns), got %r.' % (what, scope))
    for key, kwargs in scope.items():
        if not isinstance(kwargs, dict):
            raise TypeError('%s: the arg_scope entry %r must be a dict of keyword arguments, '
                            'got %r.' % (what, key, kwargs))


def _sync_kwargs(sync_statistics, bn_overrides):
    kwargs = dict(bn_overrides)
    kwargs['sync_statistics'] = sync_statistics
    return kwargs


def _keyword_names(fn):
    # Not slim's arg_scoped_arguments(): it miscounts functions with locals.
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _check_overrides(bn_overrides, what):
    if 'inputs' in bn_overrides or 'scope' in bn_overrides:
        raise TypeError('%s: inputs and scope cannot be overridden for every layer.' % what)
    allowed = set(_keyword_names(sync_batch_norm)) - {'inputs', 'scope'}
    unknown = sorted(set(bn_overrides) - allowed)
    if unknown:
        raise TypeError('%s: unknown sync_batch_norm argument(s) %s; allowed are %s.'
                        % (what, unknown, sorted(allowed)))


def convert_arg_scope(scope, sync_statistics='auto', add_normalizer_to=(), **bn_overrides):
    """Returns a copy of a slim arg scope that uses :func:`sync_batch_norm`.

    Every entry with ``normalizer_fn=slim.batch_norm`` (for example the
    ``conv2d`` entry of ``resnet_arg_scope()``) gets
    ``normalizer_fn=sync_batch_norm`` and ``normalizer_params`` extended with
    ``sync_statistics`` and ``bn_overrides``. The keyword arguments given to
    ``slim.batch_norm`` itself (``arg_scope([slim.batch_norm], ...)``) are
    copied to the entry of :func:`sync_batch_norm`, which also receives
    ``sync_statistics`` and ``bn_overrides``. Entries that already use
    :func:`sync_batch_norm` are extended the same way. The input is not
    modified.

    This only rewrites the arg scope; models that call ``slim.batch_norm``
    directly, or open their own ``arg_scope([slim.batch_norm], ...)``, also
    need :func:`patch_slim_batch_norm`. :func:`sync_arg_scope` does both.

    Args:
      scope: a slim arg-scope dict, such as ``resnet_v1.resnet_arg_scope()`` or
        ``slim.current_arg_scope()``.
      sync_statistics: passed to every :func:`sync_batch_norm`: ``'auto'``,
        ``'collective'``, ``'nccl'``, a backend object, or None for per-tower
        statistics.
      add_normalizer_to: ops decorated with ``add_arg_scope`` (such as
        ``slim.conv2d``) that get ``normalizer_fn=sync_batch_norm`` where the
        scope gives them no normalizer yet: this adds batch norm to nets that
        have none, such as VGG ("VGG-BN"). Their ``normalizer_params`` are
        ``sync_statistics`` and ``bn_overrides``. An explicit
        ``normalizer_fn=None`` in the model (VGG's ``fc8`` logits) still wins.
      **bn_overrides: :func:`sync_batch_norm` arguments that override the
        scope's, for example ``decay=0.9`` or ``is_training=False``.

    Returns:
      A new arg-scope dict, for ``slim.arg_scope(new_scope)``.

    Raises:
      TypeError: when ``scope`` is not an arg-scope dict, an override is not
        an argument of :func:`sync_batch_norm`, or an op of
        ``add_normalizer_to`` is not decorated with ``add_arg_scope``.
    """
    what = 'convert_arg_scope'
    _check_scope(scope, what)
    _check_overrides(bn_overrides, what)
    sync_kwargs = _sync_kwargs(sync_statistics, bn_overrides)
    converted = {}
    for key, kwargs in scope.items():
        kwargs = dict(kwargs)
        if 'normalizer_fn' in kwargs and (is_slim_batch_norm(kwargs['normalizer_fn']) or
                                          _is_sync_batch_norm(kwargs['normalizer_fn'])):
            params = kwargs.get('normalizer_params') or {}
            if not isinstance(params, dict):
                raise TypeError('%s: normalizer_params of the arg_scope entry %r must be a dict, '
                                'got %r.' % (what, key, params))
            params = dict(params)
            params.update(sync_kwargs)
            kwargs['normalizer_fn'] = sync_batch_norm
            kwargs['normalizer_params'] = params
        converted[key] = kwargs
    bn_kwargs = dict(scope.get(_SLIM_KEY, {}))
    bn_kwargs.update(scope.get(_SYNC_KEY, {}))
    bn_kwargs.update(sync_kwargs)
    converted[_SYNC_KEY] = bn_kwargs
    for op in add_normalizer_to or ():
        if not slim_arg_scope.has_arg_scope(op):
            raise TypeError('%s: add_normalizer_to lists %r, which is not decorated with '
                            'add_arg_scope.' % (what, op))
        key = slim_arg_scope.arg_scope_func_key(op)
        if 'normalizer_fn' not in _keyword_names(op):
            raise TypeError('%s: %r has no normalizer_fn argument.' % (what, op))
        kwargs = dict(converted.get(key, {}))
        if kwargs.get('normalizer_fn') is None:
            kwargs['normalizer_fn'] = sync_batch_norm
            kwargs['normalizer_params'] = dict(sync_kwargs)
        converted[key] = kwargs
    return converted


@contextlib.contextmanager
def patch_slim_batch_norm(modules=()):
    """Makes ``slim.batch_norm`` name :func:`sync_batch_norm` inside the block.

    Sets the attribute ``batch_norm`` to :func:`sync_batch_norm` in
    ``tf_slim``, ``tf_slim.layers``, ``tf_slim.layers.layers`` and every other
    loaded ``tf_slim.*`` module where it is slim's batch norm, and in the
    extra ``modules``; restores every attribute it changed on exit (also on
    an exception). Nested uses and uses from several threads at once are
    fine: the patch is reference-counted, and an attribute is restored when
    the last block that patched it exits.

    Args:
      modules: extra module objects (or ``sys.modules`` names) whose
        ``batch_norm`` attribute should be patched too, for your own code that
        did ``from tf_slim.layers.layers import batch_norm``.

    Yields:
      The list of ``(module, attribute)`` pairs that were patched.

    Raises:
      TypeError: when ``modules`` names a module that is not loaded, or that
        has no ``batch_norm`` attribute that is slim's batch norm.
    """
    patch = _SlimPatch(modules).apply()
    try:
        yield [(module, 'batch_norm') for module in patch.targets]
    finally:
        patch.restore()


class _SlimPatch(Patch):
    """``batch_norm`` of slim's modules named :func:`sync_batch_norm`, reference-counted.

    Blocks nest, and blocks of several threads overlap (the replica threads of
    ``MirroredStrategy``): each module attribute is patched by the first block
    that reaches it and restored when the last one that patched it exits
    (``_PATCHED``, under the kind's lock). The check of the names is
    :func:`sync_arg_scope`'s, with the arg scope in force.
    """

    api = 'patch_slim_batch_norm'
    target = 'tf_slim'
    exclusive = False

    def __init__(self, modules):
        super().__init__()
        self._modules = modules
        self.targets = []

    def _apply(self):
        self.targets = _patch_targets(self._modules)
        for module in self.targets:
            entry = _PATCHED.get(id(module))
            if entry is None:
                _PATCHED[id(module)] = [module, module.batch_norm, 1]
                module.batch_norm = sync_batch_norm
            else:
                entry[2] += 1
            self._on_undo(functools.partial(_release, module))


def _release(module):
    """One block less on ``module`` (under the lock): the last one restores its ``batch_norm``."""
    entry = _PATCHED[id(module)]
    entry[2] -= 1
    if entry[2] == 0:
        module.batch_norm = entry[1]
        del _PATCHED[id(module)]


def _patch_targets(modules):
    """The modules whose ``batch_norm`` the block patches (already patched ones included)."""
    def patchable(module):
        return id(module) in _PATCHED or is_slim_batch_norm(getattr(module, 'batch_norm', None))

    targets = [module for name, module in list(sys.modules.items())
               if module is not None and (name == 'tf_slim' or name.startswith('tf_slim.'))
               and patchable(module)]
    for module in modules or ():
        if isinstance(module, str):
            if module not in sys.modules:
                raise TypeError('patch_slim_batch_norm: module %r is not imported.' % module)
            module = sys.modules[module]
        if _is_sync_batch_norm(getattr(module, 'batch_norm', None)) and \
                id(module) not in _PATCHED:
            continue     # the user's own module already names sync_batch_norm
        if not patchable(module):
            raise TypeError('patch_slim_batch_norm: %r has no batch_norm attribute that is '
                            'slim.batch_norm.' % (module,))
        if module not in targets:
            targets.append(module)
    return targets


@contextlib.contextmanager
def sync_arg_scope(scope=None, sync_statistics='auto', add_normalizer_to=(), patch=True,
                   modules=(), **bn_overrides):
    """Builds slim models with :func:`sync_batch_norm` instead of ``slim.batch_norm``.

    Opens ``slim.arg_scope(convert_arg_scope(scope, ...))`` (the current arg
    scope when ``scope`` is None) and, with ``patch``, also
    :func:`patch_slim_batch_norm` for the duration of the block; see the module
    docstring for what is patched. Build the model inside the block::

        with slim.arg_scope(resnet_v2.resnet_arg_scope()):
            with sync_arg_scope(decay=0.9):
                logits, _ = resnet_v2.resnet_v2_50(images, num_classes=10)

        # Or in one call:
        with sync_arg_scope(inception_v3.inception_v3_arg_scope()):
            logits, _ = inception_v3.inception_v3(images, num_classes=10)

        # VGG has no batch norm: add it to every conv (a VGG-BN).
        with sync_arg_scope(vgg.vgg_arg_scope(), add_normalizer_to=[slim.conv2d]):
            logits, _ = vgg.vgg_16(images, num_classes=10)

    Args:
      scope: a slim arg-scope dict to convert, or None for the current one.
      sync_statistics: passed to every :func:`sync_batch_norm` (``'auto'``,
        ``'collective'``, ``'nccl'``, a backend object, or None for per-tower
        statistics).
      add_normalizer_to: see :func:`convert_arg_scope`.
      patch: also patch ``slim.batch_norm`` (see :func:`patch_slim_batch_norm`).
        Needed for models that call it directly or open their own arg scope
        for it (``resnet_v1``, ``resnet_v2``, ``inception_v3``).
      modules: extra modules to patch, see :func:`patch_slim_batch_norm`.
      **bn_overrides: :func:`sync_batch_norm` arguments that override the
        scope's.

    Yields:
      The converted arg-scope dict.

    Inside the block it checks that ``slim.batch_norm`` and the module
    attributes it patched name :func:`sync_batch_norm` and that no
    ``normalizer_fn`` of the arg scope in force is ``slim.batch_norm``; where a
    tf-slim/TensorFlow release defeats that, it undoes both and raises.

    Raises:
      TypeError: see :func:`convert_arg_scope` and :func:`patch_slim_batch_norm`.
      tf1_syncbn.PatchError: when a name above is not :func:`sync_batch_norm`
        (the message names the TensorFlow and Keras versions).
    """
    if scope is None:
        scope = slim_arg_scope.current_arg_scope()
    converted = convert_arg_scope(scope, sync_statistics=sync_statistics,
                                  add_normalizer_to=add_normalizer_to, **bn_overrides)
    with contextlib.ExitStack() as stack:
        patched = stack.enter_context(patch_slim_batch_norm(modules)) if patch else []
        entered = stack.enter_context(slim_arg_scope.arg_scope(converted))
        # On an error the stack undoes the patch and the arg scope.
        verify('sync_arg_scope', _user_names(patched), _INSTEAD)
        yield entered


_INSTEAD = ('pass normalizer_fn=tf1_syncbn.sync_batch_norm in the model\'s arg scope and call '
            'tf1_syncbn.sync_batch_norm where the model calls slim.batch_norm')


def _user_names(patched):
    """How a slim model reaches batch norm inside the block (:mod:`tf1_syncbn._frontend.patching`).

    ``slim.batch_norm``, ``slim.layers.batch_norm`` and the module attribute
    that ``tf_slim.nets`` call (``tf_slim.layers.layers.batch_norm``), with
    the patch; and each ``normalizer_fn`` of the arg scope now in force.
    """
    def module(name):
        return lambda: importlib.import_module(name)

    def ours(value):
        return value is sync_batch_norm

    names = []
    modules = {id(m): m for m, _ in patched}
    for name in ('tf_slim', 'tf_slim.layers', _SLIM_LAYERS_MODULE):
        if id(sys.modules.get(name)) in modules:
            names.append(Name(name.replace('tf_slim', 'slim', 1) + '.batch_norm',
                              getattr_path(module(name), 'batch_norm'), ours))
    for target in modules.values():
        names.append(Name('%s.batch_norm' % target.__name__,
                          getattr_path(lambda target=target: target, 'batch_norm'), ours))
    for key, kwargs in slim_arg_scope.current_arg_scope().items():
        if 'normalizer_fn' in kwargs:
            names.append(Name('normalizer_fn of the arg_scope entry %s' % key,
                              lambda kwargs=kwargs: kwargs['normalizer_fn'],
                              lambda value: not is_slim_batch_norm(value)))
    return names


# --------------------------------------------------------------------------- patch_slim

#: Modules that keep slim's function (this library's own references to it).
_OWN = 'tf1_syncbn'


def _with_defaults(defaults):
    """:func:`sync_batch_norm` with the patch's defaults, as ``slim.batch_norm``.

    An argument wins over the arg scope of :func:`sync_batch_norm`, which
    wins over the arg scope of slim's own ``batch_norm`` (one built before
    the patch), which wins over the defaults. Its arg-scope key is
    :func:`sync_batch_norm`'s: ``slim.arg_scope([slim.batch_norm], ...)``
    then holds :func:`sync_batch_norm`'s arguments, and ``add_arg_scope``'s
    check of ``arg_scope`` passes.
    """
    @functools.wraps(sync_batch_norm)
    def batch_norm(inputs, *args, **kwargs):
        current = slim_arg_scope.current_arg_scope()
        ours = current.get(_SYNC_KEY, {})
        for source in (current.get(_SLIM_KEY, {}), defaults):
            for key, value in source.items():
                if key not in kwargs and key not in ours:
                    kwargs[key] = value
        return sync_batch_norm(inputs, *args, **kwargs)

    batch_norm._key_op = _SYNC_KEY  # noqa: SLF001 - tf-slim's arg-scope key, as add_arg_scope sets it
    return batch_norm


class _SlimSwitch(Patch):
    """The handle :func:`patch_slim` returns: a context manager, or call :meth:`restore`."""

    api = 'patch_slim'
    target = 'tf_slim'
    instead = _INSTEAD

    def __init__(self, defaults):
        super().__init__()
        self.batch_norm = _with_defaults(defaults)

    def _apply(self):
        # slim's function, and that of a yielding patch that stepped aside for this one
        # (python -m tf1_syncbn.run's), which modules imported while it was active.
        theirs = {id(_ORIGINAL_BATCH_NORM)}
        theirs.update(id(waiting.batch_norm) for waiting in self._waiting_patches)
        for name, module in loaded_modules():
            if name == _OWN or name.startswith(_OWN + '.'):
                continue
            space = namespace(module)
            for attribute, value in list(space.items()):
                if id(value) in theirs:
                    self._set(module, attribute, self.batch_norm, direct=True)

    def user_names(self):
        def module(name):
            return lambda: importlib.import_module(name)

        def ours(value):
            return value is self.batch_norm

        return [Name(name.replace('tf_slim', 'slim', 1) + '.batch_norm',
                     getattr_path(module(name), 'batch_norm'), ours)
                for name in ('tf_slim', 'tf_slim.layers', _SLIM_LAYERS_MODULE)]


def patch_slim(sync_statistics='auto', num_dev=None, group_size=None):
    """Makes ``slim.batch_norm`` this library's :func:`sync_batch_norm`, process-wide.

    After this call, ``slim.batch_norm``, ``slim.layers.batch_norm``,
    ``tf_slim.layers.layers.batch_norm`` (what ``tf_slim.nets`` call) and the
    names your loaded modules imported it as are :func:`sync_batch_norm` with
    the given defaults: passed as ``normalizer_fn``, used as an ``arg_scope``
    key (``slim.arg_scope([slim.batch_norm], decay=0.9)``) or called::

        import tf1_syncbn
        tf1_syncbn.patch_slim(num_dev=4)       # before the model is built
        ...                                    # the script, unchanged

    Variables keep slim's names, so checkpoints restore. Arg scopes that
    :func:`sync_arg_scope` converts still use :func:`sync_batch_norm` with
    their own arguments. The patch is process-wide (do not build another
    model in another thread meanwhile); undo it with ``restore()`` or a
    ``with`` block. ``python -m tf1_syncbn.run`` makes it for unchanged
    scripts.

    Args:
      sync_statistics: the default ``sync_statistics`` (``'auto'``:
        synchronize over the towers the layers are built in; None: per-tower
        statistics, as slim's).
      num_dev: the default ``num_dev`` (the number of towers of a script
        whose towers are ``tower_<i>`` / ``clone_<i>`` name scopes).
      group_size: the default ``group_size`` (docs/sync-groups.md).

    Returns:
      A handle with ``restore()``, usable as a context manager.

    Raises:
      RuntimeError: when a patch is already active.
      tf1_syncbn.PatchError: when ``slim.batch_norm`` is not
        :func:`sync_batch_norm` after the patch (the message names the
        TensorFlow and Keras versions); pass
        ``normalizer_fn=tf1_syncbn.sync_batch_norm`` instead.
    """
    return _SlimSwitch({'sync_statistics': sync_statistics, 'num_dev': num_dev,
                        'group_size': group_size}).apply()

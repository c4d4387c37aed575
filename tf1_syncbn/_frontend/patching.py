"""What a front-end switches the user's code with: the one base of the patches, :class:`Patch`.

A front-end's ``patch.py`` imports everything it uses of the library from
here (its second door, beside :mod:`tf1_syncbn._frontend.building`): the
base and its check (below), the loaded modules' namespaces read without
running their hooks (:func:`loaded_modules`, :func:`namespace`, from
:mod:`tf1_syncbn._frontend.modules`) and which Keras 2 package code reaches
(:func:`keras2_package`, :func:`tf_keras_is_keras3`, :func:`keras_versions`,
from :mod:`tf1_syncbn._frontend.keras2`). So does ``python -m tf1_syncbn.run``
(:func:`yielding`).

:func:`tf1_syncbn.patch_tf_layers`, :func:`tf1_syncbn.patch_tensorpack`,
:func:`tf1_syncbn.keras.patch_keras`, :func:`tf1_syncbn.patch_slim` and
:func:`tf1_syncbn.sync_arg_scope` (:func:`~tf1_syncbn.slim.patch_slim_batch_norm`)
replace another library's batch normalization wherever they can find it, each
by a subclass of :class:`Patch`, which gives them the same life:

* :meth:`Patch.apply` holds the kind's process lock, refuses a second active
  patch of an exclusive kind (``RuntimeError``), runs the subclass's
  ``_apply`` (which changes things only through :meth:`Patch._set`,
  :meth:`Patch._set_item` and :meth:`Patch._on_undo`, so that every change
  has its undo), undoes everything when ``_apply`` raises, and then verifies;
* :meth:`Patch.restore` undoes, in reverse order, once (idempotent);
* a patch is a context manager: ``with patch_tf_layers(): ...`` restores at
  the end of the block;
* a patch made inside :func:`yielding` (``python -m tf1_syncbn.run``'s
  switches) steps aside for a later patch of its kind: the later one applies
  (a script's own ``patch_tf_layers(num_dev=4)`` under the runner), and the
  yielding one applies again once that is restored. A yielding patch that
  arrives while a patch of its kind is active, or is being applied by the
  same thread (its ``_apply`` imported a module whose import makes the
  yielding one), waits the same way.

A TensorFlow or Keras release that hands the layer out some other way would
leave the user's code on the original layer, training with per-tower
statistics, silently. So each patch ends by resolving, the way user code does,
every name it promises (:class:`Name`: ``tf.compat.v1.layers.batch_normalization``,
``tf.keras.layers.BatchNormalization``, tensorpack's ``BatchNorm`` as
``LinearWrap`` finds it, ``slim.batch_norm`` ...), and :meth:`Patch.verify`
(:func:`verify`) raises :class:`~tf1_syncbn.errors.PatchError` naming each one
that is not the library's, the TensorFlow and Keras versions, and what to do
instead. The patch undoes itself first.
"""

import contextlib
import threading

from tf1_syncbn._frontend.keras2 import package as keras2_package
from tf1_syncbn._frontend.keras2 import tf_keras_is_keras3
from tf1_syncbn._frontend.keras2 import versions as keras_versions
from tf1_syncbn._frontend.modules import loaded_modules, namespace
from tf1_syncbn.errors import PatchError

__all__ = ['Patch', 'ABSENT', 'Name', 'failures', 'getattr_path', 'verify', 'yielding',
           'loaded_modules', 'namespace', 'keras2_package', 'tf_keras_is_keras3',
           'keras_versions']

#: What a resolver returns for a name that this TensorFlow/Keras does not have
#: at all (nothing to switch, nothing to check).
ABSENT = object()


class _Failed(object):
    """A name whose lookup raised: what it raised."""

    def __init__(self, error):
        self.error = error

    def __repr__(self):
        return 'raises %s: %s' % (type(self.error).__name__, self.error)


class Name(object):
    """One way user code reaches a layer.

    Args:
      spelling: the name as users write it, for messages
        (``'tf.compat.v1.layers.batch_normalization'``).
      resolve: a callable that returns what that spelling gives now (as user
        code would get it), or :data:`ABSENT` where this version has no such
        name. An exception it raises counts as a name that does not resolve.
      accept: a callable that takes the value and says whether it is the
        library's.
    """

    def __init__(self, spelling, resolve, accept):
        self.spelling = spelling
        self.resolve = resolve
        self.accept = accept

    def value(self):
        try:
            return self.resolve()
        except Exception as e:  # noqa: BLE001 - any failure of the lookup is reported
            return _Failed(e)


def getattr_path(root, path):
    """A resolver: ``root.<path>`` by ``getattr``, as user code's attribute access does.

    ``root`` is a callable returning the object to start from (a module
    looked up at check time); ``path`` is dotted (``'layers.batch_normalization'``).
    """
    def resolve():
        value = root()
        for part in path.split('.'):
            value = getattr(value, part)
        return value
    return resolve


def _describe(value):
    if isinstance(value, _Failed):
        return repr(value)
    module = getattr(value, '__module__', None)
    name = getattr(value, '__qualname__', None) or getattr(value, '__name__', None)
    if isinstance(module, str) and isinstance(name, str):
        return '%s.%s' % (module, name)
    return repr(value)


def failures(names):
    """``[(spelling, description of what it resolves to)]`` of the names not accepted."""
    found = []
    for name in names:
        value = name.value()
        if value is ABSENT:
            continue
        if isinstance(value, _Failed) or not name.accept(value):
            found.append((name.spelling, _describe(value)))
    return found


def verify(api, names, instead, undo=None):
    """Raises :class:`PatchError` unless every name resolves to the library's layer.

    Args:
      api: the patch's name, for the message (``'patch_tf_layers'``).
      names: :class:`Name` objects.
      instead: what to do instead, a sentence for the message (``'call
        tf1_syncbn.layers.batch_normalization directly'``).
      undo: called before raising (the patch undoes itself).

    Raises:
      PatchError: naming each name that is not the library's, what it is, the
        TensorFlow and Keras versions, and ``instead``.
    """
    found = failures(names)
    if not found:
        return
    if undo is not None:
        undo()
    raise PatchError(
        '%s cannot take effect here (%s): %s. The patch is undone, so nothing is left '
        'half-switched. Instead, %s.'
        % (api, keras_versions(),
           '; '.join('%s is still %s, not this library\'s layer' % f for f in found), instead))


_MISSING = object()
_YIELDING = threading.local()


@contextlib.contextmanager
def yielding():
    """Patches created in the block step aside for later patches of their kind.

    ``python -m tf1_syncbn.run`` makes its switches this way, so that a
    script that calls a patch itself keeps working, with its own arguments,
    while that patch is active (:class:`Patch`, :attr:`Patch.yields`).
    """
    previous = getattr(_YIELDING, 'on', False)
    _YIELDING.on = True
    try:
        yield
    finally:
        _YIELDING.on = previous


class Patch(object):
    """One patch: a lock and an active list per kind, an undo list, apply, restore, verify.

    A subclass is one kind of patch. It sets :attr:`api`, :attr:`target`
    and :attr:`instead`, implements ``_apply()`` (every change through
    :meth:`_set`, :meth:`_set_item` or :meth:`_on_undo`) and, for the check,
    :meth:`user_names`. Each subclass gets its own process lock (held while
    it applies or restores) and its own list of active patches.

    Attributes:
      api: the public function, for messages (``'patch_tf_layers'``).
      target: what it patches, for the message of a second patch
        (``'tf.compat.v1.layers'``).
      instead: what to do where the patch cannot take effect, a sentence for
        :class:`~tf1_syncbn.errors.PatchError`.
      exclusive: one active patch of this kind at a time (a second one raises
        ``RuntimeError``, unless the active one yields); False where patches
        nest (reference-counted).
      yields: made inside :func:`yielding`: an exclusive patch that steps
        aside for a later patch of its kind (the later one applies; this one
        applies again once that is restored), and waits while one is active.
    """

    api = None
    target = None
    instead = None
    exclusive = True
    _lock = threading.Lock()
    _active_patches = []
    _waiting_patches = []       # yielding patches stepped aside, the last one first back
    _applying = None            # the thread that runs an _apply of this kind now

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._lock = threading.Lock()
        cls._active_patches = []
        cls._waiting_patches = []
        cls._applying = None

    def __init__(self):
        self._undo = []          # callables, run in reverse by restore()
        self._active = False
        self._waiting = False
        self.yields = getattr(_YIELDING, 'on', False)

    @property
    def active(self):
        """Whether the patch is applied and not restored (False while it waits)."""
        return self._active

    @property
    def waiting(self):
        """Whether the patch yields to another of its kind now (it applies once that ends)."""
        return self._waiting

    def _apply(self):
        """Makes the changes (through :meth:`_set`, :meth:`_set_item`, :meth:`_on_undo`)."""
        raise NotImplementedError

    def user_names(self):
        """The :class:`Name` objects :meth:`verify` checks (none by default)."""
        return []

    def apply(self):
        """Applies the patch, then verifies it (outside the lock).

        Returns:
          self.

        A yielding patch (:attr:`yields`) waits instead while a patch of its
        kind that does not yield is active or being applied by this thread
        (it applies once that is restored); an active yielding patch steps
        aside for this one.

        Raises:
          RuntimeError: when the kind is exclusive and a patch of it that does
            not yield is active (or is being applied by this thread).
          tf1_syncbn.PatchError: see :meth:`verify` (the patch is undone).
          Whatever ``_apply`` raises, once everything it changed is undone.
        """
        kind = type(self)
        if self.exclusive and kind._applying == threading.get_ident():  # noqa: SLF001 - its kind
            # This thread holds the lock, in another patch's _apply of this kind.
            if not self.yields:
                raise RuntimeError('%s: %s is being patched; restore that patch first.'
                                   % (self.api, self.target))
            self._wait()
            return self
        with self._lock:
            if self.exclusive and self._active_patches:
                if not all(p.yields for p in self._active_patches):
                    if self.yields:
                        self._wait()
                        return self
                    raise RuntimeError('%s: %s is already patched; restore the active patch '
                                       'first.' % (self.api, self.target))
                for patch in list(self._active_patches):
                    patch._step_aside()  # noqa: SLF001 - a patch of this kind
            self._apply_locked()
        # Outside the lock: looking a name up can import a module whose import
        # hook the patch installed, and the hook takes the lock.
        self.verify()
        return self

    def _apply_locked(self):
        kind = type(self)
        self._active = True
        kind._applying = threading.get_ident()  # noqa: SLF001 - its own kind
        try:
            self._apply()
        except BaseException:
            self._undo_all()
            raise
        finally:
            kind._applying = None  # noqa: SLF001 - its own kind
        self._active_patches.append(self)

    def _wait(self):
        """Steps aside until the patches of the kind ahead of this one are restored."""
        self._waiting = True
        self._waiting_patches.append(self)

    def _step_aside(self):
        """Undoes this (yielding, active) patch, to apply it again later (the lock is held)."""
        self._undo_all()
        self._active_patches.remove(self)
        self._wait()

    def _resume(self):
        """The last waiting patch applies again, when none is active (the lock is held).

        Returns:
          The patch that applied, or None.
        """
        if self._active_patches or not self._waiting_patches:
            return None
        patch = self._waiting_patches.pop()
        patch._waiting = False  # noqa: SLF001 - a patch of this kind
        patch._apply_locked()  # noqa: SLF001 - a patch of this kind
        return patch

    def _on_undo(self, undo):
        """Remembers ``undo``, a callable that :meth:`restore` runs (in reverse order)."""
        self._undo.append(undo)

    def _set(self, owner, attribute, value, direct=False):
        """Sets ``owner.attribute`` to ``value``, remembering how to undo it.

        Args:
          owner: a module (or another object with a namespace).
          attribute: the attribute's name.
          value: the new value.
          direct: write the object's namespace dict instead of calling
            ``setattr``: a TensorFlow lazy loader's ``setattr`` would import the
            module it stands for, and a proxy's may refuse.
        """
        space = namespace(owner) if direct else vars(owner)
        previous = space.get(attribute, _MISSING)
        if previous is value:
            return
        if direct:
            space[attribute] = value
        else:
            setattr(owner, attribute, value)

        def undo():
            if previous is _MISSING:
                space.pop(attribute, None)
            elif direct:
                space[attribute] = previous
            else:
                setattr(owner, attribute, previous)
        self._on_undo(undo)

    def _set_item(self, mapping, key, value):
        """Sets ``mapping[key]`` to ``value``, remembering how to undo it."""
        previous = mapping.get(key, _MISSING)
        mapping[key] = value

        def undo():
            if previous is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = previous
        self._on_undo(undo)

    def _undo_all(self):
        self._active = False
        while self._undo:
            self._undo.pop()()

    def restore(self):
        """Undoes every change, in reverse order; idempotent.

        A yielding patch that stepped aside for this one applies again (and
        is verified); a waiting patch stops waiting.
        """
        with self._lock:
            if self._waiting:
                self._waiting = False
                self._waiting_patches.remove(self)
                return
            if not self._active:
                return
            self._undo_all()
            if self in self._active_patches:
                self._active_patches.remove(self)
            resumed = self._resume() if self.exclusive else None
        if resumed is not None:
            resumed.verify()

    def verify(self, names=None):
        """Raises :class:`~tf1_syncbn.errors.PatchError` unless every name is the library's.

        Args:
          names: :class:`Name` objects (default: :meth:`user_names`).

        The patch is restored before it raises.
        """
        verify(self.api, self.user_names() if names is None else names, self.instead,
               undo=self.restore)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False

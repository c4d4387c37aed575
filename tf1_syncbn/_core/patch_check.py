"""What every patch checks once it has switched a library's layer: the names users call.

:func:`tf1_syncbn.patch_tf_layers`, :func:`tf1_syncbn.patch_tensorpack`,
:func:`tf1_syncbn.keras.patch_keras` and :func:`tf1_syncbn.sync_arg_scope`
replace another library's batch normalization wherever they can find it. A
TensorFlow or Keras release that hands the layer out some other way would
leave the user's code on the original layer, training with per-tower
statistics, silently. So each patch ends by resolving, the way user code does,
every name it promises (:class:`Name`: ``tf.compat.v1.layers.batch_normalization``,
``tf.keras.layers.BatchNormalization``, tensorpack's ``BatchNorm`` as
``LinearWrap`` finds it, ``slim.batch_norm`` ...), and :func:`verify` raises
:class:`PatchError` naming each one that is not the library's, the TensorFlow
and Keras versions, and what to do instead. The patch undoes itself first.
"""

from tf1_syncbn._core import keras2 as _keras2
from tf1_syncbn.errors import PatchError

__all__ = ['ABSENT', 'Name', 'failures', 'getattr_path', 'verify']

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
        % (api, _keras2.versions(),
           '; '.join('%s is still %s, not this library\'s layer' % f for f in found), instead))

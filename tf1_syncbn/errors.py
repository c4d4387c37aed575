"""The library's own warning and exceptions (multi-worker ones: :mod:`tf1_syncbn.distributed`).

* :class:`SyncBNWarning`: a switch left some code unswitched
  (``patch_keras`` about a Keras it does not patch); the message says why and
  how to fix it. A layer that cannot synchronize as asked never warns: it
  raises at graph build (a warning followed by per-tower statistics would be a
  silent fallback).
* :class:`PatchError`: a patch could not make a name that user code calls
  resolve to this library's layer.

Everything else the layers refuse at graph build is a ``ValueError`` or
``TypeError`` naming the layer, the argument as the user spelled it, and the
fix. This module imports nothing.
"""

__all__ = ['SyncBNWarning', 'PatchError']


class SyncBNWarning(UserWarning):
    """Code a switch leaves unswitched, e.g. a Keras ``patch_keras`` does not patch.

    (Layers that cannot synchronize as asked raise ``ValueError`` instead.)
    """


class PatchError(RuntimeError):
    """A patch could not make a name that user code calls resolve to this library's layer."""

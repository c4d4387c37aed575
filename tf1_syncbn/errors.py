"""The library's own warning and exceptions (multi-worker ones: :mod:`tf1_syncbn.distributed`).

* :class:`SyncBNWarning`: a layer that could synchronize does not (the
  message says why and how to fix it).
* :class:`PatchError`: a patch could not make a name that user code calls
  resolve to this library's layer.

Everything else the layers refuse at graph build is a ``ValueError`` or
``TypeError`` naming the layer, the argument as the user spelled it, and the
fix. This module imports nothing.
"""

__all__ = ['SyncBNWarning', 'PatchError']


class SyncBNWarning(UserWarning):
    """A synchronized layer that cannot synchronize (see the message for the fix)."""


class PatchError(RuntimeError):
    """A patch could not make a name that user code calls resolve to this library's layer."""

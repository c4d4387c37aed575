"""Synchronized Batch Normalization for TF1-style multi-tower graphs.

* :func:`sync_batch_norm`: ``slim.batch_norm`` with global-batch statistics.
* Backends: :class:`CollectiveBackend`, :class:`NcclBackend`,
  :class:`HorovodBackend` (or the strings ``'collective'``, ``'nccl'``,
  ``'horovod'``, ``'auto'``).
"""

from tf1_syncbn.backends import (CollectiveBackend, HorovodBackend, NcclBackend, SyncBackend,
                                 SyncKey)
from tf1_syncbn.slim_layer import sync_batch_norm

__all__ = ['sync_batch_norm', 'SyncBackend', 'SyncKey', 'CollectiveBackend', 'NcclBackend',
           'HorovodBackend']

__version__ = '0.1.0'

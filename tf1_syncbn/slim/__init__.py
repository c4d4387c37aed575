"""The tf-slim front-end: ``slim.batch_norm``, synchronized, and the switch for slim models.

* :func:`sync_batch_norm` (:mod:`~tf1_syncbn.slim.layer`): slim's signature
  and variable names, plus ``sync_statistics`` and ``num_dev``;
* :func:`sync_arg_scope`, :func:`convert_arg_scope`,
  :func:`patch_slim_batch_norm` (:mod:`~tf1_syncbn.slim.patch`): build
  ``tf_slim.nets`` and other slim code with it, unedited;
* :func:`patch_slim`: ``slim.batch_norm`` switched process-wide, in the shape
  of the other front-ends' patches.

Also ``tf1_syncbn.sync_batch_norm``, ``tf1_syncbn.sync_arg_scope``,
``tf1_syncbn.convert_arg_scope``.
"""

from tf1_syncbn.slim.layer import sync_batch_norm
from tf1_syncbn.slim.patch import (convert_arg_scope, is_slim_batch_norm, patch_slim,
                                   patch_slim_batch_norm, sync_arg_scope)

__all__ = ['sync_batch_norm', 'sync_arg_scope', 'convert_arg_scope', 'patch_slim_batch_norm',
           'is_slim_batch_norm', 'patch_slim']

"""Synchronized Batch Normalization for TF1-style multi-tower graphs.

* :func:`sync_batch_norm`: ``slim.batch_norm`` with global-batch statistics.
* :func:`BatchNorm`, :func:`BatchRenorm`: tensorpack's layers, on the same engine.
* :mod:`tf1_syncbn.layers`: ``batch_normalization`` / ``BatchNormalization``,
  tf.layers' API, on the same engine.
* :func:`start_finetuning`: restart the exact population statistics.
* :func:`patch_tensorpack`, :func:`patch_tf_layers`, :func:`sync_arg_scope`,
  :func:`patch_slim`: make existing tensorpack, tf.layers and tf-slim code
  build this library's layers; ``python -m tf1_syncbn.run`` does it for an
  unchanged script (:mod:`tf1_syncbn.run`).
* :mod:`tf1_syncbn.keras`: tf-keras' (Keras 2) ``BatchNormalization`` for Keras
  models in TF1 graphs, and :func:`patch_keras` (both need tf-keras; loaded on
  first use, so ``import tf1_syncbn`` never imports tf-keras).
* :func:`moments`, :func:`weighted_moments`: ``tf.nn.moments`` and
  ``tf.nn.weighted_moments`` over the global batch of the towers, for
  hand-written batch norm.
* :func:`audit_graph`: whether every batch norm of a graph is synchronized and
  its moving averages update (also ``python -m tf1_syncbn.audit``).
* :mod:`tf1_syncbn.export`: an inference graph (frozen ``GraphDef`` or
  SavedModel, plain TensorFlow ops) from a training graph. Importing the
  package is enough to load a meta graph the layers built.
* The layers find their towers in :class:`tower.TowerContext`, tensorpack's
  trainers, ``tower_<i>`` / ``clone_<i>`` name scopes (with ``num_dev``) and
  ``tf.distribute`` strategies (``strategy.run`` in a TF1 graph).
* :class:`SyncBNWarning`: warned when a switch leaves some code unswitched
  (``patch_keras`` and a Keras it does not patch). A layer that cannot
  synchronize as asked raises ``ValueError`` at graph build instead.
* :class:`PatchError`: raised by a patch that cannot make the names users
  call resolve to this library's layer on this TensorFlow/Keras.
* Backends: :class:`CollectiveBackend`, :class:`NcclBackend`,
  :class:`HorovodBackend` (or the strings ``'collective'``, ``'nccl'``,
  ``'horovod'``, ``'auto'``).
* Multiple workers (:mod:`tf1_syncbn.distributed`): :func:`setup_cluster`,
  :class:`DistributedOptimizer`, :func:`all_reduce_gradients`,
  :func:`broadcast_variables`, :class:`WorkerSession`; local worker processes:
  ``python -m tf1_syncbn.launch`` (:mod:`tf1_syncbn.launch`).
"""

# `python -m tf1_syncbn.<command> --help` answers here, before TensorFlow loads, and
# `python -m tf1_syncbn.run` starts its script (the imports below come after it on purpose).
# ruff: noqa: E402
from tf1_syncbn._cli import answer_help_early as _answer_help_early
from tf1_syncbn._cli import start_early as _start_early
_answer_help_early()
_start_early()

import sys as _sys

from tf1_syncbn.backends import (CollectiveBackend, HorovodBackend, NcclBackend, SyncBackend,
                                 SyncKey)
from tf1_syncbn.errors import PatchError, SyncBNWarning
from tf1_syncbn.slim import convert_arg_scope, patch_slim, sync_arg_scope, sync_batch_norm
from tf1_syncbn.tensorpack import BatchNorm, BatchRenorm, patch_tensorpack, start_finetuning
from tf1_syncbn import layers
from tf1_syncbn.layers import patch_tf_layers
from tf1_syncbn.distributed import (Cluster, ClusterError, DistributedOptimizer, PeerMissingError,
                                    WorkerLostError, WorkerSession, all_reduce_gradients,
                                    average_across_workers, broadcast_variables, setup_cluster)
from tf1_syncbn.audit import audit_graph
from tf1_syncbn.nn import moments, weighted_moments
from tf1_syncbn import export
from tf1_syncbn import kernels as _kernels
from tf1_syncbn.audit import report as _audit_report
from tf1_syncbn.launch import restarts as _restarts

__all__ = ['sync_batch_norm', 'BatchNorm', 'BatchRenorm', 'start_finetuning', 'SyncBackend',
           'SyncKey', 'CollectiveBackend', 'NcclBackend', 'HorovodBackend']
__all__ += ['sync_arg_scope', 'convert_arg_scope', 'patch_tensorpack', 'patch_slim',
            'SyncBNWarning', 'PatchError']
__all__ += ['layers', 'patch_tf_layers']
__all__ += ['setup_cluster', 'Cluster', 'DistributedOptimizer', 'all_reduce_gradients',
            'average_across_workers', 'broadcast_variables', 'WorkerSession', 'ClusterError',
            'PeerMissingError', 'WorkerLostError']
__all__ += ['audit_graph', 'export', 'moments', 'weighted_moments']

# A graph saved with the compiled ops (a meta graph, a GraphDef) loads in a new
# process once the package is imported: a cached build registers them (no compiler runs).
_kernels.register_cached()

__version__ = '0.1.0'

# Module paths of before a package layout (issues 34 and 44): the same module objects, so
# `tf1_syncbn.audit_report.AuditReport` and `tf1_syncbn.restarts.restart_count` keep working.
_sys.modules.setdefault(__name__ + '.audit_report', _audit_report)
audit_report = _audit_report
_sys.modules.setdefault(__name__ + '.restarts', _restarts)
restarts = _restarts


def __getattr__(name):
    """``tf1_syncbn.keras`` and ``tf1_syncbn.patch_keras``, imported on first use (tf-keras)."""
    if name in ('keras', 'patch_keras'):
        import importlib  # noqa: PLC0415 - only for these lazy names
        module = importlib.import_module('tf1_syncbn.keras')
        return module if name == 'keras' else module.patch_keras
    raise AttributeError('module %r has no attribute %r' % (__name__, name))

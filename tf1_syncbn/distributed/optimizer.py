"""``DistributedOptimizer``: a TF1 optimizer, gradients averaged over all towers of all workers."""

import tensorflow as tf

from tf1_syncbn.distributed.collectives import DEFAULT_BUCKET_BYTES, all_reduce_gradients
from tower.context import get_current_tower_context

tf1 = tf.compat.v1

__all__ = ['DistributedOptimizer']


def _is_tower_list(grads_and_vars):
    """True when ``grads_and_vars`` is a list of per-tower ``(grad, var)`` lists."""
    if not grads_and_vars:
        return False
    first = grads_and_vars[0]
    return isinstance(first, (list, tuple)) and len(first) > 0 and \
        isinstance(first[0], (list, tuple))


class DistributedOptimizer(tf1.train.Optimizer):
    """Wraps any ``tf.compat.v1.train.Optimizer`` to average gradients across workers.

    The counterpart of Horovod's ``DistributedOptimizer``, for in-graph towers:

    * one tower per worker (no :class:`tower.TowerContext`, or a context with
      one tower): ``compute_gradients`` returns gradients already averaged over
      the workers, so ``minimize`` works as with the wrapped optimizer;
    * several towers per worker: call ``compute_gradients`` in each tower (it
      returns the tower's own gradients) and pass the list of every tower's
      lists to ``apply_gradients``, which runs :func:`all_reduce_gradients`
      then the wrapped optimizer's ``apply_gradients``::

          opt = DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), cluster)
          tower_grads = call_for_each_tower(lambda: opt.compute_gradients(loss_fn()),
                                            cluster.tower_devices)
          train_op = opt.apply_gradients(tower_grads, global_step=global_step)

    To clip or otherwise transform the averaged gradients, call
    :func:`all_reduce_gradients` yourself and pass the result to the wrapped
    optimizer.

    Slots and variables are the wrapped optimizer's (``get_slot``,
    ``get_slot_names``, ``variables``), so checkpoints are the same.

    Args:
      optimizer: the ``tf.compat.v1.train.Optimizer`` to wrap.
      cluster: the :class:`Cluster`; None for a single worker.
      name: the name of the collectives (see :func:`all_reduce_gradients`);
        defaults to ``'Distributed' + optimizer.get_name()``.
      bucket_bytes, sparse_as_dense: as in :func:`all_reduce_gradients`.

    Hangs: as :func:`all_reduce_gradients`.
    """

    def __init__(self, optimizer, cluster=None, name=None, bucket_bytes=DEFAULT_BUCKET_BYTES,
                 sparse_as_dense=False):
        if not isinstance(optimizer, tf1.train.Optimizer):
            raise TypeError('DistributedOptimizer: optimizer must be a '
                            'tf.compat.v1.train.Optimizer, got %r.' % (optimizer,))
        name = name or 'Distributed' + optimizer.get_name()
        super().__init__(use_locking=False, name=name)
        self._optimizer = optimizer
        self._cluster = cluster
        self._bucket_bytes = bucket_bytes
        self._sparse_as_dense = sparse_as_dense
        self._tower_grads_pending = False
        self._calls = 0

    def _reduce(self, tower_grads):
        name = self.get_name() if self._calls == 0 else '%s_%d' % (self.get_name(), self._calls)
        self._calls += 1
        return all_reduce_gradients(tower_grads, self._cluster, name=name,
                                    bucket_bytes=self._bucket_bytes,
                                    sparse_as_dense=self._sparse_as_dense)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients: the tower's own inside towers, else averaged."""
        grads = self._optimizer.compute_gradients(*args, **kwargs)
        context = get_current_tower_context()
        if context is not None and context.total > 1:
            self._tower_grads_pending = True
            return grads
        return self._reduce([grads])

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Applies averaged gradients; a list of per-tower lists is all-reduced first."""
        grads_and_vars = list(grads_and_vars)
        if _is_tower_list(grads_and_vars):
            grads_and_vars = self._reduce(grads_and_vars)
        elif self._tower_grads_pending:
            raise ValueError(
                'DistributedOptimizer.apply_gradients: compute_gradients was called inside '
                'towers, which returns each tower\'s own gradients; pass the list of every '
                'tower\'s (gradient, variable) lists to apply_gradients so that they are '
                'averaged over towers and workers.')
        self._tower_grads_pending = False
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                               name=name)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self):
        return self._optimizer.variables()

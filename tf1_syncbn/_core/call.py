"""The one call every front-end makes: :func:`batch_norm`.

A front-end (``sync_batch_norm``, tensorpack's ``BatchNorm``/``BatchRenorm``,
``tf1_syncbn.layers``) checks its arguments into an
:class:`~tf1_syncbn._core.options.Options` and its input into a
:class:`~tf1_syncbn._core.options.Layout`, creates the variables with its own
library's names, and calls :func:`batch_norm` with the input. Here, in stages:

1. find the tower and its group (:mod:`tf1_syncbn._sync.group`);
2. plan the synchronization of a training call (:mod:`tf1_syncbn._sync.plan`);
3. compute the output in the mode asked for (:mod:`tf1_syncbn._core.normalize`):
   training, inference, or a tensor switch between them;
4. build the moving-average updates on the main tower and share a trigger of
   them with the other towers (:mod:`tf1_syncbn._core.updates`).

Every front-end's entry point is marked
``tf.autograph.experimental.do_not_convert``: graph-building code that
branches on Python values, never to be rewritten by AutoGraph, which
``tf.map_fn``, ``tf.scan`` and ``tf.function`` apply to the functions they
are given and, recursively, to everything those call (AutoGraph's conversion
of the layers failed there at random, its cache handing one function's
conversion to another).
"""

import tensorflow as tf

from tf1_syncbn._compute.xla import outside_xla_clusters
from tf1_syncbn._core import normalize as _normalize
from tf1_syncbn._core import records as _inference_records
from tf1_syncbn._core import updates as _updates
from tf1_syncbn._sync.group import check_untowered_copies, find_call_site
from tf1_syncbn._core.options import check_batch_weights
from tf1_syncbn._sync.plan import plan_sync
from tf1_syncbn._core.variables import read, variable_name

tf1 = tf.compat.v1

__all__ = ['batch_norm']


def batch_norm(x, layout, options, params, batch_weights=None,
               updates_collections=tf1.GraphKeys.UPDATE_OPS, update_moving=True, finetune=None,
               prediction_towers_update=False, trigger_after_output=False):
    """Builds one batch-norm call.

    Args:
      x: the input, checked by :func:`~tf1_syncbn._core.options.check_inputs`.
      layout: its :class:`~tf1_syncbn._core.options.Layout`.
      options: the call's :class:`~tf1_syncbn._core.options.Options`.
      params: the layer's :class:`~tf1_syncbn._core.variables.Params`.
      batch_weights: per-example weights of the batch, or None.
      updates_collections: where the moving-average updates go, or None for
        control dependencies on the output.
      update_moving: False never updates the moving statistics.
      finetune: None, or a Python bool / scalar bool tensor that switches the
        moving statistics to the exact average over batches (needs
        ``params.finetune_count``).
      prediction_towers_update: a call with batch statistics in a prediction
        tower updates the moving statistics (tensorpack's layers do).
      trigger_after_output: a non-main tower's trigger also waits for this
        call's output, so that it depends on the tower's input (tf-keras
        files updates by the inputs they are reachable from).

    Moving-average updates are built once per call, by the main training
    tower; with ``updates_collections``, every other training tower of the
    group adds a trigger of those same updates to its own collections.

    Returns:
      The output tensor, with the shape and dtype of ``x``.

    Hangs: a synchronized training call waits in its all-reduces for every
    member of its group; see :mod:`tf1_syncbn._sync.guards` for what turns that
    into an error. Its ops stay out of XLA's auto-clustering
    (:mod:`tf1_syncbn._compute.xla`).
    """
    with outside_xla_clusters():
        return _batch_norm(x, layout, options, params, batch_weights, updates_collections,
                           update_moving, finetune, prediction_towers_update,
                           trigger_after_output)


def _batch_norm(x, layout, options, params, batch_weights, updates_collections, update_moving,
                finetune, prediction_towers_update, trigger_after_output):
    weights = check_batch_weights(options, batch_weights, x)
    site = find_call_site(options, prediction_towers_update)
    training = options.is_training
    plan = plan_sync(options, site) if training is not False else None
    do_update = update_moving and (site.main or site.replicated_updates)

    finetune_step = None
    if finetune is not None and params.finetune_count is not None and training is not False:
        active = finetune if training is True else tf.logical_and(
            tf.convert_to_tensor(finetune, tf.bool), training)
        finetune_step = _updates.finetune_decay(options, params.finetune_count, active)

    renorm_reads = None
    if options.renorm and training is not False:
        renorm_reads = _updates.read_renorm_statistics(params.renorm)
    updates = []
    if training is False:
        y = _normalize.infer(x, layout, options, params)
    elif training is True:
        y, stats = _normalize.train(x, layout, options, params, plan, weights, renorm_reads)
        if do_update:
            stats = _main_group(plan, stats)
            updates = _updates.update_ops(options, params, stats, finetune_step)
    else:
        y, stats = _switch(x, layout, options, params, plan, weights, training, renorm_reads)
        if do_update:
            stats = _main_group(plan, stats)
            # In inference the count is 0: the updates leave everything as it is
            # (and, as the statistics come from the branch taken, wait for nothing).
            updates = _updates.update_ops(options, params, stats, finetune_step)
    if updates:
        if updates_collections is None:
            with tf.control_dependencies(updates):
                y = tf.identity(y)
        else:
            for op in updates:
                tf1.add_to_collections(updates_collections, op)
    _updates.share_updates(site, updates, update_moving and training is not False,
                           updates_collections, [y] if trigger_after_output else [])
    check_untowered_copies(options, site, variable_name(params.moving_mean), y)
    y.set_shape(x.shape)
    # What tf1_syncbn.export needs to replace this call by an inference op (no op built).
    _inference_records.record(x, y, layout, options, params)
    return y


def _main_group(plan, stats):
    """The statistics the moving averages take: those of worker 0's main tower's sync group.

    See :meth:`tf1_syncbn._sync.plan.SyncPlan.main_group_statistics` (nothing
    changes without sync groups, or in one process).
    """
    if plan is None:
        return stats
    renorm = tuple(stats.renorm or ())
    out = plan.main_group_statistics((stats.mean, stats.variance, stats.count) + renorm)
    return stats._replace(mean=out[0], variance=out[1], count=out[2],
                          renorm=tuple(out[3:]) if stats.renorm is not None else None)


def _switch(x, layout, options, params, plan, weights, training, renorm_reads):
    """Training or inference, chosen at run time by the bool tensor ``training``."""
    bessel = []

    def train_branch():
        # In TF2 behaviour a branch is a graph of its own, which the call's
        # outside_xla_clusters() does not reach: each branch enters it again.
        with outside_xla_clusters():
            return _train_outputs()

    def _train_outputs():
        y, st = _normalize.train(x, layout, options, params, plan, weights, renorm_reads)
        bessel.append(st.bessel)
        # The gradient of tf.cond differentiates every output of a branch (with
        # zeros for those without a gradient): cut the statistics, which come
        # from all-reduces, off the gradient explicitly.
        stats = [tf.stop_gradient(t) for t in (st.mean, st.variance, st.count) +
                 tuple(st.renorm or ())]
        return (y,) + tuple(stats)

    def infer_branch():
        with outside_xla_clusters():
            return _infer_outputs()

    def _infer_outputs():
        y = _normalize.infer(x, layout, options, params)
        stats = (read(params.moving_mean), read(params.moving_variance),
                 tf.zeros([], tf.float32))
        if options.renorm:
            stats += (read(params.renorm.mean), read(params.renorm.stddev))
        # No variable read as a branch output: TensorFlow's freezing
        # (convert_variables_to_constants) turns a branch's reads into Identity
        # ops but keeps the branch outputs naming ReadVariableOp's output, and
        # the frozen graph then fails to run ("Return ... is not found").
        return (y,) + tuple(tf.identity(t) for t in stats)

    # Named as slim's and tf.layers' tf.cond (its ops show in TF1 behaviour's graphs).
    outs = tf.cond(training, train_branch, infer_branch, name='cond')
    stats = _normalize.BatchStats(outs[1], outs[2], outs[3],
                                  tuple(outs[4:6]) if options.renorm else None, bessel[0])
    return outs[0], stats

"""Moving-average updates: built once per call by the main tower, triggered from every tower.

* :func:`update_ops` builds the assignments of one training step (moving
  mean and variance, renorm statistics, zero-debias shadows, the fine-tune
  counter), named and computed as slim / Keras / tensorpack name and compute
  them. An empty global batch updates nothing.
* :func:`share_updates`: the main training tower builds the updates; every
  other training tower of the group puts a trigger of those same updates into
  its own update collection, so a harness that keeps the first tower's
  ``UPDATE_OPS`` (tf-slim's ``model_deploy``), the last one's (the classic
  multi-GPU scripts) or all of them runs them exactly once per step. For
  ``tf1_syncbn.keras`` a trigger also waits for its own tower's output (see
  :func:`share_updates`).

Updates assign the variables under a ``custom_getter``'s transformed values
(:func:`tf1_syncbn._core.variables.assignable`).
"""

import collections
import numbers

import tensorflow as tf

from tf1_syncbn._compute import math as _math
from tf1_syncbn._sync.control_flow import enclosing_while_loop
from tf1_syncbn._core.variables import assignable, read, variable_name
from tf1_syncbn._graph.cache import graph_cache

tf1 = tf.compat.v1

__all__ = ['update_ops', 'finetune_decay', 'share_updates', 'tracked_variance',
           'read_renorm_statistics']


def tracked_variance(options, stats):
    """The batch variance the moving variance tracks: unbiased or biased, as the replaced layer."""
    if options.unbiased_variance == stats.bessel:
        return stats.variance
    if options.unbiased_variance:
        return _math.bessel_correct(stats.variance, stats.count)
    # The fused kernel's variance is M2 / max(n - 1, 1).
    count = stats.count
    return stats.variance * (tf.maximum(count - 1.0, 0.0) / tf.maximum(count, 1.0))


def _like(value, variable):
    """``value`` (``[C]``) in the shape of ``variable`` (``[1, ..., C, ...]`` for tf.layers'
    ghost batch norm)."""
    shape = variable.shape
    if shape.ndims is not None and shape.ndims > 1:
        return tf.reshape(value, shape)
    return value


def _one_minus(decay, dtype, float32_decay=False):
    if float32_decay and isinstance(decay, numbers.Real):
        decay = tf.constant(decay, tf.float32)
    one_minus = tf.convert_to_tensor(1.0 - decay, name='decay')
    if one_minus.dtype != dtype:
        one_minus = tf.cast(one_minus, dtype)
    return one_minus


def _assign_moving_average(variable, value, decay, active, float32_decay=False):
    """``variable -= (variable - value) * (1 - decay)`` where ``active``, else nothing.

    The ops are named as ``moving_averages.assign_moving_average`` (and Keras)
    name them (``AssignMovingAvg``, ``AssignMovingAvg_1``, ... under the
    current name scope), and compute the same numbers.

    Args:
      variable: the moving-average variable (never partitioned).
      value: its new observation.
      decay: a Python number or a float scalar tensor.
      active: a scalar bool tensor; False leaves ``variable`` as it is.
      float32_decay: compute ``1 - decay`` in float32 as Keras' fused path
        does (``assign_moving_average`` computes it in double).
    """
    with tf1.name_scope(None, 'AssignMovingAvg', [variable, value, decay]) as scope:
        one_minus = _one_minus(decay, variable.dtype.base_dtype, float32_decay)
        delta = (variable - _like(value, variable)) * one_minus
        delta = tf.where(active, delta, tf.zeros_like(delta))
        return tf1.assign_sub(variable, delta, name=scope)


def _assign_zero_debiased_average(variable, value, decay, active, debias):
    """``assign_moving_average(..., zero_debias=True)`` that skips inactive steps.

    TensorFlow's version counts every run of the op in ``local_step``, so a step
    without data would change the debiased mean; here an inactive step leaves
    ``biased``, ``local_step`` and ``variable`` as they are. Same names and
    numbers otherwise.

    Args:
      debias: ``(biased, local_step)`` from
        :func:`tf1_syncbn._core.variables.zero_debias_variables`.
    """
    biased, local_step = debias
    with tf1.name_scope(None, 'AssignMovingAvg', [variable, value, decay]):
        one_minus = _one_minus(decay, variable.dtype.base_dtype)
        delta = (biased - _like(value, biased)) * one_minus
        update_biased = tf1.assign_sub(biased, tf.where(active, delta, tf.zeros_like(delta)))
        update_step = tf1.assign_add(local_step, tf.cast(active, local_step.dtype.base_dtype))
        bias_factor = 1 - tf.pow(1.0 - one_minus, update_step)
        new_value = tf.where(active, update_biased / bias_factor, tf.convert_to_tensor(variable))
        return tf1.assign(variable, new_value,
                          name=tf1.get_default_graph().get_name_scope() + '/')


class _RenormOrder(object):
    """The towers' reads of each renorm variable, and its updates, by (graph, name)."""

    def __init__(self):
        self.reads = collections.defaultdict(list)
        self.updates = collections.defaultdict(list)


def _order_key(variable):
    """Ops of one graph (a function's body is a graph of its own), outside while loops,
    can be ordered by control edges; None elsewhere."""
    if enclosing_while_loop() is not None:
        return None
    return tf1.get_default_graph(), variable_name(variable)


def read_renorm_statistics(renorm):
    """Reads ``renorm_mean`` and ``renorm_stddev`` before every update of them in the step.

    A training call computes Batch Renormalization's ``r`` and ``d`` from
    these variables as they were before the step, and the main tower updates
    them in the same step. Every tower reads them here, outside any branch on
    ``training``, and each read is a control input of the updates of the same
    variables, whichever tower builds them first: without it, a tower outside
    the main tower's sync group (or any tower with ``sync_statistics=None``)
    whose read was scheduled after the main tower's update would compute with
    the updated values. (Inside a ``tf.while_loop`` each tower keeps its own
    statistics, and no other tower's op can wait for one in its frame.)

    Args:
      renorm: the layer's :class:`~tf1_syncbn._core.variables.RenormVariables`.

    Returns:
      ``(renorm_mean, renorm_stddev)`` as ``[C]`` tensors.
    """
    reads = (read(renorm.mean), read(renorm.stddev))
    order = graph_cache().slot('tf1_syncbn.renorm_order', _RenormOrder)
    for variable, value in zip((renorm.mean, renorm.stddev), reads):
        key = _order_key(variable)
        if key is not None:
            order.reads[key].append(value.op)
            for update in order.updates[key]:
                update._add_control_inputs([value.op])  # noqa: SLF001
    return reads


def _renorm_update(variable, value, decay, active):
    """The moving-average update of a renorm variable, after every tower's read of it."""
    order = graph_cache().slot('tf1_syncbn.renorm_order', _RenormOrder)
    key = _order_key(variable)
    with tf.control_dependencies(order.reads[key] if key is not None else []):
        update = _assign_moving_average(assignable(variable), value, decay, active)
    if key is not None:
        order.updates[key].append(update.op)
    return update


def update_ops(options, params, stats, finetune=None):
    """The moving-average assignments of one training step.

    An empty global batch (``stats.count == 0``) updates nothing. Names and
    order follow slim / Keras: ``AssignMovingAvg`` (mean), ``AssignMovingAvg_1``
    (variance); with renorm, Keras' ``AssignMovingAvg`` (renorm_mean),
    ``_1`` (renorm_stddev), ``_2`` (moving_mean), ``_3`` (moving_stddev) and
    ``AssignNewValue`` (moving_variance), where the renorm updates run as
    control dependencies of the other two.

    Args:
      options: the call's :class:`~tf1_syncbn._core.options.Options`.
      params: the layer's :class:`~tf1_syncbn._core.variables.Params`.
      stats: the step's :class:`~tf1_syncbn._core.normalize.BatchStats`.
      finetune: None, or ``(decay, new_count)`` from :func:`finetune_decay`.

    Returns:
      The update ops for the updates collection (the fine-tune counter's
      assignment last, when there is one).
    """
    active = tf.greater(stats.count, 0.0)
    if finetune is None:
        decay, float32_decay = options.momentum, options.float32_decay
    else:
        decay, float32_decay = finetune[0], False
    moving_mean = assignable(params.moving_mean)
    moving_variance = assignable(params.moving_variance)

    def average(variable, value, var_decay, f32=False):
        return _assign_moving_average(assignable(variable), value, var_decay, active, f32)

    if params.zero_debias is not None:
        mean_update = _assign_zero_debiased_average(moving_mean, stats.mean, decay, active,
                                                    params.zero_debias)
    elif stats.renorm is None:
        mean_update = average(moving_mean, stats.mean, decay, float32_decay)
    if stats.renorm is None:
        ops = [mean_update, average(moving_variance, tracked_variance(options, stats), decay,
                                    float32_decay)]
    else:
        rmean, rstd = stats.renorm
        renorm_updates = [_renorm_update(params.renorm.mean, rmean, options.renorm_momentum,
                                         active),
                          _renorm_update(params.renorm.stddev, rstd, options.renorm_momentum,
                                         active)]
        with tf.control_dependencies(renorm_updates):
            rmean, rstd = tf.identity(rmean), tf.identity(rstd)
            if params.zero_debias is None:
                mean_update = average(moving_mean, stats.mean, decay)
            # moving_variance follows moving_stddev, as in Keras.
            moving_stddev = average(params.renorm.moving_stddev, rstd, decay)
            with tf1.name_scope(None, 'AssignNewValue') as scope:
                new_variance = tf.where(
                    active, tf.nn.relu(moving_stddev * moving_stddev - options.epsilon),
                    tf.convert_to_tensor(moving_variance))
                variance_update = tf1.assign(moving_variance, new_variance, name=scope)
        ops = [mean_update, variance_update]
    if finetune is not None:
        count = assignable(params.finetune_count)
        new_count = tf.where(active, finetune[1], tf.convert_to_tensor(count))
        with tf.control_dependencies(ops):
            ops.append(tf1.assign(count, new_count, name='update_finetune_count'))
    return ops


def finetune_decay(options, count, finetune):
    """Decay ``1 - 1/n`` of fine-tune mode, and the counter's new value.

    Args:
      options: the call's options (``momentum`` when fine-tune is off).
      count: the layer's batch-counter variable.
      finetune: a Python bool or a scalar bool tensor.

    Returns:
      ``(decay, new_count)``: with fine-tune on, the moving statistics become
      the exact average of the batches seen since the last reset (steps with an
      empty global batch do not count).
    """
    active = tf.cast(tf.convert_to_tensor(finetune, tf.bool), tf.float32)
    new_count = read(count) + active
    decay = active * (1.0 - 1.0 / tf.maximum(new_count, 1.0)) + (1.0 - active) * options.momentum
    return decay, new_count


class _SharedUpdates(object):
    """Per graph: the main tower's updates of each call, and triggers waiting for them."""

    def __init__(self):
        self.updates = {}                                  # (towers, call) -> update ops
        self.waiting = collections.defaultdict(list)       # same key -> early triggers


def share_updates(site, updates, updating, updates_collections, after=()):
    """Puts a trigger of the main tower's updates into every other training tower's collections.

    TensorFlow runs an op once per step however many times it is fetched, so
    fetching the updates and any number of triggers updates the moving
    statistics exactly once. A trigger built before the main tower gets its
    control inputs when the main tower builds the updates.

    Args:
      site: the call's :class:`~tf1_syncbn._sync.group.CallSite`.
      updates: the update ops this tower built (only the main tower builds any).
      updating: whether this call updates the moving statistics at all.
      updates_collections: the collections the updates go to (None: inside the
        layer, nothing to share).
      after: ops or tensors a trigger also waits for. ``tf1_syncbn.keras``
        passes the tower's output: tf-keras files an update under
        ``get_updates_for(inputs)`` only when it is reachable from
        ``inputs``, and a trigger whose only control inputs are the main
        tower's assignments is reachable from the main tower's input alone
        (tf-keras filed it as unconditional: the last tower's
        ``get_updates_for`` was empty). Elsewhere nothing: fetching every
        tower's ``UPDATE_OPS`` then needs no other tower's input.
    """
    if site.towers == 1 or updates_collections is None or not updating or \
            site.replicated_updates or enclosing_while_loop() is not None:
        # (Inside a while loop, per-tower statistics: each tower's loop body is
        # a frame of its own, which no other tower's op can depend on.)
        return
    shared = graph_cache().slot('tf1_syncbn.updates', _SharedUpdates)
    key = (site.towers, site.call)
    if site.main:
        if updates:
            shared.updates[key] = list(updates)
            for trigger in shared.waiting.pop(key, []):
                trigger._add_control_inputs([_as_op(u) for u in updates])  # noqa: SLF001
        return
    if site.ctx is not None and not site.ctx.is_training:
        return
    existing = shared.updates.get(key)
    with tf.control_dependencies([_as_op(a) for a in after]):
        if existing is not None:
            trigger = tf.group(*existing, name='update_moving_averages')
        else:
            trigger = tf.no_op(name='update_moving_averages')
            shared.waiting[key].append(trigger)
    tf1.add_to_collections(updates_collections, trigger)


def _as_op(value):
    return value if isinstance(value, tf.Operation) else value.op

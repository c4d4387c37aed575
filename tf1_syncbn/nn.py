"""``tf.nn``'s ``moments`` and ``weighted_moments``, over every tower's batch.

The front-end of hand-written batch norm (``tf.nn.moments`` +
``tf.nn.batch_normalization`` or a formula of one's own, one's own
``gamma``/``beta`` and moving averages): replacing ``tf.nn.moments`` by
:func:`moments` (also ``tf1_syncbn.moments``) makes the layer normalize with
the statistics of the global batch, as one device with the concatenated
batch would. As the layers' front-ends do, it checks the user's arguments
(``tf.nn``'s names and order, and TF1's refused with the fix) and makes one
call of the core, :func:`tf1_syncbn._core.moments.global_moments`, which finds
the call's tower and group and all-reduces through its plan.

The ops are built in a name scope ``moments`` (``weighted_moments``), as
``tf.nn``'s, where :func:`tf1_syncbn.audit_graph` finds them and counts them
to the layer of the enclosing scope.
"""

import numpy as np
import tensorflow as tf

from tf1_syncbn._frontend.building import (check_graph_mode, check_options, global_moments,
                                           moments_scope)
from tower.graph_state import full_name_scope

__all__ = ['moments', 'weighted_moments']

_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


@tf.autograph.experimental.do_not_convert     # (see tf1_syncbn._core.call)
def moments(x, axes, shift=None, keepdims=None, name=None, keep_dims=None, *, training=True,
            sync_statistics='auto', num_dev=None, group_size=None):
    """``tf.nn.moments``, with the mean and variance of the global batch over the towers.

    The same arguments and return values as ``tf.nn.moments``, in its (TF2)
    order ``(x, axes, shift, keepdims, name)``, and ``tf.compat.v1.nn.moments``'
    keyword ``keep_dims``; plus the layers' ``training``, ``sync_statistics``
    and ``num_dev``. When ``axes`` holds the batch axis 0, the mean and
    (biased) variance are those of the concatenation of every tower's batch
    along axis 0, as ``tf.nn.moments`` computes them on one device: uneven
    and empty towers included. Their gradients reach every tower's input
    (each tower's gradient is built with one all-reduce). Without axis 0
    nothing is synchronized: each example's statistics are its own, as on
    one device.

    The tower and its group are found as the layers find them: a
    :class:`tower.TowerContext` (``call_for_each_tower``), tensorpack's
    towers, a ``tf.distribute`` replica, or a ``tower_<i>`` / ``clone_<i>``
    name scope with ``num_dev``. Outside any tower (one device) it is
    ``tf.nn.moments``. It never falls back to one tower's statistics, silently
    or after a warning; at graph build, these raise: ``num_dev`` that
    disagrees with the towers, a backend asked for where the number of towers
    is unknown, ``'auto'`` in a tower name scope above ``tower_0`` without
    ``num_dev``, and the copies of one hand-written layer in a device loop the
    call cannot see (``tf.device`` with ``tf.variable_scope(..., reuse=i >
    0)``, no tower name scope, no ``num_dev``). Those copies are the training
    calls under one variable scope with one name (``bn/moments``: the same in
    every copy of a layer whose variable scope the loop reuses, while their
    name scopes differ): the one on a second device raises. ``num_dev=1``
    says they are one model split across devices on purpose,
    ``sync_statistics=None`` asks for per-device statistics.

    Args:
      x: a float16, bfloat16, float32 or float64 tensor of known rank; axis 0
        is the batch axis the towers split.
      axes: the axes to reduce (ints, negative from the end).
      shift: not used, as in ``tf.nn.moments`` (each tower shifts its data by
        a value of its own batch).
      keepdims: keep the reduced axes with length 1 (a bool or None).
      name: the name scope of the ops (default ``'moments'``). The audit
        recognizes the default, ``'moments'`` and ``'moments_<n>'``.
      keep_dims: TF1's name of ``keepdims`` (keyword only in practice:
        ``tf.compat.v1.nn.moments``' positional order differs).
      training: True (default): the statistics of the global batch; False:
        this tower's own (``tf.nn.moments``, no all-reduce); a scalar bool
        tensor chooses at run time (a ``tf.cond`` around the all-reduce), so
        that a run with it False (evaluation) may fetch one tower's output
        alone. Pass the layer's ``is_training`` tensor.
      sync_statistics: ``'auto'`` (default: synchronize over the towers it
        is built in, nothing with one tower), ``'collective'``, ``'nccl'``,
        ``'horovod'``, None (this tower's statistics, ``tf.nn.moments``) or a
        :class:`tf1_syncbn.SyncBackend`.
      num_dev: the number of towers, for ``tower_<i>`` / ``clone_<i>`` name
        scopes without a tower context.
      group_size: None (over every tower), or the statistics of each group of
        that many consecutive global towers, or explicit groups (lists of
        global tower indices); as for :func:`tf1_syncbn.sync_batch_norm`.

    Returns:
      ``(mean, variance)`` in the dtype of ``x`` (statistics computed in
      float32, float64 for float64 inputs, and combined in float64).

    Raises:
      TypeError: a non-float input; ``keepdims`` / ``keep_dims`` that are not
        bools or ``name`` that is not a string (TF1's positional order,
        ``tf.compat.v1.nn.moments(x, axes, shift, name, keep_dims)``: the
        message says what to pass by keyword); ``training`` that is neither
        a bool nor a scalar bool tensor.
      ValueError: ``keepdims`` and ``keep_dims`` that disagree; an unknown
        rank, an axis out of range; towers whose static non-reduced
        dimensions differ; and the layers' errors about towers and backends
        (naming ``tf1_syncbn.moments(<scope>)``).
      RuntimeError: eagerly or inside a ``tf.function``.

    At run time, towers whose non-reduced dimensions differ (not all known
    statically) fail the step with ``InvalidArgumentError`` naming the call
    and every tower's dimensions, before the all-reduce.

    Hangs: a synchronized call waits in its all-reduce for every tower of its
    group, and its gradient in a second one: every tower must run it in the
    same ``session.run`` (and build the same gradients through it); a run
    that fetches one tower's output alone waits for the others unless
    ``training`` is False in it. The collective backend's timeout turns a
    missing tower into an error (docs/timeouts.md).
    """
    keepdims = _check_positional('moments', keepdims, name, keep_dims)
    return _sync_moments('moments', x, axes, None, keepdims, name, training,
                         sync_statistics, num_dev, group_size)


@tf.autograph.experimental.do_not_convert     # (see tf1_syncbn._core.call)
def weighted_moments(x, axes, frequency_weights, keepdims=None, name=None, keep_dims=None, *,
                     training=True, sync_statistics='auto', num_dev=None, group_size=None):
    """``tf.nn.weighted_moments``, over the global batch of the towers.

    As :func:`moments`, with ``frequency_weights`` (each tower's, broadcastable
    to its ``x``): the weighted mean ``sum(w * x) / sum(w)`` and variance
    ``sum(w * (x - mean)**2) / sum(w)`` of every tower's data together, 0
    where the total weight is 0 (as ``tf.nn.weighted_moments``). Gradients
    reach every tower's input and weights. The order is TF2's,
    ``(x, axes, frequency_weights, keepdims, name)``; TF1's
    ``tf.compat.v1.nn.weighted_moments(x, axes, frequency_weights, name,
    keep_dims)`` is refused as for :func:`moments`.

    Args:
      x, axes, keepdims, name, keep_dims, training, sync_statistics, num_dev, group_size:
        as for :func:`moments` (the default name is ``'weighted_moments'``).
      frequency_weights: a tensor broadcastable to ``x``.

    Returns:
      ``(weighted_mean, weighted_variance)`` in the dtype of ``x``.

    Raises:
      As :func:`moments`.

    Hangs: as :func:`moments`.
    """
    keepdims = _check_positional('weighted_moments', keepdims, name, keep_dims)
    return _sync_moments('weighted_moments', x, axes, frequency_weights, keepdims, name,
                         training, sync_statistics, num_dev, group_size)


#: Each function's positional order: TF2's (``tf.nn``, this module's) and TF1's.
_ORDERS = {
    'moments': ('x, axes, shift, keepdims, name', 'x, axes, shift, name, keep_dims'),
    'weighted_moments': ('x, axes, frequency_weights, keepdims, name',
                         'x, axes, frequency_weights, name, keep_dims'),
}
_BOOLS = (bool, np.bool_)


def _check_positional(kind, keepdims, name, keep_dims):
    """``keepdims`` as a bool, after refusing TF1's positional order.

    ``tf.compat.v1.nn.moments(x, axes, shift, name, keep_dims)`` puts the name
    where TF2's order has ``keepdims`` and ``keep_dims`` where it has the
    name: a string ``keepdims`` or a bool ``name`` is that order.
    """
    scope = full_name_scope()
    label = 'tf1_syncbn.%s(%s)' % (kind, '%s/%s' % (scope, kind) if scope else kind)
    tf2_order, tf1_order = _ORDERS[kind]
    orders = ('tf1_syncbn.%s takes TF2\'s order, tf.nn.%s(%s), not TF1\'s '
              'tf.compat.v1.nn.%s(%s)' % (kind, kind, tf2_order, kind, tf1_order))
    first = tf2_order.rsplit(', keepdims', 1)[0]
    if keepdims is not None and not isinstance(keepdims, _BOOLS):
        fix = ('name=%r' % (keepdims,) if isinstance(keepdims, str) else 'name=...') + (
            '' if name is None else ', keep_dims=%r' % (name,))
        raise TypeError(
            '%s: keepdims=%r is not a bool: %s, where the fourth positional argument is the '
            'name. Pass the name (and keep_dims) by keyword: tf1_syncbn.%s(%s, %s).'
            % (label, keepdims, orders, kind, first, fix))
    if keep_dims is not None and not isinstance(keep_dims, _BOOLS):
        raise TypeError('%s: keep_dims=%r is not a bool (keep_dims is TF1\'s name of keepdims).'
                        % (label, keep_dims))
    if name is not None and not isinstance(name, str):
        raise TypeError(
            '%s: name=%r is not a string: %s, where the fifth positional argument is '
            'keep_dims. Pass keep_dims (and the name) by keyword: tf1_syncbn.%s(%s, '
            'keep_dims=%r, name=...).' % (label, name, orders, kind, first, name))
    if keepdims is not None and keep_dims is not None and bool(keepdims) != bool(keep_dims):
        raise ValueError('%s: keepdims=%r and keep_dims=%r disagree (keep_dims is TF1\'s name of '
                         'keepdims): pass one of them.' % (label, keepdims, keep_dims))
    return bool(keepdims if keepdims is not None else keep_dims)


def _check_axes(label, axes, rank):
    axes = [axes] if isinstance(axes, int) else list(axes)
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
        raise TypeError('%s: axes must be ints, got %r.' % (label, axes))
    normalized = sorted({a + rank if a < 0 else a for a in axes})
    if any(not 0 <= a < rank for a in normalized) or len(normalized) != len(axes):
        raise ValueError('%s: invalid axes %r for an input of rank %d: each must lie in '
                         '[-%d, %d) and appear once.' % (label, axes, rank, rank, rank))
    return normalized


def _sync_moments(kind, x, axes, weights, keepdims, name, training, sync_statistics, num_dev,
                  group_size=None):
    check_graph_mode('tf1_syncbn.%s' % kind)
    with moments_scope(name, kind, [x] + ([weights] if weights is not None else [])):
        label = 'tf1_syncbn.%s(%s)' % (kind, full_name_scope() or kind)
        if isinstance(training, np.bool_):
            training = bool(training)
        options = check_options(label, arg_names={'is_training': 'training'},
                                is_training=training, num_dev=num_dev,
                                sync_statistics=sync_statistics, group_size=group_size)
        x = tf.convert_to_tensor(x)
        if x.dtype.base_dtype not in _DTYPES:
            raise TypeError('%s: x has dtype %s; moments need a float16, bfloat16, float32 or '
                            'float64 tensor (cast integers with tf.cast first).'
                            % (label, x.dtype.name))
        rank = x.shape.ndims
        if rank is None:
            raise ValueError('%s: x has an undefined rank; give it a static rank (for example '
                             'with tf.ensure_shape).' % label)
        axes = _check_axes(label, axes, rank)
        return global_moments(x, axes, weights, keepdims, options, label, name or kind)

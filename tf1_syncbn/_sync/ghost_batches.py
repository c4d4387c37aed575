"""Ghost batches over a sync group: every member must have the same batch size.

Virtual batch ``k`` spans the ``k``-th run of every member, so the packed
all-reduce of the ghost moments has ``batch / per_member`` rows on each
member: towers of different batch sizes hand TensorFlow's all-reduce
tensors of different shapes, which aborts the step ("Collective ops is
aborted by: Shape mismatch") with no layer named, and leaves the session's
collectives unusable. :func:`checked_batch` turns that into the library's
own errors:

* at graph build, when the sizes are static: the first member of a call
  records its static batch size, and a later member with another static
  size raises ``ValueError`` naming the layer, the towers' sizes and the fix;
* at run time, when they are not: a later member with a dynamic batch checks
  its size against the first member's static one (a local assert), and when
  the first member's batch is dynamic every member all-reduces its batch size
  first (one small all-reduce of the same shape everywhere) and asserts that
  every member's is the same, naming the layer and the towers' sizes, before
  the ghost all-reduce can start.

Every member of a group takes the same decision (the first member's), so
they build the same collectives.
"""

import tensorflow as tf

from tower.graph_state import get_graph_state

__all__ = ['checked_batch']

_SLOT = 'tf1_syncbn.ghost_batches'
_RESTART = ('A failed step with collectives leaves the collectives of its session unusable '
            '(later steps fail with "Collective ops is aborted"): after fixing the batch sizes, '
            'open a new session or restart the process.')


def _fix(options):
    return ('Give every tower the same batch size (split the global batch evenly, drop the '
            'remainder: dataset.batch(..., drop_remainder=True)), or pass %s=None (or '
            'sync_statistics=None for per-tower ghost batches).'
            % options.arg('virtual_batch_size'))


def checked_batch(options, plan, x4):
    """``x4``, after the checks that every member of ``plan`` has its batch size.

    Args:
      options: the call's options (the layer's name and ``virtual_batch_size``).
      plan: the call's :class:`~tf1_syncbn._sync.plan.SyncPlan` (not None).
      x4: this member's canonical view.

    Returns:
      ``x4``, or an identity of it that waits for the run-time check.

    Raises:
      ValueError: when another member of the call has another static batch size.

    Hangs: the run-time check all-reduces (see
      :meth:`~tf1_syncbn._sync.plan.SyncPlan.all_reduce`).
    """
    static = tf.compat.dimension_value(x4.shape[0])
    table = get_graph_state().slot(_SLOT, dict)
    first = table.setdefault((plan.key.name, plan.key.group), (plan.tower, static))
    first_tower, first_static = first
    vbs = options.virtual_batch_size
    name = options.arg('virtual_batch_size')
    if first_tower == plan.tower:
        if static is not None:
            return x4
    elif first_static is not None:
        if static is not None:
            if static != first_static:
                raise options.error(
                    '%s=%d over a sync group of %d members needs the same batch size in every '
                    'tower (virtual batch k spans the k-th run of each), but tower %d has %d '
                    'examples and tower %d has %d (static shapes). %s'
                    % (name, vbs, plan.group_size, first_tower, first_static, plan.tower,
                       static, _fix(options)))
            return x4
        batch = tf.shape(x4)[0]
        check = tf.debugging.Assert(
            tf.equal(batch, first_static),
            ['%s: %s=%d needs the same batch size in every tower, but tower %d has %d '
             'examples (static) and tower %d has:' % (options.layer, name, vbs, first_tower,
                                                     first_static, plan.tower),
             batch, '%s %s' % (_fix(options), _RESTART)], name='check_ghost_batch')
        with tf.control_dependencies([check]):
            return tf.identity(x4)
    return _all_reduced_check(options, plan, x4)


def _all_reduced_check(options, plan, x4):
    """Every member's batch size, all-reduced, asserted equal before the ghost all-reduce."""
    towers = max(plan.group_size, plan.member + 1)
    batch = tf.cast(tf.shape(x4)[0], tf.float64)
    slots = tf.one_hot(plan.member, towers, dtype=tf.float64) * batch
    packed = tf.concat([tf.stack([tf.ones([], tf.float64), batch, batch * batch]), slots], 0)
    summed = plan.all_reduce(packed, 'ghost_batches')
    members, total, squares = summed[0], summed[1], summed[2]
    # Equal sizes iff their variance is zero (exact: integers in float64).
    same = tf.equal(members * squares, total * total)
    name = options.arg('virtual_batch_size')
    listed = ('by tower index (summed over workers)' if plan.sync_group is None else
              'by member of sync %s' % plan.sync_group.label())
    check = tf.debugging.Assert(
        same, ['%s: %s=%d needs the same batch size in every tower of the sync group (virtual '
               'batch k spans the k-th run of each), but the towers\' batch sizes differ in '
               'this step; %s:' % (options.layer, name, options.virtual_batch_size, listed),
               summed[3:],
               '%s %s' % (_fix(options), _RESTART)],
        summarize=towers, name='check_ghost_batches')
    with tf.control_dependencies([check]):
        return tf.identity(x4)

"""Every member of a synchronized call must all-reduce one shape: checked before the all-reduce.

A call whose all-reduced tensor takes its shape from dimensions of the
member's input (ghost batches: the batch size; ``tf1_syncbn.moments``: the
dimensions it keeps) hands TensorFlow's all-reduce tensors of different
shapes when the members' inputs differ there. That aborts the step
("Collective ops is aborted by: Shape mismatch") naming only the node, and
leaves the session's collectives unusable. :func:`checked_dims` turns it
into the caller's own errors:

* at graph build, when the static dimensions already disagree: the first
  member of a call records its static dimensions, and a later member whose
  known dimensions differ raises the caller's exception;
* at run time, when they are not all static: a later member whose
  dimensions are not all static asserts them against the first member's
  static ones (a local assert, no collective); when the first member's are
  not all static, every member all-reduces its dimensions first (one small
  all-reduce of the same shape everywhere) and asserts that every member's
  are the same, listing each member's.

Every member of a group takes the same decision (the first member's), so
they build the same collectives. Static dimensions that agree cost nothing.
"""

import collections

import tensorflow as tf

from tf1_syncbn._graph.cache import graph_cache

__all__ = ['Messages', 'checked_dims', 'RESTART']

#: What a failed step leaves behind, for run-time messages (``%s``: what to fix).
RESTART = ('A failed step with collectives leaves the collectives of its session unusable '
           '(later steps fail with "Collective ops is aborted"): after fixing the %s, '
           'open a new session or restart the process.')


class Messages(collections.namedtuple('Messages', ['refuse', 'local', 'reduced'])):
    """The caller's messages for :func:`checked_dims`.

    Attributes:
      refuse: ``refuse(first_tower, first_static, tower, static)``: the
        exception raised at graph build when known static dimensions differ.
      local: ``local(first_tower, first_static, tower, dims)``: the ``data``
        of the ``Assert`` of a member whose dimensions ``dims`` (a 1-D int32
        tensor) are not all static, against the first member's static ones.
      reduced: ``reduced(listed, row, per_member)``: the ``data`` of the
        ``Assert`` after the all-reduce; ``per_member`` is a float64 tensor
        with one row of dimensions per member, ``listed`` says how the rows
        are ordered, and ``row`` names one (``'tower'`` or ``'member'``).
    """


def checked_dims(plan, slot, tensor, static, dims, messages, direction):
    """``tensor``, after the checks that every member of ``plan`` has the same dimensions.

    Args:
      plan: the call's :class:`~tf1_syncbn._sync.plan.SyncPlan` (not None).
      slot: the graph-state slot of the caller's table of first members.
      tensor: what the caller all-reduces next (returned, gated by a
        run-time check when one is needed).
      static: this member's static dimensions (ints, None where unknown).
      dims: a callable that builds this member's dimensions at run time (a
        1-D int32 tensor as long as ``static``), called only when needed.
      messages: the caller's :class:`Messages`.
      direction: the name of the check's all-reduce among the call's (its
        ``Assert`` ops are ``check_<direction>``).

    Returns:
      ``tensor``, or an identity of it that waits for the run-time check.

    Raises:
      The exception of ``messages.refuse`` when known static dimensions
      differ from the first member's.

    Hangs: the all-reduced check waits for every member (see
      :meth:`~tf1_syncbn._sync.plan.SyncPlan.all_reduce`).
    """
    static = list(static)
    table = graph_cache().slot(slot, dict)
    first_tower, first_static = table.setdefault((plan.key.name, plan.key.group),
                                                 (plan.tower, static))
    if first_tower != plan.tower and (len(first_static) != len(static) or any(
            a is not None and b is not None and a != b for a, b in zip(first_static, static))):
        raise messages.refuse(first_tower, first_static, plan.tower, static)
    if None not in first_static:
        if first_tower == plan.tower or None not in static:
            return tensor
        values = dims()
        check = tf.debugging.Assert(
            tf.reduce_all(tf.equal(values, first_static)),
            messages.local(first_tower, first_static, plan.tower, values),
            name='check_%s' % direction)
    else:
        check = _all_reduced_check(plan, len(static), dims(), messages, direction)
    with tf.control_dependencies([check]):
        return tf.identity(tensor)


def _all_reduced_check(plan, k, dims, messages, direction):
    """Every member's ``dims``, all-reduced, asserted equal."""
    members = max(plan.num_members, plan.member + 1)
    values = tf.cast(dims, tf.float64)
    slots = tf.one_hot(plan.member, members, dtype=tf.float64)[:, None] * values[None, :]
    packed = tf.concat([tf.ones([1], tf.float64), values, values * values,
                        tf.reshape(slots, [-1])], 0)
    summed = plan.all_reduce(packed, direction)
    count, total, squares = summed[0], summed[1:1 + k], summed[1 + k:1 + 2 * k]
    # Equal dimensions iff their variance is zero (exact: integers in float64).
    same = tf.reduce_all(tf.equal(count * squares, total * total))
    if plan.sync_group is None:
        listed, row = 'by tower index (summed over workers)', 'tower'
    else:
        listed, row = 'by member of sync %s' % plan.sync_group.label(), 'member'
    return tf.debugging.Assert(
        same, messages.reduced(listed, row, tf.reshape(summed[1 + 2 * k:], [members, k])),
        summarize=members * k, name='check_%s' % direction)

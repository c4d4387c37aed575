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
they build the same collectives (:func:`tf1_syncbn._sync.member_shapes.checked_dims`,
which ``tf1_syncbn.moments`` shares for the dimensions it keeps).
"""

import tensorflow as tf

from tf1_syncbn._sync.member_shapes import RESTART, Messages, checked_dims

__all__ = ['checked_batch']

_SLOT = 'tf1_syncbn.ghost_batches'
_RESTART = RESTART % 'batch sizes'


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
      :func:`tf1_syncbn._sync.member_shapes.checked_dims`).
    """
    vbs = options.virtual_batch_size
    name = options.arg('virtual_batch_size')

    def refuse(first_tower, first_static, tower, static):
        return options.error(
            '%s=%d over a sync group of %d members needs the same batch size in every '
            'tower (virtual batch k spans the k-th run of each), but tower %d has %d '
            'examples and tower %d has %d (static shapes). %s'
            % (name, vbs, plan.num_members, first_tower, first_static[0], tower, static[0],
               _fix(options)))

    def local(first_tower, first_static, tower, dims):
        return ['%s: %s=%d needs the same batch size in every tower, but tower %d has %d '
                'examples (static) and tower %d has:' % (options.layer, name, vbs, first_tower,
                                                        first_static[0], tower),
                dims[0], '%s %s' % (_fix(options), _RESTART)]

    def reduced(listed, row, per_member):
        del row
        return ['%s: %s=%d needs the same batch size in every tower of the sync group (virtual '
                'batch k spans the k-th run of each), but the towers\' batch sizes differ in '
                'this step; %s:' % (options.layer, name, vbs, listed),
                per_member[:, 0], '%s %s' % (_fix(options), _RESTART)]

    return checked_dims(plan, _SLOT, x4, [tf.compat.dimension_value(x4.shape[0])],
                        lambda: tf.shape(x4)[:1], Messages(refuse, local, reduced),
                        'ghost_batches')

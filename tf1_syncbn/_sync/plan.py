"""The synchronization plan of one layer call: the only way to build its collectives.

Every way of computing training statistics (the fast fused op, the
differentiable slow path of renorm / batch weights / adjustment /
``fused=False``, ghost batches) receives a :class:`SyncPlan`, or None for
this tower's statistics alone, and builds its all-reduces with
:meth:`SyncPlan.all_reduce`. The plan carries the checks that must precede
any collective of the step (the run-time check that every tower was built,
and the step watchdog, :mod:`tf1_syncbn._sync.guards`), so no path can build a
collective without them.
"""

import collections
import itertools

import tensorflow as tf

from tf1_syncbn import timeouts
from tf1_syncbn._sync import guards as _guards
from tf1_syncbn._sync.control_flow import enclosing_while_loop
from tf1_syncbn._compute.gradients import raw_collectives
from tf1_syncbn._sync.group import choose_backend, current_device, find_sync_group, sync_groups
from tf1_syncbn._sync.registry import get_registry
from tf1_syncbn.backends import SyncKey
from tower import TowerContext

__all__ = ['SyncPlan', 'plan_sync', 'backward_direction', 'GROUP_OF_ONE']

#: The name of the identity that stands for the all-reduce of a sync group of
#: one tower (the audit, :mod:`tf1_syncbn.audit.layers`, reads it).
GROUP_OF_ONE = 'sync_group_of_one'


class SyncPlan(collections.namedtuple('SyncPlan',
                                      ['backend', 'key', 'guards', 'watched', 'backward_builds',
                                       'tower', 'sync_group'], defaults=(None,))):
    """How one call synchronizes (frozen).

    Attributes:
      backend: the :class:`~tf1_syncbn.SyncBackend`.
      key: the call's :class:`~tf1_syncbn.SyncKey` (its name is the same in
        every tower; its device is this tower's).
      guards: the ops every collective of the call waits for.
      watched: whether the step watchdog bounds those collectives (they then
        carry no per-op timeout).
      backward_builds: counts this member's backward all-reduces
        (:func:`backward_direction`).
      tower: this member's tower index in its graph (for messages and checks).
      sync_group: this member's :class:`~tf1_syncbn._sync.group.SyncGroup` when
        ``group_size`` splits the towers, else None (every tower).
    """

    @property
    def num_members(self):
        """The number of all-reduce members (``key.num_members``)."""
        return self.key.num_members

    @property
    def member(self):
        """This member's position in its group (with every tower: its tower index)."""
        return self.tower if self.sync_group is None else self.sync_group.position

    @property
    def device(self):
        """This member's canonical device ('' when unplaced)."""
        return self.key.device

    def all_reduce(self, tensor, direction):
        """The sum of ``tensor`` over the group, after the guards.

        Args:
          tensor: the tensor to sum (same shape and dtype on every member).
          direction: ``'forward'`` or ``'backward'``. Every member builds the
            same directions, so each names one collective of the group. The
            forward all-reduce is built once per call; a backward one each
            time a gradient of the call is built (:func:`backward_direction`).

        Hangs: waits for every member of the group; a member that builds fewer
          backward all-reduces than the others (a gradient built for some
          towers only) leaves the others' extra ones waiting until the step's
          timeout (:mod:`tf1_syncbn.timeouts`), when they are run.
        """
        if direction == 'backward':
            direction = backward_direction(next(self.backward_builds))
        if self.num_members == 1:
            # A group of one tower: its sum is its own tensor. Named, so that the
            # audit tells this tower's group of one from a tower left unsynchronized.
            return tf.identity(tensor, name=GROUP_OF_ONE)
        with tf.control_dependencies(self.guards), timeouts.watched(self.watched), \
                raw_collectives():
            return self.backend.all_reduce(tensor, self.key, direction)

    def main_group_statistics(self, tensors):
        """The moving-average inputs ``tensors`` as worker 0's main tower computes them.

        The moving statistics follow the group of worker 0's main training
        tower (global tower 0, as PyTorch's rank 0 and TPU's replica 0). In
        one process the main tower is in that group. Across workers whose
        main towers are in other groups, every worker's main tower takes
        worker 0's values, so the workers' variables stay identical: one
        all-reduce among the workers' main towers of the values, which only
        worker 0 contributes (exact: the others add zeros).

        Args:
          tensors: float32 tensors of this main tower's statistics.

        Returns:
          The tensors (unchanged when no worker needs them from worker 0).

        Hangs: waits for every worker's main tower, as the step's other
          all-reduces (same guards and timeout).
        """
        if self.sync_group is None or not self.sync_group.main_needs_worker0():
            return list(tensors)
        shapes = [tf.shape(t) for t in tensors]
        sizes = [tf.size(t) for t in tensors]
        packed = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], 0)
        if self.sync_group.rank != 0:
            packed = tf.zeros_like(packed)
        # (The audit tells this all-reduce from the group's by the name scope.)
        with tf.control_dependencies(self.guards), timeouts.watched(self.watched), \
                raw_collectives(), tf.name_scope('main_group_statistics'):
            summed = self.backend.all_reduce_workers(packed, self.key, 'main-statistics')
        parts = tf.split(summed, tf.stack(sizes), num=len(tensors))
        return [tf.cast(tf.reshape(p, shape), t.dtype)
                for p, shape, t in zip(parts, shapes, tensors)]


def backward_direction(build):
    """The direction label of a call's ``build``-th backward all-reduce (from 0).

    ``tf.gradients`` builds a layer's gradient once per call of it: a step
    that fetches the gradients of two losses through one layer (two
    ``tf.gradients`` or ``compute_gradients`` calls, a GAN's two losses
    through its discriminator) runs two backward all-reduces of the layer.
    Each needs keys of its own, or TensorFlow pairs one tower's first with
    another's second (a wrong gradient, or an internal error). Every member
    counts its own builds: the k-th of each pair up, as the towers build the
    same gradients in the same order. The first keeps the plain
    ``'backward'``, so graphs built before are keyed as they were.
    """
    return 'backward' if build == 0 else 'backward/%d' % build


def plan_sync(options, site):
    """Plans a training call's synchronization, or returns None for local statistics.

    Chooses the backend (:func:`tf1_syncbn._sync.group.choose_backend`), builds the
    call's key, checks it with the backend (devices, GPUs), registers the
    member with the graph's :class:`~tf1_syncbn._sync.registry.CallRegistry`
    (which raises on conflicts between towers) and gets the step's guards.

    Args:
      options: the layer's :class:`~tf1_syncbn._core.options.Options`.
      site: the call's :class:`~tf1_syncbn._sync.group.CallSite`.

    Returns:
      A :class:`SyncPlan`, or None (no synchronization: ``sync_statistics``
      None, or one tower in all). A tower alone in its sync group gets a plan
      whose all-reduces are identities (named :data:`GROUP_OF_ONE`): no
      collective, no guard.

    Raises:
      ValueError: inside a while loop (see
        :func:`tf1_syncbn._sync.control_flow.enclosing_while_loop`); and
        see :func:`~tf1_syncbn._sync.group.choose_backend`, the backend's ``check``
        and :meth:`~tf1_syncbn._sync.registry.CallRegistry.register`.
    """
    if options.sync_statistics is None:
        return None
    device = current_device()
    backend = choose_backend(options, site, device)
    if backend is None:
        if options.group_size is not None and site.towers is not None:
            sync_groups(options, site.towers, site.workers)   # refuses a size that does not fit
        return None
    sync_group = find_sync_group(options, site, backend)
    if sync_group is None:
        num_members = backend.num_members(site.towers)
        if num_members == 1:
            return None                 # one tower in all
    else:
        num_members = len(sync_group.members)
    # A tower alone in its sync group (group_size=1, or explicit groups such as
    # [[0], [1, 2, 3]]) all-reduces nothing for its statistics (its plan sums
    # over itself: identities), but it is planned and registered as every
    # member is: the registry then knows that it built the layer, and checks
    # that it built it with the same groups as the other towers.
    collective = num_members > 1 or sync_group.main_needs_worker0()
    loop = enclosing_while_loop()
    if loop is not None and collective:
        raise options.error(
            'a synchronized layer cannot be built inside the while loop %r (tf.while_loop, or '
            'tf.map_fn / tf.scan / a tf.function loop built on it). Its all-reduces would have '
            'to run the same number of times in every tower, and a loop body drops the control '
            'inputs that bound them, so any mismatch would hang. Build the layer outside the '
            'loop, or pass %s=None for per-tower statistics inside it.'
            % (loop, options.arg('sync_statistics')))
    key = SyncKey(name=site.call, layer=tf.compat.v1.get_variable_scope().name,
                  num_members=num_members, device=device,
                  members=None if sync_group is None else sync_group.members,
                  group=None if sync_group is None else sync_group.index)
    backend.check(key)
    get_registry().register(key, site.index, site.towers, backend,
                            track=isinstance(site.ctx, TowerContext),
                            labels=None if sync_group is None else sync_group.local_labels())
    guards, watched = _guards.step_guards(device, backend.step_timeout()) if collective else \
        ((), False)
    return SyncPlan(backend, key, guards, watched, itertools.count(), site.index, sync_group)


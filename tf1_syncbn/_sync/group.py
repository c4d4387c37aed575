"""Which tower a layer call is built in, and which group it synchronizes with.

The layers never ask a harness directly: :func:`tower.get_current_tower_context`
gives this library's ``TowerContext`` or another harness's tower (tensorpack's,
a ``tf.distribute`` replica) through :mod:`tower.harness`, and a name scope
gives the tower of scripts without tower objects (``tower_<i>``,
``clone_<i>``, registered patterns). :func:`find_call_site` reads them;
:func:`choose_backend` turns ``sync_statistics`` into a backend for that
group, and refuses at graph build rather than normalize with one tower's
statistics when the group cannot be told (a warning followed by per-tower
statistics would be a silent fallback). :func:`check_untowered_copies` does
the same for a tower loop it cannot see at all: one layer trained by copies
on several devices, outside any tower it can name.
"""

import collections

import tensorflow as tf

from tf1_syncbn import backends
from tf1_syncbn._sync.registry import base_name, get_registry
from tower import get_current_tower_context, tower_index_from_name
from tower.graph_state import full_name_scope

tf1 = tf.compat.v1

__all__ = ['CallSite', 'find_call_site', 'choose_backend', 'check_untowered_copies',
           'canonical_device', 'current_device', 'SyncGroup', 'sync_groups', 'find_sync_group']


class CallSite(collections.namedtuple('CallSite', ['ctx', 'index', 'towers', 'main', 'call',
                                                   'workers', 'replicated_updates'])):
    """Where a layer call is built: its tower and the towers built with it.

    Not the call's sync group (:class:`SyncGroup`, with ``group_size``): the
    towers of this graph (and the harness's workers) that the group draws from.

    Attributes:
      ctx: the tower context (this library's, or another harness's seen
        through :class:`tower.harness.HarnessTowerContext`), or None.
      index: the tower's index (0 outside any tower).
      towers: the number of towers of this graph in the group: the context's
        ``total``, or ``num_dev`` for name-scope towers, 1 outside any tower,
        and None when the name scope says "tower" but nothing says how many.
      main: whether this call builds the moving-average updates (the main
        training tower).
      call: the call's name, the same in every tower (see
        :meth:`tf1_syncbn._sync.registry.CallRegistry.call_name`); an inference
        call (``is_training=False``) takes no index: ``'<base>:inference'``.
      workers: how many processes build ``towers`` towers each into the group
        (a ``tf.distribute`` multi-worker strategy; 1 elsewhere).
      replicated_updates: every tower builds the moving-average updates and
        the harness merges them (``tf.distribute``); else only ``main`` does.
    """


def canonical_device(device):
    """Canonical form of a device string ('' stays '')."""
    if not device:
        return ''
    return tf.DeviceSpec.from_string(device).to_string()


def current_device():
    """The canonical device that ops built here are placed on (the innermost tf.device).

    Device functions (``replica_device_setter``) decide per op, so an op is
    built to ask: one ``NoOp`` named ``device_probe``.
    """
    return canonical_device(tf.no_op(name='device_probe').device)


def find_call_site(options, prediction_towers_update=False):
    """Finds this call's tower, its index and the number of towers in its group.

    In order: a tower context (this library's, tensorpack's, a
    ``tf.distribute`` replica's); else a tower name scope (``tower<i>``,
    ``tower_<i>``, ``clone_<i>`` or a registered pattern), with ``num_dev``
    giving the number of towers; else a single tower.

    Args:
      options: the layer's :class:`~tf1_syncbn._core.options.Options`.
      prediction_towers_update: whether a call with batch statistics in a
        prediction tower updates the moving statistics (tensorpack's layers
        do; slim's run in training towers only).

    Returns:
      A :class:`CallSite`.

    Raises:
      ValueError: when ``num_dev`` disagrees with the tower context or the
        name scope, or ``num_dev > 1`` for a training call outside any tower.
    """
    ctx = get_current_tower_context()
    num_dev = options.num_dev
    workers = getattr(ctx, 'workers', 1)
    if ctx is not None:
        if num_dev is not None and num_dev != ctx.total * workers:
            raise options.error('%s=%d disagrees with the %d towers of %r; drop %s or fix it.'
                                % (options.arg('num_dev'), num_dev, ctx.total * workers, ctx,
                                   options.arg('num_dev')))
        index, towers = ctx.index, ctx.total
        main = ctx.is_main_training_tower or (prediction_towers_update and not ctx.is_training)
    else:
        scope = full_name_scope()
        index = tower_index_from_name(scope)
        if num_dev is None:
            towers = 1 if index is None else None
        else:
            towers = num_dev
            if index is None and num_dev > 1 and options.is_training is not False:
                raise options.error(
                    '%s=%d but the layer is built outside any tower (name scope %r): build '
                    'each tower in tower.TowerContext (or call_for_each_tower), or under a name '
                    'scope tower<i>, tower_<i> or clone_<i> (or a pattern registered with '
                    'tower.register_tower_pattern), so that the tower index is known.'
                    % (options.arg('num_dev'), num_dev, scope))
            if index is not None and index >= num_dev:
                raise options.error('the name scope %r says tower %d but %s=%d.'
                                    % (scope, index, options.arg('num_dev'), num_dev))
        index = index or 0
        main = index == 0
    base = base_name(tf1.get_variable_scope().name, ctx)
    # An inference call builds no collective and no update: it takes no call
    # index, so calls built before, between or after the towers (a validation
    # graph, `training=False`) never shift the towers' numbering.
    call = get_registry().call_name(towers, index, base) if options.is_training is not False \
        else '%s:inference' % base
    return CallSite(ctx, index, towers, main, call, workers,
                 bool(getattr(ctx, 'replicated_updates', False)))


class SyncGroup(collections.namedtuple('SyncGroup', ['groups', 'index', 'towers', 'workers',
                                                     'rank', 'tower'])):
    """This member's sync group, when ``group_size`` splits the towers into several.

    Towers are numbered globally: worker ``w``'s tower ``t`` is
    ``w * towers + t``, as PyTorch ranks and TPU shards are.

    Attributes:
      groups: every group, a tuple of sorted tuples of global tower indices.
      index: this member's group (0-based; messages count from 1).
      towers: towers per worker in this graph.
      workers: the workers the towers span.
      rank: this worker's rank.
      tower: this member's tower index in its graph.
    """

    @property
    def members(self):
        """The global tower indices of this member's group."""
        return self.groups[self.index]

    @property
    def position(self):
        """This member's position in its group (0 to ``len(members) - 1``)."""
        return self.members.index(self.rank * self.towers + self.tower)

    def label(self, index=None):
        """``'group 2 of 4 (towers 2, 3)'`` for group ``index`` (default: this member's)."""
        index = self.index if index is None else index
        members = self.groups[index]
        return 'group %d of %d (%s %s)' % (
            index + 1, len(self.groups), 'tower' if len(members) == 1 else
            'global towers' if self.workers > 1 else 'towers', ', '.join(map(str, members)))

    def local_labels(self):
        """``{tower index in this graph: label of its group}``."""
        group_of = {m: g for g, members in enumerate(self.groups) for m in members}
        return {t: self.label(group_of[self.rank * self.towers + t])
                for t in range(self.towers)}

    def main_needs_worker0(self):
        """Whether some worker's main tower (this member's tower index) is outside worker 0's
        main tower's group: its moving statistics then come from worker 0's group.
        """
        group_of = {m: g for g, members in enumerate(self.groups) for m in members}
        return len({group_of[w * self.towers + self.tower] for w in range(self.workers)}) > 1


def sync_groups(options, towers, workers):
    """The sync groups of ``towers * workers`` global towers, from ``options.group_size``.

    Args:
      options: the call's :class:`~tf1_syncbn._core.options.Options`.
      towers: towers per worker.
      workers: the number of workers.

    Returns:
      A tuple of sorted tuples of global tower indices, one per group.

    An int ``group_size`` with one tower in all (one device, one worker) is
    that tower's group, whatever its size: the script runs as written, its
    statistics those of the tower's batch. Explicit groups must name exactly
    the towers that exist, with one tower too (``[[0]]``).

    Raises:
      ValueError: with more than one tower, an int ``group_size`` that does not
        divide the towers; explicit groups that do not cover every tower once.
    """
    spec, name, total = options.group_size, options.arg('group_size'), towers * workers
    where = ('%d towers' % total if workers == 1 else
             '%d towers (%d per worker x %d workers)' % (total, towers, workers))
    if spec is None:
        return (tuple(range(total)),)
    if isinstance(spec, int):
        if total == 1:
            # One tower in all (a one-device debug run of a script written for
            # groups): its group is itself, whose batch is the group's batch.
            return ((0,),)
        if total % spec:
            raise options.error(
                '%s=%d does not divide the %s of its sync group: groups are consecutive global '
                "towers (worker w's tower t is w * %d + t), %d in each. Pass a %s that divides "
                '%d (one of %s; %d synchronizes every tower), or explicit groups (a list of '
                'lists of global tower indices).'
                % (name, spec, where, towers, spec, name, total,
                   ', '.join(str(d) for d in range(1, total + 1) if total % d == 0), total))
        return tuple(tuple(range(start, start + spec)) for start in range(0, total, spec))
    covered = sorted(m for members in spec for m in members)
    if covered != list(range(total)):
        unknown = sorted(set(covered) - set(range(total)))
        missing = sorted(set(range(total)) - set(covered))
        raise options.error(
            '%s=%r must put each of the %s (global indices 0 to %d) in exactly one group%s%s%s.'
            % (name, [list(m) for m in spec], where, total - 1,
               '; no group holds %s' % ', '.join(map(str, missing)) if missing else '',
               '; there is no tower %s' % ', '.join(map(str, unknown)) if unknown else '',
               _HOW_TOWERS_ARE_COUNTED if unknown and workers == 1 else ''))
    return tuple(sorted(spec))


#: What explicit groups that name more towers than the layer sees add to their refusal.
_HOW_TOWERS_ARE_COUNTED = (
    '. The layer counts the towers it can name: those of a tower context '
    '(tower.TowerContext, tower.call_for_each_tower, a harness it reads), or, with '
    'num_dev=<number of towers>, tower i built under a name scope tower_<i>. If this graph '
    'builds more towers, build them one of these ways')


def find_sync_group(options, site, backend):
    """This member's :class:`SyncGroup`, or None when its group is every tower of every worker.

    Raises:
      ValueError: see :func:`sync_groups`; and a group across workers whose
        rank the backend does not know, a backend that cannot build the
        groups (Horovod across processes), or a ``tf.distribute`` strategy.
    """
    if options.group_size is None:
        return None
    total = backend.num_members(site.towers)
    workers = max(total // site.towers, 1)
    groups = sync_groups(options, site.towers, workers)
    if len(groups) == 1:
        return None
    if site.replicated_updates and site.workers > 1:
        # One worker: the strategy keeps replica 0's updates (ONLY_FIRST_REPLICA),
        # so the moving statistics follow replica 0's group, as the rule says.
        raise options.error(
            '%s=%r under %r: sync groups are not supported with multi-worker tf.distribute '
            "strategies, whose workers each keep their first replica's moving statistics. "
            'Leave %s unset (every replica synchronizes), or run the workers with '
            'tf1_syncbn.distributed and tower.call_for_each_tower, where groups span workers.'
            % (options.arg('group_size'), options.group_size, site.ctx,
               options.arg('group_size')))
    rank = backend.worker_rank()
    if rank is None:
        raise options.error(
            '%s=%r with %r: sync groups number the towers of every worker globally (worker '
            "w's tower t is w * %d + t), which needs this worker's rank. Pass "
            'CollectiveBackend(num_workers=%d, rank=<this worker\'s rank>), or cluster.backend() '
            'from tf1_syncbn.distributed.'
            % (options.arg('group_size'), options.group_size, backend, site.towers, workers))
    check = getattr(backend, 'check_groups', None)
    if check is not None:
        check(options.layer, groups, site.towers)
    me = rank * site.towers + site.index
    index = [g for g, members in enumerate(groups) if me in members][0]
    return SyncGroup(groups, index, site.towers, workers, rank, site.index)


def _is_auto(spec):
    return isinstance(spec, str) and spec.lower() == 'auto'


def choose_backend(options, site, device):
    """The backend that synchronizes a training call of ``group`` on ``device``, or None.

    Returns:
      A :class:`~tf1_syncbn.SyncBackend`, or None for this tower's statistics
      alone (``sync_statistics=None``, one tower, or ``'auto'`` in tower 0 of
      a name scope without ``num_dev``: one tower so far, since any higher
      tower refuses, see below).

    Raises:
      ValueError: when the number of towers is unknown (no tower context and
        no ``num_dev``) and ``sync_statistics`` names a backend, or is
        ``'auto'`` in a name scope of a tower above 0 (``tower_1``): the layer
        never falls back to per-tower statistics, not even with a warning.
    """
    spec = options.sync_statistics
    if spec is None:
        return None
    if site.towers is None:
        # A name scope says "tower <i>", but nothing says how many towers.
        if not _is_auto(spec):
            raise _unknown_group_error(options, spec)
        if site.index == 0:
            # Alone, tower 0 is one tower; the graph of several never builds:
            # tower 1 (any tower above 0) refuses here.
            return None
        raise options.error(
            "%s='auto' cannot tell the layer's group: its name scope %r looks like tower %d "
            'of a multi-tower graph, but nothing says how many towers there are, and the '
            "layer does not normalize with this tower's statistics alone instead. Pass "
            '%s=<number of towers in this graph> to synchronize the towers (tower i under a '
            'name scope tower_<i>, tower<i> or clone_<i>), or build them in '
            'tower.TowerContext / tower.call_for_each_tower; or pass %s=None to keep '
            'per-tower statistics on purpose.'
            % (options.arg('sync_statistics'), full_name_scope(), site.index,
               options.arg('num_dev'), options.arg('sync_statistics')))
    backend = backends.resolve(spec, options.layer, device, site.towers * site.workers,
                               site.workers)
    if backend is None:
        return None
    if site.replicated_updates and \
            backend.num_members(site.towers) != site.towers * site.workers:
        # A tf.distribute strategy knows how many members the group has.
        raise options.error(
            '%s=%r synchronizes %d members, but %r has %d towers in all (%d per worker x %d '
            'workers). Pass sync_statistics=\'auto\' or CollectiveBackend(num_workers=%d).'
            % (options.arg('sync_statistics'), backend, backend.num_members(site.towers),
               site.ctx, site.towers * site.workers, site.towers, site.workers,
               site.workers))
    if site.ctx is None and options.num_dev is None and not backend.implicit_single_tower:
        raise _unknown_group_error(options, spec)
    return backend


def _unknown_group_error(options, spec):
    return options.error(
        '%s=%r asks for synchronized statistics, but the layer cannot tell how many towers '
        'synchronize: it is built outside any tower context (name scope %r) and %s is not '
        "given. Build the towers in tower.TowerContext / tower.call_for_each_tower (or "
        "tensorpack's trainers, or a tf.distribute strategy's run()), or pass "
        '%s=<number of towers in this graph> (1 for one tower) and build tower i under a name '
        'scope tower<i>, tower_<i> or clone_<i> (or a pattern added with '
        'tower.register_tower_pattern).'
        % (options.arg('sync_statistics'), spec, full_name_scope(), options.arg('num_dev'),
           options.arg('num_dev')))


def check_untowered_copies(options, site, variable, output, hand_written=False):
    """Raises when copies of one layer train on several devices outside any tower.

    A tower loop the layer cannot see (``for i: with tf.device('/gpu:%d' % i),
    tf.variable_scope('', reuse=i > 0):``, or under an unregistered ``gpu_<i>``
    name scope, without ``num_dev``) gives every copy a group of one: each
    would normalize with its own device's batch. The graph shows it: one
    layer's variables trained by copies on several devices. The graph's
    :class:`~tf1_syncbn._sync.registry.CallRegistry` keeps the devices of each
    layer's training copies outside any tower; from the second device on, the
    call raises at graph build, whatever its ``sync_statistics`` but None
    (``'auto'`` included: a warning followed by per-device statistics would be
    a silent fallback). Copies on one device (one layer applied to several
    inputs), inference copies, copies without a device, ``num_dev`` (``1``:
    one tower split across devices on purpose) and ``sync_statistics=None``
    (per-device statistics on purpose) say nothing.

    A hand-written layer's :func:`tf1_syncbn.moments` call has no variables of
    its own: its copies are the training calls under one variable scope with
    one name (the scope the call enters, ``bn/moments``), which a tower loop
    gives every copy of a layer whose variables it shares (``reuse``), while
    their name scopes differ (``bn``, ``bn_1``).

    Args:
      options: the call's :class:`~tf1_syncbn._core.options.Options`.
      site: the call's :class:`CallSite`.
      variable: what names the layer in every copy: the name of its moving
        mean (of the variable a custom getter received,
        :func:`tf1_syncbn._core.variables.variable_name`), or with
        ``hand_written``, the variable scope of the ``moments`` call.
      output: a tensor the call built, whose device is the copy's.
      hand_written: the call is :func:`tf1_syncbn.moments` (or
        ``weighted_moments``) in a hand-written layer.

    Raises:
      ValueError: from the second device on, naming the devices and the fix.
    """
    if options.sync_statistics is None or options.is_training is False or \
            site.ctx is not None or options.num_dev is not None or site.towers != 1:
        return
    device = canonical_device(output.op.device)
    if not device:
        return
    registry = get_registry()
    key = 'tf1_syncbn.moments:%s' % variable if hand_written else variable
    devices = registry.untowered_copy_devices(key, device)
    if len(devices) > 1:
        num_dev = options.arg('num_dev')
        if hand_written:
            what = ("its calls under the variable scope %r (one hand-written layer's copies) "
                    'are built for training on %d devices (%s)'
                    % (variable, len(devices), ', '.join(devices)))
            fix = 'tf1_syncbn.moments(..., %s=<number of towers>)' % num_dev
        else:
            what = ('its variables (%s, ...) are used in training by copies on %d devices (%s)'
                    % (variable, len(devices), ', '.join(devices)))
            fix = '%s=<number of towers>' % num_dev
        raise options.error(
            '%s, none of them in a tower it can name (no tower context, no tower name scope, '
            "no %s; this copy: name scope %r), so each copy would normalize with its own "
            "device's batch alone. To synchronize the copies as towers, pass %s and build "
            'tower i under a name scope tower_<i> (or register your convention, e.g. '
            "tower.register_tower_pattern(r'gpu_([0-9]+)') for gpu_<i>), or build the "
            'towers in tower.TowerContext / tower.call_for_each_tower. If the copies are one '
            'tower on purpose (one model split across devices), pass %s=1; to keep '
            'per-device statistics on purpose, %s=None.'
            % (what, num_dev, full_name_scope(), fix, num_dev, options.arg('sync_statistics')))
    registry.add_untowered_copy(key, device)

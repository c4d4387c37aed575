"""Per-graph record of the synchronized calls the towers built.

* Every layer call in a tower gets a name that is the same in every tower
  (:meth:`CallRegistry.call_name`): its scope without tower prefixes, plus a
  per-tower call index. Keys of collectives and shared names derive from it.
* Synchronized calls are registered per tower (:meth:`CallRegistry.register`),
  which catches conflicts at graph build (two towers on one device, mixed
  backends, a key collision), and are checked for towers that never built
  them: when every tower of a ``TowerContext`` group has been built
  (:meth:`CallRegistry.on_tower_exit`) and, for harnesses that never say when
  their last tower is built, at run time (:mod:`tf1_syncbn._sync.guards`), from
  the verdict of :meth:`CallRegistry.run_time_verdict`, which the registry
  keeps current in the graph through its listeners.

The registry lives on its graph (:mod:`tf1_syncbn._graph.cache`), shared by the
graph's ``tf.cond`` branches; it checks the towers when they exit through
the tower contexts' exit hooks (:mod:`tower.graph_state`).
"""

import collections

from tf1_syncbn.backends import stable_hash
from tower import strip_tower_prefix
from tf1_syncbn._graph.cache import graph_cache
from tower.graph_state import get_graph_state

__all__ = ['CallRegistry', 'get_registry', 'base_name']


class _Member(collections.namedtuple('_Member', ['device', 'backend', 'layer', 'num_members'])):
    pass


class CallRegistry(object):
    """What the towers of one graph built: call names and synchronized members.

    Attributes:
      listeners: callables run after every registration that changes
        :meth:`run_time_verdict` (the run-time checks of :mod:`tf1_syncbn._sync.guards`).
    """

    #: Incomplete groups a run-time message names (then: "and N more").
    MESSAGE_GROUPS = 3

    def __init__(self):
        self._call_counts = collections.defaultdict(int)  # (towers, tower, base) -> calls
        self._members = {}          # call name -> {tower index: _Member}
        self._totals = {}           # call name -> number of towers expected
        self._labels = {}           # call name -> {tower index: its sync group}, with groups
        self._hashes = {}           # stable hash -> call name
        self._exited = collections.defaultdict(set)   # total -> tower indices exited
        self._pending = collections.defaultdict(set)  # total -> call names to check
        self._incomplete = {}       # call names some tower has not built yet, in order
        self._unnamed = collections.defaultdict(list)  # layer key -> devices of untowered copies
        self.listeners = []

    def call_name(self, towers, tower_index, base):
        """The name of this call of ``base``, the same in every tower.

        Args:
          towers: the number of towers of the group (None when unknown).
          tower_index: this tower's index.
          base: the layer's scope with tower prefixes stripped.

        Returns:
          ``'<base>:<k>'`` for the ``k``-th call of ``base`` in this tower.
        """
        slot = (towers, tower_index, base)
        index = self._call_counts[slot]
        self._call_counts[slot] += 1
        return '%s:%d' % (base, index)

    def register(self, key, tower_index, total, backend, track, labels=None):
        """Records that ``tower_index`` builds ``key``; raises on conflicts.

        Args:
          key: the call's :class:`~tf1_syncbn.SyncKey`.
          tower_index: this tower's index.
          total: the number of towers of this graph in the group.
          backend: the call's backend.
          track: also check the group when its ``TowerContext`` towers exit.
          labels: with sync groups (``group_size``), ``{tower index: its group}``
            (``'group 2 of 2 (towers 2, 3)'``), which messages about missing
            towers name.

        Raises:
          ValueError: a key collision, a tower building one call twice, mixed
            backends, or two members on one device.
        """
        h = stable_hash(key.name)
        other = self._hashes.setdefault(h, key.name)
        if other != key.name:
            raise ValueError('%s: the synchronization key of %r collides with %r. Rename one '
                             'of the two layers (give it another scope).'
                             % (key.layer, key.name, other))
        members = self._members.setdefault(key.name, {})
        if tower_index in members:
            raise ValueError(
                '%s: tower %d builds the synchronized layer %r twice under the same key. '
                'Build each tower once per TowerContext, or give the towers distinct indices.'
                % (key.layer, tower_index, key.name))
        previous = self._labels.get(key.name)
        if members and previous != (labels or None):
            index = sorted(members)[0]
            raise ValueError(
                '%s: tower %d builds %r in %s, but tower %d built it in %s. Every tower must '
                'build the layer with the same group_size.'
                % (key.layer, tower_index, key.name,
                   'sync %s' % labels[tower_index] if labels else 'one group of every tower',
                   index, 'sync %s' % previous[index] if previous else
                   'one group of every tower'))
        for index, member in members.items():
            if type(member.backend) is not type(backend):
                raise ValueError(
                    '%s: tower %d synchronizes %r with %r but tower %d uses %r. Every tower '
                    'must use the same backend; pass sync_statistics explicitly.'
                    % (key.layer, tower_index, key.name, backend, index, member.backend))
            # (A tower alone in its sync group joins no all-reduce.)
            if key.device and member.device == key.device and key.num_members > 1 and \
                    member.num_members > 1:
                raise ValueError(
                    '%s: towers %d and %d are both on device %s. Two members of one '
                    'all-reduce on one device would abort the process; place each tower on '
                    'its own device.' % (key.layer, index, tower_index, key.device))
        members[tower_index] = _Member(key.device, backend, key.layer, key.num_members)
        self._totals[key.name] = total
        self._labels[key.name] = labels or None
        if track:
            self._pending[total].add(key.name)
        was_incomplete = bool(self._incomplete)
        if len(members) < total:
            self._incomplete[key.name] = True
        else:
            self._incomplete.pop(key.name, None)
        if was_incomplete or self._incomplete:
            for listener in self.listeners:
                listener()

    def untowered_copy_devices(self, variable, device):
        """The devices of a layer's training copies outside any tower, ``device`` included.

        A layer whose variables are used in training by copies on several
        devices, none of them in a tower the layer can name (no tower context,
        no tower name scope, no ``num_dev``), would normalize each copy alone:
        an unnamed tower loop. Nothing is recorded here (see
        :meth:`add_untowered_copy`), so that a call that raises leaves no trace.

        Args:
          variable: what names the layer in every copy: the name of its
            moving-mean variable (a ``tf1_syncbn.moments`` call: a key made of
            its variable scope, see
            :func:`tf1_syncbn._sync.group.check_untowered_copies`).
          device: the canonical device of this copy.

        Returns:
          The distinct devices, in the order they were first seen.
        """
        devices = self._unnamed.get(variable, [])
        return list(devices) if device in devices else devices + [device]

    def add_untowered_copy(self, variable, device):
        """Records a training copy of ``variable``'s layer outside any tower on ``device``."""
        devices = self._unnamed[variable]
        if device not in devices:
            devices.append(device)

    def missing_towers(self, names=None):
        """Descriptions of the synchronized calls that some tower never built.

        Args:
          names: the call names to check (default: every registered one).

        Returns:
          A list of strings, empty when every group is complete.
        """
        problems = []
        for name in sorted(self._members if names is None else names):
            members, total = self._members[name], self._totals[name]
            missing = sorted(set(range(total)) - set(members))
            if missing:
                built = sorted(members)
                labels = self._labels.get(name) or {}
                problems.append('%s (a group of %d towers: built by tower%s %s, never by '
                                'tower%s %s)' % (
                                    members[built[0]].layer, total,
                                    's' if len(built) > 1 else '', ', '.join(map(str, built)),
                                    's' if len(missing) > 1 else '',
                                    ', '.join('%d in sync %s' % (t, labels[t]) if t in labels
                                              else str(t) for t in missing)))
        return problems

    def run_time_verdict(self):
        """What the run-time check says now: ``(complete, message)``.

        Kept incrementally (no scan of every call): ``message`` names the
        first :attr:`MESSAGE_GROUPS` incomplete groups, in the order they were
        built, and how many more there are; it is ``''`` when every group is
        complete.
        """
        if not self._incomplete:
            return True, ''
        names = []
        for name in self._incomplete:
            names.append(name)
            if len(names) == self.MESSAGE_GROUPS:
                break
        more = len(self._incomplete) - len(names)
        return False, (
            'tf1_syncbn: some towers of a synchronized group were never built, so the '
            'all-reduce of these layers would wait for them until the collective timeout: '
            '%s%s. Build every tower of the group, or give the tower context total (or '
            'num_dev) the number of towers you build.' % (
                '; '.join(self.missing_towers(names)),
                ' and %d more group%s' % (more, 's' if more > 1 else '') if more else ''))

    def on_tower_exit(self, ctx):
        """Once every tower of a ``TowerContext`` group has been built, checks they match.

        Raises:
          ValueError: naming the layers and towers, when some tower of the
            group did not build a synchronized call that another one built.
        """
        exited = self._exited[ctx.total]
        exited.add(ctx.index)
        if len(exited) < ctx.total:
            return
        exited.clear()
        pending, self._pending[ctx.total] = self._pending[ctx.total], set()
        problems = self.missing_towers(pending)
        if problems:
            raise ValueError(
                'Towers built different synchronized batch-norm layers; the all-reduce of '
                'these layers would wait forever: %s. Every tower of a sync group must '
                'build the same synchronized layers the same number of times.'
                % '; '.join(problems))


def get_registry(graph=None):
    """The :class:`CallRegistry` of ``graph``'s root graph (default: the current graph)."""
    def create():
        registry = CallRegistry()
        get_graph_state(graph).tower_exit_hooks.append(registry.on_tower_exit)
        return registry

    return graph_cache(graph).slot('tf1_syncbn.registry', create)


def base_name(layer_scope, ctx):
    """The layer's scope without tower prefixes: the same in every tower."""
    return strip_tower_prefix(layer_scope, ctx) or layer_scope

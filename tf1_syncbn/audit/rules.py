"""The audit's rules, :data:`RULES`, and :func:`audit_graph`, which applies them.

:func:`audit_graph` finds the graph's batch-norm layers
(:mod:`tf1_syncbn.audit.layers`, on the graph flattened by
:mod:`tf1_syncbn.audit.graph`), gathers each layer's
:class:`~tf1_syncbn.audit.facts.LayerFacts` (:mod:`tf1_syncbn.audit.facts`)
and applies every rule of :data:`RULES` to them, in order. A rule is a small
function of a layer's facts that returns its findings: :class:`Problem`
strings (the audit fails) and :class:`Note` strings (information only). To
add a check, write one such function and add it to :data:`RULES`.

The problems:

* :func:`unsynchronized_towers`: a layer built in more than one tower that
  normalizes each tower with its own batch's statistics, or synchronizes
  only some towers, or over a group smaller than its towers;
* :func:`disagreeing_sync_groups`: with sync groups (the layers'
  ``group_size``), towers that disagree on the groups: a tower in two groups,
  a group's sizes that differ, a group with members that never come;
* :func:`untowered_copies`: a layer trained by copies on several devices
  that no tower name tells apart (an unnamed tower loop:
  ``tf.device('/gpu:%d' % i)`` without ``tower_<i>`` scopes, or an
  unregistered convention), none synchronized;
* :func:`updates_not_run`: moving-average updates that do not run when the
  train op runs (reachable from it through data or control edges, the
  layer's own output included: ``updates_collections=None``);
* :func:`updates_of_several_towers`: a moving variable assigned by the
  update ops of more than one tower in one step;

and the notes: :func:`several_inputs` (a layer applied to several inputs in
one step), :func:`frozen_in_training_tower` (inference-mode copies in a
training tower), :func:`updates_never_built`. The report is an
:class:`~tf1_syncbn.audit.report.AuditReport`. The command line is
:mod:`tf1_syncbn.audit`.
"""

import re

import tensorflow as tf

from tf1_syncbn.audit import report as report_lib
from tf1_syncbn.audit.facts import graph_facts, layer_facts, towers_of, unique_towers
from tf1_syncbn.audit.graph import GraphIndex
from tower import harness

__all__ = ['audit_graph', 'RULES', 'Problem', 'Note']


class Problem(str):
    """A rule's finding that fails the audit (it names the layer and the fix)."""


class Note(str):
    """A rule's finding for information only."""


_UPDATE_FIX = ('Run them in the same step: build the train op under '
               'tf.control_dependencies(tf.compat.v1.get_collection('
               'tf.compat.v1.GraphKeys.UPDATE_OPS)) (Keras layers: their layer.updates), '
               'fetch them with the train op, or (slim) build the layer with '
               'updates_collections=None.')


def _some(names, shown=3):
    names = list(names)
    more = len(names) - shown
    return ', '.join(names[:shown]) + (', and %d more' % more if more > 0 else '')


def unsynchronized_towers(layer):
    """Problem: training towers that do not all-reduce together, over every tower."""
    key, towers, synced = layer.key, layer.training_towers, layer.synced_towers
    sizes, backends = layer.group_sizes, layer.backends
    if len(towers) < 2 or len(layer.sync_groups) > 1:    # groups: disagreeing_sync_groups
        return []
    listed = report_lib.format_towers(towers)
    if not synced:
        layers = ('tf1_syncbn.sync_batch_norm as the normalizer_fn (slim; '
                  'tf_slim.nets built inside tf1_syncbn.sync_arg_scope()), '
                  'tf1_syncbn.patch_tf_layers() or tf1_syncbn.layers (tf.layers), '
                  'tf1_syncbn.keras.patch_keras() (Keras), tf1_syncbn.BatchNorm or '
                  'tf1_syncbn.patch_tensorpack() (tensorpack)')
        if layer.computation == 'tf1_syncbn':
            # The graph does not say why: sync_statistics=None (tensorpack's default),
            # or towers the layer could not count (built before it refused that).
            return [Problem(
                '%s: built in %d towers (%s) but normalizes each tower with its own batch\'s '
                'statistics (no all-reduce). %s synchronizes the towers it can count, unless '
                'its sync_statistics is None: pass %s where no tower context gives the number '
                'of towers (tower_<i> / clone_<i> name scopes, or a convention registered '
                "with tower.register_tower_pattern), and sync_statistics='auto' (or a "
                'backend) where it is None%s.'
                % (key, len(towers), listed,
                   'tf1_syncbn.moments' if layer.hand_written else "tf1_syncbn's layer",
                   _num_dev(layer, len(towers)),
                   '' if layer.hand_written else
                   " (tensorpack's default, which tf1_syncbn.BatchNorm / BatchRenorm and "
                   'patch_tensorpack keep)'))]
        if layer.computation == 'moments':
            # tf.nn.moments: a batch norm written by hand, or a library's non-fused
            # layer (tf.layers, slim, Keras with fused=False): the graph cannot tell.
            fix = ('Synchronize it: written by hand, replace its tf.nn.moments by '
                   'tf1_syncbn.moments (docs/hand-written.md); a library\'s layer, use ' + layers)
        else:
            fix = 'Synchronize it: ' + layers
        return [Problem(
            '%s: built in %d towers (%s) but normalizes each tower with its own batch\'s '
            'statistics (no all-reduce). %s; add num_dev=%d where no tower context gives '
            'the number of towers (tower_<i> / clone_<i> loops).'
            % (key, len(towers), listed, fix, len(towers)))]
    unsynced = [t for t in towers if t not in synced]
    if unsynced:
        return [Problem(
            '%s: synchronized in %s but not in %s: the all-reduce waits for towers '
            'that never join it, and the others normalize alone. Build the layer with the '
            'same sync_statistics in every tower.'
            % (key, report_lib.format_towers(synced), report_lib.format_towers(unsynced)))]
    if sizes and min(sizes) < len(towers):
        return [Problem(
            '%s: synchronized over a group of %d (%s all-reduce) but built in %d towers '
            '(%s), so each all-reduce covers part of the global batch. Make the group span '
            'every tower: build the towers with call_for_each_tower or '
            'TowerContext(total=%d), pass num_dev=%d for name-scope towers, or use a '
            'backend whose num_members() counts every tower.'
            % (key, min(sizes), '/'.join(sorted(backends)) or 'an', len(towers), listed,
               len(towers), len(towers)))]
    return []


def disagreeing_sync_groups(layer):
    """Problem: sync groups whose towers disagree (a tower in two, sizes, missing members).

    Each group is checked on its own. Towers on other workers (``/job:``
    devices) may complete a group, so a group with fewer towers here than its
    size is flagged only in a graph of one process.
    """
    groups, key = layer.sync_groups, layer.key
    if len(groups) < 2:
        return []
    problems = []
    seen = {}
    multi_process = any('/job:' in (i.device or '') for i in layer.in_step)
    for number, (towers, sizes) in enumerate(groups, 1):
        label = 'sync group %d of %d (%s)' % (number, len(groups),
                                             report_lib.format_towers(towers))
        twice = [t for t in towers if t in seen]
        if twice:
            problems.append(Problem(
                '%s: %s also all-reduces in sync group %d: its towers disagree on the groups. '
                'Build the layer with the same group_size in every tower.'
                % (key, report_lib.format_towers(twice), seen[twice[0]])))
        for tower in towers:
            seen.setdefault(tower, number)
        if len(sizes) > 1:
            problems.append(Problem(
                '%s: the towers of %s disagree on its size (%s). Build the layer with the '
                'same group_size in every tower.'
                % (key, label, ', '.join(str(n) for n in sorted(sizes)))))
        elif sizes and not multi_process and min(sizes) != len(towers):
            problems.append(Problem(
                '%s: %s all-reduces over %d members but %s of this graph join%s it, so its '
                'all-reduce waits for towers that never come. Build the layer with the same '
                'group_size in every tower.'
                % (key, label, min(sizes), '1 tower' if len(towers) == 1 else
                   '%d towers' % len(towers), 's' if len(towers) == 1 else '')))
    return problems


def untowered_copies(layer):
    """Problem: copies that no tower name tells apart, trained on several devices, none synced.

    A tower loop that neither the layer nor the audit can see (no tower name
    scope, or an unregistered one, and no tower context): every copy had a
    group of one. Where the copies' name scopes follow a convention
    (``gpu0``, ``gpu_1``, ``GPU-2``), the advice gives the pattern that
    matches them.
    """
    problems = []
    for tower, copies in layer.untowered.items():
        towers = '<number of towers>'
        if layer.computation == 'tf1_syncbn':
            fix = "Pass %s (and sync_statistics='auto'%s where it is None)" % (
                _num_dev(layer, towers), ', its default,' if layer.hand_written else
                ' or a backend')
        elif layer.computation == 'moments':
            fix = ("With tf1_syncbn.moments in place of its tf.nn.moments (written by hand, "
                   "docs/hand-written.md) or tf1_syncbn's layers (a library's layer: " +
                   _LAYERS + '), pass num_dev=%s' % towers)
        else:
            fix = "With tf1_syncbn's layers (%s), pass num_dev=%s" % (_LAYERS, towers)
        scopes = sorted(s for found in copies.values() for s in found)
        pattern = _tower_pattern(scopes)
        if pattern is None:
            convention = ("e.g. tower.register_tower_pattern(r'gpu_([0-9]+)') for gpu_<i> name "
                          'scopes, and audit with tower_patterns / --tower-pattern')
        else:
            names = sorted({part for s in scopes for part in s.split('/')
                            if re.fullmatch(pattern, part)}, key=report_lib.tower_sort_key)
            convention = ("tower.register_tower_pattern(r'%s') for these %s name scopes, and "
                          "audit with tower_patterns=[r'%s'] / --tower-pattern '%s'"
                          % (pattern, _some(names, 2), pattern, pattern))
        problems.append(Problem(
            '%s: trained by copies on %d devices (%s) that no tower name tells apart (%s%s), '
            "each normalizing with its own device's batch (no all-reduce): a tower loop the "
            'layer cannot see. %s and build tower i under a name scope tower_<i> (or '
            'register your convention: %s), or build the towers in tower.TowerContext / '
            'tower.call_for_each_tower. (A model split across devices on purpose, one tower, '
            'shows the same way.)'
            % (layer.key, len(copies), ', '.join(sorted(copies)), _some(scopes),
               ' in ' + tower if tower else '', fix, convention)))
    return problems


#: The layers of tf1_syncbn and the switches, for code that uses another library's.
_LAYERS = ('sync_batch_norm, tf1_syncbn.layers, tf1_syncbn.keras, BatchNorm, or the patches '
           'patch_tf_layers(), keras.patch_keras(), patch_tensorpack()')

#: A name-scope component made of a text around a number (its last one): the tower index.
_NUMBERED = re.compile(r'(.*?)([0-9]+)([^0-9]*)')


def _num_dev(layer, towers):
    """``num_dev=<towers>`` as the layer takes it (``tf1_syncbn.moments(..., num_dev=N)``)."""
    if layer.hand_written:
        return 'tf1_syncbn.moments(..., num_dev=%s)' % towers
    return 'num_dev=%s' % towers


def _tower_pattern(scopes):
    r"""A tower pattern that names the copies of a layer by their name scopes, or None.

    The first path component above the layer's own (the last) in which the
    scopes differ, when each holds the same text around a different number
    (``gpu0`` / ``gpu1``: ``r'gpu([0-9]+)'``; ``GPU-0``: ``r'GPU\-([0-9]+)'``).
    The pattern, one group for the index as :func:`tower.register_tower_pattern`
    takes it, is checked to match every copy's component.

    Args:
      scopes: the copies' full name scopes (``gpu0/bn``, ``gpu1/bn``).

    Returns:
      The pattern, a string, or None (the copies' scopes name no towers:
      ``bn``, ``bn_1``).
    """
    parts = [scope.split('/')[:-1] for scope in scopes]
    for components in zip(*parts):
        if len(set(components)) < 2:
            continue
        found = [_NUMBERED.fullmatch(c) for c in components]
        if None in found or len({(m.group(1), m.group(3)) for m in found}) > 1 or \
                len({int(m.group(2)) for m in found}) < len(found):
            continue
        pattern = re.escape(found[0].group(1)) + '([0-9]+)' + re.escape(found[0].group(3))
        matched = [re.fullmatch(pattern, c) for c in components]
        if all(m is not None and m.group(1) == n.group(2) for m, n in zip(matched, found)):
            return pattern
    return None


def updates_not_run(layer):
    """Problem: statistics none of whose updates the step runs (they never move)."""
    if not layer.step_updates or not layer.unreached_statistics:
        return []
    built = sorted(u.name for node, _ in layer.moving
                   for u in layer.graph.updates.get(node.key, []))
    return [Problem(
        '%s: its moving-average updates (%s) do not run when the train op runs, so %s '
        'never move from their initial values, and inference uses those. %s'
        % (layer.key, _some(built), ' and '.join(layer.unreached_statistics), _UPDATE_FIX))]


def updates_of_several_towers(layer):
    """Problem: a moving variable assigned by the update ops of several towers in one step."""
    if not layer.step_updates:
        return []
    problems = []
    for node, stat, names in layer.reached_updates:
        towers = towers_of(names, layer.graph.patterns)
        if len(names) < 2 or len(towers) < 2:
            continue
        problems.append(Problem(
            '%s: %s (%s) is assigned by update ops of %d towers (%s) in one step (%s), so '
            'it moves once per tower per step. Run one tower\'s update ops '
            '(tf.compat.v1.get_collection(UPDATE_OPS, <one tower\'s scope>)), or use '
            'tf1_syncbn\'s layers, which build the updates once and share them with every '
            'tower.' % (layer.key, stat, node.name, len(towers), report_lib.format_towers(towers),
                        _some(names))))
    return problems


def several_inputs(layer):
    """Note: a layer applied to several inputs of one tower in one step (a Siamese network).

    Not where its copies are an unnamed tower loop (:func:`untowered_copies`).
    """
    if not layer.step_updates or layer.untowered:
        return []
    first = min(stat for _, stat in layer.moving)
    notes = []
    for node, stat, names in layer.reached_updates:
        towers = towers_of(names, layer.graph.patterns)
        if len(names) < 2 or len(towers) > 1 or stat != first:
            continue
        tower = towers[0] if towers else ''
        notes.append(Note(
            '%s: applied to %d inputs in one step (%s), each call updating the moving '
            'statistics, so they move %d times per step, as the layer does on one device '
            '(a Siamese network, two views, micro-batches). Each call normalizes with its '
            'input\'s own statistics (over every tower when synchronized).'
            % (layer.key, len(names), _some(sorted(i.scope for i in layer.training
                                                   if i.tower == tower)), len(names))))
    return notes


def frozen_in_training_tower(layer):
    """Note: copies that normalize with the moving statistics in a tower that trains."""
    frozen = layer.frozen_towers
    if not frozen:
        return []
    return [Note('%s: normalizes with its moving statistics (inference mode) in '
                 'training tower%s %s: they stay frozen while the tower trains. Fine '
                 'when fine-tuning with frozen batch norm; else build it with '
                 'is_training=True (training=True).'
                 % (layer.key, 's' if len(frozen) > 1 else '',
                    report_lib.format_towers(frozen)))]


def updates_never_built(layer):
    """Note: a layer that trains with batch statistics but builds no update of them."""
    if layer.update_status != report_lib.UPDATES_NONE:
        return []
    return [Note('%s: trains with batch statistics, but no op updates its moving '
                 'statistics (none was built, e.g. ema_update=\'skip\').' % layer.key)]


#: The checks, in the order their findings are reported: each takes a layer's
#: :class:`~tf1_syncbn.audit.facts.LayerFacts` and returns a list of
#: :class:`Problem` and :class:`Note` strings.
RULES = (
    unsynchronized_towers,
    disagreeing_sync_groups,
    untowered_copies,
    updates_not_run,
    updates_of_several_towers,
    several_inputs,
    frozen_in_training_tower,
    updates_never_built,
)


def _synchronized(synced_towers, training_towers):
    if not synced_towers:
        return False
    return True if len(synced_towers) == len(training_towers) else None


def _layer_audit(layer, findings):
    """The report's :class:`~tf1_syncbn.audit.report.LayerAudit` of a layer's facts."""
    return report_lib.LayerAudit(
        layer.key, towers=layer.towers, training_towers=layer.training_towers,
        inference_towers=layer.inference_towers, mode=layer.mode,
        computation=layer.computation,
        synchronized=_synchronized(layer.synced_towers, layer.training_towers),
        backend='/'.join(sorted(layer.backends)) or None,
        group_size=layer.group_sizes[-1] if layer.group_sizes else None,
        groups=(tuple(towers for towers, _ in layer.sync_groups)
                if len(layer.sync_groups) > 1 else ()),
        collectives_per_step=layer.collectives_per_step,
        updates=layer.update_status, update_ops=layer.update_ops,
        moving_variables=tuple(sorted(node.name for node, _ in layer.moving)),
        devices=layer.devices,
        problems=[str(f) for f in findings if isinstance(f, Problem)],
        notes=[str(f) for f in findings if not isinstance(f, Problem)])


def _graph_def_and_train_ops(graph):
    """``(GraphDef, op names of the graph's train_op collection)``."""
    if isinstance(graph, tf.Graph):
        ops = graph.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP)
        return graph.as_graph_def(), [getattr(o, 'op', o).name for o in ops]
    if hasattr(graph, 'graph_def') and hasattr(graph, 'collection_def'):     # MetaGraphDef
        names = []
        if tf.compat.v1.GraphKeys.TRAIN_OP in graph.collection_def:
            collection = graph.collection_def[tf.compat.v1.GraphKeys.TRAIN_OP]
            names = [n.lstrip('^').split(':', 1)[0] for n in collection.node_list.value]
        return graph.graph_def, names
    if hasattr(graph, 'node') and hasattr(graph, 'library'):                  # GraphDef
        return graph, []
    raise TypeError('audit_graph: graph must be a tf.Graph, a GraphDef or a MetaGraphDef, got '
                    '%r. Pass tf.compat.v1.get_default_graph() or the MetaGraphDef that '
                    'tf.compat.v1.train.export_meta_graph() returns.' % (graph,))


def _train_op_names(train_op, graph):
    """The op names of ``train_op``: an op, tensor, name, or a list of them."""
    items = list(train_op) if isinstance(train_op, (list, tuple, set)) else [train_op]
    if not items:
        raise ValueError('audit_graph: train_op is an empty list; pass the op that one training '
                         'step runs (or None to skip the update checks).')
    names = []
    for item in items:
        op = getattr(item, 'op', item)          # a tensor or variable: its op
        if isinstance(item, str):
            names.append(item.lstrip('^').split(':', 1)[0])
        elif isinstance(op, tf.Operation):
            if isinstance(graph, tf.Graph) and op.graph is not graph:
                raise ValueError('audit_graph: train_op %r belongs to another graph than '
                                 '`graph`; pass the graph it was built in.' % op.name)
            names.append(op.name)
        else:
            raise TypeError('audit_graph: train_op must be an op, a tensor, an op name or a '
                            'list of them (what one training step runs), got %r.' % (item,))
    return names


def _patterns(extra):
    compiled = [re.compile(p) for p in harness.tower_patterns()]
    for pattern in extra or ():
        try:
            regex = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError('audit_graph: tower_patterns entry %r is not a regular expression '
                             '(%s).' % (pattern, e))
        if regex.groups != 1:
            raise ValueError('audit_graph: tower_patterns entry %r must have exactly one group '
                             '(the tower index), like r"gpu([0-9]+)".' % (pattern,))
        compiled.append(regex)
    return compiled


def audit_graph(graph, train_op=None, tower_patterns=None):
    """Audits every batch-norm layer of a training graph (see the module docstring).

    Args:
      graph: a ``tf.Graph``, a ``GraphDef`` or a ``MetaGraphDef``.
      train_op: what one training step runs: an op, a tensor, an op name, or
        a list of them (``[train_op] + update_ops`` where a harness fetches
        the update ops next to the train op, as tensorpack's ``RunUpdateOps``
        callback does). None: the graph's ``train_op`` collection if it has
        one, else the updates are not checked (a note says so).
      tower_patterns: extra regular expressions for tower name-scope
        components (one group, the index), besides ``tower<i>``,
        ``tower_<i>``, ``clone_<i>``, ``replica_<i>`` and the patterns
        registered with :func:`tower.register_tower_pattern`.

    Returns:
      An :class:`~tf1_syncbn.audit.report.AuditReport` (``.ok``,
      ``.problems``, ``.info``, ``.layers``; ``str(report)`` is a table).

    Raises:
      TypeError: ``graph`` or ``train_op`` of another type.
      ValueError: a ``train_op`` that is not an op of the graph, or a tower
        pattern that is not a regular expression with one group.
    """
    graph_def, collected = _graph_def_and_train_ops(graph)
    patterns = _patterns(tower_patterns)
    index = GraphIndex(graph_def)
    names = _train_op_names(train_op, graph) if train_op is not None else collected
    names = list(dict.fromkeys(names))
    roots = []
    for name in names:
        node = index.node(name)
        if node is None:
            raise ValueError('audit_graph: train_op %r is not an op of the graph. Pass the op '
                             'that one training step runs, or its name as the graph has it '
                             '(train_op.name).' % name)
        roots.append(node)
    found = graph_facts(index, patterns, roots)
    layers = []
    for key in sorted(found.layers):
        facts = layer_facts(key, found)
        layers.append(_layer_audit(facts, [f for rule in RULES for f in rule(facts)]))
    problems = [p for layer in layers for p in layer.problems]
    notes = [n for layer in layers for n in layer.notes]
    if found.reached is None:
        notes.append('Moving-average updates were not checked: pass train_op (what one '
                     'training step runs; --train-op NAME on the command line).')
    towers = unique_towers(i.tower for group in found.layers.values() for i in group if i.tower)
    return report_lib.AuditReport(layers, problems, notes, names, towers)

"""The audit's rules: what is a problem, and :func:`audit_graph`.

:func:`audit_graph` finds the graph's batch-norm layers
(:mod:`tf1_syncbn._audit_layers`, on the graph flattened by
:mod:`tf1_syncbn._audit_index`) and reports, per layer, as problems:

* a layer built in more than one tower that normalizes each tower with its
  own batch's statistics, or synchronizes only some towers;
* moving-average updates that do not run when the train op runs (reachable
  from it through data or control edges, the layer's own output included:
  ``updates_collections=None``);
* a moving variable assigned by more than one update op in one step;
* a synchronized layer whose all-reduce group is smaller than the towers
  that build it;
* a layer trained by copies on several devices that no tower name tells
  apart (an unnamed tower loop: ``tf.device('/gpu:%d' % i)`` without
  ``tower_<i>`` scopes, or an unregistered convention), none synchronized;

and, as notes only, inference-mode layers in a training tower. The report
is an :class:`~tf1_syncbn.audit_report.AuditReport`. The command line is
:mod:`tf1_syncbn.audit`.
"""

import collections
import re

import tensorflow as tf

from tf1_syncbn import audit_report as report_lib
from tf1_syncbn._audit_index import GraphIndex, parent_scope, tower_of
from tf1_syncbn._audit_layers import (MAIN_GROUP_STATISTICS, collective_group, collective_key,
                                      find_layers)
from tower import harness

__all__ = ['audit_graph']

_UPDATE_FIX = ('Run them in the same step: build the train op under '
               'tf.control_dependencies(tf.compat.v1.get_collection('
               'tf.compat.v1.GraphKeys.UPDATE_OPS)) (Keras layers: their layer.updates), '
               'fetch them with the train op, or (slim) build the layer with '
               'updates_collections=None.')


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


def _unique(labels):
    return tuple(sorted(set(labels), key=report_lib.tower_sort_key))


def _update_status(key, training, variables, updates, reached, index, patterns,
                   several_inputs_note=True):
    """``(status, update op names, problems, notes)`` of a layer's moving-average updates.

    ``several_inputs_note``: note a layer applied to several inputs of one
    tower (False where its copies are an unnamed tower loop, a problem).
    """
    own = [(node, stat) for k, stat, node in variables.values() if k == key]
    built = [u for node, _ in own for u in updates.get(node.key, [])]
    if not training:
        return report_lib.UPDATES_INFERENCE, (), [], []
    if not built:
        return report_lib.UPDATES_NONE, (), [], []
    names = tuple(sorted(u.name for u in built))
    if reached is None:
        return report_lib.UPDATES_NOT_CHECKED, names, [], []
    if not any(i.reached(reached) for i in training):
        return report_lib.UPDATES_OUTSIDE, names, [], []
    problems, notes = [], []
    run = [u for u in built if u.key in reached]
    stats = sorted({stat for _, stat in own})
    missing = [s for s in stats if not any(u.key in reached for node, stat in own if stat == s
                                           for u in updates.get(node.key, []))]
    if missing:
        problems.append(
            '%s: its moving-average updates (%s) do not run when the train op runs, so %s '
            'never move from their initial values, and inference uses those. %s'
            % (key, _some(names), ' and '.join(missing), _UPDATE_FIX))
    for node, stat in own:
        twice = sorted(u.name for u in updates.get(node.key, []) if u.key in reached)
        if len(twice) < 2:
            continue
        towers = _unique(tower_of(name, patterns) or '' for name in twice)
        if len(towers) > 1:
            problems.append(
                '%s: %s (%s) is assigned by update ops of %d towers (%s) in one step (%s), so '
                'it moves once per tower per step. Run one tower\'s update ops '
                '(tf.compat.v1.get_collection(UPDATE_OPS, <one tower\'s scope>)), or use '
                'tf1_syncbn\'s layers, which build the updates once and share them with every '
                'tower.' % (key, stat, node.name, len(towers), report_lib.format_towers(towers),
                            _some(twice)))
        elif stat == stats[0] and several_inputs_note:
            notes.append(
                '%s: applied to %d inputs in one step (%s), each call updating the moving '
                'statistics, so they move %d times per step, as the layer does on one device '
                '(a Siamese network, two views, micro-batches). Each call normalizes with its '
                'input\'s own statistics (over every tower when synchronized).'
                % (key, len(twice), _some(sorted(i.scope for i in training
                                                 if i.tower == (towers[0] if towers else ''))),
                   len(twice)))
    if missing:
        return report_lib.UPDATES_NOT_RUN, names, problems, notes
    scopes = {i.scope for i in training}
    inside = any(consumer.op in ('Identity', 'IdentityN') and
                 parent_scope(consumer.name) in scopes
                 for u in run for consumer, control in index.consumers(u) if control)
    return (report_lib.UPDATES_IN_LAYER if inside else report_lib.UPDATES_RUN,
            tuple(sorted(u.name for u in run)), problems, notes)


def _some(names, shown=3):
    names = list(names)
    more = len(names) - shown
    return ', '.join(names[:shown]) + (', and %d more' % more if more > 0 else '')


def _sync_problems(key, computation, towers, synced_towers, sizes, backends):
    """The problems of a layer's synchronization across the towers that train it."""
    if len(towers) < 2:
        return []
    listed = report_lib.format_towers(towers)
    if not synced_towers:
        layers = ('tf1_syncbn.sync_batch_norm as the normalizer_fn (slim; '
                  'tf_slim.nets built inside tf1_syncbn.sync_arg_scope()), '
                  'tf1_syncbn.patch_tf_layers() or tf1_syncbn.layers (tf.layers), '
                  'tf1_syncbn.keras.patch_keras() (Keras), tf1_syncbn.BatchNorm or '
                  'tf1_syncbn.patch_tensorpack() (tensorpack)')
        if computation == 'tf1_syncbn':
            fix = ("Pass sync_statistics='auto' (or a backend) instead of None")
        elif computation == 'moments':
            # tf.nn.moments: a batch norm written by hand, or a library's non-fused
            # layer (tf.layers, slim, Keras with fused=False): the graph cannot tell.
            fix = ('Synchronize it: written by hand, replace its tf.nn.moments by '
                   'tf1_syncbn.moments (docs/hand-written.md); a library\'s layer, use ' + layers)
        else:
            fix = 'Synchronize it: ' + layers
        return ['%s: built in %d towers (%s) but normalizes each tower with its own batch\'s '
                'statistics (no all-reduce). %s; add num_dev=%d where no tower context gives '
                'the number of towers (tower_<i> / clone_<i> loops).'
                % (key, len(towers), listed, fix, len(towers))]
    unsynced = [t for t in towers if t not in synced_towers]
    if unsynced:
        return ['%s: synchronized in %s but not in %s: the all-reduce waits for towers '
                'that never join it, and the others normalize alone. Build the layer with the '
                'same sync_statistics in every tower.'
                % (key, report_lib.format_towers(synced_towers),
                   report_lib.format_towers(unsynced))]
    if sizes and min(sizes) < len(towers):
        return ['%s: synchronized over a group of %d (%s all-reduce) but built in %d towers '
                '(%s), so each all-reduce covers part of the global batch. Make the group span '
                'every tower: build the towers with call_for_each_tower or '
                'TowerContext(total=%d), pass num_dev=%d for name-scope towers, or use a '
                'backend whose group_size() counts every tower.'
                % (key, min(sizes), '/'.join(sorted(backends)) or 'an', len(towers), listed,
                   len(towers), len(towers))]
    return []


def _sync_groups(in_step):
    """The sync groups of a layer's training towers: ``[(towers, group sizes)]``.

    Towers whose forward all-reduces share a group key (NCCL: a group label)
    are one group; the layers' ``group_size`` gives several. In the order of
    their first tower.
    """
    groups = collections.OrderedDict()
    for instance in in_step:
        for node in instance.collectives:
            if MAIN_GROUP_STATISTICS in node.name.split('/'):
                continue
            towers, sizes = groups.setdefault(collective_key(node), ([], set()))
            if instance.tower not in towers:
                towers.append(instance.tower)
            size = collective_group(node)[1]
            if size:
                sizes.add(size)
    return [(tuple(towers), sizes) for towers, sizes in groups.values()]


def _group_problems(key, groups, in_step):
    """Groups whose towers disagree: a tower in two groups, sizes that differ, missing members.

    Towers on other workers (``/job:`` devices) may complete a group, so a
    group with fewer towers here than its size is flagged only in a graph of
    one process.
    """
    problems = []
    seen = {}
    multi_process = any('/job:' in (i.device or '') for i in in_step)
    for number, (towers, sizes) in enumerate(groups, 1):
        label = 'sync group %d of %d (%s)' % (number, len(groups),
                                             report_lib.format_towers(towers))
        twice = [t for t in towers if t in seen]
        if twice:
            problems.append('%s: %s also all-reduces in sync group %d: its towers disagree on '
                            'the groups. Build the layer with the same group_size in every '
                            'tower.' % (key, report_lib.format_towers(twice), seen[twice[0]]))
        for tower in towers:
            seen.setdefault(tower, number)
        if len(sizes) > 1:
            problems.append('%s: the towers of %s disagree on its size (%s). Build the layer '
                            'with the same group_size in every tower.'
                            % (key, label, ', '.join(str(n) for n in sorted(sizes))))
        elif sizes and not multi_process and min(sizes) != len(towers):
            problems.append('%s: %s all-reduces over %d members but %s of this graph '
                            'join%s it, so its all-reduce waits for towers that never come. '
                            'Build the layer with the same group_size in every tower.'
                            % (key, label, min(sizes), '1 tower' if len(towers) == 1 else
                               '%d towers' % len(towers), 's' if len(towers) == 1 else ''))
    return problems


def _canonical_device(device):
    try:
        return tf.DeviceSpec.from_string(device).to_string()
    except ValueError:
        return device


def _untowered_problems(key, computation, in_step):
    """Copies that no tower name tells apart, trained on several devices, none synchronized.

    A tower loop that neither the layer nor the audit can see (no tower name
    scope, or an unregistered one, and no tower context): every copy had a
    group of one.
    """
    by_tower = {}
    for instance in in_step:
        if instance.collectives or not instance.device:
            continue
        copies = by_tower.setdefault(instance.tower, {})
        copies.setdefault(_canonical_device(instance.device), []).append(instance.scope)
    problems = []
    for tower, copies in sorted(by_tower.items()):
        if len(copies) < 2:
            continue
        if computation == 'tf1_syncbn':
            fix = 'Pass'
        else:
            fix = ("With tf1_syncbn's layers (sync_batch_norm, tf1_syncbn.layers, "
                   'tf1_syncbn.keras, BatchNorm, or the patches patch_tf_layers(), '
                   'keras.patch_keras(), patch_tensorpack()), pass')
        scopes = sorted(s for found in copies.values() for s in found)
        problems.append(
            '%s: trained by copies on %d devices (%s) that no tower name tells apart (%s%s), '
            "each normalizing with its own device's batch (no all-reduce): a tower loop the "
            'layer cannot see. %s num_dev=<number of towers> and build tower i under a '
            'name scope tower_<i> (or register your convention: '
            "tower.register_tower_pattern(r'gpu_([0-9]+)') for gpu_<i>, and audit with "
            'tower_patterns / --tower-pattern), or build the towers in tower.TowerContext / '
            'tower.call_for_each_tower. (A model split across devices on purpose, one tower, '
            'shows the same way.)'
            % (key, len(copies), ', '.join(sorted(copies)), _some(scopes),
               ' in ' + tower if tower else '', fix))
    return problems


def _synchronized(synced_towers, training_towers):
    if not synced_towers:
        return False
    return True if len(synced_towers) == len(training_towers) else None


def _layer(key, group, found):
    """The :class:`LayerAudit` of one layer from its towers' instances."""
    index, reached = found['index'], found['reached']
    training = [i for i in group if i.training]
    # With a train op, copies that the step never runs (a Keras model's own
    # graph on its keras.Input placeholders, next to the towers that call the
    # model) are not among the towers it synchronizes.
    in_step = [i for i in training if i.reached(reached)] or training
    kinds = set().union(*(i.kinds for i in group))
    computation = ('tf1_syncbn' if 'library' in kinds else 'fused' if 'fused' in kinds else
                   'moments' if 'moments' in kinds else '-')
    training_towers = _unique(i.tower for i in in_step)
    synced_towers = _unique(i.tower for i in in_step if i.collectives)
    forward = [c for i in in_step for c in i.collectives]
    described = [collective_group(c) for c in forward
                 if MAIN_GROUP_STATISTICS not in c.name.split('/')]
    backends = {b for b, _ in described}
    sizes = sorted({s for _, s in described if s})
    groups = _sync_groups(in_step)
    collectives = forward + found['backward'].get(key, [])
    untowered = _untowered_problems(key, computation, in_step)
    status, update_ops, update_problems, update_notes = _update_status(
        key, training, found['variables'], found['updates'], reached, index, found['patterns'],
        several_inputs_note=not untowered)
    mode = ('infer' if not training else
            'train+infer' if any(i.inference for i in group) else 'train')
    layer = report_lib.LayerAudit(
        key, towers=_unique(i.tower for i in group), training_towers=training_towers,
        inference_towers=_unique(i.tower for i in group if i.inference), mode=mode,
        computation=computation,
        synchronized=_synchronized(synced_towers, training_towers),
        backend='/'.join(sorted(backends)) or None, group_size=sizes[-1] if sizes else None,
        groups=tuple(towers for towers, _ in groups) if len(groups) > 1 else (),
        collectives_per_step=sum(1 for c in collectives if reached is None or c.key in reached),
        updates=status, update_ops=update_ops,
        moving_variables=tuple(sorted(n.name for k, _, n in found['variables'].values()
                                      if k == key)),
        devices=tuple(sorted({_canonical_device(i.device) for i in in_step if i.device})))
    if len(groups) > 1:      # sync groups (group_size): each group is checked on its own
        sync_problems = _group_problems(key, groups, in_step)
    else:
        sync_problems = _sync_problems(key, computation, training_towers, synced_towers, sizes,
                                       backends)
    layer.problems = sync_problems + untowered + update_problems
    layer.notes = update_notes
    return layer


def _notes(layers, by_key, reached):
    """Information only: inference-mode copies in training towers, updates never built."""
    training_towers = {i.tower for group in by_key.values() for i in group
                       if i.training and i.reached(reached)}
    notes = []
    for layer in layers:
        notes.extend(layer.notes)
        frozen = _unique(i.tower for i in by_key[layer.name]
                         if not i.training and i.tower in training_towers and
                         i.reached(reached))
        if frozen:
            notes.append('%s: normalizes with its moving statistics (inference mode) in '
                         'training tower%s %s: they stay frozen while the tower trains. Fine '
                         'when fine-tuning with frozen batch norm; else build it with '
                         'is_training=True (training=True).'
                         % (layer.name, 's' if len(frozen) > 1 else '',
                            report_lib.format_towers(frozen)))
        if layer.updates == report_lib.UPDATES_NONE:
            notes.append('%s: trains with batch statistics, but no op updates its moving '
                         'statistics (none was built, e.g. ema_update=\'skip\').' % layer.name)
    if reached is None:
        notes.append('Moving-average updates were not checked: pass train_op (what one '
                     'training step runs; --train-op NAME on the command line).')
    return notes


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
      An :class:`~tf1_syncbn.audit_report.AuditReport` (``.ok``,
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
    found = find_layers(index, patterns)
    found.update(index=index, reached=index.reachable(roots) if roots else None,
                 patterns=patterns)
    by_key, reached = found['layers'], found['reached']
    layers = [_layer(key, by_key[key], found) for key in sorted(by_key)]
    problems = [p for layer in layers for p in layer.problems]
    towers = _unique(i.tower for group in by_key.values() for i in group if i.tower)
    return report_lib.AuditReport(layers, problems, _notes(layers, by_key, reached), names,
                                  towers)


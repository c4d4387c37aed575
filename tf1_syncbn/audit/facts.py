"""What the audit's rules read: :class:`GraphFacts` of a graph, :class:`LayerFacts` per layer.

:func:`graph_facts` finds the graph's batch-norm layers
(:func:`tf1_syncbn.audit.layers.find_layers`) and what one training step runs;
:func:`layer_facts` gathers, for one layer, everything a rule
(:mod:`tf1_syncbn.audit.rules`) or the report's row reads: its towers, which
of them all-reduce and how, its moving variables and what the step does with
their updates, its copies that no tower name tells apart. Facts only: no
judgement, no message.
"""

import collections
import dataclasses

import tensorflow as tf

from tf1_syncbn.audit import report as report_lib
from tf1_syncbn.audit.graph import parent_scope, tower_of
from tf1_syncbn.audit.layers import (MAIN_GROUP_STATISTICS, collective_group, collective_key,
                                     find_layers)

__all__ = ['GraphFacts', 'LayerFacts', 'graph_facts', 'layer_facts', 'unique_towers',
           'towers_of', 'canonical_device']


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    """What the audit knows of the whole graph.

    Attributes:
      index: the graph's :class:`~tf1_syncbn.audit.graph.GraphIndex`.
      patterns: the compiled tower patterns (one group: the index).
      reached: the keys of the nodes one training step runs (reachable from the
        train op), or None when no train op was given or found.
      layers: ``{layer key: [Instance]}`` (:class:`~tf1_syncbn.audit.layers.Instance`:
        one tower's copy).
      variables: ``{variable node key: (layer key, statistic, node)}`` of every
        moving-statistic variable.
      updates: ``{variable node key: [assign nodes]}`` (initializers and
        restores left out).
      backward: ``{layer key: [backward all-reduce nodes]}``.
      training_towers: the towers whose training copies the step runs (all
        training towers without a train op).
    """

    index: object
    patterns: list
    reached: object
    layers: dict
    variables: dict
    updates: dict
    backward: dict
    training_towers: frozenset


@dataclasses.dataclass(frozen=True)
class LayerFacts:
    """What the audit knows of one batch-norm layer (all its towers' copies).

    Attributes:
      key: the layer's scope without tower prefixes.
      graph: the :class:`GraphFacts` it was read from.
      instances: every copy (``Instance``), in graph order.
      training: the copies that normalize with batch statistics.
      in_step: the training copies the step runs (all training copies when
        it runs none, or without a train op).
      computation: ``'tf1_syncbn'``, ``'fused'``, ``'moments'`` or ``'-'``.
      hand_written: its ``'tf1_syncbn'`` computation is ``tf1_syncbn.moments``
        calls (a batch norm written by hand), not one of the library's layers.
      mode: ``'train'``, ``'infer'`` or ``'train+infer'``.
      towers, training_towers, inference_towers, synced_towers: sorted tower
        labels: of every copy, of ``in_step``, of the inference paths, of the
        ``in_step`` copies that all-reduce (or are alone in their sync group).
      backends: the names of the backends of its forward all-reduces.
      group_sizes: the group sizes those all-reduces record, sorted (the
        all-reduce of the moving statistics across workers' sync groups left out).
      sync_groups: ``((towers, group sizes), ...)``: the towers whose forward
        all-reduces share a group key (NCCL: a group label), each with the
        sizes they record, in the order of their first tower; more than one
        with sync groups (the layers' ``group_size``), where a tower alone in
        its group is a group of its own, of size 1.
      collectives_per_step: its all-reduces (forward and backward) the step
        runs (all of them without a train op).
      devices: the canonical devices of the ``in_step`` copies that name one.
      moving: ``((variable node, statistic), ...)``: its moving variables.
      update_status: a ``tf1_syncbn.audit.report.UPDATES_*`` value.
      update_ops: the names of its update ops (those the step runs, when it
        runs some).
      step_updates: whether the step runs its training copies, so that what
        it does with their updates was checked (status ``NOT RUN``,
        ``train_op`` or ``in layer``).
      unreached_statistics: the statistics none of whose updates the step runs.
      reached_updates: ``((variable node, statistic, names of its update ops
        the step runs), ...)``.
      untowered: ``{tower: {device: [scopes]}}``: copies on two devices or
        more that no tower name tells apart, none all-reducing.
      frozen_towers: the training towers of the step where a copy of it
        normalizes with its moving statistics.
    """

    key: str
    graph: GraphFacts
    instances: tuple
    training: tuple
    in_step: tuple
    computation: str
    hand_written: bool
    mode: str
    towers: tuple
    training_towers: tuple
    inference_towers: tuple
    synced_towers: tuple
    backends: frozenset
    group_sizes: tuple
    sync_groups: tuple
    collectives_per_step: int
    devices: tuple
    moving: tuple
    update_status: str
    update_ops: tuple
    step_updates: bool
    unreached_statistics: tuple
    reached_updates: tuple
    untowered: dict
    frozen_towers: tuple


def unique_towers(labels):
    """Tower labels, each once, in tower order."""
    return tuple(sorted(set(labels), key=report_lib.tower_sort_key))


def canonical_device(device):
    """``device`` in TensorFlow's canonical form (as written when it does not parse)."""
    try:
        return tf.DeviceSpec.from_string(device).to_string()
    except ValueError:
        return device


def graph_facts(index, patterns, roots):
    """The :class:`GraphFacts` of the graph of ``index``; ``roots``: the train op's nodes."""
    found = find_layers(index, patterns)
    reached = index.reachable(roots) if roots else None
    training_towers = frozenset(i.tower for group in found.layers.values() for i in group
                                if i.training and i.reached(reached))
    return GraphFacts(index=index, patterns=patterns, reached=reached, layers=found.layers,
                      variables=found.variables, updates=found.updates,
                      backward=found.backward, training_towers=training_towers)


def layer_facts(key, graph):
    """The :class:`LayerFacts` of the layer ``key`` of ``graph`` (:class:`GraphFacts`)."""
    group, reached = graph.layers[key], graph.reached
    training = [i for i in group if i.training]
    # With a train op, copies that the step never runs (a Keras model's own
    # graph on its keras.Input placeholders, next to the towers that call the
    # model) are not among the towers it synchronizes.
    in_step = [i for i in training if i.reached(reached)] or training
    kinds = set().union(*(i.kinds for i in group))
    forward = [c for i in in_step for c in i.collectives]
    described = [collective_group(c) for c in forward if not _main_group_statistics(c)]
    collectives = forward + graph.backward.get(key, [])
    moving = tuple((node, stat) for k, stat, node in graph.variables.values() if k == key)
    updates = _updates(moving, training, graph)
    return LayerFacts(
        key=key, graph=graph, instances=tuple(group), training=tuple(training),
        in_step=tuple(in_step),
        computation=('tf1_syncbn' if 'library' in kinds else 'fused' if 'fused' in kinds else
                     'moments' if 'moments' in kinds else '-'),
        hand_written=any(i.hand_written for i in group),
        mode=('infer' if not training else
              'train+infer' if any(i.inference for i in group) else 'train'),
        towers=unique_towers(i.tower for i in group),
        training_towers=unique_towers(i.tower for i in in_step),
        inference_towers=unique_towers(i.tower for i in group if i.inference),
        synced_towers=unique_towers(i.tower for i in in_step if i.collectives or i.alone),
        backends=frozenset(b for b, _ in described),
        group_sizes=tuple(sorted({s for _, s in described if s})),
        sync_groups=_sync_groups(in_step),
        collectives_per_step=sum(1 for c in collectives if reached is None or c.key in reached),
        devices=tuple(sorted({canonical_device(i.device) for i in in_step if i.device})),
        moving=moving, untowered=_untowered(in_step),
        frozen_towers=unique_towers(i.tower for i in group
                                    if not i.training and i.tower in graph.training_towers and
                                    i.reached(reached)),
        **updates)


def _main_group_statistics(node):
    """Whether ``node`` gives every worker's main tower worker 0's group's moving statistics."""
    return MAIN_GROUP_STATISTICS in node.name.split('/')


def _sync_groups(in_step):
    """The sync groups of a layer's training towers: ``((towers, group sizes), ...)``.

    A tower alone in its sync group all-reduces nothing: a group of one.
    """
    groups = collections.OrderedDict()
    for instance in in_step:
        if instance.alone:
            groups.setdefault(('alone', instance.tower), ([instance.tower], {1}))
        for node in instance.collectives:
            if _main_group_statistics(node):
                continue
            towers, sizes = groups.setdefault(collective_key(node), ([], set()))
            if instance.tower not in towers:
                towers.append(instance.tower)
            size = collective_group(node)[1]
            if size:
                sizes.add(size)
    ordered = sorted(groups.values(), key=lambda group: min(
        report_lib.tower_sort_key(t) for t in group[0]))
    return tuple((tuple(towers), frozenset(sizes)) for towers, sizes in ordered)


def _untowered(in_step):
    """``{tower: {device: [scopes]}}`` of unsynchronized copies on two devices or more."""
    by_tower = {}
    for instance in in_step:
        if instance.collectives or instance.alone or not instance.device:
            continue
        copies = by_tower.setdefault(instance.tower, {})
        copies.setdefault(canonical_device(instance.device), []).append(instance.scope)
    return {tower: copies for tower, copies in sorted(by_tower.items()) if len(copies) > 1}


_Updates = collections.namedtuple('_Updates', ['update_status', 'update_ops', 'step_updates',
                                               'unreached_statistics', 'reached_updates'])


def _updates(moving, training, graph):
    """What the step does with a layer's moving-average updates (the update fields)."""
    reached, updates = graph.reached, graph.updates
    built = [u for node, _ in moving for u in updates.get(node.key, [])]

    def result(status, names=(), checked=False, unreached=(), per_variable=()):
        return _Updates(status, names, checked, unreached, per_variable)._asdict()

    if not training:
        return result(report_lib.UPDATES_INFERENCE)
    if not built:
        return result(report_lib.UPDATES_NONE)
    names = tuple(sorted(u.name for u in built))
    if reached is None:
        return result(report_lib.UPDATES_NOT_CHECKED, names)
    if not any(i.reached(reached) for i in training):
        return result(report_lib.UPDATES_OUTSIDE, names)
    run = [u for u in built if u.key in reached]
    stats = sorted({stat for _, stat in moving})
    unreached = tuple(s for s in stats
                      if not any(u.key in reached for node, stat in moving if stat == s
                                 for u in updates.get(node.key, [])))
    per_variable = tuple((node, stat, tuple(sorted(u.name for u in updates.get(node.key, [])
                                                   if u.key in reached)))
                         for node, stat in moving)
    if unreached:
        return result(report_lib.UPDATES_NOT_RUN, names, True, unreached, per_variable)
    scopes = {i.scope for i in training}
    inside = any(consumer.op in ('Identity', 'IdentityN') and
                 parent_scope(consumer.name) in scopes
                 for u in run for consumer, control in graph.index.consumers(u) if control)
    return result(report_lib.UPDATES_IN_LAYER if inside else report_lib.UPDATES_RUN,
                  tuple(sorted(u.name for u in run)), True, unreached, per_variable)


def towers_of(names, patterns):
    """The towers of op ``names``, each once, in tower order."""
    return unique_towers(tower_of(name, patterns) or '' for name in names)

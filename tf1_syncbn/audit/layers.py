"""Where a graph's batch-norm layers are: tower copies, moving statistics, updates, all-reduces.

Works on a :class:`~tf1_syncbn.audit.graph.GraphIndex`. A layer shows in a
tower through *anchors*, ops that only batch norm builds:

* this library's training ops: the ``IdentityN`` named ``sync_batch_norm`` /
  ``all_reduce`` with the library's gradient, ``SyncBnMoments``, the slow
  path's ``packed_moments`` and the ``update_moving_averages`` trigger that
  every non-main training tower holds; under a ``moments`` scope
  (``tf1_syncbn.moments`` in a hand-written batch norm), the layer is the
  enclosing scope, as for ``tf.nn.moments``;
* ``FusedBatchNorm*`` (slim, ``tf.layers``, Keras, tensorpack), with batch
  statistics or, ``is_training=False``, the moving ones;
* ``<layer>/moments/mean`` (``tf.nn.moments``) and ``<layer>/batchnorm/Rsqrt``
  (``tf.nn.batch_normalization`` on moving statistics).

Anchors in one full scope (a ``tf.cond``'s branches included, whose ops get
the scope of the ``If`` op) are one :class:`Instance`: one tower's copy. Its
layer is the scope without tower components, when moving-statistic variables
(``moving_mean``, ``moving_variance``, ``mean/EMA``, ``variance/EMA``) have
that scope; else the layer whose moving statistics it reads or updates (an
evaluation path under another scope); else, for a plain kernel, it is not
batch norm (layer norm's fused kernel has no moving statistics).
"""

import collections
import re

from tf1_syncbn.backends import NcclBackend, backend_of_op_type
from tf1_syncbn.audit.graph import (ASSIGN_OPS, VARIABLE_OPS, is_gradient_scope, parent_scope,
                                    strip_towers, tower_of)

__all__ = ['STATISTICS', 'Instance', 'FoundLayers', 'find_layers', 'collective_group',
           'collective_key', 'MAIN_GROUP_STATISTICS']

#: Names of moving-statistic variables, after the layer's scope.
STATISTICS = ('moving_mean', 'moving_variance', 'mean/EMA', 'variance/EMA')
_FUSED = frozenset(['FusedBatchNorm', 'FusedBatchNormV2', 'FusedBatchNormV3'])
_LIBRARY_GRADIENT = b'Tf1SyncbnCustomGradient'
_SYNC_IDENTITY = re.compile(r'(sync_batch_norm|all_reduce)(_[0-9]+)?')
_MOMENTS = re.compile(r'(weighted_)?moments(_[0-9]+)?')
_GRADIENTS = re.compile(r'gradients(_[0-9]+)?')
_SAVER = re.compile(r'save(_[0-9]+)?')
_TRAINING_KINDS = frozenset(['library', 'fused', 'moments'])
#: Ops between a layer's statistics and its variables (reads, casts, the update's arithmetic).
_STATISTIC_PATH = frozenset(['Identity', 'Snapshot', 'ReadVariableOp', 'Cast', 'Enter',
                             'Switch', 'AddV2', 'Add', 'Sub', 'Mul', 'StopGradient', 'Squeeze',
                             'Reshape', 'SelectV2', 'Select'])


def _anchor(node):
    """``(layer scope, kind)`` when ``node`` shows a batch-norm computation, else None.

    Kinds: ``'library'`` (this library's training ops and update triggers),
    ``'fused'`` (``FusedBatchNorm*`` with batch statistics), ``'moments'``
    (``<layer>/moments/mean``), ``'infer'`` (moving statistics).
    """
    last = node.name.rsplit('/', 1)[-1]
    scope = parent_scope(node.name)
    op = node.op
    if op == 'IdentityN' and _SYNC_IDENTITY.fullmatch(last) and \
            getattr(node.get_attr('_gradient_op_type'), 's', None) == _LIBRARY_GRADIENT:
        return _moments_layer(scope), 'library'
    if op == 'SyncBnMoments' or (op == 'ConcatV2' and last == 'packed_moments') or \
            (op == 'NoOp' and last == 'update_moving_averages'):
        return _moments_layer(scope), 'library'
    if op in _FUSED:
        training = node.get_attr('is_training')
        return scope, 'fused' if training is None or training.b else 'infer'
    if op == 'Mean' and last == 'mean' and _MOMENTS.fullmatch(scope.rsplit('/', 1)[-1]):
        return parent_scope(scope), 'moments'
    if op == 'Rsqrt' and scope.rsplit('/', 1)[-1] == 'batchnorm':
        return parent_scope(scope), 'infer'
    return None


def _moments_layer(scope):
    """The layer of ``tf1_syncbn.moments``' ops (``<layer>/moments``), as of ``tf.nn.moments``'."""
    if _MOMENTS.fullmatch(scope.rsplit('/', 1)[-1]):
        return parent_scope(scope)
    return scope


class Instance(object):
    """One tower's copy of a layer: the anchors found under one full scope."""

    def __init__(self, scope, tower):
        self.scope = scope
        self.tower = tower
        self.key = None
        self.anchors = []            # (node, kind)
        self.collectives = []        # forward all-reduces under its scope
        self.alone = []              # identities that stand for a sync group of one's

    @property
    def kinds(self):
        return {kind for _, kind in self.anchors}

    @property
    def training(self):
        return bool(self.kinds & _TRAINING_KINDS)

    @property
    def hand_written(self):
        """Whether its library anchors are ``tf1_syncbn.moments``' (under a ``moments`` scope)."""
        return any(kind == 'library' and
                   _MOMENTS.fullmatch(parent_scope(node.name).rsplit('/', 1)[-1])
                   for node, kind in self.anchors)

    @property
    def inference(self):
        """Whether a graph, function body or v1 cond branch holds only inference anchors of it."""
        training_contexts = {(id(n.context), n.branch) for n, k in self.anchors
                             if k in _TRAINING_KINDS}
        return any(k == 'infer' and (id(n.context), n.branch) not in training_contexts
                   for n, k in self.anchors)

    def reached(self, reached):
        return reached is None or any(n.key in reached for n, _ in self.anchors)

    @property
    def device(self):
        """The device its training anchors (else any) were placed on, as written; '' if none.

        An op of a function body (a ``tf.cond`` branch) without a device of
        its own runs on the device of the op that calls the function.
        """
        ordered = sorted(self.anchors, key=lambda a: a[1] not in _TRAINING_KINDS)
        for node, _ in ordered:
            device, context = node.device, node.context
            while not device and context is not None:
                device, context = context.caller.device, context.caller.context
            if device:
                return device
        return ''


def _moving_variables(index, patterns):
    """``{variable node key: (layer key, statistic, node)}`` of every moving-statistic variable."""
    found = {}
    for node in index.nodes:
        if node.context is not None or node.op not in VARIABLE_OPS:
            continue
        name = strip_towers(node.name, patterns)
        for stat in STATISTICS:
            if name == stat or name.endswith('/' + stat):
                found[node.key] = (name[:-len(stat)].rstrip('/'), stat, node)
                break
    return found


def _updates(index, variables):
    """``{variable node key: [assign nodes]}``: every assignment but initializers and restores."""
    updates = {}
    for node in index.nodes:
        if node.op not in ASSIGN_OPS:
            continue
        target = index.variable_of(node)
        if target is None or target.key not in variables:
            continue
        if node.name.startswith(target.name + '/') or \
                _SAVER.fullmatch(node.name.split('/', 1)[0]):
            continue                    # its initializer, or a Saver's restore
        updates.setdefault(target.key, []).append(node)
    return updates


def _instances(index, patterns, variables):
    """``{full scope: Instance}`` of the batch-norm computations, keyed to their layer."""
    instances = {}
    for node in index.nodes:
        if is_gradient_scope(node.name):
            continue
        found = _anchor(node)
        if found is None:
            continue
        scope, kind = found
        instance = instances.get(scope)
        if instance is None:
            instance = instances[scope] = Instance(scope, tower_of(scope, patterns) or '')
        instance.anchors.append((node, kind))
    layer_keys = {key for key, _, _ in variables.values()}
    for scope, instance in list(instances.items()):
        key = strip_towers(scope, patterns)
        if key not in layer_keys:
            key = _linked_key(index, instance, variables) or _reused_key(key, layer_keys) or \
                _model_key(key, layer_keys) or (key if 'library' in instance.kinds else None)
        if key is None:
            del instances[scope]        # not batch norm (layer norm's fused kernel, say)
        else:
            instance.key = key
    return instances


#: What :func:`find_layers` returns (see there).
FoundLayers = collections.namedtuple('FoundLayers', ['layers', 'variables', 'updates', 'backward'])

_CALL_SUFFIX = re.compile(r'(.+)_[0-9]+')


def _reused_key(key, layer_keys):
    """The layer that a further call of a reused layer belongs to, or None.

    A layer called again in its variable scope (``reuse=True``, a Keras or
    tf.layers layer object applied to a second input) gets the name scope
    ``<scope>_<n>`` for its ops, while its variables stay under ``<scope>``.
    """
    match = _CALL_SUFFIX.fullmatch(key)
    return match.group(1) if match is not None and match.group(1) in layer_keys else None


def _model_key(key, layer_keys):
    """The layer of a Keras layer called inside a model (``model(x)`` in a tower), or None.

    Its ops get the model's name scope, ``<model>/<layer>``, while its
    variables, created when the model was constructed, stay under ``<layer>``.
    """
    parts = key.split('/')
    for i in range(1, len(parts)):
        candidate = '/'.join(parts[i:])
        if candidate in layer_keys:
            return candidate
        reused = _reused_key(candidate, layer_keys)
        if reused is not None:
            return reused
    return None


def _statistic_inputs(node):
    """The inputs of an anchor that carry moving statistics (inference), as input strings."""
    if node.op in _FUSED:
        return node.inputs[3:5]
    if node.op == 'Rsqrt':
        return node.inputs[:1]
    return []


def _is_statistic_output(node, input_string):
    """Whether ``input_string`` reads a batch statistic of the training anchor ``node``."""
    if node.op not in _FUSED:
        return node.op == 'Mean'
    output = input_string.split(':')[1:]
    return output in (['1'], ['2']) or (output[:1] in (['batch_mean'], ['batch_variance']))


def _linked_key(index, instance, variables, depth=6):
    """The layer of the moving statistics an instance reads or updates, or None.

    Follows only the statistics: from an inference anchor's mean and variance
    inputs back to variables, and from a training anchor's batch mean and
    variance forward to assignments, through the few elementwise ops between
    them (never through another layer).
    """
    for node, kind in instance.anchors:
        frontier = [index.producer(node, i) for i in _statistic_inputs(node)]
        for _ in range(depth):
            following = []
            for producer in frontier:
                if producer is None:
                    continue
                if producer.key in variables:
                    return variables[producer.key][0]
                if producer.op in _STATISTIC_PATH:
                    following.extend(index.producer(producer, i) for i in producer.inputs)
            frontier = following
        if kind not in ('fused', 'moments'):
            continue
        frontier = [c for c, control in index.consumers(node) if not control and
                    any(_is_statistic_output(node, i) for i in c.inputs
                        if index.producer(c, i) is node)]
        for _ in range(depth):
            following = []
            for consumer in frontier:
                if consumer.op in ASSIGN_OPS:
                    target = index.variable_of(consumer)
                    if target is not None and target.key in variables:
                        return variables[target.key][0]
                elif consumer.op in _STATISTIC_PATH:
                    following.extend(c for c, control in index.consumers(consumer)
                                     if not control)
            frontier = following
    return None


def collective_group(node):
    """``(backend, group size or None)`` when ``node`` is an all-reduce, else None."""
    backend = backend_of_op_type(node.op)
    if backend is None:
        return None
    attribute = backend.num_members_attributes.get(node.op)
    size = node.get_attr(attribute) if attribute else None
    return backend.name, size.i if size is not None else None


#: The name scope of the all-reduce that gives every worker's main tower the
#: moving statistics of worker 0's sync group (tf1_syncbn._sync.plan): not a group's.
MAIN_GROUP_STATISTICS = 'main_group_statistics'


def collective_key(node):
    """What tells an all-reduce's sync group apart: its group key, or NCCL's group label.

    Returns:
      A hashable value, the same for the members of one group; towers of
      different sync groups (the layers' ``group_size``) have different ones.
    """
    if node.op in NcclBackend.op_types:
        shared = node.get_attr('shared_name')
        text = shared.s.decode('utf-8', 'replace') if shared is not None else ''
        match = re.search(r'/group[0-9_,]+$', text)
        return ('nccl', match.group(0) if match else '')
    key = node.get_attr('group_key')
    return (node.op, key.i if key is not None else None)


#: The name of the identity that stands for the all-reduce of a tower alone in
#: its sync group (``group_size=1``, or explicit groups with a group of one):
#: ``tf1_syncbn._sync.plan.GROUP_OF_ONE``.
GROUP_OF_ONE = re.compile(r'sync_group_of_one(_[0-9]+)?')


def _is_group_of_one(node):
    return node.op == 'Identity' and GROUP_OF_ONE.fullmatch(node.name.rsplit('/', 1)[-1])


def _attach_collectives(index, instances):
    """Forward all-reduces (and groups of one) to the instance whose scope holds them.

    Returns:
      The backward all-reduces.
    """
    backward = []
    for node in index.nodes:
        alone = _is_group_of_one(node)
        if not alone and collective_group(node) is None:
            continue
        if is_gradient_scope(node.name):
            if not alone:
                backward.append(node)
            continue
        scope = parent_scope(node.name)
        while scope and scope not in instances:
            scope = parent_scope(scope)
        if scope in instances:
            (instances[scope].alone if alone else instances[scope].collectives).append(node)
    return backward


def _backward_owner(node, keys, patterns):
    """The layer key whose scope appears in a backward all-reduce's name (the longest)."""
    parts = [p for p in strip_towers(node.name, patterns).split('/')
             if not _GRADIENTS.fullmatch(p)]
    best = None
    for i in range(len(parts)):
        for j in range(len(parts), i, -1):
            candidate = '/'.join(parts[i:j])
            candidate = candidate if candidate in keys else _reused_key(candidate, keys)
            if candidate is not None and (best is None or len(candidate) > len(best)):
                best = candidate
                break
    return best


def _name_replica_zero(by_key):
    """Under tf.distribute, replica 0 builds without a prefix: call it ``replica_0``."""
    for group in by_key.values():
        if any(i.tower.startswith('replica_') for i in group):
            for instance in group:
                if not instance.tower:
                    instance.tower = 'replica_0'


def find_layers(index, patterns):
    """Every batch-norm layer of the graph.

    Args:
      index: the graph's :class:`~tf1_syncbn.audit.graph.GraphIndex`.
      patterns: compiled tower patterns (one group: the index).

    Returns:
      A :class:`FoundLayers`: ``layers`` (``{layer key: [Instance]}``), ``variables``
      (``{variable node key: (layer key, statistic, node)}``), ``updates``
      (``{variable node key: [assign nodes]}``: every assignment but
      initializers and restores) and ``backward`` (``{layer key: [backward
      all-reduce nodes]}``).
    """
    variables = _moving_variables(index, patterns)
    instances = _instances(index, patterns, variables)
    backward_nodes = _attach_collectives(index, instances)
    layers = {}
    for instance in instances.values():
        layers.setdefault(instance.key, []).append(instance)
    _name_replica_zero(layers)
    synced = {k for k, group in layers.items() if any(i.collectives for i in group)}
    backward = {}
    for node in backward_nodes:
        owner = _backward_owner(node, synced, patterns)
        if owner is not None:
            backward.setdefault(owner, []).append(node)
    return FoundLayers(layers=layers, variables=variables, updates=_updates(index, variables),
                       backward=backward)

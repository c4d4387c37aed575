"""The tower context: which per-device replica ("tower") code is built in.

A multi-tower TF1 graph builds the same model once per device, each copy under
its own name scope (``tower0/``, ``tower1/``, ...). Layers that synchronize
across towers, or that must act only once (such as moving-average updates),
need to know which tower they are in, how many towers there are, and which one
is the main training tower. :class:`TowerContext` records that, per graph.
"""

import contextlib

import tensorflow as tf
from tensorflow.python.ops import variable_scope as _vs

from tower import harness
from tower.graph_state import full_name_scope, get_graph_state, root_graph

__all__ = ['TowerContext', 'get_current_tower_context', 'strip_tower_prefix',
           'tower_index_from_name']


def _check_int(value, what, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError('TowerContext: %s must be an int, got %r.' % (what, value))
    if value < minimum:
        raise ValueError('TowerContext: %s must be >= %d, got %d.' % (what, minimum, value))


class TowerContext(object):
    """Context manager that builds one tower of a multi-tower graph.

    Entering it opens the name scope ``name`` (so ops are named ``tower0/...``)
    and records the tower's index and the number of towers in the current
    graph, where layers read them through :func:`get_current_tower_context`.

    Variables are shared in one of two ways:

    * in-graph sharing (``vs_name=''``, the default): tower 0 creates the
      variables; towers with ``index > 0`` reuse them (``reuse=True``), so a
      variable that tower 0 did not create is an error in the other towers.
      Layers built without an explicit scope get the same default scope names
      (``BatchNorm``, ``Conv_1``, ...) in every tower, so they share too;
    * replicated (``vs_name='tower1'`` etc.): each tower opens its own variable
      scope ``vs_name`` and owns a copy of every variable.

    Example::

        for i in range(4):
            with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i, total=4):
                logits = model(images[i])

    Args:
      name: the tower's name scope, for example ``'tower0'``; ``''`` opens no
        name scope (a single tower, as tensorpack's ``TowerContext('')``).
      is_training: whether this tower trains. Together with ``index == 0`` it
        makes the tower the main training tower.
      index: the tower's index, ``0 <= index < total``.
      total: the number of towers that are built together (and synchronize).
      vs_name: variable scope for replicated mode, or ``''`` for in-graph
        sharing.

    Raises:
      ValueError: on entering a tower inside another tower of the same graph,
        or when ``index``/``total`` are out of range.
      TypeError: when an argument has the wrong type.
    """

    def __init__(self, name, is_training=True, index=0, total=1, vs_name=''):
        if not isinstance(name, str) or '/' in name:
            raise ValueError(
                'TowerContext: name must be a string without "/", got %r.' % (name,))
        if not isinstance(is_training, bool):
            raise TypeError('TowerContext: is_training must be a Python bool, got %r.'
                            % (is_training,))
        _check_int(index, 'index', 0)
        _check_int(total, 'total', 1)
        if index >= total:
            raise ValueError('TowerContext(%r): index=%d must be smaller than total=%d.'
                             % (name, index, total))
        if not isinstance(vs_name, str):
            raise TypeError('TowerContext: vs_name must be a string, got %r.' % (vs_name,))
        self._name = name
        self._is_training = is_training
        self._index = index
        self._total = total
        self._vs_name = vs_name
        self._ns_name = None
        self._graph = None
        self._exit_stack = None

    @property
    def name(self):
        """The tower's name, for example ``'tower1'``."""
        return self._name

    @property
    def index(self):
        """The tower's index in ``[0, total)``."""
        return self._index

    @property
    def total(self):
        """The number of towers built together."""
        return self._total

    @property
    def is_training(self):
        """Whether the tower trains."""
        return self._is_training

    @property
    def is_main_training_tower(self):
        """True for tower 0 of a training graph: the one that updates shared state."""
        return self._is_training and self._index == 0

    @property
    def vs_name(self):
        """The tower's own variable scope in replicated mode, or ``''``."""
        return self._vs_name

    @property
    def ns_name(self):
        """The full name scope of the tower (without trailing ``/``) once entered."""
        return self._ns_name

    def __repr__(self):
        return ('TowerContext(name=%r, index=%d, total=%d, is_training=%r, vs_name=%r)'
                % (self._name, self._index, self._total, self._is_training, self._vs_name))

    def __enter__(self):
        graph = tf.compat.v1.get_default_graph()
        state = get_graph_state(graph)
        if state.tower_stack:
            raise ValueError(
                'Cannot enter %r inside %r: towers cannot be nested. Build each tower '
                'at the top level of the model.' % (self, state.tower_stack[-1]))
        if self._exit_stack is not None:
            raise ValueError('%r is already entered; create one context per tower.' % (self,))
        stack = contextlib.ExitStack()
        try:
            if self._vs_name:
                stack.enter_context(tf.compat.v1.variable_scope(
                    self._vs_name, auxiliary_name_scope=False))
            elif self._index > 0:
                stack.enter_context(tf.compat.v1.variable_scope(
                    tf.compat.v1.get_variable_scope(), reuse=True,
                    auxiliary_name_scope=False))
            self._align_default_scope_names(state)
            outer = graph.get_name_scope()
            if self._name:
                full = (outer + '/' + self._name) if outer else self._name
                stack.enter_context(graph.name_scope(full + '/'))
            else:
                full = outer
            self._ns_name = full
            state.tower_stack.append(self)
            stack.callback(state.tower_stack.pop)
        except BaseException:
            stack.close()
            raise
        self._graph = graph
        self._exit_stack = stack
        return self

    def _align_default_scope_names(self, state):
        # Layers built without an explicit scope get default names ('BatchNorm',
        # 'BatchNorm_1', 'Conv', ...) from per-graph counters. In in-graph
        # sharing mode every tower must get the names tower 0 got, so that it
        # reuses tower 0's variables: restore the counters tower 0 started with.
        counts = _vs.get_variable_scope_store().variable_scopes_count
        key = (tf.compat.v1.get_variable_scope().name, self._total)
        if self._index == 0 and not self._vs_name:
            state.scope_counts[key] = dict(counts)
        elif not self._vs_name and key in state.scope_counts:
            counts.clear()
            counts.update(state.scope_counts[key])

    def __exit__(self, exc_type, exc_value, traceback):
        stack, graph = self._exit_stack, self._graph
        self._exit_stack = None
        self._graph = None
        try:
            if exc_type is None:
                for hook in list(get_graph_state(graph).tower_exit_hooks):
                    hook(self)
        finally:
            stack.close()
        return False


def get_current_tower_context(graph=None):
    """Returns the tower being built in ``graph``, or None.

    That is the innermost :class:`TowerContext` of ``graph`` or, when there is
    none and ``graph`` is the current default graph, another harness's tower
    seen through a read-only :class:`tower.harness.HarnessTowerContext` with
    the same properties: tensorpack's active tower context
    (``TrainTowerContext`` / ``PredictTowerContext``; tensorpack is never
    imported for this), or the ``tf.distribute`` replica that
    ``strategy.run`` is building.

    Args:
      graph: a ``tf.Graph``; defaults to the current default graph.

    Code built outside any tower gets None and should behave as a single tower
    (index 0, total 1); :func:`tower_index_from_name` helps code that builds
    towers with plain name scopes (``tower_<i>``, ``clone_<i>``, ...) instead.

    Raises:
      ValueError: when a ``TowerContext`` (or tensorpack's) is entered inside
        ``strategy.run``: the layer could not tell which group to synchronize
        with. (Inside both this library's and tensorpack's, the library's
        wins, as the innermost.)
    """
    contexts = active_tower_contexts(graph)
    if len(contexts) > 1 and any(getattr(c, 'replicated_updates', False) for c in contexts):
        raise ValueError(
            'Towers of two harnesses are being built at once: %s. A layer cannot tell which '
            'towers to synchronize with. Build the towers with one of them: inside '
            'strategy.run, the strategy\'s replicas are the towers (drop the TowerContext / '
            'call_for_each_tower there).' % ' and '.join(repr(c) for c in contexts))
    return contexts[0] if contexts else None


def active_tower_contexts(graph=None):
    """Every tower being built in ``graph``: this library's, tensorpack's, tf.distribute's.

    Returns:
      A list, innermost library context first; usually of one element or none.
    """
    found = []
    stack = get_graph_state(graph).tower_stack
    if stack:
        found.append(stack[-1])
    if graph is None or root_graph(graph) is root_graph():
        for context in (harness.tensorpack_tower_context(),
                        harness.distribute_replica_context(full_name_scope())):
            if context is not None:
                found.append(context)
    return found


def strip_tower_prefix(name, context=None):
    """Removes tower name-scope components from a scope or op name.

    Every whole path component that names a tower is removed: ``tower<i>``,
    ``tower_<i>``, ``clone_<i>`` and the patterns added with
    :func:`tower.register_tower_pattern`. So is a leading ``ns_name`` or
    ``vs_name`` of ``context`` (default: the current tower context, including
    tensorpack's), which covers custom tower names and replicated mode.
    Components that only contain such text, such as ``xtower1`` or
    ``mytower3``, are kept. The result is the same in every tower, so it can
    name things shared across towers.

    Examples::

        strip_tower_prefix('tower0/conv1/BatchNorm')  ->  'conv1/BatchNorm'
        strip_tower_prefix('clone_1/conv1/BatchNorm') ->  'conv1/BatchNorm'
        strip_tower_prefix('tower12/')                ->  ''
        strip_tower_prefix('xtower1/conv')            ->  'xtower1/conv'

    Args:
      name: a name such as ``tf.compat.v1.get_variable_scope().name``.
      context: the tower context whose ``ns_name``/``vs_name`` is also removed.

    Returns:
      The name without tower components and without a trailing ``/``.
    """
    if not isinstance(name, str):
        raise TypeError('strip_tower_prefix: name must be a string, got %r.' % (name,))
    if context is None:
        context = get_current_tower_context()
    name = name.strip('/')
    if context is not None:
        for prefix in (context.ns_name, context.vs_name):
            if prefix and (name == prefix or name.startswith(prefix + '/')):
                name = name[len(prefix):].lstrip('/')
    kept = [p for p in name.split('/') if p and harness.tower_index_of_component(p) is None]
    return '/'.join(kept)


def tower_index_from_name(name):
    """The index of the first tower component of the name scope ``name``, or None.

    Used for towers built with plain name scopes and no tower context, as in
    the classic multi-GPU scripts (``tower_<i>``), tf-slim's ``model_deploy``
    (``clone_<i>``) or ``tower<i>``; see :mod:`tower.harness` for the
    patterns and how to add one.
    """
    if not isinstance(name, str):
        raise TypeError('tower_index_from_name: name must be a string, got %r.' % (name,))
    for part in name.split('/'):
        index = harness.tower_index_of_component(part)
        if index is not None:
            return index
    return None

"""Per-graph state of the tower contexts: the entered towers, their exit hooks, scope counts.

State lives on the ``tf.Graph`` it belongs to, as one attribute of the graph
object (:data:`_ATTRIBUTE`), so two graphs never see each other's towers or
counters. Nothing here is global across graphs, and nothing outside the graph
refers to the state: state that holds the graph's own ops (an exit hook's
owner may) only makes a reference cycle through the graph, which Python's
garbage collector frees with it. A module-level map from graphs to their
state would keep every graph alive through the ops its values hold, even with
weak keys.

The branches of ``tf.cond``/``tf.while_loop`` (control flow v2) and traced
functions are built in ``FuncGraph``s nested in the model's graph; they share
the state of their outermost graph, since they are part of the same model.

:func:`root_graph` and :func:`full_name_scope` serve the libraries that read
towers too; what ``tf1_syncbn`` keeps per graph is its own
(``tf1_syncbn._graph.cache``).
"""

import threading

import tensorflow as tf

_ATTRIBUTE = '_tf1_syncbn_graph_state'
_LOCK = threading.Lock()


class GraphState(object):
    """Mutable state owned by one graph.

    Attributes:
      tower_stack: list of entered ``TowerContext`` objects, innermost last.
      tower_exit_hooks: callables run with the context when a tower is left
        without an exception (used to check that towers built the same
        synchronized layers).
      scope_counts: default-scope-name counters saved when tower 0 of a group
        was entered, restored for the other towers.
    """

    def __init__(self):
        self.tower_stack = []
        self.tower_exit_hooks = []
        self.scope_counts = {}


def root_graph(graph=None):
    """The outermost graph of ``graph`` (default: current graph).

    A ``FuncGraph`` (a ``tf.cond`` branch, a loop body, a traced function)
    belongs to the graph it is nested in.
    """
    if graph is None:
        graph = tf.compat.v1.get_default_graph()
    while getattr(graph, 'outer_graph', None) is not None:
        graph = graph.outer_graph
    return graph


def full_name_scope(graph=None):
    """The current name scope of ``graph`` (default: current), enclosing graphs included.

    A ``tf.cond`` branch is traced in a ``FuncGraph`` whose own name scope
    starts empty; the scope it is built in (``tower_1/cond/...``) is that of
    the enclosing graph.
    """
    if graph is None:
        graph = tf.compat.v1.get_default_graph()
    parts = []
    while graph is not None:
        parts.append(graph.get_name_scope())
        graph = getattr(graph, 'outer_graph', None)
    return '/'.join(p for p in reversed(parts) if p)


def root_graph_attribute(attribute, factory, graph=None):
    """The object kept as ``attribute`` on ``graph``'s outermost graph, made by ``factory()``.

    Made on first use, under one process lock; kept on the graph object, so
    it lives and dies with the graph (see the module docstring). The
    towers' state is one (:func:`get_graph_state`); another library keeps its
    own under an attribute of its own (``tf1_syncbn``'s per-graph cache).

    Args:
      attribute: the attribute's name, private to its owner
        (``'_tf1_syncbn_graph_state'``).
      factory: a callable without arguments.
      graph: a graph (default: the current graph).
    """
    graph = root_graph(graph)
    with _LOCK:
        value = getattr(graph, attribute, None)
        if value is None:
            value = factory()
            setattr(graph, attribute, value)
        return value


def get_graph_state(graph=None):
    """Returns the :class:`GraphState` of ``graph``'s outermost graph (default: current)."""
    return root_graph_attribute(_ATTRIBUTE, GraphState, graph)

"""Per-graph state for tower contexts and the layers that read them.

State lives in a ``WeakKeyDictionary`` keyed by the ``tf.Graph`` it belongs
to, so two graphs never see each other's towers or counters, and the state is
freed together with its graph. Nothing here is global across graphs.
"""

import threading
import weakref

import tensorflow as tf

_STATES = weakref.WeakKeyDictionary()
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
      slots: dict of named sub-states for other packages (for example the
        per-tower call counters of ``tf1_syncbn``), created on first use by
        :meth:`slot`.
    """

    def __init__(self):
        self.tower_stack = []
        self.tower_exit_hooks = []
        self.scope_counts = {}
        self.slots = {}

    def slot(self, name, factory):
        """Returns the sub-state ``name``, creating it with ``factory()``."""
        if name not in self.slots:
            self.slots[name] = factory()
        return self.slots[name]


def get_graph_state(graph=None):
    """Returns the :class:`GraphState` of ``graph`` (default: current graph)."""
    if graph is None:
        graph = tf.compat.v1.get_default_graph()
    with _LOCK:
        state = _STATES.get(graph)
        if state is None:
            state = GraphState()
            _STATES[graph] = state
        return state

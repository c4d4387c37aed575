"""The library's per-graph cache: one named slot per use, kept on the graph it belongs to.

A slot lives in one attribute of the ``tf.Graph`` object (:data:`_ATTRIBUTE`),
so two graphs never see each other's registries or counters. Nothing here is
global across graphs, and nothing outside the graph refers to the cache: a
slot that holds the graph's own ops (the call registry does) only makes a
reference cycle through the graph, which Python's garbage collector frees
with it. A module-level map from graphs to their state would keep every graph
alive through the ops its values hold, even with weak keys.

The branches of ``tf.cond``/``tf.while_loop`` (control flow v2) and traced
functions are built in ``FuncGraph``\\ s nested in the model's graph; they share
the cache of their outermost graph, since they are part of the same model
(:func:`tower.graph_state.root_graph_attribute` keeps it there, as it keeps
the towers' state).

What towers keep per graph (the entered towers, their exit hooks) is
:mod:`tower.graph_state`'s, beside this.
"""

from tower.graph_state import root_graph_attribute

__all__ = ['GraphCache', 'graph_cache']

_ATTRIBUTE = '_tf1_syncbn_cache'


class GraphCache(object):
    """The library's state owned by one graph: named slots, created on first use.

    Attributes:
      slots: ``{name: state}``; names are dotted by their owner
        (``'tf1_syncbn.registry'``, ``'tf1_syncbn.layers.names'``).
    """

    def __init__(self):
        self.slots = {}

    def slot(self, name, factory):
        """Returns the slot ``name``, creating it with ``factory()``."""
        if name not in self.slots:
            self.slots[name] = factory()
        return self.slots[name]


def graph_cache(graph=None):
    """Returns the :class:`GraphCache` of ``graph``'s outermost graph (default: current)."""
    return root_graph_attribute(_ATTRIBUTE, GraphCache, graph)

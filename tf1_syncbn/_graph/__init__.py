"""The library's per-graph state (private): :mod:`~tf1_syncbn._graph.cache`.

Every part of the library that keeps something per graph (the call
registry, the guards, the shared updates, the kernel sets' compiled vector
math, the gradients' records, ...) keeps it in a slot of its graph's
:class:`~tf1_syncbn._graph.cache.GraphCache`. It imports only :mod:`tower`
(the root graph of a ``tf.cond`` branch); the other internals import it.
"""

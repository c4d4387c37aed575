"""Keeps the library's ops out of XLA's auto-clustering.

With XLA auto-clustering on (``global_jit_level = ON_1`` in the session
config, ``TF_XLA_FLAGS=--tf_xla_auto_jit=2``), TensorFlow merges
neighbouring ops of a device into clusters that run as one op: a cluster
waits for all its inputs before it yields any output. XLA checks that this
creates no cycle *in the graph*, but the all-reduces of the towers pair up
across devices outside the graph's edges: a cluster in one tower that joins
an op feeding one all-reduce with an op fed by another makes that tower
start the first only after the second ended, while another tower waits in
the first (a deadlock, seen with the portable kernel set: every step ended
at the collective timeout).

:func:`outside_xla_clusters` marks every op built under it with
``_XlaCompile=False`` (what ``tf.xla.experimental.jit_scope(compile_ops=False)``
sets, without its graph collection): the auto-clustering pass leaves such
ops alone. Every layer call, ``tf1_syncbn.moments`` and every gradient of
the library's custom gradients are built under it, so the ops around the
all-reduces never join a cluster; the model's other ops still do. (The
portable kernel set's own ``tf.function(jit_compile=True)`` functions are
compiled explicitly, as single ops, whatever this says.)
"""

import contextlib

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

__all__ = ['outside_xla_clusters', 'XLA_COMPILE_ATTR']

XLA_COMPILE_ATTR = '_XlaCompile'


@contextlib.contextmanager
def outside_xla_clusters():
    """Ops built in this block carry ``_XlaCompile=False`` (see the module docstring)."""
    graph = tf.compat.v1.get_default_graph()
    with graph._attr_scope({XLA_COMPILE_ATTR: attr_value_pb2.AttrValue(b=False)}):  # noqa: SLF001
        yield

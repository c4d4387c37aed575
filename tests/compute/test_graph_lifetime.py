"""Graphs built and dropped are freed: the library keeps no graph alive.

Hyper-parameter searches, evaluation loops and test suites build many graphs
in one process. Before, every synchronized or multi-tower graph stayed in
memory for the life of the process: ``tf.custom_gradient`` registers a
closure in TensorFlow's global gradient registry per call, the run-time check
(a ``tf.numpy_function``) registered a method of its graph's registry, and
per-graph state sat in a module-level map whose values held their graph.
"""

import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
from tf1_syncbn import BatchNorm, BatchRenorm, CollectiveBackend, kernels, sync_batch_norm
from tower import TowerContext, call_for_each_tower, virtual_cpu_config

tf1 = tf.compat.v1
GRAPHS = 2   # each graph left alive fails: two show it


def _build_and_run(custom):
    """One multi-tower training graph with every path, run once; returns a weak reference."""
    graph = tf.Graph()
    with graph.as_default(), kernels.use_custom_kernels(custom):
        is_training = tf1.placeholder(tf.bool, [])
        xs = []

        def tower():
            x = tf1.placeholder(tf.float32, [None, 4, 3])
            xs.append(x)
            backend = CollectiveBackend(timeout=60)
            h = sync_batch_norm(x, is_training=is_training, sync_statistics=backend,
                                scope='fast')
            h = sync_batch_norm(h, renorm=True, sync_statistics=backend, scope='slow')
            h = BatchNorm('ghost', h, virtual_batch_size=2, sync_statistics=backend)
            return BatchRenorm('brn', h, 3.0, 5.0, sync_statistics=backend)

        ys = call_for_each_tower(tower, ['/cpu:0', '/cpu:1'])
        loss = tf.add_n([tf.reduce_sum(y * y) for y in ys])
        grads = tf.gradients(loss, xs + tf1.trainable_variables())
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            step = tf.group(*grads)
        feed = {x: np.random.RandomState(0).randn(2, 4, 3).astype(np.float32) for x in xs}
        feed[is_training] = True
        with tf1.Session(config=virtual_cpu_config(2)) as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run([loss, step], feed)
    return weakref.ref(graph)


# The TF1-behaviour pass: the compiled kernels (tf_behavior.pick).
@pytest.mark.parametrize('custom', tf_behavior.pick([True, False], [True]))
def test_dropped_graphs_are_freed(custom):
    if custom and kernels.load() is None:
        pytest.skip('the compiled kernels are unavailable: %s' % kernels.status())
    refs = [_build_and_run(custom) for _ in range(GRAPHS)]
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    assert alive == 0, '%d of %d graphs still alive' % (alive, GRAPHS)


def test_tower_contexts_keep_no_graph_alive():
    refs = []
    for _ in range(GRAPHS):
        graph = tf.Graph()
        with graph.as_default():
            for i in range(2):
                with TowerContext('tower%d' % i, index=i, total=2):
                    tf1.get_variable('w', [3])
        refs.append(weakref.ref(graph))
        del graph
    gc.collect()
    assert all(ref() is None for ref in refs)

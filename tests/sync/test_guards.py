"""Every synchronized computation waits for the step's guards, whatever path builds it.

The guards are the run-time check that every tower of a group was built and
the step watchdog that turns a wait longer than the timeout into an error.
Before, the slow path (``fused=False``, renorm, ``BatchRenorm``,
``batch_weights``, ``adjustment``) and ghost batches built their collectives
without them, and a tower that skipped such a layer at run time hung forever
even with ``CollectiveBackend(timeout=3)``.
"""

import time

import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
from bn_reference import build_towers, towers_skipping_a_layer
from conftest import assert_first_run_fails, make_session
from tf1_syncbn import BatchNorm, BatchRenorm, CollectiveBackend, kernels, sync_batch_norm

tf1 = tf.compat.v1

# name -> layer(x, backend): every path that builds collectives.
PATHS = {
    'fast': lambda x, b: sync_batch_norm(x, sync_statistics=b, updates_collections=None),
    'fused=False': lambda x, b: sync_batch_norm(x, fused=False, sync_statistics=b,
                                                updates_collections=None),
    'renorm': lambda x, b: sync_batch_norm(x, renorm=True, sync_statistics=b,
                                           updates_collections=None),
    'batch_weights': lambda x, b: sync_batch_norm(
        x, batch_weights=tf.ones(tf.shape(x)[:1]), sync_statistics=b, updates_collections=None),
    'adjustment': lambda x, b: sync_batch_norm(
        x, adjustment=lambda shape: (tf.ones([3]), tf.zeros([3])), sync_statistics=b,
        updates_collections=None),
    'BatchRenorm': lambda x, b: BatchRenorm('brn', x, 3.0, 5.0, sync_statistics=b),
    'virtual_batch_size': lambda x, b: BatchNorm('bn', x, virtual_batch_size=4,
                                                 sync_statistics=b),
}


@pytest.fixture(autouse=True)
def _library():
    if kernels.library() is None:
        pytest.skip('the step watchdog needs the compiled library: %s' % kernels.status())


def _graphs(graph):
    """The graph and the graphs of every function in its library (tf.cond branches, XLA)."""
    return [graph] + [f.graph for f in graph._functions.values()]  # noqa: SLF001


def _callers(graphs):
    """Function name -> the ops (of any of ``graphs``) that call it."""
    callers = {}
    for g in graphs:
        for op in g.get_operations():
            for attr in ('then_branch', 'else_branch', 'f'):
                try:
                    callers.setdefault(op.get_attr(attr).name, []).append(op)
                except (ValueError, AttributeError):
                    pass
    return callers


def _ancestors(op, callers):
    """Every op that ``op`` depends on, through data and control inputs, across tf.cond.

    An op inside a ``tf.cond`` branch reaches the ops of the enclosing graph
    through the ``If`` op that calls the branch: its inputs and control inputs.
    """
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        parents = [t.op for t in current.inputs] + list(current.control_inputs)
        parents += callers.get(getattr(current.graph, 'name', None), [])
        for parent in parents:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


@pytest.mark.parametrize('path', sorted(PATHS))
@pytest.mark.parametrize('training', ['python', 'tensor'])
def test_every_collective_waits_for_the_check_and_the_watchdog(graph, path, training):
    is_training = tf1.placeholder(tf.bool, []) if training == 'tensor' else True
    backend = CollectiveBackend(timeout=30)

    def layer(x):
        if is_training is True:
            return PATHS[path](x, backend)
        return tf.cond(is_training, lambda: PATHS[path](x, backend), lambda: x)

    net = build_towers(layer, 2, (None, 4, 3))
    tf.gradients(net['loss'], net['xs'])
    graphs = _graphs(graph)
    callers = _callers(graphs)
    check = graph.get_operation_by_name('tf1_syncbn_check_towers')
    watchdog = graph.get_operation_by_name('tf1_syncbn_step_watchdog')
    collectives = [op for g in graphs for op in g.get_operations()
                   if op.type == 'CollectiveReduce']
    assert len(collectives) >= 4, [op.name for op in collectives]   # 2 towers x 2 directions
    for op in collectives:
        ancestors = _ancestors(op, callers)
        assert check in ancestors and watchdog in ancestors, op.name


# The TF1-behaviour pass: the non-fused path and renorm (tf_behavior.pick).
@pytest.mark.parametrize('path', tf_behavior.pick(sorted(p for p in PATHS if p != 'fast'),
                                                  ['fused=False', 'renorm']))
def test_a_tower_that_skips_a_slow_path_layer_fails_within_the_timeout(graph, path):
    """The fast path's guarantee (test_step_watchdog) holds for every other path too."""
    xs, ys = towers_skipping_a_layer(CollectiveBackend(timeout=2), layer=PATHS[path])
    feed = {x: np.ones((4, 4, 3), np.float32) for x in xs}
    assert_first_run_fails(graph, ys, feed, tf.errors.DeadlineExceededError, 'ran more than 2 s',
                           devices=2, within=60)


def _count_in_graph_def(graph, op_types):
    """Ops of these types in the graph and in every function of its library."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return sum(1 for node in nodes if node.op in op_types)


def test_one_check_and_one_watchdog_per_graph_and_host_under_a_tensor_is_training(graph):
    """Layers x towers x tf.cond branches used to build one check and one watchdog each."""
    is_training = tf1.placeholder(tf.bool, [])

    def net(x):
        for i in range(5):
            x = sync_batch_norm(x, is_training=is_training, scope='bn%d' % i,
                                sync_statistics=CollectiveBackend(timeout=30))
        return x

    towers = build_towers(net, 4, (None, 3))
    tf.gradients(towers['loss'], towers['xs'])
    assert _count_in_graph_def(graph, ('PyFunc', 'EagerPyFunc')) == 0
    assert sum(1 for node in graph.as_graph_def().node
               if node.name == 'tf1_syncbn_check_towers' and node.op == 'Assert') == 1
    assert _count_in_graph_def(graph, ('SyncBnStepWatchdog',)) == 1
    # And it runs: training and inference steps of the same graph.
    feed = {x: np.random.RandomState(0).randn(3, 3).astype(np.float32) for x in towers['xs']}
    with make_session(graph, 4) as sess:
        sess.run(tf1.global_variables_initializer())
        for value in (True, False, True):
            sess.run(towers['ys'], {**feed, is_training: value})


@pytest.mark.parametrize('timeout', [float('inf'), 1e30])
def test_an_infinite_or_huge_timeout_never_aborts_a_step(graph, timeout):
    """inf used to overflow the watchdog's int64 nanoseconds: every step aborted after 0.04 s."""
    net = build_towers(lambda x: sync_batch_norm(
        x, sync_statistics=CollectiveBackend(timeout=timeout)), 2, (None, 3))
    # The library itself clamps too, whatever the Python side passes.
    with tf.device('/cpu:0'):
        raw = kernels.library().sync_bn_step_watchdog(timeout_seconds=timeout, message='x')
        slow = tf1.py_func(lambda: time.sleep(0.3) or np.float32(0), [], tf.float32)
    with tf.control_dependencies([raw, slow]):
        ys = [tf.identity(y) for y in net['ys']]
    feed = {x: np.ones((2, 3), np.float32) for x in net['xs']}
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(3):
            sess.run(ys, feed)


@pytest.mark.parametrize('training', ['python', 'tensor'])
def test_every_tower_reads_the_renorm_statistics_before_its_all_reduce(graph, training):
    """Else a tower could read them after the main tower's update in the same step.

    The main tower updates ``renorm_mean`` and ``renorm_stddev`` after the
    forward all-reduce; every tower must have read them before it (a race seen
    with a tensor ``is_training`` on 3 towers: some steps of towers 1 and 2
    used the updated values).
    """
    is_training = tf1.placeholder(tf.bool, []) if training == 'tensor' else True
    net = build_towers(lambda x: sync_batch_norm(x, renorm=True, is_training=is_training,
                                                 sync_statistics=CollectiveBackend(30)),
                       3, (None, 3))
    tf.gradients(net['loss'], net['xs'])
    graphs = _graphs(graph)
    callers = _callers(graphs)
    forward = {(getattr(g, 'name', ''), op.name): op for g in graphs for op in g.get_operations()
               if op.type == 'CollectiveReduce' and 'gradients' not in op.name
               and 'grad' not in getattr(g, 'name', '')}.values()
    assert len(forward) == 3
    for op in forward:
        # (TF1 behaviour reads reference variables into a Snapshot: a copy.)
        reads = [a for a in _ancestors(op, callers) if a.type in ('ReadVariableOp', 'Snapshot')]
        assert len(reads) >= 2, (op.name, [a.name for a in reads])

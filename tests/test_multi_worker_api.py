"""tf1_syncbn.distributed in one process: cluster resolution, configs, checks, one worker.

What needs several processes is in test_multi_worker_training.py.
"""

import json
import os
import socket
import threading

import numpy as np
import pytest
import tensorflow as tf

from conftest import make_session
from tf1_syncbn import distributed as dist
from tower import TowerContext, average_gradients, call_for_each_tower

tf1 = tf.compat.v1


@pytest.fixture
def no_tf_config(monkeypatch):
    monkeypatch.delenv('TF_CONFIG', raising=False)


def set_tf_config(monkeypatch, cluster, task_type, index):
    monkeypatch.setenv('TF_CONFIG', json.dumps({'cluster': cluster,
                                               'task': {'type': task_type, 'index': index}}))


def test_without_tf_config_the_cluster_is_this_process(no_tf_config):
    cluster = dist.setup_cluster(towers=3)
    assert cluster.server is None and cluster.target == ''
    assert (cluster.num_workers, cluster.rank, cluster.is_chief) == (1, 0, True)
    assert cluster.tower_devices == ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2']
    assert cluster.config.device_count['CPU'] == 3
    assert not cluster.config.device_filters
    assert cluster.backend().num_workers == 1


def test_tf_config_with_a_chief(monkeypatch):
    spec = {'chief': ['c:1'], 'worker': ['w0:2', 'w1:3'], 'evaluator': ['e:4']}
    set_tf_config(monkeypatch, spec, 'worker', 1)
    resolved = dist._resolve(None, None)
    assert resolved == ({'chief': ['c:1'], 'worker': ['w0:2', 'w1:3']}, 'worker', 1)
    jobs = [('chief', 0), ('worker', 0), ('worker', 1)]
    config = dist.session_config(2, 'CPU', jobs, rank=2)
    assert config.experimental.collective_group_leader == '/job:chief/replica:0/task:0'
    assert list(config.device_filters) == ['/job:worker/task:1']
    assert config.device_count['CPU'] == 2
    assert dist._tower_devices(jobs, 2, 2, 'CPU', False) == [
        '/job:worker/replica:0/task:1/device:CPU:0', '/job:worker/replica:0/task:1/device:CPU:1']


def test_hosts_and_task(no_tf_config):
    assert dist._resolve('h0:1,h1:2', 1) == ({'worker': ['h0:1', 'h1:2']}, 'worker', 1)
    config = dist.session_config(1, 'GPU', [('worker', 0), ('worker', 1)], rank=0,
                                 config=tf1.ConfigProto(allow_soft_placement=True))
    assert config.allow_soft_placement
    assert 'CPU' not in config.device_count
    assert list(config.device_filters) == ['/job:worker/task:0']


@pytest.mark.parametrize('kwargs, match', [
    (dict(hosts=['h0:1', 'h1:2'], task=2), 'task must be an int in'),
    (dict(hosts=['h0:1', 'nohost'], task=0), 'host:port'),
    (dict(hosts=[], task=0), 'hosts is empty'),
    (dict(task=1), 'needs hosts'),
    (dict(towers=0), 'towers must be a positive int'),
    (dict(device_type='TPU'), 'device_type'),
    (dict(collective_timeout=-1), 'collective_timeout'),
    (dict(startup_timeout=0), 'startup_timeout'),
])
def test_bad_arguments_are_named(no_tf_config, kwargs, match):
    with pytest.raises(ValueError, match=match):
        dist.setup_cluster(**kwargs)


@pytest.mark.parametrize('spec, task_type, match', [
    ({'worker': ['a:1'], 'ps': ['b:2']}, 'worker', 'parameter servers'),
    ({'worker': ['a:1'], 'evaluator': ['b:2']}, 'evaluator', 'not a training worker'),
    ({'worker': ['a:1', 'b:2']}, 'chief', 'not a training worker|not in'),
])
def test_bad_tf_config_is_named(monkeypatch, spec, task_type, match):
    set_tf_config(monkeypatch, spec, task_type, 0)
    with pytest.raises(ValueError, match=match):
        dist.setup_cluster()


def _fake_cluster(addresses, rank=0):
    jobs = [('worker', i) for i in range(len(addresses))]
    return dist.Cluster(None, tf1.ConfigProto(), addresses, jobs, rank, 1,
                        ['/device:CPU:0'], 'CPU', 5.0, 0.5)


def test_a_peer_that_does_not_listen_is_named():
    listening = socket.socket()
    listening.bind(('localhost', 0))
    listening.listen(1)
    from tf1_syncbn.launch import free_ports
    missing = 'localhost:%d' % free_ports(1)[0]
    try:
        cluster = _fake_cluster(['localhost:%d' % listening.getsockname()[1], missing, missing],
                                rank=1)
        with pytest.raises(dist.PeerMissingError) as info:
            dist.wait_for_peers(cluster, timeout=0.3)
    finally:
        listening.close()
    assert info.value.missing == ['worker 2 (%s)' % missing]
    expected = ('worker 1 (%s): worker 2 (%s) did not answer within the start-up timeout of '
                '0.3 s' % (missing, missing))
    assert expected in str(info.value)


def test_buckets_split_by_dtype_and_size_in_order():
    with tf.Graph().as_default():
        items = [(i, tf.zeros(shape, dtype)) for i, (shape, dtype) in enumerate(
            [([4], tf.float32), ([2], tf.float16), ([3], tf.float32), ([10], tf.float32),
             ([1], tf.float32), ([2], tf.float16)])]
        buckets = dist._buckets(items, bucket_bytes=28)
    assert [(dtype, [i for i, _ in bucket]) for dtype, bucket in buckets] == [
        (tf.float32, [0, 2]), (tf.float32, [3]), (tf.float32, [4]), (tf.float16, [1, 5])]


def test_summary_of_a_collective_error():
    error = tf.errors.DeadlineExceededError(None, None, (
        'Graph execution error:\n\nDetected at node \'x\' defined at\n  File "a.py"\n'
        'From /job:worker/replica:0/task:0:\nCollective has timed out waiting for other '
        'workers.\n\t [[{{node CollectiveReduce}}]]'))
    assert dist._summarize(error) == ('DeadlineExceededError: Collective has timed out waiting '
                                      'for other workers.')


def test_a_collective_name_used_twice_in_a_graph_is_an_error():
    with tf.Graph().as_default() as graph:
        dist._instance_key(graph, 'grads', 'bucket/0')
        with pytest.raises(ValueError, match="name 'grads' is already used"):
            dist._instance_key(graph, 'grads', 'bucket/0')


def _tower_model(devices, optimizer):
    """Two variables, one with a sparse gradient; returns (tower gradient lists, vars)."""
    with tf.device(devices[0]):
        w = tf1.get_variable('w', initializer=tf.constant([[1.0, -2.0], [0.5, 3.0]]))
        table = tf1.get_variable('table', initializer=tf.constant(np.arange(8.0).reshape(4, 2),
                                                                   tf.float32))

    def tower():
        from tower import get_current_tower_context
        i = get_current_tower_context().index
        x = tf.constant([[1.0 + i, 2.0]])
        loss = tf.reduce_sum(tf.matmul(x, w) ** 2) + tf.reduce_sum(tf.gather(table, [i, 3]))
        return optimizer.compute_gradients(loss, [w, table])
    return call_for_each_tower(tower, devices), [w, table]


def test_distributed_optimizer_on_one_worker_is_the_in_graph_average(graph):
    devices = ['/cpu:0', '/cpu:1']
    sgd = tf1.train.GradientDescentOptimizer(0.1)
    opt = dist.DistributedOptimizer(sgd)
    tower_grads, (w, table) = _tower_model(devices, opt)
    assert isinstance(tower_grads[0][1][0], tf.IndexedSlices)     # the tower's own, sparse
    expected = average_gradients(tower_grads)
    train_op = opt.apply_gradients(tower_grads)
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        before = sess.run([w, table])
        grads = sess.run([tf.convert_to_tensor(g) for g, _ in expected])
        sess.run(train_op)
        after = sess.run([w, table])
    for b, g, a in zip(before, grads, after):
        np.testing.assert_allclose(a, b - 0.1 * g, rtol=1e-6)


def test_distributed_optimizer_rejects_unreduced_tower_gradients(graph):
    opt = dist.DistributedOptimizer(tf1.train.GradientDescentOptimizer(0.1))
    tower_grads, _ = _tower_model(['/cpu:0', '/cpu:1'], opt)
    with pytest.raises(ValueError, match="pass the list of every tower's"):
        opt.apply_gradients(tower_grads[0])


def test_distributed_optimizer_minimize_outside_towers(graph):
    w = tf1.get_variable('w', initializer=tf.constant([2.0]))
    opt = dist.DistributedOptimizer(tf1.train.MomentumOptimizer(0.5, 0.9))
    train_op = opt.minimize(tf.reduce_sum(w * w))
    assert opt.get_slot(w, 'momentum') is not None
    assert opt.get_slot_names() == ['momentum']
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op)
        np.testing.assert_allclose(sess.run(w), [2.0 - 0.5 * 4.0])


def test_distributed_optimizer_needs_an_optimizer():
    with pytest.raises(TypeError, match='tf.compat.v1.train.Optimizer'):
        dist.DistributedOptimizer(object())


def test_sparse_as_dense_on_one_worker(graph):
    opt = tf1.train.GradientDescentOptimizer(0.1)
    tower_grads, _ = _tower_model(['/cpu:0', '/cpu:1'], opt)
    dense = dist.all_reduce_gradients(tower_grads, sparse_as_dense=True)
    sparse = dist.all_reduce_gradients(tower_grads)
    assert isinstance(sparse[1][0], tf.IndexedSlices)
    assert not isinstance(dense[1][0], tf.IndexedSlices)
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        a, b = sess.run([dense[1][0], tf.convert_to_tensor(sparse[1][0])])
    np.testing.assert_allclose(a, b)


def test_one_worker_broadcast_and_metrics_are_no_ops(graph):
    v = tf1.get_variable('v', initializer=tf.constant([1.0]))
    assert dist.broadcast_variables([v], None).type == 'NoOp'
    cluster = _fake_cluster(['localhost:1'])
    assert dist.broadcast_variables([v], cluster).type == 'NoOp'
    x = tf.constant(2, tf.int32)
    out, = dist.average_across_workers([x], None)
    assert out.dtype == tf.float32


def test_worker_session_on_one_worker_saves_and_resumes(no_tf_config, tmp_path):
    cluster = dist.setup_cluster(towers=2)
    ckpt = str(tmp_path / 'ckpt')

    def build():
        graph = tf.Graph()
        with graph.as_default():
            step = tf1.train.get_or_create_global_step()
            v = tf1.get_variable('v', initializer=tf.constant([1.0, 2.0]))
            train = tf.group(v.assign_add([1.0, 1.0]), step.assign_add(1))
        return graph, v, train

    graph, v, train = build()
    with dist.WorkerSession(cluster, checkpoint_dir=ckpt, graph=graph) as session:
        assert session.start_step == 0 and session.restored_from is None
        for _ in range(3):
            session.run(train)
        assert session.save().endswith('model.ckpt-3')
        session.run(train)
    calls = []
    graph, v, train = build()
    with dist.WorkerSession(cluster, checkpoint_dir=ckpt, graph=graph,
                            init_fn=calls.append) as session:
        assert session.start_step == 3 and session.restored_from.endswith('model.ckpt-3')
        np.testing.assert_allclose(session.session.run(v), [4.0, 5.0])
    assert calls == []          # init_fn only runs when nothing was restored
    graph, v, train = build()
    with dist.WorkerSession(cluster, checkpoint_dir=ckpt, graph=graph, restore=False,
                            init_fn=lambda s: s.run(v.assign([7.0, 7.0]))) as session:
        assert session.start_step == 0
        np.testing.assert_allclose(session.session.run(v), [7.0, 7.0])
    assert sorted(os.listdir(ckpt))[0] == 'checkpoint'
    assert not [t for t in threading.enumerate() if t.name == 'tf1_syncbn-watchdog']


def test_worker_session_single_worker_errors_are_tensorflows(no_tf_config):
    cluster = dist.setup_cluster(towers=1)
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [1])
        check = tf.debugging.assert_positive(x)
    with dist.WorkerSession(cluster, graph=graph) as session:
        with pytest.raises(tf.errors.InvalidArgumentError):
            session.run(check, {x: [-1.0]})


def test_towers_built_by_hand_work_too(graph):
    # TowerContext directly, as a user of tensorpack-style loops would.
    opt = dist.DistributedOptimizer(tf1.train.GradientDescentOptimizer(1.0))
    with tf.device('/cpu:0'):
        w = tf1.get_variable('w', initializer=tf.constant([1.0]))
    tower_grads = []
    for i in range(2):
        with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i, total=2):
            tower_grads.append(opt.compute_gradients(w * float(i + 1)))
    train_op = opt.apply_gradients(tower_grads)
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op)
        np.testing.assert_allclose(sess.run(w), [1.0 - 1.5])

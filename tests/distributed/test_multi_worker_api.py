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
from tf1_syncbn.distributed import cluster as dist_cluster
from tf1_syncbn.distributed import collectives as dist_collectives
from tf1_syncbn.distributed import session as dist_session
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
    resolved = dist_cluster._resolve(None, None)
    assert resolved == ({'chief': ['c:1'], 'worker': ['w0:2', 'w1:3']}, 'worker', 1)
    jobs = [('chief', 0), ('worker', 0), ('worker', 1)]
    config = dist.session_config(2, 'CPU', jobs, rank=2)
    assert config.experimental.collective_group_leader == '/job:chief/replica:0/task:0'
    assert list(config.device_filters) == ['/job:worker/task:1']
    assert config.device_count['CPU'] == 2
    assert dist_cluster._tower_devices(jobs, 2, 2, 'CPU', False) == [
        '/job:worker/replica:0/task:1/device:CPU:0', '/job:worker/replica:0/task:1/device:CPU:1']


def test_hosts_and_task(no_tf_config):
    assert dist_cluster._resolve('h0:1,h1:2', 1) == ({'worker': ['h0:1', 'h1:2']}, 'worker', 1)
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
    (dict(collective_timeout=float('nan')), 'collective_timeout'),
    (dict(collective_timeout='60'), 'collective_timeout'),
    (dict(startup_timeout=0), 'startup_timeout'),
    (dict(startup_timeout=float('inf')), 'startup_timeout'),
    (dict(startup_timeout=True), 'startup_timeout'),
    (dict(communication_hint='fast'), "communication_hint must be 'auto', 'ring' or 'nccl'"),
    (dict(communication_hint='nccl'), "communication_hint='nccl' needs device_type='GPU'"),
    (dict(gpu_memory_growth='yes'), 'gpu_memory_growth must be True, False or None'),
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
        buckets = dist_collectives._buckets(items, bucket_bytes=28)
    assert [(dtype, [i for i, _ in bucket]) for dtype, bucket in buckets] == [
        (tf.float32, [0, 2]), (tf.float32, [3]), (tf.float32, [4]), (tf.float16, [1, 5])]


def test_summary_of_a_collective_error():
    error = tf.errors.DeadlineExceededError(None, None, (
        'Graph execution error:\n\nDetected at node \'x\' defined at\n  File "a.py"\n'
        'From /job:worker/replica:0/task:0:\nCollective has timed out waiting for other '
        'workers.\n\t [[{{node CollectiveReduce}}]]'))
    assert dist_session._summarize(error) == (
        'DeadlineExceededError: Collective has timed out waiting for other workers.')


def test_a_collective_name_used_twice_in_a_graph_is_an_error():
    with tf.Graph().as_default() as graph:
        dist_collectives._instance_key(graph, 'grads', 'bucket/0')
        with pytest.raises(ValueError, match="name 'grads' is already used"):
            dist_collectives._instance_key(graph, 'grads', 'bucket/0')


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


def _counting_graph(initial, increment):
    """``(graph, v, train)``: ``train`` adds ``increment`` to ``v`` and 1 to the global step."""
    graph = tf.Graph()
    with graph.as_default():
        step = tf1.train.get_or_create_global_step()
        v = tf1.get_variable('v', initializer=tf.constant(initial))
        train = tf.group(v.assign_add(increment), step.assign_add(1))
    return graph, v, train


def test_worker_session_on_one_worker_saves_and_resumes(no_tf_config, tmp_path):
    cluster = dist.setup_cluster(towers=2)
    ckpt = str(tmp_path / 'ckpt')

    def build():
        return _counting_graph([1.0, 2.0], [1.0, 1.0])

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


def _half_write(prefix, part):
    """Leaves checkpoint ``prefix`` as a kill during its write would: ``part`` cut or gone."""
    path = prefix + ('.index' if part == 'index' else '.data-00000-of-00001')
    if part == 'index':
        os.remove(path)
    else:
        with open(path, 'r+b') as f:
            f.truncate(os.path.getsize(path) // 2)


def test_worker_session_never_resumes_from_a_half_written_checkpoint(no_tf_config, tmp_path,
                                                                     monkeypatch, capsys):
    # The state file names checkpoints 2, 4 and 6; 6 is half-written (its data
    # cut short, or its index missing), so the chief restores 4, says so,
    # and prints the start line the restarting launcher logs.
    from tf1_syncbn.launch.restarts import RESTART_COUNT_ENV, parse_start_line
    cluster = dist.setup_cluster(towers=1)

    def build():
        return _counting_graph([0.0, 0.0], [1.0, 2.0])

    def saved(directory, part):
        graph, v, train = build()
        with dist.WorkerSession(cluster, checkpoint_dir=directory, graph=graph) as session:
            for _ in range(3):
                session.run([train])
                session.run([train])
                path = session.save()
        _half_write(path, part)
        return path

    monkeypatch.setenv(RESTART_COUNT_ENV, '1')
    for part in ('data', 'index'):
        directory = str(tmp_path / part)
        broken = saved(directory, part)
        capsys.readouterr()
        graph, v, train = build()
        with dist.WorkerSession(cluster, checkpoint_dir=directory, graph=graph,
                                init_fn=lambda s: pytest.fail('init_fn ran')) as session:
            assert session.start_step == 4, part
            assert session.restored_from == os.path.join(directory, 'model.ckpt-4')
            np.testing.assert_allclose(session.session.run(v), [4.0, 8.0])
        err = capsys.readouterr().err
        start = [parse_start_line(line) for line in err.splitlines() if parse_start_line(line)]
        assert start == [{'step': 4, 'checkpoint': session.restored_from,
                          'directory': None}], err
        assert broken.endswith('model.ckpt-6')
    # Every checkpoint listed is half-written: an error naming each, never a
    # fresh start in their place.
    directory = str(tmp_path / 'all')
    saved(directory, 'data')
    for step in (2, 4):
        _half_write(os.path.join(directory, 'model.ckpt-%d' % step), 'index')
    graph, v, train = build()
    with pytest.raises(RuntimeError, match='none of the checkpoints') as error:
        dist.WorkerSession(cluster, checkpoint_dir=directory, graph=graph)
    for step in (2, 4, 6):
        assert 'model.ckpt-%d (' % step in str(error.value)


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


def test_collective_timeout_goes_through_validate_timeout(no_tf_config):
    assert dist.setup_cluster(collective_timeout=float('inf')).collective_timeout == 0.0
    assert dist.setup_cluster(collective_timeout=1e30).collective_timeout == 1e9
    assert dist.setup_cluster(collective_timeout=7).backend().timeout == 7.0


# --- GPUs (on CPU: the configs produced, with the GPU count and the server faked) --------

class FakeServer(object):
    """Stands in for tf.distribute.Server: records what it was started with."""
    started = []

    def __init__(self, cluster_spec, job_name, task_index, config, start):
        self.cluster_spec, self.job_name, self.task_index = cluster_spec, job_name, task_index
        self.config, self.target = config, 'grpc://fake:%d' % task_index
        FakeServer.started.append(self)


@pytest.fixture
def fake_gpus(monkeypatch, no_tf_config):
    """``fake_gpus(n)``: this process sees n GPUs; servers are not started."""
    real = tf.config.list_physical_devices
    monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
    monkeypatch.setattr(tf.distribute, 'Server', FakeServer)
    FakeServer.started = []

    def see(n):
        devices = [tf.config.PhysicalDevice('/physical_device:GPU:%d' % i, 'GPU')
                   for i in range(n)]
        monkeypatch.setattr(tf.config, 'list_physical_devices',
                            lambda kind=None: devices if kind == 'GPU' else real(kind))
    return see


# Workers 0, 2 and 3 on host h0 (spelled with and without capitals), worker 1 on h1.
HOSTS = ['h0:2222', 'h1:2222', 'H0:2223', 'h0:2224']


def test_local_rank_counts_the_workers_of_the_same_host():
    assert [dist.local_rank(HOSTS, r) for r in range(4)] == [0, 0, 1, 2]
    assert [dist.local_rank(['localhost:1', '127.0.0.1:2', '[::1]:3'], r)
            for r in range(3)] == [0, 1, 2]
    assert dist.local_rank([], 0) == 0


def test_each_local_gpu_worker_gets_its_own_gpus(fake_gpus):
    fake_gpus(6)
    expected = ['0,1', '0,1', '2,3', '4,5']
    for rank in range(4):
        cluster = dist.setup_cluster(towers=2, hosts=HOSTS, task=rank, device_type='GPU')
        assert cluster.local_rank == [0, 0, 1, 2][rank]
        assert cluster.config.gpu_options.visible_device_list == expected[rank]
        # The server runs with the same GPUs as the sessions.
        assert FakeServer.started[-1].config.gpu_options.visible_device_list == expected[rank]
        # visible_device_list renumbers: the towers are GPU:0 and GPU:1 in every process.
        assert cluster.tower_devices == ['/job:worker/replica:0/task:%d/device:GPU:%d' % (rank, i)
                                         for i in range(2)]
        assert 'CPU' not in cluster.config.device_count
        assert not cluster.config.gpu_options.allow_growth


def test_one_gpu_worker_alone_takes_the_first_gpus(fake_gpus):
    fake_gpus(4)
    cluster = dist.setup_cluster(towers=3, device_type='GPU')
    assert cluster.config.gpu_options.visible_device_list == '0,1,2'
    assert cluster.tower_devices == ['/device:GPU:0', '/device:GPU:1', '/device:GPU:2']
    assert FakeServer.started == []


def test_cuda_visible_devices_has_already_chosen_the_gpus(fake_gpus, monkeypatch):
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '6,7')
    fake_gpus(2)                       # what the process sees through CUDA_VISIBLE_DEVICES
    cluster = dist.setup_cluster(towers=2, hosts=HOSTS, task=3, device_type='GPU')
    assert cluster.config.gpu_options.visible_device_list == '0,1'


def test_a_visible_device_list_in_the_users_config_is_kept(fake_gpus):
    fake_gpus(4)
    config = tf1.ConfigProto()
    config.gpu_options.visible_device_list = '3'
    cluster = dist.setup_cluster(towers=1, hosts=HOSTS, task=2, device_type='GPU',
                                 config=config)
    assert cluster.config.gpu_options.visible_device_list == '3'
    config.gpu_options.visible_device_list = '0'
    with pytest.raises(ValueError, match='needs 2 GPUs, but config.gpu_options'):
        dist.setup_cluster(towers=2, hosts=HOSTS, task=2, device_type='GPU', config=config)


def test_memory_growth_option(fake_gpus):
    fake_gpus(2)
    assert dist.setup_cluster(towers=2, device_type='GPU',
                              gpu_memory_growth=True).config.gpu_options.allow_growth
    config = tf1.ConfigProto()
    config.gpu_options.allow_growth = True
    assert dist.setup_cluster(towers=2, device_type='GPU',
                              config=config).config.gpu_options.allow_growth
    assert not dist.setup_cluster(towers=2, device_type='GPU', config=config,
                                  gpu_memory_growth=False).config.gpu_options.allow_growth


@pytest.mark.parametrize('seen, cuda_visible, match', [
    (4, None, r"worker 3 \(h0:2224\) with device_type='GPU' and towers=2 needs 6 GPUs "
              r"\(local rank 2: worker 2 on its host, so GPUs 4 to 5\), but this process "
              r"sees 4\. .*--gpus-per-worker 2"),
    (1, '3,4', r"worker 3 \(h0:2224\) .* needs 2 GPUs \(CUDA_VISIBLE_DEVICES='3,4'\), but "
               r"this process sees 1\."),
    (0, '9', r"needs 2 GPUs .* sees 0\. A TensorFlow build without GPU support"),
])
def test_a_gpu_worker_that_does_not_see_its_gpus_is_an_error(fake_gpus, monkeypatch, seen,
                                                             cuda_visible, match):
    if cuda_visible is not None:
        monkeypatch.setenv('CUDA_VISIBLE_DEVICES', cuda_visible)
    fake_gpus(seen)
    with pytest.raises(ValueError, match=match):
        dist.setup_cluster(towers=2, hosts=HOSTS, task=3, device_type='GPU')
    assert FakeServer.started == []           # the error comes before the server starts


# --- communication_hint ------------------------------------------------------------------

def _collective_ops(graph):
    return [op for op in graph.get_operations() if op.type.startswith('Collective')]


@pytest.mark.parametrize('device_type, hint', [('CPU', 'ring'), ('GPU', 'nccl')])
@pytest.mark.parametrize('rank', [0, 1])
def test_every_cross_worker_collective_carries_the_communication_hint(device_type, hint, rank):
    addresses = ['localhost:1', 'localhost:2']
    cluster = dist.Cluster(None, tf1.ConfigProto(), addresses,
                           [('worker', 0), ('worker', 1)], rank, 2,
                           dist_cluster._tower_devices([('worker', 0), ('worker', 1)], rank, 2,
                                               device_type, False),
                           device_type, 5.0, 1.0, communication_hint=hint)
    assert cluster.backend().communication_hint == hint
    assert cluster.backend(communication_hint='auto').communication_hint == 'auto'
    graph = tf.Graph()
    with graph.as_default():
        opt = tf1.train.GradientDescentOptimizer(0.1)
        tower_grads, variables = _tower_model(cluster.tower_devices, opt)

        def dynamic_tower():
            ids = tf1.placeholder(tf.int32, [None])
            return [(tf.IndexedSlices(tf.gather(variables[1], ids), ids,
                                      tf.constant([4, 2])), variables[1])]
        dynamic = call_for_each_tower(dynamic_tower, cluster.tower_devices)
        dist.all_reduce_gradients(tower_grads, cluster, name='static')
        dist.all_reduce_gradients(dynamic, cluster, name='dynamic')
        dist.average_across_workers([tf.constant(1.0)], cluster)
        dist.broadcast_variables(variables, cluster)
    ops = _collective_ops(graph)
    kinds = {op.type for op in ops}
    assert {'CollectiveReduce', 'CollectiveGather',
            'CollectiveBcastSend' if rank == 0 else 'CollectiveBcastRecv'} <= kinds, kinds
    assert {op.get_attr('communication_hint') for op in ops} == {hint.encode()}


def test_the_batch_norm_backend_of_a_cluster_carries_the_hint(graph):
    from tf1_syncbn import sync_batch_norm
    jobs = [('worker', 0), ('worker', 1)]
    cluster = dist.Cluster(None, tf1.ConfigProto(), ['localhost:1', 'localhost:2'], jobs, 0, 2,
                           dist_cluster._tower_devices(jobs, 0, 2, 'CPU', False), 'CPU', 5.0, 1.0,
                           communication_hint='ring')
    x = tf1.placeholder(tf.float32, [4, 3])
    outputs = call_for_each_tower(
        lambda: sync_batch_norm(x, is_training=True, sync_statistics=cluster.backend()),
        cluster.tower_devices)
    tf.gradients(tf.add_n([tf.reduce_sum(y) for y in outputs]), x)
    ops = [op for op in _collective_ops(graph) if op.type == 'CollectiveReduce']
    assert len(ops) == 4                      # forward and backward, two towers
    assert {op.get_attr('communication_hint') for op in ops} == {b'ring'}
    assert {op.get_attr('group_size') for op in ops} == {4}   # 2 workers x 2 towers


def test_cluster_checks_its_communication_hint():
    with pytest.raises(ValueError, match="Cluster: communication_hint must be"):
        dist.Cluster(None, tf1.ConfigProto(), [], [('worker', 0)], 0, 1, ['/device:CPU:0'],
                     'CPU', 5.0, 1.0, communication_hint='NCCL')


# --- WorkerSession start-up timeouts -----------------------------------------------------

def _session_without_start(monkeypatch, rank, **kwargs):
    """A WorkerSession of a 2-worker cluster, built but not started (no server needed)."""
    monkeypatch.setattr(dist.WorkerSession, '_start', lambda self: None)
    cluster = _fake_cluster(['localhost:1', 'localhost:2'], rank=rank)   # startup_timeout 0.5
    graph = tf.Graph()
    with graph.as_default():
        tf1.get_variable('v', initializer=tf.constant([1.0, 2.0]))
    return dist.WorkerSession(cluster, graph=graph, **kwargs), graph


@pytest.mark.parametrize('rank, restore_timeout, expected', [
    (0, 30.0, 0.5),            # the chief: only the start-up timeout
    (1, 30.0, 30.5),           # the others wait for the chief's restore too
    (1, None, 0.5 + dist.DEFAULT_RESTORE_TIMEOUT),
    (1, 0, 0.5),
])
def test_the_other_workers_broadcast_waits_for_the_chiefs_restore(monkeypatch, rank,
                                                                  restore_timeout, expected):
    kwargs = {} if restore_timeout is None else {'restore_timeout': restore_timeout}
    session, graph = _session_without_start(monkeypatch, rank, **kwargs)
    try:
        assert session.broadcast_timeout == expected
        ops = [op for op in _collective_ops(graph) if op.type.startswith('CollectiveBcast')]
        assert ops and {op.get_attr('timeout_seconds') for op in ops} == {expected}
    finally:
        session.close()


def test_the_hang_watchdog_allows_for_the_restore(monkeypatch):
    session, _ = _session_without_start(monkeypatch, 1, restore_timeout=100)
    session.close()
    assert session.hang_limit == 2 * 0.5 + 30 + 100
    session, _ = _session_without_start(monkeypatch, 1, restore_timeout=100, hang_timeout=6)
    session.close()
    assert session.hang_limit == 106


@pytest.mark.parametrize('kwargs, match', [
    (dict(restore_timeout=-1), 'WorkerSession: restore_timeout must be a finite number'),
    (dict(restore_timeout=float('inf')), 'restore_timeout must be a finite'),
    (dict(restore_timeout=float('nan')), 'restore_timeout must be a finite'),
    (dict(restore_timeout='60'), 'restore_timeout must be a finite'),
    (dict(hang_timeout=0), 'WorkerSession: hang_timeout must be a finite number of seconds > 0'),
    (dict(hang_timeout=float('inf')), 'hang_timeout must be a finite'),
])
def test_worker_session_checks_its_timeouts(monkeypatch, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _session_without_start(monkeypatch, 1, **kwargs)

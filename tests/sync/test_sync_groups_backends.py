"""Sync groups on the other backends and harnesses: graph structure and refusals.

NCCL has no CPU kernel and Horovod is not installed here: their graphs are
built (on fake GPUs, with a fake ``horovod.tensorflow``), not run, as
tests/sync/test_sync_communication.py does for NCCL. Under ``MirroredStrategy``
each group equals its reference and the moving statistics are replica 0's
group's.
"""

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_forward
from tf1_syncbn import CollectiveBackend, HorovodBackend, audit_graph, backends, sync_batch_norm
from tower import call_for_each_tower, virtual_cpu_config

tf1 = tf.compat.v1


def _towers(layer, devices):
    xs = []

    def tower():
        x = tf1.placeholder(tf.float32, [None, 3])
        xs.append(x)
        return layer(x)

    ys = call_for_each_tower(tower, devices)
    tf.gradients(tf.add_n([tf.reduce_sum(y) for y in ys]), xs)
    return ys


@pytest.mark.once
def test_nccl_groups_have_their_own_shared_names_and_sizes(graph, monkeypatch):
    monkeypatch.setattr(backends.base, 'physical_gpu_count', lambda: 4)
    _towers(lambda x: sync_batch_norm(x, group_size=2, sync_statistics='nccl'),
            ['/gpu:%d' % i for i in range(4)])
    nccl = [op for op in graph.get_operations() if op.type == 'NcclAllReduce']
    assert len(nccl) == 8 and all(op.get_attr('num_devices') == 2 for op in nccl)
    names = {}
    for op in nccl:
        names.setdefault(op.get_attr('shared_name').decode(), []).append(op.device[-1])
    assert names == {'tf1_syncbn/BatchNorm_0/%s/group%s' % (d, g): list(g[::2])
                     for d in ('forward', 'backward') for g in ('0_1', '2_3')}, names
    layer, = audit_graph(graph).layers
    assert layer.groups == (('tower0', 'tower1'), ('tower2', 'tower3'))


class _FakeHorovod(object):
    """What HorovodBackend calls at graph build: size, rank, allreduce (an identity op)."""

    Sum = 'sum'

    def __init__(self, size, rank):
        self.calls = []
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank

    def allreduce(self, tensor, op, name):
        self.calls.append(name)
        return tf.identity(tensor)


def _horovod(size, rank):
    backend = HorovodBackend.__new__(HorovodBackend)
    backend._hvd = _FakeHorovod(size, rank)
    backend._local = CollectiveBackend()
    return backend


@pytest.mark.once
def test_horovod_groups_within_a_process_are_local_collectives(graph):
    backend = _horovod(size=2, rank=1)
    _towers(lambda x: sync_batch_norm(x, group_size=2, sync_statistics=backend),
            ['/cpu:0', '/cpu:1'])
    reduces = [op for op in graph.get_operations() if op.type == 'CollectiveReduce']
    assert len(reduces) == 4 and all(op.get_attr('group_size') == 2 for op in reduces)
    # No Horovod op in the groups; one to give this process worker 0's group's statistics.
    assert backend._hvd.calls == ['tf1_syncbn.BatchNorm_0.main-statistics']


@pytest.mark.once
def test_horovod_groups_across_processes_are_refused_at_build(graph):
    backend = _horovod(size=2, rank=0)
    with pytest.raises(ValueError, match=r"sync_statistics='horovod' cannot synchronize the "
                                         r"group of towers \[0, 2\]: it spans Horovod "
                                         r'processes.*process set'):
        _towers(lambda x: sync_batch_norm(x, group_size=[[0, 2], [1, 3]],
                                          sync_statistics=backend), ['/cpu:0', '/cpu:1'])


@pytest.mark.once
def test_groups_across_workers_need_the_rank(graph):
    with pytest.raises(ValueError, match=r"needs this worker's rank.*"
                                         r'CollectiveBackend\(num_workers=2, rank='):
        _towers(lambda x: sync_batch_norm(x, group_size=2,
                                          sync_statistics=CollectiveBackend(num_workers=2)),
                ['/cpu:0', '/cpu:1'])


def test_mirrored_strategy_groups_equal_their_references():
    """Replica 0's group feeds the moving statistics (the strategy keeps the first replica's
    updates), on every replica's copy of the variables."""
    graph = tf.Graph()
    xs = []
    with graph.as_default():
        strategy = tf1.distribute.MirroredStrategy(['/cpu:%d' % i for i in range(4)])

        def replica():
            x = tf1.placeholder(tf.float32, [None, 3])
            xs.append(x)
            return sync_batch_norm(x, group_size=2, decay=0.5)

        with strategy.scope():
            ys = strategy.experimental_local_results(strategy.run(replica))
        updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        moving_mean, = [v for v in tf1.global_variables() if 'moving_mean' in v.name]
        init = tf1.global_variables_initializer()
    rng = np.random.RandomState(0)
    parts = [rng.randn(n, 3) * (i + 1) + 3 * i for i, n in enumerate([2, 3, 1, 2])]
    with tf1.Session(graph=graph, config=virtual_cpu_config(4)) as sess:
        sess.run(init)
        got, _ = sess.run([list(ys), updates], dict(zip(xs, parts)))
        copies = sess.run(list(moving_mean.values))
    refs = [bn_forward(np.concatenate(parts[g:g + 2]), np.ones(3), np.zeros(3), 1e-3)
            for g in (0, 2)]
    for g, ref in zip((0, 2), refs):
        np.testing.assert_allclose(np.concatenate(got[g:g + 2]), ref['y'], atol=1e-4)
    for copy in copies:
        np.testing.assert_allclose(copy, 0.5 * refs[0]['mean'], rtol=1e-5, atol=1e-6)

"""One packed all-reduce each way, deterministic keys, and the backends."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_backward, bn_forward, build_towers, count_ops, split_batches, var
from conftest import make_session
from tf1_syncbn import CollectiveBackend, NcclBackend, SyncBackend, backends, sync_batch_norm
from tf1_syncbn.backends import stable_hash
from tower import TowerContext, call_for_each_tower

tf1 = tf.compat.v1
EPS = 1e-3


def _collectives(graph):
    return [op for op in graph.get_operations() if op.type.startswith('CollectiveReduce')]


@pytest.mark.parametrize('num_towers', [2, 4])
def test_one_all_reduce_forward_and_one_backward_per_layer(graph, num_towers):
    def model(x):
        h = sync_batch_norm(x, scope='bn1', sync_statistics='collective')
        return sync_batch_norm(tf.nn.relu(h), scope='bn2', scale=True,
                               sync_statistics='collective')

    net = build_towers(model, num_towers, (None, 4, 4, 3))
    forward = _collectives(graph)
    assert len(forward) == 2 * num_towers
    # Each layer's forward collective sits on its tower's device.
    devices = sorted(op.device for op in forward)
    assert devices == sorted(['/device:CPU:%d' % i for i in range(num_towers)] * 2)
    grads = tf.gradients(net['loss'], net['xs'])
    backward = [op for op in _collectives(graph) if op not in forward]
    assert len(backward) == 2 * num_towers
    # The backward collective is pinned to the forward op's device.
    assert sorted(op.device for op in backward) == devices
    # Instance keys: one per layer and direction, identical on every tower.
    keys = {}
    for op in _collectives(graph):
        keys.setdefault(op.get_attr('instance_key'), []).append(op)
    assert len(keys) == 4
    assert all(len(ops) == num_towers for ops in keys.values())
    assert len({op.get_attr('group_key') for op in _collectives(graph)}) == 1
    # Statistics travel in one float64 vector [n, n*mean, M2 + n*mean^2].
    assert {op.inputs[0].dtype for op in forward} == {tf.float64}
    assert {op.inputs[0].shape.as_list()[0] for op in forward} == {1 + 2 * 3}
    assert {op.inputs[0].shape.as_list()[0] for op in backward} == {2 * 3}
    del grads


def test_single_tower_and_auto_build_no_collective(graph):
    build_towers(lambda x: sync_batch_norm(x), 1, (None, 3))
    with TowerContext('pred', is_training=False):
        sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]), scope='other',
                        sync_statistics='collective')
    sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]), scope='outside', num_dev=1,
                    sync_statistics='collective')
    assert not _collectives(graph)


def test_auto_picks_collective_on_cpu_towers(graph):
    build_towers(lambda x: sync_batch_norm(x), 2, (None, 3))
    assert len(_collectives(graph)) == 2


def test_sync_statistics_none_is_per_tower(graph, rng):
    sizes = [2, 5]
    net = build_towers(lambda x: sync_batch_norm(x, sync_statistics=None, epsilon=EPS), 2,
                       (None, 3))
    assert not _collectives(graph)
    grads = tf.gradients(net['loss'], net['xs'])
    x = rng.randn(7, 3).astype(np.float32)
    dy = rng.randn(7, 3).astype(np.float32)
    feed = dict(zip(net['xs'], split_batches(x, sizes)))
    feed.update(zip(net['dys'], split_batches(dy, sizes)))
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        ys, dxs = sess.run([net['ys'], grads], feed)
    for y, dx, xp, dyp in zip(ys, dxs, split_batches(x, sizes), split_batches(dy, sizes)):
        np.testing.assert_allclose(y, bn_forward(xp, 1.0, 0.0, EPS)['y'], atol=2e-5)
        np.testing.assert_allclose(dx, bn_backward(dyp, xp, np.ones(3), EPS)['dx'], atol=5e-5)


def test_same_scope_twice_in_a_tower_gets_distinct_keys(graph, rng):
    def model(x):
        a = sync_batch_norm(x, scope='bn', epsilon=EPS, sync_statistics=CollectiveBackend(60))
        b = sync_batch_norm(x * 3.0 + 1.0, scope='bn', reuse=True, epsilon=EPS,
                            sync_statistics=CollectiveBackend(60))
        return tf.concat([a, b], axis=0)

    sizes = [2, 3]
    net = build_towers(model, 2, (None, 3))
    assert len({op.get_attr('instance_key') for op in _collectives(graph)}) == 2
    assert len(tf1.global_variables()) == 3  # beta, moving_mean, moving_variance
    x = rng.randn(5, 3).astype(np.float32)
    feed = dict(zip(net['xs'], split_batches(x, sizes)))
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        ys = sess.run(net['ys'], feed)
    first = np.concatenate([y[:s] for y, s in zip(ys, sizes)])
    second = np.concatenate([y[s:] for y, s in zip(ys, sizes)])
    np.testing.assert_allclose(first, bn_forward(x, 1.0, 0.0, EPS)['y'], atol=2e-5)
    np.testing.assert_allclose(second, bn_forward(x * 3 + 1, 1.0, 0.0, EPS)['y'], atol=2e-5)


def test_towers_without_context_use_num_dev_and_name_scopes(graph, rng):
    """The classic multi-GPU script: tf.device + tf.name_scope('tower<i>') + num_dev."""
    xs, ys = [], []
    for i in range(3):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower%d' % i):
            with tf1.variable_scope(tf1.get_variable_scope(), reuse=i > 0):
                x = tf1.placeholder(tf.float32, [None, 2])
                ys.append(sync_batch_norm(x, num_dev=3, decay=0.0, scope='bn',
                                          sync_statistics=CollectiveBackend(60)))
                xs.append(x)
    # Moving averages assigned on tower 0; towers 1 and 2 hold a trigger each.
    assert len(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, 'tower0/')) == 2
    assert len(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)) == 4
    data = rng.randn(9, 2).astype(np.float32)
    with make_session(graph, 3) as sess:
        sess.run(tf1.global_variables_initializer())
        out = sess.run(ys + tf1.get_collection(tf1.GraphKeys.UPDATE_OPS),
                       dict(zip(xs, np.split(data, 3))))
        mv = sess.run(var('bn/moving_variance'))
    np.testing.assert_allclose(np.concatenate(out[:3]), bn_forward(data, 1, 0, 1e-3)['y'],
                               atol=2e-5)
    np.testing.assert_allclose(mv, bn_forward(data, 1, 0, 1e-3)['var_unbiased'], rtol=1e-5)


@pytest.mark.once(reason='a hash of strings in fresh interpreters; no graph is built')
def test_stable_hash_is_the_same_in_every_process():
    code = ('from tf1_syncbn.backends import stable_hash; '
            'print(stable_hash("block1/BatchNorm:0/forward"))')
    outs = set()
    for seed in ('1', '12345'):
        env = dict(os.environ, PYTHONHASHSEED=seed, TF_CPP_MIN_LOG_LEVEL='3')
        outs.add(subprocess.run([sys.executable, '-c', code], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    assert outs == {str(stable_hash('block1/BatchNorm:0/forward'))}
    assert 0 < stable_hash('x') < 2 ** 31


def test_keys_do_not_depend_on_build_order(graph):
    """Tower 1 built first: the keys are derived from names, not from a counter."""
    def build(index):
        with tf.device('/cpu:%d' % index), TowerContext('tower%d' % index, index=index,
                                                          total=2, vs_name='tower%d' % index):
            x = tf1.placeholder(tf.float32, [None, 3])
            sync_batch_norm(x, scope='a', sync_statistics='collective')
            sync_batch_norm(x, scope='b', sync_statistics='collective')

    build(0)
    build(1)
    g2 = tf.Graph()
    with g2.as_default():
        build(1)
        build(0)
    keys1 = sorted(op.get_attr('instance_key') for op in _collectives(graph))
    keys2 = sorted(op.get_attr('instance_key') for op in _collectives(g2))
    assert keys1 == keys2 and len(set(keys1)) == 2


# --- NCCL: graph structure only (no GPU kernel here) ------------------------

@pytest.fixture
def fake_gpus(monkeypatch):
    """Makes the layers believe GPUs are present, to build NCCL graphs on this CPU machine."""
    monkeypatch.setattr(backends.base, 'physical_gpu_count', lambda: 2)


def test_nccl_graph_structure_on_gpu_devices(graph, fake_gpus):
    xs = []

    def tower():
        x = tf1.placeholder(tf.float32, [None, 4, 4, 3])
        xs.append(x)
        return sync_batch_norm(x, scale=True, scope='conv1/BatchNorm', sync_statistics='nccl')

    ys = call_for_each_tower(tower, ['/gpu:0', '/gpu:1'])
    tf.gradients(tf.add_n([tf.reduce_sum(y) for y in ys]), xs)
    nccl = [op for op in graph.get_operations() if op.type == 'NcclAllReduce']
    assert len(nccl) == 4
    names = sorted(op.get_attr('shared_name').decode() for op in nccl)
    assert names == sorted(['tf1_syncbn/conv1/BatchNorm_0/forward'] * 2 +
                           ['tf1_syncbn/conv1/BatchNorm_0/backward'] * 2)
    assert sorted(op.device for op in nccl) == ['/device:GPU:0'] * 2 + ['/device:GPU:1'] * 2
    assert all(op.get_attr('num_devices') == 2 for op in nccl)


def test_auto_picks_nccl_on_gpu_towers(graph, fake_gpus):
    call_for_each_tower(lambda: sync_batch_norm(tf1.placeholder(tf.float32, [None, 3])),
                        ['/gpu:0', '/gpu:1'])
    assert count_ops(graph, 'NcclAllReduce') == 2
    assert not _collectives(graph)


@pytest.mark.skipif(bool(tf.config.list_physical_devices('GPU')),
                    reason='checks the behaviour on a machine without GPUs')
@pytest.mark.parametrize('spec', ['auto', 'collective', 'nccl'])
def test_gpu_towers_without_gpus_fail_at_build(graph, spec):
    # Soft placement would put every tower on CPU:0, where the all-reduce waits
    # for its timeout (and NCCL has no kernel at all): a build error instead.
    with pytest.raises(ValueError, match='this machine has no GPU'):
        call_for_each_tower(lambda: sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]),
                                                    sync_statistics=spec),
                            ['/gpu:0', '/gpu:1'])


def test_nccl_on_cpu_is_a_build_error(graph):
    with pytest.raises(ValueError, match='NCCL has no CPU kernel'):
        build_towers(lambda x: sync_batch_norm(x, sync_statistics='nccl'), 2, (None, 3))


# --- Horovod: what a run under horovodrun cannot show -------------------------
# (tests/with_horovod/ runs the backend with Horovod itself: make test-horovod.)

def test_horovod_missing_is_a_clear_error(graph, monkeypatch):
    monkeypatch.setitem(sys.modules, 'horovod', None)
    monkeypatch.setitem(sys.modules, 'horovod.tensorflow', None)
    with pytest.raises(ValueError, match='horovod'):
        sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]), sync_statistics='horovod')


@pytest.mark.parametrize('environ,seconds', [
    ({}, 0),                                                                # Horovod's default
    ({'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS': '120'}, 120),
    ({'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS': '30'}, 0),                     # < the 60 s check
    ({'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS': '4', 'HOROVOD_STALL_CHECK_TIME_SECONDS': '2'}, 4),
    ({'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS': '4', 'HOROVOD_STALL_CHECK_TIME_SECONDS': '4'}, 4),
    ({'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS': '90s'}, 90),                   # strtol, as Horovod
    ({'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS': 'x'}, 0),
    ({'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS': '120', 'HOROVOD_STALL_CHECK_DISABLE': '1'}, 0),
    ({'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS': '120', 'HOROVOD_STALL_CHECK_DISABLE': '0'}, 120),
])
def test_horovod_stall_shutdown_is_read_as_horovod_reads_it(environ, seconds):
    """What HorovodBackend warns about: whether Horovod would end a stalled job, and when."""
    assert backends.stall_shutdown_seconds(environ) == seconds


def _doubled_statistics(graph, rng, backend):
    """One step of sync_batch_norm on one tower whose ``backend`` pretends a second, identical one.

    Returns:
      ``(output, moving variance, the reference's)``: the output and the
      moving variance that tracks the Bessel-corrected variance of the global
      batch: with two members ``2 n`` examples, which sets it apart from one
      tower's (numpy float64, the data concatenated twice).
    """
    x = tf1.placeholder(tf.float32, [None, 3])
    y = sync_batch_norm(x, epsilon=EPS, decay=0.5, num_dev=1, sync_statistics=backend,
                        updates_collections=None)
    data = rng.randn(5, 3).astype(np.float32)
    ref = bn_forward(np.concatenate([data, data]), 1, 0, EPS)
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        out = sess.run(y, {x: data})
        moving = sess.run(var('BatchNorm/moving_variance'))      # in a run of its own
    return out, ref['y'][:5], moving, 0.5 + 0.5 * ref['var_unbiased']


def test_custom_backend_object(graph, rng):
    class Doubling(SyncBackend):
        """Pretends two identical members, as a user backend could."""
        name = 'doubling'

        def num_members(self, towers):
            return 2 * towers

        def all_reduce(self, tensor, key, direction):
            return tensor * key.num_members

    out, ref, moving, ref_moving = _doubled_statistics(graph, rng, Doubling())
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_allclose(moving, ref_moving, rtol=1e-5)


def test_a_custom_backend_written_for_the_old_interface_still_works(graph, rng):
    """group_size(towers), key.group_size, group_size_attributes: deprecated, not broken."""
    with pytest.warns(DeprecationWarning, match=r'OldDoubling.group_size\(towers\)'):
        class OldDoubling(SyncBackend):
            """A backend written before num_members, with the member count's old names."""
            name = 'old-doubling'
            group_size_attributes = {}

            def group_size(self, towers):
                return 2 * towers

            def all_reduce(self, tensor, key, direction):
                return tensor * key.group_size

    backend = OldDoubling()
    assert backend.num_members(3) == 6 and backend.num_members_attributes == {}
    with pytest.warns(DeprecationWarning, match=r'SyncKey.group_size'):
        out, ref, moving, ref_moving = _doubled_statistics(graph, rng, backend)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_allclose(moving, ref_moving, rtol=1e-5)


def test_the_member_count_keeps_its_old_names_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r'CollectiveBackend.group_size\(towers\)'):
        assert CollectiveBackend(num_workers=3).group_size(2) == 6
    with pytest.warns(DeprecationWarning, match='group_size_attributes'):
        assert NcclBackend().group_size_attributes == {'NcclAllReduce': 'num_devices'}
    # An old override of a library backend reaches its parent's count through the old name.
    with pytest.warns(DeprecationWarning):
        class Tripled(CollectiveBackend):
            def group_size(self, towers):
                return 3 * super().group_size(towers)
    with pytest.warns(DeprecationWarning):
        assert Tripled(num_workers=2).num_members(2) == 12
    key = backends.SyncKey('bn:0', 'tower_0/bn', 4, '/device:CPU:0')
    with pytest.warns(DeprecationWarning, match=r'SyncKey\(group_size=...\)'):
        assert backends.SyncKey(name='bn:0', layer='tower_0/bn', group_size=4,
                                device='/device:CPU:0') == key
    with pytest.warns(DeprecationWarning, match=r'SyncKey._replace\(group_size=...\)'):
        assert key._replace(group_size=2).num_members == 2
    with pytest.warns(DeprecationWarning, match=r'SyncKey.group_size'):
        assert key.group_size == key.num_members == 4


def test_backend_reprs_and_validation():
    assert 'timeout=5.0' in repr(CollectiveBackend(timeout=5))
    assert repr(NcclBackend()) == 'NcclBackend()'
    for bad in (dict(timeout=-1), dict(timeout='1'), dict(communication_hint='x'),
                dict(num_workers=0)):
        with pytest.raises(ValueError):
            CollectiveBackend(**bad)
    assert CollectiveBackend(num_workers=3).num_members(2) == 6


@pytest.mark.parametrize('backend', ['nccl', 'collective', 'auto'])
def test_a_gpu_index_this_process_does_not_have_is_a_build_time_error(graph, fake_gpus, backend):
    """Soft placement would quietly put '/gpu:5' elsewhere, beside another tower."""
    def tower():
        return sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]), sync_statistics=backend)

    with pytest.raises(ValueError, match=r"on /device:GPU:5, but this process sees 2 GPUs "
                                         r"\(GPU:0 to GPU:1\)"):
        call_for_each_tower(tower, ['/gpu:0', '/gpu:5'])


def test_gpu_towers_on_existing_gpus_build(graph, fake_gpus):
    call_for_each_tower(lambda: sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]),
                                                sync_statistics='collective'),
                        ['/gpu:1', '/gpu:0'])
    assert len(_collectives(graph)) == 2


def test_nccl_gets_the_run_time_check_but_no_deadline_as_documented(graph, fake_gpus):
    """The documented limit: NcclAllReduce cannot be aborted, so no watchdog is armed for it.

    The run-time check (towers never built) still guards it; docs/timeouts.md
    ("NCCL has no timeout") says that a tower skipping an NCCL layer at
    run time waits forever, and how to get a timeout on GPUs instead.
    """
    from tf1_syncbn import NcclBackend
    assert NcclBackend().step_timeout() == 0
    call_for_each_tower(lambda: sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]),
                                                sync_statistics='nccl'),
                        ['/gpu:0', '/gpu:1'])
    types = [op.type for op in graph.get_operations()]
    assert types.count('NcclAllReduce') == 2
    assert 'SyncBnStepWatchdog' not in types
    assert types.count('Assert') == 1            # tf1_syncbn_check_towers
    nccl = [op for op in graph.get_operations() if op.type == 'NcclAllReduce']
    check = graph.get_operation_by_name('tf1_syncbn_check_towers')
    assert all(check in op.control_inputs for op in nccl)
    import os  # noqa: PLC0415
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    page = open(os.path.join(root, 'docs', 'timeouts.md')).read()
    assert '## NCCL has no timeout' in page

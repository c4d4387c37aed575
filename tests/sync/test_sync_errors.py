"""Bad configuration fails at graph build with a clear error; mismatches never hang."""


import numpy as np
import pytest
import tensorflow as tf

from bn_reference import build_towers, towers_skipping_a_layer
from conftest import assert_first_run_fails, make_session
from tf1_syncbn import CollectiveBackend, sync_batch_norm
from tower import TowerContext, call_for_each_tower, get_current_tower_context

tf1 = tf.compat.v1


def ph(shape, dtype=tf.float32):
    return tf1.placeholder(dtype, shape)


@pytest.mark.parametrize('make,kwargs,exc,match', [
    (lambda: ph([None, 4, 4, None]), {}, ValueError, 'channel dimension'),
    (lambda: ph([None, None, 4, 4]), dict(data_format='NCHW'), ValueError, 'channel dimension'),
    (lambda: ph([None]), {}, ValueError, 'rank 1'),
    (lambda: ph([2, 2, 2, 2, 2, 3]), {}, ValueError, 'rank 6'),
    (lambda: ph(None), {}, ValueError, 'undefined rank'),
    (lambda: ph([None, 3], tf.int32), {}, TypeError, 'int32'),
    (lambda: ph([None, 3], tf.float64), {}, TypeError, 'float64'),
    (lambda: ph([None, 3]), dict(data_format='NWHC'), ValueError, 'data_format'),
    (lambda: ph([None, 4, 4, 3]), dict(data_format='NDHWC'), ValueError, 'rank-5'),
    (lambda: ph([None, 3]), dict(sync_statistics='mpi'), ValueError, 'sync_statistics'),
    (lambda: ph([None, 3]), dict(sync_statistics=3), TypeError, 'sync_statistics'),
    (lambda: ph([None, 3]), dict(param_initializers={'gama': 1}), ValueError, 'gama'),
    (lambda: ph([None, 3]), dict(param_regularizers={'moving_mean': 1}), ValueError,
     'moving_mean'),
    (lambda: ph([None, 3]), dict(param_initializers=[1]), TypeError, 'dict'),
    (lambda: ph([None, 3]), dict(is_training='yes'), TypeError, 'is_training'),
    (lambda: ph([None, 3]), dict(is_training=ph([2], tf.bool)), TypeError, 'is_training'),
    (lambda: ph([None, 3]), dict(decay=1.5), ValueError, r'decay=1\.5 is outside'),
    (lambda: ph([None, 3]), dict(decay='0.9'), TypeError, 'decay must be a number'),
    (lambda: ph([None, 3]), dict(decay=ph([2])), TypeError, 'decay must be a number or a float '
     'scalar tensor'),
    (lambda: ph([None, 3]), dict(renorm=True, renorm_decay=-0.1), ValueError,
     r'renorm_decay=-0\.1 is outside'),
    (lambda: ph([None, 3]), dict(renorm=True, renorm_clipping={'rmax': 0.5}), ValueError,
     r"renorm_clipping\['rmax'\]=0\.5 is invalid: .*0 < rmin <= 1 <= rmax and dmax >= 0"),
    (lambda: ph([None, 3]), dict(renorm=True, renorm_clipping={'rmin': 2.0}), ValueError,
     r"renorm_clipping\['rmin'\]=2\.0 is invalid"),
    (lambda: ph([None, 3]), dict(renorm=True, renorm_clipping={'rmin': 0.0}), ValueError,
     r"renorm_clipping\['rmin'\]=0\.0 is invalid"),
    (lambda: ph([None, 3]), dict(renorm=True, renorm_clipping={'dmax': -1.0}), ValueError,
     r"renorm_clipping\['dmax'\]=-1\.0 is invalid"),
    (lambda: ph([None, 3]), dict(renorm=True, renorm_clipping={'dmax': '1'}), TypeError,
     r"renorm_clipping\['dmax'\] must be a number or a tensor"),
    (lambda: ph([None, 3]), dict(epsilon=-1.0), ValueError, 'epsilon'),
    (lambda: ph([None, 3]), dict(num_dev=0), ValueError, 'num_dev'),
    (lambda: ph([None, 3]), dict(num_dev=2), ValueError, 'outside any tower'),
    (lambda: ph([None, 3]), dict(fused='yes'), ValueError, 'fused'),
    (lambda: ph([None, 3]), dict(renorm_clipping={'rmax': 3.0}), ValueError, 'renorm'),
    (lambda: ph([None, 3]), dict(adjustment=3), TypeError, 'adjustment'),
])
def test_bad_input_names_the_layer(graph, make, kwargs, exc, match):
    with pytest.raises(exc, match=match) as info:
        sync_batch_norm(make(), scope='my_bn', **kwargs)
    assert 'sync_batch_norm' in str(info.value)


def test_decay_and_renorm_clipping_may_be_tensors(graph):
    """slim accepts a tensor decay; tensors cannot be checked at build: accepted."""
    x = ph([None, 3])
    sync_batch_norm(x, decay=ph([]), scope='a')
    sync_batch_norm(x, decay=tf.constant(0.9), renorm=True, renorm_decay=ph([]), scope='b',
                    renorm_clipping={'rmax': ph([]), 'rmin': ph([]), 'dmax': ph([])})
    sync_batch_norm(x, renorm=True, renorm_clipping={'rmax': 1.0, 'rmin': 1.0, 'dmax': 0.0},
                    scope='c')


def test_num_dev_must_agree_with_towers(graph):
    with pytest.raises(ValueError, match='num_dev=3 disagrees'):
        build_towers(lambda x: sync_batch_norm(x, num_dev=3, sync_statistics='collective'),
                     2, (None, 3))


def test_num_dev_must_agree_with_towers_without_sync(graph):
    with pytest.raises(ValueError, match='num_dev=3 disagrees'):
        build_towers(lambda x: sync_batch_norm(x, num_dev=3, sync_statistics=None), 2,
                     (None, 3))


def test_num_dev_outside_towers_is_fine_for_inference(graph):
    """The same normalizer_params can build a single-tower inference graph."""
    y = sync_batch_norm(ph([4, 3]), is_training=False, num_dev=2,
                        sync_statistics='collective')
    assert y.shape.as_list() == [4, 3]


def test_tower_name_scope_beyond_num_dev(graph):
    with tf.name_scope('tower5'):
        with pytest.raises(ValueError, match='tower 5 but num_dev=2'):
            sync_batch_norm(ph([None, 3]), num_dev=2)


def test_towers_that_build_different_layers_fail_at_build(graph):
    def model():
        ctx = get_current_tower_context()
        x = ph([None, 3])
        y = sync_batch_norm(x, scope='shared', sync_statistics='collective')
        if ctx.index == 0:
            y = sync_batch_norm(y, scope='only_in_tower0', sync_statistics='collective')
        return y

    with pytest.raises(ValueError) as info:
        call_for_each_tower(model, ['/cpu:0', '/cpu:1', '/cpu:2'])
    message = str(info.value)
    assert 'only_in_tower0' in message and 'never by towers 1, 2' in message
    assert 'shared (' not in message


def test_a_tower_calling_a_layer_more_often_fails_at_build(graph):
    def model():
        ctx = get_current_tower_context()
        x = ph([None, 3])
        for _ in range(2 if ctx.index == 1 else 1):
            x = sync_batch_norm(x, scope='bn', reuse=tf1.AUTO_REUSE,
                                sync_statistics='collective')
        return x

    with pytest.raises(ValueError, match=r'bn.*never by tower 0'):
        call_for_each_tower(model, ['/cpu:0', '/cpu:1'])


def test_two_towers_on_one_device_fail_at_build(graph):
    with pytest.raises(ValueError, match='both on device'):
        for i in range(2):
            with tf.device('/cpu:0'), TowerContext('tower%d' % i, index=i, total=2):
                sync_batch_norm(ph([None, 3]), sync_statistics='collective')


def test_towers_without_devices_fail_at_build(graph):
    with pytest.raises(ValueError, match='own device'):
        with TowerContext('tower0', index=0, total=2):
            sync_batch_norm(ph([None, 3]), sync_statistics='collective')


class _OtherBackend(CollectiveBackend):
    """Another backend type (as 'auto' could pick on mixed CPU/GPU towers)."""


def test_mixed_backends_fail_at_build(graph):
    with pytest.raises(ValueError, match='same backend'):
        for i in range(2):
            backend = CollectiveBackend() if i == 0 else _OtherBackend()
            with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i, total=2):
                sync_batch_norm(ph([None, 3]), sync_statistics=backend)


def test_a_tower_that_never_builds_a_layer_fails_at_the_first_run(graph):
    """Without TowerContext the builder cannot see the mismatch: the first run does."""
    xs, ys = [], []
    for i in range(2):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower%d' % i):
            x = ph([None, 3])
            xs.append(x)
            if i == 0:  # tower 1 forgets the layer
                ys.append(sync_batch_norm(x, num_dev=2, scope='bn',
                                          sync_statistics=CollectiveBackend(timeout=60)))
            else:
                ys.append(x)
    assert_first_run_fails(   # within 30 s: not the collective timeout
        graph, ys, {x: np.ones((2, 3)) for x in xs}, tf.errors.InvalidArgumentError,
        r'bn \(a group of 2 towers: built by tower 0, never by tower 1\)', devices=2)


def test_a_tower_that_skips_a_layer_at_run_time_times_out(graph):
    """A layer built in every tower but skipped by a tf.cond in one: only the timeout sees it."""
    xs, ys = towers_skipping_a_layer(CollectiveBackend(timeout=1))
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        with pytest.raises(tf.errors.DeadlineExceededError):
            sess.run(ys, {x: np.ones((2, 3)) for x in xs})


def test_update_ops_run_alone_time_out_instead_of_hanging(graph):
    # 5 s: the same graph must also run a step to success within its timeout
    # below, on a machine as loaded as CI's 2 cores can be.
    net = build_towers(lambda x: sync_batch_norm(
        x, sync_statistics=CollectiveBackend(timeout=5)), 2, (None, 3))
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    assert len(updates) == 3  # 2 assignments on tower 0, their trigger on tower 1
    feed = {x: np.ones((2, 3)) for x in net['xs']}
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        with pytest.raises(tf.errors.DeadlineExceededError):
            sess.run(updates, feed)
    # Run together with every tower's forward pass, they work. (A timed-out
    # collective aborts its session's collective executor: use a new session.)
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(updates + net['ys'], feed)

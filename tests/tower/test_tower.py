"""Tests of the tower context package."""

import threading

import numpy as np
import pytest
import tensorflow as tf

from conftest import make_session
from tower import (TowerContext, average_gradients, call_for_each_tower,
                   get_current_tower_context, strip_tower_prefix, tower_index_from_name,
                   virtual_cpu_config)

tf1 = tf.compat.v1


def _var():
    return tf1.get_variable('w', [2], initializer=tf1.ones_initializer())


# --- naming and properties -------------------------------------------------

def test_name_scope_and_properties(graph):
    with TowerContext('tower0', index=0, total=2) as ctx0:
        op0 = tf.identity(1.0, name='x')
        assert get_current_tower_context() is ctx0
        assert ctx0.is_main_training_tower
        assert ctx0.ns_name == 'tower0'
    with TowerContext('tower1', index=1, total=2, is_training=True) as ctx1:
        op1 = tf.identity(1.0, name='x')
        assert (ctx1.index, ctx1.total, ctx1.is_training) == (1, 2, True)
        assert not ctx1.is_main_training_tower
    assert op0.op.name == 'tower0/x'
    assert op1.op.name == 'tower1/x'
    assert get_current_tower_context() is None


def test_prediction_tower_is_not_main(graph):
    with TowerContext('pred', is_training=False) as ctx:
        assert ctx.index == 0 and not ctx.is_main_training_tower


def test_reentering_a_tower_name_keeps_the_scope(graph):
    with TowerContext('tower0'):
        tf.identity(1.0, name='a')
    with TowerContext('tower0'):
        b = tf.identity(1.0, name='b')
    assert b.op.name == 'tower0/b'


def test_outer_name_scope_is_kept(graph):
    with tf.name_scope('train'):
        with TowerContext('tower1', index=1, total=2) as ctx:
            x = tf.identity(1.0, name='x')
    assert x.op.name == 'train/tower1/x'
    assert ctx.ns_name == 'train/tower1'


# --- variable sharing --------------------------------------------------------

def test_in_graph_sharing_reuses_tower0_variables(graph):
    vs = call_for_each_tower(_var, ['/cpu:0', '/cpu:1', '/cpu:2'])
    assert all(v is vs[0] for v in vs)
    assert vs[0].op.name == 'w'
    assert len(tf1.global_variables()) == 1


def test_tower_above_zero_cannot_create_new_variables(graph):
    with TowerContext('tower0', index=0, total=2):
        _var()
    with TowerContext('tower1', index=1, total=2):
        with pytest.raises(ValueError):
            tf1.get_variable('other', [1])


def test_replicated_mode_owns_variables(graph):
    vs = call_for_each_tower(_var, ['/cpu:0', '/cpu:1'], replicated=True)
    assert [v.op.name for v in vs] == ['tower0/w', 'tower1/w']
    assert vs[0] is not vs[1]


def test_call_for_each_tower_places_devices(graph):
    outs = call_for_each_tower(lambda: tf.identity(1.0, name='y'), ['/cpu:0', '/cpu:1'])
    assert [o.device for o in outs] == ['/device:CPU:0', '/device:CPU:1']
    assert [o.op.name for o in outs] == ['tower0/y', 'tower1/y']
    with make_session(graph, 2) as sess:
        assert sess.run(outs) == [1.0, 1.0]


def test_call_for_each_tower_sets_context(graph):
    seen = call_for_each_tower(
        lambda: (get_current_tower_context().index, get_current_tower_context().total,
                 get_current_tower_context().is_training),
        ['/cpu:0', '/cpu:1', '/cpu:2'], is_training=False)
    assert seen == [(0, 3, False), (1, 3, False), (2, 3, False)]


@pytest.mark.parametrize('devices', [[], '/cpu:0', ['/cpu:0', '/device:CPU:0']])
def test_call_for_each_tower_rejects_bad_devices(graph, devices):
    with pytest.raises(ValueError):
        call_for_each_tower(lambda: None, devices)


# --- errors ------------------------------------------------------------------

def test_nesting_is_an_error(graph):
    with TowerContext('tower0', index=0, total=2):
        with pytest.raises(ValueError, match='nested'):
            with TowerContext('tower1', index=1, total=2):
                pass
        # The outer context is intact after the failed nesting.
        assert get_current_tower_context().name == 'tower0'
        assert tf.identity(1.0, name='z').op.name == 'tower0/z'


@pytest.mark.parametrize('kwargs,exc', [
    (dict(index=2, total=2), ValueError),
    (dict(index=-1, total=2), ValueError),
    (dict(index=0, total=0), ValueError),
    (dict(index=0, total=-3), ValueError),
    (dict(index=1.0, total=2), TypeError),
    (dict(index=True, total=2), TypeError),
    (dict(is_training='yes'), TypeError),
    (dict(vs_name=3), TypeError),
])
def test_argument_errors(kwargs, exc):
    with pytest.raises(exc):
        TowerContext('tower0', **kwargs)


@pytest.mark.parametrize('name', ['a/b', None, 3])
def test_bad_names(name):
    with pytest.raises(ValueError):
        TowerContext(name)


def test_empty_name_opens_no_scope(graph):
    with TowerContext('', is_training=False) as ctx:
        assert tf.identity(1.0, name='x').op.name == 'x'
        assert ctx.ns_name == '' and not ctx.is_main_training_tower


def test_exception_restores_the_stack(graph):
    with pytest.raises(RuntimeError):
        with TowerContext('tower1', index=1, total=2):
            raise RuntimeError('boom')
    assert get_current_tower_context() is None
    # Name and variable scopes are restored too.
    assert tf.identity(1.0, name='after').op.name == 'after'
    assert not tf1.get_variable_scope().reuse
    with TowerContext('tower0'):
        assert get_current_tower_context().name == 'tower0'


def test_exception_in_replicated_tower(graph):
    with pytest.raises(KeyError):
        with TowerContext('tower1', index=1, total=2, vs_name='tower1'):
            raise KeyError('x')
    assert tf1.get_variable_scope().name == ''
    assert get_current_tower_context() is None


def test_two_graphs_do_not_share_towers():
    g1, g2 = tf.Graph(), tf.Graph()
    with g1.as_default(), TowerContext('tower0', index=0, total=2) as c1:
        assert get_current_tower_context() is c1
        with g2.as_default():
            assert get_current_tower_context() is None
            # A tower in another graph is not nesting.
            with TowerContext('tower1', index=1, total=2) as c2:
                assert get_current_tower_context() is c2
                assert get_current_tower_context(g1) is c1
            assert get_current_tower_context() is None
        assert get_current_tower_context() is c1


def test_threads_with_their_own_graphs():
    errors = []

    def build(i):
        try:
            g = tf.Graph()
            with g.as_default():
                for _ in range(50):
                    with TowerContext('tower%d' % i, index=i, total=4) as ctx:
                        if get_current_tower_context() is not ctx:
                            errors.append(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# --- stripping ---------------------------------------------------------------

@pytest.mark.parametrize('name,expected', [
    ('tower0/conv1/BatchNorm', 'conv1/BatchNorm'),
    ('tower12/a/b', 'a/b'),
    ('tower3', ''),
    ('tower3/', ''),
    ('conv1/BatchNorm', 'conv1/BatchNorm'),
    ('xtower1/conv', 'xtower1/conv'),
    ('mytower3/bn', 'mytower3/bn'),
    ('tower1x/bn', 'tower1x/bn'),
    ('towers/bn', 'towers/bn'),
    ('tower/bn', 'tower/bn'),
    ('train/tower2/bn', 'train/bn'),
    ('', ''),
])
def test_strip_tower_prefix(graph, name, expected):
    assert strip_tower_prefix(name) == expected


def test_strip_replicated_vs_name_and_custom_names(graph):
    with TowerContext('gpu_a', index=1, total=2, vs_name='replica_a') as ctx:
        assert strip_tower_prefix('replica_a/conv/bn') == 'conv/bn'
        assert strip_tower_prefix('gpu_a/conv/bn') == 'conv/bn'
        # Only a leading vs_name is a tower prefix.
        assert strip_tower_prefix('conv/replica_a/bn') == 'conv/replica_a/bn'
        assert strip_tower_prefix(tf1.get_variable_scope().name + '/bn') == 'bn'
    assert strip_tower_prefix('replica_a/conv', context=ctx) == 'conv'
    assert strip_tower_prefix('replica_a/conv') == 'replica_a/conv'


def test_strip_is_identical_across_towers(graph):
    names = []

    def fn():
        with tf1.variable_scope('block1'):
            with tf1.variable_scope('bn'):
                names.append(strip_tower_prefix(tf1.get_variable_scope().name + '/' +
                                                tf.identity(1.0, name='y').op.name))
    call_for_each_tower(fn, ['/cpu:0', '/cpu:1', '/cpu:2'], replicated=True)
    assert len(set(names)) == 1 and 'tower' not in names[0]


def test_strip_rejects_non_strings():
    with pytest.raises(TypeError):
        strip_tower_prefix(3)


def test_tower_index_from_name():
    assert tower_index_from_name('tower3/conv') == 3
    assert tower_index_from_name('a/tower12') == 12
    assert tower_index_from_name('xtower3/conv') is None
    assert tower_index_from_name('conv') is None


# --- gradient averaging ------------------------------------------------------

def test_average_gradients_matches_numpy(graph, rng):
    a, b = rng.randn(3, 2), rng.randn(4)
    va = tf1.get_variable('a', initializer=a.astype(np.float32))
    vb = tf1.get_variable('b', initializer=b.astype(np.float32))
    per_tower = [rng.randn(3, 2).astype(np.float32) for _ in range(3)]
    grads_b = [rng.randn(4).astype(np.float32) for _ in range(3)]
    tower_grads = [[(tf.constant(per_tower[i]), va), (tf.constant(grads_b[i]), vb)]
                   for i in range(3)]
    out = average_gradients(tower_grads)
    assert [v for _, v in out] == [va, vb]
    with make_session(graph, 1) as sess:
        ga, gb = sess.run([out[0][0], out[1][0]])
    np.testing.assert_allclose(ga, np.mean(per_tower, axis=0), rtol=1e-6)
    np.testing.assert_allclose(gb, np.mean(grads_b, axis=0), rtol=1e-6)


def test_average_gradients_none_counts_as_zero(graph):
    v = tf1.get_variable('v', [2])
    u = tf1.get_variable('u', [2])
    out = average_gradients([
        [(tf.constant([2.0, 4.0]), v), (None, u)],
        [(None, v), (None, u)],
    ])
    assert out[1] == (None, u)
    with make_session(graph, 1) as sess:
        np.testing.assert_allclose(sess.run(out[0][0]), [1.0, 2.0])


def test_average_gradients_indexed_slices(graph, rng):
    table = tf1.get_variable('emb', [5, 3])
    ids = [np.array([0, 2]), np.array([2, 4])]
    loss_parts = [tf.reduce_sum(tf.gather(table, i) * (k + 1.0)) for k, i in enumerate(ids)]
    tower_grads = [[(tf.gradients(loss, table)[0], table)] for loss in loss_parts]
    assert all(isinstance(g, tf.IndexedSlices) for (g, _), in tower_grads)
    (avg, _), = average_gradients(tower_grads)
    assert isinstance(avg, tf.IndexedSlices)
    expected = np.zeros((5, 3))
    for k, i in enumerate(ids):
        expected[i] += (k + 1.0) / 2
    with make_session(graph, 1) as sess:
        dense = sess.run(tf.convert_to_tensor(avg))
    np.testing.assert_allclose(dense, expected, rtol=1e-6)


def test_average_gradients_mixed_sparse_dense(graph):
    table = tf1.get_variable('emb', [3, 2], initializer=tf1.zeros_initializer())
    sparse = tf.gradients(tf.reduce_sum(tf.gather(table, [1])), table)[0]
    dense = tf.ones([3, 2])
    (avg, _), = average_gradients([[(sparse, table)], [(dense, table)]])
    with make_session(graph, 1) as sess:
        np.testing.assert_allclose(sess.run(avg), [[0.5, 0.5], [1.0, 1.0], [0.5, 0.5]])


def test_average_gradients_rejects_mismatched_towers(graph):
    v, u = tf1.get_variable('v', [1]), tf1.get_variable('u', [1])
    with pytest.raises(ValueError, match='tower 1'):
        average_gradients([[(tf.ones([1]), v)], [(tf.ones([1]), u)]])
    with pytest.raises(ValueError):
        average_gradients([])


# --- virtual devices ---------------------------------------------------------

def test_virtual_cpu_config_gives_devices(graph):
    outs = call_for_each_tower(lambda: tf.identity(tf.constant(2.0)),
                               ['/cpu:%d' % i for i in range(5)])
    with tf1.Session(graph=graph, config=virtual_cpu_config(5)) as sess:
        devices = [d.name for d in sess.list_devices() if d.device_type == 'CPU']
        assert len(devices) == 5
        assert sess.run(outs) == [2.0] * 5


@pytest.mark.parametrize('n', [0, -1, 1.5, True])
def test_virtual_cpu_config_rejects_bad_counts(n):
    with pytest.raises(ValueError):
        virtual_cpu_config(n)

"""Variables, collections and moving-average updates (main tower only)."""

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_forward, build_towers, split_batches, var
from conftest import make_session
from tf1_syncbn import CollectiveBackend, sync_batch_norm

tf1 = tf.compat.v1


def _model(x, **kwargs):
    h = sync_batch_norm(x, scope='block1/bn', sync_statistics=CollectiveBackend(60), **kwargs)
    return sync_batch_norm(h, scope='block2/bn', sync_statistics=CollectiveBackend(60),
                           **kwargs)


def test_slim_variable_names_and_collections(graph):
    build_towers(lambda x: _model(x, scale=True), 2, (None, 3))
    names = sorted(v.op.name for v in tf1.global_variables())
    assert names == sorted('block%d/bn/%s' % (b, n) for b in (1, 2)
                           for n in ('beta', 'gamma', 'moving_mean', 'moving_variance'))
    assert sorted(v.op.name for v in tf1.trainable_variables()) == sorted(
        'block%d/bn/%s' % (b, n) for b in (1, 2) for n in ('beta', 'gamma'))
    assert len(tf1.get_collection(tf1.GraphKeys.MODEL_VARIABLES)) == 8


def test_assignments_on_the_main_tower_and_one_trigger_per_layer_elsewhere(graph):
    build_towers(_model, 4, (None, 3))
    main = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, 'tower0/')
    assert len(main) == 4 and all(op.op.type != 'NoOp' for op in main)
    for scope in ('block1/bn', 'block2/bn'):
        in_scope = [op for op in main if op.name.startswith('tower0/' + scope + '/')]
        assert len(in_scope) == 2, [op.name for op in main]
        for i in (1, 2, 3):
            triggers = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, 'tower%d/%s/' % (i, scope))
            assert [op.type for op in triggers] == ['NoOp']
            # A trigger runs the main tower's assignments of the same layer.
            assert set(triggers[0].control_inputs) == {op.op for op in in_scope}


def test_custom_updates_collection(graph):
    build_towers(lambda x: _model(x, updates_collections=['my_updates']), 2, (None, 3))
    assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    assert len(tf1.get_collection('my_updates', 'tower0/')) == 4
    assert len(tf1.get_collection('my_updates', 'tower1/')) == 2


@pytest.mark.parametrize('num_towers', [1, 3])
def test_updates_as_control_dependencies(graph, rng, num_towers):
    sizes = [2, 3, 1][:num_towers]
    net = build_towers(lambda x: _model(x, updates_collections=None, decay=0.5), num_towers,
                       (None, 3))
    assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    x = rng.randn(sum(sizes), 3).astype(np.float32) + 2
    with make_session(graph, num_towers) as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(net['ys'], dict(zip(net['xs'], split_batches(x, sizes))))
        mm, mv = sess.run([var('block1/bn/moving_mean'), var('block1/bn/moving_variance')])
    f = bn_forward(x, 1, 0, 1e-3)
    np.testing.assert_allclose(mm, 0.5 * f['mean'], rtol=1e-5)
    np.testing.assert_allclose(mv, 0.5 + 0.5 * f['var_unbiased'], rtol=1e-5)


def test_prediction_towers_do_not_sync_or_update(graph):
    from tower import call_for_each_tower
    call_for_each_tower(lambda: sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]),
                                                is_training=False),
                        ['/cpu:0', '/cpu:1'], is_training=False)
    assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    assert not [op for op in graph.get_operations() if op.type.startswith('Collective')]


# --- an empty global batch ------------------------------------------------------------

def _empty_batch_layer(options, towers):
    """A layer call for test_an_empty_global_batch_updates_nothing, and its extra feed."""
    from tf1_syncbn import BatchNorm, BatchRenorm  # noqa: PLC0415
    kwargs = dict(options)
    extra = []
    backend = CollectiveBackend(timeout=60) if towers > 1 else None
    layer = kwargs.pop('layer', 'slim')

    def fn(x):
        if layer == 'BatchNorm':
            return BatchNorm('bn', x, momentum=0.5, sync_statistics=backend, **kwargs)
        if layer == 'BatchRenorm':
            return BatchRenorm('bn', x, 1.5, 0.5, momentum=0.5, sync_statistics=backend)
        kw = dict(kwargs)
        if kw.pop('batch_weights', None):
            w = tf1.placeholder(tf.float32, [None])
            extra.append(w)
            kw['batch_weights'] = w
        return sync_batch_norm(
            x, decay=0.5, scale=True, sync_statistics=backend or 'auto',
            param_initializers={'moving_mean': tf1.constant_initializer(2.0),
                                'moving_variance': tf1.constant_initializer(3.0)}, **kw)
    return fn, extra


@pytest.mark.parametrize('towers', [1, 2])
@pytest.mark.parametrize('options', [
    {}, {'updates_collections': None}, {'fused': False}, {'renorm': True},
    {'zero_debias_moving_mean': True}, {'finetune': True}, {'batch_weights': True},
    {'layer': 'BatchNorm'}, {'layer': 'BatchNorm', 'virtual_batch_size': 2},
    {'layer': 'BatchRenorm'}], ids=lambda o: '-'.join('%s=%s' % kv for kv in o.items()) or
    'default')
def test_an_empty_global_batch_updates_nothing(graph, rng, towers, options):
    """Nothing was seen, so no moving statistic, shadow or counter moves (decay 0.5)."""
    fn, weights = _empty_batch_layer(options, towers)
    net = build_towers(fn, towers, (None, 2, 3))
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    variables = tf1.global_variables()
    with make_session(graph, towers) as sess:
        sess.run(tf1.global_variables_initializer())
        x = (rng.randn(4 * towers, 2, 3) * 2 + 5).astype(np.float32)
        feed = dict(zip(net['xs'], np.split(x, towers)))
        feed.update({w: np.ones(4, np.float32) for w in weights})
        sess.run([net['ys'], updates], feed)  # one ordinary step: everything moves
        before = sess.run(variables)
        empty = np.zeros((0, 2, 3), np.float32)
        feed = {x_ph: empty for x_ph in net['xs']}
        feed.update({w: np.zeros(0, np.float32) for w in weights})
        ys, _ = sess.run([net['ys'], updates], feed)
        after = sess.run(variables)
        if weights:
            # Examples whose weights are all zero carry no statistics either.
            feed = dict(zip(net['xs'], np.split(x, towers)))
            feed.update({w: np.zeros(4, np.float32) for w in weights})
            sess.run([net['ys'], updates], feed)
            for v, b, a in zip(variables, before, sess.run(variables)):
                np.testing.assert_array_equal(a, b, err_msg=v.op.name)
    assert ys[0].shape == (0, 2, 3)
    for v, b, a in zip(variables, before, after):
        np.testing.assert_array_equal(a, b, err_msg=v.op.name)
    assert any(np.any(b != 0) and 'mean' in v.op.name for v, b in zip(variables, before))


def test_a_tower_built_before_the_main_one_still_triggers_its_updates(graph, rng):
    # Name-scope towers built in the order 1, 0: tower 1's trigger is created
    # before tower 0 builds the updates, and gets them as control inputs then.
    xs = {}
    for i in (1, 0):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
            with tf1.variable_scope(tf1.get_variable_scope(), reuse=tf1.AUTO_REUSE):
                x = tf1.placeholder(tf.float32, [None, 3])
                xs[i] = (x, sync_batch_norm(x, num_dev=2, decay=0.5, scope='bn',
                                            sync_statistics=CollectiveBackend(timeout=60)))
    last = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, 'tower_1/')
    assert [op.type for op in last] == ['NoOp'] and len(last[0].control_inputs) == 2
    data = rng.randn(6, 3).astype(np.float32) + 2
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run([xs[0][1], xs[1][1]] + last, {xs[0][0]: data[:4], xs[1][0]: data[4:]})
        mm, mv = sess.run([var('bn/moving_mean'), var('bn/moving_variance')])
    f = bn_forward(data, 1, 0, 1e-3)
    np.testing.assert_allclose(mm, 0.5 * f['mean'], rtol=1e-5)
    np.testing.assert_allclose(mv, 0.5 + 0.5 * f['var_unbiased'], rtol=1e-5)

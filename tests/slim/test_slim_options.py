"""Every slim.batch_norm option of sync_batch_norm, synced and not, against numpy."""

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

from bn_reference import bn_backward, bn_forward, build_towers, split_batches, var
from conftest import make_session
from tf1_syncbn import CollectiveBackend, sync_batch_norm

tf1 = tf.compat.v1
EPS = 1e-3
SIZES = [3, 1, 4]


def _run_towers(graph, layer, x, dy, sizes=SIZES, steps=1, extra_feed=None, fetch=()):
    net = build_towers(layer, len(sizes), (None,) + x.shape[1:])
    grads = tf.gradients(net['loss'], net['xs'] + tf1.trainable_variables())
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    feed = dict(zip(net['xs'], split_batches(x, sizes)))
    feed.update(zip(net['dys'], split_batches(dy, sizes)))
    if extra_feed is not None:
        feed.update(extra_feed())  # placeholders that exist once the towers are built
    with make_session(graph, len(sizes)) as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(steps):
            ys, gs, _ = sess.run([net['ys'], grads, updates], feed)
        values = {v.op.name: sess.run(v) for v in tf1.global_variables()}
        extra = sess.run(list(fetch), feed) if fetch else []
    n = len(sizes)
    return np.concatenate(ys), np.concatenate(gs[:n]), gs[n:], values, extra


def _sync(**kwargs):
    return lambda x: sync_batch_norm(x, sync_statistics=CollectiveBackend(timeout=60),
                                     **kwargs)


@pytest.mark.parametrize('sync', [True, False])
def test_renorm_with_synced_moments(graph, rng, sync):
    clip = {'rmax': 1.5, 'rmin': 0.8, 'dmax': 0.3}
    kwargs = dict(scale=True, decay=0.9, epsilon=EPS, renorm=True, renorm_clipping=clip,
                  renorm_decay=0.8)
    layer = _sync(**kwargs) if sync else (lambda x: sync_batch_norm(x, **kwargs))
    sizes = SIZES if sync else [8]
    x = (rng.randn(8, 2, 3) * 3 + 1).astype(np.float32)
    dy = rng.randn(*x.shape).astype(np.float32)
    y, dx, (dbeta, dgamma), values, _ = _run_towers(graph, layer, x, dy, sizes, steps=2)
    # numpy: two steps of the same batch; r and d use the renorm statistics
    # from before each step.
    f = bn_forward(x, 1.0, 0.0, EPS)
    rmean, rstd = np.zeros(3), np.ones(3)
    mm, mstd = np.zeros(3), np.ones(3)
    for _ in range(2):
        std = np.sqrt(f['var'] + EPS)
        r = np.clip(std / np.maximum(rstd, np.sqrt(EPS)), clip['rmin'], clip['rmax'])
        d = np.clip((f['mean'] - rmean) / np.maximum(rstd, np.sqrt(EPS)), -clip['dmax'],
                    clip['dmax'])
        expected_y = f['xhat'] * r + d
        expected_dx = bn_backward(dy, x, r, EPS)['dx']
        expected_dgamma = (dy * (f['xhat'] * r + d)).reshape(-1, 3).sum(0)
        rmean = 0.8 * rmean + 0.2 * f['mean']
        rstd = 0.8 * rstd + 0.2 * std
        mm = 0.9 * mm + 0.1 * f['mean']
        mstd = 0.9 * mstd + 0.1 * std
    assert abs(r - 1).max() > 0.05 and abs(d).max() > 0.05  # the test exercises r and d
    np.testing.assert_allclose(y, expected_y, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-4, atol=5e-5)
    np.testing.assert_allclose(dgamma, expected_dgamma, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dbeta, dy.reshape(-1, 3).sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(values['BatchNorm/renorm_mean'], rmean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values['BatchNorm/renorm_stddev'], rstd, rtol=1e-5)
    np.testing.assert_allclose(values['BatchNorm/moving_mean'], mm, rtol=1e-5, atol=1e-6)
    # As in Keras: moving_variance follows moving_stddev.
    np.testing.assert_allclose(values['BatchNorm/moving_stddev'], mstd, rtol=1e-5)
    np.testing.assert_allclose(values['BatchNorm/moving_variance'], mstd ** 2 - EPS, rtol=1e-5)


def test_renorm_clipping_keys_are_checked(graph):
    with pytest.raises(ValueError, match='dmin'):
        sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]), renorm=True,
                        renorm_clipping={'dmin': 1.0})


def _weighted_reference(x, dy, w, gamma, eps):
    c = x.shape[-1]
    per = x[0].size // c
    we = np.repeat(w.astype(np.float64), per)
    flat = x.reshape(-1, c).astype(np.float64)
    dyf = dy.reshape(-1, c).astype(np.float64)
    total = we.sum()
    mean = (we[:, None] * flat).sum(0) / total
    var_ = (we[:, None] * (flat - mean) ** 2).sum(0) / total
    r = 1 / np.sqrt(var_ + eps)
    xhat = (flat - mean) * r
    y = xhat * gamma
    dx = gamma * r * (dyf - we[:, None] / total * dyf.sum(0) -
                      we[:, None] / total * xhat * (dyf * xhat).sum(0))
    return y.reshape(x.shape), dx.reshape(x.shape), mean, var_


@pytest.mark.parametrize('sync', [True, False])
def test_batch_weights_give_weighted_global_moments(graph, rng, sync):
    sizes = SIZES if sync else [8]
    weights_ph = []

    def layer(x):
        w = tf1.placeholder(tf.float32, [None])
        weights_ph.append(w)
        kwargs = dict(scale=True, decay=0.0, epsilon=EPS, batch_weights=w)
        if sync:
            kwargs['sync_statistics'] = CollectiveBackend(timeout=60)
        return sync_batch_norm(x, **kwargs)

    x = (rng.randn(8, 2, 2, 3) * 2 + 1).astype(np.float32)
    dy = rng.randn(*x.shape).astype(np.float32)
    w = rng.uniform(0.0, 2.0, 8).astype(np.float32)
    w[2] = 0.0
    # weights_ph are created while building; fill the feed lazily.
    y, dx, _, values, _ = _run_towers(graph, layer, x, dy, sizes,
                                      extra_feed=lambda: dict(zip(weights_ph,
                                                                  split_batches(w, sizes))))
    ey, edx, emean, evar = _weighted_reference(x, dy, w, 1.0, EPS)
    np.testing.assert_allclose(y, ey, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(dx, edx, rtol=1e-4, atol=5e-5)
    # The moving statistics use the weighted moments (decay 0: this batch).
    np.testing.assert_allclose(values['BatchNorm/moving_mean'], emean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values['BatchNorm/moving_variance'], evar, rtol=1e-5)


@pytest.mark.parametrize('option', [dict(batch_weights=np.ones(8, np.float32)), dict(renorm=True),
                                    dict(adjustment=lambda s: (1.0, 0.0))])
def test_fused_true_is_a_hint_that_falls_back_silently(graph, rng, option):
    """As in slim: an arg_scope with fused=True over a layer that cannot be fused."""
    x = (rng.randn(8, 3) * 2 + 1).astype(np.float32)
    outputs = []
    for fused in (True, None):
        with slim.arg_scope([sync_batch_norm], fused=fused):
            outputs.append(sync_batch_norm(tf.constant(x), decay=0.5, scope='bn%s' % fused,
                                           updates_collections=None, **option))
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        y_true, y_none = sess.run(outputs)
        stats = sess.run([var('bn%s/moving_%s' % (f, s)) for f in (True, None)
                          for s in ('mean', 'variance')])
    np.testing.assert_array_equal(y_true, y_none)
    np.testing.assert_array_equal(stats[0], stats[2])
    np.testing.assert_array_equal(stats[1], stats[3])


def test_batch_weights_shape_is_checked(graph):
    with pytest.raises(ValueError, match='batch_weights'):
        sync_batch_norm(tf1.placeholder(tf.float32, [4, 3]), batch_weights=tf.ones([5]))


def test_adjustment_applies_in_training_only(graph, rng):
    scale = np.array([0.5, 2.0, 1.5], np.float32)
    bias = np.array([0.1, -0.2, 0.3], np.float32)
    seen_shapes = []

    def adjustment(shape):
        seen_shapes.append(shape)
        return tf.constant(scale), tf.constant(bias)

    x = (rng.randn(8, 3) + 2).astype(np.float32)
    dy = rng.randn(8, 3).astype(np.float32)
    beta0 = np.array([0.3, 0.0, -0.5], np.float32)
    y, dx, (dbeta,), _, _ = _run_towers(
        graph, _sync(epsilon=EPS, adjustment=adjustment,
                     param_initializers={'beta': tf1.constant_initializer(beta0)}), x, dy)
    assert len(seen_shapes) == 3 and seen_shapes[0].dtype == tf.int32
    f = bn_forward(x, 1.0, 0.0, EPS)
    np.testing.assert_allclose(y, f['xhat'] * scale + bias + beta0, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(dx, bn_backward(dy, x, scale, EPS)['dx'], rtol=1e-4, atol=5e-5)
    np.testing.assert_allclose(dbeta, dy.sum(0), rtol=1e-5, atol=1e-5)
    # At inference the adjustment is not applied.
    g2 = tf.Graph()
    with g2.as_default():
        out = sync_batch_norm(tf.constant(x), is_training=False, adjustment=adjustment)
        with make_session(g2, 1) as sess:
            sess.run(tf1.global_variables_initializer())
            np.testing.assert_allclose(sess.run(out), x / np.sqrt(1 + 1e-3), rtol=1e-5)


def test_zero_debias_moving_mean(graph, rng):
    x = (rng.randn(8, 3) + 5).astype(np.float32)
    decay = 0.9
    _, _, _, values, _ = _run_towers(graph, _sync(decay=decay, zero_debias_moving_mean=True),
                                     x, np.zeros_like(x), steps=3)
    mean = bn_forward(x, 1, 0, EPS)['mean']
    biased = 0.0
    for _ in range(3):
        biased = biased * decay + mean * (1 - decay)
    np.testing.assert_allclose(values['BatchNorm/moving_mean'], biased / (1 - decay ** 3),
                               rtol=1e-5)
    assert 'BatchNorm/BatchNorm/moving_mean/biased' in values
    assert 'BatchNorm/BatchNorm/moving_mean/local_step' in values


def test_is_training_tensor_switches_modes_in_one_graph(graph, rng):
    training = tf1.placeholder(tf.bool, [])
    net = build_towers(_sync(decay=0.5, epsilon=EPS, scale=True, is_training=training), 3,
                       (None, 2, 3))
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    grads = tf.gradients(net['loss'], net['xs'] + [var('BatchNorm/gamma')])
    x = (rng.randn(8, 2, 3) * 2 + 3).astype(np.float32)
    dy = rng.randn(*x.shape).astype(np.float32)
    feed = dict(zip(net['xs'], split_batches(x, SIZES)))
    feed.update(zip(net['dys'], split_batches(dy, SIZES)))
    mm_v, mv_v = var('BatchNorm/moving_mean'), var('BatchNorm/moving_variance')
    with make_session(graph, 3) as sess:
        sess.run(tf1.global_variables_initializer())
        ys, gs, _ = sess.run([net['ys'], grads, updates], _with(feed, training, True))
        f = bn_forward(x, 1.0, 0.0, EPS)
        np.testing.assert_allclose(np.concatenate(ys), f['y'], rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(np.concatenate(gs[:3]), bn_backward(dy, x, np.ones(3),
                                                                       EPS)['dx'],
                                   rtol=1e-4, atol=5e-5)
        mm, mv = sess.run([mm_v, mv_v])
        np.testing.assert_allclose(mm, 0.5 * f['mean'], rtol=1e-5)
        # Evaluation: moving statistics, no update, no collective to wait for
        # (tower 0 alone runs: a collective would time out).
        y0, _ = sess.run([net['ys'][0], updates], {net['xs'][0]: x[:3], training: False})
        np.testing.assert_allclose(y0, (x[:3] - mm) / np.sqrt(mv + EPS), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(sess.run(mm_v), mm)
        # Gradients still flow to gamma in evaluation mode (frozen statistics).
        g_eval = sess.run(grads[-1], _with(feed, training, False))
        np.testing.assert_allclose(g_eval, (dy * (x - mm) / np.sqrt(mv + EPS)).reshape(-1, 3)
                                   .sum(0), rtol=1e-4, atol=1e-4)


def _with(feed, key, value):
    out = dict(feed)
    out[key] = value
    return out


def test_frozen_statistics_inside_a_training_tower(graph, rng):
    x = (rng.randn(8, 4, 3) + 1).astype(np.float32)
    dy = rng.randn(*x.shape).astype(np.float32)
    mean0 = np.array([0.5, -1.0, 2.0], np.float32)
    var0 = np.array([2.0, 0.5, 1.0], np.float32)
    inits = {'moving_mean': tf1.constant_initializer(mean0),
             'moving_variance': tf1.constant_initializer(var0),
             'gamma': tf1.constant_initializer(1.5)}
    y, dx, (dbeta, dgamma), values, _ = _run_towers(
        graph, _sync(is_training=False, scale=True, param_initializers=inits), x, dy)
    xhat = (x - mean0) / np.sqrt(var0 + EPS)
    np.testing.assert_allclose(y, xhat * 1.5, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dy * 1.5 / np.sqrt(var0 + EPS), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dgamma, (dy * xhat).reshape(-1, 3).sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dbeta, dy.reshape(-1, 3).sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(values['BatchNorm/moving_mean'], mean0)
    assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)


def test_initializers_regularizers_collections_outputs(graph):
    x = tf1.placeholder(tf.float32, [None, 3])
    def reg(v):
        return 0.5 * tf.reduce_sum(v * v)

    y = sync_batch_norm(
        x, scale=True, scope='bn',
        param_initializers={'beta': tf1.constant_initializer(1.0),
                            'gamma': tf1.constant_initializer(2.0),
                            'moving_mean': tf1.constant_initializer(3.0),
                            'moving_variance': tf1.constant_initializer(4.0)},
        param_regularizers={'gamma': reg},
        variables_collections={'beta': ['betas'], 'moving_mean': ['stats']},
        outputs_collections=['outs'], activation_fn=tf.nn.relu)
    assert [v.op.name for v in tf1.get_collection('betas')] == ['bn/beta']
    assert [v.op.name for v in tf1.get_collection('stats')] == ['bn/moving_mean']
    assert len(tf1.get_collection(tf1.GraphKeys.REGULARIZATION_LOSSES)) == 1
    assert tf1.get_collection('outs')[0] is y
    assert y.op.type == 'Relu'
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        vals = sess.run([var('bn/beta'), var('bn/gamma'), var('bn/moving_mean'),
                         var('bn/moving_variance')])
        assert [float(v[0]) for v in vals] == [1.0, 2.0, 3.0, 4.0]
        assert sess.run(tf1.get_collection(tf1.GraphKeys.REGULARIZATION_LOSSES)[0]) == 6.0


def test_variables_collections_as_a_list(graph):
    sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]), scale=True,
                    variables_collections=['all_bn'])
    assert len(tf1.get_collection('all_bn')) == 4


def test_trainable_false_and_reuse(graph):
    x = tf1.placeholder(tf.float32, [None, 3])
    sync_batch_norm(x, scale=True, trainable=False, scope='frozen')
    assert not tf1.trainable_variables()
    sync_batch_norm(x, scope='frozen', scale=True, reuse=True)
    assert len(tf1.global_variables()) == 4
    with pytest.raises(ValueError):
        sync_batch_norm(x, scope='missing', reuse=True)


def test_center_false_and_scale_false(graph):
    sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]), center=False, scale=False)
    assert sorted(v.op.name for v in tf1.global_variables()) == [
        'BatchNorm/moving_mean', 'BatchNorm/moving_variance']


@pytest.mark.parametrize('fused', [None, False])
def test_fused_false_is_exact_too(graph, rng, fused):
    x = (rng.randn(8, 2, 3) * 2 + 1).astype(np.float32)
    dy = rng.randn(*x.shape).astype(np.float32)
    y, dx, _, _, _ = _run_towers(graph, _sync(epsilon=EPS, fused=fused), x, dy)
    # The fused path: TF's fused kernel, or the compiled kernel that replaces it on CPU.
    has_fused_training = any(op.type in ('FusedBatchNormV3', 'SyncBnNormalize')
                             for op in graph.get_operations())
    assert has_fused_training == (fused is None)
    np.testing.assert_allclose(y, bn_forward(x, 1, 0, EPS)['y'], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(dx, bn_backward(dy, x, np.ones(3), EPS)['dx'], rtol=1e-4,
                               atol=5e-5)


def test_fused_false_inference_uses_separate_ops(graph, rng):
    x = rng.randn(4, 3).astype(np.float32)
    y = sync_batch_norm(tf.constant(x), is_training=False, fused=False)
    assert not [op for op in graph.get_operations() if op.type.startswith('FusedBatchNorm')]
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        np.testing.assert_allclose(sess.run(y), x / np.sqrt(1 + 1e-3), rtol=1e-6)


def test_zero_debias_in_a_partitioned_scope(graph, rng):
    """slim partitions moving_mean/biased there and fails; nothing is partitioned here."""
    x = tf1.placeholder(tf.float32, [None, 4])
    with tf1.variable_scope('net', partitioner=tf1.fixed_size_partitioner(2)):
        y = sync_batch_norm(x, decay=0.5, scale=True, zero_debias_moving_mean=True,
                            updates_collections=None)
    names = sorted(v.op.name for v in tf1.global_variables())
    assert names == ['net/BatchNorm/beta/part_0', 'net/BatchNorm/beta/part_1',
                     'net/BatchNorm/gamma/part_0', 'net/BatchNorm/gamma/part_1',
                     'net/BatchNorm/moving_mean', 'net/BatchNorm/moving_variance',
                     'net/BatchNorm/net/BatchNorm/moving_mean/biased',
                     'net/BatchNorm/net/BatchNorm/moving_mean/local_step']
    train = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(y * y))
    data = (rng.randn(6, 4) + 3).astype(np.float32)
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train, {x: data})
        # One debiased step: the batch mean itself.
        np.testing.assert_allclose(sess.run(var('net/BatchNorm/moving_mean')), data.mean(0),
                                   rtol=1e-5)

"""A multi-tower sync_batch_norm checkpoint restores into a single-tower inference graph.

Train a few steps on 2 or 4 virtual CPU towers (synchronized statistics,
UPDATE_OPS run with the train op), save with ``tf.compat.v1.train.Saver``,
restore into a graph built once, without towers, with ``is_training=False``,
and compare its predictions with references computed from the saved values
only: numpy, and ``tf.compat.v1.nn.fused_batch_norm(is_training=False)``.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

from conftest import make_session
from tf1_syncbn import sync_batch_norm
from tower import average_gradients, call_for_each_tower, get_current_tower_context

tf1 = tf.compat.v1

EPS = 1e-3
SIZE, CHANNELS, CLASSES = 6, 3, 4


def _model(images, is_training, sync_statistics='auto'):
    """conv -> sync BN -> relu -> fc -> sync BN -> relu -> logits."""
    bn_params = {'is_training': is_training, 'scale': True, 'decay': 0.5, 'epsilon': EPS,
                 'sync_statistics': sync_statistics}
    with slim.arg_scope([slim.conv2d, slim.fully_connected], normalizer_fn=sync_batch_norm,
                        normalizer_params=bn_params):
        net = slim.conv2d(images, 5, [3, 3], scope='conv')
        net = slim.flatten(net)
        net = slim.fully_connected(net, 6, scope='fc')
        return slim.fully_connected(net, CLASSES, activation_fn=None, normalizer_fn=None,
                                    scope='logits')


def _train_and_save(path, towers, rng):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        images = tf1.placeholder(tf.float32, [None, SIZE, SIZE, CHANNELS])
        labels = tf1.placeholder(tf.int32, [None])
        image_parts = tf.split(images, towers)
        label_parts = tf.split(labels, towers)
        optimizer = tf1.train.MomentumOptimizer(0.1, 0.9)

        def tower_fn():
            i = get_current_tower_context().index
            logits = _model(image_parts[i], is_training=True)
            loss = tf1.losses.sparse_softmax_cross_entropy(label_parts[i], logits,
                                                           loss_collection=None)
            return optimizer.compute_gradients(loss)

        tower_grads = call_for_each_tower(tower_fn, ['/cpu:%d' % i for i in range(towers)])
        updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        # Assignments on tower 0; the other towers hold triggers of the same ones.
        assert updates and all(op.name.startswith('tower0/') or op.name.endswith(
            '/update_moving_averages') for op in updates)
        with tf.control_dependencies(updates):
            train_op = optimizer.apply_gradients(average_gradients(tower_grads))
        saver = tf1.train.Saver()
        init = tf1.global_variables_initializer()
        names = sorted(v.op.name for v in tf1.global_variables())
    with make_session(graph, towers) as sess:
        sess.run(init)
        for _ in range(4):
            x = (rng.randn(4 * towers, SIZE, SIZE, CHANNELS) * 2 + 1).astype(np.float32)
            y = rng.randint(0, CLASSES, 4 * towers)
            sess.run(train_op, {images: x, labels: y})
        saver.save(sess, path)
    return names


def _saved(path):
    reader = tf1.train.NewCheckpointReader(path)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def _numpy_bn(x, saved, scope):
    mean = saved[scope + '/BatchNorm/moving_mean']
    var = saved[scope + '/BatchNorm/moving_variance']
    gamma = saved[scope + '/BatchNorm/gamma']
    beta = saved[scope + '/BatchNorm/beta']
    return (x - mean) / np.sqrt(var + EPS) * gamma + beta


def _numpy_conv_same(x, w):
    """3x3 stride-1 SAME convolution, NHWC, float64."""
    k = w.shape[0]
    pad = k // 2
    xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    out = np.zeros(x.shape[:3] + (w.shape[-1],))
    for i in range(k):
        for j in range(k):
            out += np.einsum('nhwc,co->nhwo', xp[:, i:i + x.shape[1], j:j + x.shape[2]],
                             w[i, j])
    return out


def _numpy_predict(x, saved):
    x = np.asarray(x, np.float64)
    h = _numpy_conv_same(x, saved['conv/weights'])
    h = np.maximum(_numpy_bn(h, saved, 'conv'), 0).reshape(len(x), -1)
    h = np.maximum(_numpy_bn(h @ saved['fc/weights'], saved, 'fc'), 0)
    return h @ saved['logits/weights'] + saved['logits/biases']


def _fused_predict(x, saved):
    """The same model from tf ops on constants, BN by fused_batch_norm(is_training=False)."""
    graph = tf.Graph()
    with graph.as_default():
        def bn(h, scope):
            y, _, _ = tf1.nn.fused_batch_norm(
                h, saved[scope + '/BatchNorm/gamma'], saved[scope + '/BatchNorm/beta'],
                mean=saved[scope + '/BatchNorm/moving_mean'],
                variance=saved[scope + '/BatchNorm/moving_variance'], epsilon=EPS,
                is_training=False)
            return y

        h = tf.nn.conv2d(tf.constant(x), saved['conv/weights'], 1, 'SAME')
        h = tf.reshape(tf.nn.relu(bn(h, 'conv')), [len(x), -1])
        h = tf.matmul(h, saved['fc/weights'])
        h = tf.reshape(bn(tf.reshape(h, [len(x), 1, 1, -1]), 'fc'), [len(x), -1])
        out = tf.matmul(tf.nn.relu(h), saved['logits/weights']) + saved['logits/biases']
        with tf1.Session(graph=graph) as sess:
            return sess.run(out)


@pytest.mark.parametrize('towers', [2, 4])
def test_multi_tower_checkpoint_restores_into_single_tower_inference(tmp_path, towers):
    rng = np.random.RandomState(towers)
    path = str(tmp_path / 'model.ckpt')
    train_names = _train_and_save(path, towers, rng)
    saved = _saved(path)

    # Slim names, shared by all towers: no tower prefix in the checkpoint.
    assert not [n for n in saved if 'tower' in n]
    for scope in ('conv', 'fc'):
        for var in ('beta', 'gamma', 'moving_mean', 'moving_variance'):
            assert scope + '/BatchNorm/' + var in saved
        # The moving statistics were trained (initial values are 0 and 1).
        assert np.abs(saved[scope + '/BatchNorm/moving_mean']).max() > 1e-2
        assert np.abs(saved[scope + '/BatchNorm/moving_variance'] - 1).max() > 1e-2
    assert sorted(saved) == train_names

    graph = tf.Graph()
    with graph.as_default():
        images = tf1.placeholder(tf.float32, [None, SIZE, SIZE, CHANNELS])
        logits = _model(images, is_training=False)
        model_vars = {v.op.name: v for v in tf1.global_variables()}
        saver = tf1.train.Saver()
    # Inference needs neither towers nor collectives.
    assert not [op for op in graph.get_operations() if 'Collective' in op.type]
    assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    assert set(model_vars) <= set(saved)
    x = rng.randn(7, SIZE, SIZE, CHANNELS).astype(np.float32) * 2 + 1
    with tf1.Session(graph=graph) as sess:
        saver.restore(sess, path)
        restored = sess.run(model_vars)
        predictions = sess.run(logits, {images: x})
        # Inference is deterministic and ignores the batch: one example at a time.
        one_by_one = np.concatenate([sess.run(logits, {images: x[i:i + 1]})
                                     for i in range(len(x))])

    for name in model_vars:
        np.testing.assert_array_equal(restored[name], saved[name], err_msg=name)
    np.testing.assert_allclose(predictions, _numpy_predict(x, saved), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(predictions, _fused_predict(x, saved), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(one_by_one, predictions, rtol=1e-5, atol=1e-5)


def test_inference_graph_with_towers_restores_too(tmp_path):
    """The same checkpoint also restores into a 2-tower is_training=False graph."""
    rng = np.random.RandomState(0)
    path = str(tmp_path / 'model.ckpt')
    _train_and_save(path, 2, rng)
    saved = _saved(path)
    graph = tf.Graph()
    with graph.as_default():
        images = tf1.placeholder(tf.float32, [4, SIZE, SIZE, CHANNELS])
        parts = tf.split(images, 2)
        outs = call_for_each_tower(
            lambda: _model(parts[get_current_tower_context().index], is_training=False),
            ['/cpu:0', '/cpu:1'], is_training=False)
        saver = tf1.train.Saver()
    x = rng.randn(4, SIZE, SIZE, CHANNELS).astype(np.float32)
    with make_session(graph, 2) as sess:
        saver.restore(sess, path)
        predictions = np.concatenate(sess.run(outs, {images: x}))
    np.testing.assert_allclose(predictions, _numpy_predict(x, saved), rtol=1e-4, atol=1e-4)

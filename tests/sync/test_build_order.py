"""Inference calls built before the towers do not shift the towers' call numbering.

A validation output built first (``model(x_val, training=False)`` in Keras,
``batch_normalization(x_val, training=False)`` in tf.layers), then a
``tower_%d`` loop with ``num_dev``: the inference call builds no collective,
so it must take no call index (before the fix it took ``bn:0``, tower 0's
training call became ``bn:1`` while tower 1's was ``bn:0``, and the first
step failed with "built by tower 1, never by tower 0"). The towers equal
float64 numpy batch norm on the concatenated batch; the validation output
uses the initial moving statistics (mean 0, variance 1).
"""

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_forward
from conftest import make_session
import tf1_syncbn

tf1 = tf.compat.v1
EPS = 1e-3
SIZES = (3, 2)


def _towers(call):
    """Builds ``call(x)`` in ``tower_<i>`` name scopes on their own CPUs; returns xs, ys."""
    xs, ys = [], []
    for i in range(len(SIZES)):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
            x = tf1.placeholder(tf.float32, [None, 4], name='x')
            xs.append(x)
            ys.append(call(x))
    return xs, ys


def _check(graph, x_val, val, xs, ys):
    rng = np.random.RandomState(3)
    data = (rng.randn(sum(SIZES), 4) * 2 + 1).astype(np.float32)
    parts = np.split(data, np.cumsum(SIZES)[:-1])
    feed = dict(zip(xs, parts))
    feed[x_val] = data[:2]
    with make_session(graph, len(SIZES)) as sess:
        sess.run(tf1.global_variables_initializer())
        outs, v = sess.run([ys, val], feed)
    ones, zeros = np.ones(4), np.zeros(4)
    np.testing.assert_allclose(np.concatenate(outs), bn_forward(data, ones, zeros, EPS)['y'],
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(v, data[:2] / np.sqrt(1 + EPS), rtol=1e-5, atol=1e-5)


def test_tf_layers_inference_call_before_the_towers(graph):
    x_val = tf1.placeholder(tf.float32, [None, 4], name='x_val')
    val = tf1_syncbn.layers.batch_normalization(x_val, training=False, name='bn',
                                                num_dev=len(SIZES))
    xs, ys = _towers(lambda x: tf1_syncbn.layers.batch_normalization(
        x, training=True, name='bn', reuse=True, num_dev=len(SIZES)))
    _check(graph, x_val, val, xs, ys)


@pytest.mark.parametrize('where', ['before', 'between'])
def test_keras_inference_call_before_or_between_the_towers(graph, where):
    import tf_keras  # noqa: PLC0415 - tf-keras is a test dependency
    with tf1_syncbn.keras.patch_keras(num_dev=len(SIZES)):
        inputs = tf_keras.Input(shape=(4,))
        model = tf_keras.Model(inputs, tf_keras.layers.BatchNormalization(epsilon=EPS)(inputs))
    x_val = tf1.placeholder(tf.float32, [None, 4], name='x_val')
    built = []

    def call(x):
        if where == 'between' and len(built) == 1:
            built.append(model(x_val, training=False))
        built.append(model(x, training=True))
        return built[-1]

    val = model(x_val, training=False) if where == 'before' else None
    xs, ys = _towers(call)
    _check(graph, x_val, val if val is not None else built[1], xs, ys)

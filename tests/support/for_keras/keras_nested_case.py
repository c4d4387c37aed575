"""Keras batch norms called on tensors without Keras' history, on one device or on towers.

Two nests that TF1 Keras code builds: ``TimeDistributed(BatchNormalization())``
(CRNN and video models), and a custom layer whose ``call`` does
``self.bn(tf.nn.relu(x))``. The model is built once (on ``keras.Input``
placeholders) and called by every tower in a ``tower_<i>`` name-scope loop
on ``/cpu:<i>`` (``'towers'``), or once on the whole batch (``'one'``). It
never imports ``tf1_syncbn``: the test process patches tf-keras before
calling :func:`train`, the reference subprocess runs tf-keras' own layers.
"""

import contextlib

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1
STEPS = 2
LEARNING_RATE = 0.1


def build_model():
    import tf_keras  # noqa: PLC0415 - the reference side imports it after its shim

    class ReluBatchNorm(tf_keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.bn = tf_keras.layers.BatchNormalization(momentum=0.5, name='inner_bn')

        def call(self, x, training=None):
            return self.bn(tf.nn.relu(x), training=training)

    inputs = tf_keras.Input(shape=(3, 4))
    h = tf_keras.layers.TimeDistributed(
        tf_keras.layers.BatchNormalization(momentum=0.5, name='td_bn'))(inputs)
    h = tf_keras.layers.Flatten()(h)
    return tf_keras.Model(inputs, ReluBatchNorm(name='relu_bn')(h * 2.0 + 0.5))


def train(sizes, mode='one'):
    """``STEPS`` SGD steps on ``sum(y * dy)``; returns outputs, gradients and weights."""
    total = int(sum(sizes))
    rng = np.random.RandomState(5)
    data = [((rng.randn(total, 3, 4) * 2 + 1).astype(np.float32),
             rng.randn(total, 12).astype(np.float32)) for _ in range(STEPS)]
    starts = np.cumsum([0] + list(sizes))
    graph = tf.Graph()
    with graph.as_default():
        model = build_model()
        xs, dys, ys = [], [], []
        for i in range(len(sizes)):
            with tf.device('/cpu:%d' % i) if mode == 'towers' else contextlib.nullcontext(), \
                    tf.name_scope('tower_%d' % i) if mode == 'towers' else \
                    contextlib.nullcontext():
                xs.append(tf1.placeholder(tf.float32, (None, 3, 4), 'x'))
                dys.append(tf1.placeholder(tf.float32, (None, 12), 'dy'))
                ys.append(model(xs[-1], training=True))
        loss = tf.add_n([tf.reduce_sum(y * dy) for y, dy in zip(ys, dys)])
        weights = model.trainable_weights
        grads = tf.gradients(loss, xs + weights)
        updates = [u for x in xs for u in model.get_updates_for(x)]
        assert updates, 'no updates'
        with tf.control_dependencies(updates):
            step = tf.group(*[w.assign_sub(LEARNING_RATE * g)
                              for w, g in zip(weights, grads[len(xs):])])
        arrays = {}
        with tf1.Session(config=tf1.ConfigProto(device_count={'CPU': len(sizes)})) as sess:
            sess.run(tf1.global_variables_initializer())
            for s, (x, dy) in enumerate(data):
                feed = {}
                for i in range(len(sizes)):
                    rows = slice(starts[i], starts[i + 1])
                    feed[xs[i]], feed[dys[i]] = x[rows], dy[rows]
                outs, gs = sess.run([ys, grads], feed)
                sess.run(step, feed)
                arrays['y/%d' % s] = np.concatenate(outs)
                arrays['dx/%d' % s] = np.concatenate(gs[:len(xs)])
                for w, g in zip(weights, gs[len(xs):]):
                    arrays['grad/%d/%s' % (s, w.name.split(':')[0])] = g
            for w, value in zip(model.weights, sess.run(model.weights)):
                arrays['var/' + w.name.split(':')[0]] = value
    return arrays

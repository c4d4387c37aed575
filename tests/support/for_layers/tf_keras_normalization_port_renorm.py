"""Port of tf-keras' legacy normalization tests, part 3: batch renormalization and ``adjustment``.

See :mod:`tf_keras_normalization_port` for the original and how the port runs.
Each case feeds 4x3 batches of uniform data (axis 1; gamma 2, beta 3,
epsilon 1e-3) and compares the training and the inference output of every
step with the original's numpy model of the layer (renormalization
corrections ``r`` and ``d`` from the renorm mean and stddev, clipped where
asked; moving averages with the layer's momenta).
"""

import numpy as np
import tensorflow as tf

from tf_keras_normalization_port import assert_all_close, session

tf1 = tf.compat.v1
SHAPE = (4, 3)
GAMMA, BETA, EPSILON = 2.0, 3.0, 0.001
CLIPPING = {'rmax': 1.1, 'rmin': 0.9, 'dmax': 0.1}


class _Renorm:
    """The original's numpy model of renormalization: moving and renorm mean and stddev."""

    def __init__(self, momentum, renorm_momentum):
        self.momentum, self.renorm_momentum = momentum, renorm_momentum
        self.moving_mean, self.moving_stddev = 0.0, 1.0
        self.renorm_mean, self.renorm_stddev = 0.0, 1.0

    def train(self, x, clipping=None):
        """``(x normalized and corrected by r and d, its stddev)``, r and d from renorm stats."""
        mean = x.mean(0)
        stddev = np.sqrt(x.var(0) + EPSILON)
        r = stddev / self.renorm_stddev
        d = (mean - self.renorm_mean) / self.renorm_stddev
        if clipping is not None:
            r = r.clip(clipping['rmin'], clipping['rmax'])
            d = d.clip(-clipping['dmax'], clipping['dmax'])
        return (x - mean) / stddev * r + d, stddev

    def update(self, x, stddev):
        """One step of the four moving averages."""
        mean = x.mean(0)
        self.renorm_mean += (mean - self.renorm_mean) * (1.0 - self.renorm_momentum)
        self.renorm_stddev += (stddev - self.renorm_stddev) * (1.0 - self.renorm_momentum)
        self.moving_mean += (mean - self.moving_mean) * (1.0 - self.momentum)
        self.moving_stddev += (stddev - self.moving_stddev) * (1.0 - self.momentum)

    def infer(self, x):
        """The inference output, from the moving mean and stddev."""
        return (x - self.moving_mean) / (self.moving_stddev * self.moving_stddev) ** 0.5 * GAMMA \
            + BETA


def _layer(layers, x, momentum, **options):
    """The layer under test on ``x``, axis 1, gamma 2, beta 3: ``(training, output, layer)``."""
    layer = layers.BatchNormalization(
        axis=1, gamma_initializer=tf1.constant_initializer(GAMMA),
        beta_initializer=tf1.constant_initializer(BETA), epsilon=EPSILON, momentum=momentum,
        **options)
    training = tf1.placeholder(tf.bool)
    return training, layer(x, training=training), layer


def _adjustments():
    """Random ``adjustment``: channel scales in [0.5, 1.5), biases in [-0.2, 0.2)."""
    scale = tf.random.uniform(SHAPE[-1:], 0.5, 1.5)
    bias = tf.random.uniform(SHAPE[-1:], -0.2, 0.2)
    return scale, bias


def _steps_with_adjustment(x, training, y, layer, scale, bias):
    """Five steps on new random batches, as the original's adjustment cases run them.

    Each step runs the layer in training (with its updates, and the random
    ``adjustment`` of that run), then in inference (with its updates).

    Yields:
      ``(batch, training output, adjustment scale, adjustment bias, inference output)``.
    """
    with session() as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(5):
            batch = np.random.random(SHAPE)
            train, scale_value, bias_value = sess.run(
                [y, scale, bias] + layer.updates, feed_dict={x: batch, training: True})[:3]
            test = sess.run([y] + layer.updates, feed_dict={x: batch, training: False})[0]
            yield batch, train, scale_value, bias_value, test


def testRenorm(layers):
    model = _Renorm(momentum=0.99, renorm_momentum=0.8)
    x = tf1.placeholder(tf.float32, SHAPE)
    training, y, layer = _layer(layers, x, 0.99, renorm=True, renorm_clipping=dict(CLIPPING),
                                renorm_momentum=0.8)
    with session() as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(5):
            batch = np.random.random(SHAPE)
            normalized, stddev = model.train(batch, CLIPPING)
            expected_train = normalized * GAMMA + BETA
            model.update(batch, stddev)
            expected_test = model.infer(batch)
            train, _, _ = sess.run([y] + layer.updates, feed_dict={x: batch, training: True})
            test, _, _ = sess.run([y] + layer.updates, feed_dict={x: batch, training: False})
            assert_all_close(expected_train, train, atol=1e-5, what='training output')
            assert_all_close(expected_test, test, atol=1e-5, what='inference output')


def testRenormNoClippingSameMomentumGivesSameTestTrain(layers):
    model = _Renorm(momentum=0.9, renorm_momentum=0.9)
    x = tf1.placeholder(tf.float32, SHAPE)
    training, y, layer = _layer(layers, x, 0.9, renorm=True, renorm_clipping=None,
                                renorm_momentum=0.9)
    with session() as sess:
        sess.run(tf1.global_variables_initializer())
        for step in range(6):
            batch = np.random.random(SHAPE)
            expected_test = model.infer(batch)
            normalized, stddev = model.train(batch)
            expected_train = normalized * GAMMA + BETA
            model.update(batch, stddev)
            test, _, _ = sess.run([y] + layer.updates, feed_dict={x: batch, training: False})
            train, _, _ = sess.run([y] + layer.updates, feed_dict={x: batch, training: True})
            # The model's and the layer's starting statistics differ a little: the
            # first step is allowed about epsilon; then all three agree.
            atol = EPSILON * 1.5 if step == 0 else 1e-5
            assert_all_close(expected_train, train, atol=atol, what='training output')
            assert_all_close(expected_test, test, atol=atol, what='inference output')
            assert_all_close(train, test, atol=atol, what='training against inference')


def testAdjustment(layers):
    momentum = 0.99
    x = tf1.placeholder(tf.float32, SHAPE)
    scale, bias = _adjustments()
    training, y, layer = _layer(layers, x, momentum, adjustment=lambda _: (scale, bias))
    moving_mean, moving_variance = 0.0, 1.0
    for batch, train, scale_value, bias_value, test in _steps_with_adjustment(
            x, training, y, layer, scale, bias):
        mean, variance = batch.mean(0), batch.var(0)
        normalized = (batch - mean) / (variance + EPSILON) ** 0.5
        expected_train = (normalized * scale_value + bias_value) * GAMMA + BETA
        moving_mean += (mean - moving_mean) * (1.0 - momentum)
        moving_variance += (variance - moving_variance) * (1.0 - momentum)
        expected_test = (batch - moving_mean) / (moving_variance + EPSILON) ** 0.5 * GAMMA + BETA
        assert_all_close(expected_train, train, atol=1e-5, what='training output')
        assert_all_close(expected_test, test, atol=1e-5, what='inference output')


def testRenormWithAdjustment(layers):
    model = _Renorm(momentum=0.99, renorm_momentum=0.8)
    x = tf1.placeholder(tf.float32, SHAPE)
    scale, bias = _adjustments()
    training, y, layer = _layer(layers, x, 0.99, renorm=True, renorm_clipping=dict(CLIPPING),
                                renorm_momentum=0.8, adjustment=lambda _: (scale, bias))
    for batch, train, scale_value, bias_value, test in _steps_with_adjustment(
            x, training, y, layer, scale, bias):
        normalized, stddev = model.train(batch, CLIPPING)
        expected_train = (normalized * scale_value + bias_value) * GAMMA + BETA
        model.update(batch, stddev)
        expected_test = model.infer(batch)
        assert_all_close(expected_train, train, atol=1e-5, what='training output')
        assert_all_close(expected_test, test, atol=1e-5, what='inference output')

"""Port of tf-keras' legacy normalization tests, part 2: 100 training steps, then inference.

See :mod:`tf_keras_normalization_port` for the original and how the port runs.
Each case feeds a variable of uniform data (``+ 100`` where the original adds
it) to the layer (epsilon 1e-3, momentum 0.9) for 100 training steps and
checks, with the original's formula and rounding, that the output is
normalized at every step (``(y - epsilon) * gamma + beta`` has mean 0 and
standard deviation 1), that the moving mean and variance are then the data's
own (within 1e-2, per normalized axis or block of axes), and that the
inference output is normalized too.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_keras_normalization_port import (NEEDS_CUDA, assert_all_close, assert_almost_equal,
                                         evaluate, has_cuda_gpu, session)

tf1 = tf.compat.v1
EPSILON = 1e-3


def _assert_normalized(output, gamma, beta, mean_places=1):
    """The original's check: ``(output - epsilon) * gamma + beta`` has mean ~0 and std ~1."""
    values = (output - EPSILON) * gamma + beta
    assert_almost_equal(np.mean(values), 0.0, mean_places, what='mean of the normalized output')
    assert_almost_equal(np.std(values), 1.0, 1, what='std of the normalized output')


def _assert_moving_statistics(moving_mean, moving_variance, inputs, reduced, keepdims=False):
    """The moving mean and variance are ``inputs``' mean and biased variance over ``reduced``."""
    mean, variance = evaluate([moving_mean, moving_variance])
    data = evaluate(inputs)
    assert_all_close(np.mean(data, axis=reduced, keepdims=keepdims), mean, atol=1e-2,
                     what='moving mean')
    assert_all_close(np.square(np.std(data, axis=reduced, keepdims=keepdims)), variance,
                     atol=1e-2, what='moving variance')


def _normalizes(layers, shape, axis, reduced, parameter_shape=None, **options):
    """The common case: a layer on ``axis`` of an input of ``shape``, trained by a placeholder.

    ``parameter_shape``: how the original reshapes ``gamma`` and ``beta`` to
    broadcast them over the output (one axis); None where they have the
    input's rank already (several axes; the statistics then keep their
    dimensions too).
    """
    layer = layers.BatchNormalization(axis=axis, epsilon=EPSILON, momentum=0.9, **options)
    inputs = tf.Variable(np.random.random(shape) + 100, dtype=tf.float32)
    training = tf1.placeholder(dtype='bool')
    outputs = layer(inputs, training=training)
    with session() as sess:
        sess.run(tf1.global_variables_initializer())
        gamma, beta = evaluate([layer.gamma, layer.beta])
        if parameter_shape is not None:
            gamma, beta = np.reshape(gamma, parameter_shape), np.reshape(beta, parameter_shape)
        for _ in range(100):
            output, _, _ = sess.run([outputs] + layer.updates, feed_dict={training: True})
            _assert_normalized(output, gamma, beta)
        _assert_moving_statistics(layer.moving_mean, layer.moving_variance, inputs, reduced,
                                  keepdims=parameter_shape is None)
        _assert_normalized(sess.run(outputs, feed_dict={training: False}), gamma, beta)


def test3DInputAxis1(layers):
    _normalizes(layers, (5, 4, 3), 1, (0, 2), (1, 4, 1))


def test3DInputAxis2(layers):
    _normalizes(layers, (5, 4, 3), 2, (0, 1), (1, 1, 3))


def test4DInputAxis1(layers):
    if not has_cuda_gpu():
        pytest.skip(NEEDS_CUDA)
    _normalizes(layers, (5, 4, 3, 6), 1, (0, 2, 3), (1, 4, 1, 1))


def test4DInputAxis2(layers):
    _normalizes(layers, (5, 4, 3, 6), 2, (0, 1, 3), (1, 1, 3, 1))


def test4DInputAxis3(layers):
    _normalizes(layers, (5, 4, 3, 6), 3, (0, 1, 2), (1, 1, 1, 6))


def test4DInputAxis3Fused(layers):
    _normalizes(layers, (5, 4, 3, 6), 3, (0, 1, 2), (1, 1, 1, 6), fused=True)


def test4DInputAxis1Fused(layers):
    if not has_cuda_gpu():
        pytest.skip(NEEDS_CUDA)
    _normalizes(layers, (5, 4, 3, 6), 1, (0, 2, 3), (1, 4, 1, 1), fused=True)


def testNegativeAxis(layers):
    _normalizes(layers, (5, 4, 3, 6), -1, (0, 1, 2), (1, 1, 1, 6))


def test3DInputMultiAxis12(layers):
    _normalizes(layers, (5, 4, 3), [1, 2], 0)


def test5DInputMultiAxis123(layers):
    _normalizes(layers, (5, 3, 4, 4, 3), [1, 2, 3], (0, 4))


def testBooleanLearningPhase(layers):
    layer = layers.BatchNormalization(axis=-1, epsilon=EPSILON, momentum=0.9)
    inputs = tf.Variable(np.random.random((5, 4, 3, 6)) + 100, dtype=tf.float32)
    training_outputs = layer(inputs, training=True)
    inference_outputs = layer(inputs, training=False)
    with session() as sess:
        sess.run(tf1.global_variables_initializer())
        gamma, beta = (np.reshape(v, (1, 1, 1, 6)) for v in evaluate([layer.gamma, layer.beta]))
        for _ in range(100):
            output, _, _ = sess.run([training_outputs] + layer.updates)
            _assert_normalized(output, gamma, beta, mean_places=2)
        _assert_moving_statistics(layer.moving_mean, layer.moving_variance, inputs, (0, 1, 2))
        _assert_normalized(evaluate(inference_outputs), gamma, beta)


def _variables_named(scope):
    """``(gamma, beta, moving_mean, moving_variance)`` of the global variables under ``scope/``."""
    found = {variable.name: variable for variable in tf1.global_variables()}
    return tuple(found['%s/%s:0' % (scope, name)]
                 for name in ('gamma', 'beta', 'moving_mean', 'moving_variance'))


def testFunctionalNoReuse(layers):
    inputs = tf.Variable(np.random.random((5, 4, 3, 6)), dtype=tf.float32)
    training = tf1.placeholder(dtype='bool')
    outputs = layers.batch_norm(inputs, axis=-1, momentum=0.9, epsilon=EPSILON,
                                training=training, name='bn')
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    gamma, beta, moving_mean, moving_variance = _variables_named('bn')
    with session() as sess:
        sess.run(tf1.global_variables_initializer())
        gamma, beta = (np.reshape(v, (1, 1, 1, 6)) for v in evaluate([gamma, beta]))
        for _ in range(100):
            output, _, _ = sess.run([outputs] + updates, feed_dict={training: True})
            _assert_normalized(output, gamma, beta)
        _assert_moving_statistics(moving_mean, moving_variance, inputs, (0, 1, 2))
        _assert_normalized(sess.run(outputs, feed_dict={training: False}), gamma, beta)


def testFunctionalReuse(layers):
    first_inputs = tf.Variable(np.random.random((5, 4, 3, 6)), dtype=tf.float32)
    inputs = tf.Variable(np.random.random((5, 4, 3, 6)), dtype=tf.float32)
    training = tf1.placeholder(dtype='bool')
    options = dict(axis=-1, momentum=0.9, epsilon=EPSILON, training=training, name='bn')
    layers.batch_norm(first_inputs, **options)
    outputs = layers.batch_norm(inputs, reuse=True, **options)
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)[-2:]
    gamma, beta, moving_mean, moving_variance = _variables_named('bn')
    with session() as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(100):
            output, _, _ = sess.run([outputs] + updates, feed_dict={training: True})
        _assert_moving_statistics(moving_mean, moving_variance, inputs, (0, 1, 2))
        gamma, beta = (np.reshape(v, (1, 1, 1, 6)) for v in evaluate([gamma, beta]))
        _assert_normalized(output, gamma, beta, mean_places=2)
        _assert_normalized(sess.run(outputs, feed_dict={training: False}), gamma, beta,
                           mean_places=2)

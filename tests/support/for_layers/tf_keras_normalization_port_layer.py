"""Port of tf-keras' legacy normalization tests, part 4: the layer's objects, ghost batches, axes.

See :mod:`tf_keras_normalization_port` for the original and how the port runs.
The layer's variables, update ops and losses and the collections they go
to; reuse under a variable scope; constraints; ghost batch normalization
(``virtual_batch_size``) against the original's numpy model; the axis lists
it must refuse.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_keras_normalization_port import assert_all_close, assert_list_equal, session

tf1 = tf.compat.v1


def _assert_counts(layer, updates, variables, trainable, non_trainable):
    """The numbers of the layer's update ops and (trainable, non-trainable) variables."""
    counts = (len(layer.updates), len(layer.variables), len(layer.trainable_variables),
              len(layer.non_trainable_variables))
    assert counts == (updates, variables, trainable, non_trainable), counts


def _assert_in_collections(layer):
    """``UPDATE_OPS`` is the layer's updates, ``TRAINABLE_VARIABLES`` its trainable variables."""
    assert_list_equal(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS), layer.updates,
                      what='UPDATE_OPS')
    assert_list_equal(tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES),
                      layer.trainable_variables, what='TRAINABLE_VARIABLES')


def testCreateBN(layers):
    layer = layers.BatchNormalization(axis=1)
    inputs = tf.random.uniform((5, 4, 3), seed=1)
    outputs = layer(inputs, training=tf1.placeholder(dtype='bool'))
    assert_list_equal(outputs.get_shape().as_list(), [5, 4, 3], what='output shape')
    _assert_counts(layer, 2, 4, 2, 2)
    _assert_in_collections(layer)


def testCreateFusedBNFloat16(layers):
    layer = layers.BatchNormalization(axis=1, fused=True)
    inputs = tf.random.uniform((5, 4, 3, 3), seed=1, dtype=tf.float16)
    outputs = layer(inputs, training=tf1.placeholder(dtype='bool'))
    assert_list_equal(outputs.get_shape().as_list(), [5, 4, 3, 3], what='output shape')
    _assert_counts(layer, 2, 4, 2, 2)
    # A reference variable's dtype is the "_ref" twin of its base dtype.
    not_reference = [v.name for v in layer.variables if v.dtype == v.dtype.base_dtype]
    assert not not_reference, 'not reference variables: %s' % not_reference
    _assert_in_collections(layer)


def testFunctionalReuseFromScope(layers):
    inputs = tf.Variable(np.random.random((5, 4, 3, 6)), dtype=tf.float32)
    training = tf1.placeholder(dtype='bool')
    for reuse in (None, True):
        with tf1.variable_scope('scope', reuse=reuse):
            layers.batch_norm(inputs, axis=-1, momentum=0.9, epsilon=1e-3, training=training)
            assert len(tf1.global_variables()) == 5, tf1.global_variables()


def testNoCenter(layers):
    layer = layers.BatchNormalization(axis=1, center=False)
    outputs = layer(tf.random.uniform((5, 4, 3), seed=1), training=tf1.placeholder(dtype='bool'))
    assert_list_equal(outputs.get_shape().as_list(), [5, 4, 3], what='output shape')
    _assert_counts(layer, 2, 3, 1, 2)


def testNoScale(layers):
    layer = layers.BatchNormalization(axis=1, scale=False)
    outputs = layer(tf.random.uniform((5, 4, 3), seed=1), training=tf1.placeholder(dtype='bool'))
    assert_list_equal(outputs.get_shape().as_list(), [5, 4, 3], what='output shape')
    _assert_counts(layer, 2, 3, 1, 2)


def testRegularizers(layers):
    def regularizer(variable):
        return 0.1 * tf.reduce_sum(variable)

    for argument in ('beta_regularizer', 'gamma_regularizer'):
        layer = layers.BatchNormalization(axis=1, **{argument: regularizer})
        layer(tf.random.uniform((5, 4, 3), seed=1), training=tf1.placeholder(dtype='bool'))
        assert len(layer.losses) == 1, (argument, layer.losses)


def testConstraints(layers):
    def gamma_constraint(variable):
        return variable / tf.reduce_sum(variable)

    def beta_constraint(variable):
        return variable / tf.reduce_max(variable)

    layer = layers.BatchNormalization(axis=1, gamma_constraint=gamma_constraint,
                                      beta_constraint=beta_constraint)
    layer(tf.random.uniform((5, 4, 3), seed=1))
    assert layer.gamma_constraint == gamma_constraint
    assert layer.beta_constraint == beta_constraint


def testGhostBNNegativeVirtualBatch(layers):
    inputs = tf.random.uniform([6, 5, 4, 3], seed=1)
    with pytest.raises(ValueError):
        layers.batch_normalization(inputs, virtual_batch_size=-1)


def testGhostBNVirtualBatchFull(layers):
    shape = [6, 5, 4, 3]
    inputs = tf.random.uniform(shape, seed=1)
    whole = layers.batch_normalization(inputs)
    ghost = layers.batch_normalization(inputs, virtual_batch_size=6)
    assert_list_equal(whole.shape.as_list(), ghost.shape.as_list(), what='output shapes')
    with session() as sess:
        sess.run(tf1.global_variables_initializer())
        batch = np.random.random(shape)
        whole_value, ghost_value = sess.run([whole, ghost], feed_dict={inputs: batch})
        assert_all_close(whole_value, ghost_value, atol=1e-5, what='one virtual batch')


def testGhostBNInputOutputShapesMatch(layers):
    shape = [6, 4, 3]
    outputs = layers.batch_normalization(tf.random.uniform(shape, seed=1), virtual_batch_size=3)
    assert_list_equal(outputs.shape.as_list(), shape, what='output shape')


def testGhostBNUnknownBatchSize(layers):
    inputs = tf1.placeholder(tf.float32, [None, 5, 4])
    outputs = layers.batch_normalization(inputs, virtual_batch_size=2)
    with session() as sess:
        sess.run(tf1.global_variables_initializer())
        value = sess.run(outputs, feed_dict={inputs: np.random.random([10, 5, 4])})
        assert_list_equal(list(value.shape), [10, 5, 4], what='output shape')


def _ghost_batches(layers, shape, virtual_batch_size, statistics_shape, reduced, atol,
                   **options):
    """Five steps of ghost batch norm (beta 2, gamma 3, momentum 0.8) against the numpy model.

    The batch is viewed as ``[virtual_batch_size, batch / virtual_batch_size,
    ...]``: each virtual batch normalized by its own mean and variance over
    ``reduced`` (axes of that view), the moving statistics (of
    ``statistics_shape`` at first) following the mean over virtual batches.
    """
    beta, gamma, momentum, epsilon = 2.0, 3.0, 0.8, 1e-3
    moving_mean = np.zeros(statistics_shape, dtype=np.float32)
    moving_variance = np.ones(statistics_shape, dtype=np.float32)
    inputs = tf1.placeholder(tf.float32, shape)
    training = tf1.placeholder(tf.bool)
    layer = layers.BatchNormalization(
        momentum=momentum, epsilon=epsilon, beta_initializer=tf1.constant_initializer(beta),
        gamma_initializer=tf1.constant_initializer(gamma), virtual_batch_size=virtual_batch_size,
        **options)
    outputs = layer(inputs, training=training)
    view = [virtual_batch_size, shape[0] // virtual_batch_size] + list(shape[1:])
    with session() as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(5):
            batch = np.random.random(shape)
            ghosts = np.reshape(batch, view)
            means = np.mean(ghosts, axis=reduced, keepdims=True)
            variances = np.var(ghosts, axis=reduced, keepdims=True)
            moving_mean = moving_mean * momentum + np.mean(means, axis=1, keepdims=True) * (
                1.0 - momentum)
            moving_variance = moving_variance * momentum + np.mean(
                variances, axis=1, keepdims=True) * (1.0 - momentum)
            expected_train = (ghosts - means) / (variances + epsilon) ** 0.5 * gamma + beta
            expected_test = (ghosts - moving_mean) / (moving_variance + epsilon) ** 0.5 * gamma \
                + beta
            train, _, _ = sess.run([outputs] + layer.updates,
                                   feed_dict={inputs: batch, training: True})
            test = sess.run(outputs, feed_dict={inputs: batch, training: False})
            assert_all_close(np.reshape(expected_train, shape), train, atol=atol,
                             what='training output')
            assert_all_close(np.reshape(expected_test, shape), test, atol=atol,
                             what='inference output')


def testGhostBN2Dims(layers):
    _ghost_batches(layers, [6, 2], 3, [2, 2], 0, 1e-5)


def testGhostBN4DimsAxis3(layers):
    _ghost_batches(layers, [6, 10, 10, 3], 2, [1, 1, 1, 1, 3], (0, 2, 3), 1e-2, axis=3)


def testGhostBN4DimsAxis1(layers):
    # fused=False as in the original: the CPU has no fused kernel for channels first.
    _ghost_batches(layers, [6, 3, 10, 10], 2, [1, 1, 3, 1, 1], (0, 3, 4), 1e-2, axis=1,
                   fused=False)


def testMultiAxisInvalid(layers):
    inputs = tf.random.uniform([6, 5, 4, 3], seed=1)
    for axis in ([1, 4], [-5, 1], [1, 2, 1]):        # out of range, out of range, repeated
        with pytest.raises(ValueError):
            layers.batch_normalization(inputs, axis=axis)


def testGhostBN5DimsMultiAxis14(layers):
    _ghost_batches(layers, [6, 3, 10, 10, 4], 3, [1, 1, 3, 1, 1, 4], (0, 3, 4), 1e-2,
                   axis=[1, 4], fused=False)

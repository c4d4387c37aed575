"""Port of tf-keras' legacy normalization tests, part 1: training, checkpoints and inference.

See :mod:`tf_keras_normalization_port` for the original and how the port runs.
Every case here trains the original's small model: a 3x3 convolution to 2
channels (tf-keras' own ``conv2d`` in both runs: a kernel of ones, no bias),
the layer under test, ``sum(|y|)`` as the loss, SGD with rate 0.01 (after
the update ops when training), for two steps on seeded random images of
shape ``[2, 4, 5, 3]``; each graph built anew. As in the original, the model
sets ``_bessels_correction_test_only = False`` on the layer: a private,
test-only attribute of tf-keras' layer that makes its fused path track the
biased batch variance, as its non-fused path does. tf1_syncbn's layer does
not read it (it follows tf.layers' public behaviour), so the nine
``testCheckpoint*`` cases, which compare a fused model with a non-fused one,
fail with it on the moving variance: the expected outcome
(``test_tf_keras_own_tests.py``). ``testHalfPrecision`` compares fused
models only and passes.
"""

import itertools

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import saver_pb2
from tf_keras.src.legacy_tf_layers import convolutional

from tf_keras_normalization_port import MODELS_DIFFER, assert_all_close, session

tf1 = tf.compat.v1
#: The images: batch, height, width, channels.
IMAGES = [2, 4, 5, 3]


def _model(layers, images, fused, frozen):
    """The original's model: ``(loss, train_op, saver)``."""
    features = convolutional.conv2d(images, 2, 3, use_bias=False,
                                    kernel_initializer=tf1.ones_initializer())
    layer = layers.BatchNormalization(fused=fused)
    layer._bessels_correction_test_only = False
    loss = tf.reduce_sum(tf.abs(layer(features, training=not frozen)))
    optimizer = tf1.train.GradientDescentOptimizer(0.01)
    if frozen:
        train_op = optimizer.minimize(loss)
    else:
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train_op = optimizer.minimize(loss)
    return loss, train_op, tf1.train.Saver(write_version=saver_pb2.SaverDef.V2)


def _train(layers, path, use_gpu, fused, restore=False, frozen=False, dtype=tf.float32):
    """Two training steps on a new graph, from scratch (then saved to ``path``) or from ``path``.

    Returns:
      After a restore, ``(name, value)`` of every global variable; else None.
    """
    with session(tf.Graph(), use_gpu) as sess:
        images = tf1.placeholder(dtype, IMAGES)
        loss, train_op, saver = _model(layers, images, fused, frozen)
        if restore:
            saver.restore(sess, path)
        else:
            sess.run(tf1.global_variables_initializer())
        np.random.seed(0)
        for _ in range(2):
            batch = np.random.rand(*IMAGES).astype(dtype.as_numpy_dtype)
            sess.run([loss, train_op], feed_dict={images: batch})
        if not restore:
            saver.save(sess, path)
            return None
        return [(variable.op.name, variable.eval())
                for variable in tf1.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)]


def _infer(layers, path, batch, use_gpu, fused):
    """The loss of the model restored from ``path`` in inference mode on ``batch``."""
    with session(tf.Graph(), use_gpu) as sess:
        images = tf1.placeholder(batch.dtype, IMAGES)
        loss, _, saver = _model(layers, images, fused, frozen=True)
        saver.restore(sess, path)
        return sess.run(loss, feed_dict={images: batch})


def _train_restore_infer(layers, directory, dtype, first_gpu, second_gpu, infer_gpu):
    """Trains a fused model, trains it on from its checkpoint, infers: ``(variables, loss)``."""
    path = str(directory / ('cp_%s_%s_%s_%s' % (dtype.name, first_gpu, second_gpu, infer_gpu)))
    _train(layers, path, first_gpu, fused=True, dtype=dtype)
    variables = _train(layers, path, second_gpu, fused=True, restore=True, dtype=dtype)
    np.random.seed(0)
    batch = np.random.rand(*IMAGES).astype(dtype.as_numpy_dtype)
    return variables, _infer(layers, path, batch, infer_gpu, fused=True)


def testHalfPrecision(layers, tmp_path):
    reference, reference_loss = _train_restore_infer(layers, tmp_path, tf.float32, True, True,
                                                     True)
    assert len(reference) == 5, reference
    for devices in itertools.product([True, False], repeat=3):
        variables, loss = _train_restore_infer(layers, tmp_path, tf.float16, *devices)
        assert len(variables) == 5, variables
        for (name, value), (_, expected) in zip(variables, reference):
            assert_all_close(value, expected, rtol=1e-3, atol=1e-3, what='float16 ' + name)
        assert_all_close(loss, reference_loss, rtol=1e-3, atol=1e-3, what='float16 loss')


def _checkpoints(layers, directory, fused_a, fused_b, gpu_a, gpu_b, test_gpu_a, test_gpu_b,
                 frozen):
    """Models ``a`` and ``b`` trained and saved, trained on as fused and non-fused: equal."""
    tag = '_'.join(str(v) for v in (fused_a, fused_b, gpu_a, gpu_b, test_gpu_a, test_gpu_b))
    path_a = str(directory / ('checkpoint_a_' + tag))
    path_b = str(directory / ('checkpoint_b_' + tag))
    _train(layers, path_a, gpu_a, fused_a, frozen=frozen)
    _train(layers, path_b, gpu_b, fused_b, frozen=frozen)
    fused = _train(layers, path_a, test_gpu_a, True, restore=True, frozen=frozen)
    non_fused = _train(layers, path_b, test_gpu_b, False, restore=True, frozen=frozen)
    assert len(fused) == 5 and len(non_fused) == 5, (fused, non_fused)
    for (name, value), (other_name, other) in zip(fused, non_fused):
        assert_all_close(value, other, atol=1e-5, what='%s: %s and %s (frozen=%s)' % (
            MODELS_DIFFER, name, other_name, frozen))
    batch = np.random.rand(*IMAGES).astype(np.float32)
    loss = _infer(layers, path_a, batch, test_gpu_a, True)
    non_fused_loss = _infer(layers, path_b, batch, test_gpu_b, False)
    assert_all_close(loss, non_fused_loss, atol=1e-6, rtol=3e-4, what='inference losses')


def _across_devices(layers, directory, a_fused, a_gpu, b_fused, b_gpu):
    """:func:`_checkpoints` on every pair of test devices, frozen and training.

    The original passes its four arguments on in this order to a function
    whose first four parameters are ``(fused_a, fused_b, gpu_a, gpu_b)``, so
    checkpoint ``a`` is trained with ``fused=a_fused`` on ``use_gpu=b_fused``
    and ``b`` with ``fused=a_gpu`` on ``use_gpu=b_gpu``; the port keeps that.
    """
    for test_gpu_a, test_gpu_b, frozen in itertools.product([True, False], repeat=3):
        _checkpoints(layers, directory, a_fused, a_gpu, b_fused, b_gpu, test_gpu_a, test_gpu_b,
                     frozen)


def testCheckpointFusedCPUAndFusedGPU(layers, tmp_path):
    _across_devices(layers, tmp_path, True, False, True, True)


def testCheckpointFusedCPUAndFusedCPU(layers, tmp_path):
    _across_devices(layers, tmp_path, True, False, True, False)


def testCheckpointFusedGPUAndFusedGPU(layers, tmp_path):
    _across_devices(layers, tmp_path, True, True, True, True)


def testCheckpointNonFusedCPUAndNonFusedGPU(layers, tmp_path):
    _across_devices(layers, tmp_path, False, False, False, True)


def testCheckpointNonFusedCPUAndNonFusedCPU(layers, tmp_path):
    _across_devices(layers, tmp_path, False, False, False, False)


def testCheckpointNonFusedGPUAndNonFusedGPU(layers, tmp_path):
    _across_devices(layers, tmp_path, False, True, False, True)


def testCheckpointNonFusedGPUAndFusedGPU(layers, tmp_path):
    _across_devices(layers, tmp_path, False, True, True, True)


def testCheckpointNonFusedGPUAndFusedCPU(layers, tmp_path):
    _across_devices(layers, tmp_path, False, True, True, False)


def testCheckpointNonFusedCPUAndFusedCPU(layers, tmp_path):
    _across_devices(layers, tmp_path, False, False, True, False)

"""A ``tf.estimator`` script (TensorFlow 2.15, the last release that has it): a ``model_fn``
with ``tf.compat.v1.layers.batch_normalization``, trained with
``RunConfig(train_distribute=MirroredStrategy(...))`` on REPLICAS virtual CPUs (a plain
``Estimator`` on one). Each replica gets its own batch from ``input_fn``. Unchanged under
``python -m tf1_syncbn.run`` (tests/run/test_run_scripts.py).

Usage: ``python estimator_mirrored.py REPLICAS OUT.npz``.
"""

import sys
import tempfile

import numpy as np
import tensorflow as tf

import tf_behavior

tf_behavior.apply()
tf1 = tf.compat.v1
REPLICAS, OUT = int(sys.argv[1]), sys.argv[2]
BATCH, STEPS = 8, 2
RNG = np.random.RandomState(5)
X = (RNG.randn(STEPS * BATCH, 3) * 2 + 1).astype(np.float32)
Y = RNG.randn(STEPS * BATCH, 3).astype(np.float32)
VARIABLES = ('bn/moving_mean', 'bn/moving_variance', 'bn/gamma', 'bn/beta')


def input_fn():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH // REPLICAS,
                                                           drop_remainder=True)


def model_fn(features, labels, mode):
    h = tf1.layers.batch_normalization(features, training=True, momentum=0.5, name='bn')
    loss = tf.reduce_sum(tf.square(h - labels)) / tf.cast(tf.shape(features)[0], tf.float32)
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = tf1.train.GradientDescentOptimizer(0.5).minimize(
            loss, global_step=tf1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


strategy = (tf1.distribute.MirroredStrategy(['/cpu:%d' % i for i in range(REPLICAS)])
            if REPLICAS > 1 else None)
config = tf.estimator.RunConfig(
    session_config=tf1.ConfigProto(device_count={'CPU': REPLICAS}, allow_soft_placement=True),
    train_distribute=strategy, save_summary_steps=None, log_step_count_steps=None)
estimator = tf.estimator.Estimator(model_fn, model_dir=tempfile.mkdtemp(), config=config)
estimator.train(input_fn, steps=STEPS)
np.savez(OUT, **{name: estimator.get_variable_value(name) for name in VARIABLES})
print('trained %d steps' % STEPS, flush=True)

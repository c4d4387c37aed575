"""A hand-written batch norm (``tf.nn.moments`` and moving averages of its own) in a
``tower_%d`` loop (``unchanged.common.tower_gradients``), the last tower's ``UPDATE_OPS`` run
with the train op: what no patch can switch. ``python -m tf1_syncbn.run --strict`` stops it
before its first step (tests/run/test_run_scripts.py).

Usage: ``python hand_moments.py TOWERS OUT.npz``.
"""

import tensorflow as tf

import tf_behavior
from unchanged.common import BATCH, arguments, data, tower_gradients, train_and_save

tf_behavior.apply()
tf1 = tf.compat.v1
TOWERS, OUT = arguments()
DATA, _ = data(seed=4)


def batch_norm(x, decay=0.9):
    with tf1.variable_scope('my_bn'):
        mean, variance = tf.nn.moments(x, [0])
        moving_mean = tf1.get_variable('moving_mean', x.shape[-1:], trainable=False,
                                       initializer=tf1.zeros_initializer())
        moving_variance = tf1.get_variable('moving_variance', x.shape[-1:], trainable=False,
                                           initializer=tf1.ones_initializer())
        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign_sub(
            moving_mean, (1 - decay) * (moving_mean - mean)))
        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign_sub(
            moving_variance, (1 - decay) * (moving_variance - variance)))
        return (x - mean) * tf.math.rsqrt(variance + 1e-3)


def tower_loss(x):
    w = tf1.get_variable('w', [5, 4], initializer=tf1.ones_initializer())
    return tf.reduce_mean(tf.square(batch_norm(tf.matmul(x, w)) - 0.3))


images = tf1.placeholder(tf.float32, [BATCH, 5])
opt = tf1.train.GradientDescentOptimizer(0.5)
tower_grads, updates = tower_gradients(images, TOWERS, opt, tower_loss)
grads = [(tf.add_n([g for g, _ in pairs]) / TOWERS, pairs[0][1]) for pairs in zip(*tower_grads)]
with tf.control_dependencies(updates):
    train_op = opt.apply_gradients(grads)

train_and_save(train_op, images, DATA, TOWERS, OUT)

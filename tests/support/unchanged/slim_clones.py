"""A tf-slim ``model_deploy``-style script: ``clone_%d`` scopes (none with one clone),
variables reused after the first clone, ``normalizer_fn=slim.batch_norm`` in an ``arg_scope``,
the first clone's ``UPDATE_OPS``. Unchanged under ``python -m tf1_syncbn.run``
(tests/run/test_run_scripts.py).

Usage: ``python slim_clones.py CLONES OUT.npz`` (the global batch is split into CLONES).
"""

import tensorflow as tf
import tf_slim as slim

import tf_behavior
from unchanged.common import BATCH, arguments, data, train_and_save

tf_behavior.apply()
tf1 = tf.compat.v1
CLONES, OUT = arguments()
DATA, W = data(seed=1)


def clone_fn(x):
    with slim.arg_scope([slim.fully_connected], normalizer_fn=slim.batch_norm,
                        normalizer_params={'decay': 0.5, 'scale': True, 'is_training': True}):
        net = slim.fully_connected(x, 4, weights_initializer=tf1.constant_initializer(W),
                                   scope='fc1')
    return tf.reduce_mean(tf.square(net - 0.3))


images = tf1.placeholder(tf.float32, [BATCH, 5])
opt = tf1.train.GradientDescentOptimizer(0.5)
clone_grads = []
for i, x in enumerate(tf.split(images, CLONES)):
    with tf1.name_scope('clone_%d' % i if CLONES > 1 else None) as scope, \
            tf.device('/cpu:%d' % i), \
            tf1.variable_scope(tf1.get_variable_scope(), reuse=True if i > 0 else None):
        loss = clone_fn(x) / CLONES          # model_deploy divides each clone's loss
        if i == 0:
            update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope)
        clone_grads.append(opt.compute_gradients(loss))
grads = [(tf.add_n([g for g, _ in pairs]), pairs[0][1]) for pairs in zip(*clone_grads)]
with tf.control_dependencies(update_ops):
    train_op = opt.apply_gradients(grads)

train_and_save(train_op, images, DATA, CLONES, OUT)

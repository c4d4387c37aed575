"""A ``cifar10_multi_gpu_train.py``-style tf.layers script: ``tower_%d`` loop
(``unchanged.common.tower_gradients``), the last tower's ``UPDATE_OPS``. Unchanged under
``python -m tf1_syncbn.run`` (tests/run/test_run_scripts.py).

Usage: ``python layers_towers.py TOWERS OUT.npz`` (the global batch is split into TOWERS;
``{worker}`` in OUT becomes the worker's index in ``TF_CONFIG``, for runs under the launcher).
"""

import tensorflow as tf

import tf_behavior
from unchanged.common import BATCH, arguments, data, tower_gradients, train_and_save

tf_behavior.apply()
tf1 = tf.compat.v1
TOWERS, OUT = arguments()
DATA, W = data(seed=0)


def tower_loss(x):
    h = tf.matmul(x, tf1.get_variable('w', initializer=W))
    h = tf1.layers.batch_normalization(h, training=True, momentum=0.5, name='bn')
    return tf.reduce_mean(tf.square(tf.nn.relu(h) - 0.3))


def average_gradients(tower_grads):
    return [(tf.add_n([g for g, _ in pairs]) / len(pairs), pairs[0][1])
            for pairs in zip(*tower_grads)]


images = tf1.placeholder(tf.float32, [BATCH, 5])
opt = tf1.train.GradientDescentOptimizer(0.5)
tower_grads, batchnorm_updates = tower_gradients(images, TOWERS, opt, tower_loss)
apply_gradient_op = opt.apply_gradients(average_gradients(tower_grads))
train_op = tf.group(apply_gradient_op, *batchnorm_updates)

train_and_save(train_op, images, DATA, TOWERS, OUT)

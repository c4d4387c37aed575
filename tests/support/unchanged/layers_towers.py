"""A ``cifar10_multi_gpu_train.py``-style tf.layers script: ``tower_%d`` loop, the last tower's
``UPDATE_OPS``. Unchanged under ``python -m tf1_syncbn.run`` (tests/run/test_run_scripts.py).

Usage: ``python layers_towers.py TOWERS OUT.npz`` (the global batch is split into TOWERS;
``{worker}`` in OUT becomes the worker's index in ``TF_CONFIG``, for runs under the launcher).
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import tf_behavior

tf_behavior.apply()
tf1 = tf.compat.v1
TOWERS = int(sys.argv[1])
OUT = sys.argv[2].replace('{worker}', str(json.loads(os.environ.get('TF_CONFIG') or '{}')
                                          .get('task', {}).get('index', 0)))
BATCH, STEPS = 8, 2
RNG = np.random.RandomState(0)
DATA = (RNG.randn(STEPS, BATCH, 5) * 2 + 1).astype(np.float32)
W = RNG.randn(5, 4).astype(np.float32)


def tower_loss(x):
    h = tf.matmul(x, tf1.get_variable('w', initializer=W))
    h = tf1.layers.batch_normalization(h, training=True, momentum=0.5, name='bn')
    return tf.reduce_mean(tf.square(tf.nn.relu(h) - 0.3))


def average_gradients(tower_grads):
    return [(tf.add_n([g for g, _ in pairs]) / len(pairs), pairs[0][1])
            for pairs in zip(*tower_grads)]


images = tf1.placeholder(tf.float32, [BATCH, 5])
opt = tf1.train.GradientDescentOptimizer(0.5)
tower_grads = []
with tf1.variable_scope(tf1.get_variable_scope()):
    for i, x in enumerate(tf.split(images, TOWERS)):
        with tf.device('/cpu:%d' % i), tf1.name_scope('tower_%d' % i) as scope:
            loss = tower_loss(x)
            tf1.get_variable_scope().reuse_variables()
            batchnorm_updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope)
            tower_grads.append(opt.compute_gradients(loss))
apply_gradient_op = opt.apply_gradients(average_gradients(tower_grads))
train_op = tf.group(apply_gradient_op, *batchnorm_updates)

config = tf1.ConfigProto(device_count={'CPU': TOWERS}, allow_soft_placement=True)
with tf1.Session(config=config) as sess:
    sess.run(tf1.global_variables_initializer())
    for step in range(STEPS):
        sess.run(train_op, {images: DATA[step]})
        print('step %d done' % (step + 1), flush=True)
    np.savez(OUT, **{v.op.name: sess.run(v) for v in tf1.global_variables()})

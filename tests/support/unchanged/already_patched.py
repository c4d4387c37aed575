"""A script that already uses the library: it imports ``tf1_syncbn`` first (TensorFlow is then
imported inside that import), takes tf.layers' function by ``from ... import`` and calls
``patch_tf_layers(num_dev=TOWERS)`` itself, in a ``tower_%d`` loop
(``unchanged.common.tower_gradients``); then restores the patch.
Under ``python -m tf1_syncbn.run --strict`` (no ``--num-dev``) it keeps its own patch's
arguments (tests/run/test_run_scripts.py).

Usage: ``python already_patched.py TOWERS OUT.npz``.
"""

import sys

import tf1_syncbn  # first: the runner switches on once this import ends
import numpy as np
import tensorflow.compat.v1 as tf
from tensorflow.compat.v1.layers import batch_normalization

import tf_behavior
from unchanged.common import tower_gradients

tf_behavior.apply()
TOWERS, OUT = int(sys.argv[1]), sys.argv[2]
patch = tf1_syncbn.patch_tf_layers(num_dev=TOWERS)


def tower_loss(x):
    h = batch_normalization(tf.layers.batch_normalization(x, training=True, name='bn1'),
                            training=True, name='bn2')
    return tf.reduce_mean(tf.square(h))


images = tf.placeholder(tf.float32, [8, 3])
opt = tf.train.GradientDescentOptimizer(0.1)
tower_grads, updates = tower_gradients(images, TOWERS, opt, tower_loss)
grads = [(tf.add_n([g for g, _ in pairs]) / TOWERS, pairs[0][1]) for pairs in zip(*tower_grads)]
with tf.control_dependencies(updates):
    train_op = opt.apply_gradients(grads)
with tf.Session(config=tf.ConfigProto(device_count={'CPU': TOWERS})) as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(train_op, {images: np.random.RandomState(6).rand(8, 3)})
    print('step 1 done', flush=True)
patch.restore()
print('restored: %s' % tf.layers.batch_normalization.__module__)

"""A Keras 2 model called in a ``tower_%d`` loop of a TF1 graph (one model, its weights shared by
every tower), the updates of each tower's call run with the train op. Needs tf-keras and
``TF_USE_LEGACY_KERAS=1`` (``tf.keras`` is then tf-keras). Unchanged under
``python -m tf1_syncbn.run`` (tests/run/test_run_scripts.py).

Usage: ``python keras_towers.py TOWERS OUT.npz`` (the global batch is split into TOWERS).
"""

import tensorflow as tf

import tf_behavior
from unchanged.common import BATCH, arguments, data, train_and_save

tf_behavior.apply()
tf1 = tf.compat.v1
keras = tf.keras
TOWERS, OUT = arguments()
DATA, W = data(seed=2)

model = keras.Sequential([
    keras.layers.Dense(4, use_bias=False, kernel_initializer=keras.initializers.Constant(W)),
    keras.layers.BatchNormalization(momentum=0.5, name='bn'),
    keras.layers.ReLU(),
])
model.build((None, 5))

images = tf1.placeholder(tf.float32, [BATCH, 5])
opt = tf1.train.GradientDescentOptimizer(0.5)
tower_grads, updates = [], []
for i, x in enumerate(tf.split(images, TOWERS)):
    with tf.device('/cpu:%d' % i), tf1.name_scope('tower_%d' % i):
        before = {id(u) for u in model.updates}
        loss = tf.reduce_mean(tf.square(model(x, training=True) - 0.3))
        updates += [u for u in model.updates if id(u) not in before]     # this tower's call
        tower_grads.append(opt.compute_gradients(loss, model.trainable_weights))
grads = [(tf.add_n([g for g, _ in pairs]) / TOWERS, pairs[0][1]) for pairs in zip(*tower_grads)]
with tf.control_dependencies(updates):
    train_op = opt.apply_gradients(grads)

train_and_save(train_op, images, DATA, TOWERS, OUT, model.weights)

"""A Keras 2 model called in a ``tower_%d`` loop of a TF1 graph (one model, its weights shared by
every tower), the updates of each tower's call run with the train op. Needs tf-keras and
``TF_USE_LEGACY_KERAS=1`` (``tf.keras`` is then tf-keras). Unchanged under
``python -m tf1_syncbn.run`` (tests/run/test_run_scripts.py).

Usage: ``python keras_towers.py TOWERS OUT.npz`` (the global batch is split into TOWERS).
"""

import sys

import numpy as np
import tensorflow as tf

import tf_behavior

tf_behavior.apply()
tf1 = tf.compat.v1
keras = tf.keras
TOWERS, OUT = int(sys.argv[1]), sys.argv[2]
BATCH, STEPS = 8, 2
RNG = np.random.RandomState(2)
DATA = (RNG.randn(STEPS, BATCH, 5) * 2 + 1).astype(np.float32)
W = RNG.randn(5, 4).astype(np.float32)

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

config = tf1.ConfigProto(device_count={'CPU': TOWERS}, allow_soft_placement=True)
with tf1.Session(config=config) as sess:
    sess.run(tf1.global_variables_initializer())
    for step in range(STEPS):
        sess.run(train_op, {images: DATA[step]})
        print('step %d done' % (step + 1), flush=True)
    np.savez(OUT, **{v.name: sess.run(v) for v in model.weights})

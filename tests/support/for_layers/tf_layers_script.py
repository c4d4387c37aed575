"""An unmodified TF1 tf.layers training script, in the multi-GPU styles of TF1 code.

Three loops, each building one name scope per device, reusing the variables
after the first, averaging the gradients, and running the update ops it
keeps as control dependencies of the train op (:data:`STYLES`):

* ``tower_last``: ``cifar10_multi_gpu_train.py``: ``tower_%d`` name scopes,
  ``reuse_variables()`` after the first tower, the **last** tower's
  ``UPDATE_OPS`` (filtered by its scope);
* ``clone_first``: tf-slim's ``model_deploy`` (``train_image_classifier.py``):
  ``clone_%d`` name scopes (none with one clone), a variable scope reused for
  clones after the first, the **first** clone's ``UPDATE_OPS``;
* ``all``: ``tower_%d`` name scopes and **every** ``UPDATE_OPS`` of the graph.

Batch norm through tf.layers' function (``bn1``, named, reused through the
enclosing scope) and its layer object (``bn2``, one object applied in every
tower), then an inference graph that reuses both (``reuse=True``,
``training=False``).

The tests run it as it is: with tf.layers itself on one tower (the
reference), and under ``tf1_syncbn.patch_tf_layers(num_dev=4)`` on 4 towers,
on plain TensorFlow 2.16+ and with tf-keras (``run_patched_script.py``).
``tf.layers.conv2d`` and ``dense`` exist only with tf-keras; without it the
script builds them from ``get_variable`` under the same names.

Usage: ``python tf_layers_script.py TOWERS OUT.npz [STYLE,...]`` (every style
by default, each in its own graph; writes ``OUT.npz``, its arrays keyed
``<style>/...``, and ``OUT.json``, the layer object's API by style).
"""

import json
import sys

import numpy as np
import tensorflow.compat.v1 as tf

import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)

tf_behavior.apply()

STEPS = 3
BATCH = 8
_RNG = np.random.RandomState(3)
CONV = _RNG.randn(3, 3, 3, 4).astype(np.float32) * 0.5
FC = _RNG.randn(4, 3).astype(np.float32)


def conv2d(x, name):
    try:
        conv = tf.layers.conv2d
    except AttributeError:      # TensorFlow 2.16+ without tf-keras
        with tf.variable_scope(name):
            kernel = tf.get_variable('kernel', initializer=CONV)
        return tf.nn.conv2d(x, kernel, [1, 1, 1, 1], 'SAME')
    return conv(x, 4, 3, padding='same', use_bias=False, name=name,
                kernel_initializer=tf.constant_initializer(CONV))


def dense(x, name):
    try:
        fully_connected = tf.layers.dense
    except AttributeError:      # TensorFlow 2.16+ without tf-keras
        with tf.variable_scope(name):
            kernel = tf.get_variable('kernel', initializer=FC)
            bias = tf.get_variable('bias', initializer=tf.zeros([3]))
        return tf.matmul(x, kernel) + bias
    return fully_connected(x, 3, name=name, kernel_initializer=tf.constant_initializer(FC))


def model(images, bn2, training):
    net = conv2d(images, 'conv1')
    net = tf.layers.batch_normalization(net, training=training, momentum=0.9, name='bn1',
                                        reuse=True if training is False else None)
    net = tf.reduce_mean(tf.nn.relu(net), [1, 2])
    net = bn2.apply(net, training=training)
    return dense(net, 'fc')


#: The loops: (name scope of tower i, which towers' UPDATE_OPS the train op runs).
STYLES = ('tower_last', 'clone_first', 'all')


def build(style, towers):
    """The training graph of one style; returns its tensors and the layer object."""
    images = tf.placeholder(tf.float32, [BATCH, 6, 6, 3])
    labels = tf.placeholder(tf.float32, [BATCH, 3])
    opt = tf.train.GradientDescentOptimizer(0.2)
    bn2 = tf.layers.BatchNormalization(momentum=0.8, name='bn2')
    tower_grads, losses, kept = [], [], []
    parts = zip(tf.split(images, towers), tf.split(labels, towers))
    if style == 'clone_first':
        # model_deploy.create_clones: clone_<i> (no name scope with one clone),
        # variables reused for the clones after the first.
        for i, (x, y) in enumerate(parts):
            with tf.name_scope('clone_%d' % i if towers > 1 else None) as scope, \
                    tf.device('/cpu:%d' % i), \
                    tf.variable_scope(tf.get_variable_scope(), reuse=True if i > 0 else None):
                loss = tf.reduce_mean(tf.square(model(x, bn2, True) - y))
                if i == 0:      # model_deploy: the first clone's update ops
                    kept = tf.get_collection(tf.GraphKeys.UPDATE_OPS, scope)
                tower_grads.append(opt.compute_gradients(loss))
                losses.append(loss)
    else:
        with tf.variable_scope(tf.get_variable_scope()):
            for i, (x, y) in enumerate(parts):
                with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i) as scope:
                    loss = tf.reduce_mean(tf.square(model(x, bn2, True) - y))
                    tf.get_variable_scope().reuse_variables()
                    kept = tf.get_collection(tf.GraphKeys.UPDATE_OPS, scope)   # the last's
                    tower_grads.append(opt.compute_gradients(loss))
                    losses.append(loss)
        if style == 'all':
            kept = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
    grads = [(tf.add_n([g for g, _ in pairs]) / float(towers), pairs[0][1])
             for pairs in zip(*tower_grads)]
    with tf.control_dependencies(kept):
        train_op = opt.apply_gradients(grads)
    mean_loss = tf.add_n(losses) / float(towers)
    with tf.variable_scope(tf.get_variable_scope(), reuse=True), tf.name_scope('eval'):
        evaluation = model(images, bn2, False)
    return images, labels, train_op, mean_loss, evaluation, bn2


def run(style, towers):
    """Trains one style's graph for ``STEPS`` steps; returns its arrays and the layer's API."""
    with tf.Graph().as_default():
        images, labels, train_op, mean_loss, evaluation, bn2 = build(style, towers)
        rng = np.random.RandomState(5)
        results = {}
        config = tf.ConfigProto(device_count={'CPU': towers})
        with tf.Session(config=config) as sess:
            sess.run(tf.global_variables_initializer())
            for step in range(STEPS):
                feed = {images: rng.randn(BATCH, 6, 6, 3).astype(np.float32) * 2 + 1,
                        labels: rng.randn(BATCH, 3).astype(np.float32)}
                results['loss/%d' % step], _ = sess.run([mean_loss, train_op], feed)
            for v in tf.global_variables():
                results['var/' + v.op.name] = sess.run(v)
            results['eval'] = sess.run(evaluation, {images: rng.randn(BATCH, 6, 6, 3) + 1})
        api = {'name': bn2.name, 'variables': [v.name for v in bn2.variables],
               'trainable_variables': [v.name for v in bn2.trainable_variables],
               'moving_mean': bn2.moving_mean.name, 'gamma': bn2.gamma.name,
               'fused': bn2.fused, 'has_updates': bool(bn2.updates)}
    return results, api


def main(towers, out, styles=STYLES):
    arrays, apis = {}, {}
    for style in styles:
        results, apis[style] = run(style, towers)
        arrays.update({'%s/%s' % (style, k): v for k, v in results.items()})
    np.savez(out, **arrays)
    with open(out[:-len('.npz')] + '.json', 'w') as f:
        json.dump(apis, f)
    print('RESULT %s' % out)


if __name__ == '__main__':
    main(int(sys.argv[1]), sys.argv[2],
         sys.argv[3].split(',') if len(sys.argv) > 3 else STYLES)

"""How many run-time checks and watchdog arms a resnet_v1_50 step runs, with a tensor is_training.

The guards every collective waits for (the run-time check that every tower
was built, and the step watchdog) should run once per host and step. This counts
them in the graph (its function library included: ``tf.cond`` branches) and
in a traced training step, for resnet_v1_50 built with ``sync_arg_scope`` on
virtual CPU towers with ``is_training`` a bool tensor. Op counts are
deterministic: no machine line is needed, but the TensorFlow version is
printed.

Usage::

    python bench/guard_count.py [--towers 2] [--size 32]
"""

import argparse
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_slim as slim  # noqa: E402
from tf_slim.nets import resnet_v1  # noqa: E402

from tf1_syncbn import sync_arg_scope  # noqa: E402
from tower import call_for_each_tower, virtual_cpu_config  # noqa: E402

tf1 = tf.compat.v1
NAMES = {'run-time check': 'tf1_syncbn_check_towers', 'watchdog arm': 'tf1_syncbn_step_watchdog'}


def build(towers, size):
    is_training = tf1.placeholder(tf.bool, [], name='is_training')
    images = []

    def tower():
        x = tf1.placeholder(tf.float32, [None, size, size, 3])
        images.append(x)
        with slim.arg_scope(resnet_v1.resnet_arg_scope()), sync_arg_scope():
            logits, _ = resnet_v1.resnet_v1_50(x, num_classes=10, is_training=is_training)
        return tf.reduce_mean(tf.square(logits))

    losses = call_for_each_tower(tower, ['/cpu:%d' % i for i in range(towers)])
    grads = tf.gradients(tf.add_n(losses), tf1.trainable_variables())
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        step = tf.add_n([tf.reduce_sum(g) for g in grads if g is not None])
    return is_training, images, step


def count_in_graph(graph):
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return {what: sum(1 for n in nodes if n.name.split('/')[-1].startswith(name))
            for what, name in NAMES.items()}


def count_in_step(sess, fetch, feed):
    options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE)
    metadata = tf1.RunMetadata()
    sess.run(fetch, feed, options=options, run_metadata=metadata)
    names = [n.node_name for d in metadata.step_stats.dev_stats for n in d.node_stats]
    return {what: sum(1 for n in names if n.split('/')[-1].startswith(name))
            for what, name in NAMES.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--towers', type=int, default=2)
    parser.add_argument('--size', type=int, default=32)
    args = parser.parse_args()
    tf1.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        is_training, images, step = build(args.towers, args.size)
        in_graph = count_in_graph(graph)
        feed = {x: np.random.RandomState(0).rand(2, args.size, args.size, 3) for x in images}
        feed[is_training] = True
        with tf1.Session(config=virtual_cpu_config(args.towers)) as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(step, feed)
            in_step = count_in_step(sess, step, feed)
    print('resnet_v1_50, %d towers, is_training a bool tensor (TensorFlow %s)'
          % (args.towers, tf.__version__))
    for what in NAMES:
        print('  %-15s in the graph: %4d   run per training step: %4d'
              % (what, in_graph[what], in_step[what]))


if __name__ == '__main__':
    main()

"""Inference time of sync_batch_norm(is_training=False) against its anchors.

Prints the median time of one forward pass (default 32x28x28x64, float32) of:

* ``fused``: ``tf.nn.fused_batch_norm(is_training=False)`` on the same moving
  statistics (the target anchor);
* ``sync_batch_norm``: this library with ``is_training=False``;
* ``separate_ops``: the hand-written batch norm of the seed question
  (``rsqrt`` / multiply / subtract / add as separate ops);

and the ratios, and the machine. The variants run interleaved in one
process. Each step fetches a scalar that depends on the whole output.
``--device gpu`` runs them on ``'/gpu:0'`` and prints the GPUs too.

Usage: python bench/inference.py [--shape 32,28,28,64] [--steps 50] [--device cpu|gpu]
"""

import argparse
import contextlib
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _devices import on_devices, parse_towers  # noqa: E402
from _timing import median_times, setup_lines  # noqa: E402

from tf1_syncbn import sync_batch_norm  # noqa: E402

tf1 = tf.compat.v1
EPS = 1e-3
# Non-trivial statistics, so that no graph optimizer can fold the layer away.
INITIALIZERS = {'moving_mean': tf1.constant_initializer(0.5),
                'moving_variance': tf1.constant_initializer(2.0)}


def _stats(channels):
    gamma = tf1.get_variable('gamma', [channels], initializer=tf1.ones_initializer())
    beta = tf1.get_variable('beta', [channels], initializer=tf1.zeros_initializer())
    mean = tf1.get_variable('moving_mean', [channels], initializer=INITIALIZERS['moving_mean'],
                            trainable=False)
    var = tf1.get_variable('moving_variance', [channels],
                           initializer=INITIALIZERS['moving_variance'], trainable=False)
    return gamma, beta, mean, var


def fused(x):
    gamma, beta, mean, var = _stats(x.shape[-1])
    y, _, _ = tf1.nn.fused_batch_norm(x, gamma, beta, mean=mean, variance=var, epsilon=EPS,
                                      is_training=False)
    return y


def separate_ops(x):
    gamma, beta, mean, var = _stats(x.shape[-1])
    inv = tf.math.rsqrt(var + EPS) * gamma
    return ((x * inv) - (mean * inv)) + beta


def ours(x):
    return sync_batch_norm(x, scale=True, epsilon=EPS, is_training=False, scope='bn',
                           param_initializers=INITIALIZERS)


def build(layer, shape, setup=None):
    """One graph and session of ``layer``: on one CPU, or on ``setup``'s GPU (``_devices``)."""
    graph = tf.Graph()
    gpu = setup is not None and setup.kind == 'gpu'
    place = tf.device(setup.devices[0]) if gpu else contextlib.nullcontext()
    with graph.as_default(), place:
        x = tf1.Variable(np.random.RandomState(0).randn(*shape).astype(np.float32),
                         trainable=False, name='x')
        with tf1.variable_scope('bn'):
            y = layer(x)
        fetch = tf.reduce_sum(y)
        init = tf1.global_variables_initializer()
    config = setup.config if gpu else tf1.ConfigProto(device_count={'CPU': 1})
    sess = tf1.Session(graph=graph, config=config)
    sess.run(init)
    return sess, fetch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--shape', default='32,28,28,64')
    parser.add_argument('--steps', type=int, default=50)
    parser.add_argument('--warmup', type=int, default=5)
    args, setup = parse_towers(parser, argv, towers=1,
                               device_help='one CPU (default) or the first GPU')
    tf1.disable_eager_execution()
    shape = tuple(int(s) for s in args.shape.split(','))
    variants = [('fused', fused), ('sync_batch_norm', ours), ('separate_ops', separate_ops)]
    runs = {name: build(layer, shape, setup) for name, layer in variants}
    med = median_times(runs, args.steps, args.warmup)
    print('inference forward, %s%s, median of %d steps (ms)'
          % ('x'.join(map(str, shape)), on_devices(setup), args.steps))
    for name, _ in variants:
        print('  %-16s %8.3f ms' % (name, med[name]))
    print('  ratio sync_batch_norm / fused: %.3fx  (target <= 1.05x)'
          % (med['sync_batch_norm'] / med['fused']))
    print('  ratio separate_ops / fused:    %.3fx' % (med['separate_ops'] / med['fused']))
    print('\n'.join(setup_lines(setup)))


if __name__ == '__main__':
    main()

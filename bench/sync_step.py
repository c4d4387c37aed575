"""Forward+backward step time of synchronized batch norm on N towers (virtual CPUs or GPUs).

Prints, for one shape on N towers (default 4 x 32x28x28x64), the median step
time of:

* ``fused``: unsynchronized ``tf.nn.fused_batch_norm`` per tower (the floor);
* ``sync_batch_norm``: this library, collective backend (with its compiled CPU
  kernels when they are available);
* ``sync_stock_kernels``: the same with TensorFlow's stock kernels only;
* ``textbook``: the textbook synchronized batch norm (all-reduce E[x] and
  E[x^2] separately, var = E[x^2] - E[x]^2, two collectives forward and two
  backward, from separate TensorFlow ops) on the same collective ops;

and the ratios between them. All variants run in one process, interleaved
round by round, so the ratios compare like with like. Every step fetches one
scalar that depends on every gradient, so no gradient work can be skipped.

``--device gpu`` puts tower ``i`` on ``'/gpu:<i>'`` (with fewer physical GPUs
than towers, each GPU split into logical GPUs, as the output says; see
``bench/_devices.py``). GPU towers always run TensorFlow's kernels (cuDNN,
XLA), so there ``sync_stock_kernels`` builds the same graph as
``sync_batch_norm``.

Usage: python bench/sync_step.py [--towers 4] [--shape 32,28,28,64] [--steps 30]
           [--timeout S] [--device cpu|gpu]
"""

import argparse
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _devices import on_devices, parse_towers  # noqa: E402
from _timing import median_times, setup_lines  # noqa: E402
from tensorflow.python.ops import collective_ops  # noqa: E402

from tf1_syncbn import CollectiveBackend, kernels, sync_batch_norm  # noqa: E402
from tower import call_for_each_tower, get_current_tower_context  # noqa: E402

tf1 = tf.compat.v1
EPS = 1e-3


def fused_layer(x):
    channels = x.shape[-1]
    gamma = tf1.get_variable('gamma', [channels], initializer=tf1.ones_initializer())
    beta = tf1.get_variable('beta', [channels], initializer=tf1.zeros_initializer())
    y, _, _ = tf1.nn.fused_batch_norm(x, gamma, beta, epsilon=EPS, is_training=True)
    return y


def _textbook_all_reduce(t, towers, key):
    """Sum all-reduce with a sum all-reduce gradient (what NCCL's gradient does)."""
    device = t.device

    @tf.custom_gradient
    def reduce(v):
        out = collective_ops.all_reduce(v, towers, 99, key, 'Add', 'Id')

        def grad(dy):
            with tf.device(device):
                return collective_ops.all_reduce(dy, towers, 99, key + 1, 'Add', 'Id')
        return out, grad
    return reduce(t)


def textbook_layer(x):
    """The textbook algorithm, on collective ops instead of NCCL (CPU has no NCCL)."""
    ctx = get_current_tower_context()
    channels = x.shape[-1]
    gamma = tf1.get_variable('gamma', [channels], initializer=tf1.ones_initializer())
    beta = tf1.get_variable('beta', [channels], initializer=tf1.zeros_initializer())
    mean = tf.reduce_mean(x, [0, 1, 2])
    mean_sq = tf.reduce_mean(tf.square(x), [0, 1, 2])
    mean = _textbook_all_reduce(mean, ctx.total, 1000) * (1.0 / ctx.total)
    mean_sq = _textbook_all_reduce(mean_sq, ctx.total, 2000) * (1.0 / ctx.total)
    var = mean_sq - tf.square(mean)
    return tf.nn.batch_normalization(x, mean, var, beta, gamma, EPS)


#: The collective backend of the synchronized variants (set from --timeout).
BACKEND = [CollectiveBackend()]


def sync_layer(x):
    return sync_batch_norm(x, scale=True, epsilon=EPS, updates_collections=None,
                           sync_statistics=BACKEND[0])


def sync_layer_stock(x):
    with kernels.use_custom_kernels(False):
        return sync_layer(x)


def build(layer, setup, shape):
    """One graph and session of ``layer`` on the towers of ``setup`` (``_devices.TowerSetup``)."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)

        def tower():
            i = get_current_tower_context().index
            # Per-tower data lives in (non-shared) variables: no feed in the timing.
            x = tf1.Variable(rng.randn(*shape).astype(np.float32), trainable=False, name='x')
            dy = tf1.Variable(rng.randn(*shape).astype(np.float32), trainable=False, name='dy')
            del i
            with tf1.variable_scope('bn'):
                y = layer(x)
            loss = tf.reduce_sum(y * dy)
            params = tf1.trainable_variables()
            grads = tf.gradients(loss, [x] + params)
            # One scalar that depends on every gradient (and the output).
            return tf.add_n([tf.reduce_sum(g) for g in grads] + [tf.reduce_sum(y)])

        outs = call_for_each_tower(tower, setup.devices)
        fetch = tf.add_n(outs)
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=graph, config=setup.config)
    sess.run(init)
    return sess, fetch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--towers', type=int, default=4)
    parser.add_argument('--shape', default='32,28,28,64')
    parser.add_argument('--steps', type=int, default=30)
    parser.add_argument('--warmup', type=int, default=5)
    parser.add_argument('--timeout', type=float, default=None,
                        help="the collective backend's timeout in seconds (default: the "
                        "library's default; 0: none)")
    args, setup = parse_towers(parser, argv)
    if args.timeout is not None:
        BACKEND[0] = CollectiveBackend(timeout=args.timeout)
    tf1.disable_eager_execution()
    shape = tuple(int(s) for s in args.shape.split(','))
    variants = [('fused', fused_layer), ('sync_batch_norm', sync_layer),
                ('sync_stock_kernels', sync_layer_stock), ('textbook', textbook_layer)]
    runs = {name: build(layer, setup, shape) for name, layer in variants}
    med = median_times(runs, args.steps, args.warmup)
    print('forward+backward, %d towers of %s%s, median of %d steps (ms)'
          % (args.towers, 'x'.join(map(str, shape)), on_devices(setup), args.steps))
    for name, _ in variants:
        print('  %-19s %8.2f ms' % (name, med[name]))
    print('\n'.join(setup_lines(setup, BACKEND[0])))
    print('  ratio sync_batch_norm / fused: %.2fx  (target <= 1.15x)'
          % (med['sync_batch_norm'] / med['fused']))
    print('  ratio sync_stock_kernels / fused: %.2fx' % (med['sync_stock_kernels'] / med['fused']))
    print('  ratio textbook / fused:        %.2fx' % (med['textbook'] / med['fused']))
    print('  ratio textbook / sync_batch_norm: %.2fx' % (med['textbook'] / med['sync_batch_norm']))


if __name__ == '__main__':
    main()

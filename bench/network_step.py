"""A whole network's SGD training step: synchronized vs per-tower batch norm.

Builds ``resnet_v1_50`` from ``tf_slim.nets`` with :func:`tf1_syncbn.sync_arg_scope`
on N virtual CPU towers (default 4 towers x 4 images of 64x64; ``--device gpu``:
GPU towers, see below), one SGD step per ``Session.run``, and compares:

* ``unsync``: the same layer, ``sync_batch_norm(sync_statistics=None)``:
  per-tower statistics, one fused kernel each way (the anchor);
* ``sync``: ``sync_batch_norm`` with the collective backend (compiled CPU
  kernels when they are available);
* ``sync_stock`` (with ``--stock``): the same with TensorFlow's stock kernels.

It prints:

* the median step time of each variant and the ratio to ``unsync``; the
  variants run in one process, interleaved in blocks of steps, so that load
  drift hits them alike (repeat the script for a range);
* the collective ops per step and the batch-norm ops per layer per tower
  (forward and backward, constants excluded, counted in tower 1, which builds
  no moving-average updates): deterministic;
* the peak memory of each variant (peak resident set, ``VmHWM``: the
  ``ru_maxrss`` of the process itself), each measured in a fresh subprocess
  that builds only that variant and runs a few steps;
* the machine (CPU model, cores, TensorFlow, load average).

Each step fetches a scalar that depends on every averaged gradient, and runs
the SGD update (with the moving-average updates), so no gradient work can be
skipped.

The synchronized variants use the library's default backend
(``CollectiveBackend()``: a 600 s collective timeout, kept by the step
watchdog, one thread per process). ``--timeout 0`` measures them with no
timeout at all. The thread count printed after timing shows that the timeout
costs no threads per collective (TensorFlow's own per-op timeout would start
two per collective execution).

``--device gpu`` puts tower ``i`` on ``'/gpu:<i>'`` (with fewer physical GPUs
than towers, each GPU split into logical GPUs, as the output says; see
``bench/_devices.py``), and prints the GPUs. GPU towers always run
TensorFlow's kernels, so ``--stock`` adds nothing there, and the memory runs
are left out (they measure the host's resident memory, not the GPU's).

Usage: python bench/network_step.py [--towers 4] [--batch 4] [--size 64]
           [--steps 20] [--warmup 3] [--stock] [--no-memory] [--timeout S]
           [--device cpu|gpu]
"""

import argparse
import json
import os
import resource
import subprocess
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, '..'))
sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _devices import on_devices, parse_towers  # noqa: E402
from _timing import median_times, setup_lines  # noqa: E402
from tf_slim.nets import resnet_v1  # noqa: E402

from tf1_syncbn import CollectiveBackend, kernels, sync_arg_scope  # noqa: E402
from tf1_syncbn.backends import DEFAULT_TIMEOUT  # noqa: E402
from tower import average_gradients, call_for_each_tower  # noqa: E402

tf1 = tf.compat.v1
NUM_CLASSES = 10
VARIANTS = ('unsync', 'sync', 'sync_stock')


def backend(timeout):
    """The collective backend of the synchronized variants."""
    return CollectiveBackend(timeout=timeout)


def build(variant, setup, batch, size, timeout=DEFAULT_TIMEOUT):
    """One graph and session of ``variant``; returns ``(session, fetch, graph)``.

    ``setup``: the towers' devices and session config (``_devices.TowerSetup``).
    """
    graph = tf.Graph()
    with graph.as_default(), kernels.use_custom_kernels(variant != 'sync_stock'):
        rng = np.random.RandomState(0)
        optimizer = tf1.train.GradientDescentOptimizer(0.01)

        def tower():
            # Per-tower data lives in non-trainable variables: no feed in the timing.
            images = tf1.Variable(rng.randn(batch, size, size, 3).astype(np.float32),
                                  trainable=False, name='images')
            labels = tf1.Variable(rng.randint(0, NUM_CLASSES, batch).astype(np.int32),
                                  trainable=False, name='labels')
            with sync_arg_scope(resnet_v1.resnet_arg_scope(),
                                sync_statistics=None if variant == 'unsync'
                                else backend(timeout)):
                logits, _ = resnet_v1.resnet_v1_50(images, num_classes=NUM_CLASSES)
            logits = tf.reshape(logits, [-1, NUM_CLASSES])
            loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits,
                                                           loss_collection=None)
            return optimizer.compute_gradients(loss, tf1.trainable_variables('resnet_v1_50/'))

        grads = average_gradients(call_for_each_tower(tower, setup.devices))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train = optimizer.apply_gradients(grads)
        # One scalar that depends on every averaged gradient, fetched after the update.
        checksum = tf.add_n([tf.reduce_sum(g) for g, _ in grads])
        with tf.control_dependencies([train]):
            fetch = tf.identity(checksum, name='step')
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=graph, config=setup.config)
    sess.run(init)
    return sess, fetch, graph


def graph_counts(graph, towers):
    """``(collectives per step, batch-norm layers, ops per layer per tower)``."""
    ops = graph.get_operations()
    collectives = sum(1 for op in ops if op.type.startswith('Collective'))
    layers = sum(1 for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
                 if v.op.name.endswith('/moving_mean'))
    tower = 'tower1/' if towers > 1 else 'tower0/'
    bn_ops = [op for op in ops if op.name.startswith(tower) and '/BatchNorm/' in op.name
              and op.type != 'Const']
    return collectives, layers, len(bn_ops) / float(layers)


def measure_memory(variant, args, setup):
    """Runs in a fresh process: builds ``variant``, runs steps, prints ru_maxrss (MB)."""
    sess, fetch, _ = build(variant, setup, args.batch, args.size, args.timeout)
    for _ in range(args.memory_steps):
        sess.run(fetch)
    print(json.dumps({'variant': variant, 'peak_mb': peak_rss_mb(), 'threads': thread_count()}))


def thread_count():
    try:
        with open('/proc/self/status') as f:
            return int(next(l for l in f if l.startswith('Threads:')).split()[1])
    except (OSError, StopIteration):
        return -1


def peak_rss_mb():
    """This process's peak resident memory, MB.

    ``VmHWM`` is ``ru_maxrss`` without what Linux carries over from the parent
    across fork and exec (the child of a process that holds 1.5 GB reports at
    least 1.5 GB in ``ru_maxrss``); ``ru_maxrss`` where ``/proc`` is missing.
    """
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith('VmHWM:'):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def memory_in_subprocess(variant, args):
    cmd = [sys.executable, os.path.abspath(__file__), '--memory-of', variant,
           '--towers', str(args.towers), '--batch', str(args.batch), '--size', str(args.size),
           '--memory-steps', str(args.memory_steps)]
    cmd += ['--timeout', repr(args.timeout)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--towers', type=int, default=4)
    parser.add_argument('--batch', type=int, default=4, help='images per tower')
    parser.add_argument('--size', type=int, default=64, help='image height and width')
    parser.add_argument('--steps', type=int, default=20, help='timed steps per variant')
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--stock', action='store_true',
                        help="also time sync_batch_norm on TensorFlow's stock kernels")
    parser.add_argument('--no-memory', action='store_true', help='skip the memory runs')
    parser.add_argument('--memory-steps', type=int, default=3)
    parser.add_argument('--memory-repeats', type=int, default=2)
    parser.add_argument('--timeout', type=float, default=DEFAULT_TIMEOUT,
                        help="the collective backend's timeout in seconds (default: the "
                        "library's, %g; 0: none)" % DEFAULT_TIMEOUT)
    parser.add_argument('--memory-of', choices=VARIANTS, help=argparse.SUPPRESS)
    args, setup = parse_towers(parser, argv)
    tf1.disable_eager_execution()
    if args.memory_of:
        measure_memory(args.memory_of, args, setup)
        return
    variants = ['unsync', 'sync'] + (['sync_stock'] if args.stock else [])
    built = {name: build(name, setup, args.batch, args.size, args.timeout)
             for name in variants}
    med = median_times({name: b[:2] for name, b in built.items()}, args.steps, args.warmup,
                       block=3)
    print('resnet_v1_50 SGD step, %d towers x %d images of %dx%d%s, median of %d steps'
          % (args.towers, args.batch, args.size, args.size, on_devices(setup), args.steps))
    print('\n'.join(setup_lines(setup, backend(args.timeout))))
    for name in variants:
        collectives, layers, per_layer = graph_counts(built[name][2], args.towers)
        print('  %-11s %8.1f ms  %.3fx   %4d collectives/step, %d layers, %5.1f ops per '
              'layer per tower' % (name, med[name], med[name] / med['unsync'], collectives,
                                   layers, per_layer))
    print('  ratio sync / unsync: %.3fx  (target <= 1.08x)' % (med['sync'] / med['unsync']))
    # TensorFlow's per-op collective timeout would start two sleeping threads per
    # collective execution; the step watchdog keeps one thread for the process.
    print('  threads in this process after timing: %d' % thread_count())
    for _, (sess, _, _) in built.items():
        sess.close()
    if args.no_memory or setup.kind == 'gpu':
        if setup.kind == 'gpu' and not args.no_memory:
            print('peak memory: not measured on GPU towers (the memory runs measure the '
                  "host's resident memory)")
        return
    peaks = {name: [] for name in variants}
    for _ in range(args.memory_repeats):
        for name in variants:
            result = memory_in_subprocess(name, args)
            peaks[name].append(result['peak_mb'])
            threads = result['threads']
    print('peak memory (VmHWM), fresh process per variant and run, %d steps, %d run(s) each'
          % (args.memory_steps, args.memory_repeats))
    base = min(peaks['unsync'])
    for name in variants:
        print('  %-11s %7.0f - %7.0f MB  %.3fx (min vs min)'
              % (name, min(peaks[name]), max(peaks[name]), min(peaks[name]) / base))
    print('  ratio peak memory sync / unsync: %.3fx  (target <= 1.03x); last run had %d threads'
          % (min(peaks['sync']) / base, threads))

if __name__ == '__main__':
    main()

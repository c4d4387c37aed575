"""Sync groups across workers: per-worker groups against full sync and no sync, in one run.

Starts ``--workers`` worker processes on this machine (``tf1_syncbn.launch``,
over localhost) with ``--towers`` towers each, and times in each of them, in
one graph, a training step (forward, backward, moving-average updates) of a
stack of ``--layers`` batch-norm + ReLU layers in three variants:

* ``full``: every tower of every worker synchronizes (``group_size=None``):
  two all-reduces across the workers per layer, forward and backward;
* ``groups``: groups inside each worker (``group_size=<towers>``): the
  all-reduces stay in the worker; one small all-reduce across the workers
  per layer gives every worker the moving statistics of worker 0's group
  (docs/sync-groups.md);
* ``none``: per-tower statistics (``sync_statistics=None``);

and ``groups_no_updates``, the ``groups`` step without its moving-average
updates (so without the all-reduce across workers), which tells what that
all-reduce costs.

The variants take turns in blocks of steps (``bench/_timing.py``), the same
on every worker, so the ratios compare like with like. Worker 0 prints the
median step times, the ratios, what groups save per layer, and the machine.
Workers on one machine talk over loopback, so the figures are a floor of
what the all-reduces across machines cost (docs/benchmarks.md has the cost
model for a larger job).

Usage: python bench/groups_step.py [--workers 2] [--towers 2] [--layers 8]
           [--shape 8,8,8,32] [--steps 30]
"""

import argparse
import json
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..'))
sys.path.insert(0, HERE)

VARIANTS = ('full', 'groups', 'none')


def _layer_fn(variant, cluster, index):
    from tf1_syncbn import sync_batch_norm

    def layer(h):
        if variant == 'none':
            return sync_batch_norm(h, scale=True, scope='bn%d' % index, sync_statistics=None)
        return sync_batch_norm(h, scale=True, scope='bn%d' % index,
                               group_size=cluster.towers if variant == 'groups' else None,
                               sync_statistics=cluster.backend())
    return layer


def worker(args):
    """One worker: builds the variants, times them, prints a JSON line (worker 0: the table)."""
    import numpy as np
    import tensorflow as tf
    from _timing import machine_line, median_times

    from tf1_syncbn.distributed import WorkerSession, hard_exit, setup_cluster
    from tower import call_for_each_tower

    tf1 = tf.compat.v1
    tf1.disable_eager_execution()
    cluster = setup_cluster(towers=args.towers, collective_timeout=120)
    shape = [int(s) for s in args.shape.split(',')]
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(cluster.rank)

        def tower():
            # Per-tower data lives in (non-shared) variables: no feed in the timing.
            x = tf1.Variable(rng.randn(*shape).astype(np.float32), trainable=False, name='x')
            dy = tf1.Variable(rng.randn(*shape).astype(np.float32), trainable=False, name='dy')
            outs = {}
            for variant in VARIANTS:
                with tf1.variable_scope(variant):
                    h = x
                    for i in range(args.layers):
                        h = tf.nn.relu(_layer_fn(variant, cluster, i)(h))
                    params = [v for v in tf1.trainable_variables()
                              if v.op.name.startswith(variant + '/')]
                    grads = tf.gradients(tf.reduce_sum(h * dy), [x] + params)
                    # One scalar that depends on every gradient (and the output).
                    outs[variant] = tf.add_n([tf.reduce_sum(g) for g in grads] +
                                             [tf.reduce_sum(h)])
            return outs

        outs = call_for_each_tower(tower, cluster.tower_devices)
        updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        fetches = {}
        for variant in VARIANTS:
            mine = [u for u in updates if '/%s/' % variant in '/' + u.name]
            with tf.control_dependencies(mine):
                fetches[variant] = tf.identity(tf.add_n([o[variant] for o in outs]))
        fetches['groups_no_updates'] = tf.add_n([o['groups'] for o in outs])
    with WorkerSession(cluster, graph=graph) as session:
        times = median_times({v: (session, f) for v, f in fetches.items()}, args.steps,
                             args.warmup)
    print('TIMES %s' % json.dumps({'rank': cluster.rank, 'times': times}), flush=True)
    if cluster.rank == 0:
        full, groups, none = (times[v] for v in VARIANTS)
        print('%d workers x %d towers, %d layers of batch norm + ReLU on [%s] per tower, '
              'forward + backward + moving-average updates; median of %d steps:'
              % (cluster.num_workers, cluster.towers, args.layers, args.shape, args.steps))
        for variant in VARIANTS:
            print('  %-6s %8.2f ms/step  (%.2fx full sync)'
                  % (variant, times[variant], times[variant] / full))
        print('  groups_no_updates %.2f ms/step: the moving statistics\' all-reduce across '
              'workers costs %.3f ms per layer' % (times['groups_no_updates'], (
                  groups - times['groups_no_updates']) / args.layers))
        print('  groups save %.3f ms per layer per step against full sync (%.0f%% of the '
              "synchronization's cost over no sync)"
              % ((full - groups) / args.layers,
                 100.0 * (full - groups) / (full - none) if full > none else 0.0))
        print(machine_line())
    hard_exit(0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--workers', type=int, default=2)
    parser.add_argument('--towers', type=int, default=2, help='towers per worker')
    parser.add_argument('--layers', type=int, default=8)
    parser.add_argument('--shape', default='8,8,8,32', help='per-tower input shape, NHWC')
    parser.add_argument('--steps', type=int, default=30)
    parser.add_argument('--warmup', type=int, default=5)
    args = parser.parse_args(argv)
    if json.loads(os.environ.get('TF_CONFIG') or '{}').get('cluster'):
        return worker(args)
    from tf1_syncbn.launch import launch
    return launch([sys.executable, os.path.abspath(__file__)] + list(
        sys.argv[1:] if argv is None else argv), args.workers, grace=60)


if __name__ == '__main__':
    sys.exit(main())

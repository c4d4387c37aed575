"""Synchronized batch norm across worker processes, with collective ops.

Each worker process runs a TF server and builds the same graph: ``--towers``
towers on its own (virtual CPU) devices. ``sync_batch_norm`` with
``CollectiveBackend(num_workers=W)`` (``Cluster.backend()``) then computes its
statistics over the batches of every tower of every worker.

Run all workers on this machine (they talk over localhost; the launcher stops
every worker when one fails and leaves none behind)::

    python examples/multi_worker.py --workers 2 --towers 2

or one worker per machine, with the same ``--hosts`` list everywhere (or with
``TF_CONFIG`` set instead of ``--hosts``/``--task``)::

    python examples/multi_worker.py --hosts h0:2222,h1:2222 --task 0   # on h0
    python examples/multi_worker.py --hosts h0:2222,h1:2222 --task 1   # on h1

Every worker checks its towers' outputs, input gradients and the moving
variance against a float64 reference on the global batch (which every worker
can compute, the data being seeded), prints PASS or FAIL and exits non-zero
on a mismatch. A worker that does not come up within ``--startup-timeout`` is
named in an error; one lost mid-run fails the others within ``--timeout``.

TensorFlow's C++ INFO/WARNING logs (among them "still waiting for response
from worker") are hidden by TF_CPP_MIN_LOG_LEVEL=2 unless you set it: run
with TF_CPP_MIN_LOG_LEVEL=0 to see them.
"""

import argparse
import json
import os
import sys
import traceback

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

import numpy as np  # noqa: E402

SHAPE = (6, 3)


def global_batch(workers, towers, per_tower=5, seed=0):
    """Inputs and upstream gradients of every tower of every worker (same in each process)."""
    rng = np.random.RandomState(seed)
    n = workers * towers * per_tower
    return ((rng.randn(n, *SHAPE) * 2 + 3).astype(np.float32),
            rng.randn(n, *SHAPE).astype(np.float32))


def run_worker(cluster):
    """Builds and runs one synchronized layer on this worker's towers; returns its results."""
    import tensorflow as tf

    from tf1_syncbn import sync_batch_norm
    from tf1_syncbn.distributed import WorkerSession
    from tower import call_for_each_tower

    tf1 = tf.compat.v1
    workers, towers, task = cluster.num_workers, cluster.towers, cluster.rank
    data, upstream = global_batch(workers, towers)
    per_tower = len(data) // (workers * towers)
    placeholders = []
    graph = tf.Graph()
    with graph.as_default():
        def tower():
            x = tf1.placeholder(tf.float32, (None,) + SHAPE)
            dy = tf1.placeholder(tf.float32, (None,) + SHAPE)
            placeholders.append((x, dy))
            return dy, sync_batch_norm(x, decay=0.0, updates_collections=None,
                                       sync_statistics=cluster.backend())

        pairs = call_for_each_tower(tower, cluster.tower_devices)
        outputs = [y for _, y in pairs]
        loss = tf.add_n([tf.reduce_sum(y * dy) for dy, y in pairs])
        grads = tf.gradients(loss, [x for x, _ in placeholders])
        moving_variance = [v for v in tf1.global_variables()
                           if v.op.name == 'BatchNorm/moving_variance'][0]
    feed = {}
    for i, (x, dy) in enumerate(placeholders):
        start = (task * towers + i) * per_tower
        feed[x] = data[start:start + per_tower]
        feed[dy] = upstream[start:start + per_tower]
    # Checks that every peer answers (naming the ones that do not), initializes
    # and broadcasts worker 0's variables.
    with WorkerSession(cluster, graph=graph) as session:
        ys, dxs = session.run([outputs, grads], feed)
        mv = session.run(moving_variance)
    return {'task': task, 'outputs': [y.tolist() for y in ys],
            'input_grads': [g.tolist() for g in dxs], 'moving_variance': mv.tolist()}


def check(results, workers, towers, epsilon=1e-3):
    """Compares every worker's outputs with a float64 reference; returns the max error."""
    data, upstream = (a.astype(np.float64) for a in global_batch(workers, towers))
    channels = SHAPE[-1]
    mean = data.reshape(-1, channels).mean(0)
    var = data.reshape(-1, channels).var(0)
    xhat = (data - mean) / np.sqrt(var + epsilon)
    expected = xhat
    n = data.size // channels
    dbeta = upstream.reshape(-1, channels).sum(0)
    dgamma = (upstream * xhat).reshape(-1, channels).sum(0)
    expected_dx = (upstream - dbeta / n - xhat * dgamma / n) / np.sqrt(var + epsilon)
    per_tower = len(data) // (workers * towers)
    error = 0.0
    for result in results:
        got = np.concatenate([np.asarray(y) for y in result['outputs']])
        start = result['task'] * towers * per_tower
        error = max(error, float(np.abs(got - expected[start:start + len(got)]).max()))
        got_dx = np.concatenate([np.asarray(g) for g in result['input_grads']])
        error = max(error, float(np.abs(got_dx - expected_dx[start:start + len(got)]).max()))
        # Rank-3 inputs: slim.batch_norm's path is not fused there, and its moving
        # variance (so ours) tracks the biased batch variance.
        error = max(error, float(np.abs(np.asarray(result['moving_variance']) - var).max()))
    return error


def worker_main(args):
    """One worker of the cluster (from --hosts/--task or TF_CONFIG); returns its exit status."""
    import tensorflow as tf

    from tf1_syncbn.distributed import ClusterError, hard_exit, setup_cluster
    if args.tf1_behavior:
        tf.compat.v1.disable_v2_behavior()
    else:
        tf.compat.v1.disable_eager_execution()
    try:
        cluster = setup_cluster(towers=args.towers, hosts=args.hosts if args.task is not None
                                else None, task=args.task, collective_timeout=args.timeout,
                                startup_timeout=args.startup_timeout)
        result = run_worker(cluster)
    except ClusterError as e:
        print('FAIL: %s' % e, flush=True)
        hard_exit(1)
    except Exception:       # noqa: BLE001 - leave through hard_exit (see its docstring)
        traceback.print_exc()
        hard_exit(1)
    error = check([result], cluster.num_workers, cluster.towers)
    ok = error < 1e-4
    print('%s, %d towers: max error of its outputs, input gradients and moving variance against '
          'the float64 reference on the global batch of %d workers: %.2e: %s'
          % (cluster.describe(cluster.rank), cluster.towers, cluster.num_workers, error,
             'PASS' if ok else 'FAIL'), flush=True)
    hard_exit(0 if ok else 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--workers', type=int, default=2,
                        help='launch this many local workers (without --task and TF_CONFIG)')
    parser.add_argument('--towers', type=int, default=2, help='towers per worker')
    parser.add_argument('--hosts', help='comma-separated host:port of every worker')
    parser.add_argument('--task', type=int, help='run only this worker (with --hosts)')
    parser.add_argument('--timeout', type=float, default=120.0,
                        help='collective timeout: a lost worker fails the others within it')
    parser.add_argument('--startup-timeout', type=float, default=120.0,
                        help='seconds to wait for every worker at start-up')
    parser.add_argument('--tf1-behavior', action='store_true',
                        help='run under tf.compat.v1.disable_v2_behavior() (TF1 behaviour), as '
                             'TF1 scripts do; default: TF2-behaviour graph mode')
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.task is not None and not args.hosts:
        parser.error('--task needs --hosts')
    tf_config = json.loads(os.environ.get('TF_CONFIG') or '{}')
    if args.task is not None or tf_config.get('cluster'):
        return worker_main(args)
    from tf1_syncbn.launch import launch
    hosts = args.hosts.split(',') if args.hosts else None
    workers = len(hosts) if hosts else args.workers
    status = launch([sys.executable, os.path.abspath(__file__)] + argv, workers,
                    addresses=hosts, grace=args.timeout + 15)
    print('%d workers x %d towers: %s' % (
        workers, args.towers,
        'every worker matches the global-batch reference: PASS' if status == 0 else
        'FAIL (exit status %d; see the workers\' lines above)' % status))
    return status


if __name__ == '__main__':
    sys.exit(main())

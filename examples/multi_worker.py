"""Synchronized batch norm across worker processes, with collective ops.

Each worker process runs a TF server and builds the same graph: ``--towers``
towers on its own (virtual CPU or GPU) devices. ``sync_batch_norm`` with
``CollectiveBackend(num_workers=W)`` then computes its statistics over the
batches of every tower of every worker.

Run all workers on this machine (they talk over localhost)::

    python examples/multi_worker.py --workers 2 --towers 2

or one worker per machine, with the same ``--hosts`` list everywhere::

    python examples/multi_worker.py --hosts h0:2222,h1:2222 --task 0   # on h0
    python examples/multi_worker.py --hosts h0:2222,h1:2222 --task 1   # on h1

Every worker prints the layer's outputs, input gradients and moving variance;
the launcher checks them against a float64 reference on the global batch and
exits non-zero on a mismatch.
"""

import argparse
import json
import os
import socket
import subprocess
import sys

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


def run_worker(hosts, task, towers, timeout):
    import tensorflow as tf

    from tf1_syncbn import CollectiveBackend, sync_batch_norm
    from tower import call_for_each_tower, virtual_cpu_config

    tf1 = tf.compat.v1
    tf1.disable_eager_execution()
    workers = len(hosts)
    cluster = tf.train.ClusterSpec({'worker': hosts})
    config = virtual_cpu_config(towers)
    config.experimental.collective_group_leader = '/job:worker/replica:0/task:0'
    server = tf.distribute.Server(cluster, job_name='worker', task_index=task, config=config)
    data, upstream = global_batch(workers, towers)
    per_tower = len(data) // (workers * towers)
    placeholders = []

    def tower():
        x = tf1.placeholder(tf.float32, (None,) + SHAPE)
        dy = tf1.placeholder(tf.float32, (None,) + SHAPE)
        placeholders.append((x, dy))
        return dy, sync_batch_norm(x, decay=0.0, updates_collections=None,
                               sync_statistics=CollectiveBackend(timeout=timeout,
                                                                 num_workers=workers))

    devices = ['/job:worker/task:%d/device:CPU:%d' % (task, i) for i in range(towers)]
    pairs = call_for_each_tower(tower, devices)
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
    with tf1.Session(server.target, config=config) as sess:
        sess.run(tf1.global_variables_initializer())
        ys, dxs = sess.run([outputs, grads], feed)
        mv = sess.run(moving_variance)
    return {'task': task, 'outputs': [y.tolist() for y in ys],
            'input_grads': [g.tolist() for g in dxs], 'moving_variance': mv.tolist()}


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(('localhost', 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--workers', type=int, default=2,
                        help='launch this many local workers (ignored with --task)')
    parser.add_argument('--towers', type=int, default=2, help='towers per worker')
    parser.add_argument('--hosts', help='comma-separated host:port of every worker')
    parser.add_argument('--task', type=int, help='run only this worker (with --hosts)')
    parser.add_argument('--timeout', type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.task is not None:
        if not args.hosts:
            parser.error('--task needs --hosts')
        result = run_worker(args.hosts.split(','), args.task, args.towers, args.timeout)
        print('RESULT ' + json.dumps(result))
        return 0
    hosts = args.hosts.split(',') if args.hosts else \
        ['localhost:%d' % p for p in free_ports(args.workers)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), '--hosts',
                               ','.join(hosts), '--task', str(t), '--towers', str(args.towers),
                               '--timeout', str(args.timeout)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for t in range(len(hosts))]
    results, failed = [], False
    for proc in procs:
        out, err = proc.communicate(timeout=args.timeout + 120)
        lines = [l for l in out.splitlines() if l.startswith('RESULT ')]
        if proc.returncode != 0 or not lines:
            failed = True
            print('worker failed (exit %s):\n%s' % (proc.returncode, err[-3000:]))
        else:
            results.append(json.loads(lines[-1][len('RESULT '):]))
    if failed:
        return 1
    error = check(results, len(hosts), args.towers)
    ok = error < 1e-4
    print('%d workers x %d towers: max error against the global-batch reference %.2e: %s'
          % (len(hosts), args.towers, error, 'PASS' if ok else 'FAIL'))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())

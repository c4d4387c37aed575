"""One worker of ``MultiWorkerMirroredStrategy`` (v1) in a TF1 graph, for tests.

Started by ``tests/tower/test_tower_distribute_multi_worker.py`` as 2 local processes,
each with its own ``TF_CONFIG`` (:class:`tf1_syncbn.launch.Launcher`). Each
worker runs one replica on its CPU and trains the model of
``strategy_case.py`` for ``strategy_case.STEPS`` SGD steps, its batch norm
being two of the library's layers (:func:`make_layer`), on its own rows of
the global batch (``--sizes``: 3 and 5, or 0 and 8), the optimizer inside the
replica function with the ``UPDATE_OPS`` as control dependencies, as TF1 code
under a strategy does.

The set-up is TensorFlow's own for a v1 graph: the strategy reads
``TF_CONFIG``; ``strategy.update_config_proto`` gives the session config
(collective group leader, device filters); a ``tf.distribute.Server`` for
this task; a ``Session`` on the server's target.

Writes ``worker<rank>.npz`` to ``--out``: ``loss/<step>`` (the global loss of
the step, all-reduced over the replicas by the strategy), ``share/<step>``
(this worker's own part of it), ``var/<name>`` (every global variable after
the last step, as this worker holds it), ``collectives`` (the layers'
``CollectiveReduce`` ops as ``<name>:<group size>``) and ``rank``.

Every step runs the strategy's collectives, which have no timeout: a lost
peer hangs the others, so whoever starts the workers must stop them after a
deadline (the tests give :meth:`tf1_syncbn.launch.Launcher.wait` one).

``--fork JOBS.json`` (:func:`fork_workers`) starts several workers from one
interpreter, which imports TensorFlow once (most of a start's cost) and forks
one process per worker; each child takes its own ``TF_CONFIG`` and arguments
and imports tf1_syncbn itself, as a started worker does.
"""

import argparse
import json
import os
import sys

SUPPORT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, SUPPORT)
sys.path.insert(0, os.path.dirname(os.path.dirname(SUPPORT)))
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import strategy_case  # noqa: E402

tf1 = tf.compat.v1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
    p.add_argument('--sizes', required=True,
                   help='rows of the global batch per worker, comma-separated (e.g. 3,5)')
    p.add_argument('--out', required=True, help='directory for worker<rank>.npz')
    p.add_argument('--sync', choices=['auto', 'none'], default='auto',
                   help="sync_batch_norm's sync_statistics: 'auto' (default) or None")
    p.add_argument('--timeout', type=float, default=60.0,
                   help='seconds a step may wait in a collective (TF1_SYNCBN_TIMEOUT)')
    return p.parse_args(argv)


#: The same layers with tf-slim, for the reference on one device (legacy Keras).
SLIM_LAYER = ("slim.batch_norm(tf.nn.relu(slim.batch_norm(x)), decay=0.9, scale=True, "
              "scope='bn2')")


def make_layer(sync_batch_norm, per_worker=False):
    """The batch norm of the model: two of the library's layers.

    The first with slim's default arguments (``sync_statistics='auto'``,
    decay 0.999, no gamma), then a ReLU, then one with gamma and a short
    memory (decay 0.9), so that three steps move its statistics far from
    where they started. :data:`SLIM_LAYER` is the same with tf-slim.

    Args:
      sync_batch_norm: the library's layer (imported by the caller).
      per_worker: build both with ``sync_statistics=None`` instead.
    """
    sync = {'sync_statistics': None} if per_worker else {}

    def layer(x):
        net = tf.nn.relu(sync_batch_norm(x, **sync))
        return sync_batch_norm(net, decay=0.9, scale=True, scope='bn2', **sync)
    return layer


def main(argv=None):
    opts = parse_args(argv)
    sizes = [int(s) for s in opts.sizes.split(',')]
    os.environ['TF1_SYNCBN_TIMEOUT'] = str(opts.timeout)
    import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
    tf_behavior.apply()
    from tf1_syncbn import sync_batch_norm  # noqa: PLC0415 - after TF1_SYNCBN_TIMEOUT

    spec = json.loads(os.environ['TF_CONFIG'])
    rank = int(spec['task']['index'])
    workers = len(spec['cluster']['worker'])
    if len(sizes) != workers:
        raise ValueError('distribute_worker: --sizes has %d entries for %d workers.'
                         % (len(sizes), workers))
    total = sum(sizes)
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    data = strategy_case.case_data(total)
    layer = make_layer(sync_batch_norm, per_worker=opts.sync == 'none')

    graph = tf.Graph()
    with graph.as_default():
        strategy = tf1.distribute.experimental.MultiWorkerMirroredStrategy()
        config = strategy.update_config_proto(tf1.ConfigProto())
        server = tf.distribute.Server(
            tf.train.ClusterSpec(spec['cluster']), job_name='worker', task_index=rank,
            config=config)
        x = tf1.placeholder(tf.float32, (None,) + strategy_case.SHAPE, 'x')
        y = tf1.placeholder(tf.float32, (None, 3), 'y')
        opt = tf1.train.GradientDescentOptimizer(strategy_case.LEARNING_RATE)

        def replica_fn():
            share = strategy_case.model(layer, x, y, total)
            with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                step = opt.minimize(share)
            loss = tf.distribute.get_replica_context().all_reduce('sum', share)
            return share, loss, step

        with strategy.scope():
            share, loss, step = strategy.run(replica_fn)
            fetches = [strategy.experimental_local_results(t)[0] for t in (share, loss, step)]
        variables = tf1.global_variables()
        # The layers' own all-reduces (the strategy's are CollectiveReduceV2
        # and broadcasts), with their group sizes.
        collectives = ['%s:%d' % (op.name, op.get_attr('group_size'))
                       for op in graph.get_operations() if op.type == 'CollectiveReduce']
        arrays = {'rank': np.int64(rank), 'collectives': np.array(sorted(collectives))}
        with tf1.Session(server.target, config=config) as sess:
            sess.run(tf1.global_variables_initializer())
            for s in range(strategy_case.STEPS):
                share_value, loss_value, _ = sess.run(
                    fetches, {x: data['x/%d' % s][mine], y: data['y/%d' % s][mine]})
                arrays['share/%d' % s] = np.float64(share_value)
                arrays['loss/%d' % s] = np.float64(loss_value)
                print('worker %d: step %d loss %.6f' % (rank, s, loss_value), flush=True)
            for v in variables:
                arrays['var/' + v.op.name] = sess.run(v)
    os.makedirs(opts.out, exist_ok=True)
    np.savez(os.path.join(opts.out, 'worker%d.npz' % rank), **arrays)
    print('worker %d: done' % rank, flush=True)


def fork_workers(jobs, deadline):
    """Forks one worker per job from this interpreter; waits for all, at most ``deadline`` s.

    Nothing here has imported tf1_syncbn, created a session or a server before
    the forks: each child does, in its own process group, with its job's
    ``TF_CONFIG``, its output in its job's log file.

    Args:
      jobs: ``[{'argv': main's arguments, 'tf_config': ..., 'log': path}]``.
      deadline: seconds for all of them; children still running then are
        SIGKILLed (with their process groups).

    Returns:
      Each job's exit status (negative: the signal that ended it), in order.
    """
    import forked  # noqa: PLC0415
    import tf_behavior  # noqa: PLC0415
    tf_behavior.apply()

    def worker(job):
        os.environ['TF_CONFIG'] = job['tf_config']
        main(job['argv'])

    return forked.wait([forked.fork(lambda job=job: worker(job), log=job['log']) for job in jobs],
                       deadline)


if __name__ == '__main__':
    if sys.argv[1:2] == ['--fork']:
        with open(sys.argv[2]) as f:
            request = json.load(f)
        print('STATUSES ' + json.dumps(fork_workers(request['jobs'], request['deadline'])),
              flush=True)
    else:
        main()

"""A tiny multi-worker training job for tests/distributed/test_multi_worker_training.py.

Run as a worker (``TF_CONFIG`` set, usually by :mod:`tf1_syncbn.launch`), or
in-process with one worker (:func:`train` with a local cluster) as the
reference. Model: dense -> sync_batch_norm -> relu, concatenated with an
embedding lookup (sparse ``IndexedSlices`` gradients of static length) ->
logits, plus a penalty on a lookup of data-dependent length (sparse gradients
of dynamic length); momentum SGD through
:class:`tf1_syncbn.DistributedOptimizer` with 64-byte buckets (several
all-reduces). Initial values come from
numpy with a seed (``--seed``, plus ``1000 * rank`` with ``--differ-seeds``),
so that only the broadcast can make the workers agree.

The data of step ``s`` is a function of ``s`` alone: a global batch of
``workers * towers * per_tower`` rows, of which worker ``r``'s tower ``t``
takes rows ``(r * towers + t) * per_tower`` onwards. So 2 workers x 2 towers
see exactly what 1 worker x 4 towers sees.

Each worker prints ``step <s> ...`` lines and writes ``worker<rank>.npz`` to
``--out``: losses, every global variable at the end, and the trainable
variables right after start-up (``start/<name>``) with the numpy initial
values (``init/<name>``), and per step two more metrics of its own
(``extra_local/<i>``: an int32 class count vector and a float64 fraction)
with their :func:`average_across_workers` (``extra_mean/<i>``).

``--checkpoint-dir`` may hold ``{rank}``, so that each worker has its own
directory. ``--pause S --pause-after N`` makes worker ``--pause-rank`` sleep
``S`` seconds between steps ``N`` and ``N + 1`` (as a long checkpoint save
or evaluation would); ``--chief-start-delay S`` makes the chief's restore
(or, with nothing to restore, its ``init_fn``) take ``S`` seconds longer.
"""

import argparse
import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1

FEATURES, HIDDEN, VOCAB, EMBED, CLASSES = 5, 6, 7, 3, 3


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument('--towers', type=int, default=2)
    p.add_argument('--per-tower', type=int, default=3)
    p.add_argument('--steps', type=int, default=4)
    p.add_argument('--save-every', type=int, default=0)
    p.add_argument('--checkpoint-dir')
    p.add_argument('--out')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--differ-seeds', action='store_true')
    p.add_argument('--step-delay', type=float, default=0.0)
    p.add_argument('--collective-timeout', type=float, default=30.0)
    p.add_argument('--startup-timeout', type=float, default=60.0)
    p.add_argument('--bucket-bytes', type=int, default=64)
    p.add_argument('--hang-timeout', type=float)
    p.add_argument('--restore-timeout', type=float)
    p.add_argument('--pause', type=float, default=0.0)
    p.add_argument('--pause-after', type=int, default=0)
    p.add_argument('--pause-rank', type=int, default=0)
    p.add_argument('--chief-start-delay', type=float, default=0.0)
    return p.parse_args(argv)


def initial_values(seed):
    rng = np.random.RandomState(seed)
    return {'dense/kernel': rng.randn(FEATURES, HIDDEN).astype(np.float32) * 0.5,
            'dense/bias': rng.randn(HIDDEN).astype(np.float32) * 0.1,
            'embedding': rng.randn(VOCAB, EMBED).astype(np.float32) * 0.5,
            'logits/kernel': rng.randn(HIDDEN + EMBED, CLASSES).astype(np.float32) * 0.5,
            'logits/bias': np.zeros(CLASSES, np.float32),
            'bag': rng.randn(VOCAB, 2).astype(np.float32)}


def global_batch(step, size):
    rng = np.random.RandomState(1000 + step)
    x = (rng.randn(size, FEATURES) * 2 + 1).astype(np.float32)
    ids = rng.randint(0, VOCAB, size).astype(np.int32)
    labels = rng.randint(0, CLASSES, size).astype(np.int32)
    return x, ids, labels


def build(cluster, opts, init):
    from tf1_syncbn import DistributedOptimizer, sync_batch_norm
    from tf1_syncbn.distributed import average_across_workers
    from tower import call_for_each_tower, get_current_tower_context

    towers, b = cluster.towers, opts.per_tower
    x = tf1.placeholder(tf.float32, [towers * b, FEATURES], name='x')
    ids = tf1.placeholder(tf.int32, [towers * b], name='ids')
    labels = tf1.placeholder(tf.int32, [towers * b], name='labels')
    global_step = tf1.train.get_or_create_global_step()
    opt = DistributedOptimizer(tf1.train.MomentumOptimizer(0.1, 0.9), cluster,
                               bucket_bytes=opts.bucket_bytes)

    def var(name):
        return tf1.get_variable(name, initializer=tf.constant(init[name]))

    def tower():
        i = get_current_tower_context().index
        part = slice(i * b, (i + 1) * b)
        h = tf.matmul(x[part], var('dense/kernel')) + var('dense/bias')
        h = tf.nn.relu(sync_batch_norm(h, decay=0.9, scale=True, is_training=True,
                                       sync_statistics=cluster.backend()))
        e = tf.gather(var('embedding'), ids[part])
        logits = tf.matmul(tf.concat([h, e], 1), var('logits/kernel')) + var('logits/bias')
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels[part], logits=logits))
        # A sparse gradient whose length is known only at run time (and differs
        # between towers and workers): all-gathered with padding.
        small = tf.boolean_mask(ids[part], ids[part] < 3)
        loss += 0.1 * tf.reduce_sum(tf.square(tf.gather(var('bag'), small)))
        return loss, opt.compute_gradients(loss)

    results = call_for_each_tower(tower, cluster.tower_devices)
    local_loss = tf.add_n([r[0] for r in results]) / towers
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = opt.apply_gradients([r[1] for r in results], global_step=global_step)
    global_loss, = average_across_workers([local_loss], cluster)
    # Two more metrics of this worker, of other dtypes and shapes, averaged in
    # one packed all-reduce: the class counts of its batch and the fraction of
    # its ids below 3.
    extra_local = [tf.reduce_sum(tf.one_hot(labels, CLASSES, dtype=tf.int32), 0),
                   tf.reduce_mean(tf.cast(ids < 3, tf.float64))]
    extra_mean = average_across_workers(extra_local, cluster, name='extra')
    return dict(x=x, ids=ids, labels=labels, train_op=train_op, local_loss=local_loss,
                global_loss=global_loss, extra_local=extra_local, extra_mean=extra_mean)


def train(opts, cluster):
    """Runs the job on ``cluster``; returns the results dict (also written to --out)."""
    from tf1_syncbn.distributed import WorkerSession
    seed = opts.seed + (1000 * cluster.rank if opts.differ_seeds else 0)
    init = initial_values(seed)
    graph = tf.Graph()
    with graph.as_default():
        net = build(cluster, opts, init)
        trainable = tf1.trainable_variables()
        variables = tf1.global_variables()
        saver = init_fn = None
        if opts.chief_start_delay:
            saver = SlowSaver(opts.chief_start_delay, me='worker %d' % cluster.rank)
            init_fn = saver.slow_init
    me = 'worker %d' % cluster.rank
    checkpoint_dir = (opts.checkpoint_dir.format(rank=cluster.rank)
                      if opts.checkpoint_dir else None)
    print('%s: graph built, starting the session' % me, flush=True)
    kwargs = {} if opts.restore_timeout is None else {'restore_timeout': opts.restore_timeout}
    session = WorkerSession(cluster, checkpoint_dir=checkpoint_dir, graph=graph,
                            hang_timeout=opts.hang_timeout, saver=saver, init_fn=init_fn,
                            **kwargs)
    print('%s: started at step %d%s' % (me, session.start_step,
                                       ' (restored %s)' % session.restored_from
                                       if session.restored_from else ''), flush=True)
    results = {'start/' + v.op.name: val for v, val in
               zip(trainable, session.session.run(trainable))}
    results.update({'init/' + k: v for k, v in init.items()})
    size = cluster.num_towers * opts.per_tower
    rows = slice(cluster.rank * cluster.towers * opts.per_tower,
                 (cluster.rank + 1) * cluster.towers * opts.per_tower)
    steps, local_losses, global_losses = [], [], []
    extra = {'extra_local/0': [], 'extra_local/1': [], 'extra_mean/0': [], 'extra_mean/1': []}
    for step in range(session.start_step, opts.steps):
        x, ids, labels = (a[rows] for a in global_batch(step, size))
        local, glob, extra_local, extra_mean, _ = session.run(
            [net['local_loss'], net['global_loss'], net['extra_local'], net['extra_mean'],
             net['train_op']], {net['x']: x, net['ids']: ids, net['labels']: labels})
        steps.append(step)
        local_losses.append(local)
        global_losses.append(glob)
        for i in range(2):
            extra['extra_local/%d' % i].append(extra_local[i])
            extra['extra_mean/%d' % i].append(extra_mean[i])
        print('%s: step %d loss %.6f' % (me, step + 1, glob), flush=True)
        if opts.pause and cluster.rank == opts.pause_rank and step + 1 == opts.pause_after:
            print('%s: pausing %g s after step %d' % (me, opts.pause, step + 1), flush=True)
            time.sleep(opts.pause)
        if opts.save_every and (step + 1) % opts.save_every == 0:
            path = session.save()
            if path:
                print('%s: saved %s' % (me, path), flush=True)
        if opts.step_delay:
            time.sleep(opts.step_delay)
    results.update({v.op.name: val for v, val in zip(variables, session.session.run(variables))})
    results.update(steps=np.array(steps), local_loss=np.array(local_losses),
                   global_loss=np.array(global_losses), start_step=session.start_step)
    results.update({k: np.array(v) for k, v in extra.items()})
    session.close()
    if opts.out:
        os.makedirs(opts.out, exist_ok=True)
        np.savez(os.path.join(opts.out, 'worker%d.npz' % cluster.rank), **results)
    return results


class SlowSaver(tf1.train.Saver):
    """A Saver whose restore (and the matching ``init_fn``) takes ``delay`` s longer."""

    def __init__(self, delay, me):
        super().__init__()
        self.delay, self.me = delay, me

    def _slow(self, what):
        started = time.time()
        time.sleep(self.delay)
        print('%s: %s took %.1f s' % (self.me, what, time.time() - started), flush=True)

    def restore(self, sess, save_path):
        super().restore(sess, save_path)
        self._slow('restore')

    def slow_init(self, sess):
        del sess
        self._slow('init_fn')


def main(argv=None):
    from tf1_syncbn.distributed import ClusterError, hard_exit, setup_cluster
    import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
    tf_behavior.apply()
    opts = parse_args(argv)
    try:
        cluster = setup_cluster(towers=opts.towers, collective_timeout=opts.collective_timeout,
                                startup_timeout=opts.startup_timeout)
        train(opts, cluster)
    except ClusterError as e:
        print('ERROR: %s' % e, flush=True)
        hard_exit(1)
    hard_exit(0)


if __name__ == '__main__':
    main()

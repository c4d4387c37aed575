"""SyncBN vs per-tower batch norm: a small conv net on the UCI handwritten digits.

The main job of ``make demo``. It trains the same conv net twice, by default
on one worker with 4 towers of virtual CPUs and 2 examples per tower (a
global batch of 8):

* ``sync``: ``sync_batch_norm`` with ``sync_statistics='auto'`` (collective
  all-reduce between the towers): every tower normalizes with the statistics
  of the global batch of 8;
* ``per_tower``: the same layer with ``sync_statistics=None``: every tower
  normalizes with the statistics of its own 2 examples, as plain batch norm in
  a multi-GPU script does.

Both runs use in-graph replication (``tower.call_for_each_tower``, variables
shared by the towers), :class:`tf1_syncbn.DistributedOptimizer` around one
momentum optimizer (with one worker: the classic in-graph gradient average),
start from the same weights and see the same batches. The batch-norm
moving-average updates (``UPDATE_OPS``, built on tower 0) run in the same
``session.run`` as the train op, as a control dependency: SyncBN's updates
need the forward pass of every tower in the same step.

Several workers (data-parallel over processes or machines, on TensorFlow's
collective runtime; see docs/multi-worker.md):

* ``--workers W --towers T`` starts W local worker processes of T towers each
  (:mod:`tf1_syncbn.launch`), waits for them and prints the verdict;
* ``--hosts h0:port,h1:port --task i`` (or ``TF_CONFIG``) runs one worker of
  a cluster, one per host.

With ``--workers W --max-restarts N``, a worker that dies makes the launcher
stop the others and start every worker again, up to N times; the restarted
workers resume from the chief's last complete checkpoint, and
``metrics.json`` records each restart (``restarts``: the worker, its exit
cause, where the chief resumed each run). Workers that a supervisor restarts
with the same command (``--hosts``/``--task`` or ``TF_CONFIG``) take
``--auto-resume``: ``--resume`` when ``--out-dir`` holds a checkpoint, else
``--overwrite``. See docs/restarts.md.

The global batch is ``workers * towers * batch_per_tower``; the batch of step
``s`` is a function of ``s`` and ``--seed`` only, and worker ``r`` takes its
``r``-th slice. So ``--workers 2 --towers 2`` follows ``--workers 1 --towers
4`` step by step. Batch norm is synchronized over every tower of every worker
(``CollectiveBackend(num_workers=W)``), gradients are averaged over all
towers, and every worker starts from worker 0's weights (broadcast).

Every ``--eval-every`` steps the chief scores the held-out set with an
inference path (``is_training=False``: moving statistics). Every
``--save-every`` steps and at the end, only the chief (worker 0) saves a
checkpoint (all variables, optimizer slots and the step) into
``--out-dir/<run>/``; ``--resume`` continues both runs from there (the chief
restores, the broadcast carries the values to the others) and, since data
follow the step, continues as the uninterrupted run would. When
``--out-dir`` holds an earlier run, the job refuses to start (exit status 2)
unless ``--resume`` (continue it) or ``--overwrite`` (delete its checkpoints,
history, initial weights and metrics, and start afresh) is given; with both,
``--resume`` wins. ``--resume`` refuses too (exit status 2, naming the
folder) when ``--out-dir`` holds no checkpoint, and when the earlier run had
another global batch or ``--seed`` (``run.json`` records them): the batch of
every step follows both, so that would not continue the same run. Another
``--towers``/``--workers`` split of the same global batch is fine, and so is
a longer ``--steps`` (the learning-rate schedule follows it). Checkpoints
name their files relative to their folder (``save_relative_paths``): a run
folder moved or copied elsewhere resumes where it stopped.
``history.json``, ``metrics.json`` and ``run.json`` are written
atomically (a temporary file, then ``os.replace``). At the end, the
chief restores each model into a single-tower inference graph and scores it,
writes ``metrics.json`` (per-step losses and held-out accuracy of ``sync`` and
``per_tower``) and a plot into ``--out-dir`` (``--update-docs`` also copies
the plot to ``docs/demo.png``).

Before training, the chief prints each run's batch-norm audit
(:func:`tf1_syncbn.audit_graph`, docs/audit.md): every layer
synchronized over all towers, its updates run by the train op. The
``per_tower`` run's audit shows every layer unsynchronized, as intended for
the comparison; any other problem of it still prints as ``FAILED``.

What to expect (times and machines: docs/demo.md): at 2
examples per tower the per-tower model's held-out accuracy stays at 65% to
78% over seeds 0 to 2 (its 2-example statistics are far from the moving
statistics used at inference) while SyncBN, with 8-example statistics,
reaches 99.1% to 99.8% (docs/demo.md: the figures, and the machines they come from).

The job exits with status 1 when the SyncBN model's held-out accuracy is
below ``--min-accuracy`` (default 0.95), or when a worker fails; with status
2 on a command-line error or when it refuses to replace an earlier run.

Usage::

    python examples/train_multitower.py [--towers 4] [--batch-per-tower 2]
        [--steps 900] [--backend auto|collective|none] [--out-dir demo_out/]
        [--seed 0] [--min-accuracy 0.95] [--workers 1] [--max-restarts 0]
        [--resume | --overwrite | --auto-resume]
    python examples/train_multitower.py --hosts h0:2222,h1:2222 --task 0 --towers 2
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings

# Hides TensorFlow's C++ INFO and WARNING logs, among them the "still waiting
# for response from worker" messages of a session that waits for a peer. The
# multi-worker start-up check of tf1_syncbn reports missing peers by name
# instead; run with TF_CPP_MIN_LOG_LEVEL=0 to see TensorFlow's own messages.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Train a small conv net on handwritten digits on N towers (and W workers), '
                    'with SyncBN and with per-tower batch norm, and plot both.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--towers', type=int, default=4,
                        help='towers per worker (virtual CPUs)')
    parser.add_argument('--batch-per-tower', type=int, default=2,
                        help='examples per tower and step')
    parser.add_argument('--steps', type=int, default=900, help='training steps per run')
    parser.add_argument('--backend', choices=('auto', 'collective', 'none'), default='auto',
                        help="sync_statistics of the SyncBN run ('none': no sync, which "
                             "makes both runs the same)")
    parser.add_argument('--out-dir', default='demo_out/',
                        help='checkpoints, metrics.json and the plot go here (on the chief)')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed of the weights and of the order of the examples')
    parser.add_argument('--lr', type=float, default=0.05, help='initial learning rate')
    parser.add_argument('--eval-every', type=int, default=50,
                        help='score the held-out set every this many steps')
    parser.add_argument('--save-every', type=int, default=100,
                        help='the chief saves a checkpoint every this many steps (0: at the '
                             'end only)')
    parser.add_argument('--resume', action='store_true',
                        help='continue both runs from the checkpoints in --out-dir (refused '
                             'when it holds none, or when its run had another global batch '
                             'or --seed)')
    parser.add_argument('--overwrite', action='store_true',
                        help='delete an earlier run in --out-dir (checkpoints, history, initial '
                             'weights, metrics) and start afresh; without it or --resume, the '
                             'job refuses to start when --out-dir holds an earlier run')
    parser.add_argument('--auto-resume', action='store_true',
                        help='--resume when --out-dir holds a checkpoint, else --overwrite: for '
                             'workers that a supervisor restarts with the same command (the '
                             'workers that --max-restarts restarts do this without it)')
    parser.add_argument('--tf1-behavior', action='store_true',
                        help='build and run the graphs under tf.compat.v1.disable_v2_behavior() '
                             '(TF1 behaviour: reference variables, v1 control flow), as TF1 '
                             'scripts do; default: TF2-behaviour graph mode')
    parser.add_argument('--min-accuracy', type=float, default=0.95,
                        help='fail (exit 1) when the SyncBN model scores below this')
    parser.add_argument('--update-docs', action='store_true',
                        help='also copy the plot to docs/demo.png (the picture in docs/demo.md)')
    group = parser.add_argument_group('multiple workers')
    group.add_argument('--workers', type=int, default=1,
                       help='start this many local worker processes (1: this process)')
    group.add_argument('--hosts', help='host:port of every worker, comma-separated; with --task '
                                       'run that one worker here')
    group.add_argument('--task', type=int, help="this worker's index in --hosts")
    group.add_argument('--collective-timeout', type=float, default=60.0,
                       help='seconds a collective waits for the other workers (a lost worker '
                            'makes the others fail within it)')
    group.add_argument('--startup-timeout', type=float, default=120.0,
                       help='seconds to wait for every worker at start-up (a restarted '
                            'worker\'s peers wait this long for it)')
    group.add_argument('--max-restarts', type=int, default=0,
                       help='with --workers: when a worker fails, stop the others and restart '
                            'every worker, up to this many times; they resume from the chief\'s '
                            'last checkpoint (ignored by the workers themselves)')
    args = parser.parse_args(argv)
    for name in ('towers', 'batch_per_tower', 'steps', 'eval_every', 'workers'):
        if getattr(args, name) < 1:
            parser.error('--%s must be at least 1' % name.replace('_', '-'))
    if args.save_every < 0:
        parser.error('--save-every must be at least 0')
    if args.max_restarts < 0:
        parser.error('--max-restarts must be at least 0')
    if args.task is not None and not args.hosts:
        parser.error('--task needs --hosts')
    if args.hosts and args.task is None and args.workers != len(args.hosts.split(',')):
        parser.error('--hosts without --task launches one local worker per host: give '
                     '--workers %d' % len(args.hosts.split(',')))
    if args.towers * args.batch_per_tower * args.workers < 2:
        parser.error('the global batch needs at least 2 examples')
    return args


if __name__ == '__main__' and any(a in ('-h', '--help') for a in sys.argv[1:]):
    parse_args()        # prints the help and exits, before TensorFlow loads

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_slim as slim  # noqa: E402

from tf1_syncbn import DistributedOptimizer, audit_graph, sync_batch_norm  # noqa: E402
from tf1_syncbn.audit import AuditReport  # noqa: E402
from tf1_syncbn.distributed import (ClusterError, WorkerSession,  # noqa: E402
                                    average_across_workers, hard_exit, setup_cluster)
from tf1_syncbn.launch.restarts import restart_count  # noqa: E402
from tower import call_for_each_tower, get_current_tower_context  # noqa: E402

tf1 = tf.compat.v1

# tf-slim's pooling and flatten layers wrap deprecated tf.layers classes.
warnings.filterwarnings('ignore', message=r'`(layer\.apply|tf\.layers\.flatten)` is deprecated',
                        category=UserWarning)


def _not_the_savers_own_deprecation(record):
    """False for the warning TensorFlow's ``Saver`` logs about itself.

    Deleting a checkpoint beyond ``max_to_keep``, TF's ``Saver`` calls
    ``checkpoint_management.remove_checkpoint``, which TF deprecates: the
    warning is TensorFlow's own business, nothing this script can act on.
    Every other record of the ``tensorflow`` logger prints.
    """
    message = record.getMessage()
    return not ('remove_checkpoint (from tensorflow.' in message and 'deprecated' in message)


tf.get_logger().addFilter(_not_the_savers_own_deprecation)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS_PLOT = os.path.join(REPO, 'docs', 'demo.png')
NUM_CLASSES = 10
RUNS = ('sync', 'per_tower')
LABELS = {'sync': 'SyncBN', 'per_tower': 'per-tower BN'}
#: What the audit says of a layer that normalizes each tower with its own batch
#: (tests/audit/test_audit.py's KINDS): the per_tower run's purpose, not its problem.
PER_TOWER_FINDING = "normalizes each tower with its own batch's statistics"


#: The UCI handwritten digits (1797 8x8 images, 10 classes), as scikit-learn ships
#: them (data/README.md): bundled, so the demo needs no download and no scikit-learn.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'digits.csv.gz')


def load_data(seed, path=DIGITS, test_fraction=0.25):
    """Digits as [N, 8, 8, 1] float32 in [0, 1]; a stratified 75/25 split seeded with ``seed``.

    Returns:
      ``x_train, x_test, y_train, y_test``: a quarter of each class, drawn by
      ``np.random.RandomState(seed)``, is held out.
    """
    import gzip
    with gzip.open(path, 'rt') as f:
        table = np.loadtxt(f, delimiter=',', dtype=np.float32)
    images = (table[:, :-1].reshape(-1, 8, 8, 1) / 16.0).astype(np.float32)
    labels = table[:, -1].astype(np.int32)
    rng = np.random.RandomState(seed)
    held_out = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        held_out.extend(members[:int(round(test_fraction * len(members)))])
    held_out = rng.permutation(held_out)
    train = rng.permutation(np.setdiff1d(np.arange(len(labels)), held_out))
    return images[train], images[held_out], labels[train], labels[held_out]


def batch_indices(step, global_batch, num_examples, seed):
    """The training examples of step ``step``: a function of the step, not of the history.

    Epoch ``e`` visits the examples in the order of a permutation seeded with
    ``(seed, e)``; step ``s`` takes positions ``s * global_batch`` onwards of
    the concatenated epochs. So a run resumed at step ``s`` sees the batches
    the uninterrupted run sees.
    """
    positions = np.arange(step * global_batch, (step + 1) * global_batch)
    epochs = positions // num_examples
    out = np.empty(global_batch, np.int64)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        order = np.random.RandomState([seed, int(epoch)]).permutation(num_examples)
        out[mask] = order[positions[mask] % num_examples]
    return out


def sync_spec(backend, cluster):
    """The ``sync_statistics`` value of the SyncBN run."""
    if backend == 'none':
        return None
    if cluster.num_workers > 1:
        return cluster.backend()          # CollectiveBackend(num_workers=W)
    if backend == 'collective':
        return cluster.backend(timeout=60)
    return 'auto'


def model(images, is_training, sync_statistics):
    """conv-conv-pool-conv-pool-fc-logits; every layer but the logits has batch norm."""
    bn_params = {'is_training': is_training, 'decay': 0.9, 'scale': True, 'epsilon': 1e-3,
                 'sync_statistics': sync_statistics}
    with slim.arg_scope([slim.conv2d, slim.fully_connected], normalizer_fn=sync_batch_norm,
                        normalizer_params=bn_params):
        net = slim.conv2d(images, 32, [3, 3], scope='conv1')
        net = slim.conv2d(net, 32, [3, 3], scope='conv2')
        net = slim.max_pool2d(net, [2, 2], scope='pool1')
        net = slim.conv2d(net, 64, [3, 3], scope='conv3')
        net = slim.max_pool2d(net, [2, 2], scope='pool2')
        net = slim.flatten(net, scope='flatten')
        net = slim.fully_connected(net, 64, scope='fc1')
        return slim.fully_connected(net, NUM_CLASSES, activation_fn=None, normalizer_fn=None,
                                    scope='logits')


def build_training_graph(args, sync_statistics, cluster):
    """Towers, all-reduced gradients, the train op (with UPDATE_OPS) and an eval path."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(args.seed)
        towers, per_tower = cluster.towers, args.batch_per_tower
        images = tf1.placeholder(tf.float32, [towers * per_tower, 8, 8, 1], name='images')
        labels = tf1.placeholder(tf.int32, [towers * per_tower], name='labels')
        image_parts = tf.split(images, towers)
        label_parts = tf.split(labels, towers)
        global_step = tf1.train.get_or_create_global_step()
        learning_rate = tf1.train.cosine_decay(args.lr, global_step, args.steps, alpha=0.02)
        optimizer = DistributedOptimizer(tf1.train.MomentumOptimizer(learning_rate, 0.9),
                                         cluster)

        def tower_fn():
            i = get_current_tower_context().index
            logits = model(image_parts[i], True, sync_statistics)
            loss = tf1.losses.sparse_softmax_cross_entropy(label_parts[i], logits,
                                                           loss_collection=None)
            correct = tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32),
                                       label_parts[i]), tf.float32)
            return loss, tf.reduce_mean(correct), optimizer.compute_gradients(loss)

        results = call_for_each_tower(tower_fn, cluster.tower_devices)
        loss = tf.add_n([r[0] for r in results]) / towers
        accuracy = tf.add_n([r[1] for r in results]) / towers
        # The mean over every tower of every worker (one small all-reduce).
        loss, accuracy = average_across_workers([loss, accuracy], cluster)
        # The moving-average updates of every batch-norm layer (built on tower 0)
        # run in the same step as the forward pass of all towers. Gradients are
        # summed over this worker's towers, all-reduced across workers in packed
        # buckets and divided by the number of towers of the cluster.
        update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        with tf.control_dependencies(update_ops):
            train_op = optimizer.apply_gradients([r[2] for r in results],
                                                 global_step=global_step)

        # Inference path for the held-out curve: one tower, moving statistics,
        # the training variables.
        with tf.device(cluster.tower_devices[0]), tf1.name_scope('eval'), \
                tf1.variable_scope(tf1.get_variable_scope(), reuse=True):
            eval_images = tf1.placeholder(tf.float32, [None, 8, 8, 1], name='images')
            eval_labels = tf1.placeholder(tf.int32, [None], name='labels')
            eval_logits = model(eval_images, False, None)
            eval_loss = tf1.losses.sparse_softmax_cross_entropy(eval_labels, eval_logits,
                                                                loss_collection=None)
        eval_predictions = tf.argmax(eval_logits, 1, output_type=tf.int32)
        trainable = {v.op.name: v for v in tf1.trainable_variables()}
        # To start the second run from the first run's initial weights.
        with tf1.name_scope('set_weights'):
            feeds = {k: tf1.placeholder(v.dtype.base_dtype, v.shape)
                     for k, v in trainable.items()}
            set_weights = tf.group(*[v.assign(feeds[k]) for k, v in trainable.items()])
        # Everything, optimizer slots and the step included, so that a run resumes
        # exactly; relative paths, so that a moved or copied run folder resumes too.
        saver = tf1.train.Saver(max_to_keep=2, save_relative_paths=True)
    return dict(graph=graph, images=images, labels=labels, loss=loss, accuracy=accuracy,
                train_op=train_op, eval_images=eval_images, eval_labels=eval_labels,
                eval_loss=eval_loss, eval_predictions=eval_predictions, trainable=trainable,
                weight_feeds=feeds, set_weights=set_weights, saver=saver)


@contextlib.contextmanager
def progress_bar(total, initial, desc):
    """tqdm's progress bar on stdout, with TensorFlow's log records printed above it.

    A record logged while the bar runs (a deprecation warning, once per
    function) would otherwise be written into the bar's line. Within the
    block, the ``tensorflow`` logger writes through ``tqdm.write``, which
    clears the bar, prints the record whole and draws the bar again.
    """
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with tqdm(total=total, initial=initial, desc=desc, unit='step', dynamic_ncols=True,
              file=sys.stdout, mininterval=0.5) as bar, \
            logging_redirect_tqdm([tf.get_logger()], tqdm_class=tqdm):
        yield bar


def print_audit(name, net):
    """Prints ``tf1_syncbn.audit_graph``'s report on a run's training graph, and returns it.

    The ``per_tower`` run keeps per-tower statistics on purpose (it is the
    comparison): what the audit finds of that, one problem per layer, prints
    as intended, with the table that shows it (``no (per tower)``). Any other
    problem of that run, or a layer of it that synchronizes, still prints as
    a failure (``FAILED: ...``).
    """
    report = audit_graph(net['graph'], net['train_op'])
    if name != 'per_tower':
        print('%s: batch-norm audit of the training graph:' % name)
        print(report, flush=True)
        return report
    per_tower = [layer for layer in report.layers if layer.synchronized is False]
    intended = [p for layer in per_tower for p in layer.problems if PER_TOWER_FINDING in p]
    others = AuditReport(report.layers, [p for p in report.problems if p not in intended],
                         report.info, report.train_op, report.towers)
    print('per_tower: batch-norm audit of the training graph (the comparison run):')
    print(str(others).rsplit('\n', 1)[0])      # without its verdict: the lines below say it
    failures = len(others.problems)
    synced = [layer.name for layer in report.layers if layer not in per_tower]
    if synced:
        failures += 1
        print('PROBLEM: %s synchronize%s: this run should normalize each tower alone.'
              % (', '.join(synced), 's' if len(synced) == 1 else ''))
    print('per-tower run: %d layer%s unsynchronized, as intended for the comparison%s' % (
        len(per_tower), '' if len(per_tower) == 1 else 's',
        '.' if failures else '; nothing else found.'))
    if failures:
        print('FAILED: %d problem%s.' % (failures, '' if failures == 1 else 's'))
    sys.stdout.flush()
    return report


_STEP_KEYS = ('step', 'loss', 'accuracy', 'eval_step', 'eval_accuracy', 'eval_loss')


def _new_history():
    history = {key: [] for key in _STEP_KEYS}
    history['resumed_at'] = []          # the step of every resume of this run, in order
    return history


def _history_until(history, step):
    """The entries of ``history`` up to (and including) ``step``, and its resumes."""
    out = _new_history()
    kept = sum(1 for s in history['step'] if s <= step)
    evals = sum(1 for s in history['eval_step'] if s <= step)
    for key in _STEP_KEYS:
        out[key] = history[key][:evals if key.startswith('eval_') else kept]
    out['resumed_at'] = list(history.get('resumed_at', []))
    return out


def run_config(args, workers):
    """What ``run.json`` records of a run: what the batch of every step depends on."""
    return {'global_batch': workers * args.towers * args.batch_per_tower, 'workers': workers,
            'towers': args.towers, 'batch_per_tower': args.batch_per_tower, 'seed': args.seed}


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _checkpoint_step(path):
    """The step of a checkpoint path ``.../model.ckpt-<step>``, or 0 (None, or no step)."""
    try:
        return int(path.rsplit('-', 1)[1]) if path else 0
    except (IndexError, ValueError):
        return 0


def latest_saved(run_dir):
    """The newest checkpoint of ``run_dir``'s state file whose index is there, or None.

    Like ``tf.train.latest_checkpoint``, but a newest one whose files are
    missing (half-written) does not hide the older ones, which
    :class:`~tf1_syncbn.distributed.WorkerSession` restores instead.
    """
    state = tf1.train.get_checkpoint_state(run_dir)
    if state is None:
        return None
    paths = [state.model_checkpoint_path] + list(reversed(state.all_model_checkpoint_paths))
    return next((p for p in paths if p and os.path.exists(p + '.index')), None)


def apply_auto_resume(args):
    """--auto-resume, or a worker restarted by --max-restarts: --resume or --overwrite.

    --resume when --out-dir holds a checkpoint of either run, else --overwrite
    (what an interrupted first start left is replaced). Returns the choice, or
    None when neither applies.
    """
    if not (args.auto_resume or restart_count() > 0):
        return None
    out_dir = os.path.abspath(args.out_dir)
    args.resume = any(latest_saved(os.path.join(out_dir, run)) for run in RUNS)
    args.overwrite = not args.resume
    return '--resume' if args.resume else '--overwrite'


def resume_problem(args):
    """Why ``--resume`` cannot continue the run in --out-dir, or None.

    It needs a checkpoint of at least one of the runs, ``--steps`` no fewer
    than the steps already trained, and the global batch and seed of the
    earlier run (``run.json``, or an older run's ``metrics.json``): the batch
    of every step follows them.
    """
    if not args.resume:
        return None
    out_dir = os.path.abspath(args.out_dir)
    runs = [os.path.join(out_dir, run) for run in RUNS]
    if not any(latest_saved(run_dir) for run_dir in runs):
        stale = [os.path.join(run_dir, 'checkpoint') for run_dir in runs
                 if os.path.exists(os.path.join(run_dir, 'checkpoint'))]
        return ('--resume: %s holds no checkpoint to resume from%s. Run without --resume '
                'to start afresh, or give the --out-dir of the run to continue.'
                % (out_dir, ' (%s names checkpoint files that are not there: a run saved by an '
                             'older version, with absolute paths, then moved)' % stale[0]
                   if stale else ''))
    trained = max(_checkpoint_step(latest_saved(run_dir)) for run_dir in runs)
    if args.steps < trained:
        return ('--resume: the run in %s has trained %d steps already; --steps %d would train '
                'none of them again and leave its metrics mixed. Pass --steps %d or more '
                '(the learning-rate schedule follows it), or start afresh with --overwrite.'
                % (out_dir, trained, args.steps, trained))
    earlier = _read_json(os.path.join(out_dir, 'run.json')) or \
        _read_json(os.path.join(out_dir, 'metrics.json')) or {}
    now = run_config(args, _planned_workers(args))
    changed = [key for key in ('global_batch', 'seed') if key in earlier and
               earlier[key] != now[key]]
    if not changed:
        return None
    def describe(config):
        split = [(config.get(k), w) for k, w in (('workers', 'worker'), ('towers', 'tower'),
                                                 ('batch_per_tower', 'example'))]
        return 'global batch %s (%s per tower), seed %s' % (
            config.get('global_batch'), ' x '.join('%s %s%s' % (n, w, '' if n == 1 else 's')
                                                   for n, w in split if n is not None),
            config.get('seed'))

    return ('--resume: the run in %s was trained with %s; this job has %s. The examples of '
            'every step follow the global batch and the seed, so resuming would not continue '
            'that run. Resume with the same --workers x --towers x --batch-per-tower and '
            '--seed, or start afresh with --overwrite (or another --out-dir).'
            % (out_dir, describe(earlier), describe(now)))


def _is_run_state(name):
    return name == 'checkpoint' or name.startswith('model.ckpt') or name == 'history.json'


def earlier_run(out_dir):
    """The files of an earlier run in ``out_dir``: checkpoints, history, weights, metrics."""
    found = [os.path.join(out_dir, name) for name in ('metrics.json', 'initial_weights.npz')
             if os.path.exists(os.path.join(out_dir, name))]
    for run in RUNS:
        run_dir = os.path.join(out_dir, run)
        if os.path.isdir(run_dir):
            found += sorted(os.path.join(run_dir, name) for name in os.listdir(run_dir)
                            if _is_run_state(name))
    return found


def refusal(args):
    """The message refusing to replace an earlier run in --out-dir, or None."""
    if args.resume or args.overwrite:
        return None
    out_dir = os.path.abspath(args.out_dir)
    found = earlier_run(out_dir)
    if not found:
        return None
    return ('%s holds an earlier run (%s%s). Pass --resume to continue it, or --overwrite to '
            'delete it and start afresh (or choose another --out-dir).'
            % (out_dir, ', '.join(os.path.relpath(f, out_dir) for f in found[:4]),
               ', ...' if len(found) > 4 else ''))


def clear_checkpoints(run_dir):
    """Removes an earlier run's checkpoints and history (the chief, with --overwrite)."""
    if not os.path.isdir(run_dir):
        return
    for name in os.listdir(run_dir):
        if _is_run_state(name):
            os.remove(os.path.join(run_dir, name))


def _atomic_write(path, write, mode='w'):
    """Writes ``path`` through ``write(file)`` into a temporary file, then ``os.replace``.

    A failure (or a kill) part-way leaves the previous ``path`` as it was.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix='.%s.' % os.path.basename(path),
                               suffix='.tmp')
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path, value, **kwargs):
    """``json.dump(value)`` into ``path``, atomically (see :func:`_atomic_write`)."""
    _atomic_write(path, lambda f: json.dump(value, f, **kwargs))


def train(name, args, sync_statistics, data, run_dir, cluster, initial_values=None,
          initial_path=None):
    """Trains one run on this worker.

    Without ``initial_values``, a run that starts at step 0 takes its own
    initial weights, and the chief writes them to ``initial_path`` before the
    first step (so that the other run starts from them, also after a restart).

    Returns:
      ``(history, checkpoint path or None, initial weights, final held-out accuracy
      of the in-session eval path)``.
    """
    x_train, x_test, y_train, y_test = data
    chief = cluster.is_chief
    net = build_training_graph(args, sync_statistics, cluster)
    if chief:
        print_audit(name, net)
        os.makedirs(run_dir, exist_ok=True)
        if not args.resume:
            clear_checkpoints(run_dir)      # main() refused unless --overwrite was given
    history_path = os.path.join(run_dir, 'history.json')
    global_batch = cluster.num_towers * args.batch_per_tower
    local = slice(cluster.rank * cluster.towers * args.batch_per_tower,
                  (cluster.rank + 1) * cluster.towers * args.batch_per_tower)

    def set_initial_weights(session):
        if initial_values is not None:
            session.run(net['set_weights'], {ph: initial_values[k]
                                             for k, ph in net['weight_feeds'].items()})

    started = time.time()
    # Checks the peers, initializes, restores the chief's latest checkpoint
    # (with --resume) and broadcasts worker 0's variables to every worker.
    session = WorkerSession(cluster, checkpoint_dir=run_dir, saver=net['saver'],
                            graph=net['graph'], restore=args.resume,
                            init_fn=set_initial_weights)
    start = session.start_step
    history = _new_history()
    if start and chief and os.path.exists(history_path):
        with open(history_path) as f:
            history = _history_until(json.load(f), start)
    if start == 0 and initial_values is None:
        initial_values = session.session.run(net['trainable'])
        if chief and initial_path:
            _atomic_write(initial_path, lambda f: np.savez(f, **initial_values), mode='wb')
    if session.restored_from:
        print('%-9s resumed at step %d from %s' % (name, start, session.restored_from))
        history['resumed_at'].append(start)
        if chief:
            write_json(history_path, history)       # the history of the restored step

    def evaluate():
        predictions, eval_loss = session.session.run(
            [net['eval_predictions'], net['eval_loss']],
            {net['eval_images']: x_test, net['eval_labels']: y_test})
        return float(np.mean(predictions == y_test)), float(eval_loss)

    def save(step):
        # History first: a crash between the two writes then leaves the history
        # ahead of the last checkpoint, and a resume truncates it to the
        # restored step (_history_until); the other order would lose steps.
        if chief:
            write_json(history_path, history)
        return session.save()

    one_process = cluster.num_workers == 1 and not cluster.server     # else: a progress line
    with (progress_bar(args.steps, start, '%-9s' % name) if one_process
          else contextlib.nullcontext()) as bar:
        report_every = max(1, args.steps // 10)
        run_loss = run_acc = None
        path = session.restored_from if chief else None
        for step in range(start + 1, args.steps + 1):
            batch = batch_indices(step - 1, global_batch, len(x_train), args.seed)[local]
            loss, acc, _ = session.run([net['loss'], net['accuracy'], net['train_op']],
                                       {net['images']: x_train[batch],
                                        net['labels']: y_train[batch]})
            history['step'].append(step)
            history['loss'].append(float(loss))
            history['accuracy'].append(float(acc))
            run_loss = loss if run_loss is None else 0.95 * run_loss + 0.05 * loss
            run_acc = acc if run_acc is None else 0.95 * run_acc + 0.05 * acc
            if chief and (step % args.eval_every == 0 or step == args.steps):
                accuracy, eval_loss = evaluate()
                history['eval_step'].append(step)
                history['eval_accuracy'].append(accuracy)
                history['eval_loss'].append(eval_loss)
            if (args.save_every and step % args.save_every == 0) or step == args.steps:
                path = save(step) or path
            if bar is not None:
                bar.update(1)
                if step % 10 == 0 or step == args.steps:
                    postfix = {'loss': '%.3f' % run_loss, 'acc': '%.3f' % run_acc}
                    if history['eval_accuracy']:
                        postfix['held-out'] = '%.3f' % history['eval_accuracy'][-1]
                    bar.set_postfix(postfix, refresh=False)
            elif chief and (step % report_every == 0 or step == args.steps):
                print('%-9s step %d/%d  loss %.3f  acc %.3f%s' % (
                    name, step, args.steps, run_loss, run_acc,
                    '  held-out %.3f' % history['eval_accuracy'][-1]
                    if history['eval_accuracy'] else ''), flush=True)
    final_accuracy = evaluate()[0]
    session.close()
    history['seconds'] = time.time() - started
    history['start_step'] = start
    return history, path, initial_values, final_accuracy


def evaluate_checkpoint(path, images, labels):
    """Held-out accuracy of a single-tower, is_training=False graph restored from ``path``."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 8, 8, 1])
        predictions = tf.argmax(model(x, False, None), 1, output_type=tf.int32)
        saver = tf1.train.Saver(tf1.model_variables())
    with tf1.Session(graph=graph) as sess:
        saver.restore(sess, path)
        return float(np.mean(sess.run(predictions, {x: images}) == labels))


def _smooth(values, weight=0.9):
    out, last = [], values[0]
    for v in values:
        last = weight * last + (1 - weight) * v
        out.append(last)
    return out


def plot(histories, args, global_batch, path):
    """Training and held-out loss and accuracy of both runs, 2x2 panels.

    Returns:
      Whether the plot was written: it needs matplotlib (``pip install
      '.[demo]'``, which ``make demo`` installs); without it the demo says so
      and goes on.
    """
    try:
        import matplotlib
    except ImportError:
        print('No plot: matplotlib is not installed (pip install matplotlib, or '
              "pip install '.[demo]').")
        return False
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    colors = {'sync': 'tab:blue', 'per_tower': 'tab:red'}
    labels = {'sync': 'SyncBN (statistics of %d examples)',
              'per_tower': 'per-tower BN (statistics of %d examples)'}
    sizes = {'sync': global_batch, 'per_tower': args.batch_per_tower}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (train_loss, train_acc), (eval_loss, eval_acc) = axes
    for name, h in histories.items():
        if not h['step'] or not h['eval_step']:
            continue
        label = labels[name] % sizes[name]
        style = dict(color=colors[name], label=label)
        train_loss.plot(h['step'], _smooth(h['loss']), **style)
        train_acc.plot(h['step'], _smooth(h['accuracy']), **style)
        eval_loss.plot(h['eval_step'], h['eval_loss'], 'o-', markersize=3, **style)
        eval_acc.plot(h['eval_step'], h['eval_accuracy'], 'o-', markersize=3, **style)
    train_loss.set_title('training loss (smoothed; batch statistics)')
    train_acc.set_title('training accuracy (smoothed; batch statistics)')
    eval_loss.set_title('held-out loss (is_training=False: moving statistics)')
    eval_acc.set_title('held-out accuracy (is_training=False: moving statistics)')
    train_loss.set_yscale('log')
    eval_loss.set_yscale('log')
    lows = [min(h['eval_accuracy']) for h in histories.values() if h['eval_accuracy']]
    if lows:
        eval_acc.set_ylim(max(0.0, min(0.9, min(lows) - 0.01)), 1.001)
    train_acc.set_ylim(0.0, 1.01)
    for ax in axes.ravel():
        ax.set_xlabel('step')
        ax.grid(alpha=0.3)
        ax.legend(loc='best', fontsize=8)
    workers = global_batch // (args.towers * args.batch_per_tower)
    fig.suptitle('handwritten digits, %s%d towers x %d examples per tower (global batch %d): '
                 'synchronized vs per-tower batch norm'
                 % ('%d workers x ' % workers if workers > 1 else '', args.towers,
                    args.batch_per_tower, global_batch))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def verdict(accuracies, min_accuracy, backend):
    """(passed, lines): the final held-out accuracies and PASS/FAIL."""
    passed = accuracies['sync'] >= min_accuracy
    lines = ['  SyncBN (--backend %s): %.2f%%' % (backend, 100 * accuracies['sync']),
             '  per-tower BN (sync_statistics=None): %.2f%%' % (100 * accuracies['per_tower']),
             '%s: SyncBN held-out accuracy %.2f%% %s --min-accuracy %.2f%%' % (
                 'PASS' if passed else 'FAIL', 100 * accuracies['sync'],
                 '>=' if passed else 'is below', 100 * min_accuracy)]
    return passed, lines


def run_worker(args, cluster):
    """Both runs on this worker (the only one, or one of a cluster). Returns the exit status."""
    out_dir = os.path.abspath(args.out_dir)
    chief = cluster.is_chief
    if chief:
        os.makedirs(out_dir, exist_ok=True)
        if not args.resume:
            for name in ('metrics.json', 'initial_weights.npz'):
                if os.path.exists(os.path.join(out_dir, name)):
                    os.remove(os.path.join(out_dir, name))
        # What a later --resume checks (resume_problem).
        write_json(os.path.join(out_dir, 'run.json'), run_config(args, cluster.num_workers))
    data = load_data(args.seed)
    global_batch = cluster.num_towers * args.batch_per_tower
    me = cluster.describe(cluster.rank) if cluster.num_workers > 1 else None
    if chief:
        print('Digits: %d training, %d held-out images (8x8); %s%d towers x %d examples '
              'per tower = global batch %d; %d steps per run.'
              % (len(data[0]), len(data[1]),
                 '%d workers x ' % cluster.num_workers if cluster.num_workers > 1 else '',
                 cluster.towers, args.batch_per_tower, global_batch, args.steps))
    start = time.time()
    initial_path = os.path.join(out_dir, 'initial_weights.npz')
    initial_values = None
    if chief and args.resume and os.path.exists(initial_path):
        initial_values = dict(np.load(initial_path))
    histories, checkpoints, final = {}, {}, {}
    for name in RUNS:
        spec = sync_spec(args.backend, cluster) if name == 'sync' else None
        run_dir = os.path.join(out_dir, name)
        history, checkpoints[name], values, local_accuracy = train(
            name, args, spec, data, run_dir, cluster, initial_values, initial_path)
        initial_values = values if values is not None else initial_values
        histories[name] = history
        if chief and checkpoints[name]:
            final[name] = evaluate_checkpoint(checkpoints[name], data[1], data[3])
            where = 'single-tower inference graph restored from %s' % checkpoints[name]
        else:
            final[name] = local_accuracy
            where = 'this worker\'s variables'
            if spec is None and cluster.num_workers > 1:
                where += ('; unsynchronized batch norm updates its moving statistics from this '
                          'worker\'s own tower 0, so they differ from the chief\'s')
        print('%-9s %.1f s, held-out accuracy %.2f%% (%s)'
              % (name, history['seconds'], 100 * final[name], where))
    passed, lines = verdict(final, args.min_accuracy, args.backend)
    if chief:
        metrics = {
            'workers': cluster.num_workers, 'towers': cluster.towers,
            'batch_per_tower': args.batch_per_tower, 'global_batch': global_batch,
            'steps': args.steps, 'seed': args.seed, 'backend': args.backend,
            'min_accuracy': args.min_accuracy, 'passed': passed,
            # This chief's attempt (TF1_SYNCBN_RESTART_COUNT: 0, or the k-th restart of
            # --max-restarts); the launcher adds 'restarts', the record of each.
            'restart_count': restart_count(),
            'runs': {name: {'held_out_accuracy': final[name],
                            'loss': histories[name]['loss'],
                            'accuracy': histories[name]['accuracy'],
                            'eval_step': histories[name]['eval_step'],
                            'eval_accuracy': histories[name]['eval_accuracy'],
                            'start_step': histories[name]['start_step'],
                            'resumed_at': histories[name]['resumed_at'],
                            'seconds': histories[name]['seconds'],
                            'checkpoint': checkpoints[name]} for name in RUNS}}
        metrics_path = os.path.join(out_dir, 'metrics.json')
        write_json(metrics_path, metrics, indent=1)
        plot_path = os.path.join(out_dir, 'syncbn_vs_per_tower.png')
        plotted = plot(histories, args, global_batch, plot_path)
        print()
        print('Final held-out accuracy (is_training=False, single tower, %d images):'
              % len(data[1]))
        for line in lines:
            print(line)
        print('Checkpoint (sync model): %s' % checkpoints['sync'])
        print('Metrics: %s' % metrics_path)
        if plotted:
            print('Plot: %s' % plot_path)
        if args.update_docs and plotted:
            os.makedirs(os.path.dirname(DOCS_PLOT), exist_ok=True)
            shutil.copyfile(plot_path, DOCS_PLOT)
            print('Plot copied to %s (the picture in docs/demo.md).' % os.path.relpath(DOCS_PLOT))
        print('Total time: %.1f s' % (time.time() - start))
    else:
        print('%s: %s (computed with this worker\'s variables, which the broadcast, the '
              'all-reduced gradients and the synchronized statistics keep equal to the '
              'chief\'s; metrics.json, checkpoints and the plot are written by worker 0)'
              % (me, lines[-1]))
    return 0 if passed else 1


def launch_workers(args, argv):
    """Starts ``--workers`` local worker processes running this script; prints the verdict."""
    from tf1_syncbn.launch import launch
    out_dir = os.path.abspath(args.out_dir)
    metrics_path = os.path.join(out_dir, 'metrics.json')
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    command = [sys.executable, os.path.abspath(__file__)] + list(argv)
    addresses = args.hosts.split(',') if args.hosts else None
    print('Starting %d local workers of %d towers each (tf1_syncbn.launch; a failed worker stops '
          'the others%s)' % (args.workers, args.towers,
                             ', then every worker restarts, up to %d times' % args.max_restarts
                             if args.max_restarts else ''), flush=True)
    restarts = []
    status = launch(command, args.workers, addresses=addresses,
                    grace=args.collective_timeout + 15, max_restarts=args.max_restarts,
                    restarts=restarts)
    print()
    for r in restarts:
        print('Restart %d: %s; the chief then %s.' % (
            r.number, r.describe(), ', '.join(
                'resumed at step %d from %s' % (s['step'], s['checkpoint']) if s['checkpoint']
                else 'started at step 0' for s in r.resumed) or 'did not report its start'))
    if not os.path.exists(metrics_path):
        print('FAIL: a worker failed (exit status %d, see its lines above); no metrics.json was '
              'written. Restart with --resume to continue from the chief\'s last checkpoint in %s.'
              % (status, out_dir))
        return status or 1
    with open(metrics_path) as f:
        metrics = json.load(f)
    if args.max_restarts:
        # The launcher's record of each restart: the worker, its exit cause, where
        # the chief resumed.
        metrics['restarts'] = [r.to_dict() for r in restarts]
        write_json(metrics_path, metrics, indent=1)
    accuracies = {name: metrics['runs'][name]['held_out_accuracy'] for name in RUNS}
    passed, lines = verdict(accuracies, args.min_accuracy, args.backend)
    print('%d workers x %d towers x %d examples per tower (global batch %d), %d steps; final '
          'held-out accuracy:' % (metrics['workers'], metrics['towers'],
                                  metrics['batch_per_tower'], metrics['global_batch'],
                                  metrics['steps']))
    for line in lines:
        print(line)
    print('Metrics: %s' % metrics_path)
    if status and passed:
        print('FAIL: a worker exited with status %d.' % status)
    return status or (0 if passed else 1)


def _tf_config_cluster():
    try:
        return bool(json.loads(os.environ.get('TF_CONFIG') or '{}').get('cluster'))
    except ValueError:
        return True     # malformed: let TensorFlow's resolver say what is wrong


def _planned_workers(args):
    """The number of workers of this job, known before the cluster is set up."""
    if args.hosts:
        return len(args.hosts.split(','))
    try:
        cluster = json.loads(os.environ.get('TF_CONFIG') or '{}').get('cluster')
        if not cluster:
            return args.workers
        return max(1, len(cluster.get('chief', [])) + len(cluster.get('worker', [])))
    except (ValueError, TypeError, AttributeError):
        return args.workers


def _will_be_chief(args):
    """Whether this process will be worker 0 (the one that writes into --out-dir)."""
    if args.task is not None:
        return args.task == 0
    try:
        config = json.loads(os.environ.get('TF_CONFIG') or '{}')
        if not config.get('cluster'):
            return True
        task = config.get('task', {})
        chief_type = 'chief' if config['cluster'].get('chief') else 'worker'
        return task.get('type') == chief_type and int(task.get('index', 0)) == 0
    except (ValueError, TypeError, AttributeError):
        return False        # malformed: setup_cluster says what is wrong


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.tf1_behavior:
        tf1.disable_v2_behavior()
    else:
        tf1.disable_eager_execution()
    worker_mode = args.task is not None or _tf_config_cluster()
    choice = apply_auto_resume(args)
    if choice and _will_be_chief(args) and (worker_mode or args.workers == 1):
        print('%s: %s (%s checkpoint in %s)' % (
            'restart %d' % restart_count() if restart_count() else '--auto-resume', choice,
            'a' if args.resume else 'no', os.path.abspath(args.out_dir)), flush=True)
    # Before anything starts: never delete an earlier run's checkpoints
    # because --resume was forgotten.
    message = (refusal(args) or resume_problem(args)) if _will_be_chief(args) else None
    if message:
        sys.stderr.write('%s: error: %s\n' % (os.path.basename(__file__), message))
        sys.stderr.flush()
        if worker_mode:
            hard_exit(2)
        return 2
    if args.workers > 1 and not worker_mode:
        return launch_workers(args, argv)
    try:
        cluster = setup_cluster(towers=args.towers,
                                hosts=args.hosts if args.task is not None else None,
                                task=args.task, collective_timeout=args.collective_timeout,
                                startup_timeout=args.startup_timeout)
        if args.workers > 1 and cluster.num_workers != args.workers:
            raise ValueError('--workers %d, but the cluster has %d workers.'
                             % (args.workers, cluster.num_workers))
        status = run_worker(args, cluster)
    except ClusterError as e:
        print('FAIL: %s' % e, flush=True)
        status = 1
    except Exception:       # noqa: BLE001 - a worker must still leave through hard_exit
        if not worker_mode:
            raise
        traceback.print_exc()
        status = 1
    if worker_mode:
        # A TensorFlow server cannot be stopped; leave without the interpreter's
        # shutdown, which can block or crash once peers are gone.
        hard_exit(status)
    return status


if __name__ == '__main__':
    sys.exit(main())

"""SyncBN vs per-tower batch norm: a small conv net on scikit-learn's digits.

The main job of ``make demo``. It trains the same conv net twice, on 4 towers
of virtual CPUs with 2 examples per tower (a global batch of 8):

* ``sync``: ``sync_batch_norm`` with ``sync_statistics='auto'`` (collective
  all-reduce between the towers): every tower normalizes with the statistics
  of the global batch of 8;
* ``per-tower``: the same layer with ``sync_statistics=None``: every tower
  normalizes with the statistics of its own 2 examples, as plain batch norm in
  a multi-GPU script does.

Both runs use in-graph replication (``tower.call_for_each_tower``, variables
shared by the towers), ``tower.average_gradients`` and one momentum optimizer,
start from the same weights and see the same batches. The batch-norm
moving-average updates (``UPDATE_OPS``, built on tower 0) run in the same
``session.run`` as the train op, as a control dependency: SyncBN's updates
need the forward pass of every tower in the same step.

Every ``--eval-every`` steps the held-out set is scored with an inference path
(``is_training=False``: moving statistics) that shares the variables. At the
end, the sync model is saved with ``tf.compat.v1.train.Saver``, restored into
a separate single-tower inference graph and scored there; the per-tower model
gets the same treatment. A PNG plot of both runs' loss and accuracy goes to
``--out-dir`` (``--update-docs`` also copies it to ``docs/demo.png``).

What to expect (2 CPU cores, about 35 s for both runs): at 2 examples per
tower the per-tower model's held-out accuracy falls to ~70% (its 2-example
statistics are far from the moving statistics used at inference) while
SyncBN, with 8-example statistics, reaches ~99%. At ``--batch-per-tower 4``
SyncBN still trains to a ~10x lower training loss, but on this easy data set
both reach ~99% held-out accuracy.

The job exits with status 1 when the SyncBN model's held-out accuracy is
below ``--min-accuracy`` (default 0.95).

Usage::

    python examples/train_multitower.py [--towers 4] [--batch-per-tower 2]
        [--steps 900] [--backend auto|collective|none] [--out-dir demo_out/]
        [--seed 0] [--min-accuracy 0.95]
"""

import argparse
import os
import shutil
import sys
import time
import warnings

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import matplotlib  # noqa: E402

matplotlib.use('Agg')

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_slim as slim  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tf1_syncbn import CollectiveBackend, sync_batch_norm  # noqa: E402
from tower import (average_gradients, call_for_each_tower, get_current_tower_context,  # noqa: E402
                   virtual_cpu_config)

tf1 = tf.compat.v1

# tf-slim's pooling and flatten layers wrap deprecated tf.layers classes.
warnings.filterwarnings('ignore', message=r'`(layer\.apply|tf\.layers\.flatten)` is deprecated',
                        category=UserWarning)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS_PLOT = os.path.join(REPO, 'docs', 'demo.png')
NUM_CLASSES = 10


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Train a small conv net on sklearn digits on N towers, with SyncBN and '
                    'with per-tower batch norm, and plot both.')
    parser.add_argument('--towers', type=int, default=4, help='number of towers (virtual CPUs)')
    parser.add_argument('--batch-per-tower', type=int, default=2,
                        help='examples per tower and step (default 4)')
    parser.add_argument('--steps', type=int, default=900, help='training steps per run')
    parser.add_argument('--backend', choices=('auto', 'collective', 'none'), default='auto',
                        help="sync_statistics of the SyncBN run ('none': no sync, which "
                             "makes both runs the same)")
    parser.add_argument('--out-dir', default='demo_out/', help='checkpoints and plot go here')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--lr', type=float, default=0.05, help='initial learning rate')
    parser.add_argument('--eval-every', type=int, default=50,
                        help='score the held-out set every this many steps')
    parser.add_argument('--min-accuracy', type=float, default=0.95,
                        help='fail (exit 1) when the SyncBN model scores below this')
    parser.add_argument('--update-docs', action='store_true',
                        help='also copy the plot to docs/demo.png (the README picture)')
    args = parser.parse_args(argv)
    for name in ('towers', 'batch_per_tower', 'steps', 'eval_every'):
        if getattr(args, name) < 1:
            parser.error('--%s must be at least 1' % name.replace('_', '-'))
    if args.towers * args.batch_per_tower < 2:
        parser.error('the global batch needs at least 2 examples')
    return args


def load_data(seed):
    """Digits as [N, 8, 8, 1] float32 in [0, 1]; a stratified 75/25 split."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    return train_test_split(images, labels, test_size=0.25, random_state=seed,
                            stratify=labels)


def sync_spec(backend):
    """The ``sync_statistics`` value of the SyncBN run."""
    if backend == 'none':
        return None
    if backend == 'collective':
        return CollectiveBackend(timeout=60)
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


def build_training_graph(args, sync_statistics):
    """Towers, averaged gradients, the train op (with UPDATE_OPS) and an eval path."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(args.seed)
        towers, per_tower = args.towers, args.batch_per_tower
        images = tf1.placeholder(tf.float32, [towers * per_tower, 8, 8, 1], name='images')
        labels = tf1.placeholder(tf.int32, [towers * per_tower], name='labels')
        image_parts = tf.split(images, towers)
        label_parts = tf.split(labels, towers)
        global_step = tf1.train.get_or_create_global_step()
        learning_rate = tf1.train.cosine_decay(args.lr, global_step, args.steps, alpha=0.02)
        optimizer = tf1.train.MomentumOptimizer(learning_rate, 0.9)

        def tower_fn():
            i = get_current_tower_context().index
            logits = model(image_parts[i], True, sync_statistics)
            loss = tf1.losses.sparse_softmax_cross_entropy(label_parts[i], logits,
                                                           loss_collection=None)
            correct = tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32),
                                       label_parts[i]), tf.float32)
            return loss, tf.reduce_mean(correct), optimizer.compute_gradients(loss)

        devices = ['/cpu:%d' % i for i in range(towers)]
        results = call_for_each_tower(tower_fn, devices)
        loss = tf.add_n([r[0] for r in results]) / towers
        accuracy = tf.add_n([r[1] for r in results]) / towers
        grads = average_gradients([r[2] for r in results])
        # The moving-average updates of every batch-norm layer (built on tower 0)
        # run in the same step as the forward pass of all towers.
        update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        with tf.control_dependencies(update_ops):
            train_op = optimizer.apply_gradients(grads, global_step=global_step)

        # Inference path for the held-out curve: one tower, moving statistics,
        # the training variables.
        with tf.device('/cpu:0'), tf1.name_scope('eval'), \
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
        saver = tf1.train.Saver(tf1.model_variables() + [global_step])
        init = tf1.global_variables_initializer()
    return dict(graph=graph, images=images, labels=labels, loss=loss, accuracy=accuracy,
                train_op=train_op, update_ops=update_ops, eval_images=eval_images,
                eval_labels=eval_labels, eval_loss=eval_loss,
                eval_predictions=eval_predictions, trainable=trainable, weight_feeds=feeds,
                set_weights=set_weights, saver=saver, init=init)


def train(name, args, sync_statistics, data, ckpt_path, initial_values=None):
    """Trains one run; returns its history, its checkpoint and its initial weights."""
    x_train, x_test, y_train, y_test = data
    net = build_training_graph(args, sync_statistics)
    rng = np.random.RandomState(args.seed)
    global_batch = args.towers * args.batch_per_tower
    history = {'step': [], 'loss': [], 'accuracy': [], 'eval_step': [], 'eval_accuracy': [],
               'eval_loss': []}
    order = np.array([], np.int64)
    start = time.time()
    with tf1.Session(graph=net['graph'], config=virtual_cpu_config(args.towers)) as sess:
        sess.run(net['init'])
        if initial_values is None:
            initial_values = sess.run(net['trainable'])
        else:
            sess.run(net['set_weights'], {ph: initial_values[k]
                                          for k, ph in net['weight_feeds'].items()})
        bar = tqdm(range(1, args.steps + 1), desc='%-9s' % name, unit='step',
                   dynamic_ncols=True, file=sys.stdout, mininterval=0.5)
        run_loss = run_acc = None
        for step in bar:
            if len(order) < global_batch:
                order = np.concatenate([order, rng.permutation(len(x_train))])
            batch, order = order[:global_batch], order[global_batch:]
            loss, acc, _ = sess.run([net['loss'], net['accuracy'], net['train_op']],
                                    {net['images']: x_train[batch],
                                     net['labels']: y_train[batch]})
            history['step'].append(step)
            history['loss'].append(float(loss))
            history['accuracy'].append(float(acc))
            run_loss = loss if run_loss is None else 0.95 * run_loss + 0.05 * loss
            run_acc = acc if run_acc is None else 0.95 * run_acc + 0.05 * acc
            if step % args.eval_every == 0 or step == args.steps:
                predictions, eval_loss = sess.run(
                    [net['eval_predictions'], net['eval_loss']],
                    {net['eval_images']: x_test, net['eval_labels']: y_test})
                history['eval_step'].append(step)
                history['eval_accuracy'].append(float(np.mean(predictions == y_test)))
                history['eval_loss'].append(float(eval_loss))
            if step % 10 == 0 or step == args.steps:
                postfix = {'loss': '%.3f' % run_loss, 'acc': '%.3f' % run_acc}
                if history['eval_accuracy']:
                    postfix['held-out'] = '%.3f' % history['eval_accuracy'][-1]
                bar.set_postfix(postfix, refresh=False)
        bar.close()
        path = net['saver'].save(sess, ckpt_path)
    history['seconds'] = time.time() - start
    return history, path, initial_values


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


def plot(histories, args, path):
    """Training and held-out loss and accuracy of both runs, 2x2 panels."""
    colors = {'sync': 'tab:blue', 'per-tower': 'tab:red'}
    labels = {'sync': 'SyncBN (statistics of %d examples)',
              'per-tower': 'per-tower BN (statistics of %d examples)'}
    sizes = {'sync': args.towers * args.batch_per_tower, 'per-tower': args.batch_per_tower}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (train_loss, train_acc), (eval_loss, eval_acc) = axes
    for name, h in histories.items():
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
    last = min(min(h['eval_accuracy']) for h in histories.values())
    eval_acc.set_ylim(max(0.0, min(0.9, last - 0.01)), 1.001)
    train_acc.set_ylim(0.0, 1.01)
    for ax in axes.ravel():
        ax.set_xlabel('step')
        ax.grid(alpha=0.3)
        ax.legend(loc='best', fontsize=8)
    fig.suptitle('sklearn digits, %d towers x %d examples per tower (global batch %d): '
                 'synchronized vs per-tower batch norm'
                 % (args.towers, args.batch_per_tower, args.towers * args.batch_per_tower))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    tf1.disable_eager_execution()
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    data = load_data(args.seed)
    print('sklearn digits: %d training, %d held-out images (8x8); %d towers on virtual CPUs x '
          '%d examples per tower = global batch %d; %d steps per run.'
          % (len(data[0]), len(data[1]), args.towers, args.batch_per_tower,
             args.towers * args.batch_per_tower, args.steps))
    start = time.time()
    runs = [('sync', sync_spec(args.backend)), ('per-tower', None)]
    histories, checkpoints, final = {}, {}, {}
    initial_values = None
    for name, spec in runs:
        ckpt = os.path.join(out_dir, name.replace('-', '_'), 'model.ckpt')
        os.makedirs(os.path.dirname(ckpt), exist_ok=True)
        history, checkpoints[name], initial_values = train(name, args, spec, data, ckpt,
                                                           initial_values)
        histories[name] = history
        final[name] = evaluate_checkpoint(checkpoints[name], data[1], data[3])
        print('%-9s %.1f s, held-out accuracy %.2f%% (single-tower inference graph restored '
              'from %s)' % (name, history['seconds'], 100 * final[name], checkpoints[name]))
    plot_path = os.path.join(out_dir, 'syncbn_vs_per_tower.png')
    plot(histories, args, plot_path)
    print()
    print('Final held-out accuracy (is_training=False, single tower, %d images):'
          % len(data[1]))
    print('  SyncBN (--backend %s): %.2f%%' % (args.backend, 100 * final['sync']))
    print('  per-tower BN (sync_statistics=None): %.2f%%' % (100 * final['per-tower']))
    print('Checkpoint (sync model): %s' % checkpoints['sync'])
    print('Plot: %s' % plot_path)
    if args.update_docs:
        os.makedirs(os.path.dirname(DOCS_PLOT), exist_ok=True)
        shutil.copyfile(plot_path, DOCS_PLOT)
        print('Plot copied to %s (the picture for the README).' % os.path.relpath(DOCS_PLOT))
    print('Total time: %.1f s' % (time.time() - start))
    if final['sync'] < args.min_accuracy:
        print('FAIL: the SyncBN model scored %.2f%%, below --min-accuracy %.2f%%.'
              % (100 * final['sync'], 100 * args.min_accuracy))
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())

"""Writes the checkpoints of ``tests/data/pre_layout/``: a 2-tower model saved by the old layout.

Written once, with the code as it was before the package layout of issue 34
(``git log -- tests/data/pre_layout`` names the commit), so that the layout
change and every later one can be checked against it: a meta graph and a
checkpoint written by an earlier version must still import, restore and
train on (``tests/core/test_pre_layout_checkpoints.py``).

The model: 2 towers on 2 virtual CPUs (``tower.call_for_each_tower``), in
each a slim ``conv2d`` with ``normalizer_fn=tf1_syncbn.sync_batch_norm``,
``tf1_syncbn.BatchNorm`` (tensorpack) and
``tf1_syncbn.layers.batch_normalization`` (tf.layers), all synchronized,
and a logits layer; momentum SGD with the update ops as control inputs of
the train op. Only public names are used, as a user's script would.

One directory per configuration: the TF behaviour (``v2``: TF2-behaviour
graph mode, ``v1``: ``disable_v2_behavior()``) and the kernels
(``compiled``: the compiled CPU kernels; ``stock``: TensorFlow's own,
``TF1_SYNCBN_KERNELS=0 TF_ENABLE_ONEDNN_OPTS=0``). Each holds
``model.ckpt.meta.gz`` (the meta graph, gzipped: a tenth of its size),
``model.ckpt.index`` and ``model.ckpt.data-00000-of-00001`` (saved after
``STEPS`` steps), and ``expected.json``: the batch of the next step (its
seed), the loss of that step and every variable after it.

Usage: ``python tests/data/pre_layout/write.py [OUT_DIR]`` (default: next
to this file); it runs one child process per configuration.
"""

import gzip
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TOWERS = 2
STEPS = 2
#: configuration -> (TF behaviour, environment of the process that writes it).
CONFIGS = {
    'v2-compiled': ('v2', {}),
    'v2-stock': ('v2', {'TF1_SYNCBN_KERNELS': '0', 'TF_ENABLE_ONEDNN_OPTS': '0'}),
    'v1-compiled': ('v1', {}),
    'v1-stock': ('v1', {'TF1_SYNCBN_KERNELS': '0', 'TF_ENABLE_ONEDNN_OPTS': '0'}),
}


def batch(step, towers=TOWERS):
    """The inputs of step ``step`` (the same in every process)."""
    import numpy as np
    rng = np.random.RandomState(100 + step)
    return (rng.randn(2 * towers, 5, 5, 3).astype(np.float32) * 2 + 1,
            rng.randint(0, 4, 2 * towers).astype(np.int32))


def build_model(towers=TOWERS):
    """The model and its training step, in the default graph (see the module docstring).

    Also the model ``tests/core/test_resume_meta_graph.py`` saves and resumes:
    what the checkpoints here hold is what this builds with ``towers=TOWERS``.

    Returns:
      ``(images, labels, loss, train_op)``: the placeholders of :func:`batch`'s
      arrays, the mean loss of the towers and the train op (also in the
      collections ``'loss'`` and ``'train_op'``).
    """
    import tensorflow as tf
    import tf_slim as slim

    import tf1_syncbn
    from tower import call_for_each_tower, get_current_tower_context
    tf1 = tf.compat.v1

    tf1.set_random_seed(0)
    images = tf1.placeholder(tf.float32, [2 * towers, 5, 5, 3], name='images')
    labels = tf1.placeholder(tf.int32, [2 * towers], name='labels')
    is_training = tf1.placeholder_with_default(True, [], name='is_training')
    image_parts, label_parts = tf.split(images, towers), tf.split(labels, towers)

    def tower():
        i = get_current_tower_context().index
        net = slim.conv2d(image_parts[i], 4, [3, 3], normalizer_fn=tf1_syncbn.sync_batch_norm,
                          normalizer_params={'is_training': is_training,
                                             'sync_statistics': 'auto'}, scope='conv')
        net = tf1_syncbn.BatchNorm('bn', net, training=True, sync_statistics='auto')
        net = tf1_syncbn.layers.batch_normalization(net, training=True, name='tfl_bn')
        logits = slim.fully_connected(tf.reduce_mean(net, [1, 2]), 4, activation_fn=None,
                                      scope='logits')
        return tf1.losses.sparse_softmax_cross_entropy(label_parts[i], logits,
                                                       loss_collection=None)

    losses = call_for_each_tower(tower, ['/cpu:%d' % i for i in range(towers)])
    loss = tf.add_n(losses) / towers
    step = tf1.train.get_or_create_global_step()
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
    tf1.add_to_collection('train_op', train_op)
    tf1.add_to_collection('loss', loss)
    return images, labels, loss, train_op


def _write(directory, behavior):
    import numpy as np
    import tensorflow as tf
    if behavior == 'v1':
        tf.compat.v1.disable_v2_behavior()
    else:
        tf.compat.v1.disable_eager_execution()

    import tf1_syncbn
    from tower import virtual_cpu_config
    tf1 = tf.compat.v1

    graph = tf.Graph()
    with graph.as_default():
        images, labels, loss, train_op = build_model()
        saver = tf1.train.Saver()
        with tf1.Session(config=virtual_cpu_config(TOWERS)) as sess:
            sess.run(tf1.global_variables_initializer())
            for s in range(STEPS):
                x, y = batch(s)
                sess.run(train_op, {images: x, labels: y})
            os.makedirs(directory, exist_ok=True)
            prefix = os.path.join(directory, 'model.ckpt')
            saver.save(sess, prefix, write_state=False)
            with open(prefix + '.meta', 'rb') as f:
                meta = f.read()
            with open(prefix + '.meta.gz', 'wb') as f:
                f.write(gzip.compress(meta, 9, mtime=0))
            os.remove(prefix + '.meta')
            x, y = batch(STEPS)
            value = sess.run([loss, train_op], {images: x, labels: y})[0]
            # In a run of its own: in TF1 behaviour a variable fetched with its
            # update may alias the buffer the update writes.
            variables = tf1.global_variables()
            values = sess.run(variables)
        types = sorted({op.type for op in graph.get_operations()})
    expected = {
        'written_by': {'tensorflow': tf.__version__, 'tf1_syncbn': tf1_syncbn.__version__,
                       'behavior': behavior,
                       'kernels': os.environ.get('TF1_SYNCBN_KERNELS', '1')},
        'towers': TOWERS, 'step': STEPS, 'loss': float(value),
        'variables': {v.op.name: np.asarray(x).tolist() for v, x in zip(variables, values)},
        'library_op_types': [t for t in types if t.startswith('SyncBn')],
    }
    with open(os.path.join(directory, 'expected.json'), 'w') as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write('\n')


def main(argv):
    out = os.path.abspath(argv[0]) if argv else HERE
    for config, (behavior, env) in sorted(CONFIGS.items()):
        environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', **env)
        environ['PYTHONPATH'] = os.pathsep.join(
            [ROOT] + [p for p in environ.get('PYTHONPATH', '').split(os.pathsep) if p])
        subprocess.run([sys.executable, os.path.abspath(__file__), '--child',
                        os.path.join(out, config), behavior], env=environ, check=True)
        print('wrote', os.path.join(out, config))


if __name__ == '__main__':
    if sys.argv[1:2] == ['--child']:
        _write(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1:])

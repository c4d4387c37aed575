"""The unchanged scripts' own utility module: arguments, data, a tower loop, the training loop.

What a user keeps in a ``utils.py`` beside the training script: nothing of it
shows a style but :func:`tower_gradients`, ``cifar10_multi_gpu_train.py``'s
tower loop, which three of the scripts share. Each script keeps the rest of
what does (its model, a tower or clone loop of another kind, the update ops
it keeps, how it combines the towers' gradients), so that it reads as the
user's script it stands for.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1
#: The global batch's rows, and the training steps.
BATCH, STEPS = 8, 2


def arguments():
    """``(TOWERS, OUT)`` of ``script.py TOWERS OUT.npz``.

    ``{worker}`` in ``OUT`` becomes the worker's index in ``TF_CONFIG`` (runs
    under the launcher).
    """
    task = json.loads(os.environ.get('TF_CONFIG') or '{}').get('task', {})
    return int(sys.argv[1]), sys.argv[2].replace('{worker}', str(task.get('index', 0)))


def data(seed):
    """``(DATA, W)``: ``STEPS`` global batches of ``BATCH`` rows of 5 features, a 5x4 weight."""
    rng = np.random.RandomState(seed)
    batches = (rng.randn(STEPS, BATCH, 5) * 2 + 1).astype(np.float32)
    return batches, rng.randn(5, 4).astype(np.float32)


def tower_gradients(images, towers, opt, tower_loss):
    """``cifar10_multi_gpu_train.py``'s tower loop: tower ``i`` on ``/cpu:i`` in ``tower_i``.

    ``images`` is split into ``towers`` parts; the towers share their
    variables (reused after the first tower's).

    Args:
      images: the global batch.
      towers: the number of towers.
      opt: the optimizer whose ``compute_gradients`` each tower's loss gets.
      tower_loss: a tower's loss from its part of ``images``.

    Returns:
      ``(tower_grads, updates)``: each tower's ``(gradient, variable)``
      pairs, and the ``UPDATE_OPS`` of the last tower's name scope (what that
      script keeps).
    """
    tower_grads = []
    with tf1.variable_scope(tf1.get_variable_scope()):
        for i, x in enumerate(tf.split(images, towers)):
            with tf.device('/cpu:%d' % i), tf1.name_scope('tower_%d' % i) as scope:
                loss = tower_loss(x)
                tf1.get_variable_scope().reuse_variables()
                updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope)
                tower_grads.append(opt.compute_gradients(loss))
    return tower_grads, updates


def train_and_save(train_op, images, batches, towers, out, variables=None):
    """One run of ``train_op`` per batch on ``towers`` virtual CPUs, then the variables to ``out``.

    Args:
      train_op: what a training step runs.
      images: the placeholder each batch feeds.
      batches: the global batches, one per step.
      towers: the number of virtual CPUs (``/cpu:0`` ...).
      out: the ``.npz`` file ``variables`` (default: every global variable)
        are written to, by name.
    """
    config = tf1.ConfigProto(device_count={'CPU': towers}, allow_soft_placement=True)
    with tf1.Session(config=config) as sess:
        sess.run(tf1.global_variables_initializer())
        for step, batch in enumerate(batches):
            sess.run(train_op, {images: batch})
            print('step %d done' % (step + 1), flush=True)
        variables = tf1.global_variables() if variables is None else variables
        np.savez(out, **{v.op.name: sess.run(v) for v in variables})

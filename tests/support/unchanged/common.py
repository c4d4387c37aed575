"""The unchanged scripts' own utility module: their arguments, data and training loop.

What a user keeps in a ``utils.py`` beside the training script: nothing of it
shows a style. Each script keeps what does (its model, its tower or clone
loop, the update ops it keeps, how it combines the towers' gradients), so
that it reads as the user's script it stands for.
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

"""A tensorpack script: a ``ModelDesc`` with tensorpack's ``BatchNorm`` (its default
``sync_statistics=None``: per-tower statistics), trained by ``SyncMultiGPUTrainerReplicated``
(``SimpleTrainer`` on one tower). Needs legacy Keras (tensorpack 0.11 on TensorFlow 2.16+).
Unchanged under ``python -m tf1_syncbn.run`` (tests/run/test_run_scripts.py).

The one line that is not tensorpack's: its trainers put tower k on ``/gpu:k``; this machine has
none, so ``tensorpack_devices.towers_on_virtual_cpus()`` puts it on ``/cpu:k``.

Usage: ``python tensorpack_trainer.py TOWERS OUT.npz`` (each step's global batch split into TOWERS).
"""

import os
import tempfile

import numpy as np
import tensorflow as tf
from tensorpack import *  # noqa: F401,F403 - as tensorpack scripts are written
from tensorpack import (BatchData, BatchNorm, DataFromList, FullyConnected, ModelDesc,
                        ModelSaver, SimpleTrainer, SyncMultiGPUTrainerReplicated, TrainConfig,
                        launch_train_with_config)

import tf_behavior
from tensorpack_devices import towers_on_virtual_cpus
from unchanged.common import BATCH, STEPS, arguments, data

tf_behavior.apply()
towers_on_virtual_cpus()
tf1 = tf.compat.v1
TOWERS, OUT = arguments()
DATA, W = data(seed=3)


class Model(ModelDesc):
    def inputs(self):
        return [tf.TensorSpec((None, 5), tf.float32, 'x')]

    def build_graph(self, x):
        h = FullyConnected('fc', x, 4, use_bias=False, activation=tf.identity,
                           kernel_initializer=tf1.constant_initializer(W))
        h = BatchNorm('bn', h, momentum=0.5)
        return tf.reduce_mean(tf.square(tf.nn.relu(h) - 0.3), name='cost')

    def optimizer(self):
        return tf1.train.GradientDescentOptimizer(0.5)


checkpoints = tempfile.mkdtemp()
config = TrainConfig(
    model=Model(),
    dataflow=BatchData(DataFromList([[row] for batch in DATA for row in batch], shuffle=False),
                       BATCH // TOWERS),
    callbacks=[ModelSaver(checkpoint_dir=checkpoints)], monitors=[],
    # More inter-op threads than towers: tensorpack's StagingInput blocks one per tower.
    session_config=tf1.ConfigProto(device_count={'CPU': TOWERS}, allow_soft_placement=True,
                                   inter_op_parallelism_threads=2 * TOWERS + 2,
                                   use_per_session_threads=True),
    steps_per_epoch=STEPS, max_epoch=1)
launch_train_with_config(config, SyncMultiGPUTrainerReplicated(TOWERS) if TOWERS > 1
                         else SimpleTrainer())
reader = tf1.train.load_checkpoint(tf1.train.latest_checkpoint(checkpoints))
np.savez(OUT, **{name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
                 if not name.startswith(('global_step', 'tower'))})
print('trained %d steps' % STEPS, flush=True)
os.environ.get('KEEP_CHECKPOINTS') or __import__('shutil').rmtree(checkpoints, True)

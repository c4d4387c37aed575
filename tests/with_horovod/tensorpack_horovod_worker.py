"""tensorpack 0.11's own ``HorovodTrainer`` with this library's BatchNorm: one process of the job.

    TF_USE_LEGACY_KERAS=1 horovodrun -np 2 -H localhost:2 --gloo \\
        python tensorpack_horovod_worker.py OUT_DIR CONFIG_JSON

Reuses ``tests/support/for_tensorpack/tensorpack_harness.py`` (its model, data, loss recorder and
result files; importing it reads ``OUT_DIR`` and ``CONFIG_JSON`` from argv).
Each process trains on its own half of every global batch (tensorpack's
Horovod convention: one tower per process, each with its own input), with:

* ``horovod``: ``tf1_syncbn.BatchNorm(..., sync_statistics='horovod')``;
* ``horovod-nchw``: the same on a channels_first tensor;
* ``patched``: the argscope/LinearWrap model that calls tensorpack's
  ``BatchNorm`` by name, under ``tf1_syncbn.patch_tensorpack(sync_statistics='horovod')``;
* ``unsynced``: tensorpack's own ``BatchNorm`` (per-process statistics), the
  control that must differ from one device;

then process 0 trains the reference, tensorpack's ``BatchNorm`` under
``SimpleTrainer`` on the whole batch. One override of tensorpack, for
TensorFlow 2: see ``_horovod_trainer_on_tf2``. Writes ``OUT_DIR/rank<r>/result.npz``
and ``result.json`` (every process's losses; process 0 the checkpoints'
variables).
"""

import json
import os
import sys

from legacy_reference import SHIM

exec(SHIM)  # noqa: S102 - tensorpack 0.11 on TF 2.21 needs legacy Keras (TF_USE_LEGACY_KERAS=1)

import tf_behavior  # noqa: E402

tf_behavior.apply()

import horovod.tensorflow as hvd  # noqa: E402

OUT = sys.argv[1]
CONFIG = json.loads(sys.argv[2])
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
RANK_OUT = os.path.join(OUT, 'rank%d' % RANK)
os.makedirs(RANK_OUT, exist_ok=True)
sys.argv = [sys.argv[0], RANK_OUT, json.dumps(CONFIG)]   # what tensorpack_harness reads

import tensorflow as tf  # noqa: E402
from tensorpack import (BatchNorm, DataFromList, HorovodTrainer, ModelSaver,  # noqa: E402
                        SimpleTrainer, TrainConfig, launch_train_with_config)

import tensorpack_harness as harness  # noqa: E402
import tf1_syncbn  # noqa: E402

tf1 = tf.compat.v1


def _horovod_trainer_on_tf2():
    """The one override of tensorpack: its trainers module reads TensorFlow 1's names.

    tensorpack 0.11's ``HorovodTrainer.initialize`` calls ``tf.global_variables()``,
    which TensorFlow 2 has only as ``tf.compat.v1.global_variables`` (an
    ``AttributeError`` at the first ``launch_train_with_config``). The module
    ``tensorpack.train.trainers`` gets ``tf.compat.v1`` as its ``tf``: every
    other name it uses (``name_scope``, ``train.Server``,
    ``config.experimental.list_physical_devices``) is there too.
    """
    import tensorpack.train.trainers as trainers  # noqa: PLC0415
    trainers.tf = tf1


_horovod_trainer_on_tf2()


class _AfterEveryGradient(tf1.train.GradientDescentOptimizer):
    """The models' SGD, its updates run after every gradient of the step is computed.

    As ``parity_harness.train_case`` does: in TF1 behaviour a read of a
    reference variable aliases it, and tensorpack's own layer reads gamma
    again in its backward pass, so an update of gamma that runs first changes
    its input gradient (measured: the reference's losses differed from the
    same run in TF2 behaviour by 2e-3 from step 1; this library copies its
    reads). Every run of this module uses it.
    """

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        grads_and_vars = list(grads_and_vars)
        with tf.control_dependencies([g for g, _ in grads_and_vars if g is not None]):
            return super(_AfterEveryGradient, self).apply_gradients(grads_and_vars,
                                                                    global_step, name)


def _after_every_gradient(model):
    """``model`` (a harness model) with its optimizer's updates after every gradient."""
    learning_rate = model.optimizer()._learning_rate  # noqa: SLF001 - the harness's rate
    model.optimizer = lambda: _AfterEveryGradient(learning_rate)
    return model


def horovod_bn(name, x, data_format='channels_last'):
    return tf1_syncbn.BatchNorm(name, x, momentum=harness.MOMENTUM, sync_statistics='horovod',
                                data_format=data_format)


def rows(step, rank, size):
    """This process's rows of global batch ``step`` (an even share, in order)."""
    share = harness.GLOBAL_BATCH // size
    start = step * harness.GLOBAL_BATCH + rank * share
    return slice(start, start + share)


def train(name, model, trainer, rank, size):
    """``harness.train``, each process fed its own rows of every global batch."""
    batches = [[harness.IMAGES[rows(s, rank, size)], harness.LABELS[rows(s, rank, size)]]
               for s in range(harness.STEPS)]
    model = _after_every_gradient(model)
    ckpt_dir = os.path.join(OUT, name)
    sink = {}
    with tf.Graph().as_default():
        config = TrainConfig(
            model=model, dataflow=DataFromList(batches, shuffle=False),
            callbacks=[harness.RecordLosses(sink).set_chief_only(False),
                       ModelSaver(checkpoint_dir=ckpt_dir)], monitors=[],
            steps_per_epoch=harness.STEPS, max_epoch=1)
        launch_train_with_config(config, trainer)
    variables = {}
    if rank == 0:   # (ModelSaver runs on the chief only)
        reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(ckpt_dir))
        variables = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    return sink, variables


def main():
    results, info = {}, {'rank': RANK, 'size': SIZE}

    def keep(name, build):
        harness.keep_run(results, info, name, build)

    keep('horovod', lambda: train('horovod', harness.Model(horovod_bn), HorovodTrainer(),
                                  RANK, SIZE))
    keep('horovod-nchw', lambda: train('horovod-nchw',
                                       harness.Model(horovod_bn, 'channels_first'),
                                       HorovodTrainer(), RANK, SIZE))
    with tf1_syncbn.patch_tensorpack(sync_statistics='horovod'):
        keep('patched', lambda: train('patched', harness.LinearWrapModel(), HorovodTrainer(),
                                      RANK, SIZE))
    info['restored'] = 'tf1_syncbn' not in BatchNorm.__module__
    keep('unsynced', lambda: train('unsynced', harness.Model(harness.tensorpack_bn),
                                   HorovodTrainer(), RANK, SIZE))
    if RANK == 0:
        keep('reference', lambda: train('reference', harness.Model(harness.tensorpack_bn),
                                        SimpleTrainer(), 0, 1))
    harness.save(results, info)


if __name__ == '__main__':
    main()

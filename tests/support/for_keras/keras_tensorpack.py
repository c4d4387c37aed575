"""tensorpack 0.11's own trainers on a ``tf_keras.applications`` model (Keras 2 in a ModelDesc).

Run by ``tests/keras/test_keras_models.py`` through ``legacy_reference.run_reference``
(a fresh interpreter with legacy Keras, which tensorpack 0.11 needs on TF 2.21),
in the TF behaviour of the test run:

    python keras_tensorpack.py OUT_DIR '{"towers": [2], "steps": 3, "shape": [32, 32, 3], ...}' \
        [REFERENCE.npz]

The model is ``keras_app_case``'s application (MobileNet), written as a
tensorpack ``ModelDesc`` holding a Keras model: built in the first tower on
its own ``keras.Input``, called in every tower with ``training=
ctx.is_training`` (tensorpack's tower context), each tower's
``model.get_updates_for(image)`` put into ``UPDATE_OPS`` (tensorpack's
``RunUpdateOps`` runs them), its weights set from ``keras_app_case``'s
seeded values by a tensorpack ``SessionInit``. The training loop and
checkpoint reading are ``tensorpack_harness.py``'s (imported, so that its
one override of tensorpack, towers on ``/cpu:<k>``, applies), the data
``keras_app_case``'s: step ``s`` trains on the rows of its global batch
``s`` (the towers get halves of it, in whatever order tensorpack's queue
hands them out), so that the runs compare with ``keras_app_case.train``'s
one-device reference. Runs:

* ``ps<N>``: after ``tf1_syncbn.keras.patch_keras()``, under
  ``SyncMultiGPUTrainerParameterServer`` on N virtual CPUs (the layers find
  tensorpack's towers themselves);
* ``per-tower<N>``: the control, tf-keras' own layer under the same trainer.

With ``REFERENCE.npz``, first (before anything is patched) the one-device
reference of ``test_keras_models.py``: ``keras_app_case.train`` with
tf-keras' own layers on the whole global batch, saved there (the test then
needs no interpreter of its own for it).

Writes ``OUT_DIR/result.npz`` (``losses/<run>``, ``var/<run>/<name>``) and
``OUT_DIR/result.json`` (per run: what ``tensorpack_harness.RecordLosses``
counted, the layer class, or the error).
"""

import sys

import tf_behavior

tf_behavior.apply()

OUT = sys.argv[1]
REFERENCE = sys.argv[3] if len(sys.argv) > 3 else None
# tensorpack_harness reads its output directory and configuration at import.
sys.argv = [sys.argv[0], OUT, sys.argv[2]]
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorpack_harness as harness  # noqa: E402
from tensorpack import ModelDesc, SyncMultiGPUTrainerParameterServer  # noqa: E402
from tensorpack.tfutils.sessinit import SessionInit  # noqa: E402
from tensorpack.tfutils.tower import get_current_tower_context  # noqa: E402

import keras_app_case as app  # noqa: E402
import tf1_syncbn.keras  # noqa: E402

tf1 = tf.compat.v1


class KerasAppModel(ModelDesc):
    """The application in a ModelDesc: one Keras model, called by every tower."""

    def __init__(self, sink):
        self._sink = sink
        self.model = None

    def inputs(self):
        return [tf.TensorSpec((None,) + harness.SHAPE, tf.float32, 'input'),
                tf.TensorSpec((None,), tf.int32, 'label')]

    def build_graph(self, image, label):
        ctx = get_current_tower_context()
        if self.model is None:
            self.model = app.build_model()
            self._sink['layer_classes'] = sorted({
                '%s.%s' % (type(layer).__module__, type(layer).__name__)
                for layer in self.model.layers if 'BatchNormalization' in type(layer).__name__})
        logits = self.model(image, training=ctx.is_training)
        for update in self.model.get_updates_for(image):
            tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
        return harness._cost(logits, label)  # noqa: SLF001 - the harness's named cost

    def optimizer(self):
        return tf1.train.GradientDescentOptimizer(app.LEARNING_RATE)


class InitialWeights(SessionInit):
    """Sets the model's weights to ``keras_app_case.initial_values`` after initialization."""

    def __init__(self, desc):
        self._desc = desc

    def _setup_graph(self):
        model = self._desc.model
        self._assign = [w.assign(v) for w, v in zip(model.weights, app.initial_values(model))]

    def _run_init(self, sess):
        sess.run(self._assign)


def main():
    results, info = {}, {}
    data = app.case_data(harness.GLOBAL_BATCH)
    harness.IMAGES = np.concatenate([data['x/%d' % s] for s in range(harness.STEPS)])
    harness.LABELS = np.concatenate([data['y/%d' % s] for s in range(harness.STEPS)])

    def keep(name, trainer, towers):
        sink = {}
        desc = KerasAppModel(sink)

        def build():
            out, variables = harness.train(name, desc, trainer, towers,
                                           session_init=InitialWeights(desc))
            out.update(sink)
            return out, variables
        harness.keep_run(results, info, name, build)

    if REFERENCE:
        import tf_keras  # noqa: PLC0415
        assert tf_keras.layers.BatchNormalization.__module__.startswith('tf_keras.')
        np.savez(REFERENCE, **app.train([harness.GLOBAL_BATCH], 'one'))
    n = harness.CONFIG['towers'][0]
    with tf1_syncbn.keras.patch_keras():
        keep('ps%d' % n, SyncMultiGPUTrainerParameterServer(n), n)
    keep('per-tower%d' % n, SyncMultiGPUTrainerParameterServer(n), n)
    harness.save(results, info)


if __name__ == '__main__':
    main()

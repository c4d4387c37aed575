"""tensorpack 0.11's own trainers on a model written with tf.layers' batch normalization.

Run by ``tests/layers/test_layers_harness.py`` through ``legacy_reference.run_reference``
(a fresh interpreter with legacy Keras, which tensorpack 0.11 needs on TF 2.21,
and where ``tf.compat.v1.layers`` is tf-keras' legacy layer):

    python tensorpack_tf_layers.py OUT_DIR '{"towers": [2], "steps": 3, ...}'

The model and the training loop are ``tensorpack_harness.py``'s (imported, so
that its one override of tensorpack, towers on ``/cpu:<k>``, applies), with
batch norm written as tensorpack users write tf.layers code:
``tf.compat.v1.layers.batch_normalization(x, training=ctx.is_training, ...)``
with ``ctx`` tensorpack's tower context. Runs:

* ``reference``: tf.layers itself under ``SimpleTrainer``, one tower on the
  whole batch;
* ``ps<N>``, ``replicated<N>``: the same model under
  ``tf1_syncbn.patch_tf_layers()`` (the layer finds tensorpack's towers
  itself) with ``SyncMultiGPUTrainerParameterServer`` and
  ``SyncMultiGPUTrainerReplicated`` on N virtual CPUs. tensorpack's
  ``RunUpdateOps`` runs every tower's ``UPDATE_OPS``;
* ``per-tower<N>``: the control, ``patch_tf_layers(sync_statistics=None)``
  under the parameter-server trainer: per-tower statistics, which must not
  pass for the reference.

Writes ``OUT_DIR/result.npz`` (losses per step and the checkpoint's
variables, keyed ``losses/<run>`` and ``var/<run>/<name>``) and
``OUT_DIR/result.json`` (per run: what ``tensorpack_harness.RecordLosses``
counted, or the error).
"""

import sys

import tensorflow as tf

OUT = sys.argv[1]
# tensorpack_harness reads its output directory and configuration at import.
sys.argv = [sys.argv[0], OUT, sys.argv[2]]
import tensorpack_harness as harness  # noqa: E402
from tensorpack import (SimpleTrainer, SyncMultiGPUTrainerParameterServer,  # noqa: E402
                        SyncMultiGPUTrainerReplicated)
from tensorpack.tfutils.tower import get_current_tower_context  # noqa: E402

import tf1_syncbn  # noqa: E402

tf1 = tf.compat.v1


def tf_layers_bn(name, x, data_format='channels_last'):
    """Batch norm as tf.layers code in a tensorpack model calls it (looked up at call time)."""
    del data_format
    return tf1.layers.batch_normalization(x, momentum=harness.MOMENTUM, name=name,
                                          training=get_current_tower_context().is_training)


def main():
    results, info = {}, {}

    def keep(name, trainer, towers):
        harness.keep_run(results, info, name, lambda: harness.train(
            name, harness.Model(tf_layers_bn), trainer, towers))

    assert tf1.layers.batch_normalization.__module__.startswith('tf_keras')
    keep('reference', SimpleTrainer(), 1)
    with tf1_syncbn.patch_tf_layers():
        for n in harness.CONFIG['towers']:
            keep('ps%d' % n, SyncMultiGPUTrainerParameterServer(n), n)
            keep('replicated%d' % n, SyncMultiGPUTrainerReplicated(n, mode='cpu'), n)
    with tf1_syncbn.patch_tf_layers(sync_statistics=None):
        n = harness.CONFIG['towers'][0]
        keep('per-tower%d' % n, SyncMultiGPUTrainerParameterServer(n), n)
    harness.save(results, info)


if __name__ == '__main__':
    main()

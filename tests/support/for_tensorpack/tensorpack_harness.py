"""tensorpack 0.11's own trainers and predictor, with tf1_syncbn's layers plugged in.

Run by ``tests/tensorpack/test_tensorpack_trainers.py`` through ``legacy_reference.run_reference``
(a fresh interpreter with legacy Keras, which tensorpack 0.11 needs on TF 2.21):

    python tensorpack_harness.py OUT_DIR '{"towers": [2, 4], ...}'

It trains the same small conv net (Conv2D -> BatchNorm -> relu -> pooling ->
FullyConnected) for a few SGD steps with:

* ``reference``: tensorpack's own ``BatchNorm`` under ``SimpleTrainer``: one
  tower on the whole (concatenated) batch;
* ``ps<N>``: ``tf1_syncbn.BatchNorm(..., sync_statistics='collective')`` under
  tensorpack's ``SyncMultiGPUTrainerParameterServer`` on N towers;
* ``replicated<N>``: the same under ``SyncMultiGPUTrainerReplicated`` (each
  tower owns ``tower<k>/`` variables, tensorpack syncs them itself);
* ``patched<N>``: a model written with ``argscope`` and ``LinearWrap`` that
  calls tensorpack's ``BatchNorm`` by name, switched to tf1_syncbn's by
  ``tf1_syncbn.patch_tensorpack()`` and nothing else, under the PS trainer;

each for every layout in ``CONFIG['data_formats']`` (``channels_last``, and
``channels_first``, run names ending in ``-nchw``: the layer on a transposed
NCHW tensor, since CPU convolutions are NHWC only), and for every kernel set
in ``CONFIG['kernel_sets']`` (``custom``: the compiled CPU kernels; ``stock``:
TensorFlow's, run names ending in ``@stock``; switched in-process with
``tf1_syncbn.kernels.use_custom_kernels``; oneDNN follows the environment's
``TF_ENABLE_ONEDNN_OPTS``); or only the runs of ``CONFIG['runs']``
(``[kind, towers, data format, kernel set]`` each), with the reference for
each layout they use. Each run records how many compiled-kernel ops its
graph has. Then it scores a held-out batch twice with tensorpack's
``OfflinePredictor`` on the first ``ps<N>`` checkpoint (channels-last where
there is one). Everything tensorpack
does is tensorpack's own code, with one override, documented at
``_towers_on_virtual_cpus``. It writes
``OUT_DIR/result.npz`` (losses, checkpoint variables, predictor outputs) and
``OUT_DIR/result.json`` (op counts, layer types).
"""

import faulthandler
import json
import os
import sys

import numpy as np
import tensorflow as tf
from tensorpack import *  # noqa: F401,F403 - as tensorpack scripts are written
from tensorpack import (BatchData, BatchNorm, Callback, Conv2D, DataFromList, FullyConnected,
                        GlobalAvgPooling, LinearWrap, ModelDesc, ModelSaver, OfflinePredictor,
                        PredictConfig, SimpleTrainer, SmartInit,
                        SyncMultiGPUTrainerParameterServer, SyncMultiGPUTrainerReplicated,
                        TrainConfig, argscope, launch_train_with_config)

import tf1_syncbn
from tf1_syncbn import kernels as tf1_syncbn_kernels
from tower import virtual_cpu_config
from without_onednn import error_summary

tf1 = tf.compat.v1
OUT = sys.argv[1]
CONFIG = json.loads(sys.argv[2])
# A run that hangs (a deadlock no collective timeout covers, such as one in
# tensorpack's input pipeline) prints every thread's stack and exits, so that
# the test fails saying where, instead of waiting for the subprocess timeout.
faulthandler.dump_traceback_later(CONFIG.get('hang_seconds', 240), exit=True)
STEPS = CONFIG['steps']
GLOBAL_BATCH = CONFIG['global_batch']
DATA_FORMATS = CONFIG.get('data_formats', ['channels_last'])
KERNEL_SETS = CONFIG.get('kernel_sets', ['custom'])
SUFFIX = {'channels_last': '', 'channels_first': '-nchw', 'custom': '', 'stock': '@stock'}
KERNEL_OPS = ('SyncBnMoments', 'SyncBnNormalize', 'SyncBnGradSums', 'SyncBnGradInput')
MOMENTUM = 0.8
SHAPE = tuple(CONFIG.get('shape', (6, 6, 3)))
CLASSES = 4


def _towers_on_virtual_cpus():
    """tensorpack's trainers put tower k on '/gpu:k': on '/cpu:k' here (no GPU)."""
    from tensorpack_devices import towers_on_virtual_cpus  # noqa: PLC0415
    towers_on_virtual_cpus()


_towers_on_virtual_cpus()

rng = np.random.RandomState(0)
IMAGES = (rng.randn(STEPS * GLOBAL_BATCH + 8, *SHAPE) * 2 + 1).astype(np.float32)
LABELS = rng.randint(0, CLASSES, size=len(IMAGES)).astype(np.int32)
W_CONV = (rng.randn(3, 3, SHAPE[-1], 8) * 0.3).astype(np.float32)
W_FC = (rng.randn(8, CLASSES) * 0.3).astype(np.float32)


def tensorpack_bn(name, x, data_format='channels_last'):
    return BatchNorm(name, x, momentum=MOMENTUM, data_format=data_format)


def synced_bn(name, x, data_format='channels_last'):
    return tf1_syncbn.BatchNorm(name, x, momentum=MOMENTUM, sync_statistics='collective',
                                data_format=data_format)


def _to_nchw(x):
    return tf.transpose(x, [0, 3, 1, 2])


def _to_nhwc(x):
    return tf.transpose(x, [0, 2, 3, 1])


class Model(ModelDesc):
    """A conv net written with explicit layer calls; ``bn`` is the batch norm."""

    def __init__(self, bn, data_format='channels_last'):
        self._bn = bn
        self._data_format = data_format

    def _normalize(self, x):
        if self._data_format == 'channels_first':
            return _to_nhwc(self._bn('bn', _to_nchw(x), data_format='channels_first'))
        return self._bn('bn', x)

    def inputs(self):
        return [tf.TensorSpec((None,) + SHAPE, tf.float32, 'input'),
                tf.TensorSpec((None,), tf.int32, 'label')]

    def build_graph(self, image, label):
        x = Conv2D('conv', image, 8, 3, activation=tf.identity, use_bias=False,
                   kernel_initializer=tf1.constant_initializer(W_CONV))
        x = tf.nn.relu(self._normalize(x))
        x = GlobalAvgPooling('gap', x)
        logits = FullyConnected('fc', x, CLASSES, kernel_initializer=tf1.constant_initializer(W_FC))
        return _cost(logits, label)

    def optimizer(self):
        return tf1.train.GradientDescentOptimizer(0.5)


class LinearWrapModel(Model):
    """The same net as tensorpack's examples write it: argscope + LinearWrap, BatchNorm by name."""

    def __init__(self, data_format='channels_last'):
        super(LinearWrapModel, self).__init__(None, data_format)

    def build_graph(self, image, label):
        first = self._data_format == 'channels_first'
        with argscope(BatchNorm, momentum=MOMENTUM, data_format=self._data_format), \
                argscope(Conv2D, data_format='channels_last'):
            logits = (LinearWrap(image)
                      .Conv2D('conv', 8, 3, activation=tf.identity, use_bias=False,
                              kernel_initializer=tf1.constant_initializer(W_CONV))
                      .apply(_to_nchw if first else tf.identity)
                      .BatchNorm('bn')
                      .apply(_to_nhwc if first else tf.identity)
                      .tf.nn.relu()
                      .GlobalAvgPooling('gap')
                      .FullyConnected('fc', CLASSES,
                                      kernel_initializer=tf1.constant_initializer(W_FC))())
        return _cost(logits, label)


def _cost(logits, label):
    cost = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=label,
                                                                         logits=logits))
    return tf.identity(cost, name='cost')


class RecordLosses(Callback):
    """Fetches every tower's cost in each training step (the step's loss is their mean)."""

    def __init__(self, sink):
        self._sink = sink

    def _setup_graph(self):
        graph = tf1.get_default_graph()
        self._costs = [op.outputs[0] for op in graph.get_operations()
                       if op.type == 'Identity' and op.name.split('/')[-1] == 'cost']
        self._sink['towers_with_cost'] = len(self._costs)
        self._sink['collectives'] = sum(1 for op in graph.get_operations()
                                        if op.type == 'CollectiveReduce')
        self._sink['kernel_ops'] = sum(1 for op in graph.get_operations()
                                       if op.type in KERNEL_OPS)
        self._sink['tower_bn_variables'] = sorted(
            v.op.name for v in tf1.global_variables() + tf1.local_variables()
            if v.op.name.startswith('tower') and '/bn/' in v.op.name)

    def _before_run(self, _):
        return tf1.train.SessionRunArgs(fetches=self._costs)

    def _after_run(self, _, run_values):
        self._sink.setdefault('losses', []).append(float(np.mean(run_values.results)))


def _session_config(towers):
    """N virtual CPUs, and a pool of more inter-op threads than towers, per session.

    tensorpack's ``StagingInput`` (used by its multi-GPU trainers) puts each
    tower's next batch into a staging area of capacity 1; a put blocks its
    inter-op thread until the tower's get has run. With too few threads, the
    blocked puts stall every other op, including the gets: a deadlock of
    tensorpack on CPU towers, unrelated to batch norm, that happens when the
    puts are scheduled before the gets. The pool must be the session's own:
    TensorFlow's process-wide pool is sized by the *first* session of the
    process (here a one-tower run), whatever later sessions ask for.
    """
    return virtual_cpu_config(towers, allow_soft_placement=True,
                              inter_op_parallelism_threads=2 * towers + 2,
                              use_per_session_threads=True)


def train(name, model, trainer, towers, session_init=None):
    batch = GLOBAL_BATCH // towers
    data = DataFromList([[IMAGES[i], LABELS[i]] for i in range(STEPS * GLOBAL_BATCH)],
                        shuffle=False)
    ckpt_dir = os.path.join(OUT, name)
    sink = {}
    with tf.Graph().as_default():
        config = TrainConfig(
            model=model, dataflow=BatchData(data, batch),
            callbacks=[RecordLosses(sink), ModelSaver(checkpoint_dir=ckpt_dir)], monitors=[],
            session_config=_session_config(towers), session_init=session_init,
            steps_per_epoch=STEPS, max_epoch=1)
        launch_train_with_config(config, trainer)
    path = tf.train.latest_checkpoint(ckpt_dir)
    reader = tf.train.load_checkpoint(path)
    variables = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    sink['checkpoint'] = path
    return sink, variables


def predict(checkpoint):
    """Scores a held-out batch twice with tensorpack's OfflinePredictor."""
    images = IMAGES[-8:]
    predictor = OfflinePredictor(PredictConfig(
        model=Model(synced_bn), session_init=SmartInit(checkpoint),
        input_names=['input'], output_names=['conv/output', 'bn/output']))
    conv1, bn1 = predictor(images)
    conv2, bn2 = predictor(images)
    with predictor.graph.as_default():
        ema = predictor.sess.run([v for name in ('bn/mean/EMA', 'bn/variance/EMA')
                                  for v in tf1.global_variables() if v.op.name == name])
    return dict(conv=conv1, bn=bn1, bn_again=bn2, ema_mean=ema[0], ema_var=ema[1])


def argscope_channels_first():
    """The way tensorpack's own models are written: argscope over Conv2D and our BatchNorm."""
    from tensorpack.tfutils.tower import TrainTowerContext
    with tf.Graph().as_default(), TrainTowerContext(''):
        with argscope([Conv2D, tf1_syncbn.BatchNorm], data_format='channels_first'):
            y = tf1_syncbn.BatchNorm('bn', tf1.placeholder(tf.float32, [None, 5, 4, 4]))
        return {'gamma_shape': y.variables.gamma.shape.as_list(),
                'use_scope': tf1_syncbn.BatchNorm.use_scope}


def keep_run(results, info, name, build):
    """Runs ``build()`` (one training run); a failing run records its error (its test names it)."""
    try:
        sink, variables = build()
    except Exception as e:  # noqa: BLE001 - reported by that run's test
        info[name] = {'error': '%s:\n%s' % (type(e).__name__, error_summary(str(e)))}
        return
    results['losses/' + name] = np.array(sink['losses'])
    for k, v in variables.items():
        results['var/%s/%s' % (name, k)] = v
    info[name] = {k: v for k, v in sink.items() if k != 'losses'}


def save(results, info):
    """Writes ``OUT/result.npz`` and ``OUT/result.json``, and the ``RESULT`` line."""
    np.savez(os.path.join(OUT, 'result.npz'), **results)
    with open(os.path.join(OUT, 'result.json'), 'w') as f:
        json.dump(info, f)
    print('RESULT', os.path.join(OUT, 'result.npz'))


KINDS = ('ps', 'replicated', 'patched')


def run_list():
    """The training runs: ``CONFIG['runs']`` (``[kind, towers, data format, kernel set]``
    each), or every kind for every layout, kernel set and number of towers."""
    if 'runs' in CONFIG:
        return [tuple(run) for run in CONFIG['runs']]
    return [(kind, n, fmt, kernel_set) for fmt in DATA_FORMATS for kernel_set in KERNEL_SETS
            for n in CONFIG['towers'] for kind in KINDS]


def run_name(kind, towers, fmt, kernel_set):
    """``ps2``, ``replicated4-nchw``, ``patched2@stock``, ...: the run's name in the results."""
    return '%s%d%s%s' % (kind, towers, SUFFIX[fmt], SUFFIX[kernel_set])


def main():
    results, info = {}, {'argscope': argscope_channels_first()}

    def keep(name, build):
        keep_run(results, info, name, build)

    info['kernels'] = tf1_syncbn_kernels.status()
    runs = run_list()
    # keep() calls each lambda at once: the loop variables they read are current (B023).
    for fmt in DATA_FORMATS:
        if not any(run[2] == fmt for run in runs):
            continue
        suffix = SUFFIX[fmt]
        keep('reference' + suffix, lambda: train('reference' + suffix,  # noqa: B023
                                                 Model(tensorpack_bn, fmt), SimpleTrainer(), 1))  # noqa: B023
        for kind, n, _, kernel_set in [run for run in runs if run[2] == fmt]:
            name = run_name(kind, n, fmt, kernel_set)
            with tf1_syncbn_kernels.use_custom_kernels(kernel_set == 'custom'):
                if kind == 'ps':
                    keep(name, lambda: train(name, Model(synced_bn, fmt),  # noqa: B023
                                             SyncMultiGPUTrainerParameterServer(n), n))  # noqa: B023
                elif kind == 'replicated':
                    keep(name, lambda: train(name, Model(synced_bn, fmt),  # noqa: B023
                                             SyncMultiGPUTrainerReplicated(n, mode='cpu'), n))  # noqa: B023
                else:
                    with tf1_syncbn.patch_tensorpack(sync_statistics='collective') as patch:
                        info.setdefault('patched_modules', patch.patched_modules)
                        keep(name, lambda: train(name, LinearWrapModel(fmt),  # noqa: B023
                                                 SyncMultiGPUTrainerParameterServer(n), n))  # noqa: B023
    info['restored'] = BatchNorm is sys.modules['tensorpack'].BatchNorm and \
        'tf1_syncbn' not in BatchNorm.__module__
    # The first parameter-server run, channels-last where there is one.
    ps_runs = sorted((run for run in runs if run[0] == 'ps'),
                     key=lambda run: run[2] != 'channels_last')
    info['predicted_run'] = run_name(*ps_runs[0])
    checkpoint = info[info['predicted_run']].get('checkpoint')
    if checkpoint:
        for k, v in predict(checkpoint).items():
            results['predict/' + k] = v
    save(results, info)


if __name__ == '__main__':
    main()

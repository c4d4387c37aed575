"""``tf.estimator`` (TensorFlow 2.15, the last release that has it) with tf.layers code.

An unmodified ``model_fn`` that calls ``tf.compat.v1.layers.batch_normalization``,
under ``tf1_syncbn.patch_tf_layers()``:

* trained by ``Estimator`` with ``RunConfig(train_distribute=MirroredStrategy)``
  over 4 virtual CPUs (each replica gets its own batch from ``input_fn``);
* a ``model_fn`` that builds ``tower_<i>`` towers itself, one per device
  (``patch_tf_layers(num_dev=4)``), in a plain ``Estimator``.

Each equals the same ``model_fn`` with tf.layers' own layer (Keras' legacy
layer, unpatched) trained on one device with the concatenated batch: the
moving statistics, ``gamma`` and ``beta`` after two steps. The same runs
without the patch (per-replica statistics) differ from it, so the comparison
can fail. The loss is the mean over a replica's (tower's) rows; the Estimator
averages the replicas' gradients (it scales each replica's loss by 1/N), the
tower loop averages the towers' losses, so both give the one device's
gradients, whatever the order in which the replicas take their batches.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
import tf1_syncbn
from tower import virtual_cpu_config

pytestmark = pytest.mark.versions

if not hasattr(tf, 'estimator') or not hasattr(tf.estimator, 'Estimator'):
    pytest.skip('tf.estimator exists up to TensorFlow 2.15 (this is %s)' % tf.__version__,
                allow_module_level=True)

tf1 = tf.compat.v1
TOWERS = 4
ROWS = 2                       # per replica and step
STEPS = 2
GLOBAL = TOWERS * ROWS
VARIABLES = ('bn/moving_mean', 'bn/moving_variance', 'bn/gamma', 'bn/beta')


def _data():
    rng = np.random.RandomState(11)
    x = (rng.randn(STEPS * GLOBAL, 3) * 2 + 1).astype(np.float32)
    y = rng.randn(STEPS * GLOBAL, 3).astype(np.float32)
    return x, y


def _input_fn(batch):
    def input_fn():
        x, y = _data()
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    return input_fn


def _net(x, y):
    """The mean over the rows of ``x`` of the squared error."""
    h = tf1.layers.batch_normalization(x, training=True, momentum=0.5, name='bn')
    return tf.reduce_sum(tf.square(h - y)) / tf.cast(tf.shape(x)[0], tf.float32)


def _train_op(loss):
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        return tf1.train.GradientDescentOptimizer(0.5).minimize(
            loss, global_step=tf1.train.get_global_step())


def _model_fn(features, labels, mode):
    loss = _net(features, labels)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_train_op(loss))


def _towers_model_fn(features, labels, mode):
    """Builds one tower per device itself, as multi-GPU TF1 code does in its model_fn."""
    losses = []
    for i, (x, y) in enumerate(zip(tf.split(features, TOWERS), tf.split(labels, TOWERS))):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i), \
                tf1.variable_scope(tf1.get_variable_scope(), reuse=i > 0):
            losses.append(_net(x, y))
    loss = tf.add_n(losses) / float(TOWERS)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_train_op(loss))


def _train(tmp_path, name, model_fn, batch, distribute=False):
    strategy = tf1.distribute.MirroredStrategy(['/cpu:%d' % i for i in range(TOWERS)]) \
        if distribute else None
    config = tf.estimator.RunConfig(session_config=virtual_cpu_config(TOWERS),
                                    train_distribute=strategy, save_summary_steps=None,
                                    log_step_count_steps=None)
    estimator = tf.estimator.Estimator(model_fn, model_dir=str(tmp_path / name), config=config)
    estimator.train(_input_fn(batch), steps=STEPS)
    return {v: estimator.get_variable_value(v) for v in VARIABLES}


@pytest.fixture(scope='module')
def one_device(tmp_path_factory):
    """tf.layers itself (Keras' legacy layer, no patch) on one device, the whole batch."""
    assert not tf1.layers.batch_normalization.__module__.startswith('tf1_syncbn')
    return _train(tmp_path_factory.mktemp('estimator'), 'one_device', _model_fn, GLOBAL)


def _assert_same(ours, ref):
    for name in VARIABLES:
        np.testing.assert_allclose(ours[name], ref[name], rtol=2e-5, atol=2e-6, err_msg=name)


def _differs(ours, ref):
    return any(not np.allclose(ours[v], ref[v], rtol=1e-3, atol=1e-4) for v in VARIABLES)


#: (model_fn, input_fn's batch, distribute, patch_tf_layers' arguments) per case.
CASES = {'mirrored': (_model_fn, ROWS, True, {}),
         'towers': (_towers_model_fn, GLOBAL, False, {'num_dev': TOWERS})}


@pytest.mark.parametrize('case', tf_behavior.pick(CASES, ['mirrored']))
def test_estimator_with_patched_tf_layers_equals_one_device(case, one_device, tmp_path):
    model_fn, batch, distribute, patch = CASES[case]
    control = _train(tmp_path, 'control', model_fn, batch, distribute)   # tf.layers' own layer
    assert _differs(control, one_device), 'the unpatched control equals one device'
    with tf1_syncbn.patch_tf_layers(**patch):
        ours = _train(tmp_path, 'ours', model_fn, batch, distribute)
    _assert_same(ours, one_device)

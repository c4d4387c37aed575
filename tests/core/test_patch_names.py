"""Every patch, on this TensorFlow, by the names users call; and what a patch that cannot do.

A fresh interpreter per Keras setting (what a name resolves to depends on
what was imported before): ``TF_USE_LEGACY_KERAS`` unset (Keras 2.15 on
TensorFlow 2.15, Keras 3 from 2.16) and ``TF_USE_LEGACY_KERAS=1`` (tf-keras).
In each, a ``tower_%d`` loop of ``tf.compat.v1.layers.batch_normalization``
(2 towers of 2 rows, one SGD step) patched equals one device on the whole
batch (numpy, float64), and tf.layers' own layer in its place, where this
TensorFlow has one (not with Keras 3), does not; the audit flags that one and
advises ``patch_tf_layers()``, the call that made the first. Likewise one
Keras 2 ``BatchNormalization`` called in both towers, under ``patch_keras``
and not. After the patch:

* ``patch_tf_layers(num_dev=2)``: ``tf.compat.v1.layers.batch_normalization``,
  ``tf.layers.BatchNormalization`` (``import tensorflow.compat.v1 as tf``) and
  ``from tensorflow.compat.v1.layers import batch_normalization`` each build
  a ``tower_%d`` loop that the audit finds synchronized over 2 towers (on
  TensorFlow 2.15 the patch used to leave Keras' layer in place, per-tower);
* ``patch_keras()``: ``tf.keras.layers.BatchNormalization`` and
  ``tf.compat.v1.keras.layers.BatchNormalization`` where ``tf.keras`` is
  Keras 2 (else a warning that it stays Keras 3's), the Keras 2 package's
  ``layers.BatchNormalization``;
* ``patch_tensorpack()``: ``tensorpack.BatchNorm`` (imported before the
  patch and after), the layer ``LinearWrap`` finds;
* ``sync_arg_scope()``: ``slim.batch_norm`` and the ``normalizer_fn`` of
  ``slim.conv2d``'s arg scope.

Then, for each patch, a stand-in for a release that hands the layer out in a
way the patch cannot switch (a wrapper under the user's name, a module that
ignores the assignment): the patch must raise ``tf1_syncbn.PatchError`` naming
the TensorFlow version and what to call instead, and leave nothing switched.
"""

import numpy as np
import pytest
import tensorflow as tf

import fresh_script
import tf_behavior

pytestmark = pytest.mark.versions

#: After fresh_script.PRELUDE.
SCRIPT = r'''
import functools, importlib, types, warnings
import numpy as np
import tensorflow.compat.v1 as tfv1
import tf_slim as slim
import tensorpack
from tensorpack import BatchNorm as imported_before
import tf1_syncbn
import tf1_syncbn.keras as sync_keras
from tf1_syncbn import audit_graph


def towers(make):
    """The audit's (synchronized, group size) of a 2-tower tower_%d loop that calls make()."""
    graph = tf.Graph()
    with graph.as_default():
        bn = make()            # a function, or one layer object applied in every tower
        x = tf1.placeholder(tf.float32, [4, 3])
        losses = []
        for i, part in enumerate(tf.split(x, 2)):
            with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i), \
                    tf1.variable_scope('', reuse=i > 0):
                losses.append(tf.reduce_sum(bn(part)))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.add_n(losses))
        report = audit_graph(graph, train_op)
    return [[layer.synchronized, layer.group_size] for layer in report.layers]


def error(call):
    """The PatchError ``call`` raises (its message), or what happened instead."""
    try:
        handle = call()
    except tf1_syncbn.PatchError as e:
        return str(e)
    except Exception as e:
        return 'raised %s: %s' % (type(e).__name__, e)
    if handle is not None and hasattr(handle, 'restore'):
        handle.restore()
    return 'returned normally'


# A tower_%d loop, one SGD step: tf.layers' layer where this TensorFlow has it
# (per-tower), then patched (synchronized).
X = np.random.RandomState(0).randn(4, 3).astype(np.float32) * 2 + 1
W = np.random.RandomState(1).randn(4, 3).astype(np.float32)


def step():
    """gamma, beta, moving mean and variance after one step of 2 towers of 2 rows."""
    graph = tf.Graph()
    with graph.as_default():
        losses = []
        for i, (x, w) in enumerate(zip(tf.split(X, 2), tf.split(W, 2))):
            with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i), \
                    tf1.variable_scope('', reuse=i > 0):
                h = tf.compat.v1.layers.batch_normalization(x, training=True, momentum=0.5,
                                                            name='bn')
                losses.append(tf.reduce_sum(h * w))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.add_n(losses))
        names = ['bn/gamma', 'bn/beta', 'bn/moving_mean', 'bn/moving_variance']
        variables = {v.op.name: v for v in tf1.global_variables()}
        config = tf1.ConfigProto(device_count={'CPU': 2})
        with tf1.Session(config=config) as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(train_op)
            values = [sess.run(variables[n]).tolist() for n in names]
        return values, ' '.join(audit_graph(graph, train_op).problems)


try:
    out['control'], out['advice'] = step()
except AttributeError:               # Keras 3: tf.layers' layer does not exist
    out['control'] = out['advice'] = None
with tf1_syncbn.patch_tf_layers(num_dev=2):      # the audit's advice, taken
    out['patched'], out['patched problems'] = step()

def keras_step():
    """step() with one Keras 2 BatchNormalization called in both towers (its updates run)."""
    keras2 = importlib.import_module(sync_keras.KERAS_PACKAGE)
    graph = tf.Graph()
    with graph.as_default():
        layer = keras2.layers.BatchNormalization(momentum=0.5)
        losses = []
        for i, (x, w) in enumerate(zip(tf.split(X, 2), tf.split(W, 2))):
            with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
                losses.append(tf.reduce_sum(layer(x, training=True) * w))
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.add_n(losses))
        config = tf1.ConfigProto(device_count={'CPU': 2})
        with tf1.Session(config=config) as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run([train_op] + layer.updates)
            return [sess.run(v).tolist() for v in (layer.gamma, layer.beta, layer.moving_mean,
                                                   layer.moving_variance)]


out['keras control'] = keras_step()
with warnings.catch_warnings():
    warnings.simplefilter('ignore')                 # Keras 3's, checked below
    with tf1_syncbn.patch_keras(num_dev=2):
        out['keras patched'] = keras_step()

# patch_tf_layers
with tf1_syncbn.patch_tf_layers(num_dev=2):
    out['tf.compat.v1.layers.batch_normalization'] = towers(lambda: lambda x: (
        tf.compat.v1.layers.batch_normalization(x, training=True, name='bn')))
    out['tf.layers.BatchNormalization'] = towers(lambda: functools.partial(
        tfv1.layers.BatchNormalization(name='bn').apply, training=True))
    from tensorflow.compat.v1.layers import batch_normalization
    out['from tensorflow.compat.v1.layers import'] = towers(lambda: lambda x: (
        batch_normalization(x, training=True, name='bn')))

# patch_keras
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    with tf1_syncbn.patch_keras(num_dev=2):
        keras2 = __import__(sync_keras.KERAS_PACKAGE)
        out['keras2.layers'] = issubclass(keras2.layers.BatchNormalization,
                                          sync_keras.BatchNormalization)
        if not tf1_syncbn._frontend.keras2.tf_keras_is_keras3():
            out['tf.keras.layers'] = issubclass(tf.keras.layers.BatchNormalization,
                                                sync_keras.BatchNormalization)
            out['tf.compat.v1.keras.layers'] = issubclass(
                tf.compat.v1.keras.layers.BatchNormalization, sync_keras.BatchNormalizationV1)
out['keras warnings'] = [str(w.message) for w in caught if 'patch_keras' in str(w.message)]
out['keras package'] = sync_keras.KERAS_PACKAGE

# patch_tensorpack
with tf1_syncbn.patch_tensorpack(sync_statistics='auto'):
    from tensorpack import BatchNorm as imported_after
    from tensorpack.models.registry import get_registered_layer
    out['tensorpack'] = [f is tf1_syncbn.BatchNorm for f in (
        tensorpack.BatchNorm, imported_before, imported_after, get_registered_layer('BatchNorm'))]

# sync_arg_scope
with slim.arg_scope([slim.conv2d], normalizer_fn=slim.batch_norm):
    with tf1_syncbn.sync_arg_scope():
        conv = slim.current_arg_scope()[slim.arg_scope_func_key(slim.conv2d)]
        out['slim'] = [slim.batch_norm is tf1_syncbn.sync_batch_norm,
                       conv['normalizer_fn'] is tf1_syncbn.sync_batch_norm]

# Stand-ins for releases that hand the layer out some other way.
original_layers = tf.compat.v1.layers
future = types.ModuleType('future_layers')
future.batch_normalization = functools.wraps(tf1_syncbn.layers.batch_normalization)(
    lambda *args, **kwargs: None)
future.BatchNormalization = type('BatchNormalization', (), {})
tf.compat.v1.layers = future
out['tf_layers error'] = error(lambda: tf1_syncbn.patch_tf_layers())
out['tf_layers after'] = tf.compat.v1.layers.batch_normalization is future.batch_normalization
tf.compat.v1.layers = original_layers

keras_layers = __import__(sync_keras.KERAS_PACKAGE).layers
original_class = keras_layers.BatchNormalization
keras_layers.BatchNormalization = type('BatchNormalization', (original_class,), {})
out['keras error'] = error(lambda: tf1_syncbn.patch_keras())
out['keras after'] = sys.modules[sync_keras.KERAS_PACKAGE + '.src.layers.normalization.'
                                'batch_normalization'].BatchNormalization is original_class
keras_layers.BatchNormalization = original_class

original_bn = tensorpack.BatchNorm
tensorpack.BatchNorm = functools.wraps(original_bn)(lambda *args, **kwargs: None)
out['tensorpack error'] = error(lambda: tf1_syncbn.patch_tensorpack())
out['tensorpack after'] = get_registered_layer('BatchNorm') is not tf1_syncbn.BatchNorm
tensorpack.BatchNorm = original_bn


class Ignores(types.ModuleType):
    """A module that ignores assignments to batch_norm (a proxy, a read-only namespace)."""

    def __setattr__(self, name, value):
        if name != 'batch_norm':
            super().__setattr__(name, value)


sys.modules['tf_slim'].__class__ = Ignores
out['slim error'] = error(lambda: tf1_syncbn.sync_arg_scope().__enter__())
sys.modules['tf_slim'].__class__ = types.ModuleType
out['slim after'] = slim.layers.batch_norm is not tf1_syncbn.sync_batch_norm
'''


def _one_device():
    """The script's step on one device with the whole batch, in float64: tf.layers'
    rules (epsilon 1e-3, the biased variance on its non-fused rank-2 path)."""
    rng = np.random.RandomState(0)
    x = (rng.randn(4, 3).astype(np.float32) * 2 + 1).astype(np.float64)
    w = np.random.RandomState(1).randn(4, 3).astype(np.float32).astype(np.float64)
    mean, variance = x.mean(0), x.var(0)
    xhat = (x - mean) / np.sqrt(variance + 1e-3)
    return [1 - 0.1 * (xhat * w).sum(0), -0.1 * w.sum(0), 0.5 * mean, 0.5 + 0.5 * variance]


@pytest.mark.parametrize('setting', tf_behavior.pick(fresh_script.KERAS, ['legacy']))
def test_every_patch_by_the_names_users_call(setting):
    out = fresh_script.run(SCRIPT, setting, timeout=280)
    # The patched tower loop is one device on the whole batch (numpy, float64);
    # tf.layers' own layer, where there is one, is not.
    expected = _one_device()
    for got, want, name in zip(out['patched'], expected, ('gamma', 'beta', 'mean', 'variance')):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert out['patched problems'] == '', out
    for got, want, name in zip(out['keras patched'], expected, ('gamma', 'beta', 'mean', 'var')):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg='Keras ' + name)
    assert not np.allclose(out['keras control'][0], expected[0], rtol=1e-3), out
    if out['control'] is not None:
        assert not np.allclose(out['control'][0], expected[0], rtol=1e-3), out['control']
        # The audit flags tf.layers' own layer and advises the patch that then worked.
        assert 'patch_tf_layers()' in out['advice'], out['advice']
    else:
        assert setting == 'default' and not tf.__version__.startswith('2.15.'), setting
    for name in ('tf.compat.v1.layers.batch_normalization', 'tf.layers.BatchNormalization',
                 'from tensorflow.compat.v1.layers import'):
        assert out[name] == [[True, 2]], (name, out)
    keras3 = setting == 'default' and not tf.__version__.startswith('2.15.')
    assert out['keras2.layers'], out
    if keras3:
        assert 'tf.keras is Keras 3' in ' '.join(out['keras warnings']), out
    else:
        assert out['tf.keras.layers'] and out['tf.compat.v1.keras.layers'], out
        assert out['keras warnings'] == [], out
        assert out['keras package'] == ('tf_keras' if setting == 'legacy' else 'keras'), out
    assert out['tensorpack'] == [True] * 4, out
    assert out['slim'] == [True, True], out

    version = 'TensorFlow %s' % tf.__version__
    for patch, instead in (('tf_layers', 'tf1_syncbn.layers.batch_normalization'),
                           ('keras', 'tf1_syncbn.keras.BatchNormalization'),
                           ('tensorpack', 'tf1_syncbn.BatchNorm'),
                           ('slim', 'tf1_syncbn.sync_batch_norm')):
        message = out[patch + ' error']
        assert version in message and instead in message and 'undone' in message, \
            (patch, message)
        assert out[patch + ' after'], (patch, out)       # nothing left switched

"""``patch_keras()`` switches every name existing Keras code reaches tf-keras' layer by; undone.

In this process: ``tf_keras.layers``, tf-keras' own modules, names a module
imported (``from tf_keras.layers import BatchNormalization as BN``),
``tf_keras.applications`` (``VersionAwareLayers``), deserialized models, the
patch's defaults, and ``restore()`` (modules imported while it was active
included). In a fresh interpreter: ``import tf1_syncbn`` does not import tf-keras,
``tf1_syncbn.keras`` raises an ImportError that says how to install it when
tf-keras cannot be imported, ``tf.keras.layers`` and
``tf.compat.v1.keras.layers`` (``TF_USE_LEGACY_KERAS=1``) are switched, and
eager execution and ``tf.function`` get clear errors.
"""

import json
import os
import subprocess
import sys
import types

import importlib

import pytest
import tensorflow as tf

import tf1_syncbn
from tf1_syncbn import keras as sync_keras

pytestmark = pytest.mark.versions

tf1 = tf.compat.v1
#: The Keras 2 that tf.keras is: tf-keras, or Keras 2.15 on TensorFlow 2.15.
tf_keras = importlib.import_module(sync_keras.KERAS_PACKAGE)
V2, V1 = sync_keras.KERAS_BATCH_NORMALIZATION, sync_keras.KERAS_BATCH_NORMALIZATION_V1


def _module(name, source):
    """A user module, registered in ``sys.modules`` as an import would."""
    module = types.ModuleType(name)
    exec(source, vars(module))  # noqa: S102 - a stand-in for the user's file
    sys.modules[name] = module
    return module


def _batch_norm_classes(model):
    return {type(layer) for layer in model.layers if 'BatchNormalization' in type(layer).__name__}


def test_every_name_is_switched_and_restored():
    normalization = sync_keras.KERAS_PACKAGE + '.src.layers.normalization.'
    batch_normalization = importlib.import_module(normalization + 'batch_normalization')
    batch_normalization_v1 = importlib.import_module(normalization + 'batch_normalization_v1')
    before = _module('user_model_before', 'from %s.layers import BatchNormalization as BN'
                     % sync_keras.KERAS_PACKAGE)
    try:
        with sync_keras.patch_keras(num_dev=4) as patch:
            assert patch.active
            for name in (tf_keras.layers.BatchNormalization, batch_normalization.BatchNormalization,
                         before.BN):
                assert issubclass(name, sync_keras.BatchNormalization), name
            assert issubclass(batch_normalization_v1.BatchNormalization,
                              sync_keras.BatchNormalizationV1)
            during = _module('user_model_during', 'from %s.layers import BatchNormalization'
                             % sync_keras.KERAS_PACKAGE)
            assert issubclass(during.BatchNormalization, sync_keras.BatchNormalization)
            with tf.Graph().as_default():
                layer = tf_keras.layers.BatchNormalization()
                explicit = before.BN(num_dev=2, sync_statistics=None)
                model = tf_keras.applications.MobileNet(weights=None, alpha=0.25,
                                                        input_shape=(32, 32, 3), classes=2)
                small = tf_keras.Sequential([tf_keras.Input((4,)), V2(name='bn')])  # tf-keras'
                loaded = tf_keras.models.model_from_json(small.to_json())
            assert (layer.num_dev, layer.sync_statistics) == (4, 'auto')
            assert (explicit.num_dev, explicit.sync_statistics) == (2, None)
            assert type(layer).__name__ == 'BatchNormalization'
            ours = sync_keras.BatchNormalization if tf.__internal__.tf2.enabled() else \
                sync_keras.BatchNormalizationV1
            for built in (model, loaded):
                (cls,) = _batch_norm_classes(built)
                assert issubclass(cls, ours), cls
        assert not patch.active
        patch.restore()                               # idempotent
        assert tf_keras.layers.BatchNormalization is V2
        assert batch_normalization.BatchNormalization is V2
        assert batch_normalization_v1.BatchNormalization is V1
        assert before.BN is V2 and during.BatchNormalization is V2
        # What tf_keras.applications build their layers from (VersionAwareLayers):
        VersionAwareLayers = importlib.import_module(  # noqa: N806 - the class
            sync_keras.KERAS_PACKAGE + '.src.layers').VersionAwareLayers
        assert VersionAwareLayers().BatchNormalization is (
            V2 if tf.__internal__.tf2.enabled() else V1)
    finally:
        sys.modules.pop('user_model_before', None)
        sys.modules.pop('user_model_during', None)


def test_a_second_patch_is_refused_and_the_package_exports_it():
    assert tf1_syncbn.patch_keras is sync_keras.patch_keras
    assert tf1_syncbn.keras is sync_keras
    with sync_keras.patch_keras():
        with pytest.raises(RuntimeError, match='patch_keras: tf-keras is already patched'):
            tf1_syncbn.patch_keras()
    assert tf_keras.layers.BatchNormalization is V2


SCRIPT = '''
import json, os, sys
import tensorflow as tf

# tf.keras reads TF_USE_LEGACY_KERAS when first used: tf-keras from here on
# (and the Keras 2 of tf1_syncbn.keras, on TensorFlow 2.15 too).
os.environ['TF_USE_LEGACY_KERAS'] = '1'
result = {}
import tf1_syncbn
result['imported_tf_keras'] = 'tf_keras' in sys.modules


class Blocked(object):
    """tf-keras not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == 'tf_keras' or name.startswith('tf_keras.'):
            raise ModuleNotFoundError("No module named 'tf_keras'")
        return None


sys.meta_path.insert(0, Blocked())
try:
    import tf1_syncbn.keras
except ImportError as e:
    result['import_error'] = str(e)
sys.meta_path.pop(0)

import tf1_syncbn.keras as sync_keras
with sync_keras.patch_keras():
    result['tf.keras'] = tf.keras.layers.BatchNormalization.__module__
    result['tf.compat.v1.keras'] = tf.compat.v1.keras.layers.BatchNormalization.__module__
    result['v1_is_ours'] = issubclass(tf.compat.v1.keras.layers.BatchNormalization,
                                      sync_keras.BatchNormalizationV1)
result['tf.keras restored'] = tf.keras.layers.BatchNormalization is \\
    sync_keras.KERAS_BATCH_NORMALIZATION
result['tf.compat.v1.keras restored'] = tf.compat.v1.keras.layers.BatchNormalization is \\
    sync_keras.KERAS_BATCH_NORMALIZATION_V1

layer = sync_keras.BatchNormalization(name='bn')
try:
    layer(tf.ones([2, 3]), training=True)
except RuntimeError as e:
    result['eager'] = str(e)
try:
    tf.function(lambda x: sync_keras.BatchNormalization(name='fn')(x, training=True))(
        tf.ones([2, 3]))
except RuntimeError as e:
    result['function'] = str(e)
open('result.json', 'w').write(json.dumps(result))
print('RESULT result.json')
'''


@pytest.mark.once      # a fresh interpreter in eager mode, whatever the pass's behaviour
def test_tf_keras_paths_import_error_and_eager_errors(tmp_path):
    """A fresh interpreter, eager execution on (TF2's default); TF_USE_LEGACY_KERAS=1
    set after ``import tensorflow``.

    (With ``TF_USE_LEGACY_KERAS=1`` from the start, ``import tensorflow``
    itself imports tf-keras.)
    """
    script = tmp_path / 'script.py'
    script.write_text(SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    env.pop('TF_USE_LEGACY_KERAS', None)
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / 'result.json').read_text())
    assert result['imported_tf_keras'] is False
    version = '.'.join(tf.__version__.split('.')[:2])
    assert 'pip install --no-deps "tf-keras~=%s.0"' % version in result['import_error']
    assert result['tf.keras'] == result['tf.compat.v1.keras'] == 'tf1_syncbn.keras'
    assert result['v1_is_ours'] and result['tf.keras restored']
    assert result['tf.compat.v1.keras restored']
    for key, layer in (('eager', 'bn'), ('function', 'fn')):
        assert ('BatchNormalization(%s) is called eagerly or inside a tf.function' % layer
                in result[key]), result[key]

"""tf1_syncbn.layers in the harnesses tf.layers code runs in, against tf.layers on one device.

* An unmodified tf.layers script (``tf_layers_script.py``: a ``tower_%d``
  loop in the style of ``cifar10_multi_gpu_train.py`` that keeps the last
  tower's ``UPDATE_OPS``, tf.layers' function and its layer object) runs
  under ``tf1_syncbn.patch_tf_layers(num_dev=4)`` on 4 towers and equals the
  same script with tf.layers itself on one device: every loss, every
  variable, the inference output. In both environments: plain TensorFlow
  2.16+ (where tf.layers' batch normalization does not exist at all) and
  tf-keras with ``TF_USE_LEGACY_KERAS=1`` (where ``conv2d`` and ``dense`` stay
  tf-keras'), each in its own interpreter.
* ``tf.distribute.MirroredStrategy`` (``strategy_case.py``), the function
  and the layer object, with uneven replicas (one of them empty).
* A checkpoint written by tf.layers code restores unchanged and training
  continues as tf.layers' would.

The references come from ``layers_reference.py`` (tf.layers itself, in a
subprocess).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import strategy_case
from layers_reference import STRATEGY_LAYERS
from layers_reference import reference as run_layers_reference
from tf1_syncbn import layers  # noqa: F401 - the strategy layers' code names it

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KERAS_3_ERROR = 'AttributeError: `%s` is not available with Keras 3.'


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    return run_layers_reference(tmp_path_factory)


def _assert_same(ours, ref, what, rtol=1e-5, atol=2e-6):
    assert sorted(k for k in ours if not k.startswith('copies/')) == sorted(ref), what
    for key in sorted(ref):
        expected = ref[key].astype(np.float64)
        scale = max(np.abs(expected).max(), 1.0)
        np.testing.assert_allclose(ours[key], expected, rtol=rtol, atol=atol * scale,
                                   err_msg='%s: %s' % (what, key))


def _run_patched_script(tmp_path, legacy):
    env = {k: v for k, v in os.environ.items() if k != 'TF_USE_LEGACY_KERAS'}
    if legacy:
        env['TF_USE_LEGACY_KERAS'] = '1'
    env.update(TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=os.pathsep.join([HERE, ROOT]))
    out = str(tmp_path / 'ours.npz')
    proc = subprocess.run([sys.executable, os.path.join(HERE, 'run_patched_script.py'), '4',
                           out], env=env, cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    arrays = np.load(out)
    with open(out[:-4] + '.json') as f:
        api = json.load(f)
    with open(out[:-4] + '.patch.json') as f:
        patch = json.load(f)
    return {k: arrays[k] for k in arrays.files}, api, patch


@pytest.mark.timeout(600)
@pytest.mark.parametrize('environment', ['plain TensorFlow', 'tf-keras'])
def test_an_unmodified_tf_layers_script_on_4_towers_is_tf_layers_on_one(reference, tmp_path,
                                                                       environment):
    legacy = environment == 'tf-keras'
    ours, api, patch = _run_patched_script(tmp_path, legacy)
    # The environment is the one claimed, and the patch switched batch norm only.
    ours_module = 'tf1_syncbn.layers'
    if legacy:
        assert not patch['keras_layers_loaded_before']     # the patch waited for them
        assert patch['during'] == {'batch_normalization': ours_module,
                                   'BatchNormalization': ours_module,
                                   'conv2d': 'tf_keras.src.legacy_tf_layers.convolutional',
                                   'dense': 'tf_keras.src.legacy_tf_layers.core'}
        keras = 'tf_keras.src.legacy_tf_layers.normalization'
        assert patch['after'] == dict.fromkeys(('batch_normalization', 'BatchNormalization'),
                                               keras)
        # Patched again with tf-keras loaded: a module's imported name too.
        assert patch['loaded'] == {'during': [ours_module, ours_module],
                                   'after': [keras, keras]}
    else:
        assert patch['before'] == KERAS_3_ERROR % 'batch_normalization'
        assert patch['during'] == {'batch_normalization': ours_module,
                                   'BatchNormalization': ours_module,
                                   'conv2d': KERAS_3_ERROR % 'conv2d',
                                   'dense': KERAS_3_ERROR % 'dense'}
        assert patch['after'] == {name: KERAS_3_ERROR % name
                                  for name in ('batch_normalization', 'BatchNormalization')}
    # The layer object's API, as tf.layers' on the same script.
    assert api == reference['script_api']
    # Every number: 4 towers of 2 against one device with the batch of 8.
    _assert_same(ours, reference['script'], environment, rtol=2e-5, atol=1e-5)
    assert any('bn2/moving_variance' in k for k in ours)


def test_the_script_comparison_can_fail(reference):
    """A moving variance updated by one tower's statistics only would not pass."""
    wrong = dict(reference['script'])
    key = 'var/bn1/moving_variance'
    wrong[key] = wrong[key] * 1.001
    with pytest.raises(AssertionError, match='bn1/moving_variance'):
        _assert_same(wrong, reference['script'], 'wrong', rtol=2e-5, atol=1e-5)


def _strategy_layer(name):
    return eval('lambda x: ' + STRATEGY_LAYERS[name])  # noqa: S307 - our own constant code


@pytest.mark.parametrize('name,sizes', [('function', [3, 0, 5]), ('object', [3, 5])])
def test_mirrored_replicas_are_tf_layers_on_one_device(reference, name, sizes):
    ours = strategy_case.train(_strategy_layer(name), sizes, 'mirrored')
    _assert_same(ours, reference['strategy'][name], name)
    for key, copies in ours.items():
        if key.startswith('copies/'):
            np.testing.assert_array_equal(copies, np.broadcast_to(copies[0], copies.shape),
                                          err_msg=key)
    assert any(k.startswith('copies/') and 'moving_variance' in k for k in ours)


def test_a_tf_layers_checkpoint_restores_unchanged(reference):
    """Written by tf.layers code on one device; restored by ours on 2 replicas, trained on."""
    ours = strategy_case.train(_strategy_layer('function'), [5, 3], 'mirrored',
                               checkpoint_in=reference['checkpoint'])
    _assert_same({k: v for k, v in ours.items() if not k.startswith('copies/')},
                 reference['restored'], 'restored')


def test_per_replica_statistics_would_differ(reference):
    """The strategy comparison can fail: ``sync_statistics=None`` normalizes per replica."""
    ours = strategy_case.train(
        lambda x: layers.batch_normalization(x, training=True, momentum=0.9, name='bn',
                                             sync_statistics=None), [3, 5], 'mirrored')
    with pytest.raises(AssertionError):
        _assert_same(ours, reference['strategy']['function'], 'per replica')


def test_patch_is_undone_by_restore_and_refuses_to_stack():
    import tf1_syncbn  # noqa: PLC0415
    loader = tf.compat.v1.layers
    before = dict(vars(loader))
    with tf1_syncbn.patch_tf_layers(num_dev=2) as patch:
        function = tf.compat.v1.layers.batch_normalization
        assert function.__wrapped__ is tf1_syncbn.layers.batch_normalization
        assert issubclass(tf.compat.v1.layers.BatchNormalization,
                          tf1_syncbn.layers.BatchNormalization)
        assert tf.compat.v1.layers.BatchNormalization().num_dev == 2
        with pytest.raises(RuntimeError, match='already patched'):
            tf1_syncbn.patch_tf_layers()
    patch.restore()     # idempotent
    assert dict(vars(loader)) == before

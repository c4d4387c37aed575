"""tf1_syncbn.layers in the harnesses tf.layers code runs in, against tf.layers on one device.

* An unmodified tf.layers script (``tf_layers_script.py``, tf.layers'
  function and its layer object) in three loops: ``tower_%d`` keeping the
  last tower's ``UPDATE_OPS`` (``cifar10_multi_gpu_train.py``), ``clone_%d``
  keeping the first clone's with the variable scope reused after the first
  (tf-slim's ``model_deploy``), and ``tower_%d`` keeping every
  ``UPDATE_OPS``. Each runs under ``tf1_syncbn.patch_tf_layers(num_dev=4)`` on
  4 towers and equals the same loop with tf.layers itself on one device:
  every loss, every variable, the inference output. In both environments:
  plain TensorFlow 2.16+ (where tf.layers' batch normalization does not exist
  at all) and tf-keras with ``TF_USE_LEGACY_KERAS=1`` (where ``conv2d`` and
  ``dense`` stay tf-keras'), each in its own interpreter.
* tensorpack's own ``SyncMultiGPUTrainerParameterServer`` and
  ``SyncMultiGPUTrainerReplicated`` (``tensorpack_tf_layers.py``, on
  ``tensorpack_harness.py``'s model and loop) on a model that calls
  ``tf.layers.batch_normalization`` with tensorpack's ``is_training``, under
  ``patch_tf_layers()``: 2 towers equal tf.layers under tensorpack's
  ``SimpleTrainer`` on one device.
* ``tf.distribute.MirroredStrategy`` (``strategy_case.py``), the function
  and the layer object, with uneven replicas (one of them empty).
* A checkpoint written by tf.layers code restores unchanged and training
  continues as tf.layers' would.

The references come from ``layers_reference.py`` (tf.layers itself, in a
subprocess), and for tensorpack from the same subprocess as the runs.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import strategy_case
import support_paths
import tf_behavior
from legacy_reference import run_reference
from layers_reference import STRATEGY_LAYERS
from layers_reference import reference as run_layers_reference
from tf1_syncbn import layers  # noqa: F401 - the strategy layers' code names it
from tf_layers_script import STYLES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
#: The helpers and the scripts the tests start.
SUPPORT = os.path.join(ROOT, 'tests', 'support', 'for_layers')
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
    env.update(TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=support_paths.pythonpath())
    out = str(tmp_path / 'ours.npz')
    proc = subprocess.run([sys.executable, os.path.join(SUPPORT, 'run_patched_script.py'), '4',
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
# The TF1-behaviour pass: plain TensorFlow, where TF1 scripts run (tf_behavior.pick).
@pytest.mark.parametrize('environment', tf_behavior.pick(['plain TensorFlow', 'tf-keras'],
                                                        ['plain TensorFlow']))
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
    elif tf.__version__.startswith('2.15.'):
        # Plain TensorFlow 2.15: tf.compat.v1.layers is Keras 2.15's legacy layers.
        keras = 'keras.src.legacy_tf_layers.'
        assert patch['before'] == keras + 'normalization'
        assert patch['during'] == {'batch_normalization': ours_module,
                                   'BatchNormalization': ours_module,
                                   'conv2d': keras + 'convolutional', 'dense': keras + 'core'}
        assert patch['after'] == dict.fromkeys(('batch_normalization', 'BatchNormalization'),
                                               keras + 'normalization')
    else:
        assert patch['before'] == KERAS_3_ERROR % 'batch_normalization'
        assert patch['during'] == {'batch_normalization': ours_module,
                                   'BatchNormalization': ours_module,
                                   'conv2d': KERAS_3_ERROR % 'conv2d',
                                   'dense': KERAS_3_ERROR % 'dense'}
        assert patch['after'] == {name: KERAS_3_ERROR % name
                                  for name in ('batch_normalization', 'BatchNormalization')}
    # The layer object's API, as tf.layers' on the same script, in every loop.
    assert sorted(api) == sorted(STYLES)
    assert api == reference['script_api']
    # Every number: 4 towers of 2 against one device with the batch of 8, in
    # every loop (keys '<style>/...').
    _assert_same(ours, reference['script'], environment, rtol=2e-5, atol=1e-5)
    for style in STYLES:
        assert '%s/var/bn2/moving_variance' % style in ours


@pytest.mark.once(reason='a check of the comparison on stored numbers, no graph')
@pytest.mark.parametrize('style', STYLES)
def test_the_script_comparison_can_fail(reference, style):
    """Moving statistics off by 0.1%, or never updated (update ops not run), would not pass."""
    key = '%s/var/bn1/moving_variance' % style
    wrong = dict(reference['script'])
    wrong[key] = wrong[key] * 1.001
    with pytest.raises(AssertionError, match='bn1/moving_variance'):
        _assert_same(wrong, reference['script'], 'wrong', rtol=2e-5, atol=1e-5)
    never = dict(reference['script'])
    never[key] = np.ones_like(never[key])
    with pytest.raises(AssertionError, match='bn1/moving_variance'):
        _assert_same(never, reference['script'], 'never', rtol=2e-5, atol=1e-5)


@pytest.fixture(scope='module')
def tensorpack_runs(tmp_path_factory):
    """``(arrays, info)`` of ``tensorpack_tf_layers.py``, run once in a legacy-Keras subprocess."""
    out = tmp_path_factory.mktemp('tensorpack_tf_layers')
    with open(os.path.join(SUPPORT, 'tensorpack_tf_layers.py')) as f:
        code = f.read()
    config = {'towers': [2], 'steps': 3, 'global_batch': 8, 'hang_seconds': 240}
    # A collective that waits for a member fails after 60 s instead of 600 s.
    run_reference(code, out, args=[str(out), json.dumps(config)],
                  env={'TF1_SYNCBN_TIMEOUT': '60'}, timeout=300)
    with open(out / 'result.json') as f:
        info = json.load(f)
    return np.load(out / 'result.npz'), info


def _tensorpack_run(tensorpack_runs, run):
    arrays, info = tensorpack_runs
    for name in ('reference', run):
        if 'error' in info[name]:
            pytest.fail('the %s run failed: %s' % (name, info[name]['error']))
    prefix = 'var/%s/' % run
    variables = {k[len(prefix):]: arrays[k] for k in arrays.files if k.startswith(prefix)}
    return arrays['losses/' + run], variables, info[run]


@pytest.mark.parametrize('run', ['ps2', 'replicated2'])
def test_tensorpack_trainers_are_tf_layers_on_one_device(tensorpack_runs, run):
    losses, ours, info = _tensorpack_run(tensorpack_runs, run)
    ref_losses, reference, _ = _tensorpack_run(tensorpack_runs, 'reference')
    assert info['towers_with_cost'] == 2
    # Synchronized: one all-reduce forward and one backward per tower, on the
    # compiled kernels.
    assert info['collectives'] == 4
    assert info['kernel_ops'] > 0
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert sorted(ours) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # tf.layers' names; replicated towers own tower<k>/ copies (tensorpack syncs
    # them itself and does not save them).
    assert 'bn/moving_variance' in ours
    assert not np.allclose(ours['bn/moving_mean'], 0.0)
    expected = ['tower1/bn/' + v for v in ('beta', 'gamma', 'moving_mean', 'moving_variance')]
    assert info['tower_bn_variables'] == (expected if run.startswith('replicated') else [])


def test_tensorpack_per_tower_statistics_would_differ(tensorpack_runs):
    """The control: ``patch_tf_layers(sync_statistics=None)`` under the same trainer."""
    losses, ours, info = _tensorpack_run(tensorpack_runs, 'per-tower2')
    ref_losses, reference, _ = _tensorpack_run(tensorpack_runs, 'reference')
    assert info['collectives'] == 0
    assert not np.allclose(ours['bn/moving_variance'], reference['bn/moving_variance'],
                           rtol=1e-4, atol=1e-5)


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


@pytest.mark.once(reason='a check that the strategy comparison can fail; the TF1 pass '
                  'runs the synchronized replicas and the checkpoint')
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

"""Keras batch norms nested in other layers build under ``patch_keras(num_dev=N)`` and sync.

``TimeDistributed(BatchNormalization())`` and a custom layer calling
``self.bn(tf.nn.relu(x))`` hand the batch norm tensors without Keras'
history; before the fix the model's own graph (built on its
``keras.Input``) failed with "num_dev=2 but the layer is built outside any
tower". On 2 uneven towers they equal tf-keras' own layers on one device
with the concatenated batch (in a legacy-Keras subprocess, same TF
behaviour, ``keras_nested_case``): outputs, input and weight gradients of
two steps, and every weight (moving statistics included) after them.
"""

import numpy as np
import pytest

import keras_nested_case as case
from legacy_reference import run_reference
from tf1_syncbn import keras as sync_keras

SIZES = [2, 3]

REFERENCE_SCRIPT = '''
import numpy as np
import tf_behavior
tf_behavior.apply()
import tf_keras
import keras_nested_case
assert tf_keras.layers.BatchNormalization.__module__.startswith('tf_keras.')
np.savez('nested_reference.npz', **keras_nested_case.train([%d], 'one'))
''' % sum(SIZES)


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('keras_nested')
    run_reference(REFERENCE_SCRIPT, tmp)
    return dict(np.load(tmp / 'nested_reference.npz'))


def test_nested_batch_norms_on_towers_equal_tf_keras_on_one_device(reference):
    with sync_keras.patch_keras(num_dev=len(SIZES)):
        ours = case.train(SIZES, 'towers')
    assert sorted(ours) == sorted(reference)
    assert any('moving_variance' in k for k in ours)
    for key in sorted(reference):
        np.testing.assert_allclose(ours[key], reference[key], rtol=2e-4, atol=2e-5,
                                   err_msg=key)


def test_without_the_patch_the_towers_differ(reference):
    """The comparison can fail: tf-keras' own layers normalize each tower alone."""
    control = case.train(SIZES, 'towers')
    assert not np.allclose(control['y/0'], reference['y/0'], rtol=1e-3, atol=1e-3)

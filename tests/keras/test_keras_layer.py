"""tf1_syncbn.keras.BatchNormalization is tf-keras' layer, synchronized: case by case.

The invariant: N synchronized towers give what tf-keras' own
``BatchNormalization`` gives on one device with the concatenated batch (here:
3 towers of 3, 0 and 5 examples): outputs, input and parameter gradients and
every weight by name, the moving statistics included, over three SGD steps;
one tower gives it too (one case per path, :data:`ONE_TOWER_CASES`). The
moving variance tracks the Bessel-corrected batch variance where tf-keras runs
its fused kernel (rank 4 and 5, axis 1 or last, no renorm or adjustment), the
biased one elsewhere (rank 2 and 3, ``fused=False``, ``synchronized=True``,
renorm, adjustment, a mask).

The TF1-behaviour pass runs the cases whose paths TF1 behaviour changes
(``keras_cases.V1_NAMES``). The reference is tf-keras itself, run once for
all cases in a subprocess with legacy Keras in the same TF behaviour
(``reference_cases``). The multi-tower cases run on the compiled CPU kernels
here, and those of :data:`STOCK_CASES` on TensorFlow's stock kernels with
oneDNN off (what GPU towers run) in a child pytest (``without_onednn``).
"""

import contextlib
import functools

import numpy as np
import pytest
import tensorflow as tf

import keras_cases
import reference_cases
import suite_scope
import tf_behavior
from keras_cases import MODEL, RUN_CASES
from parity_harness import DEFAULT_SIZES, assert_same_numbers, case_data, train_case
from without_onednn import kernel_set, kernel_cases
from tf1_syncbn import CollectiveBackend
from tf1_syncbn import keras as sync_keras

tf1 = tf.compat.v1
exec(MODEL)  # noqa: S102 - defines keras_apply here, as in the reference
# The multi-tower cases that also run on the stock kernels with oneDNN off (in
# test_keras_models' child run, with the model's): the fused path (NHWC,
# NCHW), rank 2, a bool-tensor training, float16. renorm-rank4 runs on the
# stock kernels in make test-full only (suite_scope.covering): renorm takes the
# core's slow path, which no kernel set computes, and its oneDNN-off run is
# test_slim_renorm_claims' and the parity modules'. The TF1-behaviour pass runs
# the stock cases whose kernel-set calls TF1 changes (tf_behavior.pick): inside
# v1 tf.cond's Switch/Merge (a bool-tensor training), and 16-bit inputs under
# TF1's dtype rules; its rank-4 and rank-2 cases run on the compiled set.
STOCK_CASES = tf_behavior.pick(suite_scope.covering(
    [c for c in RUN_CASES if c['name'] in ('rank4', 'rank4-axis1', 'rank2',
                                           'training_tensor-rank4', 'renorm-rank4',
                                           'float16-rank4')],
    [c for c in RUN_CASES if c['name'] in ('rank4', 'rank4-axis1', 'rank2',
                                           'training_tensor-rank4', 'float16-rank4')]),
    [c for c in RUN_CASES if c['name'] in ('training_tensor-rank4', 'float16-rank4')])
NAMES = [c['name'] for c in RUN_CASES]
# One tower, where the layer normalizes alone (the core's local path): one case
# per path of tf-keras' (fused NHWC / NCHW, non-fused, a view, 16-bit, renorm,
# a bool tensor, the v1 class); every case runs on the towers below.
ONE_TOWER_CASES = [c for c in RUN_CASES if c['name'] in (
    'rank4', 'rank4-axis1', 'rank2', 'rank4-axis2', 'float16-rank4', 'renorm-rank4',
    'training_tensor-rank4', 'v1-rank4-axis1', 'v1-training_tensor-rank2')]
CLASSES = {'v2': sync_keras.BatchNormalization, 'v1': sync_keras.BatchNormalizationV1}


@pytest.fixture(scope='module')
def reference_dir(tmp_path_factory):
    """tf-keras' own layer on every case, one device, in one subprocess."""
    return keras_cases.reference_dir(tmp_path_factory)


@pytest.fixture(scope='module')
def keras_arrays(reference_dir):
    return reference_cases.load_arrays(reference_dir, RUN_CASES, 'tf-keras')


def _ours(case, sizes, kernel_impl=None):
    make = CLASSES[case.get('class', 'v2')]
    if len(sizes) > 1:
        make = functools.partial(make, sync_statistics=CollectiveBackend(timeout=60))
    with kernel_set(kernel_impl) if kernel_impl else contextlib.nullcontext():
        ours, info = train_case(
            lambda *args: keras_apply(make, case, *args),  # noqa: F821 - from MODEL
            case, RUN_CASES.index(case), sizes)
    if kernel_impl == 'stock':
        assert info['kernel_ops'] == 0, 'the stock kernel set used the compiled kernels'
    return ours, info


@pytest.mark.parametrize('case', ONE_TOWER_CASES, ids=lambda case: case['name'])
def test_one_tower_is_tf_keras(keras_arrays, case):
    ours, _ = _ours(case, [case['shape'][0]])
    assert_same_numbers(ours, keras_arrays[RUN_CASES.index(case)], case, 1)


@pytest.mark.parametrize('kernel_impl,case', kernel_cases(RUN_CASES, STOCK_CASES))
def test_towers_are_tf_keras_on_the_concatenated_batch(keras_arrays, case, kernel_impl):
    sizes = case.get('sizes', DEFAULT_SIZES)
    ours, _ = _ours(case, sizes, kernel_impl)
    assert_same_numbers(ours, keras_arrays[RUN_CASES.index(case)], case, len(sizes))


def test_the_variance_convention_is_exercised(keras_arrays):
    """tf-keras tracks the unbiased variance on its fused path, the biased one elsewhere.

    A check of the reference: the parity tests cannot pass with one
    convention everywhere.
    """
    expected = {'rank4': 1, 'rank4-axis1': 1, 'rank5-axis-1': 1, 'rank2': 0, 'rank3-axis1': 0,
                'fused=False-rank4': 0, 'synchronized=True-rank4': 0, 'v1-rank4-axis1': 1}
    checked = [name for name in expected if name in NAMES]
    assert {0, 1} <= {expected[name] for name in checked}
    for name in checked:
        ddof = expected[name]
        index = NAMES.index(name)
        case = RUN_CASES[index]
        x = case_data(case, index)['x/0']
        first = case['kwargs'].get('axis') == 1 and x.ndim > 2
        flat = (np.moveaxis(x, 1, -1) if first else x).reshape(-1, x.shape[1 if first else -1])
        moving = keras_arrays[index]['var/0/batch_normalization/moving_variance']
        momentum = case['kwargs']['momentum']
        tracked = [np.allclose(moving, momentum + (1 - momentum) * flat.var(0, ddof=d),
                               rtol=1e-5) for d in (0, 1)]
        assert tracked == [ddof == 0, ddof == 1], name

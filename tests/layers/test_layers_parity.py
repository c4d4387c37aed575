"""tf1_syncbn.layers behaves as tf.layers' batch normalization, option by option.

The invariant: N synchronized towers give what ``tf.compat.v1.layers.
batch_normalization`` (tf-keras' legacy layer) gives on one device with the
concatenated batch (here: 3 towers of 3, 0 and 5 examples): outputs, input
and parameter gradients, and every variable by name, the moving statistics
included, over three SGD steps; one tower gives it too, with the same
variables, collections, update ops and fused ops in the graph. The moving
variance tracks the Bessel-corrected batch variance where tf.layers runs its
fused kernel (rank 4 and 5), the biased one elsewhere (rank 2 and 3,
``fused=False``, renorm, adjustment).

The cases port tf-keras' own tests of the legacy layer (see
``layers_cases.py``); the reference is tf.layers itself, run once for all of
them in a subprocess (``layers_reference.py``). The multi-tower cases run on
the compiled CPU kernels in the test process, and (those of
:data:`STOCK_CASES`) on TensorFlow's stock kernels with oneDNN off (what GPU
towers run) in a child pytest that reuses the reference's results
(``without_onednn``). The structural tests
(``testCreateBN``, ``testFunctionalReuse``, ``testRegularizers``, ...) are
scenarios that both sides build and record.
"""

import contextlib
import functools

import numpy as np
import pytest
import tensorflow as tf

from layers_cases import PARITY_CASES, SCENARIOS, parity_apply, run_scenario
from layers_reference import REFERENCE_DIR_VARIABLE, reference_dir
from layers_reference import reference as run_layers_reference
import suite_scope
from parity_harness import DEFAULT_SIZES, assert_same_numbers, case_data, train_case
from without_onednn import kernel_set, kernel_cases, run_stock_cases_without_onednn
from tf1_syncbn import CollectiveBackend, layers

tf1 = tf.compat.v1
NAMES = [c['name'] for c in PARITY_CASES]
# The multi-tower cases that also run on the stock kernels with oneDNN off (the
# child run of test_stock_kernels_without_onednn, or this process where oneDNN
# is off): one per path of the core that tf.layers' rules choose (moments on
# rank 2, the fused kernel on an NCHW rank 4, rank 5 with axis 1, a bool-tensor
# `training` fused and not, renorm with a bool and with a tensor, adjustment),
# the 16-bit types and the large mean. The others vary axis spellings, options
# that only touch variables and update plumbing (initializers, constraints,
# partitions, momentum, trainable, the object API), or repeat a layout of
# these; the slim and tensorpack parity modules run the same core's stock
# kernels over every rank and layout. Of the other axis forms, one per view
# the core normalizes (tf1_syncbn._frontend.axes): a middle axis folded by a
# reshape, axes apart transposed (with renorm's separate ops too), ghost
# batches on a transposed view.
STOCK_PRODUCT = [PARITY_CASES[NAMES.index(name)] for name in NAMES if name in (
    'rank2', 'rank4-axis[1]-fused=True', 'bfloat16-rank5-axis1', 'training_tensor-rank4',
    'training_tensor-rank3-axis1', 'renorm-clipped-rank4-axis1',
    'renorm-training_tensor-rank4-axis1', 'adjustment-rank4-axis1', 'float16-rank4',
    'mean1e4-rank4', 'rank4-axis2-middle', 'rank4-axis[3,1]-apart',
    'renorm-rank4-axis[1,3]-training_tensor', 'virtual_batch-rank5-axis[1,4]',
    'renorm-adjustment-rank2')]
# make test runs a covering set of them (suite_scope.covering; make test-full
# all). The kernel set is what the core's fast path runs
# (tf1_syncbn._core.normalize: sync_normalize with kernel_sets.kernels_for); its
# slow path (renorm, adjustment, fused=False) and ghost batches build the same
# TensorFlow ops whichever the set, and so does every view
# (tf1_syncbn._frontend.axes), built before the core, which sees a 4-D NHWC or NCHW
# tensor. make test keeps the fast path in both layouts (NCHW: a folded middle
# view, bfloat16-rank5-axis1; NHWC: float16-rank4, mean1e4-rank4), in a tf.cond
# (training_tensor-rank4), in each 16-bit type and with the large mean, and one
# slow-path case (renorm-adjustment-rank2: renorm and adjustment, the ops oneDNN
# is turned off for in the child run). Left out, each covered by:
#   rank2 (rank 2 reaches the fast path as an NHWC view): mean1e4-rank4,
#     float16-rank4;
#   rank4-axis[1]-fused=True (fast path, NCHW): rank4-axis2-middle,
#     bfloat16-rank5-axis1;
#   training_tensor-rank3-axis1 (the fast path in a tf.cond, NCHW): in a
#     tf.cond: training_tensor-rank4; NCHW: as above;
#   renorm-clipped-rank4-axis1, renorm-training_tensor-rank4-axis1,
#     renorm-rank4-axis[1,3]-training_tensor, adjustment-rank4-axis1 (the slow
#     path): renorm-adjustment-rank2; on the compiled set (the same ops): these
#     cases themselves, where make test runs them;
#   virtual_batch-rank5-axis[1,4] (ghost batches, no kernel set): itself on the
#     compiled set;
#   rank4-axis[3,1]-apart (a transposed view, [N, S, 1, C]: what rank 2 and 4
#     NHWC inputs give the core too): mean1e4-rank4, float16-rank4.
STOCK_OUT_OF_MAKE_TEST = (
    'rank2', 'rank4-axis[1]-fused=True', 'training_tensor-rank3-axis1',
    'renorm-clipped-rank4-axis1', 'renorm-training_tensor-rank4-axis1',
    'renorm-rank4-axis[1,3]-training_tensor', 'adjustment-rank4-axis1',
    'virtual_batch-rank5-axis[1,4]', 'rank4-axis[3,1]-apart')
STOCK_CASES = suite_scope.covering(
    STOCK_PRODUCT, [c for c in STOCK_PRODUCT if c['name'] not in STOCK_OUT_OF_MAKE_TEST])
# The one-tower test (no synchronization: the graph's names, collections and
# update ops, and the numbers on one device) runs the cases of make test but
# these, whose one-tower graph is two kept cases' one-tower graphs put together
# (make test-full runs them all):
#   adjustment-rank4-axis1: adjustment (adjustment-rank5-axis2,
#     renorm-adjustment-rank2) on NCHW (fused=False-rank4-axis1);
#   rank4-axis2-fused=True-mean1e4: the large mean (mean1e4-rank4) on a folded
#     middle view, where tf.layers ignores fused=True (rank4-axis2-middle).
ONE_TOWER_OUT_OF_MAKE_TEST = ('adjustment-rank4-axis1', 'rank4-axis2-fused=True-mean1e4')
ONE_TOWER_CASES = suite_scope.covering(
    PARITY_CASES, [c for c in PARITY_CASES if c['name'] not in ONE_TOWER_OUT_OF_MAKE_TEST])


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    return run_layers_reference(tmp_path_factory)


def _reference(reference, case):
    ref, info = reference['parity'][PARITY_CASES.index(case)]
    if 'error' in info:
        pytest.fail('tf.layers itself failed on this case: %s' % info['error'])
    return ref, info


def _ours(case, sizes, kernel_impl=None):
    extra = {}
    if len(sizes) > 1:
        extra['sync_statistics'] = CollectiveBackend(timeout=60)
    apply = functools.partial(_apply, case, extra)
    with kernel_set(kernel_impl) if kernel_impl else contextlib.nullcontext():
        ours, info = train_case(apply, case, PARITY_CASES.index(case), sizes)
    if kernel_impl == 'stock':   # (the compiled set's slow paths use stock ops too)
        assert info['kernel_ops'] == 0, 'the stock kernel set used the compiled kernels'
    return ours, info


def _apply(case, extra, x, weights, training, tower, towers):
    del weights, towers
    return parity_apply(layers, case, x, training, tower, extra)


@pytest.mark.parametrize('case', ONE_TOWER_CASES, ids=[c['name'] for c in ONE_TOWER_CASES])
def test_one_tower_is_tf_layers(reference, case):
    ref, ref_info = _reference(reference, case)
    ours, info = _ours(case, [case['shape'][0]])
    assert_same_numbers(ours, ref, case, 1)
    for key in ('global_variables', 'model_variables', 'trainable_variables'):
        assert info[key] == ref_info[key], key
    # Update ops as tf.layers names them (with a bool tensor, tf.layers wraps
    # each one in a cond; ours are gated without one: the count is the same).
    if case.get('training_tensor'):
        assert len(info['update_ops']) == len(ref_info['update_ops'])
    else:
        assert info['update_ops'] == ref_info['update_ops']
    missing = set(ref_info['fused_ops']) - set(info['fused_ops'])
    assert not missing, 'tf.layers has fused ops %s, we do not' % sorted(missing)


@pytest.mark.parametrize('kernel_impl,case', kernel_cases(PARITY_CASES, STOCK_CASES))
def test_towers_are_tf_layers_on_the_concatenated_batch(reference, case, kernel_impl):
    """The compiled kernels here, the stock ones with oneDNN off in a child run.

    On 3 uneven towers, one empty; ghost batches (``virtual_batch_size``) on
    the case's ``sizes`` (towers of equal batches).
    """
    ref, ref_info = _reference(reference, case)
    sizes = case.get('sizes', DEFAULT_SIZES)
    ours, info = _ours(case, sizes, kernel_impl)
    assert_same_numbers(ours, ref, case, len(sizes))
    assert info['global_variables'] == ref_info['global_variables']
    assert info['trainable_variables'] == ref_info['trainable_variables']


def test_stock_kernels_without_onednn(tmp_path_factory, tmp_path):
    """The multi-tower cases on the stock kernels with oneDNN off (GPU towers' kernel set).

    In a child pytest (``without_onednn``), with tf.layers' results of this run.
    """
    run_stock_cases_without_onednn(
        __file__, tmp_path, expected=len(STOCK_CASES),
        extra_env={REFERENCE_DIR_VARIABLE: str(reference_dir(tmp_path_factory))})


def test_the_variance_convention_is_exercised(reference):
    """The reference tracks the unbiased variance fused (rank 4, 5), the biased one elsewhere.

    A check of the reference itself: the parity tests above cannot pass with
    one convention everywhere.
    """
    expected = {'rank4-axis3': 1, 'rank5-axis-4-object': 1, 'rank3-axis1': 0, 'rank2': 0,
                'fused=False-rank4-axis1': 0, 'fused=True-rank3-axis1': 0,
                # a middle axis or several axes: never fused, even on rank 4 and 5
                'rank4-axis2-middle': 0, 'rank3-axis[1,2]': 0, 'rank4-axis[3,1]-apart': 0}
    # (The TF1-behaviour pass runs some of these cases: both conventions still.)
    expected = {name: ddof for name, ddof in expected.items() if name in NAMES}
    assert set(expected.values()) == {0, 1}, expected
    for name, ddof in expected.items():
        index = NAMES.index(name)
        case = PARITY_CASES[index]
        x = case_data(case, index)['x/0']
        axis = case['kwargs']['axis']
        axes = sorted(a % x.ndim for a in (axis if isinstance(axis, list) else [axis]))
        others = [i for i in range(x.ndim) if i not in axes]
        channels = int(np.prod([x.shape[a] for a in axes]))
        flat = np.transpose(x, others + axes).reshape(-1, channels)   # row-major, as tf.layers
        moving = reference['parity'][index][0]['var/0/net/bn/moving_variance'].reshape(-1)
        momentum = case['kwargs']['momentum']
        tracked = [np.allclose(moving, momentum + (1 - momentum) * flat.var(0, ddof=d),
                               rtol=1e-5) for d in (0, 1)]
        assert tracked == [ddof == 0, ddof == 1], name


@pytest.mark.parametrize('name', sorted(SCENARIOS))
def test_object_api_names_and_collections_are_tf_layers(reference, name):
    """testCreateBN, testFunctionalReuse, testRegularizers, ...: the same record on both sides.

    Names of variables and layers, automatic numbering, reuse by ``name`` and
    by scope, the layer's lists (variables, trainable, updates, losses), the
    collections, regularization losses by name and value.
    """
    ref = reference['scenarios'][name]
    assert 'error' not in ref, ref
    ours = run_scenario(layers, name)
    if name == 'regularizers':
        np.testing.assert_allclose(ours.pop('values'), ref.pop('values'), rtol=1e-6)
    assert ours == ref


def _build(x, **kwargs):
    with tf.Graph().as_default():
        return layers.batch_normalization(tf1.placeholder(tf.float32, x), **kwargs)


@pytest.mark.parametrize('shape,kwargs,error,match', [
    # testMultiAxisInvalid: out of bounds, duplicate.
    ([6, 5, 4, 3], {'axis': [1, 4]}, ValueError, r'invalid axis=\[1, 4\] for inputs of rank 4'),
    ([6, 5, 4, 3], {'axis': [-5, 1]}, ValueError, r'invalid axis=\[-5, 1\]'),
    ([6, 5, 4, 3], {'axis': [1, 2, 1]}, ValueError, r'invalid axis=\[1, 2, 1\]'),
    # The batch axis: tf.layers' error with virtual batches; without, a
    # deliberate one (per-example statistics, variables the size of the batch).
    ([6, 5, 4, 3], {'axis': [0, 3], 'virtual_batch_size': 3}, ValueError,
     r'axis=\[0, 3\]: when using `virtual_batch_size`, the batch dimension must be 0'),
    ([6, 5, 4, 3], {'axis': -4, 'name': 'b'}, ValueError,
     r'batch_normalization\(b\): axis=-4 includes the batch axis 0'),
    # The normalized axes' sizes must be known (tf.layers' ValueError too).
    ([6, None, 4, 3], {'axis': [1, 3]}, ValueError, r'undefined `axis` dimension'),
    ([6, 5, 4, 3], {'virtual_batch_size': -1}, ValueError,
     r'virtual_batch_size must be a positive int, got -1'),
    ([6, 3], {'axis': 'a'}, TypeError, "argument 'axis'"),
    ([6, 3], {'renorm': True, 'renorm_clipping': {'x': 1}}, ValueError,
     r"unknown renorm_clipping key\(s\) \['x'\]"),
    ([6, 3], {'training': 0.5}, TypeError, r'training must be a Python bool or a scalar bool'),
    ([6, 3], {'gamma_initializer': 'glorot_uniform'}, TypeError, 'gamma_initializer must be'),
])
def test_errors_name_the_layer_and_the_argument(shape, kwargs, error, match):
    with pytest.raises(error, match=match):
        _build(shape, **kwargs)


def test_a_layer_object_keeps_the_rank_of_its_first_input_as_tf_layers():
    with tf.Graph().as_default():
        layer = layers.BatchNormalization(name='bn')
        layer(tf1.placeholder(tf.float32, [6, 4, 3]), training=True)
        layer(tf1.placeholder(tf.float32, [2, 5, 3]), training=True)      # same rank: fine
        with pytest.raises(ValueError, match=r'built on inputs of rank 3 .* rank 4'):
            layer(tf1.placeholder(tf.float32, [6, 4, 4, 3]), training=True)


def test_integer_and_numpy_training_values_are_bools_as_in_tf_layers():
    for training, trains in ((1, True), (0, False), (np.bool_(True), True)):
        with tf.Graph().as_default():
            layers.batch_normalization(tf1.placeholder(tf.float32, [6, 3]), training=training)
            assert bool(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)) == trains, training


def test_numpy_integer_axes_are_taken_and_a_bool_axis_is_refused():
    # tf.layers takes numpy integers (an axis read from a config or an array).
    for axis in ([np.int32(1)], np.int64(-1), (np.int64(1), 2)):
        y = _build([6, 5, 4], axis=axis, training=True)
        assert y.shape.as_list() == [6, 5, 4]
    with pytest.raises(TypeError, match="argument 'axis'"):       # a deliberate difference
        _build([6, 5, 4], axis=True)


def test_an_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['foo'\]"):
        layers.BatchNormalization(foo=1)

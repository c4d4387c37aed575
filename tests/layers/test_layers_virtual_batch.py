"""tf.layers' ghost batch norm (``virtual_batch_size``) on N towers equals tf.layers on one device.

tf.layers (tf-keras' legacy layer) reshapes the batch to ``[virtual_batch_size,
-1, ...]``, so that example ``j`` is in virtual batch ``j % groups``,
normalizes each virtual batch by its own statistics, moves the moving
statistics toward the means over the virtual batches of their means and
biased variances, and keeps its variables in shape ``[1, 1, ..., C]``. Over
``N`` towers of equal batches the library's strided virtual batches give
exactly that on the concatenated batch. The reference is tf.layers itself in a
legacy-Keras subprocess (``parity_harness.train_case``: 3 SGD steps, every
output, gradient and variable).
"""


import pytest
import tensorflow as tf

import tf1_syncbn
import reference_cases
import suite_scope
import tf_behavior
from parity_harness import assert_same_numbers, train_case
from tf1_syncbn import CollectiveBackend

tf1 = tf.compat.v1

MODEL = '''
def vbs_apply(layer, case, x, weights, training, tower, towers):
    kwargs = dict(case['kwargs'])
    if case.get('training_tensor') is None and tower is not None:
        training = True
    with tf1.variable_scope('net', reuse=True if tower is None else tf1.AUTO_REUSE):
        return layer(x, training=training, name='bn', **kwargs)
'''
exec(MODEL)  # noqa: S102 - defines vbs_apply here, as in the reference

REFERENCE_APPLY = '''
def reference_apply(case, *args):
    return vbs_apply(tf1.layers.batch_normalization, case, *args)
'''

CASES = [
    dict(name='rank4-NHWC', shape=[8, 3, 2, 3], kwargs={'virtual_batch_size': 4,
                                                          'momentum': 0.5}),
    dict(name='rank4-axis1', shape=[8, 3, 2, 2], kwargs={'virtual_batch_size': 2, 'axis': 1,
                                                           'momentum': 0.7, 'scale': False}),
    dict(name='rank2', shape=[8, 3], kwargs={'virtual_batch_size': 8, 'momentum': 0.5}),
    dict(name='rank3-training-tensor', shape=[8, 4, 3], training_tensor=True,
         kwargs={'virtual_batch_size': 4, 'momentum': 0.5}),
    # Other axis forms (testGhostBN5DimsMultiAxis14): the view keeps the batch
    # alone on axis 0 (a middle axis is transposed, not folded). fused=True:
    # tf.layers quietly takes its non-fused path, as with other options.
    dict(name='rank4-axis2-fused=True', shape=[8, 2, 3, 2],
         kwargs={'virtual_batch_size': 4, 'axis': 2, 'momentum': 0.5, 'fused': True}),
    dict(name='rank3-axis[1,2]-training-tensor', shape=[8, 2, 3], training_tensor=True,
         kwargs={'virtual_batch_size': 2, 'axis': [1, 2], 'momentum': 0.5}),
]
NAMES = [c['name'] for c in CASES]
# make test: every case on 2 towers, three on one (suite_scope.covering; make
# test-full: every case on both). One tower normalizes its virtual batches
# alone (no plan), 2 towers through the all-reduce; the view of the axes
# (channels last, a middle axis transposed, two axes) is the same code in
# both, and every case reaches it on 2 towers. The one-tower cases: the
# plain view, a middle axis with fused=True, two axes with a training tensor.
PRODUCT = [(name, towers) for name in NAMES for towers in (1, 2)]
COVERING = [(name, 2) for name in NAMES] + [
    (name, 1) for name in ('rank4-NHWC', 'rank4-axis2-fused=True',
                           'rank3-axis[1,2]-training-tensor')]
# The TF1-behaviour pass (tf_behavior.pick): the moving statistics are
# reference variables in every case; v1 tf.cond (Switch/Merge) on the training
# tensor, and Dimension shapes in the views: the plain view, a middle axis,
# and both training-tensor cases (one of them two axes, on 1 and 2 towers).
V1_CASES = [('rank4-NHWC', 2), ('rank4-axis2-fused=True', 2), ('rank3-training-tensor', 2),
            ('rank3-axis[1,2]-training-tensor', 2), ('rank3-axis[1,2]-training-tensor', 1)]
RUNS = sorted(tf_behavior.pick(suite_scope.covering(PRODUCT, COVERING), V1_CASES),
              key=PRODUCT.index)
# The cases this run trains (the reference trains these only).
RUN_CASES = [c for c in CASES if c['name'] in {name for name, _ in RUNS}]


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """This run's cases' arrays, as tf.layers computed them on one device (legacy Keras)."""
    directory = reference_cases.reference_dir(tmp_path_factory, 'vbs_reference', RUN_CASES,
                                              MODEL, REFERENCE_APPLY, timeout=300)
    return reference_cases.load_arrays(directory, RUN_CASES, 'tf.layers')


def _layer(towers):
    backend = CollectiveBackend(timeout=60) if towers > 1 else 'auto'

    def layer(x, **kwargs):
        return tf1_syncbn.layers.batch_normalization(x, sync_statistics=backend, **kwargs)

    return layer


@pytest.mark.parametrize('name,towers', RUNS, ids=['%s-%d' % run for run in RUNS])
def test_virtual_batches_equal_tf_layers_on_one_device(reference, name, towers):
    case = CASES[NAMES.index(name)]
    index = RUN_CASES.index(case)
    total = case['shape'][0]
    ours, _ = train_case(lambda *args: vbs_apply(_layer(towers), case, *args), case,  # noqa: F821
                         index, [total // towers] * towers)
    assert_same_numbers(ours, reference[index], case, towers)
    # tf.layers' shape: the input's with 1 but in the normalized axes, and a
    # leading 1 for the virtual-batch axis ([1, 1, ..., C] for the last axis).
    rank, axis = len(case['shape']), case['kwargs'].get('axis', -1)
    axes = [a % rank for a in (axis if isinstance(axis, list) else [axis])]
    assert list(ours['var/0/net/bn/moving_mean'].shape) == [1, 1] + [
        case['shape'][i] if i in axes else 1 for i in range(1, rank)]


@pytest.mark.once(reason='a check of the comparison, on the same code in both behaviours')
def test_the_strided_layout_matters(reference):
    """tensorpack's consecutive runs (a different grouping) would not match: the test can fail."""
    case = RUN_CASES[0]
    assert case is CASES[0]
    import tf1_syncbn._core.options as options_module

    original = options_module.check_options

    def runs_instead(*args, **kwargs):
        if kwargs.get('virtual_batch_style') == 'strided':
            kwargs['virtual_batch_style'] = 'runs'
        return original(*args, **kwargs)

    from unittest import mock
    with mock.patch('tf1_syncbn.layers.layer.check_options', runs_instead):
        ours, _ = train_case(lambda *args: vbs_apply(_layer(1), case, *args), case, 0, [8])  # noqa: F821
    with pytest.raises(AssertionError):
        assert_same_numbers(ours, reference[0], case, 1)


def test_fused_true_with_virtual_batches_takes_the_non_fused_path_as_tf_layers(graph):
    """tf.layers (tf-keras' V1 layer) accepts it and quietly runs without its fused kernel."""
    x = tf1.placeholder(tf.float32, [8, 2, 2, 3])
    layer = tf1_syncbn.layers.BatchNormalization(virtual_batch_size=4, fused=True)
    layer.apply(x, training=True)
    assert layer.fused is False and layer.axis == [4]
    assert layer.moving_variance.shape.as_list() == [1, 1, 1, 1, 3]

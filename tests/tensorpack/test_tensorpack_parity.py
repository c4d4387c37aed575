"""BatchNorm / BatchRenorm behave exactly like tensorpack 0.11's single-device layers.

The invariant: N synchronized towers give what tensorpack's layer gives on one
device with the concatenated batch (3 towers of 3, 0 and 5 examples; ghost
batch norm: 2 towers of 4, whose virtual batches interleave), and one tower
gives it too: outputs, input and parameter gradients, and every variable by
name, over several SGD steps.

tensorpack's 4-D path runs Keras' fused kernel (the moving variance tracks the
unbiased batch variance), its 2-D path the non-fused one and its ghost batch
norm ``tf.nn.moments`` (both: the biased variance). Its own *synchronized*
path tracks the biased ``E[x^2] - E[x]^2`` even on 4-D inputs; ours follows its
single-device path instead, which is what these tests compare with.

The reference is tensorpack itself, run once for every case of this module in
one subprocess with legacy Keras, through the same ``parity_harness.train_case``.

The multi-tower cases run on the compiled CPU kernels in the test process, and
on TensorFlow's stock kernels with oneDNN off (what GPU towers run) in a child
pytest that reuses the reference's results (``without_onednn``).
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_forward
from conftest import make_session
import reference_cases
import suite_scope
import tf_behavior
from parity_harness import DEFAULT_SIZES, assert_same_numbers, train_case
import tf1_syncbn
from tf1_syncbn import BatchNorm, CollectiveBackend
from without_onednn import kernel_set, kernel_cases, run_stock_cases_without_onednn

tf1 = tf.compat.v1

MODEL = '''
def tensorpack_apply(layers, case, x, training, tower, renorm_takes_training=False, **extra):
    """``layers.BatchNorm`` or ``layers.BatchRenorm`` on ``x`` for ``case``.

    tensorpack's BatchRenorm reads its mode from the tower context only.
    """
    kwargs = dict(case['kwargs'])
    kwargs.update(extra)
    with tf1.variable_scope('net', reuse=True if tower is None else None):
        if case.get('layer') == 'BatchRenorm':
            # tensorpack passes gamma_initializer=None on to tf.layers, whose
            # default for a weight is glorot_uniform: random. Ours defaults to ones.
            kwargs.setdefault('gamma_initializer', tf1.ones_initializer())
            if renorm_takes_training:
                kwargs['training'] = training
            return layers.BatchRenorm('bn', x, **kwargs)
        return layers.BatchNorm('bn', x, training=training, **kwargs)
'''
exec(MODEL)  # noqa: S102 - defines tensorpack_apply here, as in the reference

REFERENCE_APPLY = '''
import tensorpack.models as layers
from tensorpack.tfutils.tower import TowerContext


def reference_apply(case, x, weights, training, tower, towers):
    # tensorpack's layers read their mode from its tower context.
    with TowerContext('', is_training=tower is not None):
        return tensorpack_apply(layers, case, x, training, tower)
'''


def _case(name, shape, layer='BatchNorm', **options):
    kwargs = options.pop('kwargs', {})
    return dict(name=name, shape=shape, layer=layer, kwargs=kwargs, **options)


GHOST = dict(sizes=[4, 4], interleave=True)
CASES = [
    _case('2d', [8, 3]),
    _case('2d-momentum-epsilon', [8, 3], kwargs={'momentum': 0.8, 'epsilon': 1e-3}),
    _case('2d-legacy-names', [8, 3], kwargs={'decay': 0.7, 'use_bias': False}),
    _case('2d-no-affine', [8, 3], kwargs={'center': False, 'scale': False}),
    _case('2d-ema-skip', [8, 3], kwargs={'ema_update': 'skip'}),
    _case('4d-channels_last', [8, 3, 2, 3], kwargs={'momentum': 0.8}),
    _case('4d-channels_first', [8, 3, 3, 2], kwargs={'data_format': 'channels_first'}),
    _case('4d-axis=1', [8, 3, 3, 2], kwargs={'axis': 1, 'momentum': 0.7}),
    _case('4d-ema-internal', [8, 3, 2, 3], kwargs={'ema_update': 'internal'}),
    # A tiny variance (spread 1e-3) with momentum 0, so that the EMAs hold the
    # batch statistics themselves: from 1 with momentum 0.9, a variance of
    # ~1e-6 would move them by about one float32 ulp of 1 and nothing about
    # them could be checked. Tolerances are relative to the data's scale
    # (parity_harness.magnitude); see test_tiny_variance_case_rejects_a_wrong_answer.
    _case('4d-tiny-variance', [8, 3, 2, 3], loc=0.0, scale=1e-3,
          kwargs={'momentum': 0.0, 'epsilon': 1e-6}),
    _case('4d-float16', [8, 3, 2, 3], dtype='float16'),
    _case('4d-bfloat16-channels_first', [8, 3, 3, 2], dtype='bfloat16',
          kwargs={'data_format': 'channels_first'}),
    _case('2d-float16', [8, 3], dtype='float16'),
    # The README: "... for inputs whose mean is 10^4 times their spread"
    # (uneven towers, one empty: the default sizes).
    _case('4d-mean1e4', [8, 3, 2, 3], loc=1e4, scale=1.0, learning_rate=0.0),
    _case('4d-mean1e4-channels_first', [8, 3, 3, 2], loc=1e4, scale=1.0, learning_rate=0.0,
          kwargs={'data_format': 'channels_first'}),
    _case('2d-mean1e4', [8, 3], loc=1e4, scale=1.0, learning_rate=0.0),
    _case('renorm-4d-mean1e4', [8, 3, 2, 3], 'BatchRenorm', loc=1e4, scale=1.0,
          learning_rate=0.0,
          kwargs={'rmax': 3.0, 'dmax': 5.0, 'momentum': 0.8}),
    _case('2d-ghost', [8, 3], kwargs={'virtual_batch_size': 4, 'momentum': 0.8}, **GHOST),
    _case('4d-ghost-channels_last', [8, 2, 2, 3], kwargs={'virtual_batch_size': 4}, **GHOST),
    _case('4d-ghost-channels_first', [8, 3, 2, 2],
          kwargs={'virtual_batch_size': 4, 'data_format': 'channels_first'}, **GHOST),
    _case('renorm-4d-channels_last', [8, 3, 2, 3], 'BatchRenorm',
          kwargs={'rmax': 1.2, 'dmax': 0.2, 'momentum': 0.8}),
    _case('renorm-4d-channels_first', [8, 3, 3, 2], 'BatchRenorm',
          kwargs={'rmax': 3.0, 'dmax': 5.0, 'data_format': 'channels_first'}),
]
#: Every case, whichever the behaviour and the scope (the Horovod suite picks its own).
ALL_CASES = CASES
# make test runs a covering set of these cases (suite_scope.covering; make
# test-full all 22, in both behaviours). tensorpack's 2-D inputs reach this
# library's core as an NHWC view ([N, 1, 1, C]), its 4-D ones as NHWC or NCHW:
# a rank differs from another only in which variance the moving variance
# tracks (tensorpack's fused 4-D path: unbiased; its 2-D one: biased). The
# cases left out each repeat a layout, a convention and an option that kept
# cases carry:
#   2d: the defaults on 2-D inputs: 2d-no-affine, 2d-float16 (defaults otherwise);
#   4d-channels_last: 4-D NHWC fused: 4d-ema-internal, 4d-tiny-variance,
#     4d-mean1e4; momentum: 2d-momentum-epsilon, renorm-4d-channels_last;
#   4d-channels_first: data_format='channels_first' in float32:
#     4d-mean1e4-channels_first, renorm-4d-channels_first, 4d-ghost-channels_first;
#   4d-float16: float16 on the NHWC view: 2d-float16; a 16-bit type on the
#     fused 4-D path: 4d-bfloat16-channels_first;
#   2d-mean1e4: the large mean on the NHWC view: 4d-mean1e4, renorm-4d-mean1e4;
#   2d-ghost: ghost batches on the NHWC view: 4d-ghost-channels_last;
#     momentum with them: renorm-4d-channels_last (the same update code).
OUT_OF_MAKE_TEST = ('2d', '4d-channels_last', '4d-channels_first', '4d-float16', '2d-mean1e4',
                    '2d-ghost')
assert set(OUT_OF_MAKE_TEST) <= {c['name'] for c in CASES}
CASES = suite_scope.covering(CASES, [c for c in CASES if c['name'] not in OUT_OF_MAKE_TEST])
# The TF1-behaviour pass (tf_behavior.pick): one case per path that TF1
# behaviour changes. Reads of reference variables and their updates on each
# path: the 2-D one (2d-ema-skip), the fused 4-D one (4d-ema-internal), the
# ghost batches (4d-ghost-channels_last), renorm (renorm-4d-channels_first);
# each EMA update mode (skip, internal, and the default UPDATE_OPS one:
# 4d-bfloat16-channels_first); Dimension shapes of both layouts and both ranks;
# a 16-bit type. Not again in TF1 behaviour: the large mean, the tiny variance,
# float16 next to bfloat16 (numerics of the same kernels, which TF1 behaviour
# does not change), option spellings (legacy names, axis, momentum, epsilon).
V1_NAMES = ('2d-ema-skip', '4d-ema-internal', '4d-bfloat16-channels_first',
            '4d-ghost-channels_last', 'renorm-4d-channels_first')
assert set(V1_NAMES) <= {c['name'] for c in CASES}
CASES = tf_behavior.pick(CASES, [c for c in CASES if c['name'] in V1_NAMES])
NAMES = [c['name'] for c in CASES]
# The cases whose multi-tower run also runs on the stock kernels with oneDNN
# off (the child run of test_stock_kernels_without_onednn, or this process
# where oneDNN is off). Not the cases that vary only the variables' names and
# how the moving averages are assigned (tensorpack's legacy argument names, the
# EMA update modes), from the same batch statistics and gradients, which the
# kernel set does not touch: they run on the compiled kernels, in layouts the
# stock cases use too.
PLUMBING = ('2d-legacy-names', '2d-ema-skip', '4d-ema-internal')
STOCK_PRODUCT = [c for c in CASES if c['name'] not in PLUMBING]
# make test runs a covering set of them (suite_scope.covering; make test-full
# all). The kernel set is what the core's fast path runs
# (tf1_syncbn._core.normalize: sync_normalize with kernel_sets.kernels_for); its
# slow path (renorm) and ghost batches build the same TensorFlow ops whichever
# the set. make test keeps the fast path on 2-D and 4-D inputs in both layouts,
# in both 16-bit types, with the large mean and the tiny variance, without
# gamma and beta, and one slow-path case (renorm-4d-channels_first, for the
# ops oneDNN is turned off for in the child run). Left out, each covered by:
#   2d-momentum-epsilon: 2-D inputs: 2d-no-affine, 2d-float16; an epsilon of
#     its own: 4d-tiny-variance;
#   4d-mean1e4-channels_first: the large mean: 4d-mean1e4 (the same moments,
#     over other axes); NCHW: 4d-axis=1, 4d-bfloat16-channels_first;
#   4d-ghost-channels_first, 4d-ghost-channels_last (ghost batches, no kernel
#     set): themselves on the compiled set;
#   renorm-4d-channels_last, renorm-4d-mean1e4 (the slow path):
#     renorm-4d-channels_first; on the compiled set: themselves.
STOCK_OUT_OF_MAKE_TEST = ('2d-momentum-epsilon', '4d-mean1e4-channels_first',
                          '4d-ghost-channels_first', '4d-ghost-channels_last',
                          'renorm-4d-channels_last', 'renorm-4d-mean1e4')
STOCK_CASES = suite_scope.covering(
    STOCK_PRODUCT, [c for c in STOCK_PRODUCT if c['name'] not in STOCK_OUT_OF_MAKE_TEST])
# The one-tower test (no synchronization) runs the cases of make test but these,
# whose one-tower graph is two kept cases' one-tower graphs put together (make
# test-full runs them all):
#   renorm-4d-mean1e4: renorm (renorm-4d-channels_last) on the large mean (4d-mean1e4);
#   4d-mean1e4-channels_first: the large mean (4d-mean1e4) on NCHW (4d-axis=1);
#   4d-ghost-channels_first: ghost batches (4d-ghost-channels_last) on NCHW.
ONE_TOWER_OUT_OF_MAKE_TEST = ('renorm-4d-mean1e4', '4d-mean1e4-channels_first',
                              '4d-ghost-channels_first')
ONE_TOWER_CASES = suite_scope.covering(
    CASES, [c for c in CASES if c['name'] not in ONE_TOWER_OUT_OF_MAKE_TEST])

#: Where a child run (without_onednn) finds this module's reference results.
REFERENCE_DIR_VARIABLE = 'TF1_SYNCBN_TEST_TENSORPACK_PARITY_REFERENCE'


@pytest.fixture(scope='module')
def tensorpack_reference_dir(tmp_path_factory):
    """Runs every case with tensorpack itself, in one subprocess; returns its directory.

    A child run of this module (``test_stock_kernels_without_onednn``) reuses
    its parent's results instead of running tensorpack again.
    """
    return reference_cases.reference_dir(tmp_path_factory, 'tensorpack_parity', CASES, MODEL,
                                         REFERENCE_APPLY, REFERENCE_DIR_VARIABLE)


@pytest.fixture(scope='module')
def tensorpack_results(tensorpack_reference_dir):
    """Every case's reference arrays and graph info, as tensorpack computed them."""
    return reference_cases.load(tensorpack_reference_dir, CASES)


def _reference(results, case):
    ref, info = results[CASES.index(case)]
    if 'error' in info:
        pytest.fail('tensorpack itself failed on this case: %s' % info['error'])
    return ref, info


def _ours(case, sizes, kernel_impl=None):
    def apply(x, weights, training, tower, towers):
        extra = {'renorm_takes_training': True}
        if towers > 1 and tower is not None:
            extra['sync_statistics'] = CollectiveBackend(timeout=60)
        return tensorpack_apply(tf1_syncbn, case, x, training, tower, **extra)  # noqa: F821

    with kernel_set(kernel_impl) if kernel_impl else contextlib.nullcontext():
        ours, info = train_case(apply, case, CASES.index(case), sizes)
    if kernel_impl == 'stock':   # (the compiled set's slow paths use stock ops too)
        assert info['kernel_ops'] == 0, 'the stock kernel set used the compiled kernels'
    return ours, info


@pytest.mark.parametrize('case', ONE_TOWER_CASES, ids=[c['name'] for c in ONE_TOWER_CASES])
def test_one_tower_is_tensorpack(tensorpack_results, case):
    ref, ref_info = _reference(tensorpack_results, case)
    ours, info = _ours(case, [case['shape'][0]])
    assert_same_numbers(ours, ref, case, 1)
    for key in ('global_variables', 'trainable_variables'):
        assert info[key] == ref_info[key], key
    if case.get('interleave'):
        # tensorpack's own (ghost) path registers the moving statistics as model
        # variables. Its Keras path means to, but on TF 2.21 its isinstance(v,
        # tf.Variable) test is false for Keras' variables; ours registers them.
        assert info['model_variables'] == ref_info['model_variables']
    else:
        assert info['model_variables'] == [v for v in ref_info['global_variables']
                                           if v not in ref_info['trainable_variables']]


@pytest.mark.parametrize('kernel_impl,case', kernel_cases(CASES, STOCK_CASES))
def test_towers_are_tensorpack_on_the_concatenated_batch(tensorpack_results, case, kernel_impl):
    """The compiled kernels here, the stock ones with oneDNN off in a child run.

    (One tower does not synchronize: its test runs once.)
    """
    ref, ref_info = _reference(tensorpack_results, case)
    sizes = case.get('sizes', DEFAULT_SIZES)
    ours, info = _ours(case, sizes, kernel_impl)
    assert_same_numbers(ours, ref, case, len(sizes))
    assert info['global_variables'] == ref_info['global_variables']


@pytest.mark.parametrize('example_shape,unbiased', [
    ((4, 3), False), ((2, 2, 1, 3), False), ((2, 2, 3), True)])
def test_ranks_tensorpack_rejects_follow_its_code(graph, rng, example_shape, unbiased):
    """Rank 3 and 5 (tensorpack asserts rank 2 or 4) are not fused there: biased."""
    x = tf1.placeholder(tf.float32, (None,) + example_shape)
    y = BatchNorm('bn', x, momentum=0.0, ema_update='internal')
    data = (rng.randn(6, *example_shape) * 2 + 1).astype(np.float32)
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(y, {x: data})
        moving = sess.run(tf1.global_variables('bn/variance/EMA')[0])
    expected = bn_forward(data, 1, 0, 1e-5)['var_unbiased' if unbiased else 'var']
    np.testing.assert_allclose(moving, expected, rtol=1e-5)


def test_stock_kernels_without_onednn(tensorpack_reference_dir, tmp_path):
    """The multi-tower cases on the stock kernels with oneDNN off (GPU towers' kernel set).

    In a child pytest (``without_onednn``), with tensorpack's results of this run.
    """
    run_stock_cases_without_onednn(
        __file__, tmp_path, expected=len(STOCK_CASES),
        extra_env={REFERENCE_DIR_VARIABLE: str(tensorpack_reference_dir)})


@pytest.mark.once(reason='a check of the tolerances on the reference numbers, which TF1 '
                         'behaviour does not change (the case runs in the TF2 pass only)')
def test_tiny_variance_case_rejects_a_wrong_answer(tensorpack_results):
    """The tiny-variance comparisons mean something: wrong answers fail them.

    Data of spread 1e-3: the EMAs hold batch means ~1e-4 and variances ~1e-6.
    With ``atol`` relative to max(|value|, 1), as it was (and the EMAs
    starting at 1 with momentum 0.9), the unbiased variance instead of the
    biased one (a factor 48/47) or a mean off by 1% passed. Relative to the
    data's scale they fail; the reference itself passes.
    """
    case = CASES[NAMES.index('4d-tiny-variance')]
    ref, _ = _reference(tensorpack_results, case)
    assert_same_numbers(dict(ref), ref, case, 1)
    for pattern, factor in (('variance/EMA', 48.0 / 47.0), ('mean/EMA', 1.01)):
        wrong = {k: v * factor if pattern in k else v for k, v in ref.items()}
        assert any(pattern in k for k in ref)
        with pytest.raises(AssertionError, match=pattern):
            assert_same_numbers(wrong, ref, case, 1)

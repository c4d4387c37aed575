"""sync_batch_norm behaves exactly like tf-slim 1.1's slim.batch_norm, option by option.

The invariant: N synchronized towers give what ``slim.batch_norm`` gives on one
device with the concatenated batch (here: 3 towers of 3, 0 and 5 examples):
outputs, input and parameter gradients, and every variable by name, moving
statistics included, over several SGD steps; one tower gives it too, with the
same op names, update ops and variable collections in the graph.

Which variance the moving variance tracks follows slim's own path: the
Bessel-corrected one where slim runs its fused kernel (rank 2 and 4, and 5 on
its Keras path), the biased one on its non-fused paths (``fused=False``,
rank 3, ``batch_weights``, ``adjustment``, renorm, and rank 5 with
``zero_debias_moving_mean`` or another ``updates_collections``).

The reference is tf-slim itself, run once for every case of this module in one
subprocess with legacy Keras (``legacy_reference.py``), through the same
``parity_harness.train_case`` as this library.

The multi-tower cases run on the compiled CPU kernels in the test process, and
on TensorFlow's stock kernels with oneDNN off (what GPU towers run) in a child
pytest that reuses the reference's results (``without_onednn``).
"""

import contextlib
import functools

import numpy as np
import pytest
import tensorflow as tf

import reference_cases
import suite_scope
import tf_behavior
from parity_harness import DEFAULT_SIZES, assert_same_numbers, train_case
from without_onednn import kernel_set, kernel_cases, run_stock_cases_without_onednn
from tf1_syncbn import CollectiveBackend, sync_batch_norm

tf1 = tf.compat.v1

# What both sides build: the same code, with slim.batch_norm or sync_batch_norm.
MODEL = '''
def adjustment(shape):
    """A deterministic adjustment (channels last): scale and bias per channel."""
    channels = tf.cast(shape[-1], tf.float32)
    index = tf.range(channels)
    return 1.0 + 0.25 * index, 0.1 * index - 0.1


def slim_apply(layer, case, x, weights, training, tower, towers):
    """``layer`` (slim.batch_norm or sync_batch_norm) on ``x`` for ``case``."""
    kwargs = dict(case['kwargs'])
    if case.get('decay_tensor'):
        kwargs['decay'] = tf.constant(kwargs['decay'], tf.float32)
    if case.get('batch_weights') and tower is not None:
        kwargs['batch_weights'] = weights
    if case.get('adjustment'):
        kwargs['adjustment'] = adjustment
    if 'updates_collections' in case:
        kwargs['updates_collections'] = case['updates_collections']
    if case.get('zero_moving_variance'):
        kwargs['param_initializers'] = {'moving_variance': tf1.zeros_initializer()}
    partitioner = None
    if case.get('partitions'):
        partitioner = tf1.fixed_size_partitioner(case['partitions'])
    with tf1.variable_scope('net', partitioner=partitioner,
                            reuse=True if tower is None else None):
        return layer(x, scope='bn', is_training=training, **kwargs)
'''
exec(MODEL)  # noqa: S102 - defines slim_apply and adjustment here, as in the reference

REFERENCE_APPLY = '''
import tf_slim as slim


def reference_apply(case, *args):
    return slim_apply(slim.batch_norm, case, *args)
'''

# ---------------------------------------------------------------------------
# The cases.

SHAPES = {  # (rank, data_format) -> the global batch's shape, 3 channels
    (2, 'NHWC'): [8, 3], (2, 'NCHW'): [8, 3],
    (3, 'NHWC'): [8, 4, 3], (3, 'NCHW'): [8, 3, 4],
    (4, 'NHWC'): [8, 3, 2, 3], (4, 'NCHW'): [8, 3, 3, 2],
    (5, 'NHWC'): [8, 2, 2, 1, 3], (5, 'NCHW'): [8, 3, 2, 1, 2],
}
BASE = {'decay': 0.8, 'scale': True, 'epsilon': 1e-3}


def _case(name, rank=4, data_format='NHWC', channels=None, **options):
    shape = list(SHAPES[(rank, data_format)])
    if channels is not None:
        shape[-1 if data_format == 'NHWC' or rank == 2 else 1] = channels
    kwargs = dict(BASE, data_format=data_format)
    kwargs.update(options.pop('kwargs', {}))
    return dict(name=name, shape=shape, kwargs=kwargs, **options)


PRODUCT = [(fused, rank, fmt) for fused in (None, True, False) for rank in (2, 3, 4, 5)
           for fmt in ('NHWC', 'NCHW')]
# make test runs a covering set of the fused x rank x layout product
# (suite_scope.covering; make test-full all 24): every pair of values (each
# fused with each rank and each layout, each rank in both layouts) in 12 cases.
# What a triple left out would add is covered: the kernel for a rank and layout
# is chosen by slim's fused resolution (fused=None resolves to True where the
# fused kernel applies), so fused=None and fused=True reach the same kernel, and
# every rank meets the fused kernel in both layouts across them.
COVERING = [(None, 2, 'NHWC'), (None, 3, 'NCHW'), (None, 4, 'NCHW'), (None, 5, 'NHWC'),
            (True, 2, 'NCHW'), (True, 3, 'NHWC'), (True, 4, 'NHWC'), (True, 5, 'NCHW'),
            (False, 2, 'NHWC'), (False, 3, 'NCHW'), (False, 4, 'NHWC'), (False, 5, 'NCHW')]


def _product_case(fused, rank, fmt):
    return _case('fused=%s-rank%d-%s' % (fused, rank, fmt), rank, fmt, kwargs={'fused': fused})


OPTION_CASES = [
    # Options that no fused kernel computes: slim's non-fused paths (biased variance).
    _case('adjustment-rank4', adjustment=True),
    _case('adjustment-rank2-fused=True', 2, adjustment=True, kwargs={'fused': True}),
    _case('batch_weights-rank4', batch_weights=True),
    _case('batch_weights-rank3-NCHW', 3, 'NCHW', batch_weights=True),
    _case('renorm-rank4', kwargs={'renorm': True, 'renorm_decay': 0.7, 'renorm_clipping': {
        'rmax': 1.5, 'rmin': 0.8, 'dmax': 0.3}}),
    _case('renorm-rank2-fused=True', 2, kwargs={'renorm': True, 'fused': True}),
    _case('renorm-rank4-NCHW-unclipped', 4, 'NCHW', kwargs={'renorm': True}),
    # zero_debias_moving_mean: slim's fused function (rank 2, 4) or its moments path.
    _case('zero_debias-rank4', kwargs={'zero_debias_moving_mean': True}),
    _case('zero_debias-rank2', 2, kwargs={'zero_debias_moving_mean': True}),
    _case('zero_debias-rank4-fused=False', kwargs={'zero_debias_moving_mean': True,
                                                    'fused': False}),
    _case('zero_debias-rank3', 3, kwargs={'zero_debias_moving_mean': True}),
    _case('zero_debias-rank5-NCHW', 5, 'NCHW', kwargs={'zero_debias_moving_mean': True}),
    # updates_collections other than UPDATE_OPS (slim compares by identity).
    _case('updates=None-rank4', updates_collections=None),
    _case('updates=None-rank2', 2, updates_collections=None),
    _case('updates=None-rank3', 3, updates_collections=None),
    _case('updates=None-rank5', 5, updates_collections=None),
    _case('updates=list-rank5', 5, updates_collections=['update_ops']),
    _case('updates=list-rank4-NCHW', 4, 'NCHW', updates_collections=['update_ops']),
    # Partitioned variable scopes: beta/gamma partitioned, statistics not.
    _case('partitioned-rank4', channels=4, partitions=2),
    _case('partitioned-rank4-updates=None', channels=4, partitions=2,
          updates_collections=None),
    _case('partitioned-rank3', 3, channels=4, partitions=2),
    _case('partitioned-rank3-updates=None', 3, channels=4, partitions=2,
          updates_collections=None),
    # (slim fails on its fused path with zero_debias_moving_mean in a
    # partitioned scope: it partitions moving_mean/biased.)
    _case('partitioned-rank2-updates=None', 2, channels=4, partitions=2,
          updates_collections=None),
    # decay: a tensor, and slim's default 0.999 (Keras' fused path computes
    # 1 - decay in float32, slim's own paths in double: checked tightly).
    _case('decay_tensor-rank4', decay_tensor=True),
    _case('decay_tensor-rank3', 3, decay_tensor=True),
    _case('decay=0.999-rank4', kwargs={'decay': 0.999}, loc=3.0, scale=1.0, tight=True),
    _case('decay=0.999-rank2', 2, kwargs={'decay': 0.999}, loc=3.0, scale=1.0, tight=True),
    _case('decay=0.999-rank5-updates=None', 5, kwargs={'decay': 0.999}, loc=3.0, scale=1.0,
          updates_collections=None, tight=True),
    # A tiny variance with a tiny epsilon (TensorFlow 2.21's fused kernel takes
    # epsilon as given, as the non-fused path does). The moving variance starts
    # at 0: from 1, a variance of ~1e-6 would move it by a few float32 ulps of
    # 1 and nothing about it could be checked. With tolerances relative to the
    # data's scale (parity_harness.magnitude), see
    # test_tiny_variance_cases_reject_a_wrong_answer.
    _case('tiny_variance-rank4', kwargs={'epsilon': 1e-6}, loc=0.0, scale=1e-3,
          zero_moving_variance=True),
    _case('tiny_variance-rank3', 3, kwargs={'epsilon': 1e-6}, loc=0.0, scale=1e-3,
          zero_moving_variance=True),
    # The README: "... in float16/bfloat16 as in float32, and for inputs whose
    # mean is 10^4 times their spread", on every path of slim's. (Large means:
    # learning rate 0, see parity_harness.tolerances.)
    _case('float16-rank4', dtype='float16'),
    _case('float16-rank4-NCHW', 4, 'NCHW', dtype='float16'),
    _case('float16-rank2', 2, dtype='float16'),
    _case('float16-rank3', 3, dtype='float16'),
    _case('float16-rank5', 5, dtype='float16'),
    _case('float16-rank4-fused=False', kwargs={'fused': False}, dtype='float16'),
    _case('bfloat16-rank4-NCHW', 4, 'NCHW', dtype='bfloat16'),
    _case('bfloat16-rank3', 3, dtype='bfloat16'),
    _case('bfloat16-rank4-fused=False', kwargs={'fused': False}, dtype='bfloat16'),
    _case('mean1e4-rank4', loc=1e4, scale=1.0, learning_rate=0.0),
    _case('mean1e4-rank4-NCHW', 4, 'NCHW', loc=1e4, scale=1.0, learning_rate=0.0),
    _case('mean1e4-rank3', 3, loc=1e4, scale=1.0, learning_rate=0.0),
    _case('mean1e4-rank5', 5, loc=1e4, scale=1.0, learning_rate=0.0),
    _case('mean1e4-batch_weights-rank4', batch_weights=True, loc=1e4, scale=1.0,
          learning_rate=0.0),
    # is_training as a tensor; center/scale off.
    _case('training_tensor-rank4', training_tensor=True),
    # (slim's Keras non-fused path wraps each update in its own tf.cond, named
    # cond_<i>; ours gates them without one: the update ops' names differ.)
    _case('training_tensor-rank3', 3, training_tensor=True, update_names_differ=True),
    _case('no_center_no_scale-rank4', kwargs={'center': False, 'scale': False}),
]
# The TF1-behaviour pass (tf_behavior.pick): one case per path that TF1
# behaviour changes: every rank and layout of the fast path (Dimension shapes),
# the slow paths' reads of reference variables (fused=False, renorm, batch
# weights, adjustment), the update plumbing that assigns reference variables
# (zero-debias, updates_collections, partitions, a tensor decay), slim's v1
# tf.cond (a tensor is_training), the 16-bit types and the large mean.
V1_NAMES = ('fused=None-rank2-NHWC', 'fused=None-rank3-NCHW', 'fused=None-rank4-NCHW',
            'fused=None-rank5-NHWC', 'fused=True-rank2-NCHW', 'fused=False-rank4-NHWC',
            'fused=False-rank5-NCHW', 'adjustment-rank4', 'batch_weights-rank3-NCHW',
            'renorm-rank4', 'renorm-rank4-NCHW-unclipped', 'zero_debias-rank4',
            'zero_debias-rank4-fused=False', 'updates=None-rank4', 'updates=list-rank5',
            'partitioned-rank4', 'partitioned-rank3-updates=None', 'decay_tensor-rank4',
            'tiny_variance-rank4', 'float16-rank4', 'bfloat16-rank4-NCHW', 'mean1e4-rank4',
            'training_tensor-rank4', 'training_tensor-rank3', 'no_center_no_scale-rank4')
#: Every case, whichever the behaviour and the scope (the Horovod suite picks its own).
ALL_CASES = [_product_case(*key) for key in PRODUCT] + OPTION_CASES
CASES = [_product_case(*key) for key in suite_scope.covering(PRODUCT, COVERING)] + OPTION_CASES
CASES = tf_behavior.pick(CASES, [c for c in CASES if c['name'] in V1_NAMES])
NAMES = [c['name'] for c in CASES]
assert len(set(NAMES)) == len(NAMES)
# The cases whose multi-tower run also runs on the stock kernels with oneDNN off
# (the child run of test_stock_kernels_without_onednn). The others vary only
# which variables exist and how the moving averages are assigned (partitions,
# update collections, decay, zero-debiasing), from the same batch statistics
# and gradients, which the kernel set does not touch: their cases run on the
# compiled kernels, and every layout they use is in the first list.
PLUMBING = ('zero_debias', 'updates=', 'partitioned', 'decay')


def _slow_path(case):
    """Whether the core takes its slow path (``tf1_syncbn._core.normalize.needs_slow_path``).

    Batch weights, renorm, adjustment and ``fused=False`` compute differentiable
    global moments from TensorFlow ops (``_compute.engine.global_moments``) and
    never call a kernel set: their stock run builds the graph of their compiled
    run, op for op.
    """
    kwargs = case['kwargs']
    return bool(case.get('batch_weights') or case.get('adjustment') or kwargs.get('renorm')
                or kwargs.get('fused') is False)


# make test runs one slow-path case on the stock kernels (renorm-rank4, to show
# the stock set leaves the slow path as it is); make test-full runs all of them.
STOCK_CASES = [c for c in CASES if not c['name'].startswith(PLUMBING)
               and (not _slow_path(c) or suite_scope.full() or c['name'] == 'renorm-rank4')]


#: Where a child run (without_onednn) finds this module's reference results.
REFERENCE_DIR_VARIABLE = 'TF1_SYNCBN_TEST_SLIM_PARITY_REFERENCE'


@pytest.fixture(scope='module')
def slim_reference_dir(tmp_path_factory):
    """Runs every case with tf-slim itself, in one subprocess; returns its directory.

    A child run of this module (``test_stock_kernels_without_onednn``) reuses
    its parent's results instead of running tf-slim again.
    """
    return reference_cases.reference_dir(tmp_path_factory, 'slim_parity', CASES, MODEL,
                                         REFERENCE_APPLY, REFERENCE_DIR_VARIABLE)


@pytest.fixture(scope='module')
def slim_results(slim_reference_dir):
    """Every case's reference arrays and graph info, as tf-slim computed them."""
    return reference_cases.load(slim_reference_dir, CASES)


def _reference(slim_results, case):
    ref, info = slim_results[CASES.index(case)]
    if 'error' in info:
        pytest.fail('tf-slim itself failed on this case: %s' % info['error'])
    return ref, info


def _ours(case, sizes, kernel_impl=None):
    towers = len(sizes)
    layer = sync_batch_norm
    if towers > 1:
        layer = functools.partial(sync_batch_norm, sync_statistics=CollectiveBackend(timeout=60))
    with kernel_set(kernel_impl) if kernel_impl else contextlib.nullcontext():
        ours, info = train_case(lambda *args: slim_apply(layer, case, *args), case,  # noqa: F821
                                CASES.index(case), sizes)
    if kernel_impl == 'stock':   # (the compiled set's slow paths use stock ops too)
        assert info['kernel_ops'] == 0, 'the stock kernel set used the compiled kernels'
    return ours, info


@pytest.mark.parametrize('case', CASES, ids=NAMES)
def test_one_tower_is_slim(slim_results, case):
    ref, ref_info = _reference(slim_results, case)
    ours, info = _ours(case, [case['shape'][0]])
    assert_same_numbers(ours, ref, case, 1)
    # The graph: variables and collections, update ops and op names as slim's.
    keys = ['global_variables', 'model_variables', 'trainable_variables']
    if not case.get('update_names_differ'):
        keys += ['update_ops', 'assign_ops']
    for key in keys:
        assert info[key] == ref_info[key], key
    missing = set(ref_info['fused_ops']) - set(info['fused_ops'])
    assert not missing, 'slim has fused ops %s, we do not' % sorted(missing)


@pytest.mark.parametrize('kernel_impl,case', kernel_cases(CASES, STOCK_CASES))
def test_towers_are_slim_on_the_concatenated_batch(slim_results, case, kernel_impl):
    """The compiled kernels here, the stock ones with oneDNN off in a child run.

    (One tower does not synchronize: its test runs once.)
    """
    ref, ref_info = _reference(slim_results, case)
    sizes = case.get('sizes', DEFAULT_SIZES)
    ours, info = _ours(case, sizes, kernel_impl)
    assert_same_numbers(ours, ref, case, len(sizes))
    assert info['global_variables'] == ref_info['global_variables']
    assert info['model_variables'] == ref_info['model_variables']


def test_the_variance_convention_is_exercised(slim_results):
    """The moving variance is unbiased on slim's fused paths, biased on the others.

    A check of the reference itself, so that the parity tests above cannot pass
    with one convention everywhere.
    """
    from parity_harness import case_data  # noqa: PLC0415
    expected = {
        'fused=None-rank4-NHWC': 'unbiased', 'fused=None-rank2-NHWC': 'unbiased',
        'fused=None-rank5-NCHW': 'unbiased', 'fused=None-rank4-NCHW': 'unbiased',
        'fused=None-rank3-NHWC': 'biased', 'fused=None-rank3-NCHW': 'biased',
        'updates=None-rank5': 'biased', 'fused=False-rank2-NHWC': 'biased',
        'fused=False-rank4-NHWC': 'biased'}
    # (The TF1-behaviour pass runs some of these cases: both conventions still.)
    expected = {name: kind for name, kind in expected.items() if name in NAMES}
    assert set(expected.values()) == {'unbiased', 'biased'}, expected
    tracked = {}
    for index, case in enumerate(CASES):
        if case['name'] not in expected:
            continue
        ref, _ = slim_results[index]
        x = case_data(case, index)['x/0']
        channels_last = case['kwargs']['data_format'] == 'NHWC' or x.ndim == 2
        flat = (x if channels_last else np.moveaxis(x, 1, -1)).reshape(-1, 3)
        decay = case['kwargs']['decay']
        moving = ref['var/0/net/bn/moving_variance']
        for ddof in (0, 1):
            if np.allclose(moving, decay + (1 - decay) * flat.var(0, ddof=ddof), rtol=1e-5):
                tracked[case['name']] = 'unbiased' if ddof else 'biased'
    assert tracked == expected


def test_stock_kernels_without_onednn(slim_reference_dir, tmp_path):
    """The multi-tower cases on the stock kernels with oneDNN off (GPU towers' kernel set).

    In a child pytest (``without_onednn``), with tf-slim's results of this run.
    """
    run_stock_cases_without_onednn(__file__, tmp_path, expected=len(STOCK_CASES),
                                   extra_env={REFERENCE_DIR_VARIABLE: str(slim_reference_dir)})


@pytest.mark.parametrize('name', [n for n in ('tiny_variance-rank4', 'tiny_variance-rank3')
                                  if n in NAMES])
def test_tiny_variance_cases_reject_a_wrong_answer(slim_results, name):
    """The tiny-variance comparisons mean something: wrong answers fail them.

    Data of spread 1e-3: batch variances ~1e-6, moving means ~1e-4, a moving
    variance (from 0) ~1e-6. With ``atol`` relative to max(|value|, 1), as it
    was, a moving variance off by the Bessel factor (1/47 of ~1e-6, the biased
    instead of the unbiased variance) or a moving mean off by 1% passed,
    since both differences are far below ``1e-6 * 1``. Relative to the data's
    scale they fail; the reference itself passes.
    """
    case = CASES[NAMES.index(name)]
    ref, _ = _reference(slim_results, case)
    assert_same_numbers(dict(ref), ref, case, 1)
    for pattern, factor in (('moving_variance', 46.0 / 47.0), ('moving_mean', 1.01)):
        wrong = {k: v * factor if pattern in k else v for k, v in ref.items()}
        assert any(pattern in k for k in ref)
        with pytest.raises(AssertionError, match=pattern):
            assert_same_numbers(wrong, ref, case, 1)

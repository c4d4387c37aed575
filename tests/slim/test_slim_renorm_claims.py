"""Renorm together with batch_weights, zero_debias_moving_mean and updates_collections=None.

The README: "Two extensions: renorm works together with ``batch_weights``,
``zero_debias_moving_mean`` and ``updates_collections=None`` (slim raises)".
slim cannot be the reference directly, so each combination is compared with
tf-slim itself (in a subprocess with legacy Keras, ``legacy_reference.py``)
running plain renorm on an equivalent problem:

* ``updates_collections=None`` updates inside the layer, in the same step:
  the same numbers as slim's renorm with its ``UPDATE_OPS`` run as control
  dependencies of the train op (what ``parity_harness.train_case`` does).
* ``batch_weights`` of whole numbers ``w_i`` (1, 2 or 3 here): the weighted
  moments ``sum(w x) / sum(w)`` and ``sum(w (x - mean)^2) / sum(w)`` are the
  moments of the batch in which example ``i`` appears ``w_i`` times. slim's
  renorm runs on that batch (``tf.gather`` of repeated rows, so the gradient
  of each example sums over its copies), and each example's output is its
  first copy's.
* ``zero_debias_moving_mean``: ``assign_moving_average(zero_debias=True)``
  keeps ``biased`` (the plain moving average from 0, which is what slim's
  renorm ``moving_mean`` is), counts steps in ``local_step``, and sets
  ``moving_mean = biased / (1 - decay^step)`` (float64 here). Inference uses
  that moving mean: its output is recomputed with numpy from slim's final
  variables.

Every case on one tower and on 3 uneven towers (one empty): on the compiled
kernels, and on the stock kernels with oneDNN off in a child run
(``without_onednn``).
"""

import contextlib
import functools

import numpy as np
import pytest
import tensorflow as tf

import reference_cases
import suite_scope
import tf_behavior
from parity_harness import DEFAULT_SIZES, STEPS, assert_same_numbers, case_data, train_case
from tf1_syncbn import CollectiveBackend, sync_batch_norm
from without_onednn import kernel_set, kernel_cases, run_stock_cases_without_onednn

tf1 = tf.compat.v1

MODEL = '''
def renorm_apply(layer, case, x, weights, training, tower, towers, reference=False):
    """Renorm with the case's extensions (ours), or slim's plain renorm emulating them."""
    kwargs = dict(case['kwargs'])
    repeat = False
    if reference:
        repeat = case.get('batch_weights') and tower is not None
    else:
        if case.get('batch_weights') and tower is not None:
            kwargs['batch_weights'] = weights
        if case.get('updates_none'):
            kwargs['updates_collections'] = None
        if case.get('zero_debias'):
            kwargs['zero_debias_moving_mean'] = True
    with tf1.variable_scope('net', reuse=True if tower is None else None):
        if not repeat:
            return layer(x, scope='bn', is_training=training, **kwargs)
        counts = tf.cast(weights, tf.int32)
        rows = tf.repeat(tf.range(tf.shape(x)[0]), counts)
        y = layer(tf.gather(x, rows), scope='bn', is_training=training, **kwargs)
        return tf.gather(y, tf.cumsum(counts, exclusive=True))
'''
exec(MODEL)  # noqa: S102 - defines renorm_apply here, as in the reference

REFERENCE_APPLY = '''
import tf_slim as slim


def reference_apply(case, *args):
    return renorm_apply(slim.batch_norm, case, *args, reference=True)
'''

RENORM = {'renorm': True, 'renorm_decay': 0.7,
          'renorm_clipping': {'rmax': 1.5, 'rmin': 0.8, 'dmax': 0.3}}


def _case(name, shape, data_format='NHWC', **options):
    kwargs = dict(decay=0.8, scale=True, epsilon=1e-3, data_format=data_format, **RENORM)
    return dict(name=name, shape=shape, kwargs=kwargs, **options)


CASES = [
    _case('updates=None', [8, 3, 2, 3], updates_none=True),
    _case('batch_weights', [8, 3, 2, 3], batch_weights=True, integer_weights=True),
    _case('zero_debias', [8, 3, 2, 3], zero_debias=True),
    _case('all-three-NCHW', [8, 3, 3, 2], 'NCHW', updates_none=True, batch_weights=True,
          integer_weights=True, zero_debias=True),
    _case('all-three-rank2', [8, 3], updates_none=True, batch_weights=True,
          integer_weights=True, zero_debias=True),
]
NAMES = [c['name'] for c in CASES]
REFERENCE_DIR_VARIABLE = 'TF1_SYNCBN_TEST_RENORM_REFERENCE'
# On the stock kernels: the two cases with all three options. Renorm always
# takes the core's slow path, which no kernel set computes (TensorFlow's ops on
# either set); what the stock set's run adds is its child run with oneDNN off
# where oneDNN is on (test_stock_kernels_without_onednn): TensorFlow's plain
# kernels for every option, NCHW and rank 2 included, which these two reach
# (suite_scope.covering; make test-full: every case).
STOCK_CASES = suite_scope.covering(CASES, [c for c in CASES if c['name'] in (
    'all-three-NCHW', 'all-three-rank2')])
# The TF1-behaviour pass (tf_behavior.pick): the cases with all three options,
# one tower and 3 towers (compiled kernels; NCHW on the stock ones too). What
# TF1 behaviour changes here: reference variables (renorm's statistics read
# in the step that assigns them, updates_collections=None's assignments inside
# the layer, zero-debiasing's biased and local_step variables), which the
# cases with all three options reach together.
V1_NAMES = ('all-three-NCHW', 'all-three-rank2')
V1_TOWER_IDS = ('custom-all-three-NCHW', 'custom-all-three-rank2', 'stock-all-three-NCHW')
# The cases this run trains (the reference trains these only).
RUN_CASES = tf_behavior.pick(CASES, [c for c in CASES if c['name'] in V1_NAMES])


@pytest.fixture(scope='module')
def reference_dir(tmp_path_factory):
    """slim's plain renorm on this run's cases' equivalent problems, in one subprocess."""
    return reference_cases.reference_dir(tmp_path_factory, 'renorm_reference', RUN_CASES, MODEL,
                                         REFERENCE_APPLY, REFERENCE_DIR_VARIABLE)


@pytest.fixture(scope='module')
def slim_arrays(reference_dir):
    return reference_cases.load_arrays(reference_dir, RUN_CASES, 'tf-slim')


def _tower_params():
    params = kernel_cases(CASES, STOCK_CASES)
    if tf_behavior.is_v1():
        params = [p for p in params if p.id in V1_TOWER_IDS]
    return params


def _expected(case, slim_result, ours):
    """slim's numbers, with what zero-debiasing changes computed from them (float64)."""
    expected = dict(slim_result)
    if not case.get('zero_debias'):
        return expected
    decay = case['kwargs']['decay']
    biased = [k for k in ours if k.startswith('var/0/') and k.endswith('moving_mean/biased')]
    step_names = [k for k in ours if k.startswith('var/0/') and k.endswith('/local_step')]
    assert len(biased) == 1 and len(step_names) == 1, sorted(ours)
    biased, local_step = biased[0][len('var/0/'):], step_names[0][len('var/0/'):]
    for step in range(STEPS):
        slim_mean = slim_result['var/%d/net/bn/moving_mean' % step].astype(np.float64)
        expected['var/%d/%s' % (step, biased)] = slim_mean
        expected['var/%d/%s' % (step, local_step)] = np.float64(step + 1)
        expected['var/%d/net/bn/moving_mean' % step] = slim_mean / (1 - decay ** (step + 1))
    last = 'var/%d/net/bn/' % (STEPS - 1)
    channels_last = case['kwargs']['data_format'] == 'NHWC' or len(case['shape']) == 2
    x = case_data(case, RUN_CASES.index(case))['x/eval'].astype(np.float64)
    if not channels_last:
        x = np.moveaxis(x, 1, -1)
    y = ((x - expected[last + 'moving_mean']) /
         np.sqrt(slim_result[last + 'moving_variance'] + case['kwargs']['epsilon']) *
         slim_result[last + 'gamma'] + slim_result[last + 'beta'])
    expected['eval'] = y if channels_last else np.moveaxis(y, -1, 1)
    return expected


def _ours(case, sizes, kernel_impl=None):
    layer = sync_batch_norm
    if len(sizes) > 1:
        layer = functools.partial(sync_batch_norm, sync_statistics=CollectiveBackend(timeout=60))
    with kernel_set(kernel_impl) if kernel_impl else contextlib.nullcontext():
        ours, info = train_case(lambda *args: renorm_apply(layer, case, *args), case,  # noqa: F821
                                RUN_CASES.index(case), sizes)
    if kernel_impl == 'stock':
        assert info['kernel_ops'] == 0, 'the stock kernel set used the compiled kernels'
    return ours, info


@pytest.mark.parametrize('case', RUN_CASES, ids=lambda case: case['name'])
def test_one_tower_is_slims_renorm_on_the_equivalent_problem(slim_arrays, case):
    ours, info = _ours(case, [case['shape'][0]])
    assert_same_numbers(ours, _expected(case, slim_arrays[RUN_CASES.index(case)], ours), case,
                        1)
    if case.get('updates_none'):
        assert not info['update_ops']


@pytest.mark.parametrize('kernel_impl,case', _tower_params())
def test_towers_are_slims_renorm_on_the_concatenated_batch(slim_arrays, case, kernel_impl):
    ours, info = _ours(case, DEFAULT_SIZES, kernel_impl)
    assert_same_numbers(ours, _expected(case, slim_arrays[RUN_CASES.index(case)], ours), case,
                        len(DEFAULT_SIZES))
    if case.get('updates_none'):
        assert not info['update_ops']


@pytest.mark.once(reason='a check of the reference emulations, the same in both behaviours')
def test_the_emulations_are_not_plain_renorm(slim_arrays):
    """Each emulation changes what it must, so that the comparisons above test the option.

    The repeated batch gives slim's renorm the weighted mean (its first moving
    mean is ``(1 - decay)`` times it), which differs from the unweighted one;
    zero-debiasing scales the moving mean by ``1 / (1 - 0.8^step)``, 5x at the
    first step.
    """
    case = CASES[NAMES.index('batch_weights')]
    data = case_data(case, RUN_CASES.index(case))
    x, w = data['x/0'].astype(np.float64).reshape(-1, 3), data['w/0'].astype(np.float64)
    w = np.repeat(w, x.shape[0] // len(w))
    assert set(np.unique(w)) == {1.0, 2.0, 3.0}
    weighted, plain = (w[:, None] * x).sum(0) / w.sum(), x.mean(0)
    moving = slim_arrays[RUN_CASES.index(case)]['var/0/net/bn/moving_mean']
    np.testing.assert_allclose(moving, 0.2 * weighted, rtol=1e-5)
    assert np.abs(weighted - plain).min() > 1e-2
    case = CASES[NAMES.index('zero_debias')]
    ours, _ = _ours(case, [case['shape'][0]])
    ratio = ours['var/0/net/bn/moving_mean'] / \
        slim_arrays[RUN_CASES.index(case)]['var/0/net/bn/moving_mean']
    np.testing.assert_allclose(ratio, 1 / 0.2, rtol=1e-4)


@pytest.mark.once(reason='the parity modules run renorm on the stock kernels in TF1 behaviour')
def test_stock_kernels_without_onednn(reference_dir, tmp_path):
    run_stock_cases_without_onednn(__file__, tmp_path, expected=len(STOCK_CASES),
                                   extra_env={REFERENCE_DIR_VARIABLE: str(reference_dir)})

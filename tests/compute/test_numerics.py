"""Numerics: float16/bfloat16, |mean| >> std, non-negative variance."""

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_backward, bn_forward, build_towers, split_batches, var
from conftest import make_session
from tf1_syncbn import CollectiveBackend, sync_batch_norm

tf1 = tf.compat.v1
# Every test runs with the compiled CPU kernels and with TF's stock kernels.
pytestmark = pytest.mark.usefixtures('kernel_impl')
EPS = 1e-3


def _run(graph, net, feeds, extra=()):
    grads = tf.gradients(net['loss'], net['xs'])
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    sess = make_session(graph, len(net['xs']))
    sess.run(tf1.global_variables_initializer())
    out = sess.run([net['ys'], grads, updates] + list(extra), feeds)
    mm, mv = sess.run([var('BatchNorm/moving_mean'), var('BatchNorm/moving_variance')])
    sess.close()
    return out, mm, mv


def _feeds(net, x, dy, sizes):
    feed = dict(zip(net['xs'], split_batches(x, sizes)))
    feed.update(zip(net['dys'], split_batches(dy, sizes)))
    return feed


@pytest.mark.parametrize('dtype,tol', [(tf.float16, 2e-2), (tf.bfloat16, 6e-2)])
def test_half_precision_towers(graph, rng, dtype, tol):
    sizes = [3, 5, 0, 2]
    layer = lambda x: sync_batch_norm(x, decay=0.0, scale=True, epsilon=EPS,
                                      sync_statistics=CollectiveBackend(timeout=60))
    net = build_towers(layer, len(sizes), (None, 4, 4, 3), dtype=dtype)
    assert net['ys'][0].dtype == dtype
    assert var('BatchNorm/gamma').dtype.base_dtype == tf.float32
    x = (rng.randn(sum(sizes), 4, 4, 3) * 2 + 1).astype(np.float32)
    dy = rng.randn(*x.shape).astype(np.float32)
    # The reference sees the same rounded inputs.
    xr = x.astype(dtype.as_numpy_dtype).astype(np.float64)
    (ys, dxs, _), mm, mv = _run(graph, net, _feeds(net, x, dy, sizes))
    f = bn_forward(xr, np.ones(3), np.zeros(3), EPS)
    b = bn_backward(dy, xr, np.ones(3), EPS)
    np.testing.assert_allclose(np.concatenate(ys).astype(np.float64), f['y'], atol=tol)
    np.testing.assert_allclose(np.concatenate(dxs), b['dx'], atol=tol)
    # Statistics are accumulated in float32: the moving statistics (decay 0 =
    # this batch's statistics) are float32-accurate.
    np.testing.assert_allclose(mm, f['mean'], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mv, f['var_unbiased'], rtol=1e-5)


def test_float16_statistics_do_not_overflow(graph, rng):
    # Sums of squares of 16k values of ~100 overflow float16 (max 65504).
    sizes = [4096, 4096, 4096, 4096]
    layer = lambda x: sync_batch_norm(x, decay=0.0, sync_statistics=CollectiveBackend(60))
    net = build_towers(layer, 4, (None, 2), dtype=tf.float16)
    x = (rng.randn(sum(sizes), 2) * 30 + 100).astype(np.float32)
    xr = x.astype(np.float16).astype(np.float64)
    (ys, _, _), mm, mv = _run(graph, net, _feeds(net, x, np.zeros_like(x), sizes))
    f = bn_forward(xr, np.ones(2), np.zeros(2), EPS)
    np.testing.assert_allclose(mm, f['mean'], rtol=1e-5)
    np.testing.assert_allclose(mv, f['var_unbiased'], rtol=1e-4)
    assert np.all(np.isfinite(np.concatenate(ys)))


@pytest.mark.parametrize('offsets', [(0.0, 0.0, 0.0, 0.0), (0.0, 3.0, -2.0, 0.5)])
def test_large_mean_small_spread(graph, rng, offsets):
    """N(1e4, 1): E[x^2] - E[x]^2 in float32 fails; the variance stays within 1e-4."""
    sizes = [64, 48, 80, 32]
    layer = lambda x: sync_batch_norm(x, decay=0.0, scale=True, epsilon=1e-5,
                                      sync_statistics=CollectiveBackend(timeout=60))
    net = build_towers(layer, 4, (None, 3, 3, 4))
    parts = [(1e4 + off + rng.randn(s, 3, 3, 4)).astype(np.float32)
             for s, off in zip(sizes, offsets)]
    x = np.concatenate(parts)
    dy = rng.randn(*x.shape).astype(np.float32)
    (ys, dxs, _), mm, mv = _run(graph, net, _feeds(net, x, dy, sizes))
    f = bn_forward(x, np.ones(4), np.zeros(4), 1e-5)
    assert np.all(mv > 0)
    np.testing.assert_allclose(mv, f['var_unbiased'], rtol=1e-4)
    np.testing.assert_allclose(mm, f['mean'], rtol=1e-7)
    # The mean itself can only be stored to float32 precision (ulp(1e4) / 2 ~
    # 5e-4), which bounds the accuracy of the normalized outputs.
    np.testing.assert_allclose(np.concatenate(ys), f['y'], atol=2e-3)
    b = bn_backward(dy, x, np.ones(4), 1e-5)
    np.testing.assert_allclose(np.concatenate(dxs), b['dx'], atol=5e-3, rtol=1e-3)


def test_seed_formula_fails_where_this_succeeds(rng):
    """The reference point of the test above: E[x^2] - E[x]^2 in float32 is useless."""
    x = (1e4 + rng.randn(224, 3, 3, 4)).astype(np.float32)
    naive = np.mean(np.square(x), axis=(0, 1, 2)) - np.square(np.mean(x, axis=(0, 1, 2)))
    exact = np.var(x.astype(np.float64), axis=(0, 1, 2))
    assert np.max(np.abs(naive / exact - 1)) > 1e-2


def test_constant_input_variance_is_zero_not_negative(graph):
    sizes = [3, 2]
    layer = lambda x: sync_batch_norm(x, decay=0.0, sync_statistics=CollectiveBackend(60))
    net = build_towers(layer, 2, (None, 3))
    x = np.full((5, 3), 12345.678, np.float32)
    (ys, dxs, _), mm, mv = _run(graph, net, _feeds(net, x, np.ones_like(x), sizes))
    assert np.all(mv == 0.0)
    np.testing.assert_allclose(mm, x[0], rtol=1e-7)
    np.testing.assert_allclose(np.concatenate(ys), 0.0, atol=1e-6)
    assert np.all(np.isfinite(np.concatenate(dxs)))

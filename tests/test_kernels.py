"""The compiled CPU kernels: loaded, used on CPU towers, and the stock fallback."""

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import build_towers
from conftest import make_session
from tf1_syncbn import kernels, sync_batch_norm

tf1 = tf.compat.v1
CUSTOM_OPS = {'SyncBnMoments', 'SyncBnGradSums', 'SyncBnGradInput'}


def _op_types(graph):
    return {op.type for op in graph.get_operations()}


def test_kernels_compile_and_load_here():
    # make test installs a compiler-equipped environment: the fast path must work.
    assert kernels.load() is not None, kernels.status()
    assert kernels.status().startswith('custom CPU kernels')


@pytest.mark.parametrize('custom', [True, False])
def test_cpu_towers_use_the_kernels_when_enabled(graph, custom):
    with kernels.use_custom_kernels(custom):
        net = build_towers(lambda x: sync_batch_norm(x, sync_statistics='collective'), 2,
                           (None, 3))
        tf.gradients(net['loss'], net['xs'])
    used = CUSTOM_OPS & _op_types(graph)
    assert used == (CUSTOM_OPS if custom else set())


def test_gpu_towers_use_stock_kernels(graph, monkeypatch):
    from tower import call_for_each_tower
    from tf1_syncbn import backends
    monkeypatch.setattr(backends, 'gpus_present', lambda: True)  # build an NCCL graph
    xs = []

    def tower():
        x = tf1.placeholder(tf.float32, [None, 3])
        xs.append(x)
        return sync_batch_norm(x, sync_statistics='nccl')

    ys = call_for_each_tower(tower, ['/gpu:0', '/gpu:1'])
    tf.gradients(tf.add_n([tf.reduce_sum(y) for y in ys]), xs)
    assert not CUSTOM_OPS & _op_types(graph)


def test_environment_switch_disables_them(tmp_path):
    import os
    import subprocess
    import sys
    code = ('from tf1_syncbn import kernels; print(kernels.load() is None, kernels.status())')
    env = dict(os.environ, TF1_SYNCBN_KERNELS='0', TF_CPP_MIN_LOG_LEVEL='3')
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith('True stock kernels (custom kernels disabled)')


@pytest.mark.parametrize('dtype', ['float32', 'float16', 'bfloat16'])
@pytest.mark.parametrize('fmt', ['NHWC', 'NCHW'])
def test_kernel_ops_against_numpy(graph, rng, dtype, fmt):
    ops = kernels.load()
    tdtype = tf.as_dtype(dtype)
    x = (rng.randn(5, 6, 7, 1) * 3 + 1e3 * (dtype == 'float32')).astype(np.float32)
    if fmt == 'NHWC':
        x = x.reshape(5, 7, 1, 6)
    dy = rng.randn(*x.shape).astype(np.float32)
    axes = (0, 1, 2) if fmt == 'NHWC' else (0, 2, 3)
    c_axis = 3 if fmt == 'NHWC' else 1
    xr = x.astype(tdtype.as_numpy_dtype).astype(np.float64)
    dyr = dy.astype(tdtype.as_numpy_dtype).astype(np.float64)
    mean_ref = xr.mean(axes)
    shape = [1, 1, 1, 1]
    shape[c_axis] = 6
    a, b, c = (rng.randn(6).astype(np.float32) for _ in range(3))
    xt, dyt = tf.cast(tf.constant(x), tdtype), tf.cast(tf.constant(dy), tdtype)
    count, shift, mean_s, m2 = ops.sync_bn_moments(xt, data_format=fmt)
    sums = ops.sync_bn_grad_sums(dyt, xt, tf.constant(mean_ref.astype(np.float32)),
                                 data_format=fmt)
    dx = ops.sync_bn_grad_input(dyt, xt, a, mean_ref.astype(np.float32), b, c,
                                data_format=fmt)
    with make_session(graph, 1) as sess:
        n, s, m, q, (sum_dy, sum_dyx), dxv = sess.run([count, shift, mean_s, m2, sums, dx])
    assert n == x.size / 6
    np.testing.assert_allclose(s + m, mean_ref, rtol=1e-7, atol=1e-6)
    np.testing.assert_allclose(q, ((xr - mean_ref.reshape(shape)) ** 2).sum(axes), rtol=1e-5)
    np.testing.assert_allclose(sum_dy, dyr.sum(axes), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(sum_dyx, (dyr * (xr - mean_ref.reshape(shape))).sum(axes),
                               rtol=1e-4, atol=2e-3)
    expected = (dyr * a.reshape(shape) + (xr - mean_ref.reshape(shape)) * b.reshape(shape) +
                c.reshape(shape))
    tol = 1e-5 if dtype == 'float32' else 3e-2
    np.testing.assert_allclose(dxv.astype(np.float64), expected, rtol=tol, atol=tol * 10)


def test_kernel_ops_on_empty_batches(graph):
    ops = kernels.load()
    x = tf.zeros([0, 4, 1, 3])
    outs = ops.sync_bn_moments(x) + ops.sync_bn_grad_sums(x, x, tf.zeros([3]))
    dx = ops.sync_bn_grad_input(x, x, tf.ones([3]), tf.zeros([3]), tf.ones([3]), tf.ones([3]))
    with make_session(graph, 1) as sess:
        vals = sess.run(list(outs) + [dx])
    assert vals[0] == 0 and all(np.all(v == 0) for v in vals[1:6])
    assert vals[6].shape == (0, 4, 1, 3)

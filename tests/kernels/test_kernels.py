"""The compiled CPU kernels: the ops, their use on CPU towers, the op budget of one
layer, the build cache, and the fallback to the stock kernels."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import support_paths
from bn_reference import build_towers
from conftest import make_session
from tf1_syncbn import CollectiveBackend, kernels, sync_batch_norm
from tf1_syncbn.kernels import cache

tf1 = tf.compat.v1
CUSTOM_OPS = {'SyncBnMoments', 'SyncBnNormalize', 'SyncBnGradSums', 'SyncBnGradInput'}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Non-constant ops of one synchronized layer in one tower, forward and backward
#: (the compiled kernels need 13, the portable set 20 (NHWC) and 24 (NCHW),
#: unsynchronized fused batch norm 7; see tests/kernels/test_kernel_sets.py).
OP_BUDGET = 25


def _op_types(graph):
    return {op.type for op in graph.get_operations()}


def _subprocess_env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=support_paths.pythonpath(
                   os.path.join(ROOT, 'tests')))
    env.update(extra)
    return env


#: Why the build's own tests run in the TF2-behaviour pass only.
BUILD = 'the build and its cache, whatever the TF behaviour'


@pytest.mark.versions
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
    monkeypatch.setattr(backends.base, 'physical_gpu_count', lambda: 2)  # build an NCCL graph
    xs = []

    def tower():
        x = tf1.placeholder(tf.float32, [None, 3])
        xs.append(x)
        return sync_batch_norm(x, sync_statistics='nccl')

    ys = call_for_each_tower(tower, ['/gpu:0', '/gpu:1'])
    tf.gradients(tf.add_n([tf.reduce_sum(y) for y in ys]), xs)
    assert not CUSTOM_OPS & _op_types(graph)


def _layer_ops(graph, tower):
    """Non-constant ops that one layer call builds in ``tower``, forward and backward."""
    return [op for op in graph.get_operations()
            if (op.name.startswith(tower + '/bn/') or '/%s/bn/' % tower in op.name)
            and op.type != 'Const']


@pytest.mark.parametrize('custom', [True, False])
def test_op_budget_of_one_synchronized_layer(graph, custom):
    """Per-layer bookkeeping runs on every tower for every layer: keep it small."""
    def tower_fn(x):
        with tf1.variable_scope('bn'):
            return sync_batch_norm(x, scale=True, sync_statistics=CollectiveBackend(60))

    with kernels.use_custom_kernels(custom):
        net = build_towers(tower_fn, 2, (None, 4, 4, 8))
        tf.gradients(net['loss'], net['xs'] + tf1.trainable_variables())
    ops = _layer_ops(graph, 'tower1')   # tower 1 builds no moving-average updates
    listing = '\n'.join('%s %s' % (op.type, op.name) for op in ops)
    assert sum(op.type == 'CollectiveReduce' for op in ops) == 2, listing
    assert len(ops) <= OP_BUDGET, '%d ops > %d:\n%s' % (len(ops), OP_BUDGET, listing)
    if custom:
        assert {op.type for op in ops} >= CUSTOM_OPS, listing
        assert not {'Cast', 'ConcatV2', 'StridedSlice', 'Rsqrt'} & {op.type for op in ops}, \
            listing


def test_environment_switch_disables_them():
    code = ('from tf1_syncbn import kernels; print(kernels.load() is None, kernels.status())')
    out = subprocess.run([sys.executable, '-c', code], env=_subprocess_env(TF1_SYNCBN_KERNELS='0'),
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith('True stock kernels (custom kernels disabled)')


def _pack(x, axes):
    """The float64 packed moments of ``x``: [n, n*mu, M2 + n*mu^2]."""
    n = x.size / x.shape[3 if axes == (0, 1, 2) else 1]
    mu = x.mean(axes)
    m2 = ((x - x.mean(axes, keepdims=True)) ** 2).sum(axes)
    return np.concatenate([[n], n * mu, m2 + n * mu * mu])


@pytest.mark.versions
@pytest.mark.parametrize('dtype', ['float32', 'float16', 'bfloat16'])
@pytest.mark.parametrize('fmt', ['NHWC', 'NCHW'])
def test_kernel_ops_against_numpy(graph, rng, dtype, fmt):
    ops = kernels.load()
    tdtype = tf.as_dtype(dtype)
    # Two "towers": x is this tower's batch, other is the rest of the global batch.
    x = (rng.randn(5, 6, 7, 1) * 3 + 1e3 * (dtype == 'float32')).astype(np.float32)
    other = (rng.randn(3, 6, 7, 1) * 2 + 1e3 * (dtype == 'float32') + 1).astype(np.float32)
    if fmt == 'NHWC':
        x, other = x.reshape(5, 7, 1, 6), other.reshape(3, 7, 1, 6)
    dy = rng.randn(*x.shape).astype(np.float32)
    axes = (0, 1, 2) if fmt == 'NHWC' else (0, 2, 3)
    shape = [1, 1, 1, 1]
    shape[3 if fmt == 'NHWC' else 1] = 6
    rounded = lambda v: v.astype(tdtype.as_numpy_dtype).astype(np.float64)
    xr, otherr, dyr = rounded(x), rounded(other), rounded(dy)
    both = np.concatenate([xr, otherr], 0)
    n = both.size / 6
    mean, var = both.mean(axes), both.var(axes)
    gamma, beta = rng.uniform(0.5, 1.5, 6), rng.randn(6)
    eps = 1e-3
    inv_std = 1 / np.sqrt(var + eps)
    xhat = (xr - mean.reshape(shape)) * inv_std.reshape(shape)
    # The other tower's gradient sums, as the all-reduce would add them.
    other_grads = rng.randn(12)

    xt, dyt = tf.cast(tf.constant(x), tdtype), tf.cast(tf.constant(dy), tdtype)
    packed = ops.sync_bn_moments(xt, data_format=fmt)
    packed_sum = packed + tf.constant(_pack(otherr, axes))
    y, mean_t, var_t, count_t, inv_std_t = ops.sync_bn_normalize(
        xt, packed_sum, gamma.astype(np.float32), beta.astype(np.float32), epsilon=eps,
        data_format=fmt)
    grads, dgamma, dbeta = ops.sync_bn_grad_sums(dyt, xt, mean_t, inv_std_t, data_format=fmt)
    grads_sum = grads + other_grads.astype(np.float32)
    dx = ops.sync_bn_grad_input(dyt, xt, mean_t, inv_std_t, gamma.astype(np.float32),
                                grads_sum, count_t, data_format=fmt)
    for t in (packed, y, mean_t, var_t, inv_std_t, grads, dgamma, dbeta, dx):
        assert t.shape.is_fully_defined(), t
    with make_session(graph, 1) as sess:
        (packed_v, y_v, mean_v, var_v, count_v, inv_std_v, grads_v, dgamma_v, dbeta_v,
         dx_v) = sess.run([packed, y, mean_t, var_t, count_t, inv_std_t, grads, dgamma, dbeta,
                           dx])
    local = _pack(xr, axes)
    assert packed_v[0] == local[0]
    np.testing.assert_allclose(packed_v[1:7] / local[0], local[1:7] / local[0], rtol=1e-7,
                               atol=1e-6)
    m2 = lambda p: p[7:] - p[1:7] ** 2 / p[0]
    np.testing.assert_allclose(m2(packed_v), m2(local), rtol=1e-5)
    assert count_v == n
    np.testing.assert_allclose(mean_v, mean, rtol=1e-7, atol=1e-6)
    np.testing.assert_allclose(var_v, var, rtol=1e-5)
    np.testing.assert_allclose(inv_std_v, inv_std, rtol=1e-5)
    tol = 1e-4 if dtype == 'float32' else 3e-2
    g, b = gamma.reshape(shape), beta.reshape(shape)
    np.testing.assert_allclose(y_v.astype(np.float64), xhat * g + b, rtol=tol, atol=tol)
    sum_dy, sum_dy_xhat = dyr.sum(axes), (dyr * xhat).sum(axes)
    np.testing.assert_allclose(grads_v, np.concatenate([sum_dy_xhat, sum_dy]), rtol=1e-4,
                               atol=1e-3)
    np.testing.assert_array_equal(dgamma_v, grads_v[:6])
    np.testing.assert_array_equal(dbeta_v, grads_v[6:])
    gsum = np.concatenate([sum_dy_xhat, sum_dy]) + other_grads.astype(np.float32)
    expected = g * inv_std.reshape(shape) * (dyr - gsum[6:].reshape(shape) / n -
                                             xhat * gsum[:6].reshape(shape) / n)
    np.testing.assert_allclose(dx_v.astype(np.float64), expected, rtol=tol, atol=tol)


def test_kernel_ops_on_empty_batches(graph):
    ops = kernels.load()
    x = tf.zeros([0, 4, 1, 3])
    packed = ops.sync_bn_moments(x)
    y, mean, var, count, inv_std = ops.sync_bn_normalize(x, packed, tf.ones([3]),
                                                         tf.zeros([3]), epsilon=1e-3)
    grads, dgamma, dbeta = ops.sync_bn_grad_sums(x, x, mean, inv_std)
    dx = ops.sync_bn_grad_input(x, x, mean, inv_std, tf.ones([3]), grads, count)
    with make_session(graph, 1) as sess:
        vals = sess.run([packed, mean, var, count, grads, dgamma, dbeta, y, dx])
    assert all(np.all(v == 0) for v in vals[:7])
    assert vals[7].shape == vals[8].shape == (0, 4, 1, 3)


def test_kernel_ops_reject_bad_shapes(graph):
    ops = kernels.load()
    x = tf.zeros([2, 4, 1, 3])
    bad = ops.sync_bn_normalize(x, tf.zeros([5], tf.float64), tf.ones([3]), tf.zeros([3]),
                                epsilon=1e-3)[0]
    with make_session(graph, 1) as sess:
        with pytest.raises(tf.errors.InvalidArgumentError, match='packed moments'):
            sess.run(bad)


@pytest.mark.once(reason=BUILD)
def test_cache_key_ignores_checkout_and_environment_paths(monkeypatch, tmp_path):
    path, original_source = kernels.cache_path(), cache._SOURCE
    compile_flags, link_flags = tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()
    moved = lambda flags: [('-I' + str(tmp_path / 'venv' / f[2:].lstrip('/'))) if
                           f.startswith('-I') else ('-L' + str(tmp_path / f[2:].lstrip('/')))
                           if f.startswith('-L') else f for f in flags]
    monkeypatch.setattr(tf.sysconfig, 'get_compile_flags', lambda: moved(compile_flags))
    monkeypatch.setattr(tf.sysconfig, 'get_link_flags', lambda: moved(link_flags))
    source = tmp_path / 'clone' / 'sync_bn_ops.cc'
    source.parent.mkdir()
    shutil.copy(cache._SOURCE, source)
    monkeypatch.setattr(cache, '_SOURCE', str(source))
    assert kernels.cache_path() == path
    # ... but the source and the flags are part of it.
    source.write_text(source.read_text() + '\n// changed\n')
    assert kernels.cache_path() != path
    monkeypatch.setattr(cache, '_SOURCE', original_source)
    assert kernels.cache_path() == path
    monkeypatch.setattr(cache, '_OPT_FLAGS', ['-O2', '-shared', '-fPIC'])
    assert kernels.cache_path() != path


@pytest.mark.once(reason=BUILD)
def test_compile_says_so_on_stderr_and_caches(tmp_path):
    """A fresh cache compiles once, with a line before and after; later runs load it."""
    built = kernels.build()   # the real library, compiled here if needed
    # A stand-in compiler that writes the library built here (no 20 s compile).
    fake = tmp_path / 'fake-cxx'
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ncp %s "$2"\n' % built)
    fake.chmod(0o755)
    cache = tmp_path / 'cache'
    env = _subprocess_env(CXX=str(fake), TF1_SYNCBN_CACHE=str(cache))
    cmd = [sys.executable, '-m', 'tf1_syncbn.kernels']
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    expected = str(cache / os.path.relpath(built, os.path.dirname(os.path.dirname(built))))
    lines = [l for l in first.stderr.splitlines() if l.startswith('tf1_syncbn:')]
    assert len(lines) == 2 and 'compiling' in lines[0] and 'compiled' in lines[1], first.stderr
    assert all(expected in l for l in lines), (expected, lines)
    assert first.stdout.strip() == 'tf1_syncbn: CPU kernels ready: %s' % expected
    code = ('from tf1_syncbn import kernels; print(kernels.status())')
    second = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                            text=True, check=True, cwd=ROOT)
    assert 'compil' not in second.stderr
    assert second.stdout.strip() == 'custom CPU kernels (%s)' % expected


FALLBACK = '''
import warnings
warnings.simplefilter('always')
import numpy as np
import tensorflow as tf
from bn_reference import build_towers
from conftest import make_session
from tf1_syncbn import CollectiveBackend, kernels, sync_batch_norm
graph = tf.Graph()
with graph.as_default():
    net = build_towers(lambda x: sync_batch_norm(x, sync_statistics=CollectiveBackend(60)),
                       2, (None, 3))
    dxs = tf.gradients(net['loss'], net['xs'])
    assert not {'SyncBnMoments', 'SyncBnGradInput'} & {op.type for op in graph.get_operations()}
    x = np.arange(12, dtype=np.float32).reshape(4, 3) ** 2
    feed = {net['xs'][0]: x[:1], net['xs'][1]: x[1:], net['dys'][0]: x[:1], net['dys'][1]: x[1:]}
    with make_session(graph, 2) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        ys = np.concatenate(sess.run(net['ys'], feed))
want = (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-3)
np.testing.assert_allclose(ys, want, rtol=1e-4, atol=1e-4)
print(kernels.status())
'''


@pytest.mark.once(reason=BUILD)
def test_without_a_compiler_layers_fall_back_to_stock_kernels_with_a_warning(tmp_path):
    env = _subprocess_env(CXX=str(tmp_path / 'no' / 'g++'), TF1_SYNCBN_CACHE=str(tmp_path))
    run = subprocess.run([sys.executable, '-c', FALLBACK], env=env, capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith('stock kernels (no C++ compiler'), run.stdout
    warning = [l for l in run.stderr.splitlines() if 'custom CPU kernels unavailable' in l]
    assert len(warning) == 1 and 'no C++ compiler' in warning[0], run.stderr
    assert "TensorFlow's stock kernels" in warning[0]


@pytest.mark.once(reason=BUILD)
def test_ahead_of_time_command(capsys, monkeypatch):
    from tf1_syncbn.kernels import __main__ as command
    assert command.main([]) == 0
    assert capsys.readouterr().out.strip() == 'tf1_syncbn: CPU kernels ready: %s' % (
        kernels.cache_path())

    def broken(force=False):
        raise RuntimeError('no C++ compiler: test')

    monkeypatch.setattr(kernels, 'build', broken)
    assert command.main([]) == 1
    assert 'no C++ compiler: test' in capsys.readouterr().err

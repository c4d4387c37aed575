"""Inference runs one FusedBatchNormV3(is_training=False) and no other per-element op."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import make_session
from tf1_syncbn import sync_batch_norm

tf1 = tf.compat.v1

CASES = [((5,), 'NHWC'), ((6, 5), 'NHWC'), ((5, 6), 'NCHW'), ((3, 4, 5), 'NHWC'),
         ((5, 3, 4), 'NCHW'), ((2, 3, 2, 5), 'NDHWC'), ((5, 2, 3, 2), 'NCDHW')]


def _ops_between(source, target):
    """Ops on some path from ``source`` to ``target`` (data edges only)."""
    reach_back = set()
    stack = [target.op]
    while stack:
        op = stack.pop()
        if op in reach_back:
            continue
        reach_back.add(op)
        stack.extend(t.op for t in op.inputs)
    forward, stack = set(), [source.op]
    while stack:
        op = stack.pop()
        if op in forward:
            continue
        forward.add(op)
        stack.extend(c for t in op.outputs for c in t.consumers())
    return (reach_back & forward) - {source.op}


@pytest.mark.parametrize('example_shape,data_format', CASES)
@pytest.mark.parametrize('scale', [True, False])
def test_inference_is_one_fused_kernel(graph, rng, example_shape, data_format, scale):
    x = tf1.placeholder(tf.float32, (None,) + example_shape)
    mean = rng.randn(5).astype(np.float32)
    variance = rng.uniform(0.5, 2, 5).astype(np.float32)
    y = sync_batch_norm(x, is_training=False, scale=scale, data_format=data_format,
                        param_initializers={
                            'moving_mean': tf1.constant_initializer(mean),
                            'moving_variance': tf1.constant_initializer(variance),
                            'beta': tf1.constant_initializer(0.25),
                            'gamma': tf1.constant_initializer(1.5)})
    path = _ops_between(x, y)
    fused = [op for op in path if op.type == 'FusedBatchNormV3']
    assert len(fused) == 1 and fused[0].get_attr('is_training') is False
    # Every op that touches the data is the kernel or a free reshape; the
    # rest only compute shapes (int32).
    data_ops = {op.type for op in path if any(t.dtype.is_floating for t in op.outputs)}
    assert data_ops <= {'FusedBatchNormV3', 'Reshape'}, sorted(op.type for op in path)
    shape_ops = {op.type for op in path} - data_ops
    assert shape_ops <= {'Shape', 'StridedSlice', 'Pack', 'Prod'}, shape_ops
    # The moving statistics are what it normalizes with.
    data = rng.randn(4, *example_shape).astype(np.float32)
    channels_last = data_format in ('NHWC', 'NDHWC') or len(example_shape) == 1
    shape = [1] * (len(example_shape) + 1)
    shape[-1 if channels_last else 1] = 5
    gamma = 1.5 if scale else 1.0
    expected = ((data - mean.reshape(shape)) / np.sqrt(variance.reshape(shape) + 1e-3) *
                gamma + 0.25)
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        np.testing.assert_allclose(sess.run(y, {x: data}), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('dtype', [tf.float16, tf.bfloat16])
def test_half_precision_inference(graph, rng, dtype):
    x = tf1.placeholder(dtype, [None, 4, 4, 3])
    y = sync_batch_norm(x, is_training=False)
    assert y.dtype == dtype
    assert [op.type for op in _ops_between(x, y)] == ['FusedBatchNormV3']
    data = rng.randn(2, 4, 4, 3)
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        out = sess.run(y, {x: data.astype(dtype.as_numpy_dtype)})
    np.testing.assert_allclose(out.astype(np.float64), data / np.sqrt(1.001), atol=3e-2)

"""Ranks 2 to 5 and every data format, against float64 numpy."""

import numpy as np
import pytest
import tensorflow as tf

import suite_scope
from bn_reference import bn_backward, bn_forward, build_towers, split_batches, var
from conftest import make_session
from tf1_syncbn import CollectiveBackend, sync_batch_norm

tf1 = tf.compat.v1
EPS = 1e-3

CASES = [
    # (per-example shape, data_format, channels_last)
    ((5,), 'NHWC', True),               # [N, C]
    ((5,), 'NCHW', True),               # [N, C]: rank 2 is always [N, C]
    ((6, 5), 'NHWC', True),             # [N, L, C]
    ((5, 6), 'NCHW', False),            # [N, C, L]
    ((3, 4, 5), 'NHWC', True),
    ((5, 3, 4), 'NCHW', False),
    ((2, 3, 2, 5), 'NDHWC', True),
    ((5, 2, 3, 2), 'NCDHW', False),
    ((2, 3, 2, 5), 'NHWC', True),       # rank 5 with a 4-letter format: channels last
]


# Each format on the compiled CPU kernels; on TF's stock kernels (a case costs
# about 5x as much there) four (suite_scope.covering; make test-full: every
# format on both sets). The kernel sets never see the format: the layer hands
# them a canonical 4-D view, NHWC or NCHW, of any rank and data format
# (tf1_syncbn._compute.math.canonical_view, before the kernel set is called):
# the input itself at rank 4 (static shape), a reshape elsewhere (its spatial
# size dynamic). The four reach each view the stock set computes: NHWC and
# NCHW, each as a rank-4 input and as a reshaped rank-3 one; the view code of
# every format runs on the compiled set.
PRODUCT = [(kernels,) + case for kernels in ('custom', 'stock') for case in CASES]
COVERING = [('custom',) + case for case in CASES] + [
    ('stock',) + case for case in CASES if case[:2] in (
        ((6, 5), 'NHWC'), ((5, 6), 'NCHW'), ((3, 4, 5), 'NHWC'), ((5, 3, 4), 'NCHW'))]


@pytest.mark.parametrize('kernel_impl,example_shape,data_format,channels_last',
                         [pytest.param(*c, id='%s-%s-rank%d' % (c[0], c[2], len(c[1]) + 1))
                          for c in suite_scope.covering(PRODUCT, COVERING)],
                         indirect=['kernel_impl'])
def test_formats(graph, rng, kernel_impl, example_shape, data_format, channels_last):
    sizes = [3, 1, 2]
    layer = lambda x: sync_batch_norm(x, scale=True, decay=0.0, epsilon=EPS,
                                      data_format=data_format,
                                      sync_statistics=CollectiveBackend(timeout=60))
    net = build_towers(layer, len(sizes), (None,) + example_shape)
    assert var('BatchNorm/beta').shape.as_list() == [5]
    assert net['ys'][0].shape.as_list() == [None] + list(example_shape)
    grads = tf.gradients(net['loss'], net['xs'] + [var('BatchNorm/gamma')])
    sess = make_session(graph, len(sizes))
    sess.run(tf1.global_variables_initializer())
    x = (rng.randn(sum(sizes), *example_shape) * 2 + 1).astype(np.float32)
    dy = rng.randn(*x.shape).astype(np.float32)
    feed = dict(zip(net['xs'], split_batches(x, sizes)))
    feed.update(zip(net['dys'], split_batches(dy, sizes)))
    ys, gs = sess.run([net['ys'], grads], feed)
    sess.close()
    f = bn_forward(x, np.ones(5), np.zeros(5), EPS, channels_last)
    b = bn_backward(dy, x, np.ones(5), EPS, channels_last)
    np.testing.assert_allclose(np.concatenate(ys), f['y'], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(np.concatenate(gs[:-1]), b['dx'], rtol=1e-4, atol=5e-5)
    np.testing.assert_allclose(gs[-1], b['dgamma'], rtol=1e-4, atol=1e-4)

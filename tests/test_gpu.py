"""NCCL and GPU collectives: these need 2 GPUs and skip (saying so) without them.

On CPU-only machines the NCCL graph structure is still tested in
test_sync_communication.py; `python -m tf1_syncbn.selftest` runs the same checks
interactively on whatever GPUs are present.
"""

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_backward, bn_forward, build_towers_on, split_batches
from tf1_syncbn import CollectiveBackend, NcclBackend, sync_batch_norm

tf1 = tf.compat.v1
GPUS = tf.config.list_physical_devices('GPU')
needs_two_gpus = pytest.mark.skipif(len(GPUS) < 2,
                                    reason='GPU-only: needs 2 GPUs, found %d' % len(GPUS))


@needs_two_gpus
@pytest.mark.parametrize('backend', [NcclBackend(), CollectiveBackend(timeout=60)],
                         ids=['nccl', 'collective'])
@pytest.mark.parametrize('dtype', [tf.float32, tf.float16, tf.bfloat16])
def test_gpu_towers_equal_the_global_batch(graph, rng, backend, dtype):
    sizes = [3, 0, 5][:len(GPUS)] if len(GPUS) >= 3 else [3, 5]
    devices = ['/gpu:%d' % i for i in range(len(sizes))]
    net = build_towers_on(lambda x: sync_batch_norm(x, epsilon=1e-3,
                                                    sync_statistics=backend),
                          devices, (None, 4, 4, 3), dtype)
    grads = tf.gradients(net['loss'], net['xs'])
    x = (rng.randn(sum(sizes), 4, 4, 3) * 2 + 1).astype(np.float32)
    dy = rng.randn(*x.shape).astype(np.float32)
    feed = dict(zip(net['xs'], split_batches(x, sizes)))
    feed.update(zip(net['dys'], split_batches(dy, sizes)))
    xr = x.astype(dtype.as_numpy_dtype).astype(np.float64)
    tol = 1e-4 if dtype == tf.float32 else 6e-2
    with tf1.Session(graph=graph, config=tf1.ConfigProto(allow_soft_placement=False)) as sess:
        sess.run(tf1.global_variables_initializer())
        ys, dxs = sess.run([net['ys'], grads], feed)
    np.testing.assert_allclose(np.concatenate(ys).astype(np.float64),
                               bn_forward(xr, 1, 0, 1e-3)['y'], atol=tol)
    np.testing.assert_allclose(np.concatenate(dxs), bn_backward(dy, xr, np.ones(3), 1e-3)['dx'],
                               atol=tol)

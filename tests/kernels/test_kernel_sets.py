"""The kernel sets per device type: the compiled CPU set and the portable set GPU towers run.

The portable set is what GPU towers run (and CPU towers without the compiled
library). Its numbers are checked everywhere the exactness and parity tests
run with ``kernel_impl='stock'`` and, with oneDNN off, in
``tests/support/without_onednn.py``; here: its size and shape (at most 25 ops per
layer and tower, no ``tf.cond`` on a device value), that XLA and plain ops
give the same numbers, and the registry.
"""

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_backward, bn_forward, build_towers, split_batches
from conftest import make_session
from tf1_syncbn import CollectiveBackend, kernel_sets, kernels, sync_batch_norm

tf1 = tf.compat.v1
OP_BUDGET = 25
#: What the portable set builds per layer and tower today (docs/design.md), the
#: IdentityN that carries the gradient's gradient included.
EXPECTED = {('NHWC', 'float32'): 20, ('NCHW', 'float32'): 24, ('NHWC', 'float16'): 18,
            ('NCHW', 'float16'): 24}


def _layer_ops(graph, tower='tower1'):
    """Non-constant ops one layer builds in ``tower`` (forward and backward)."""
    return [op for op in graph.get_operations()
            if (op.name.startswith(tower + '/bn/') or '/%s/bn/' % tower in op.name)
            and op.type != 'Const']


def _build(data_format, dtype=tf.float32, shape=(None, 4, 4, 8)):
    def tower_fn(x):
        with tf1.variable_scope('bn'):
            return sync_batch_norm(x, scale=True, data_format=data_format,
                                   sync_statistics=CollectiveBackend(60))

    with kernels.use_custom_kernels(False):
        net = build_towers(tower_fn, 2, shape, dtype=dtype)
        tf.gradients(net['loss'], net['xs'] + tf1.trainable_variables())
    return net


@pytest.mark.parametrize('dtype', ['float32', 'float16'])
@pytest.mark.parametrize('data_format', ['NHWC', 'NCHW'])
def test_the_portable_set_builds_at_most_25_ops_and_no_host_round_trip(graph, data_format,
                                                                       dtype):
    _build(data_format, getattr(tf, dtype))
    ops = _layer_ops(graph)
    listing = '\n'.join('%s %s' % (op.type, op.name) for op in ops)
    assert len(ops) <= OP_BUDGET, '%d ops:\n%s' % (len(ops), listing)
    assert len(ops) == EXPECTED[(data_format, dtype)], listing
    types = [op.type for op in ops]
    assert types.count('CollectiveReduce') == 2
    # The vector math between the kernels is one XLA op per step.
    assert types.count('PartitionedCall') == 3, listing
    # Nothing waits for a device value on the host: no tf.cond, no host-side reads.
    assert not {'If', 'StatelessIf', 'Switch', 'Merge', 'PyFunc'} & set(types), listing
    # The inference-mode gradient kernel only takes NHWC: never built for NCHW.
    if data_format == 'NCHW':
        assert 'FusedBatchNormGradV3' not in types, listing


def _run_two_towers(graph, data_format, sizes, x, dy):
    net = _build(data_format, shape=(None,) + x.shape[1:])
    feed = dict(zip(net['xs'], split_batches(x, sizes)))
    feed.update(zip(net['dys'], split_batches(dy, sizes)))
    dxs = tf.gradients(net['loss'], net['xs'])
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        return sess.run([net['ys'], dxs], feed)


@pytest.mark.parametrize('data_format', ['NHWC', 'NCHW'])
def test_xla_and_plain_ops_give_the_reference_numbers(monkeypatch, data_format):
    rng = np.random.RandomState(3)
    x = (rng.randn(7, 8, 3, 2) * 3 + 1e4).astype(np.float32)     # mean 10^4 x spread
    dy = rng.randn(*x.shape).astype(np.float32)
    sizes = [5, 2]
    channels_last = data_format == 'NHWC'
    results = {}
    for xla in ('1', '0'):
        monkeypatch.setenv('TF1_SYNCBN_XLA', xla)
        graph = tf.Graph()
        with graph.as_default():
            ys, dxs = _run_two_towers(graph, data_format, sizes, x, dy)
            kinds = {op.type for op in graph.get_operations()}
        assert ('PartitionedCall' in kinds) == (xla == '1')
        results[xla] = (np.concatenate(ys), np.concatenate(dxs))
    forward = bn_forward(x, np.ones(x.shape[-1 if channels_last else 1]),
                         np.zeros(x.shape[-1 if channels_last else 1]), 1e-3, channels_last)
    backward = bn_backward(dy, x, np.ones(len(forward['mean'])), 1e-3, channels_last)
    for y, dx in results.values():
        np.testing.assert_allclose(y, forward['y'], atol=2e-3)
        np.testing.assert_allclose(dx, backward['dx'], atol=2e-3)
    np.testing.assert_allclose(results['1'][0], results['0'][0], atol=1e-5)


def test_a_registered_kernel_set_serves_its_device_type(graph, monkeypatch):
    monkeypatch.setattr(kernel_sets, '_FACTORIES', {k: list(v) for k, v in
                                                    kernel_sets._FACTORIES.items()})  # noqa: SLF001
    used = []

    class Counting(kernel_sets.PortableKernels):
        name = 'counting'

        def moments(self, x4, fmt):
            used.append(fmt)
            return super().moments(x4, fmt)

    kernel_sets.register_kernel_set('cpu', Counting)
    assert kernel_sets.kernel_set_factories('CPU')[0] is Counting
    build_towers(lambda x: sync_batch_norm(x, sync_statistics=CollectiveBackend(60)), 2,
                 (None, 3))
    assert used == ['NHWC', 'NHWC']
    with pytest.raises(TypeError, match='factory must be callable'):
        kernel_sets.register_kernel_set('GPU', 'not a factory')


def test_cpu_towers_take_the_compiled_set_and_gpu_towers_the_portable_one():
    if kernels.load() is None:
        pytest.skip('the compiled kernels are unavailable: %s' % kernels.status())
    assert kernel_sets.kernels_for('/device:CPU:1').name == 'compiled-cpu'
    assert kernel_sets.kernels_for('/job:worker/replica:0/task:1/device:GPU:0').name == \
        'portable'
    with kernels.use_custom_kernels(False):
        assert kernel_sets.kernels_for('/device:CPU:1').name == 'portable'

"""Two gradients through one synchronized layer in one step.

A step that fetches the gradients of two losses through the same layer (two
``tf.gradients`` / ``compute_gradients`` calls; a GAN's generator and
discriminator losses through the discriminator; a gradient penalty) runs two
backward all-reduces of the layer. Each needs keys of its own: with one key
for both, TensorFlow paired one tower's first with another's second, and the
fast path returned wrong gradients without an error (the slow path failed
with TensorFlow's internal ``BufRendezvous::ProvideBuf already called``).

Reference: float64 numpy (``bn_reference.bn_backward``) on the concatenated
batch, for each loss.
"""


import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
from bn_reference import bn_backward, build_towers, split_batches
from conftest import assert_first_run_fails, make_session
from tf1_syncbn import BatchNorm, CollectiveBackend, layers, sync_batch_norm
from tf1_syncbn._sync.plan import backward_direction

tf1 = tf.compat.v1
EPS = 1e-3
SHAPE = (None, 2, 2, 3)
SIZES = [3, 0, 5]

#: The paths with a backward all-reduce of their own: the fused op, the
#: differentiable global moments (fused=False; the same as renorm, batch
#: weights and adjustment), ghost batches, through three front-ends.
LAYERS = {
    'slim/fused': lambda x: sync_batch_norm(x, is_training=True, scale=True, epsilon=EPS),
    'slim/fused=False': lambda x: sync_batch_norm(x, is_training=True, scale=True,
                                                  epsilon=EPS, fused=False),
    'tensorpack': lambda x: BatchNorm('bn', x, epsilon=EPS, sync_statistics='collective'),
    # One virtual batch of the 8 examples: the ghost path, with plain batch norm's result.
    'tf.layers/ghost': lambda x: layers.batch_normalization(
        x, training=True, epsilon=EPS, virtual_batch_size=8),
}
# The TF1-behaviour pass (tf_behavior.pick): the fused op and the global moments.
PICKED = tf_behavior.pick(sorted(LAYERS), ['slim/fused', 'slim/fused=False'])


def _grads_of(loss, net):
    return tf.gradients(loss, net['xs'] + tf1.trainable_variables())


@pytest.mark.parametrize('layer', PICKED)
def test_two_gradients_in_one_step_are_each_the_one_device_gradient(graph, kernel_impl, layer):
    sizes = [4, 4] if layer == 'tf.layers/ghost' else SIZES    # ghost: equal shares
    net = build_towers(LAYERS[layer], len(sizes), SHAPE)
    second = [tf1.placeholder(tf.float32, SHAPE) for _ in net['ys']]
    loss2 = tf.add_n([tf.reduce_sum(y * d) for y, d in zip(net['ys'], second)])
    first_grads, second_grads = _grads_of(net['loss'], net), _grads_of(loss2, net)
    rng = np.random.RandomState(7)
    x = rng.randn(sum(sizes), 2, 2, 3).astype(np.float32) * 3 + 1
    dys = [rng.randn(*x.shape).astype(np.float32) for _ in range(2)]
    feed = {}
    for placeholders, value in zip((net['xs'], net['dys'], second), (x,) + tuple(dys)):
        feed.update(zip(placeholders, split_batches(value, sizes)))
    with make_session(graph) as sess:
        sess.run(tf1.global_variables_initializer())
        got = sess.run([first_grads, second_grads], feed)
    gamma = np.ones(3)
    for k, (grads, dy) in enumerate(zip(got, dys)):
        want = bn_backward(dy, x, gamma, EPS)
        towers = len(sizes)
        dx = np.concatenate(grads[:towers])
        np.testing.assert_allclose(dx, want['dx'], rtol=1e-4, atol=1e-4,
                                   err_msg='loss %d: input gradient' % (k + 1))
        by_name = {v.op.name.split('/')[-1]: np.reshape(g, -1) for v, g in
                   zip(tf1.trainable_variables(), grads[towers:])}
        for name in ('beta', 'gamma'):
            np.testing.assert_allclose(by_name[name], want['d' + name], rtol=1e-4, atol=1e-4,
                                       err_msg='loss %d: %s' % (k + 1, name))


def test_each_backward_build_has_its_own_collective_keys(graph):
    net = build_towers(LAYERS['slim/fused'], 2, SHAPE)
    tf.gradients(net['loss'], net['xs'])
    tf.gradients(net['loss'] * 2.0, net['xs'])
    keys = {}
    for op in graph.get_operations():
        if op.type == 'CollectiveReduce' and 'gradients' in op.name:
            keys.setdefault(op.get_attr('instance_key'), []).append(op.device)
    # Two builds x 2 towers: two instance keys, each shared by the two towers.
    assert sorted(len(set(devices)) for devices in keys.values()) == [2, 2], keys
    assert [backward_direction(k) for k in range(3)] == ['backward', 'backward/1',
                                                          'backward/2']


def test_a_gradient_built_for_one_tower_only_ends_the_step_within_the_timeout(graph):
    """Tower 0 builds two backward all-reduces, tower 1 one: the extra one fails, never hangs."""
    net = build_towers(lambda x: sync_batch_norm(
        x, is_training=True, sync_statistics=CollectiveBackend(timeout=2)), 2, SHAPE)
    both = tf.gradients(net['loss'], net['xs'])
    tower0_only = tf.gradients(tf.reduce_sum(net['ys'][0] * net['dys'][0]), net['xs'][0])
    x = np.ones((2, 2, 2, 3), np.float32)
    feed = {p: x for p in net['xs'] + net['dys']}
    assert_first_run_fails(graph, [both, tower0_only], feed, tf.errors.DeadlineExceededError,
                           within=60)

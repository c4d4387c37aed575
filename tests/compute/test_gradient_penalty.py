"""A gradient of a gradient through a synchronized layer (a gradient penalty).

WGAN-GP and R1 penalize the input gradient of a discriminator and train on
the gradient of that penalty: the layer is differentiated twice. Each tower
takes the input gradient of its own loss (the backward all-reduce makes it
the gradient of the sum of every tower's loss), penalizes its square and
differentiates its loss plus penalty with respect to the weights and its
input. Summed over towers (the input gradients concatenated), that is the
one-device result on the concatenated batch.

Before, the fast path's gradient ran kernels registered without gradients:
with the compiled kernels the second-order terms were silently dropped
(``d/dw`` off by a factor of 100); on the stock kernels and on the other
paths the graph failed to build with TensorFlow's ``LookupError`` (no
gradient for ``CollectiveReduce``).

Reference: the same model on one device in float64, with batch norm from
TensorFlow's own differentiable ops (``tf.nn.moments``, biased variance),
differentiated by TensorFlow: independent of the library.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
from bn_reference import split_batches
from conftest import make_session
from tf1_syncbn import BatchNorm, layers, sync_batch_norm
from tower import call_for_each_tower, get_current_tower_context

tf1 = tf.compat.v1
EPS = 1e-3
SHAPE = [2, 2, 3]
SIZES = [3, 0, 5]
GAMMA = [0.5, 1.5, 1.0]


def _is_training():
    return tf1.placeholder_with_default(True, [], name='is_training')


#: The paths with a backward all-reduce of their own: the fused op (with a
#: Python or tensor is_training), the differentiable global moments
#: (fused=False), ghost batches; through three front-ends.
LAYERS = {
    'slim/fused': lambda x: sync_batch_norm(
        x, is_training=True, scale=True, epsilon=EPS,
        param_initializers={'gamma': tf1.constant_initializer(GAMMA)}),
    'slim/fused/tensor-is_training': lambda x: sync_batch_norm(
        x, is_training=_is_training(), scale=True, epsilon=EPS,
        param_initializers={'gamma': tf1.constant_initializer(GAMMA)}),
    'slim/fused=False': lambda x: sync_batch_norm(
        x, is_training=True, scale=True, epsilon=EPS, fused=False,
        param_initializers={'gamma': tf1.constant_initializer(GAMMA)}),
    'tensorpack': lambda x: BatchNorm('bn', x, epsilon=EPS, sync_statistics='collective',
                                      gamma_initializer=tf1.constant_initializer(GAMMA)),
    # One virtual batch of the 8 examples: the ghost path, with plain batch norm's result.
    'tf.layers/ghost': lambda x: layers.batch_normalization(
        x, training=True, epsilon=EPS, virtual_batch_size=8,
        gamma_initializer=tf1.constant_initializer(GAMMA)),
}
PICKED = tf_behavior.pick(sorted(LAYERS), ['slim/fused/tensor-is_training',
                                           'slim/fused=False'])


def _penalized(x, weights, bn, pull):
    """A discriminator's loss, its input-gradient penalty, and their sum's gradients.

    Returns:
      ``(penalty, gradients)``: the gradients of loss + penalty with respect
      to ``weights`` + [gamma, beta] (found by name) and ``x``.
    """
    w, b = weights
    y = bn(x * w + b)
    loss = tf.reduce_sum(tf.square(y) * tf.constant([1.0, 2.0, 3.0], y.dtype) + y * pull)
    grad_x, = tf.gradients(loss, x)
    penalty = tf.reduce_sum(tf.square(grad_x))
    by_name = {v.op.name.split('/')[-1]: v for v in tf1.trainable_variables()}
    params = list(weights) + [by_name['gamma'], by_name['beta']]
    return penalty, tf.gradients(loss + penalty, params + [x])


def _reference(x, pull):
    """The one-device result in float64 (TensorFlow's own ops, not the library)."""
    graph = tf.Graph()
    with graph.as_default():
        xt, pt = tf.constant(x, tf.float64), tf.constant(pull, tf.float64)
        w = tf1.get_variable('w', initializer=tf.constant([1.0, 2.0, 0.5], tf.float64))
        b = tf1.get_variable('b', initializer=tf.constant([0.3, -0.2, 0.1], tf.float64))
        gamma = tf1.get_variable('bn/gamma', initializer=tf.constant(GAMMA, tf.float64))
        beta = tf1.get_variable('bn/beta', initializer=tf.zeros([3], tf.float64))

        def bn(h):
            mean, var = tf.nn.moments(h, [0, 1, 2])
            return (h - mean) * tf.math.rsqrt(var + EPS) * gamma + beta

        penalty, grads = _penalized(xt, (w, b), bn, pt)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            return sess.run([penalty, grads])


@pytest.mark.parametrize('layer', PICKED)
def test_a_gradient_penalty_equals_one_device(graph, kernel_impl, layer):
    sizes = [4, 4] if layer == 'tf.layers/ghost' else SIZES      # ghost: equal shares
    rng = np.random.RandomState(11)
    x = (rng.randn(sum(sizes), *SHAPE) * 2 + 1).astype(np.float32)
    pull = rng.randn(sum(sizes), *SHAPE).astype(np.float32)
    want_penalty, want = _reference(x.astype(np.float64), pull.astype(np.float64))

    xs = [tf1.placeholder(tf.float32, [None] + SHAPE, name='x%d' % i) for i in range(len(sizes))]
    pulls = [tf1.placeholder(tf.float32, [None] + SHAPE, name='pull%d' % i)
             for i in range(len(sizes))]
    w = tf1.get_variable('w', initializer=tf.constant([1.0, 2.0, 0.5]))
    b = tf1.get_variable('b', initializer=tf.constant([0.3, -0.2, 0.1]))

    def tower():
        i = get_current_tower_context().index
        return _penalized(xs[i], (w, b), LAYERS[layer], pulls[i])

    towers = call_for_each_tower(tower, ['/cpu:%d' % i for i in range(len(sizes))])
    feed = dict(zip(xs, split_batches(x, sizes)))
    feed.update(zip(pulls, split_batches(pull, sizes)))
    with make_session(graph) as sess:
        sess.run(tf1.global_variables_initializer())
        got = sess.run(towers, feed)
    penalty = sum(p for p, _ in got)
    np.testing.assert_allclose(penalty, want_penalty, rtol=1e-4)
    # float32 against float64: 2e-4 of each gradient's own scale, plus 1e-7 of the
    # largest gradient's (d/db is 0: batch norm removes a bias; float32 leaves 1e-5).
    overall = max(np.abs(g).max() for g in want)
    names = ['w', 'b', 'gamma', 'beta']
    for k, name in enumerate(names):
        total = np.reshape(sum(np.asarray(grads[k], np.float64) for _, grads in got), -1)
        np.testing.assert_allclose(total, want[k], rtol=2e-4,
                                   atol=2e-4 * np.abs(want[k]).max() + 1e-7 * overall,
                                   err_msg='d(loss + penalty)/d%s' % name)
    dx = np.concatenate([grads[-1] for _, grads in got])
    np.testing.assert_allclose(dx, want[-1], rtol=2e-4, atol=2e-4 * np.abs(want[-1]).max(),
                               err_msg='d(loss + penalty)/dx')

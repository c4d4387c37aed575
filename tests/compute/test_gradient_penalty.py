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

import functools

import numpy as np
import pytest
import tensorflow as tf

import suite_scope
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
#: The layers whose graph the kernel set changes (the compiled kernels or
#: TensorFlow's fused ones, and their gradients): the fused op, with a Python or
#: a tensor is_training, through slim's and tensorpack's front-ends. The global
#: moments (fused=False) and ghost batches build the same graph on both: no
#: kernel of either set (the test checks both).
KERNEL_DEPENDENT = ('slim/fused', 'slim/fused/tensor-is_training', 'tensorpack')
PRODUCT = [(kernels, layer) for kernels in ('custom', 'stock') for layer in sorted(LAYERS)]
# make test (suite_scope.covering; make test-full all 10): every layer on the
# compiled kernels, and on the stock kernels the fused op through slim with a
# Python and a tensor is_training. Left out: fused=False and the ghost path on
# the stock kernels (the same graph as on the compiled ones: no kernel of
# either set in it), and tensorpack's front-end on the stock kernels (the same
# core and kernel ops as slim/fused's on either kernel set, plus the front-end's
# own: the front-end is covered on the compiled kernels, the stock kernels'
# second-order path by slim/fused).
COVERING = [case for case in PRODUCT if case[0] == 'custom' or
            case[1] in ('slim/fused', 'slim/fused/tensor-is_training')]
# The TF1-behaviour pass: is_training as a tensor (a v1 tf.cond: Switch/Merge
# around the fused op and its gradients of both orders) on both kernel sets, and
# the global moments' (reference variables read by the gradients).
PICKED = tf_behavior.pick(suite_scope.covering(PRODUCT, COVERING),
                          [('custom', 'slim/fused/tensor-is_training'),
                           ('stock', 'slim/fused/tensor-is_training'),
                           ('custom', 'slim/fused=False')])


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


@functools.lru_cache(maxsize=None)
def _data():
    """The global batch ``x`` and the loss's ``pull`` (8 examples: every case splits them)."""
    rng = np.random.RandomState(11)
    x = (rng.randn(8, *SHAPE) * 2 + 1).astype(np.float32)
    return x, rng.randn(8, *SHAPE).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _reference():
    """The one-device result in float64 (TensorFlow's own ops, not the library), once."""
    x, pull = (a.astype(np.float64) for a in _data())
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


def _kernel_op_types(graph):
    """The batch-norm kernels' op types in ``graph`` and its functions (v2 cond branches).

    (Not the step watchdog's op, which any synchronized layer has.)
    """
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return {n.op for n in nodes if n.op.startswith(('SyncBn', 'FusedBatchNorm')) and
            n.op != 'SyncBnStepWatchdog'}


@pytest.mark.parametrize('kernel_impl,layer', PICKED, indirect=['kernel_impl'],
                         ids=['%s-%s' % case for case in PICKED])
def test_a_gradient_penalty_equals_one_device(graph, kernel_impl, layer):
    sizes = [4, 4] if layer == 'tf.layers/ghost' else SIZES      # ghost: equal shares
    x, pull = _data()
    want_penalty, want = _reference()

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
    with make_session(graph, len(sizes)) as sess:
        sess.run(tf1.global_variables_initializer())
        got = sess.run(towers, feed)
    kernel_ops = _kernel_op_types(graph)
    assert bool(kernel_ops) == (layer in KERNEL_DEPENDENT), kernel_ops
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

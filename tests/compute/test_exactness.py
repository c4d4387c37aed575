"""N synced towers == one device running fused batch norm on the concatenated batch."""

import numpy as np
import pytest
import tensorflow as tf

import suite_scope
import tf_behavior
from bn_reference import bn_backward, bn_forward, build_towers, split_batches, var
from conftest import make_session
from tf1_syncbn import CollectiveBackend, sync_batch_norm

tf1 = tf.compat.v1
EPS = 1e-3
DECAY = 0.7


def _layer(**kwargs):
    params = dict(scale=True, decay=DECAY, epsilon=EPS,
                  sync_statistics=CollectiveBackend(timeout=60),
                  param_initializers={'gamma': tf1.random_uniform_initializer(0.5, 1.5, seed=1),
                                      'beta': tf1.random_uniform_initializer(-1, 1, seed=2)})
    params.update(kwargs)
    return lambda x: sync_batch_norm(x, **params)


def _fused_reference(graph, shape):
    """Single-device tf.nn.fused_batch_norm on the concatenated batch."""
    with graph.as_default(), tf.device('/cpu:0'), tf1.variable_scope('reference'):
        x = tf1.placeholder(tf.float32, [None] + list(shape[1:]))
        dy = tf1.placeholder(tf.float32, [None] + list(shape[1:]))
        gamma = tf1.placeholder(tf.float32, [shape[-1]])
        beta = tf1.placeholder(tf.float32, [shape[-1]])
        y, mean, var = tf1.nn.fused_batch_norm(x, gamma, beta, epsilon=EPS, is_training=True)
        loss = tf.reduce_sum(y * dy)
        dx, dgamma, dbeta = tf.gradients(loss, [x, gamma, beta])
    return dict(x=x, dy=dy, gamma=gamma, beta=beta, y=y, mean=mean, var=var, dx=dx,
                dgamma=dgamma, dbeta=dbeta)


SIZES = [
    [6],                 # one tower
    [3, 3],              # even
    [5, 1],              # uneven
    [2, 4, 1, 3],        # uneven, 4 towers
    [3, 0, 2, 4],        # one empty tower
    [1, 2, 1, 3, 2, 1, 2, 4],  # 8 towers
]
# Every split on the compiled CPU kernels; on TF's stock kernels (about 5x the
# cost of a case) the uneven ones, one with an empty tower
# (suite_scope.covering; make test-full: every split on both sets). A kernel
# set computes one tower's part between the all-reduces: what it sees of a
# split is its own tower's rows (some, one, none) and the sums, which [5, 1]
# and [3, 0, 2, 4] reach; how many towers take part is the backend's, on the
# compiled set for every split. One tower alone normalizes with
# fused_batch_norm, without a kernel set.
PRODUCT = [(kernels, sizes) for kernels in ('custom', 'stock') for sizes in SIZES]
COVERING = [('custom', sizes) for sizes in SIZES] + [('stock', [5, 1]), ('stock', [3, 0, 2, 4])]
# The TF1-behaviour pass: what it changes here are the moving statistics'
# reference variables, assigned by the update ops in the step's run (the same
# ops for every split): one tower, and towers with an empty one on both sets
# (tf_behavior.pick).
V1_CASES = [('custom', [6]), ('custom', [3, 0, 2, 4]), ('stock', [3, 0, 2, 4])]


@pytest.mark.parametrize('kernel_impl,sizes', [
    pytest.param(k, s, id='%s-%s' % (k, '-'.join(map(str, s))))
    for k, s in tf_behavior.pick(suite_scope.covering(PRODUCT, COVERING), V1_CASES)],
    indirect=['kernel_impl'])
@pytest.mark.versions
def test_towers_equal_fused_on_concatenated_batch(graph, rng, kernel_impl, sizes):
    shape = (None, 4, 3, 5)
    net = build_towers(_layer(), len(sizes), shape)
    gamma, beta = var('BatchNorm/gamma'), var('BatchNorm/beta')
    moving_mean, moving_var = var('BatchNorm/moving_mean'), var('BatchNorm/moving_variance')
    grads = tf.gradients(net['loss'], net['xs'] + [gamma, beta])
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    ref = _fused_reference(graph, shape)
    sess = make_session(graph, max(len(sizes), 1))
    sess.run(tf1.global_variables_initializer())
    g_val, b_val = sess.run([gamma, beta])
    exp_mm, exp_mv = np.zeros(5), np.ones(5)
    for step in range(3):
        total = sum(sizes)
        x = (rng.randn(total, 4, 3, 5) * (step + 1) + rng.randn(5) * 3).astype(np.float32)
        dy = rng.randn(total, 4, 3, 5).astype(np.float32)
        feed = {}
        for ph, part in zip(net['xs'], split_batches(x, sizes)):
            feed[ph] = part
        for ph, part in zip(net['dys'], split_batches(dy, sizes)):
            feed[ph] = part
        feed.update({ref['x']: x, ref['dy']: dy, ref['gamma']: g_val, ref['beta']: b_val})
        ys, gs, _, r = sess.run([net['ys'], grads, updates, ref], feed)
        # Against single-device fused batch norm.
        np.testing.assert_allclose(np.concatenate(ys), r['y'], rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(np.concatenate(gs[:len(sizes)]), r['dx'], rtol=1e-4,
                                   atol=5e-5)
        np.testing.assert_allclose(gs[-2], r['dgamma'], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(gs[-1], r['dbeta'], rtol=1e-4, atol=1e-4)
        # Against float64 numpy.
        f = bn_forward(x, g_val, b_val, EPS)
        b = bn_backward(dy, x, g_val, EPS)
        np.testing.assert_allclose(np.concatenate(ys), f['y'], rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(np.concatenate(gs[:len(sizes)]), b['dx'], rtol=1e-4,
                                   atol=5e-5)
        np.testing.assert_allclose(gs[-2], b['dgamma'], rtol=1e-4, atol=1e-4)
        exp_mm = exp_mm * DECAY + f['mean'] * (1 - DECAY)
        exp_mv = exp_mv * DECAY + f['var_unbiased'] * (1 - DECAY)
        # The fused kernel's variance output is Bessel-corrected: same target.
        np.testing.assert_allclose(r['var'], f['var_unbiased'], rtol=1e-4)
    mm, mv = sess.run([moving_mean, moving_var])
    np.testing.assert_allclose(mm, exp_mm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mv, exp_mv, rtol=1e-5, atol=1e-5)
    sess.close()


# Every kernel set, TF2-behaviour pass only: the graph is the towers' of the
# other tests (the same shapes with an unknown batch size, built in both
# passes there), and it runs no update op and no assignment.
@pytest.mark.once(reason='no variable is assigned; the TF1 pass builds the same graph above')
@pytest.mark.usefixtures('kernel_impl')
def test_batch_sizes_change_between_steps(graph, rng):
    net = build_towers(_layer(), 3, (None, 2, 2, 3))
    grads = tf.gradients(net['loss'], net['xs'])
    sess = make_session(graph, 3)
    sess.run(tf1.global_variables_initializer())
    g, b = sess.run([var('BatchNorm/gamma'), var('BatchNorm/beta')])
    for sizes in ([1, 2, 3], [4, 0, 1], [2, 2, 2], [0, 0, 5]):
        x = rng.randn(sum(sizes), 2, 2, 3).astype(np.float32)
        dy = rng.randn(*x.shape).astype(np.float32)
        feed = dict(zip(net['xs'], split_batches(x, sizes)))
        feed.update(zip(net['dys'], split_batches(dy, sizes)))
        ys, dxs = sess.run([net['ys'], grads], feed)
        np.testing.assert_allclose(np.concatenate(ys), bn_forward(x, g, b, EPS)['y'],
                                   rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(np.concatenate(dxs), bn_backward(dy, x, g, EPS)['dx'],
                                   rtol=1e-4, atol=5e-5)
    sess.close()


@pytest.mark.usefixtures('kernel_impl')
def test_all_towers_empty_gives_empty_outputs_and_no_nan(graph):
    net = build_towers(_layer(), 2, (None, 3))
    grads = tf.gradients(net['loss'], net['xs'] + [var('BatchNorm/gamma')])
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    sess = make_session(graph, 2)
    sess.run(tf1.global_variables_initializer())
    empty = np.zeros((0, 3), np.float32)
    feed = {net['xs'][0]: empty, net['xs'][1]: empty, net['dys'][0]: empty,
            net['dys'][1]: empty}
    ys, gs, _ = sess.run([net['ys'], grads, updates], feed)
    assert ys[0].shape == (0, 3)
    assert np.all(np.isfinite(gs[-1]))
    mm, mv = sess.run([var('BatchNorm/moving_mean'), var('BatchNorm/moving_variance')])
    assert np.all(np.isfinite(mm)) and np.all(np.isfinite(mv))
    sess.close()

"""No output or gradient depends on whether an assignment of the same step ran first.

In TF1 behaviour (``disable_v2_behavior()``) variables are reference
variables: a read shares the variable's buffer, so an assignment of the same
step (the layer's own moving-average updates, renorm's statistics, an
optimizer's update of ``gamma``) that runs before the read's consumers changes
what they compute, and identical steps give different numbers from run to
run. Each case here repeats one training step 40 times from the same
variables and requires bitwise-identical results, on both kernel sets; in
TF2-behaviour graph mode (resource variables) the same must hold.

The same holds for the sums of the towers' gradients, in both behaviours:
TensorFlow sums them with ``AddN``, whose order of summation depends on
which of its inputs no other op still holds when it runs. A gradient that a
layer hands to ``beta`` while another op of the backward pass still reads
the same buffer (the non-fused paths did: ``offset * gamma + beta``) gave
``beta`` gradients a rounding apart from one identical step to the next
(see :func:`test_identical_steps_give_identical_gradient_sums`).
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
from conftest import make_session
from tf1_syncbn import layers, sync_batch_norm
from tower import TowerContext, average_gradients

tf1 = tf.compat.v1
TOWERS = 4
REPEATS = 40

CASES = {
    # renorm reads renorm_mean/renorm_stddev, which the main tower's update ops
    # assign in the same step (16 of 40 runs differed before).
    'renorm': dict(renorm=True, renorm_decay=0.5, decay=0.5, scale=True,
                   renorm_clipping={'rmax': 3.0, 'rmin': 0.3, 'dmax': 5.0}),
    # the fast path's input gradient uses gamma, which the optimizer assigns.
    'fused': dict(scale=True, decay=0.5),
    'fused=False': dict(scale=True, fused=False, decay=0.5),
}


def _step(params):
    """A 4-tower graph: outputs, input gradients, one SGD step and the update ops."""
    x = tf1.placeholder(tf.float32, [None, 4, 4, 6])
    opt = tf1.train.GradientDescentOptimizer(5.0)
    ys, dxs, tower_grads = [], [], []
    for i, xi in enumerate(tf.split(x, TOWERS)):
        with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i, total=TOWERS):
            y = sync_batch_norm(xi, is_training=True, **params)
            loss = tf.reduce_sum(y * tf.sin(xi))
            variables = tf1.trainable_variables()
            grads = tf.gradients(loss, [xi] + variables)
            ys.append(y)
            dxs.append(grads[0])
            tower_grads.append(list(zip(grads[1:], variables)))
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = opt.apply_gradients(average_gradients(tower_grads))
    return x, [tf.concat(ys, 0), tf.concat(dxs, 0)], train_op


def _repeat(sess, variables, step, feed):
    """``REPEATS`` runs of ``step`` (its last fetch the train op) from the same variables.

    Each run: the step's fetches but the last, then the variables after the
    step, read in a run of their own: fetched beside the train op, a
    variable's read races with its own update (in either behaviour, whatever
    the layer does), and did differ.
    """
    start = sess.run(variables)
    # What ``variable.load`` runs (the initializer with its value fed), for all
    # of them in one run.
    restore = [v.initializer for v in variables]
    values = {v.initializer.inputs[1]: value for v, value in zip(variables, start)}
    runs = []
    for _ in range(REPEATS):
        sess.run(restore, values)
        runs.append(sess.run(step, feed)[:-1] + sess.run(variables))
    return runs


def _differing(names, runs):
    """``{run index: ['name (max difference)', ...]}`` of the runs that differ from the first."""
    differing = {}
    for k, run in enumerate(runs):
        for name, a, b in zip(names, run, runs[0]):
            if not np.array_equal(a, b):
                differing.setdefault(k, []).append(
                    '%s (max %g)' % (name, np.max(np.abs(np.subtract(a, b)))))
    return differing


# The kernel sets (compiled or stock) compute the fused synchronized path only
# (tf1_syncbn._core.normalize.train: renorm and fused=False take the slow
# path, built of TensorFlow's ops whatever the set): 'fused' runs on both, the
# slow paths once. The race of a read with an assignment of the same step is
# TF1 behaviour's (reference variables): that pass runs every case. In
# TF2-behaviour graph mode (resource variables: a read never aliases an
# assignment's buffer) what can still make identical steps differ is the order
# of AddN's sums, which test_identical_steps_give_identical_gradient_sums
# covers there for the slow paths (renorm, fused=False); 'fused' runs here.
READ_CASES = [('custom', 'fused'), ('stock', 'fused'), ('custom', 'fused=False'),
              ('custom', 'renorm')]


READ_CASES_HERE = READ_CASES if tf_behavior.is_v1() else READ_CASES[:2]


@pytest.mark.parametrize('kernel_impl,case', READ_CASES_HERE, indirect=['kernel_impl'])
def test_identical_steps_give_identical_numbers(graph, kernel_impl, case):
    x, fetches, train_op = _step(CASES[case])
    rng = np.random.RandomState(0)
    warmup = (rng.randn(16, 4, 4, 6) * 2.0 + 1.0).astype(np.float32)
    data = (rng.randn(16, 4, 4, 6) * 3.0 + 5.0).astype(np.float32)
    with make_session(graph, TOWERS) as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(2):    # statistics away from their initial values
            sess.run(train_op, {x: warmup})
        variables = tf1.global_variables()
        runs = _repeat(sess, variables, fetches + [train_op], {x: data})
    differing = _differing(['outputs', 'input gradients'] + [v.op.name for v in variables],
                           runs)
    assert not differing, '%d of %d identical steps differ: %s' % (
        len(differing), REPEATS, sorted(differing.items())[:5])


# The non-fused paths, whose gradients of beta are built by TensorFlow's ops.
SLOW_LAYERS = {
    'fused=False': lambda x: sync_batch_norm(x, is_training=True, scale=True, fused=False,
                                             decay=0.5, scope='bn'),
    'renorm': lambda x: sync_batch_norm(x, is_training=True, scale=True, renorm=True,
                                        decay=0.5, renorm_decay=0.5, scope='bn',
                                        renorm_clipping={'rmax': 3.0, 'rmin': 0.3, 'dmax': 5.0}),
    'tf.layers fused=False': lambda x: layers.batch_normalization(x, training=True, fused=False,
                                                                  momentum=0.5, name='bn'),
    'per-tower fused=False': lambda x: sync_batch_norm(x, is_training=True, scale=True,
                                                       fused=False, decay=0.5, scope='bn',
                                                       sync_statistics=None),
}


def _model_step(layer):
    """4 towers of conv, the layer, relu and a dense layer; one loss over the towers.

    The gradients are those of the mean of the towers' losses (one
    ``compute_gradients``: ``AddN`` sums the towers' gradients of every
    variable); the step applies the layer's (gamma, beta) and runs its
    moving-average updates. The conv and dense layers are not updated (the
    gradient of MatMul reads ``dense`` again, which an update of it would
    race with in TF1 behaviour); their gradients are fetched, so that their
    backward kernels run beside the layer's.
    """
    x = tf1.placeholder(tf.float32, [None, 4, 4, 3])
    losses = []
    for i, xi in enumerate(tf.split(x, TOWERS)):
        with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i, total=TOWERS):
            with tf1.variable_scope('model', reuse=i > 0):
                kernel = tf1.get_variable('conv', [3, 3, 3, 8],
                                          initializer=tf1.glorot_uniform_initializer(seed=1))
                dense = tf1.get_variable('dense', [8, 5],
                                         initializer=tf1.glorot_uniform_initializer(seed=2))
            y = layer(tf.nn.conv2d(xi, kernel, 1, 'SAME'))
            logits = tf.matmul(tf.reduce_mean(tf.nn.relu(y), [1, 2]), dense)
            losses.append(tf.reduce_sum(tf.square(logits - 1.0)))
    opt = tf1.train.GradientDescentOptimizer(0.1)
    grads_and_vars = opt.compute_gradients(tf.add_n(losses) / TOWERS)
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = opt.apply_gradients([(g, v) for g, v in grads_and_vars
                                        if not v.op.name.startswith('model/')])
    return x, grads_and_vars, train_op


# Slow paths only: the kernel sets do not take part (see READ_CASES), one run
# each. The order of AddN's sums is at stake in both behaviours: the TF1 pass
# runs the two synchronized slow paths (tf_behavior.pick); tf.layers' is the
# same core path behind another front-end, the per-tower one the same path
# without the all-reduce (the copy of beta's and gamma's gradients,
# _own_gradient_buffer, is built the same way in all four).
@pytest.mark.parametrize('kernel_impl', ['custom'], indirect=True)
@pytest.mark.parametrize('case', tf_behavior.pick(sorted(SLOW_LAYERS), ['fused=False', 'renorm']))
def test_identical_steps_give_identical_gradient_sums(graph, kernel_impl, case):
    """The towers' summed gradients, and the updated variables, are the same in identical steps.

    Before the slow path handed out gradients of beta of their own, the
    gradient of beta (and beta after the step) took two values 1 ulp apart
    in 3 to 34 of the 40 steps of every case, in both behaviours.
    """
    x, grads_and_vars, train_op = _model_step(SLOW_LAYERS[case])
    rng = np.random.RandomState(0)
    data = rng.randn(8, 4, 4, 3).astype(np.float32)
    grads = [g for g, _ in grads_and_vars]
    with make_session(graph, TOWERS) as sess:
        sess.run(tf1.global_variables_initializer())
        variables = tf1.global_variables()
        # (Fetching the variables in the step's run would also hold buffers
        # that AddN could otherwise take, and hid the difference.)
        runs = _repeat(sess, variables, grads + [train_op], {x: data})
    differing = _differing(['gradient of %s' % v.op.name for _, v in grads_and_vars] +
                           [v.op.name for v in variables], runs)
    assert not differing, '%d of %d identical steps differ: %s' % (
        len(differing), REPEATS, sorted(differing.items())[:3])

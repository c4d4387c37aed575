"""Harnesses that mark towers with plain name scopes, written as their scripts do.

* tf-slim's ``model_deploy`` (behind ``train_image_classifier.py``): clones in
  ``tf.name_scope('clone_%d')`` on their own devices, variables shared with
  ``variable_scope(reuse=i > 0)``, each clone's loss divided by the number of
  clones and the gradients summed, and **the first clone's** ``UPDATE_OPS``
  (``tf.get_collection(UPDATE_OPS, 'clone_0')``).
* The classic multi-GPU scripts (``cifar10_multi_gpu_train.py``,
  ``inception_train.py``): towers in ``tf.name_scope('tower_%d')``,
  ``reuse_variables()`` after the first tower, averaged gradients, and **the
  last tower's** ``UPDATE_OPS``.

The library is plugged in as a user would: ``sync_batch_norm`` as the
``normalizer_fn`` of ``slim.conv2d`` with ``num_dev``. The reference is the
same net on one device with the concatenated batch, whose batch norm is
``tf.nn.fused_batch_norm`` plus its moving averages (what slim's fused path
computes), written here. Compared after several SGD steps: the loss of every
step, every variable, the moving statistics. On the compiled CPU kernels here,
and on the stock kernels with oneDNN off in a child run
(``test_stock_without_onednn.py``).
"""

import functools
import warnings

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import suite_scope
import tf_behavior
from conftest import make_session
from tf1_syncbn import SyncBNWarning, sync_arg_scope, sync_batch_norm
from tower import average_gradients
from without_onednn import kernel_set, kernel_sets

tf1 = tf.compat.v1
DECAY = 0.8
EPS = 1e-3
STEPS = 4
SHAPE = (6, 6, 3)
CLASSES = 4
PER_TOWER = 3

_rng = np.random.RandomState(7)
W_CONV = (_rng.randn(3, 3, SHAPE[-1], 8) * 0.3).astype(np.float32)
W_FC = (_rng.randn(8, CLASSES) * 0.3).astype(np.float32)


def fused_reference_bn(inputs, decay, epsilon, scale=True, **unused):
    """Single-device batch norm: ``tf.nn.fused_batch_norm`` and slim's variable names."""
    del unused
    with tf1.variable_scope(None, 'BatchNorm'):
        channels = inputs.shape[-1]
        beta = tf1.get_variable('beta', [channels], initializer=tf1.zeros_initializer())
        gamma = tf1.get_variable('gamma', [channels], initializer=tf1.ones_initializer())
        mean_var = tf1.get_variable('moving_mean', [channels], trainable=False,
                                    initializer=tf1.zeros_initializer())
        var_var = tf1.get_variable('moving_variance', [channels], trainable=False,
                                   initializer=tf1.ones_initializer())
        y, mean, variance = tf1.nn.fused_batch_norm(inputs, gamma if scale else None, beta,
                                                    epsilon=epsilon, is_training=True)
        for v, batch in ((mean_var, mean), (var_var, variance)):   # variance: Bessel-corrected
            tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS,
                                  tf1.assign(v, v * decay + batch * (1 - decay)))
        return y


def model(images, labels, normalizer_fn, normalizer_params):
    with tf1.variable_scope('net'):
        net = slim.conv2d(images, 8, [3, 3], activation_fn=tf.nn.relu, biases_initializer=None,
                          weights_initializer=tf1.constant_initializer(W_CONV),
                          normalizer_fn=normalizer_fn, normalizer_params=normalizer_params,
                          scope='conv1')
        net = tf.reduce_mean(net, [1, 2])
        logits = slim.fully_connected(net, CLASSES, activation_fn=None,
                                      weights_initializer=tf1.constant_initializer(W_FC),
                                      scope='fc')
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=logits))


def _data(towers):
    rng = np.random.RandomState(towers)
    n = STEPS * towers * PER_TOWER
    images = (rng.randn(n, *SHAPE) * 2 + 1).astype(np.float32)
    labels = rng.randint(0, CLASSES, n).astype(np.int32)
    return images, labels


def _train(build, towers):
    """Builds with ``build(images, labels, optimizer)``; runs STEPS SGD steps."""
    images_all, labels_all = _data(towers)
    graph = tf.Graph()
    with graph.as_default():
        images = tf1.placeholder(tf.float32, (None,) + SHAPE)
        labels = tf1.placeholder(tf.int32, [None])
        optimizer = tf1.train.GradientDescentOptimizer(0.5)
        loss, train_op = build(images, labels, optimizer)
        init = tf1.global_variables_initializer()
        names = sorted(v.op.name for v in tf1.global_variables())
        variables = [v for v in sorted(tf1.global_variables(), key=lambda v: v.op.name)]
    batch = towers * PER_TOWER
    losses = []
    with make_session(graph, towers) as sess:
        sess.run(init)
        for step in range(STEPS):
            part = slice(step * batch, (step + 1) * batch)
            losses.append(sess.run([loss, train_op], {images: images_all[part],
                                                      labels: labels_all[part]})[0])
        values = sess.run(variables)
    return np.array(losses), dict(zip(names, values)), graph


@functools.lru_cache(maxsize=None)
def _reference(towers):
    """The one-device run on the concatenated batch of ``towers`` towers (once per module)."""
    def build(images, labels, optimizer):
        with tf.device('/cpu:0'):
            loss = model(images, labels, fused_reference_bn, {'decay': DECAY, 'epsilon': EPS})
            with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                return loss, optimizer.minimize(loss)
    return _train(build, towers)


def nchw_sync_batch_norm(inputs, **params):
    """``sync_batch_norm`` on the channels-first layout, for an NHWC net (CPU convs are NHWC)."""
    y = sync_batch_norm(tf.transpose(inputs, [0, 3, 1, 2]), data_format='NCHW', **params)
    return tf.transpose(y, [0, 2, 3, 1])


def _sync_params(towers, **extra):
    params = {'decay': DECAY, 'epsilon': EPS, 'scale': True, 'num_dev': towers,
              'sync_statistics': 'collective'}
    params.update(extra)
    return params


def _keep(keep, towers, scope_format):
    if keep == 'first':
        return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope_format % 0)
    if keep == 'last':
        return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope_format % (towers - 1))
    return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)


def model_deploy_clones(towers, keep, params=None, devices=None, layer=sync_batch_norm):
    """tf-slim's model_deploy, inlined: clone_%d scopes, summed (loss / clones) gradients."""
    def build(images, labels, optimizer):
        image_parts, label_parts = tf.split(images, towers), tf.split(labels, towers)
        losses, grads = [], []
        for i in range(towers):
            device = devices[i] if devices else '/cpu:%d' % i
            with tf.name_scope('clone_%d' % i), tf.device(device):
                with tf1.variable_scope(tf1.get_variable_scope(), reuse=True if i > 0 else None):
                    loss = model(image_parts[i], label_parts[i], layer,
                                 params or _sync_params(towers))
                    losses.append(loss)
                    grads.append(optimizer.compute_gradients(loss / towers))
        # model_deploy._sum_clones_gradients
        summed = [(tf.add_n([g[k][0] for g in grads]), grads[0][k][1])
                  for k in range(len(grads[0]))]
        with tf.control_dependencies(_keep(keep, towers, 'clone_%d')):
            train_op = optimizer.apply_gradients(summed)
        return tf.add_n(losses) / towers, train_op
    return build


def classic_towers(towers, keep, layer=sync_batch_norm):
    """cifar10_multi_gpu_train.py / inception_train.py: tower_%d scopes, reuse_variables()."""
    def build(images, labels, optimizer):
        image_parts, label_parts = tf.split(images, towers), tf.split(labels, towers)
        losses, tower_grads = [], []
        for i in range(towers):
            with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
                loss = model(image_parts[i], label_parts[i], layer, _sync_params(towers))
                tf1.get_variable_scope().reuse_variables()
                losses.append(loss)
                tower_grads.append(optimizer.compute_gradients(loss))
        with tf.control_dependencies(_keep(keep, towers, 'tower_%d')):
            train_op = optimizer.apply_gradients(average_gradients(tower_grads))
        return tf.add_n(losses) / towers, train_op
    return build


def _assert_matches_reference(result, reference):
    losses, variables, _ = result
    ref_losses, ref_variables, _ = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert sorted(variables) == sorted(ref_variables)
    for name, value in ref_variables.items():
        np.testing.assert_allclose(variables[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # The moving statistics moved: STEPS updates, each exactly once.
    assert not np.allclose(variables['net/conv1/BatchNorm/moving_mean'], 0)


def _assert_kernel_set(graph, kernel_impl):
    kernel_ops = [op for op in graph.get_operations() if op.type.startswith('SyncBn') and
                  op.type != 'SyncBnStepWatchdog']
    if kernel_impl == 'custom':
        assert kernel_ops, 'the compiled kernels were not used'
    else:
        assert not kernel_ops, 'the stock kernel set used the compiled kernels'


KERNEL_SETS = ('custom', 'stock')
HARNESSES = (model_deploy_clones, classic_towers)


def _cases(cases, v1_cases):
    """``pytest.param``s of the cases this process runs (kernel set first in the id).

    The cases this process's kernel sets take (``without_onednn.kernel_sets``:
    the stock ones run here where oneDNN is off, else in the child run of
    ``test_stock_without_onednn.py``, which counts this test's parameters
    here: each covering set below has as many stock cases as custom ones), of
    this TF behaviour's (``tf_behavior.pick``).
    """
    def ident(case):
        parts = dict(zip(names, case))
        return '-'.join(str(getattr(parts[n], '__name__', parts[n])) for n in
                        ('kernel_impl', 'harness', 'keep', 'towers') if n in parts)

    names = ('keep', 'kernel_impl', 'towers', 'harness')
    return [pytest.param(*case, id=ident(case)) for case in tf_behavior.pick(cases, v1_cases)
            if case[1] in kernel_sets()]


PRODUCT = [(keep, kernels, towers, harness) for keep in ('first', 'last', 'all')
           for kernels in KERNEL_SETS for towers in (2, 4) for harness in HARNESSES]
# make test runs an all-pairs covering set of the keep x kernel set x towers x
# harness product (suite_scope.covering; make test-full all 24): 6 cases, 3 per
# kernel set, in which every value of each factor meets every value of each
# other (each harness keeps first, last and all updates; each kernel set runs
# both harnesses, both tower counts and every keep; each tower count both
# harnesses and every keep). A triple adds no path: the layer is built before
# the harness picks which tower's UPDATE_OPS it keeps, so what the layer builds
# depends on the kernel set, the number of towers and the tower scope
# (clone_%d or tower_%d, with its way of reusing variables), each two of them at
# most through the graph; keep chooses which of the built towers' update ops
# run, and each tower's update ops trigger the same all-reduced update on every
# kernel set, which each pair of keep with the other factors checks.
COVERING = suite_scope.pairwise(('first', 'last', 'all'), KERNEL_SETS, (2, 4), HARNESSES)
# The TF1-behaviour pass: reference variables, assigned by the update ops
# (every keep: first, last and all of them, once each per step) and read by
# the forward pass of the step that updates them; on both kernel sets and
# both tower scopes, 2 towers (the number of towers changes nothing TF1
# behaviour changes). (No v1 control flow: is_training is a Python bool.)
V1_COVERING = [('first', 'custom', 2, model_deploy_clones),
               ('last', 'custom', 2, classic_towers),
               ('all', 'stock', 2, classic_towers)]


@pytest.mark.parametrize('keep,kernel_impl,towers,harness',
                         _cases(suite_scope.covering(PRODUCT, COVERING), V1_COVERING))
def test_harness_equals_one_device_on_the_concatenated_batch(towers, keep, harness, kernel_impl):
    with kernel_set(kernel_impl):
        result = _train(harness(towers, keep), towers)
    _assert_matches_reference(result, _reference(towers))
    graph = result[2]
    collectives = [op for op in graph.get_operations() if op.type == 'CollectiveReduce']
    assert len(collectives) == 2 * towers   # one layer: one all-reduce forward, one backward
    _assert_kernel_set(graph, kernel_impl)


NCHW_PRODUCT = [(keep, kernels, towers, harness) for kernels in KERNEL_SETS for towers in (2, 4)
                for harness, keep in ((model_deploy_clones, 'first'), (classic_towers, 'last'))]
# make test: every pair of kernel set, towers and harness (with its own
# updates) in 4 of the 8 cases (make test-full all 8), 2 per kernel set: the
# channels-first layer on each kernel set in both harnesses and with 2 and 4
# towers, each harness with both tower counts. The layout changes what the
# layer builds for the kernel set (the channel axis of its statistics and of
# its kernels); the harness and the tower count change nothing of it, as in
# the test above.
NCHW_COVERING = [('first', 'custom', 2, model_deploy_clones), ('last', 'custom', 4, classic_towers),
                 ('first', 'stock', 4, model_deploy_clones), ('last', 'stock', 2, classic_towers)]
# The TF1-behaviour pass: the layout's shapes (Dimension objects) on each
# kernel set, in each harness.
NCHW_V1 = [('first', 'custom', 2, model_deploy_clones), ('last', 'stock', 2, classic_towers)]


@pytest.mark.parametrize('keep,kernel_impl,towers,harness',
                         _cases(suite_scope.covering(NCHW_PRODUCT, NCHW_COVERING), NCHW_V1))
def test_harness_with_channels_first_batch_norm(towers, keep, harness, kernel_impl):
    """The same nets with the layer on NCHW (as GPU nets run it), each harness's own updates."""
    with kernel_set(kernel_impl):
        result = _train(harness(towers, keep, layer=nchw_sync_batch_norm), towers)
    _assert_matches_reference(result, _reference(towers))   # (gamma has 8 channels, not 6)
    _assert_kernel_set(result[2], kernel_impl)


@pytest.mark.parametrize('kernel_impl', kernel_sets())
def test_model_deploy_with_sync_arg_scope_around_a_slim_batch_norm_net(kernel_impl):
    """The README's model_deploy recipe: the net names slim.batch_norm; clone_fn wraps it."""
    towers = 2

    def build(images, labels, optimizer):
        image_parts, label_parts = tf.split(images, towers), tf.split(labels, towers)
        losses, grads = [], []
        for i in range(towers):
            with tf.name_scope('clone_%d' % i), tf.device('/cpu:%d' % i):
                with tf1.variable_scope(tf1.get_variable_scope(), reuse=True if i > 0 else None):
                    # clone_fn: the only change is the sync_arg_scope line.
                    with sync_arg_scope(sync_statistics='collective', num_dev=towers):
                        loss = model(image_parts[i], label_parts[i], slim.batch_norm,
                                     {'decay': DECAY, 'epsilon': EPS, 'scale': True})
                    losses.append(loss)
                    grads.append(optimizer.compute_gradients(loss / towers))
        summed = [(tf.add_n([g[k][0] for g in grads]), grads[0][k][1])
                  for k in range(len(grads[0]))]
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, 'clone_0')):
            train_op = optimizer.apply_gradients(summed)
        return tf.add_n(losses) / towers, train_op

    with kernel_set(kernel_impl):
        result = _train(build, towers)
    _assert_matches_reference(result, _reference(towers))
    assert len([op for op in result[2].get_operations() if op.type == 'CollectiveReduce']) == 4
    _assert_kernel_set(result[2], kernel_impl)


def test_model_deploy_clone_on_cpu_is_a_build_error():
    # model_deploy's clone_on_cpu=True puts every clone on CPU:0: towers on one
    # device cannot synchronize, and say so instead of hanging.
    with tf.Graph().as_default():
        images = tf1.placeholder(tf.float32, (None,) + SHAPE)
        labels = tf1.placeholder(tf.int32, [None])
        build = model_deploy_clones(2, 'first', devices=['/cpu:0', '/cpu:0'])
        with pytest.raises(ValueError, match='both on device'):
            build(images, labels, tf1.train.GradientDescentOptimizer(0.1))


def _build_clones_without_num_dev(sync_statistics):
    with tf.Graph().as_default():
        images = tf1.placeholder(tf.float32, (None,) + SHAPE)
        labels = tf1.placeholder(tf.int32, [None])
        params = {'decay': DECAY, 'sync_statistics': sync_statistics}
        build = model_deploy_clones(2, 'first', params=params)
        build(images, labels, tf1.train.GradientDescentOptimizer(0.1))
        return tf1.get_default_graph()


def test_explicit_backend_without_num_dev_in_clones_is_a_build_error():
    with pytest.raises(ValueError, match=r"sync_statistics='collective'.*cannot tell how "
                                         r"many towers.*num_dev"):
        _build_clones_without_num_dev('collective')


def test_auto_without_num_dev_in_clones_is_a_build_error():
    """Before, it warned once and normalized each clone alone; now the second clone refuses."""
    with pytest.raises(ValueError, match=r"sync_batch_norm\(net/conv1/BatchNorm\): "
                                         r"sync_statistics='auto' cannot tell the layer's "
                                         r"group: its name scope 'clone_1/.*' looks like tower "
                                         r'1 .*Pass num_dev=<number of towers in this graph>'):
        _build_clones_without_num_dev('auto')


def test_sync_statistics_none_in_clones_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter('error', SyncBNWarning)
        _build_clones_without_num_dev(None)

"""tf_slim.nets with sync_batch_norm: 2 synced towers == 1 tower on the whole batch.

Each net is built with its own arg scope (``resnet_arg_scope``,
``inception_v3_arg_scope``, ``vgg_arg_scope``) inside
``tf1_syncbn.sync_arg_scope``, in a graph that holds two copies of the model:

* ``multi/``: 2 towers on 2 virtual CPUs, per-tower batch 2, synced statistics,
  averaged gradients (``tower.average_gradients``);
* ``single/``: 1 tower on batch 4 (a single tower is plain fused batch norm
  over the whole batch), started from the same variable values.

One SGD step must give the same loss, gradients and updated variables
(trainable ones and the moving statistics) in both.

Why ``beta`` starts at 3 (``sync_arg_scope(..., param_initializers=...)``):
at random init with 4 examples, these ReLU nets are chaotic in float32. With
the default ``beta = 0`` many ReLU inputs sit within rounding of zero, and
the two models, which differ only in rounding (convolutions on 2 vs 4
examples, float64 vs float32 moments), switch a few of them differently;
every switch changes the gradients of all the layers below. Measured with
``beta = 0``: two *identical* single-tower models fed the same batch in
another order, or scaled by 1 + 1e-6, already differ by 1-4% in the
gradients of resnet_v1_50 and by 10-20% in inception_v3, the same as the
2-tower model. With ``beta = 3`` the ReLUs are far from zero, and the 2-tower
and 1-tower gradients agree to ~3e-5 (ResNets) and ~7e-4 (inception_v3) of
each variable's largest gradient. Equivalence holds for any parameter values,
so this tests the same thing, without the noise.

Sizes: 64x64 for the ResNets (at 32x32 their last block normalizes 4 values
per channel, which costs float32 digits), 75x75 for inception_v3 (its
smallest input). vgg_16 only gets the 2-tower build test and a forward check:
its ``fc6`` is a VALID 7x7 convolution, so it needs 224x224 inputs, and with
138M parameters an SGD step on two model copies costs more time and memory
than this file's budget allows. VGG has no batch norm: it is added to every
convolution but the logits with ``add_normalizer_to=[slim.conv2d]``.

Grappler is switched off in these sessions: it would spend most of the test's
time optimizing the graphs once, and it may fuse ops differently in the two
copies.
"""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim
from tf_slim.nets import inception_v3, resnet_v1, resnet_v2, vgg
from tf_slim.ops import arg_scope as slim_arg_scope

import suite_scope
import tf_behavior
from tf1_syncbn import sync_arg_scope, sync_batch_norm
from tf1_syncbn.slim import patch as convert
from tower import average_gradients, call_for_each_tower, get_current_tower_context
from tower import virtual_cpu_config

tf1 = tf.compat.v1

NUM_CLASSES = 5
BATCH = 4
LEARNING_RATE = 0.1
# beta starts at 3 instead of 0 (see the module docstring).
BN_OVERRIDES = {'param_initializers': {'beta': tf1.constant_initializer(3.0)}}

_NETS = {
    # name: (arg_scope_fn, model_fn, image size, number of batch-norm layers,
    #        gradient tolerance: max error / largest entry, per variable; at 75x75
    #        inception's last blocks normalize 4 values per channel and lose
    #        more float32 digits than the ResNets at 64x64)
    'resnet_v1_50': (resnet_v1.resnet_arg_scope,
                     lambda x: resnet_v1.resnet_v1_50(x, num_classes=NUM_CLASSES), 64, 53, 1e-3),
    'resnet_v2_50': (resnet_v2.resnet_arg_scope,
                     lambda x: resnet_v2.resnet_v2_50(x, num_classes=NUM_CLASSES), 64, 49, 1e-3),
    'inception_v3': (inception_v3.inception_v3_arg_scope,
                     lambda x: inception_v3.inception_v3(
                         x, num_classes=NUM_CLASSES, dropout_keep_prob=1.0,
                         create_aux_logits=False), 75, 94, 3e-3),
    'vgg_16': (vgg.vgg_arg_scope,
               lambda x: vgg.vgg_16(x, num_classes=NUM_CLASSES, dropout_keep_prob=1.0),
               224, 15, None),
}


def _session(graph, towers):
    config = virtual_cpu_config(towers)
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    return tf1.Session(graph=graph, config=config)


def _build(name, scope, towers, batch=BATCH, with_train=True, overrides=None):
    """Builds ``towers`` towers of net ``name`` under variable scope ``scope``."""
    overrides = BN_OVERRIDES if overrides is None else overrides
    arg_scope_fn, model_fn, size = _NETS[name][:3]
    optimizer = tf1.train.GradientDescentOptimizer(LEARNING_RATE)
    extra = {'add_normalizer_to': [slim.conv2d]} if name == 'vgg_16' else {}
    # One variable scope (and so one name scope) for the whole copy: re-entering
    # it would open the name scope 'multi_1'.
    with tf1.variable_scope(scope):
        images = tf1.placeholder(tf.float32, [batch, size, size, 3], name='images')
        labels = tf1.placeholder(tf.int32, [batch], name='labels')
        image_parts = tf.split(images, towers)
        label_parts = tf.split(labels, towers)

        def tower_fn():
            i = get_current_tower_context().index
            with sync_arg_scope(arg_scope_fn(), **dict(extra, **overrides)):
                logits, _ = model_fn(image_parts[i])
            logits = tf.reshape(logits, [-1, NUM_CLASSES])
            if not with_train:
                return logits, None, None
            # Cross entropy only: the weight-decay losses are created once, in
            # tower 0, and would only add the same term to both models.
            loss = tf1.losses.sparse_softmax_cross_entropy(label_parts[i], logits,
                                                           loss_collection=None)
            grads = optimizer.compute_gradients(loss, tf1.trainable_variables(scope + '/'))
            return logits, loss, grads

        results = call_for_each_tower(tower_fn, ['/cpu:%d' % i for i in range(towers)])
    model = {'images': images, 'labels': labels,
             'logits': tf.concat([r[0] for r in results], 0)}
    if with_train:
        model['loss'] = tf.add_n([r[1] for r in results]) / towers
        grads = average_gradients([r[2] for r in results])
        model['grads'] = grads
        updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope + '/')
        with tf.control_dependencies(updates):
            model['train'] = optimizer.apply_gradients(grads)
    return model


def _check_structure(graph, name, scope, towers):
    """Variables shared by the towers, sync ops present, updates on tower 0 only."""
    num_bn = _NETS[name][3]
    variables = tf1.global_variables(scope + '/')
    moving_means = [v for v in variables if v.op.name.endswith('/moving_mean')]
    assert len(moving_means) == num_bn
    assert not [v for v in variables if '/tower' in v.op.name], 'towers must share variables'
    # The main tower builds the assignments; every other tower holds one
    # trigger of them per layer (whichever tower's UPDATE_OPS a harness keeps).
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope + '/tower0/')
    assert len(updates) == 2 * num_bn
    assert all(not isinstance(u, tf.Operation) for u in updates)  # the assignments
    for i in range(1, towers):
        triggers = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, '%s/tower%d/' % (scope, i))
        assert len(triggers) == num_bn and all(op.type == 'NoOp' for op in triggers)
    collectives = [op for op in graph.get_operations()
                   if op.name.startswith(scope + '/') and 'Collective' in op.type]
    devices = {tf.DeviceSpec.from_string(op.device).device_index for op in collectives}
    if towers > 1:
        assert devices == set(range(towers)), devices
    else:
        assert not collectives
    # The patch is gone after the build.
    layers_module = sys.modules['tf_slim.layers.layers']
    assert convert.is_slim_batch_norm(layers_module.batch_norm)
    assert convert.is_slim_batch_norm(slim.batch_norm)


def _copy_ops(src_scope, dst_scope):
    src = {v.op.name[len(src_scope) + 1:]: v for v in tf1.global_variables(src_scope + '/')}
    dst = {v.op.name[len(dst_scope) + 1:]: v for v in tf1.global_variables(dst_scope + '/')}
    assert sorted(src) == sorted(dst)
    return tf.group(*[dst[k].assign(src[k]) for k in sorted(src)]), sorted(src)


def _assert_close(actual, desired, tol, what, floor=0.0, atol=0.0):
    """Max abs error <= tol * max(largest |desired|, floor) + atol.

    Element-wise relative errors are meaningless for entries near zero (a
    gradient entry of 1e-9 next to entries of 1e-1), so errors are measured
    against the scale of the whole tensor.
    """
    actual = np.asarray(actual, np.float64)
    desired = np.asarray(desired, np.float64)
    assert actual.shape == desired.shape, what
    scale = float(np.max(np.abs(desired))) if desired.size else 0.0
    scale = max(scale, floor)
    err = float(np.max(np.abs(actual - desired))) if desired.size else 0.0
    if os.environ.get('SLIM_NETS_VERBOSE'):
        print('%-70s err %.3g scale %.3g rel %.3g' % (what, err, scale, err / max(scale, 1e-30)))
    assert err <= tol * scale + atol + 1e-30, (
        '%s: max abs error %.3g is more than %.1g x the largest entry %.3g'
        % (what, err, tol, scale))


# make test trains resnet_v1_50 (suite_scope.covering; make test-full all three):
# the three nets reach the layer through the same sync_arg_scope conversion of
# slim's arg_scope, and what differs between them is covered by cheaper tests:
# resnet_v2_50's pre-activation batch norms called directly (not as a
# normalizer_fn) by test_resnet_v2_per_tower_statistics_reach_direct_batch_norm_calls,
# inception_v3's own arg_scope and collections by
# test_convert_keeps_inception_variables_collections. The TF1-behaviour pass:
# one network (tf_behavior.pick).
NETS = suite_scope.covering(['resnet_v1_50', 'resnet_v2_50', 'inception_v3'], ['resnet_v1_50'])


@pytest.mark.parametrize('name', tf_behavior.pick(NETS, ['resnet_v1_50']))
def test_one_sgd_step_two_towers_equals_one_tower_on_the_whole_batch(name):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(0)
        multi = _build(name, 'multi', 2)
        single = _build(name, 'single', 1)
        _check_structure(graph, name, 'multi', 2)
        _check_structure(graph, name, 'single', 1)
        copy, names = _copy_ops('multi', 'single')
        multi_vars = [tf1.global_variables('multi/' + n + ':')[0] for n in names]
        single_vars = [tf1.global_variables('single/' + n + ':')[0] for n in names]
        num_trainable = len(tf1.trainable_variables('single/'))
        init = tf1.global_variables_initializer()
    rng = np.random.RandomState(0)
    size = _NETS[name][2]
    images = rng.randn(BATCH, size, size, 3).astype(np.float32)
    labels = rng.randint(0, NUM_CLASSES, BATCH).astype(np.int32)
    feed = {multi['images']: images, multi['labels']: labels,
            single['images']: images, single['labels']: labels}
    with _session(graph, 2) as sess:
        sess.run(init)
        sess.run(copy)
        before = sess.run(multi_vars)
        fetches = [multi['loss'], [g for g, _ in multi['grads']], multi['logits'],
                   single['loss'], [g for g, _ in single['grads']], single['logits'],
                   multi['train'], single['train']]
        loss_m, grads_m, logits_m, loss_s, grads_s, logits_s, _, _ = sess.run(fetches, feed)
        after_m, after_s = sess.run([multi_vars, single_vars])

    _assert_close(logits_m, logits_s, 1e-4, 'logits')
    _assert_close(loss_m, loss_s, 1e-5, 'loss')
    assert len(grads_m) == len(grads_s) == num_trainable > 0
    # Some gradients are zero in exact arithmetic (biases and betas that a
    # following batch norm cancels) and float32 noise in both models: measure
    # errors against at least 1% of the largest gradient of the net.
    floor = 1e-2 * max(float(np.max(np.abs(g))) for g in grads_s)
    tol = _NETS[name][4]
    for (_, var), gm, gs in zip(multi['grads'], grads_m, grads_s):
        _assert_close(gm, gs, tol, 'gradient of ' + var.op.name, floor)
    updates_s = [a - b for a, b in zip(after_s, before)]
    floor = 1e-2 * max(float(np.max(np.abs(u))) for u in updates_s)
    for n, b, am, us in zip(names, before, after_m, updates_s):
        # Plus the rounding of the new values (beta = 3 + update).
        rounding = 2 * np.finfo(np.float32).eps * float(np.max(np.abs(b)))
        _assert_close(am - b, us, tol, 'update of ' + n, floor, atol=rounding)
    # The step did something: every moving statistic moved, and most weights
    # (betas with a zero gradient stay at 3.0, updates below its float32 ulp).
    moving = [n for n in names if n.endswith(('moving_mean', 'moving_variance'))]
    assert len(moving) == 2 * _NETS[name][3]
    moved = {n for n, u in zip(names, updates_s) if np.any(u)}
    assert set(moving) <= moved
    assert len(moved) - len(moving) >= 0.7 * num_trainable


@pytest.mark.once(reason='a forward pass; the TF1-behaviour pass trains resnet_v1_50')
def test_vgg16_builds_on_two_towers_and_matches_one_tower_forward():
    name = 'vgg_16'
    graph = tf.Graph()
    with graph.as_default():
        multi = _build(name, 'multi', 2, batch=2, with_train=False)
        single = _build(name, 'single', 1, batch=2, with_train=False)
        _check_structure(graph, name, 'multi', 2)
        # fc8 (the logits) keeps normalizer_fn=None; every other conv got one.
        bn_scopes = sorted(v.op.name.split('/')[-3] for v in tf1.global_variables('multi/')
                           if v.op.name.endswith('BatchNorm/moving_mean'))
        assert 'fc8' not in bn_scopes and 'fc7' in bn_scopes and 'fc6' in bn_scopes
        copy, _ = _copy_ops('multi', 'single')
        init = tf1.global_variables_initializer()
    images = np.random.RandomState(1).randn(2, 224, 224, 3).astype(np.float32)
    with _session(graph, 2) as sess:
        sess.run(init)
        sess.run(copy)
        logits_m, logits_s = sess.run([multi['logits'], single['logits']],
                                      {multi['images']: images, single['images']: images})
    assert logits_m.shape == (2, NUM_CLASSES)
    assert np.all(np.isfinite(logits_m))
    # fc6 and fc7 normalize 2 values per channel: errors grow more than in
    # the other nets.
    _assert_close(logits_m, logits_s, 1e-3, 'vgg_16 logits')


@pytest.mark.once(reason='the arg scope reaching direct calls is Python; the TF1 pass builds '
                  'and trains resnet_v1_50 through the same layer')
def test_resnet_v2_per_tower_statistics_reach_direct_batch_norm_calls():
    """sync_statistics=None reaches every layer, also resnet_v2's direct calls."""
    name = 'resnet_v2_50'
    arg_scope_fn, model_fn, size, num_bn = _NETS[name][:4]
    graph = tf.Graph()
    with graph.as_default():
        images = tf1.placeholder(tf.float32, [2, size, size, 3])
        parts = tf.split(images, 2)

        def tower_fn():
            i = get_current_tower_context().index
            with sync_arg_scope(arg_scope_fn(), sync_statistics=None):
                return model_fn(parts[i])[0]

        call_for_each_tower(tower_fn, ['/cpu:0', '/cpu:1'])
        assert not [op for op in graph.get_operations() if 'Collective' in op.type]
        moving = [v for v in tf1.global_variables() if v.op.name.endswith('moving_mean')]
        assert len(moving) == num_bn


def test_resnet_v1_inference_reaches_every_layer():
    """The net's own arg_scope([batch_norm], is_training=False) reaches sync_batch_norm."""
    graph = tf.Graph()
    with graph.as_default():
        images = tf1.placeholder(tf.float32, [2, 32, 32, 3])
        with sync_arg_scope(resnet_v1.resnet_arg_scope()):
            resnet_v1.resnet_v1_50(images, num_classes=NUM_CLASSES, is_training=False)
        assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        assert not [op for op in graph.get_operations() if 'Collective' in op.type]
        moving = [v for v in tf1.global_variables() if v.op.name.endswith('moving_mean')]
        assert len(moving) == _NETS['resnet_v1_50'][3]


# --------------------------------------------------------------------------
# convert_arg_scope / patch_slim_batch_norm, without building nets.

@pytest.mark.once(reason='convert_arg_scope on dicts (Python only)')
def test_convert_arg_scope_rewrites_normalizer_and_batch_norm_entries():
    scope = resnet_v1.resnet_arg_scope(batch_norm_decay=0.9)
    before = {k: dict(v) for k, v in scope.items()}
    converted = convert.convert_arg_scope(scope, sync_statistics=None, epsilon=1e-4)
    conv_key = slim_arg_scope.arg_scope_func_key(slim.conv2d)
    bn_key = slim_arg_scope.arg_scope_func_key(sync_batch_norm)
    assert converted[conv_key]['normalizer_fn'] is sync_batch_norm
    params = converted[conv_key]['normalizer_params']
    assert params['decay'] == 0.9 and params['scale'] is True
    assert params['sync_statistics'] is None and params['epsilon'] == 1e-4
    # arg_scope([slim.batch_norm], **params) is copied to sync_batch_norm's entry.
    assert converted[bn_key]['decay'] == 0.9
    assert converted[bn_key]['sync_statistics'] is None
    assert converted[bn_key]['epsilon'] == 1e-4
    # The input is untouched.
    assert {k: dict(v) for k, v in scope.items()} == before
    assert convert.is_slim_batch_norm(scope[conv_key]['normalizer_fn'])


@pytest.mark.once(reason='convert_arg_scope on dicts (Python only)')
def test_convert_keeps_inception_variables_collections():
    converted = convert.convert_arg_scope(inception_v3.inception_v3_arg_scope())
    conv_key = slim_arg_scope.arg_scope_func_key(slim.conv2d)
    params = converted[conv_key]['normalizer_params']
    assert params['variables_collections']['moving_mean'] == ['moving_vars']
    assert params['fused'] is True and params['sync_statistics'] == 'auto'


@pytest.mark.once(reason='convert_arg_scope on dicts (Python only)')
def test_add_normalizer_to_respects_existing_normalizers():
    with slim.arg_scope([slim.fully_connected], normalizer_fn=None):
        scope = slim_arg_scope.current_arg_scope()
    converted = convert.convert_arg_scope(scope, add_normalizer_to=[slim.conv2d],
                                          decay=0.5)
    conv = converted[slim_arg_scope.arg_scope_func_key(slim.conv2d)]
    assert conv['normalizer_fn'] is sync_batch_norm
    assert conv['normalizer_params'] == {'decay': 0.5, 'sync_statistics': 'auto'}
    fc = converted[slim_arg_scope.arg_scope_func_key(slim.fully_connected)]
    assert fc['normalizer_fn'] is None


@pytest.mark.parametrize('kwargs, error', [
    (dict(scope=['not', 'a', 'dict']), TypeError),
    (dict(scope={}, momentum=0.9), TypeError),
    (dict(scope={}, inputs=1), TypeError),
    (dict(scope={}, add_normalizer_to=[len]), TypeError),
    (dict(scope={'k': 1}), TypeError),
])
def test_convert_arg_scope_errors(kwargs, error):
    scope = kwargs.pop('scope')
    with pytest.raises(error):
        convert.convert_arg_scope(scope, **kwargs)


@pytest.mark.once(reason='the patch of slim.batch_norm (Python only)')
def test_patch_is_restored_on_exit_and_on_error():
    layers_module = sys.modules['tf_slim.layers.layers']
    original = layers_module.batch_norm
    with sync_arg_scope({}):
        assert slim.batch_norm is sync_batch_norm
        assert layers_module.batch_norm is sync_batch_norm
        with convert.patch_slim_batch_norm():  # nested: a no-op
            assert slim.layers.batch_norm is sync_batch_norm
        assert slim.batch_norm is sync_batch_norm
    assert layers_module.batch_norm is original and slim.batch_norm is original
    with pytest.raises(RuntimeError):
        with sync_arg_scope({}):
            raise RuntimeError('boom')
    assert layers_module.batch_norm is original and slim.batch_norm is original
    with sync_arg_scope({}, patch=False):
        assert slim.batch_norm is original


@pytest.mark.once(reason='the patch of slim.batch_norm (Python only)')
def test_patch_lasts_until_the_last_of_several_threads_leaves():
    """MirroredStrategy builds its replicas in threads that take turns inside the block.

    Replica 0 may leave its block while replica 1 is still inside its own:
    the patch must stay until both have left (before, the first exit restored
    slim.batch_norm under the second, whose later layers were not synchronized).
    """
    import threading  # noqa: PLC0415
    layers_module = sys.modules['tf_slim.layers.layers']
    original = layers_module.batch_norm
    entered = [threading.Event(), threading.Event()]
    release = [threading.Event(), threading.Event()]
    seen = {}

    def replica(i):
        with convert.patch_slim_batch_norm():
            entered[i].set()
            release[i].wait(10)
            seen[i] = layers_module.batch_norm

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for e in entered:
        assert e.wait(10)
    release[0].set()          # replica 0 leaves first
    threads[0].join(10)
    assert layers_module.batch_norm is sync_batch_norm     # replica 1 is still inside
    release[1].set()
    threads[1].join(10)
    assert seen == {0: sync_batch_norm, 1: sync_batch_norm}
    assert layers_module.batch_norm is original and slim.batch_norm is original


@pytest.mark.versions
def test_sync_arg_scope_converts_the_current_scope():
    with slim.arg_scope(vgg.vgg_arg_scope()):
        with sync_arg_scope(add_normalizer_to=[slim.conv2d], decay=0.8) as sc:
            assert sc is slim_arg_scope.current_arg_scope()
            conv = sc[slim_arg_scope.arg_scope_func_key(slim.conv2d)]
            assert conv['padding'] == 'SAME'  # vgg_arg_scope's own argument
            assert conv['normalizer_fn'] is sync_batch_norm
            assert conv['normalizer_params']['decay'] == 0.8

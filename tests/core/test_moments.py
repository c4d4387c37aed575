"""``tf1_syncbn.moments``: a hand-written batch norm on towers equals it on one device.

The layer is written as users write it (the seed question's layer, and
tf-slim's ``fused=False`` path): its own ``gamma``/``beta`` and moving
averages, ``tf.nn.moments``, a ``tf.cond`` on a bool tensor ``is_training``
between the batch and the moving statistics, ``assign_sub`` updates in
``UPDATE_OPS`` and ``tf.nn.batch_normalization``. On 3 uneven towers, one
empty, with ``tf.nn.moments`` replaced by ``tf1_syncbn.moments(...,
training=is_training)`` (and the harness keeping one tower's ``UPDATE_OPS``,
as the classic scripts do), it equals the UNCHANGED layer on one device with
the concatenated batch, and float64 numpy: outputs, input/gamma/beta
gradients, moving averages, and the inference outputs after the step. The
audit reports it synchronized.

Issue 42: TF1's positional order is refused (defect 6), one tower of such a
training graph evaluates alone (defect 8), and towers whose kept dimensions
differ only at run time fail naming the call and their shapes.
"""

import functools
import time
import warnings

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_backward, bn_forward
import tf_behavior
from conftest import make_session
import tf1_syncbn
from tf1_syncbn import CollectiveBackend, SyncBNWarning, kernels
from tower import call_for_each_tower

tf1 = tf.compat.v1
DECAY = 0.7
EPS = 1e-3
SIZES = [3, 0, 2]
SHAPE = [2, 2, 3]


def hand_written_bn(x, is_training, moments=tf.nn.moments):
    """A batch norm written by hand, with ``moments`` for ``tf.nn.moments``."""
    with tf1.variable_scope('bn', reuse=tf1.AUTO_REUSE):
        channels = x.shape[-1]
        gamma = tf1.get_variable('gamma', [channels],
                                 initializer=tf1.random_uniform_initializer(0.5, 1.5, seed=1))
        beta = tf1.get_variable('beta', [channels],
                                initializer=tf1.random_uniform_initializer(-1, 1, seed=2))
        moving_mean = tf1.get_variable('moving_mean', [channels], trainable=False,
                                       initializer=tf1.zeros_initializer())
        moving_variance = tf1.get_variable('moving_variance', [channels], trainable=False,
                                           initializer=tf1.ones_initializer())
        batch_mean, batch_var = moments(x, axes=[0, 1, 2])
        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign_sub(
            moving_mean, (moving_mean - batch_mean) * (1 - DECAY)))
        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign_sub(
            moving_variance, (moving_variance - batch_var) * (1 - DECAY)))
        mean, var = tf.cond(is_training, lambda: (batch_mean, batch_var),
                            lambda: (tf.identity(moving_mean), tf.identity(moving_variance)))
        return tf.nn.batch_normalization(x, mean, var, beta, gamma, EPS)


def _name_scope_towers(layer, is_training):
    """``tower_%d`` scopes with ``num_dev``; the last tower's UPDATE_OPS (cifar10's)."""
    xs, ys = [], []
    for i in range(len(SIZES)):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
            xs.append(tf1.placeholder(tf.float32, [None] + SHAPE, name='x'))
            ys.append(layer(xs[-1], is_training, functools.partial(
                tf1_syncbn.moments, num_dev=len(SIZES), training=is_training,
                sync_statistics=CollectiveBackend(timeout=60))))
    return xs, ys, tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, 'tower_%d' % (len(SIZES) - 1))


def _context_towers(layer, is_training):
    """``call_for_each_tower`` (a TowerContext each); the first tower's UPDATE_OPS."""
    xs, ys, updates = [], [], []

    def tower():
        before = len(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
        xs.append(tf1.placeholder(tf.float32, [None] + SHAPE, name='x'))
        ys.append(layer(xs[-1], is_training,
                        functools.partial(tf1_syncbn.moments, training=is_training)))
        updates.append(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)[before:])

    call_for_each_tower(tower, ['/cpu:%d' % i for i in range(len(SIZES))])
    return xs, ys, updates[0]


@pytest.mark.parametrize('harness', [_name_scope_towers, _context_towers])
def test_hand_written_batch_norm_on_towers_equals_it_on_one_device(graph, harness):
    is_training = tf1.placeholder_with_default(True, [], name='is_training')
    xs, ys, updates = harness(hand_written_bn, is_training)
    scope = 'bn/'
    variables = {v.op.name[len(scope):]: v for v in tf1.global_variables()}
    loss_dys = [tf1.placeholder(tf.float32, [None] + SHAPE) for _ in xs]
    loss = tf.add_n([tf.reduce_sum(y * dy) for y, dy in zip(ys, loss_dys)])
    grads = tf.gradients(loss, xs + [variables['gamma'], variables['beta']])
    with tf.device('/cpu:0'), tf1.variable_scope('reference'):
        ref_x = tf1.placeholder(tf.float32, [None] + SHAPE)
        ref_dy = tf1.placeholder(tf.float32, [None] + SHAPE)
        before = len(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
        ref_y = hand_written_bn(ref_x, is_training)           # unchanged: tf.nn.moments
        ref_updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)[before:]
    ref_vars = {v.op.name[len('reference/' + scope):]: v for v in tf1.global_variables()
                if v.op.name.startswith('reference/')}
    ref_grads = tf.gradients(tf.reduce_sum(ref_y * ref_dy),
                             [ref_x, ref_vars['gamma'], ref_vars['beta']])
    report = tf1_syncbn.audit_graph(graph, tf.group(grads + updates))
    layer, = [lay for lay in report.layers if lay.name == 'bn']
    assert layer.synchronized is True and layer.group_size == len(SIZES), str(report)
    assert layer.updates == 'train_op' and report.ok, str(report)

    rng = np.random.RandomState(0)
    x = (rng.randn(sum(SIZES), *SHAPE) * 2 + 3).astype(np.float32)
    dy = rng.randn(*x.shape).astype(np.float32)
    feed = {ref_x: x, ref_dy: dy}
    for ph, part in zip(xs + loss_dys, np.split(x, np.cumsum(SIZES)[:-1]) +
                        np.split(dy, np.cumsum(SIZES)[:-1])):
        feed[ph] = part
    with make_session(graph, len(SIZES)) as sess:
        sess.run(tf1.global_variables_initializer())
        gamma, beta = sess.run([variables['gamma'], variables['beta']])
        np.testing.assert_array_equal(gamma, sess.run(ref_vars['gamma']))
        outs, gs, ref_out, ref_gs, _, _ = sess.run([ys, grads, ref_y, ref_grads, updates,
                                                   ref_updates], feed)
        moving = sess.run([variables['moving_mean'], variables['moving_variance']])
        ref_moving = sess.run([ref_vars['moving_mean'], ref_vars['moving_variance']])
        feed[is_training] = False
        infer, ref_infer = sess.run([ys, ref_y], feed)
    f, b = bn_forward(x, gamma, beta, EPS), bn_backward(dy, x, gamma, EPS)
    for expected, tol in ((dict(y=ref_out, dx=ref_gs[0], dgamma=ref_gs[1], dbeta=ref_gs[2],
                                mm=ref_moving[0], mv=ref_moving[1], infer=ref_infer), 1e-5),
                          (dict(y=f['y'], dx=b['dx'], dgamma=b['dgamma'], dbeta=b['dbeta'],
                                mm=(1 - DECAY) * f['mean'], mv=DECAY + (1 - DECAY) * f['var'],
                                infer=None), 2e-5)):
        np.testing.assert_allclose(np.concatenate(outs), expected['y'], rtol=tol, atol=tol)
        np.testing.assert_allclose(np.concatenate(gs[:len(xs)]), expected['dx'], rtol=1e-4,
                                   atol=1e-4)
        np.testing.assert_allclose(gs[-2], expected['dgamma'], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(gs[-1], expected['dbeta'], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(moving[0], expected['mm'], rtol=tol, atol=tol)
        np.testing.assert_allclose(moving[1], expected['mv'], rtol=tol, atol=tol)
        if expected['infer'] is not None:
            np.testing.assert_allclose(np.concatenate(infer), expected['infer'], rtol=tol,
                                       atol=tol)


def _case(name, shape, axes, dtype=tf.float32, keepdims=False, weights=None, loc=3.0):
    return dict(name=name, shape=shape, axes=axes, dtype=dtype, keepdims=keepdims,
                weights=weights, loc=loc)


CASES = [
    _case('NCHW-axes[0,2,3]-keepdims', [2, 3, 2], [0, 2, 3], keepdims=True),
    _case('rank3-axes[0,2]', [3, 2], [0, -1]),
    _case('float16-rank2', [3], [0], tf.float16),
    _case('bfloat16-rank4', [2, 2, 3], [0, 1, 2], tf.bfloat16),
    _case('float64-rank2', [3], [0], tf.float64),
    _case('mean1e4-rank2', [3], [0], loc=1e4),
    _case('weighted-rank3-axes[0,1]', [2, 3], [0, 1], weights=[None, 2, 1]),
    _case('no-batch-axis', [2, 3], [1]),
]
V1_CASES = [CASES[0], CASES[2], CASES[6]]


@pytest.mark.parametrize('case', __import__('tf_behavior').pick(CASES, V1_CASES),
                         ids=lambda c: c['name'])
def test_moments_over_towers_equal_one_device(graph, case):
    """Every form of the arguments, on towers [3, 0, 2], against tf.nn on the whole batch."""
    dtype, axes, keepdims, wshape = case['dtype'], case['axes'], case['keepdims'], \
        case['weights']
    xs, ws, outs = [], [], []
    full = [None] + case['shape']

    def tower():
        xs.append(tf1.placeholder(dtype, full))
        if wshape is None:
            outs.append(tf1_syncbn.moments(xs[-1], axes, keepdims=keepdims))
        else:
            ws.append(tf1.placeholder(dtype, wshape))
            outs.append(tf1_syncbn.weighted_moments(xs[-1], axes, ws[-1], keepdims=keepdims))

    call_for_each_tower(tower, ['/cpu:%d' % i for i in range(len(SIZES))])
    ref_x = tf1.placeholder(dtype, full)
    if wshape is None:
        ref = tf.nn.moments(ref_x, axes, keepdims=keepdims)
    else:
        ref_w = tf1.placeholder(dtype, wshape)
        ref = tf.nn.weighted_moments(ref_x, axes, ref_w, keepdims=keepdims)
    exact = dtype in (tf.float32, tf.float64)
    if exact:
        u = tf.constant(np.random.RandomState(1).randn(*ref[0].shape.as_list()[
            int(0 not in axes):]), dtype)
        objective = lambda m: tf.reduce_sum(m[0] * u + m[1] * u * u)  # noqa: E731
        # Synchronized, every tower holds the global statistics: their mean is one device's.
        share = 1.0 / len(SIZES) if 0 in axes else 1.0
        grads = tf.gradients(tf.add_n([objective(m) * share for m in outs]), xs + ws)
        u = u.op.get_attr('value')
    rng = np.random.RandomState(2)
    np_dtype = dtype.as_numpy_dtype
    x = (rng.randn(sum(SIZES), *case['shape']) * 2 + case['loc']).astype(np_dtype)
    feed = {ref_x: x}
    feed.update(zip(xs, np.split(x, np.cumsum(SIZES)[:-1])))
    if ws:
        w = rng.uniform(0, 2, [sum(SIZES)] + wshape[1:]).astype(np_dtype)
        feed[ref_w] = w
        feed.update(zip(ws, np.split(w, np.cumsum(SIZES)[:-1])))
    with make_session(graph, len(SIZES)) as sess:
        got, want = sess.run([outs, ref], feed)
        if exact:
            got_grads = sess.run(grads, feed)
    assert got[0][0].dtype == np_dtype
    assert got[0][0].shape[int(0 not in axes):] == want[0].shape[int(0 not in axes):]
    if 0 not in axes:           # each tower's own examples: nothing synchronized
        for k in (0, 1):
            np.testing.assert_allclose(np.concatenate([g[k] for g in got]), want[k], rtol=1e-5)
        return
    # float64 numpy on the same data (16-bit: tf.nn computes in float32 and rounds once).
    x64 = x.astype(np.float64)
    w64 = np.ones_like(x64) if not ws else w.astype(np.float64) * np.ones_like(x64)
    mean = (w64 * x64).sum(tuple(axes), keepdims=True) / w64.sum(tuple(axes), keepdims=True)
    var = (w64 * (x64 - mean) ** 2).sum(tuple(axes), keepdims=True) / \
        w64.sum(tuple(axes), keepdims=True)
    tol = {tf.float16: 2e-3, tf.bfloat16: 1e-2}.get(dtype, 1e-5)
    for got_tower in got:       # every tower gets the global statistics
        for value, expected in zip(got_tower, (mean, var)):
            expected = expected if keepdims else np.squeeze(expected, tuple(axes))
            np.testing.assert_allclose(value.astype(np.float64), expected, rtol=tol,
                                       atol=tol * (1 + abs(case['loc'])) * 1e-3)
    if exact:     # d/dx and d/dw of sum(mean * u + var * u**2), in float64
        u = tf.make_ndarray(u).astype(np.float64)
        u = u if keepdims else np.expand_dims(u, tuple(axes))
        total = w64.sum(tuple(axes), keepdims=True)
        dx = (u * w64 + u * u * 2 * w64 * (x64 - mean)) / total
        np.testing.assert_allclose(np.concatenate(got_grads[:len(xs)]), dx, rtol=1e-4,
                                   atol=1e-5)
        if ws:
            dw = (u * (x64 - mean) + u * u * ((x64 - mean) ** 2 - var)) / total
            dw = dw.sum(tuple(a for a, d in enumerate(wshape) if d == 1), keepdims=True)
            np.testing.assert_allclose(np.concatenate(got_grads[len(xs):]), dw, rtol=1e-4,
                                       atol=1e-5)


@pytest.mark.once
def test_never_a_silent_per_tower_fallback(graph):
    x = tf1.placeholder(tf.float32, [None, 3])
    with pytest.raises(ValueError, match=r'tf1_syncbn\.moments\(moments\): num_dev=2 but the '
                                         r'layer is built outside any tower'):
        tf1_syncbn.moments(x, [0], num_dev=2)
    with tf.name_scope('tower_1'), pytest.raises(ValueError, match="sync_statistics='collective"
                                                                   "' asks for synchronized"):
        tf1_syncbn.moments(x, [0], sync_statistics='collective')
    with tf.name_scope('tower_2'), pytest.raises(
            ValueError, match=r"moments\(tower_2/moments\): sync_statistics='auto' cannot tell "
                              r'.*Pass num_dev=<number of towers'):
        tf1_syncbn.moments(x, [0])
    with pytest.raises(TypeError, match='int32'):
        tf1_syncbn.moments(tf1.placeholder(tf.int32, [None, 3]), [0])
    with pytest.raises(ValueError, match='invalid axes'):
        tf1_syncbn.moments(x, [0, 2])
    for i, channels in enumerate([3, 4]):
        with tf.device('/cpu:%d' % i), tf.name_scope('clone_%d' % i):
            y = tf1.placeholder(tf.float32, [None, channels])
            if i == 0:
                tf1_syncbn.moments(y, [0], num_dev=2)
            else:
                with pytest.raises(ValueError, match=r'\[3\] in tower 0, \[4\] in tower 1'):
                    tf1_syncbn.moments(y, [0], num_dev=2)


def _device_loop(moments, devices):
    """The hand-written layer in a loop the call cannot see: ``tf.device``, variables reused."""
    is_training = tf1.placeholder_with_default(True, [])
    for i, device in enumerate(devices):
        with tf.device(device), tf1.variable_scope('', reuse=i > 0):
            hand_written_bn(tf1.placeholder(tf.float32, [None] + SHAPE), is_training, moments)


@pytest.mark.parametrize('kind', tf_behavior.pick(['moments', 'weighted_moments'],
                                                  ['moments']))
def test_copies_on_several_devices_outside_any_tower_are_refused(graph, kind):
    """Before, each device's copy normalized alone, silently (the layers warned at least).

    The copies are the calls under one variable scope (``bn/moments``), which
    the loop reuses; one device (a layer applied twice), ``num_dev=1`` (one
    model split across devices), ``sync_statistics=None`` and ``training=False``
    (each device's own moments, as asked: no all-reduce) stay quiet.
    """
    def moments(x, axes, **kwargs):
        if kind == 'moments':
            return tf1_syncbn.moments(x, axes, **kwargs)
        return tf1_syncbn.weighted_moments(x, axes, tf.ones_like(x[:, :1, :1, :1]), **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter('error', SyncBNWarning)
        _device_loop(moments, ['/cpu:0', '/cpu:0'])
        for kwargs in ({'num_dev': 1}, {'sync_statistics': None}, {'training': False}):
            with tf.Graph().as_default() as g:
                _device_loop(functools.partial(moments, **kwargs), ['/cpu:0', '/cpu:1'])
                assert not [op for op in g.get_operations() if 'Collective' in op.type]
        with pytest.raises(ValueError, match=(
                r"tf1_syncbn\.%s\(bn_2/%s\): its calls under the variable scope 'bn/%s' "
                r"\(one hand-written layer's copies\) are built for training on 2 devices "
                r'\(/device:CPU:0, /device:CPU:1\).*pass tf1_syncbn\.moments\(\.\.\., '
                r'num_dev=<number of towers>\).*tower\.TowerContext.*num_dev=1; .*'
                r'sync_statistics=None\.$' % (kind, kind, kind))):
            _device_loop(moments, ['/cpu:1'])


def test_a_tower_that_never_built_it_fails_the_first_step_at_once(graph):
    xs, outs = [], []
    for i in range(2):      # num_dev=3, two towers built
        with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
            xs.append(tf1.placeholder(tf.float32, [None, 3]))
            outs.append(tf1_syncbn.moments(xs[-1], [0], num_dev=3))
    with make_session(graph, 3) as sess, \
            pytest.raises(tf.errors.InvalidArgumentError, match='never by tower 2'):
        sess.run(outs, {x: np.ones((2, 3), np.float32) for x in xs})


@pytest.mark.once
def test_moments_under_a_mirrored_strategy(graph):
    """A tf.distribute replica is a tower: every replica gets the global statistics."""
    from strategy_case import make_strategy  # noqa: PLC0415
    strategy = make_strategy('mirrored', 2)
    xs = [tf1.placeholder(tf.float32, [None, 3]) for _ in range(2)]

    def replica_fn():
        i = int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))
        return tf1_syncbn.moments(xs[i], [0])

    with strategy.scope():
        means, variances = strategy.run(replica_fn)
    outs = [strategy.experimental_local_results(t) for t in (means, variances)]
    data = np.random.RandomState(4).randn(5, 3).astype(np.float32)
    with make_session(graph, 2) as sess:
        got = sess.run(outs, {xs[0]: data[:1], xs[1]: data[1:]})
    for replica in range(2):
        np.testing.assert_allclose(got[0][replica], data.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1][replica], data.var(0), rtol=1e-5, atol=1e-6)


@pytest.mark.once
def test_the_audit_names_the_fix_for_an_unchanged_hand_written_layer(graph):
    is_training = tf1.placeholder_with_default(True, [])
    ys = []
    for i in range(2):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
            ys.append(hand_written_bn(tf1.placeholder(tf.float32, [None] + SHAPE), is_training))
    report = tf1_syncbn.audit_graph(graph)
    layer, = report.layers
    assert layer.name == 'bn' and layer.synchronized is False
    assert any('tf1_syncbn.moments' in p for p in layer.problems), layer.problems


# Issue 42, defect 6: TF1's positional order, tf.compat.v1.nn.moments(x, axes, shift, name,
# keep_dims), silently meant keepdims=True (a name in keepdims' place).
TF1_POSITIONAL = [
    ('moments', (None, 'bn_moments'), r"keepdims='bn_moments' is not a bool.*"
                                      r"tf1_syncbn\.moments\(x, axes, shift, name='bn_moments'\)"),
    ('moments', (None, 'bn_moments', True), r"tf1_syncbn\.moments\(x, axes, shift, "
                                            r"name='bn_moments', keep_dims=True\)"),
    ('moments', (None, None, True), r'name=True is not a string.*keep_dims=True'),
    ('weighted_moments', ('weights', 'bn_moments'),
     r"TF1's tf\.compat\.v1\.nn\.weighted_moments\(x, axes, frequency_weights, name, "
     r"keep_dims\).*name='bn_moments'"),
    ('weighted_moments', ('weights', None, False), r'name=False is not a string'),
]


def test_tf1_positional_order_is_refused_naming_the_fix(graph):
    x = tf1.placeholder(tf.float32, [None, 3])
    w = tf1.placeholder(tf.float32, [None, 1])
    for kind, args, match in TF1_POSITIONAL:
        args = tuple(w if a == 'weights' else a for a in args)
        getattr(tf1.nn, kind)(x, [0], *args)          # a valid TF1 call (the reference)
        with pytest.raises(TypeError, match=match) as info:
            getattr(tf1_syncbn, kind)(x, [0], *args)
        assert "takes TF2's order, tf.nn.%s(x, axes" % kind in str(info.value)
    with pytest.raises(ValueError, match=r'keepdims=True and keep_dims=False disagree'):
        tf1_syncbn.moments(x, [0], keepdims=True, keep_dims=False)
    with pytest.raises(TypeError, match=r'keep_dims=.yes. is not a bool'):
        tf1_syncbn.weighted_moments(x, [0], w, keep_dims='yes')
    for training in ('yes', None):
        with pytest.raises(TypeError, match=r'training must be a Python bool or a scalar bool '
                                            r'tensor'):
            tf1_syncbn.moments(x, [0], training=training)


def test_keep_dims_is_tf1s_keepdims(graph):
    """``keep_dims=True`` equals ``keepdims=True`` and ``tf.compat.v1.nn``'s, on one device."""
    x = tf1.placeholder(tf.float32, [None, 2, 3])
    w = tf1.placeholder(tf.float32, [None, 2, 1])
    pairs = []
    for kind, extra in (('moments', (None,)), ('weighted_moments', (w,))):
        ours, ref = getattr(tf1_syncbn, kind), getattr(tf1.nn, kind)
        want = ref(x, [0, 1], *extra, name='bn_moments', keep_dims=True)
        for kwargs in (dict(keep_dims=True), dict(keepdims=True),
                       dict(keepdims=True, keep_dims=True)):
            got = ours(x, [0, 1], *extra, name='bn_moments', **kwargs)
            assert [t.shape.as_list() for t in got] == [[1, 1, 3]] * 2
            assert got[0].name.startswith('bn_moments')
            pairs.append((got, want))
        got = ours(x, [0, 1], *extra, keep_dims=False)
        pairs.append((got, ref(x, [0, 1], *extra, keep_dims=False)))
    rng = np.random.RandomState(5)
    feed = {x: rng.randn(4, 2, 3) + 2, w: rng.uniform(0, 2, [4, 2, 1])}
    with make_session(graph, 1) as sess:
        for got, want in sess.run(pairs, feed):
            for g, r in zip(got, want):
                assert g.shape == r.shape
                np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


# Issue 42, defect 8: a hand-written layer computing moments outside its tf.cond all-reduced
# in every run, so fetching one tower for evaluation waited the whole collective timeout.
@pytest.mark.parametrize('switch', ['training=is_training', 'no-switch'])
def test_one_tower_of_a_training_graph_evaluates_alone(graph, switch):
    """With ``training=is_training`` fed False, one tower's output runs no all-reduce.

    Without it, the run fails at the (short) timeout with a message that
    names this cause and the fix.
    """
    is_training = tf1.placeholder_with_default(True, [], name='is_training')
    timeout = 2 if switch == 'no-switch' else 5
    extra = {} if switch == 'no-switch' else dict(training=is_training)
    xs, ys = [], []
    for i in range(2):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
            xs.append(tf1.placeholder(tf.float32, [None] + SHAPE))
            ys.append(hand_written_bn(xs[-1], is_training, functools.partial(
                tf1_syncbn.moments, num_dev=2, sync_statistics=CollectiveBackend(timeout=timeout),
                **extra)))
    with tf.device('/cpu:0'), tf1.variable_scope('reference'):
        ref_x = tf1.placeholder(tf.float32, [None] + SHAPE)
        ref_y = hand_written_bn(ref_x, is_training)            # unchanged: tf.nn.moments
    x = np.random.RandomState(6).randn(3, *SHAPE).astype(np.float32)
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        start = time.time()
        if extra:
            got, want = sess.run([ys[0], ref_y], {xs[0]: x, ref_x: x, is_training: False})
            assert time.time() - start < timeout
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            return
        with pytest.raises(tf.errors.DeadlineExceededError) as info:
            sess.run(ys[0], {xs[0]: x, is_training: False})
    if kernels.library() is not None:     # the watchdog's message (else TensorFlow's own)
        message = info.value.message
        assert "a run that fetches some towers' synchronized ops but not the others' (e.g. " \
               "one tower's output of a training graph, for evaluation" in message, message
        assert 'tf1_syncbn.moments(..., training=is_training)' in message, message


# Issue 42, suspected: towers whose kept dimensions differ only at run time aborted inside
# TensorFlow's all-reduce ("Shape mismatch"), naming only its node.
@pytest.mark.parametrize('case', [
    dict(name='dynamic', channels=[None, None], fed=[3, 4],
         expected='[tower 0:] [3] [tower 1:] [4]'),
    dict(name='static-first', channels=[3, None], fed=[3, 4],
         expected='tower 0 has [3] (static) and tower 1 has:] [4]'),
    dict(name='groups', channels=[None] * 4, fed=[3, 3, 4, 5], group_size=2,
         expected='[member 0:] [4] [member 1:] [5]'),
], ids=lambda c: c['name'])
def test_kept_dimensions_that_differ_at_run_time_fail_naming_the_call(graph, case):
    towers = len(case['fed'])
    xs, outs = [], []
    for i, channels in enumerate(case['channels']):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
            xs.append(tf1.placeholder(tf.float32, [None, channels]))
            outs.append(tf1_syncbn.moments(xs[-1], [0], num_dev=towers,
                                           group_size=case.get('group_size'),
                                           sync_statistics=CollectiveBackend(timeout=30)))
    with make_session(graph, towers) as sess, \
            pytest.raises(tf.errors.InvalidArgumentError) as info:
        sess.run(outs, {x: np.ones((2, c), np.float32) for x, c in zip(xs, case['fed'])})
    message = info.value.message
    assert 'Shape mismatch' not in message, message
    assert 'tf1_syncbn.moments(tower_' in message, message
    assert 'kept dimensions (those not in axes=[0]) differ' in message, message
    assert case['expected'] in message, message
    assert 'sync_statistics=None' in message and 'open a new session' in message, message
    data = np.random.RandomState(7).randn(2 * towers, 3).astype(np.float32)
    with make_session(graph, towers) as sess:   # one shape, in a new session: the global moments
        got = sess.run(outs, {x: data[2 * i:2 * i + 2] for i, x in enumerate(xs)})
    size = 2 * (case.get('group_size') or towers)
    for i, (mean, var) in enumerate(got):
        part = data[i // (size // 2) * size:][:size].astype(np.float64)
        np.testing.assert_allclose(mean, part.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(var, part.var(0), rtol=1e-5, atol=1e-6)

"""tensorpack-compatible BatchNorm / BatchRenorm, ghost batch norm and fine-tune mode."""

import json
import logging

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_backward, bn_forward, build_towers, split_batches, var
from conftest import make_session
from legacy_reference import run_reference
from tf1_syncbn import BatchNorm, BatchRenorm, CollectiveBackend, start_finetuning, sync_batch_norm
from tf1_syncbn.tensorpack import layer as tensorpack_layer
from tower import TowerContext

tf1 = tf.compat.v1
EPS = 1e-5


def _collective():
    return CollectiveBackend(timeout=60)


# --- API ------------------------------------------------------------------------

def test_variable_names_and_output(graph):
    x = tf1.placeholder(tf.float32, [None, 4, 4, 3])
    y = BatchNorm('bn', x)
    assert y.op.name == 'bn/output'
    assert sorted(v.op.name for v in tf1.global_variables()) == [
        'bn/beta', 'bn/gamma', 'bn/mean/EMA', 'bn/variance/EMA']
    assert y.variables.gamma.op.name == 'bn/gamma'
    assert y.variables.mean is y.variables.moving_mean
    assert len(tf1.get_collection(tf1.GraphKeys.MODEL_VARIABLES)) == 2


def test_legacy_argument_names(graph):
    x = tf1.placeholder(tf.float32, [None, 3])
    BatchNorm('bn', x, use_bias=False, use_scale=False, decay=0.5,
              gamma_init=tf1.ones_initializer())
    assert sorted(v.op.name for v in tf1.global_variables()) == ['bn/mean/EMA',
                                                                 'bn/variance/EMA']
    with pytest.raises(TypeError, match='either'):
        BatchNorm('bn2', x, decay=0.5, momentum=0.9)
    with pytest.raises(TypeError, match='unexpected'):
        BatchNorm('bn3', x, use_gamma=True)
    with pytest.raises(ValueError, match='ema_update'):
        BatchNorm('bn4', x, ema_update='sometimes')
    with pytest.raises(ValueError, match='data_format'):
        BatchNorm('bn5', x, data_format='NWHC')


def test_the_signature_shows_tensorpacks_defaults():
    # The defaults an old name may still set print as tensorpack's (help(), the API reference).
    import inspect
    params = inspect.signature(BatchNorm).parameters
    assert {name: repr(params[name].default) for name in (
        'momentum', 'center', 'scale', 'gamma_initializer')} == {
        'momentum': '0.9', 'center': 'True', 'scale': 'True',
        'gamma_initializer': 'ones_initializer()'}


def test_use_local_stat_is_training(graph, rng):
    x = tf1.placeholder(tf.float32, [None, 3])
    y = BatchNorm('bn', x, use_local_stat=False)
    data = rng.randn(4, 3).astype(np.float32)
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        np.testing.assert_allclose(sess.run(y, {x: data}), data / np.sqrt(1 + EPS), rtol=1e-6)


@pytest.mark.parametrize('example_shape,data_format,axis', [
    ((5,), 'channels_last', None), ((4, 5), 'channels_last', None),
    ((5, 4), 'channels_first', None), ((3, 3, 5), 'channels_last', None),
    ((5, 3, 3), 'channels_first', None), ((2, 2, 2, 5), 'channels_last', None),
    ((5, 2, 2, 2), 'channels_first', None), ((5, 3, 3), 'channels_last', 1)])
@pytest.mark.versions
def test_ranks_and_formats_synced(graph, rng, example_shape, data_format, axis):
    sizes = [2, 3]
    net = build_towers(lambda x: BatchNorm('bn', x, axis=axis, data_format=data_format,
                                           sync_statistics=_collective()), 2,
                       (None,) + example_shape)
    grads = tf.gradients(net['loss'], net['xs'])
    x = rng.randn(5, *example_shape).astype(np.float32)
    dy = rng.randn(*x.shape).astype(np.float32)
    feed = dict(zip(net['xs'], split_batches(x, sizes)))
    feed.update(zip(net['dys'], split_batches(dy, sizes)))
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        ys, dxs = sess.run([net['ys'], grads], feed)
    channels_last = (data_format == 'channels_last' and axis is None) or len(example_shape) == 1
    np.testing.assert_allclose(np.concatenate(ys), bn_forward(x, 1, 0, EPS, channels_last)['y'],
                               rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(np.concatenate(dxs),
                               bn_backward(dy, x, np.ones(5), EPS, channels_last)['dx'],
                               rtol=1e-4, atol=1e-4)


def _tower_loop(build, towers=2, channels=3):
    """A plain ``tower_%d`` loop (no tower context): ``tf.device``, name scope, reused variables."""
    xs, ys = [], []
    for i in range(towers):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i), \
                tf1.variable_scope(tf1.get_variable_scope(), reuse=i > 0):
            xs.append(tf1.placeholder(tf.float32, [None, channels]))
            ys.append(build(xs[-1]))
    return xs, ys


def _patched(**defaults):
    """Existing tensorpack code's ``BatchNorm('bn', x)`` under ``patch_tensorpack(**defaults)``."""
    import tensorpack

    from tf1_syncbn import patch_tensorpack

    def build(x):
        with patch_tensorpack(**defaults):
            return tensorpack.models.BatchNorm('bn', x)
    return build


@pytest.mark.parametrize('how', ['BatchNorm', 'patch_tensorpack'])
def test_a_plain_tower_loop_synchronizes_with_num_dev(graph, rng, how):
    """Before, the layer took no num_dev (a TypeError), and without it normalized each tower
    alone after a warning that told it to pass num_dev. Now: num_dev synchronizes, as one
    device with the concatenated batch; 'auto' without it refuses, naming num_dev."""
    if how == 'BatchNorm':
        build = lambda x, **kw: BatchNorm('bn', x, sync_statistics='auto', **kw)  # noqa: E731
    else:
        build = lambda x, **kw: _patched(sync_statistics='auto', **kw)(x)  # noqa: E731
    with tf.Graph().as_default(), pytest.raises(
            ValueError, match=r"BatchNorm\(bn\): sync_statistics='auto' cannot tell the layer's "
                              r"group: its name scope 'tower_1/bn' .*Pass num_dev=<number of "
                              r'towers in this graph>'):
        _tower_loop(build)
    xs, ys = _tower_loop(lambda x: build(x, num_dev=2))
    dxs = tf.gradients(tf.add_n([tf.reduce_sum(y * y) for y in ys]), xs)
    sizes = [3, 2]
    x = rng.randn(sum(sizes), 3) * 2 + 1
    feed = dict(zip(xs, split_batches(x.astype(np.float32), sizes)))
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        got, got_dx = sess.run([ys, dxs], feed)      # (the updates run inside the layer)
        moving = sess.run([var('bn/mean/EMA'), var('bn/variance/EMA')])
    expected = bn_forward(x, np.ones(3), np.zeros(3), EPS)
    np.testing.assert_allclose(np.concatenate(got), expected['y'], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(got_dx),
                               bn_backward(2 * expected['y'], x, np.ones(3), EPS)['dx'],
                               rtol=1e-4, atol=1e-4)
    # tensorpack's rank-2 path tracks the biased variance; momentum 0.9.
    np.testing.assert_allclose(moving[0], 0.1 * expected['mean'], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(moving[1], 0.9 + 0.1 * expected['var'], rtol=1e-5, atol=1e-6)


# --- modes and EMA updates ---------------------------------------------------------

def test_training_follows_the_tower_context(graph, rng):
    x = tf1.placeholder(tf.float32, [None, 3])
    with TowerContext('pred', is_training=False):
        y = BatchNorm('bn', x)
    assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    data = rng.randn(4, 3).astype(np.float32)
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        np.testing.assert_allclose(sess.run(y, {x: data}), data / np.sqrt(1 + EPS), rtol=1e-6)


def test_prediction_towers_update_only_when_asked_for_batch_statistics(graph):
    # tensorpack's rule: do_ema_update = training and (is_main_training_tower or
    # not ctx.is_training). training=None follows the tower: no batch statistics,
    # no update; an explicit training=True in a prediction tower updates.
    with TowerContext('pred', is_training=False):
        BatchNorm('bn', tf1.placeholder(tf.float32, [None, 3]), ema_update='internal')
    assert not [op for op in graph.get_operations() if 'AssignMovingAvg' in op.name]
    with TowerContext('pred2', is_training=False):
        BatchNorm('bn2', tf1.placeholder(tf.float32, [None, 3]), training=True,
                  ema_update='internal')
    assert [op for op in graph.get_operations() if op.name.startswith('pred2/bn2/AssignMovingAvg')]


def test_frozen_statistics_warn_once(graph, caplog, monkeypatch):
    # The warning is once per process: forget earlier tests' warnings, so that
    # this test sees the first one (and fails when none is given).
    monkeypatch.setattr(tensorpack_layer, '_WARNED', set())
    with caplog.at_level(logging.WARNING, logger='tf1_syncbn'):
        for i in range(2):
            with TowerContext('tower%d' % i, index=i, total=2):
                x = tf1.placeholder(tf.float32, [None, 3])
                BatchNorm('bn1', x, training=False)
                BatchNorm('bn2', x, training=False)
    frozen = [r for r in caplog.records if 'frozen' in r.getMessage()]
    assert len(frozen) == 1, [r.getMessage() for r in caplog.records]
    assert frozen[0].levelno == logging.WARNING
    assert 'training=False' in frozen[0].getMessage()
    assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    # Outside a training tower (prediction), or with batch statistics: no warning.
    caplog.clear()
    monkeypatch.setattr(tensorpack_layer, '_WARNED', set())
    with caplog.at_level(logging.WARNING, logger='tf1_syncbn'):
        with TowerContext('pred', is_training=False):
            BatchNorm('bn3', tf1.placeholder(tf.float32, [None, 3]), training=False)
        BatchNorm('bn4', tf1.placeholder(tf.float32, [None, 3]), training=True)
    assert not [r for r in caplog.records if 'frozen' in r.getMessage()]


def _updates(graph, ema_update, sync):
    kwargs = dict(ema_update=ema_update)
    if sync:
        kwargs['sync_statistics'] = _collective()
    net = build_towers(lambda x: BatchNorm('bn', x, momentum=0.5, **kwargs), 2, (None, 3))
    return net, tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)


@pytest.mark.parametrize('ema_update,sync,in_collection,updated', [
    # Unsynchronized on 2 towers: 2 assignments on tower 0 + 1 trigger on tower 1.
    ('default', False, 3, False), ('collection', False, 3, False),
    ('internal', False, 0, True), ('skip', False, 0, False),
    ('default', True, 0, True), ('collection', True, 0, True), ('skip', True, 0, False)])
def test_ema_update_modes(graph, rng, ema_update, sync, in_collection, updated):
    net, updates = _updates(graph, ema_update, sync)
    assert len(updates) == in_collection
    data = (rng.randn(4, 3) + 3).astype(np.float32)
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(net['ys'], dict(zip(net['xs'], np.split(data, 2))))
        moved = np.any(sess.run(var('bn/mean/EMA')) != 0)
    assert moved == updated


# --- ghost batch norm -------------------------------------------------------------

def test_ghost_batch_norm_without_sync(graph, rng):
    x = tf1.placeholder(tf.float32, [None, 2, 3])
    y = BatchNorm('bn', x, virtual_batch_size=2, momentum=0.0, ema_update='internal')
    dy = rng.randn(6, 2, 3).astype(np.float32)
    dx, = tf.gradients(tf.reduce_sum(y * dy), [x])
    data = (rng.randn(6, 2, 3) * 2 + 1).astype(np.float32)
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        out, dxv = sess.run([y, dx], {x: data})
        mm, mv = sess.run([var('bn/mean/EMA'), var('bn/variance/EMA')])
    for k in range(3):
        part = slice(2 * k, 2 * k + 2)
        np.testing.assert_allclose(out[part], bn_forward(data[part], 1, 0, EPS)['y'],
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dxv[part], bn_backward(dy[part], data[part], np.ones(3),
                                                          EPS)['dx'], rtol=1e-3, atol=1e-3)
    first = bn_forward(data[:2], 1, 0, EPS)
    np.testing.assert_allclose(mm, first['mean'], rtol=1e-5)
    np.testing.assert_allclose(mv, first['var'], rtol=1e-5)  # biased, as tensorpack


def test_ghost_batch_norm_with_sync_spreads_virtual_batches_over_towers(graph, rng):
    # 2 towers, virtual batch 4: virtual batch k = examples [2k, 2k+2) of each tower.
    net = build_towers(lambda x: BatchNorm('bn', x, virtual_batch_size=4, momentum=0.0,
                                           sync_statistics=_collective()), 2, (None, 3))
    grads = tf.gradients(net['loss'], net['xs'])
    x = (rng.randn(12, 3) * 3 + 1).astype(np.float32)
    dy = rng.randn(12, 3).astype(np.float32)
    feed = dict(zip(net['xs'], np.split(x, 2)))
    feed.update(zip(net['dys'], np.split(dy, 2)))
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        ys, dxs = sess.run([net['ys'], grads], feed)
        mm, mv = sess.run([var('bn/mean/EMA'), var('bn/variance/EMA')])
    y, dx = np.concatenate(ys), np.concatenate(dxs)
    for k in range(3):
        rows = [2 * k, 2 * k + 1, 6 + 2 * k, 6 + 2 * k + 1]
        np.testing.assert_allclose(y[rows], bn_forward(x[rows], 1, 0, EPS)['y'], rtol=1e-4,
                                   atol=1e-4)
        np.testing.assert_allclose(dx[rows], bn_backward(dy[rows], x[rows], np.ones(3),
                                                         EPS)['dx'], rtol=1e-3, atol=1e-3)
    first = bn_forward(x[[0, 1, 6, 7]], 1, 0, EPS)
    np.testing.assert_allclose(mm, first['mean'], rtol=1e-5)
    np.testing.assert_allclose(mv, first['var'], rtol=1e-5)


def test_ghost_batches_over_towers_take_static_batches_of_a_share(graph, rng):
    """Static tower batches need only be multiples of virtual_batch_size / N (was: of it all)."""
    from tower import call_for_each_tower, get_current_tower_context
    xs = [tf1.placeholder(tf.float32, [6, 3]) for _ in range(2)]

    def tower():
        return BatchNorm('bn', xs[get_current_tower_context().index], virtual_batch_size=4,
                         momentum=0.0, sync_statistics=_collective())

    ys = call_for_each_tower(tower, ['/cpu:0', '/cpu:1'])
    x = (rng.randn(12, 3) * 3 + 1).astype(np.float32)
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        y = np.concatenate(sess.run(ys, dict(zip(xs, np.split(x, 2)))))
    for k in range(3):      # virtual batch k: examples [2k, 2k+2) of each tower
        rows = [2 * k, 2 * k + 1, 6 + 2 * k, 6 + 2 * k + 1]
        np.testing.assert_allclose(y[rows], bn_forward(x[rows], 1, 0, EPS)['y'], rtol=1e-4,
                                   atol=1e-4)
    # A tower batch that is not a multiple of the share is refused at graph build.
    with tf.Graph().as_default():
        odd = [tf1.placeholder(tf.float32, [5, 3]) for _ in range(2)]
        with pytest.raises(ValueError, match='each of the 2 members .* multiple of 2'):
            call_for_each_tower(lambda: BatchNorm(
                'bn', odd[get_current_tower_context().index], virtual_batch_size=4,
                sync_statistics=_collective()), ['/cpu:0', '/cpu:1'])


def test_ghost_batch_size_errors(graph):
    with pytest.raises(ValueError, match='does not divide'):
        BatchNorm('bn', tf1.placeholder(tf.float32, [6, 3]), virtual_batch_size=4)
    with pytest.raises(ValueError, match='positive int'):
        BatchNorm('bn1', tf1.placeholder(tf.float32, [6, 3]), virtual_batch_size=0)
    with pytest.raises(ValueError, match='multiple of the 2 members'):
        build_towers(lambda x: BatchNorm('bn2', x, virtual_batch_size=3,
                                         sync_statistics='collective'), 2, (None, 3))
    x = tf1.placeholder(tf.float32, [None, 3])
    y = BatchNorm('bn3', x, virtual_batch_size=4)
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError, match='virtual_batch_size=4'):
            sess.run(y, {x: np.ones((6, 3))})


# --- BatchRenorm ------------------------------------------------------------------------

def test_batch_renorm_synced_with_tensor_limits(graph, rng):
    rmax = tf1.placeholder(tf.float32, [])
    net = build_towers(lambda x: BatchRenorm('brn', x, rmax, 0.5, momentum=0.5,
                                             sync_statistics=_collective()), 2, (None, 3))
    assert sorted(v.op.name for v in tf1.global_variables()) == sorted(
        'brn/' + n for n in ('beta', 'gamma', 'moving_mean', 'moving_variance',
                             'moving_stddev', 'renorm_mean', 'renorm_stddev'))
    x = (rng.randn(10, 3) * 3 + 2).astype(np.float32)
    feed = dict(zip(net['xs'], split_batches(x, [4, 6])))
    feed[rmax] = 1.5
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        y = np.concatenate(sess.run(net['ys'], feed))
        rmean = sess.run(var('brn/renorm_mean'))
    f = bn_forward(x, 1, 0, EPS)
    std = np.sqrt(f['var'] + EPS)
    r = np.clip(std / 1.0, 1 / 1.5, 1.5)
    d = np.clip(f['mean'] / 1.0, -0.5, 0.5)
    np.testing.assert_allclose(y, f['xhat'] * r + d, rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(rmean, 0.01 * f['mean'], rtol=1e-4)


# --- fine-tune statistics -------------------------------------------------------------

@pytest.mark.parametrize('layer', ['BatchNorm', 'sync_batch_norm'])
def test_finetune_gives_exact_population_statistics_across_towers(graph, rng, layer):
    switch = tf1.placeholder(tf.bool, [])
    if layer == 'BatchNorm':
        fn = lambda x: BatchNorm('bn', x, momentum=0.9, finetune=switch,
                                 sync_statistics=_collective())
        mm_v, mv_v = lambda: var('bn/mean/EMA'), lambda: var('bn/variance/EMA')
        variance = 'var'  # tensorpack's 2-D path is not fused: the biased variance
    else:
        fn = lambda x: sync_batch_norm(x, decay=0.9, finetune=switch, scope='bn',
                                       updates_collections=None, sync_statistics=_collective())
        mm_v, mv_v = lambda: var('bn/moving_mean'), lambda: var('bn/moving_variance')
        variance = 'var_unbiased'  # slim's 2-D path is fused: the unbiased variance
    net = build_towers(fn, 3, (None, 3))
    reset = start_finetuning()
    batches = [(rng.randn(9, 3) * (k + 1) + k).astype(np.float32) for k in range(6)]
    sizes = [2, 3, 4]

    def run(batch, on):
        feed = dict(zip(net['xs'], split_batches(batch, sizes)))
        feed[switch] = on
        sess.run(net['ys'], feed)

    with make_session(graph, 3) as sess:
        sess.run(tf1.global_variables_initializer())
        run(batches[0], False)           # an ordinary step: decay 0.9
        sess.run(reset)
        for b in batches[1:4]:
            run(b, True)
        stats = [bn_forward(b, 1, 0, EPS) for b in batches[1:4]]
        np.testing.assert_allclose(sess.run(mm_v()), np.mean([s['mean'] for s in stats], 0),
                                   rtol=1e-5)
        np.testing.assert_allclose(sess.run(mv_v()),
                                   np.mean([s[variance] for s in stats], 0), rtol=1e-5)
        # Restart: the average covers only the batches after the reset.
        sess.run(reset)
        for b in batches[4:]:
            run(b, True)
        stats = [bn_forward(b, 1, 0, EPS) for b in batches[4:]]
        np.testing.assert_allclose(sess.run(mm_v()), np.mean([s['mean'] for s in stats], 0),
                                   rtol=1e-5)
        # With the switch off, the ordinary decay applies again.
        before = sess.run(mm_v())
        run(batches[0], False)
        np.testing.assert_allclose(sess.run(mm_v()),
                                   0.9 * before + 0.1 * bn_forward(batches[0], 1, 0,
                                                                   EPS)['mean'], rtol=1e-5)


# --- against tensorpack 0.11 itself ------------------------------------------------

TENSORPACK_SCRIPT = '''
import json, sys
import numpy as np
import tensorflow as tf
tf1 = tf.compat.v1
import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
tf_behavior.apply()
from tensorpack.models import BatchNorm
from tensorpack.tfutils.tower import TowerContext
cases = json.loads(sys.argv[1])
rng = np.random.RandomState(0)
results = {}
placeholders, outputs = [], []
with TowerContext('', is_training=True):
    for i, case in enumerate(cases):
        x = tf1.placeholder(tf.float32, [None] + case['shape'])
        placeholders.append(x)
        outputs.append(BatchNorm('bn%d' % i, x, **case['kwargs']))
updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
data = [[(rng.randn(8, *c['shape']) * 2 + 1).astype(np.float32) for _ in range(3)]
        for c in cases]
with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    for step in range(3):
        feed = {p: d[step] for p, d in zip(placeholders, data)}
        outs = sess.run(outputs + [updates], feed)[:-1]
        for i, o in enumerate(outs):
            results['out%d_%d' % (i, step)] = o
    for v in tf1.global_variables():
        results['var/' + v.op.name] = sess.run(v)
    tf1.train.Saver().save(sess, 'tp_ckpt/model')
for i, d in enumerate(data):
    for step in range(3):
        results['data%d_%d' % (i, step)] = d[step]
np.savez('result.npz', **results)
print('RESULT result.npz')
'''

PARITY_CASES = [
    {'shape': [4, 4, 3], 'kwargs': {}},
    {'shape': [3, 4, 4], 'kwargs': {'data_format': 'channels_first', 'momentum': 0.8,
                                    'epsilon': 1e-3}},
    {'shape': [4, 4, 3], 'kwargs': {'center': False, 'scale': False}},
    {'shape': [4, 4, 3], 'kwargs': {'use_bias': False, 'decay': 0.7}},
    {'shape': [4, 4, 3], 'kwargs': {'virtual_batch_size': 2}},
    {'shape': [4, 4, 3], 'kwargs': {'ema_update': 'internal'}},
]


@pytest.mark.versions
def test_parity_with_tensorpack_and_checkpoint_restore(graph, tmp_path):
    run_reference(TENSORPACK_SCRIPT, tmp_path, args=[json.dumps(PARITY_CASES)])
    ref = np.load(tmp_path / 'result.npz')
    placeholders, outputs = [], []
    with TowerContext('', is_training=True):
        for i, case in enumerate(PARITY_CASES):
            x = tf1.placeholder(tf.float32, [None] + case['shape'])
            placeholders.append(x)
            outputs.append(BatchNorm('bn%d' % i, x, **case['kwargs']))
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    names = sorted(v.op.name for v in tf1.global_variables())
    assert names == sorted(k[4:] for k in ref.files if k.startswith('var/'))
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        for step in range(3):
            feed = {p: ref['data%d_%d' % (i, step)] for i, p in enumerate(placeholders)}
            outs = sess.run(outputs + [updates], feed)[:-1]
            for i, o in enumerate(outs):
                np.testing.assert_allclose(o, ref['out%d_%d' % (i, step)], rtol=1e-4,
                                           atol=1e-4, err_msg='case %d step %d' % (i, step))
        for v in tf1.global_variables():
            np.testing.assert_allclose(sess.run(v), ref['var/' + v.op.name], rtol=1e-5,
                                       atol=1e-6, err_msg=v.op.name)
    # A checkpoint written by tensorpack restores into an inference graph.
    g2 = tf.Graph()
    with g2.as_default():
        x = tf1.placeholder(tf.float32, [None, 4, 4, 3])
        with TowerContext('', is_training=False):
            y = BatchNorm('bn0', x)
        with make_session(g2, 1) as sess:
            tf1.train.Saver().restore(sess, str(tmp_path / 'tp_ckpt' / 'model'))
            data = ref['data0_0']
            mean, variance = ref['var/bn0/mean/EMA'], ref['var/bn0/variance/EMA']
            expected = ((data - mean) / np.sqrt(variance + EPS) * ref['var/bn0/gamma'] +
                        ref['var/bn0/beta'])
            np.testing.assert_allclose(sess.run(y, {x: data}), expected, rtol=1e-5, atol=1e-5)


# --- argument checks, named as the user spelled them ------------------------------------

@pytest.mark.parametrize('kwargs,exc,match', [
    (dict(training='False'), TypeError, 'training must be a Python bool or a scalar bool'),
    (dict(training=1), TypeError, 'training must be'),
    (dict(training=np.bool_(True)), TypeError, 'training must be'),
    (dict(use_local_stat='True'), TypeError, 'use_local_stat must be'),
    (dict(momentum=1.5), ValueError, r'momentum=1\.5 is outside'),
    (dict(decay=1.5), ValueError, r'decay=1\.5 is outside'),
    (dict(momentum='0.9'), TypeError, 'momentum must be a number'),
])
def test_batch_norm_arguments_are_checked(graph, kwargs, exc, match):
    with pytest.raises(exc, match=match) as info:
        BatchNorm('bn', tf1.placeholder(tf.float32, [None, 3]), **kwargs)
    assert 'BatchNorm(bn)' in str(info.value)


def test_batch_norm_training_may_be_a_bool_tensor(graph, rng):
    switch = tf1.placeholder(tf.bool, [])
    x = tf1.placeholder(tf.float32, [None, 3])
    y = BatchNorm('bn', x, training=switch, momentum=tf.constant(0.5))
    data = (rng.randn(4, 3) * 2 + 1).astype(np.float32)
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        out = sess.run(y, {x: data, switch: True})
        np.testing.assert_allclose(out, bn_forward(data, 1, 0, EPS)['y'], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(sess.run(y, {x: data, switch: False}),
                                   data / np.sqrt(1 + EPS), rtol=1e-5)


@pytest.mark.parametrize('rmax,dmax,exc,match', [
    (0.5, 1.0, ValueError, r'rmax=0\.5 is invalid: .*0 < rmin <= 1 <= rmax and dmax >= 0'),
    (0, 1.0, ValueError, 'rmax=0 is invalid'),
    (-2.0, 1.0, ValueError, r'rmax=-2\.0 is invalid'),
    (2.0, -1.0, ValueError, r'dmax=-1\.0 is invalid'),
    ('3', 1.0, TypeError, 'rmax must be a number or a tensor'),
])
def test_batch_renorm_limits_are_checked(graph, rmax, dmax, exc, match):
    with pytest.raises(exc, match=match) as info:
        BatchRenorm('brn', tf1.placeholder(tf.float32, [None, 4, 4, 3]), rmax, dmax)
    assert 'BatchRenorm(brn)' in str(info.value)
    BatchRenorm('ok', tf1.placeholder(tf.float32, [None, 4, 4, 3]), 1.0, 0.0)


@pytest.mark.parametrize('layer', ['BatchNorm', 'BatchRenorm'])
def test_partitioned_scope_partitions_beta_gamma_only(graph, rng, layer):
    x = tf1.placeholder(tf.float32, [None, 2, 2, 4])
    with tf1.variable_scope('net', partitioner=tf1.fixed_size_partitioner(2)):
        if layer == 'BatchNorm':
            y = BatchNorm('bn', x, momentum=0.5)
        else:
            y = BatchRenorm('bn', x, 1.5, 0.5, momentum=0.5, gamma_initializer=None)
    names = sorted(v.op.name for v in tf1.global_variables())
    assert [n for n in names if 'part_' in n] == [
        'net/bn/beta/part_0', 'net/bn/beta/part_1', 'net/bn/gamma/part_0', 'net/bn/gamma/part_1']
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(updates):
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(y * y))
    data = (rng.randn(4, 2, 2, 4) + 3).astype(np.float32)
    moving = tf1.global_variables('net/bn/mean/EMA' if layer == 'BatchNorm'
                                  else 'net/bn/moving_mean')[0]
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train, {x: data})
        np.testing.assert_allclose(sess.run(moving), 0.5 * data.reshape(-1, 4).mean(0),
                                   rtol=1e-5)


def test_finetune_counter_in_a_partitioned_scope(graph):
    with tf1.variable_scope('net', partitioner=tf1.fixed_size_partitioner(2)):
        BatchNorm('bn', tf1.placeholder(tf.float32, [None, 4]), finetune=True)
        sync_batch_norm(tf1.placeholder(tf.float32, [None, 4]), finetune=True, scope='sbn')
    names = [v.op.name for v in tf1.global_variables()]
    assert 'net/bn/finetune_count' in names and 'net/sbn/finetune_count' in names


@pytest.mark.parametrize('how', ['default', 'None', 'gamma_init=None'])
def test_batch_renorm_gamma_starts_at_ones_without_an_initializer(graph, how):
    """The README: ``BatchRenorm(gamma_initializer=None)`` starts ``gamma`` at ones.

    (tensorpack passes None on to Keras, whose default for a weight is the
    random ``glorot_uniform``: a wrong default here would give values in
    (-sqrt(6 / 2C), sqrt(6 / 2C)), never all ones.) An initializer that is
    given is used.
    """
    x = tf1.placeholder(tf.float32, [None, 2, 2, 16])
    kwargs = {'default': {}, 'None': {'gamma_initializer': None},
              'gamma_init=None': {'gamma_init': None}}[how]
    y = BatchRenorm('brn', x, 3.0, 5.0, **kwargs)
    given = BatchRenorm('brn2', x, 3.0, 5.0, gamma_initializer=tf1.constant_initializer(2.5))
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        gamma, gamma2 = sess.run([y.variables.gamma, given.variables.gamma])
    np.testing.assert_array_equal(gamma, np.ones(16, np.float32))
    np.testing.assert_array_equal(gamma2, np.full(16, 2.5, np.float32))

"""A synchronized layer never falls back to per-tower statistics silently.

Each case where the layer cannot synchronize as asked raises (at graph build,
or at the latest at the first run), naming the layer and the fix. A warning
followed by per-tower statistics would be a silent fallback: nothing warns.
"""

import contextlib
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
from conftest import assert_first_run_fails, make_session
import tf1_syncbn
from tf1_syncbn import BatchNorm, CollectiveBackend, SyncBNWarning, audit_graph, sync_batch_norm
from tower import (TowerContext, register_tower_pattern, strip_tower_prefix,
                   tower_index_from_name, tower_patterns, unregister_tower_pattern)

tf1 = tf.compat.v1


def ph(shape=(None, 3)):
    return tf1.placeholder(tf.float32, list(shape))


@pytest.mark.parametrize('spec', ['collective', CollectiveBackend(timeout=5)])
def test_explicit_backend_outside_any_tower_is_a_build_error(graph, spec):
    with pytest.raises(ValueError, match=r'sync_batch_norm\(my_bn\).*cannot tell how many '
                                         r'towers.*num_dev=<number of towers'):
        sync_batch_norm(ph(), scope='my_bn', sync_statistics=spec)


def test_explicit_backend_outside_any_tower_is_a_build_error_for_tensorpack_layers(graph):
    with pytest.raises(ValueError, match=r"BatchNorm\(bn\).*sync_statistics='collective'"):
        BatchNorm('bn', ph(), sync_statistics='collective')


def test_num_dev_1_or_inference_outside_towers_is_fine(graph):
    sync_batch_norm(ph(), scope='one', num_dev=1, sync_statistics='collective')
    sync_batch_norm(ph(), scope='infer', is_training=False, sync_statistics='collective')
    assert not [op for op in graph.get_operations() if 'Collective' in op.type]


def test_auto_outside_any_tower_is_a_single_tower_silently(graph):
    with warnings.catch_warnings():
        warnings.simplefilter('error', SyncBNWarning)
        sync_batch_norm(ph())


@pytest.mark.parametrize('front_end,scope', tf_behavior.pick(
    [('slim', s) for s in ('tower_1', 'clone_1', 'tower1', 'outer/tower_2')] +
    [(f, 'tower_1') for f in ('tensorpack', 'layers', 'keras')],
    [('slim', 'tower_1'), ('tensorpack', 'tower_1')]))
def test_auto_in_a_tower_name_scope_of_unknown_size_refuses(graph, front_end, scope):
    """Before, 'auto' warned and normalized each tower alone; tensorpack's layer, told to
    pass num_dev, took none (a TypeError). Now every front-end refuses, naming num_dev."""
    build = _front_end(front_end)
    reuse = tf1.variable_scope(tf1.get_variable_scope(), reuse=tf1.AUTO_REUSE)
    with warnings.catch_warnings(), reuse:
        warnings.simplefilter('error', SyncBNWarning)
        with tf.name_scope(scope.replace('1', '0').replace('2', '0')):
            build(ph(), True)              # tower 0 alone is one tower: quiet
        with tf.name_scope(scope), pytest.raises(
                ValueError, match=r"bn\): sync_statistics='auto' cannot tell the layer's group: "
                                  r"its name scope '%s/.*' looks like tower [12] .*Pass "
                                  r'num_dev=<number of towers in this graph>.*'
                                  r'tower\.TowerContext.*sync_statistics=None to keep per-tower '
                                  r'statistics' % scope):
            build(ph(), True)
    assert not [op for op in graph.get_operations() if 'Collective' in op.type]


@pytest.mark.parametrize('scope', ['tower_1', 'clone_0'])
def test_explicit_backend_in_a_tower_name_scope_of_unknown_size_raises(graph, scope):
    with tf.name_scope(scope), pytest.raises(ValueError, match='cannot tell how many towers'):
        sync_batch_norm(ph(), sync_statistics='collective')


def test_incomplete_tower_context_group_fails_at_the_first_run(graph):
    # TowerContext(total=4), but only towers 0 and 1 are ever built: the exit-time
    # check never fires (the last tower never exits); the first run says so.
    xs, ys = [], []
    for i in range(2):
        with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i, total=4):
            x = ph()
            xs.append(x)
            ys.append(sync_batch_norm(x, scope='bn',
                                      sync_statistics=CollectiveBackend(timeout=120)))
    assert_first_run_fails(   # long before the collective timeout
        graph, ys, {x: np.ones((2, 3)) for x in xs}, tf.errors.InvalidArgumentError,
        r'bn \(a group of 4 towers: built by towers 0, 1, never by towers 2, 3\)',
        devices=4, within=60)


def _two_towers(scope, xs=None):
    xs = [ph() for _ in range(2)] if xs is None else xs
    ys = []
    for i in range(2):
        with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i, total=2):
            ys.append(sync_batch_norm(xs[i], scope=scope, sync_statistics='collective'))
    return xs, ys


def test_the_run_time_check_is_an_assert_on_constants_that_follow_the_registry(graph):
    """One ``Assert`` per host on two constants: no Python runs in a step.

    Before, the check was a ``tf.numpy_function`` whose callback died with the
    process that built it (an imported meta graph could not run). Now the
    registry rewrites the constants as towers register: complete groups pass,
    also once the graph is extended with more complete layers in the same
    session, and a layer that a tower never builds fails the next session.
    """
    xs, ys = _two_towers('bn')
    ops = graph.get_operations()
    checks = [op for op in ops if op.name == 'tf1_syncbn_check_towers']
    assert len(checks) == 1 and checks[0].type == 'Assert'   # one per host, not per layer
    assert not [op for op in ops if op.type in ('PyFunc', 'EagerPyFunc', 'PyFuncStateless')]
    feed = {x: np.ones((2, 3)) for x in xs}
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(2):
            sess.run(ys, feed)
        _, ys2 = _two_towers('bn2', xs)
        sess.run(tf1.variables_initializer(tf1.global_variables('bn2')))
        sess.run(ys2, feed)
    # Tower 1 never builds bn3 (its TowerContext never exits: no build-time check).
    with tf.device('/cpu:0'), TowerContext('tower0', index=0, total=2):
        sync_batch_norm(xs[0], scope='bn3', sync_statistics=CollectiveBackend(timeout=120))
    assert len([op for op in graph.get_operations()
                if op.name.startswith('tf1_syncbn_check_towers')]) == 1
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r'bn3 \(a group of 2 towers: built by tower 0, never by '
                                 r'tower 1\)'):
            sess.run(ys, feed)


def test_eager_mode_and_tf_function_are_clear_errors():
    code = ('import tensorflow as tf, tf1_syncbn\n'
            'try:\n'
            '    tf1_syncbn.sync_batch_norm(tf.ones([2, 3]))\n'
            'except RuntimeError as e:\n'
            '    print("RuntimeError:", e)\n'
            'try:\n'
            '    tf1_syncbn.BatchNorm("bn", tf.ones([2, 3]))\n'
            'except RuntimeError as e:\n'
            '    print("RuntimeError:", e)\n'
            # tf.function, traced eagerly and in a TF1 graph: TensorFlow-internal errors before.
            '@tf.function\n'
            'def traced(x):\n'
            '    return tf1_syncbn.layers.batch_normalization(x, training=True)\n'
            'try:\n'
            '    traced(tf.ones([2, 3]))\n'
            'except RuntimeError as e:\n'
            '    print("RuntimeError:", e)\n'
            'with tf.Graph().as_default():\n'
            '    @tf.function\n'
            '    def in_a_graph(x):\n'
            '        return tf1_syncbn.sync_batch_norm(x)\n'
            '    try:\n'
            '        in_a_graph(tf.ones([2, 3]))\n'
            '    except RuntimeError as e:\n'
            '        print("RuntimeError:", e)\n')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=120, env={'TF_CPP_MIN_LOG_LEVEL': '3', 'PATH': ''}).stdout
    assert out.count('disable_eager_execution()') == 4, out
    assert "BatchNorm('bn') needs graph mode" in out
    assert ("tf1_syncbn.layers.batch_normalization is called inside a tf.function (the traced "
            "function 'traced')") in out, out
    assert "sync_batch_norm is called inside a tf.function (the traced function 'in_a_graph')" \
        in out, out


# --- tower loops the layer cannot name ------------------------------------------------

#: What the layer says about an unnamed tower loop of two copies: the fix, in full.
UNTOWERED = (r'bn\): its variables \((gpu_0/)?bn/(moving_mean|mean/EMA), \.\.\.\) are used in '
             r'training by copies on 2 devices \(/device:CPU:0, /device:CPU:1\).*pass '
             r'num_dev=<number of towers>.*tower\.register_tower_pattern.*tower\.TowerContext')


def _front_end(name, **kwargs):
    """``build(x, training)``: the layer ``bn`` of a front-end, ``sync_statistics='auto'``.

    ``kwargs``: more arguments of the layer (``num_dev``, ``sync_statistics``).
    """
    if name == 'keras':
        from tf1_syncbn import keras as sync_keras  # noqa: PLC0415 - needs tf-keras
        layer = sync_keras.BatchNormalization(name='bn', **kwargs)
        return lambda x, training: layer(x, training=training)
    if name == 'layers':
        return lambda x, training: tf1_syncbn.layers.batch_normalization(
            x, training=training, name='bn', **kwargs)
    if name == 'tensorpack':
        # (tensorpack's BatchNorm keeps tensorpack's default: sync_statistics=None.)
        kwargs.setdefault('sync_statistics', 'auto')
        return lambda x, training: BatchNorm('bn', x, training=training, **kwargs)
    return lambda x, training: sync_batch_norm(x, is_training=training, scope='bn', **kwargs)


def _device_loop(build, devices, training=True, scope=None):
    """The hand-written loop: ``tf.device`` per copy, variables reused, no tower scope.

    ``scope``: a name-scope format no tower convention knows (``'gpu_%d'``),
    else the loop of ``tf.variable_scope('', reuse=...)``.
    """
    outputs = []
    for i, device in enumerate(devices):
        if scope is None:
            scopes = tf1.variable_scope('', reuse=tf1.AUTO_REUSE)
        else:
            scopes = contextlib.ExitStack()
            scopes.enter_context(tf.name_scope(scope % i))
            scopes.enter_context(tf1.variable_scope(tf1.get_variable_scope(),
                                                    reuse=tf1.AUTO_REUSE))
        with tf.device(device), scopes:
            outputs.append(build(ph(), training))
    return outputs


@pytest.mark.parametrize('front_end,scope', tf_behavior.pick(
    [(f, s) for f in ('slim', 'tensorpack', 'layers', 'keras') for s in (None, 'gpu_%d')],
    [('slim', None), ('keras', 'gpu_%d')]))
def test_an_unnamed_tower_loop_refuses_and_single_device_reuse_does_not(graph, front_end,
                                                                        scope):
    """Copies of one layer trained on 2 devices outside any tower it can name: refused.

    Before, each copy normalized alone, silently, then after a warning. One
    layer applied to two inputs on one device, and inference copies on two
    devices, stay quiet.
    """
    build = _front_end(front_end)
    with warnings.catch_warnings():
        warnings.simplefilter('error', SyncBNWarning)
        _device_loop(build, ['/cpu:0', '/cpu:0'], scope=scope)             # one device
        _device_loop(build, ['/cpu:0', '/cpu:1'], training=False, scope=scope)
        with pytest.raises(ValueError, match=UNTOWERED + r'.*pass num_dev=1; to keep '
                                                         r'per-device statistics on purpose, '
                                                         r'sync_statistics=None\.$'):
            _device_loop(build, ['/cpu:0', '/cpu:1'], scope=scope)


class _ProcessPerDevice(CollectiveBackend):
    """A backend that, as Horovod's, takes a layer outside any tower for its process's only one."""

    implicit_single_tower = True


def test_an_unnamed_tower_loop_with_an_explicit_backend_raises_and_num_dev_1_is_quiet(graph):
    """An explicit backend raises as 'auto' does; ``num_dev=1`` (one tower split across
    devices on purpose) and ``sync_statistics=None`` say nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter('error', SyncBNWarning)
        for kwargs in ({'num_dev': 1}, {'sync_statistics': None}):
            _device_loop(lambda x, training, kw=kwargs: sync_batch_norm(x, scope='bn', **kw),
                         ['/cpu:0', '/cpu:1'])

        def build(x, training):
            return sync_batch_norm(x, scope='bn', sync_statistics=_ProcessPerDevice())

        with pytest.raises(ValueError, match=UNTOWERED + r'.*pass num_dev=1; .*'
                                                         r'sync_statistics=None\.$'):
            _device_loop(build, ['/cpu:0', '/cpu:1'])
        # The copy that raised left no trace: on the first device, the layer builds.
        _device_loop(build, ['/cpu:0'])


def test_the_audit_flags_an_unnamed_tower_loop_with_the_same_advice(graph):
    ys = _device_loop(_front_end('slim', sync_statistics=None), ['/cpu:0', '/cpu:1'],
                      scope='gpu_%d')
    loss = tf.add_n([tf.reduce_sum(y * y) for y in ys])
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    report = audit_graph(graph, train_op)
    assert not report.ok, str(report)
    assert len(report.problems) == 1, str(report)
    assert re.match(r'bn: trained by copies on 2 devices \(/device:CPU:0, /device:CPU:1\) that '
                    r'no tower name tells apart \(gpu_0/bn, gpu_1/bn\).*pass num_dev=<number '
                    r'of towers>.*tower\.register_tower_pattern.*tower\.TowerContext',
                    report.problems[0]), report.problems[0]
    assert report.layers[0].sync_summary() == 'no (per device)'
    assert report.info == [], report.info     # not "one layer applied to 2 inputs"
    # The convention registered for the audit: per-tower statistics, as before.
    report = audit_graph(graph, train_op, tower_patterns=[r'gpu_([0-9]+)'])
    assert "own batch's statistics" in report.problems[0], report.problems


# --- tower name conventions ---------------------------------------------------------

@pytest.mark.parametrize('name,index', [
    ('tower3/conv', 3), ('tower_3/conv', 3), ('clone_3/conv', 3), ('a/clone_12/b', 12),
    ('towers3/conv', None), ('xtower_1', None), ('clone_1x/b', None), ('clone1/b', None)])
def test_tower_index_from_name_knows_the_harness_conventions(name, index):
    assert tower_index_from_name(name) == index


@pytest.mark.parametrize('name', ['tower0/conv1/BatchNorm', 'tower_0/conv1/BatchNorm',
                                  'clone_0/conv1/BatchNorm', 'conv1/BatchNorm'])
def test_strip_tower_prefix_gives_one_name_for_every_convention(graph, name):
    assert strip_tower_prefix(name) == 'conv1/BatchNorm'


def test_a_registered_pattern_is_recognized_and_stripped(graph):
    register_tower_pattern(r'gpu([0-9]+)')
    try:
        assert 'gpu([0-9]+)' in tower_patterns()
        assert tower_index_from_name('gpu2/conv') == 2
        assert strip_tower_prefix('gpu2/conv/BatchNorm') == 'conv/BatchNorm'
        with tf.name_scope('gpu1'), pytest.raises(ValueError, match='tower 1 but num_dev=1'):
            sync_batch_norm(ph(), num_dev=1)
    finally:
        unregister_tower_pattern(r'gpu([0-9]+)')
    assert tower_index_from_name('gpu2/conv') is None


@pytest.mark.parametrize('pattern,exc', [(3, TypeError), ('gpu', ValueError),
                                         ('(a)(b)', ValueError), ('a/(\\d)', ValueError),
                                         ('(', ValueError)])
def test_register_tower_pattern_rejects_bad_patterns(pattern, exc):
    with pytest.raises(exc):
        register_tower_pattern(pattern)


def test_builtin_patterns_cannot_be_removed():
    with pytest.raises(ValueError, match='built in'):
        unregister_tower_pattern(r'clone_([0-9]+)')
    with pytest.raises(ValueError, match='not registered'):
        unregister_tower_pattern(r'nothing([0-9]+)')


def test_the_run_time_check_can_be_left_out_for_exported_graphs(graph, monkeypatch):
    monkeypatch.setenv('TF1_SYNCBN_RUNTIME_CHECK', '0')
    for i in range(2):
        with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i, total=2):
            sync_batch_norm(ph(), scope='bn', sync_statistics='collective')
    assert not [op for op in graph.get_operations() if op.name == 'tf1_syncbn_check_towers']
    assert [op for op in graph.get_operations() if op.type == 'CollectiveReduce']

"""``group_size`` reaches the core from every front-end and through every switch.

One cheap forward step per front-end: 4 towers in groups of 2, and in groups
of one tower first and last (``[[0], [1, 2], [3]]``), each group's outputs
against float64 batch norm on its concatenated batch (every tower's data
differ, so another grouping would not match). The exactness of the
groups themselves is tests/sync/test_sync_groups.py's (in both TF behaviours,
with ``sync_batch_norm``); the TF1-behaviour pass runs ``moments`` here.
"""

import importlib
import re

import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
from bn_reference import bn_forward, split_batches
from conftest import make_session
from tower import call_for_each_tower

tf1 = tf.compat.v1
SIZES = [2, 3, 1, 2]
CHANNELS = 3


def _slim(x, spec, name):
    from tf1_syncbn import sync_batch_norm
    return sync_batch_norm(x, group_size=spec, sync_statistics='collective', scope=name)


def _sync_arg_scope(x, spec, name):
    import tf_slim as slim

    from tf1_syncbn import sync_arg_scope
    with sync_arg_scope(group_size=spec, sync_statistics='collective'):
        return slim.batch_norm(x, is_training=True, scope=name)


def _tensorpack(x, spec, name):
    from tf1_syncbn.tensorpack import BatchNorm
    return BatchNorm(name, x, training=True, epsilon=1e-3, group_size=spec,
                     sync_statistics='collective')


def _tensorpack_renorm(x, spec, name):
    from tf1_syncbn.tensorpack import BatchRenorm
    return BatchRenorm(name, x, 1.0, 0.0, training=True, epsilon=1e-3, group_size=spec,
                       sync_statistics='collective')


def _patch_tensorpack(x, spec, name):
    import tensorpack

    from tf1_syncbn import patch_tensorpack
    with patch_tensorpack(sync_statistics='collective', group_size=spec, epsilon=1e-3):
        return tensorpack.models.BatchNorm(name, x, training=True)


def _layers(x, spec, name):
    from tf1_syncbn import layers
    return layers.batch_normalization(x, training=True, name=name, reuse=tf1.AUTO_REUSE,
                                      group_size=spec, sync_statistics='collective')


def _patch_tf_layers(x, spec, name):
    from tf1_syncbn import patch_tf_layers
    with patch_tf_layers(group_size=spec, sync_statistics='collective'):
        return tf1.layers.batch_normalization(x, training=True, name=name,
                                              reuse=tf1.AUTO_REUSE)


_KERAS = {}


def _keras(x, spec, name):
    from tf1_syncbn import keras as sync_keras
    if name not in _KERAS:
        _KERAS[name] = sync_keras.BatchNormalization(group_size=spec,
                                                     sync_statistics='collective', name=name)
    return _KERAS[name](x, training=True)


def _patch_keras(x, spec, name):
    from tf1_syncbn import keras as sync_keras
    if name not in _KERAS:
        with sync_keras.patch_keras(group_size=spec, sync_statistics='collective'):
            _KERAS[name] = importlib.import_module(
                sync_keras.KERAS_PACKAGE).layers.BatchNormalization(name=name)
    return _KERAS[name](x, training=True)


def _moments(x, spec, name):
    import tf1_syncbn
    mean, variance = tf1_syncbn.moments(x, [0], group_size=spec, sync_statistics='collective',
                                        name=name)
    return (x - mean) / tf.sqrt(variance + 1e-3)


def _tensorpack_auto(x, spec, name):
    from tf1_syncbn.tensorpack import BatchNorm
    return BatchNorm(name, x, training=True, epsilon=1e-3, group_size=spec,
                     sync_statistics='auto')


def _patch_tensorpack_auto(x, spec, name):
    import tensorpack

    from tf1_syncbn import patch_tensorpack
    with patch_tensorpack(sync_statistics='auto', group_size=spec, epsilon=1e-3):
        return tensorpack.models.BatchNorm(name, x, training=True)


FRONT_ENDS = {'sync_batch_norm': _slim, 'sync_arg_scope': _sync_arg_scope,
              'tensorpack.BatchNorm': _tensorpack, 'tensorpack.BatchRenorm': _tensorpack_renorm,
              'patch_tensorpack': _patch_tensorpack, 'layers': _layers,
              'patch_tf_layers': _patch_tf_layers, 'keras': _keras, 'patch_keras': _patch_keras,
              'moments': _moments,
              # docs/sync-groups.md's switches for tensorpack, whose default is None.
              'tensorpack.BatchNorm auto': _tensorpack_auto,
              'patch_tensorpack auto': _patch_tensorpack_auto}
#: layer name -> (group_size, its groups): groups of two, and groups of one tower
#: first and last.
GROUPINGS = {'pairs': (2, [[0, 1], [2, 3]]),
             'ends_alone': ([[3], [1, 2], [0]], [[0], [1, 2], [3]])}


@pytest.mark.filterwarnings('ignore:patch_keras:UserWarning')
@pytest.mark.parametrize('front_end', tf_behavior.pick(sorted(FRONT_ENDS), ['moments']))
def test_group_size_reaches_every_front_end(graph, rng, front_end):
    _KERAS.clear()
    xs, ys = [], {name: [] for name in GROUPINGS}

    def tower():
        x = tf1.placeholder(tf.float32, [None, CHANNELS])
        xs.append(x)
        for name, (spec, _) in GROUPINGS.items():
            ys[name].append(FRONT_ENDS[front_end](x, spec, name))

    call_for_each_tower(tower, ['/cpu:%d' % i for i in range(4)])
    x = rng.randn(sum(SIZES), CHANNELS)
    for t in range(4):        # every tower's data differ: another grouping would not match
        rows = slice(sum(SIZES[:t]), sum(SIZES[:t + 1]))
        x[rows] = x[rows] * (t + 1) + 3 * t
    parts = split_batches(x.astype(np.float32), SIZES)
    with make_session(graph, 4) as sess:
        sess.run(tf1.global_variables_initializer())
        got = sess.run(ys, dict(zip(xs, parts)))
    for name, (_, groups) in GROUPINGS.items():
        for members in groups:
            expected = bn_forward(np.concatenate([parts[t] for t in members]),
                                  np.ones(CHANNELS), np.zeros(CHANNELS), 1e-3)['y']
            np.testing.assert_allclose(np.concatenate([got[name][t] for t in members]),
                                       expected, rtol=1e-4, atol=1e-4,
                                       err_msg='%s, %s' % (front_end, name))


def _without_sync(front_end):
    """``build(x)``: a front-end with ``group_size=2`` and ``sync_statistics=None``."""
    import tensorpack

    import tf1_syncbn
    from tf1_syncbn import keras as sync_keras
    if front_end == 'tensorpack.BatchNorm':        # its default, tensorpack's: None
        return lambda x: tf1_syncbn.BatchNorm('bn', x, group_size=2)
    if front_end == 'tensorpack.BatchRenorm':
        return lambda x: tf1_syncbn.BatchRenorm('bn', x, 1.0, 0.0, group_size=2)

    def patched(x):
        with tf1_syncbn.patch_tensorpack(group_size=2):
            return tensorpack.models.BatchNorm('bn', x)
    return {
        'patch_tensorpack': patched,
        'sync_batch_norm': lambda x: tf1_syncbn.sync_batch_norm(x, group_size=2,
                                                                sync_statistics=None),
        'layers': lambda x: tf1_syncbn.layers.batch_normalization(
            x, training=True, group_size=2, sync_statistics=None),
        'keras': lambda x: sync_keras.BatchNormalization(group_size=[[0, 1], [2, 3]],
                                                         sync_statistics=None)(x, training=True),
        'moments': lambda x: tf1_syncbn.moments(x, [0], group_size=2, sync_statistics=None),
    }[front_end]


@pytest.mark.once
@pytest.mark.filterwarnings('ignore:patch_keras:UserWarning')
@pytest.mark.parametrize('front_end', ['tensorpack.BatchNorm', 'tensorpack.BatchRenorm',
                                       'patch_tensorpack', 'sync_batch_norm', 'layers', 'keras',
                                       'moments'])
def test_group_size_with_sync_statistics_none_is_refused(graph, front_end):
    """Before, tensorpack's default (None) ignored group_size: per-tower statistics, silently
    (docs/sync-groups.md listed ``patch_tensorpack(group_size=2)`` as a switch)."""
    build = _without_sync(front_end)
    spelled = '[[0, 1], [2, 3]]' if front_end == 'keras' else '2'
    with pytest.raises(ValueError, match=r'group_size=%s synchronizes within groups of towers, '
                                         r'but sync_statistics=None normalizes each tower '
                                         r"alone .*Pass sync_statistics='auto' \(or a "
                                         r'backend\) with group_size, or drop group_size\.$'
                       % re.escape(spelled)):
        call_for_each_tower(lambda: build(tf1.placeholder(tf.float32, [None, CHANNELS])),
                            ['/cpu:%d' % i for i in range(4)])

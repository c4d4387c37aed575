"""``tf1_syncbn.patch_slim``: ``slim.batch_norm`` switched process-wide (what the runner uses).

Graph building only: the layer's numbers are the slim front-end's (tests/slim/), and the
switch's against tf-slim's own ``batch_norm`` run by an unchanged script under the runner
(tests/run/test_run_scripts.py). Here: every way slim code reaches the layer
(``normalizer_fn``, the ``arg_scope`` key, the names modules imported) builds this library's
layer with the patch's defaults, where arguments, the arg scope of ``sync_batch_norm`` and that
of slim's own ``batch_norm`` (an arg scope built before the patch) win in that order; ``restore``
puts slim's back everywhere; ``sync_arg_scope`` still works inside. That a patch made as the
runner's steps aside for the script's own is tests/run/test_run_proof.py's (each patch kind).
"""

import sys
import types

import tensorflow as tf
import tf_slim as slim

import tf1_syncbn

tf1 = tf.compat.v1
ORIGINAL = slim.batch_norm


def _collectives(graph):
    return sum(op.type == 'CollectiveReduce' for op in graph.get_operations())


def _variables(scope):
    return sorted(v.op.name.split('/')[-1] for v in tf1.global_variables(scope))


def _towers(fn, towers=2, outer='model'):
    with tf1.name_scope(outer):
        for i, x in enumerate(tf.split(tf1.placeholder(tf.float32, [4, 3]), towers)):
            with tf.device('/cpu:%d' % i), tf1.name_scope('clone_%d' % i), \
                    tf1.variable_scope(tf1.get_variable_scope(), reuse=i > 0):
                fn(x)


def test_every_way_to_slim_batch_norm_builds_ours_with_the_defaults(graph):
    user = types.ModuleType('user_module')
    user.bn = slim.batch_norm                     # `from tf_slim import batch_norm as bn`
    sys.modules[user.__name__] = user
    try:
        with slim.arg_scope([slim.batch_norm], scale=True) as before:     # slim's own key
            pass
        with tf1_syncbn.patch_slim(num_dev=2) as patch:
            assert slim.batch_norm is user.bn is slim.layers.batch_norm is patch.batch_norm
            with slim.arg_scope([slim.fully_connected], normalizer_fn=slim.batch_norm):
                _towers(lambda x: slim.fully_connected(x, 3, scope='fc'))
            assert _collectives(graph) == 2           # synchronized (forward): num_dev=2
            with slim.arg_scope(before):                  # arguments beat the defaults
                user.bn(tf.ones([2, 3]), num_dev=1, scope='old_scope')   # scale=True applies
                slim.batch_norm(tf.ones([2, 3]), num_dev=1, scale=False, scope='explicit')
            with slim.arg_scope([slim.batch_norm], sync_statistics=None, center=False):
                _towers(lambda x: slim.batch_norm(x, scope='per_tower'), outer='second')
            assert _collectives(graph) == 2           # the arg scope's None beat 'auto'
        assert 'gamma' in _variables('old_scope') and 'gamma' not in _variables('explicit')
        assert 'beta' not in _variables('per_tower')
        assert slim.batch_norm is ORIGINAL and user.bn is ORIGINAL
        assert sys.modules['tf_slim.layers.layers'].batch_norm is ORIGINAL and not patch.active
    finally:
        del sys.modules[user.__name__]


def test_sync_arg_scope_still_works_under_the_patch(graph):
    with tf1_syncbn.patch_slim(num_dev=2):
        with tf1_syncbn.sync_arg_scope():
            _towers(lambda x: slim.batch_norm(x, scope='bn'))
    # A direct call inside the block is still the patch's (its num_dev; the block's arg scope
    # adds sync_statistics='auto'): synchronized.
    assert _collectives(graph) == 2
    assert slim.batch_norm is ORIGINAL

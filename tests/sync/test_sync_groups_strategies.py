"""Sync groups under tf.distribute: every front-end's moving statistics are replica 0's group's.

docs/sync-groups.md: the moving mean and variance follow the group of global
tower 0, as PyTorch's rank 0 and TPU's replica 0 do. Under
``tf.compat.v1.distribute.MirroredStrategy`` every replica builds the
moving-average update with its own group's statistics, and what the variable
then holds is what the strategy makes of the replicas' updates (slim,
tensorpack, tf.layers: mirrored variables that keep the first replica's;
tf1_syncbn.keras: tf-keras' on-read variables, whose copies each replica
updates). Checked for every front-end in one graph of 4 replicas of uneven
batches, with three groupings side by side (none, ``group_size=2`` and the
explicit ``[[1, 3], [0, 2]]``, whose group of replica 0 is not listed first),
and for the Keras classes and one other front-end under
``CentralStorageStrategy``: after two training steps, the moving mean and
variance

(a) read with ``sess.run``, in a run after the training steps' (TF1
    behaviour's reference variables race with an update of the same run);
(b) as ``tf.compat.v1.train.Saver`` writes them (``tf.train.load_checkpoint``);
(c) restored from that checkpoint into a fresh session: every replica's copy;

against float64 numpy with the replaced layer's update on replica 0's group's
concatenated batch: ``moving = momentum * moving + (1 - momentum) * batch
statistic``, from 0 and 1, with the variance the replaced layer tracks on a
rank-2 input (tf-slim's fused path: Bessel-corrected; tf-keras', tf.layers'
and tensorpack's non-fused one: biased; tests/keras/test_keras_layer.py
checks the same rule against tf-keras itself). In the training session
(before any restore) every copy holds the same statistics, but tf-keras'
on-read copies, which each hold their replica's group's.

Before the fix, tf1_syncbn.keras (both classes, and through ``patch_keras``)
gave the mean of the groups' statistics in (a), (b) and (c), under both
strategies: tf-keras' ``MEAN`` aggregation of its on-read variables.
"""

import importlib

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_forward
import suite_scope
import tf_behavior
from conftest import make_session
from strategy_case import make_strategy

tf1 = tf.compat.v1

REPLICAS = 4
SIZES = [3, 2, 1, 2]
CHANNELS = 3
MOMENTUM = 0.6
EPSILON = 1e-3
STEPS = 2
#: name -> group_size; each builds its own layers in the same graph.
GROUPINGS = {'whole': None, 'pairs': 2, 'explicit': [[1, 3], [0, 2]]}


def _group_of(group_size, replica):
    """The replicas of ``replica``'s sync group (numpy's side: from the spec alone)."""
    if group_size is None:
        return list(range(REPLICAS))
    if isinstance(group_size, int):
        start = replica - replica % group_size
        return list(range(start, start + group_size))
    return sorted(next(g for g in group_size if replica in g))


def _slim(group_size, name):
    from tf1_syncbn import sync_batch_norm
    return lambda x: sync_batch_norm(x, decay=MOMENTUM, epsilon=EPSILON, scope=name,
                                     group_size=group_size)


def _layers(group_size, name):
    from tf1_syncbn import layers
    return lambda x: layers.batch_normalization(x, momentum=MOMENTUM, epsilon=EPSILON,
                                                training=True, name=name,
                                                group_size=group_size)


def _tensorpack(group_size, name):
    from tf1_syncbn.tensorpack import BatchNorm
    return lambda x: BatchNorm(name, x, momentum=MOMENTUM, epsilon=EPSILON, training=True,
                               sync_statistics='auto', group_size=group_size)


def _keras_layer(make, **kwargs):
    """A Keras layer, made in ``strategy.scope()``, called by every replica."""
    layer = make(momentum=MOMENTUM, epsilon=EPSILON, **kwargs)

    def apply(x):
        y = layer(x, training=True)
        for update in layer.get_updates_for(x):
            tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
        return y
    return apply


def _keras(group_size, name):
    from tf1_syncbn import keras as sync_keras
    return _keras_layer(sync_keras.BatchNormalization, group_size=group_size, name=name)


def _keras_v1(group_size, name):
    from tf1_syncbn import keras as sync_keras
    return _keras_layer(sync_keras.BatchNormalizationV1, group_size=group_size, name=name)


def _patch_keras(group_size, name):
    from tf1_syncbn import keras as sync_keras
    with sync_keras.patch_keras(group_size=group_size):
        make = importlib.import_module(sync_keras.KERAS_PACKAGE).layers.BatchNormalization
        assert make.__module__ == 'tf1_syncbn.keras', make
        return _keras_layer(make, name=name)


#: name -> (make(group_size, scope), moving mean's and variance's names in the
#: scope, the batch variance the replaced layer's moving variance tracks, whether
#: the variables are tf-keras' on-read ones).
FRONT_ENDS = {
    'sync_batch_norm': (_slim, ('moving_mean', 'moving_variance'), 'var_unbiased', False),
    'layers.batch_normalization': (_layers, ('moving_mean', 'moving_variance'), 'var', False),
    'tensorpack.BatchNorm': (_tensorpack, ('mean/EMA', 'variance/EMA'), 'var', False),
    'keras.BatchNormalization': (_keras, ('moving_mean', 'moving_variance'), 'var', True),
    'keras.BatchNormalizationV1': (_keras_v1, ('moving_mean', 'moving_variance'), 'var', True),
    'patch_keras': (_patch_keras, ('moving_mean', 'moving_variance'), 'var', True),
}
#: strategy kind (strategy_case.make_strategy) -> the front-ends built under it:
#: every one under MirroredStrategy; under CentralStorageStrategy (variables on
#: the parameter device) one with mirrored-style variables and the Keras classes.
FRONT_ENDS_UNDER = {
    'mirrored': list(FRONT_ENDS),
    'central': ['sync_batch_norm', 'keras.BatchNormalization', 'keras.BatchNormalizationV1'],
}
CASES = [(k, f, g) for k, front_ends in FRONT_ENDS_UNDER.items() for f in front_ends
         for g in GROUPINGS]
#: ``make test``: every MirroredStrategy case; under CentralStorageStrategy the
#: Keras layer with and without groups and slim's with groups (the v1 class's
#: weights are built by the same ``add_weight``, the explicit groups' group of
#: replica 0 is the core's, checked under MirroredStrategy). The TF1-behaviour
#: pass (reference variables, read after the training steps' runs):
#: MirroredStrategy's cases.
COVERING = [c for c in CASES if c[0] == 'mirrored'] + [
    ('central', 'keras.BatchNormalization', 'whole'),
    ('central', 'keras.BatchNormalization', 'pairs'), ('central', 'sync_batch_norm', 'pairs')]
RUN_CASES = tf_behavior.pick(suite_scope.covering(CASES, COVERING),
                             [c for c in CASES if c[0] == 'mirrored'])


def _scope(front_end, grouping):
    return '%s_%s' % (front_end.replace('.', '_'), grouping)


def _data():
    rng = np.random.RandomState(42)
    return [[(rng.randn(size, CHANNELS) * (1 + i) + 4 * i).astype(np.float32)
             for i, size in enumerate(SIZES)] for _ in range(STEPS)]


def _expected(steps, members, variance):
    mean, var = np.zeros(CHANNELS), np.ones(CHANNELS)
    for batches in steps:
        f = bn_forward(np.concatenate([batches[m] for m in members]), 1.0, 0.0, EPSILON)
        mean = MOMENTUM * mean + (1 - MOMENTUM) * f['mean']
        var = MOMENTUM * var + (1 - MOMENTUM) * f[variance]
    return mean, var


def _statistics(front_end, grouping):
    scope, names = _scope(front_end, grouping), FRONT_ENDS[front_end][1]
    # (v.name: an on-read variable's op, read across replicas, is the reduction's.)
    by_name = {v.name.split(':')[0]: v for v in tf1.global_variables()}
    return [by_name['%s/%s' % (scope, n)] for n in names]


_RUNS = {}


def _run(kind, tmp_path_factory):
    """Per strategy kind: one graph with every case, one training session, one checkpoint
    and one restoring session."""
    if kind in _RUNS:
        return _RUNS[kind]
    cases = [(f, g) for k, f, g in RUN_CASES if k == kind]
    checkpoint = str(tmp_path_factory.mktemp('groups_' + kind) / 'model.ckpt')
    data = _data()
    graph = tf.Graph()
    with graph.as_default():
        strategy = make_strategy(kind, REPLICAS)
        xs = [tf1.placeholder(tf.float32, [None, CHANNELS], 'x%d' % i) for i in range(REPLICAS)]
        with strategy.scope():
            layers = {(f, g): FRONT_ENDS[f][0](GROUPINGS[g], _scope(f, g)) for f, g in cases}

        def replica_fn():
            i = int(tf.get_static_value(
                tf.distribute.get_replica_context().replica_id_in_sync_group))
            ys = [layers[case](xs[i]) for case in cases]
            with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                return tf.group(*ys)

        with strategy.scope():
            step = tf.group(*strategy.experimental_local_results(strategy.run(replica_fn)))
        variables = {case: _statistics(*case) for case in cases}
        copies = {case: [list(strategy.experimental_local_results(v)) for v in pair]
                  for case, pair in variables.items()}
        saver = tf1.train.Saver()
        with make_session(graph, REPLICAS) as sess:
            sess.run(tf1.global_variables_initializer())
            for batches in data:
                sess.run(step, dict(zip(xs, batches)))
            # Read in a run of their own, after the updates' (one run: one executor).
            read, during = sess.run([variables, copies])
            saver.save(sess, checkpoint)
        with make_session(graph, REPLICAS) as sess:
            saver.restore(sess, checkpoint)
            restored = sess.run(copies)
        names = {case: [v.name.split(':')[0] for v in pair] for case, pair in variables.items()}
    saved = tf.train.load_checkpoint(checkpoint)
    _RUNS[kind] = dict(data=data, read=read, during=during, restored=restored, names=names,
                       saved={case: [saved.get_tensor(n) for n in names[case]]
                              for case in cases})
    return _RUNS[kind]


@pytest.mark.filterwarnings('ignore:patch_keras:UserWarning')
@pytest.mark.parametrize('kind,front_end,grouping', RUN_CASES,
                         ids=['%s-%s-%s' % c for c in RUN_CASES])
def test_moving_statistics_are_replica_0s_group(tmp_path_factory, kind, front_end, grouping):
    runs, case = _run(kind, tmp_path_factory), (front_end, grouping)
    group_size, variance, on_read = GROUPINGS[grouping], FRONT_ENDS[front_end][2], \
        FRONT_ENDS[front_end][3]
    members = _group_of(group_size, 0)
    expected = _expected(runs['data'], members, variance)
    checks = [('read', runs['read'][case], expected), ('saved', runs['saved'][case], expected)]
    checks += [('restored, copy %d' % r, [c[r] for c in runs['restored'][case]], expected)
               for r in range(len(runs['restored'][case][0]))]
    # In the training session, mirrored variables hold replica 0's update on every
    # copy; tf-keras' on-read ones, each replica's own (its group's) until a restore.
    checks += [('in training, copy %d' % r, [c[r] for c in runs['during'][case]],
                _expected(runs['data'], _group_of(group_size, r), variance) if on_read
                else expected) for r in range(len(runs['during'][case][0]))]
    wrong = []
    for label, got, want in checks:
        for name, value, target in zip(runs['names'][case], got, want):
            if not np.allclose(value, target, rtol=1e-5, atol=1e-5):
                wrong.append('%s %s: %s, not %s' % (name, label, np.round(value, 4),
                                                    np.round(target, 4)))
    assert not wrong, "expected the statistics of replica 0's group %s; got:\n%s" % (
        members, '\n'.join(wrong))

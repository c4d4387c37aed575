"""Variables, collections and moving-average updates (main tower only)."""

import numpy as np
import pytest
import tensorflow as tf

from bn_reference import bn_forward, build_towers, split_batches, var
from conftest import make_session
from tf1_syncbn import CollectiveBackend, sync_batch_norm

tf1 = tf.compat.v1


def _model(x, **kwargs):
    h = sync_batch_norm(x, scope='block1/bn', sync_statistics=CollectiveBackend(60), **kwargs)
    return sync_batch_norm(h, scope='block2/bn', sync_statistics=CollectiveBackend(60),
                           **kwargs)


def test_slim_variable_names_and_collections(graph):
    build_towers(lambda x: _model(x, scale=True), 2, (None, 3))
    names = sorted(v.op.name for v in tf1.global_variables())
    assert names == sorted('block%d/bn/%s' % (b, n) for b in (1, 2)
                           for n in ('beta', 'gamma', 'moving_mean', 'moving_variance'))
    assert sorted(v.op.name for v in tf1.trainable_variables()) == sorted(
        'block%d/bn/%s' % (b, n) for b in (1, 2) for n in ('beta', 'gamma'))
    assert len(tf1.get_collection(tf1.GraphKeys.MODEL_VARIABLES)) == 8


def test_assignments_on_the_main_tower_and_one_trigger_per_layer_elsewhere(graph):
    build_towers(_model, 4, (None, 3))
    main = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, 'tower0/')
    assert len(main) == 4 and all(op.op.type != 'NoOp' for op in main)
    for scope in ('block1/bn', 'block2/bn'):
        in_scope = [op for op in main if op.name.startswith('tower0/' + scope + '/')]
        assert len(in_scope) == 2, [op.name for op in main]
        for i in (1, 2, 3):
            triggers = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, 'tower%d/%s/' % (i, scope))
            assert [op.type for op in triggers] == ['NoOp']
            # A trigger runs the main tower's assignments of the same layer.
            assert set(triggers[0].control_inputs) == {op.op for op in in_scope}


def test_custom_updates_collection(graph):
    build_towers(lambda x: _model(x, updates_collections=['my_updates']), 2, (None, 3))
    assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    assert len(tf1.get_collection('my_updates', 'tower0/')) == 4
    assert len(tf1.get_collection('my_updates', 'tower1/')) == 2


@pytest.mark.parametrize('num_towers', [1, 3])
def test_updates_as_control_dependencies(graph, rng, num_towers):
    sizes = [2, 3, 1][:num_towers]
    net = build_towers(lambda x: _model(x, updates_collections=None, decay=0.5), num_towers,
                       (None, 3))
    assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    x = rng.randn(sum(sizes), 3).astype(np.float32) + 2
    with make_session(graph, num_towers) as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(net['ys'], dict(zip(net['xs'], split_batches(x, sizes))))
        mm, mv = sess.run([var('block1/bn/moving_mean'), var('block1/bn/moving_variance')])
    f = bn_forward(x, 1, 0, 1e-3)
    np.testing.assert_allclose(mm, 0.5 * f['mean'], rtol=1e-5)
    np.testing.assert_allclose(mv, 0.5 + 0.5 * f['var_unbiased'], rtol=1e-5)


def test_prediction_towers_do_not_sync_or_update(graph):
    from tower import call_for_each_tower
    call_for_each_tower(lambda: sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]),
                                                is_training=False),
                        ['/cpu:0', '/cpu:1'], is_training=False)
    assert not tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    assert not [op for op in graph.get_operations() if op.type.startswith('Collective')]

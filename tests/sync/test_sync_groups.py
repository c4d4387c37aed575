"""Sync groups (``group_size``): each group of towers equals its own one-device reference.

4 towers in groups of 2, and in groups of 1 and 3 (the group of one first and
last), against single-device ``tf.nn.fused_batch_norm`` and float64 numpy on
each group's concatenated batch: outputs, input gradients, parameter
gradients (the sum of the groups' contributions) and the moving statistics,
which follow the group of tower 0 (docs/sync-groups.md).
"""


import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
from bn_reference import bn_backward, bn_forward, build_towers, split_batches, var
from conftest import assert_first_run_fails, make_session
from tf1_syncbn import CollectiveBackend, sync_batch_norm
from tower import call_for_each_tower, get_current_tower_context

tf1 = tf.compat.v1
EPS = 1e-3
DECAY = 0.7
SHAPE = (None, 3, 2, 4)


def _fused_reference(graph):
    """Single-device tf.nn.fused_batch_norm on one group's concatenated batch."""
    with graph.as_default(), tf.device('/cpu:0'), tf1.variable_scope('reference'):
        x = tf1.placeholder(tf.float32, [None] + list(SHAPE[1:]))
        dy = tf1.placeholder(tf.float32, [None] + list(SHAPE[1:]))
        gamma = tf1.placeholder(tf.float32, [SHAPE[-1]])
        beta = tf1.placeholder(tf.float32, [SHAPE[-1]])
        y, mean, variance = tf1.nn.fused_batch_norm(x, gamma, beta, epsilon=EPS,
                                                    is_training=True)
        dx, dgamma, dbeta = tf.gradients(tf.reduce_sum(y * dy), [x, gamma, beta])
    return dict(x=x, dy=dy, gamma=gamma, beta=beta), dict(y=y, mean=mean, var=variance, dx=dx,
                                                           dgamma=dgamma, dbeta=dbeta)


def _layer(group_size, scope='BatchNorm', **kwargs):
    init = {'gamma': tf1.random_uniform_initializer(0.5, 1.5, seed=1),
            'beta': tf1.random_uniform_initializer(-1, 1, seed=2)}
    return lambda x: sync_batch_norm(x, scale=True, decay=DECAY, epsilon=EPS, scope=scope,
                                     group_size=group_size, param_initializers=init,
                                     sync_statistics=CollectiveBackend(timeout=60), **kwargs)


# Per-tower batch sizes of 4 towers.
SIZES = {'even': [2, 2, 2, 2], 'uneven': [3, 1, 2, 4], 'empty-tower': [1, 2, 0, 3],
         'empty-group': [2, 1, 0, 0]}
#: layer scope -> (group_size, its groups, sync_batch_norm's other arguments): groups of
#: two; groups of one tower first (the main tower alone: the moving statistics are its
#: own batch's) and last, on the fused path and on the slow one (fused=False, whose
#: moving variance is the biased one, as slim's, and which no kernel set computes: it
#: runs with the compiled kernels only).
GROUPINGS = {'pairs': (2, [[0, 1], [2, 3]], {}),
             'ends_alone': ([[0], [1, 2], [3]], [[0], [1, 2], [3]], {}),
             'last_alone_slow': ([[3], [1, 0, 2]], [[0, 1, 2], [3]], {'fused': False})}


def _grouped_towers(layers):
    """4 towers, each building every layer of ``layers`` (scope -> layer) on its input.

    Returns:
      ``(xs, dys, ys, losses)``: the towers' inputs and upstream gradients,
      ``ys[scope]`` (one output per tower) and ``losses[scope]`` (the sum over
      towers of ``sum(y * dy)``).
    """
    xs, dys, ys = [], [], {scope: [] for scope in layers}

    def tower():
        x = tf1.placeholder(tf.float32, SHAPE)
        dy = tf1.placeholder(tf.float32, SHAPE)
        xs.append(x)
        dys.append(dy)
        for scope, layer in layers.items():
            ys[scope].append(layer(x))

    call_for_each_tower(tower, ['/cpu:%d' % i for i in range(4)])
    losses = {scope: tf.add_n([tf.reduce_sum(y * dy) for y, dy in zip(outs, dys)])
              for scope, outs in ys.items()}
    return xs, dys, ys, losses


def test_groups_equal_each_groups_reference(graph, rng, kernel_impl):
    """Groups of two, and groups of one tower first and last, in one graph and session."""
    groupings = {scope: grouping for scope, grouping in GROUPINGS.items()
                 if kernel_impl == 'custom' or 'fused' not in grouping[2]}
    xs, dys, ys, losses = _grouped_towers({
        scope: _layer(spec, scope=scope, **kwargs)
        for scope, (spec, _, kwargs) in groupings.items()})
    fetches = {}
    for scope in groupings:
        gamma, beta = var(scope + '/gamma'), var(scope + '/beta')
        fetches[scope] = dict(ys=ys[scope], grads=tf.gradients(losses[scope],
                                                               xs + [gamma, beta]))
    params = {scope: [var(scope + '/gamma'), var(scope + '/beta')] for scope in groupings}
    moving = {scope: [var(scope + '/moving_mean'), var(scope + '/moving_variance')]
              for scope in groupings}
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    ref_in, ref_out = _fused_reference(graph)
    init = tf1.global_variables_initializer()
    sess = make_session(graph, 4)
    for name in tf_behavior.pick(SIZES, ['uneven', 'empty-tower']):
        sizes = SIZES[name]
        sess.run(init)
        values = sess.run(params)
        total = sum(sizes)
        # Every tower's data differ in mean and scale: another grouping would not match.
        x = rng.randn(total, *SHAPE[1:]) + rng.randn(SHAPE[-1]) * 2
        for t in range(4):
            rows = slice(sum(sizes[:t]), sum(sizes[:t + 1]))
            x[rows] = x[rows] * (t + 1) + 3 * t
        x = x.astype(np.float32)
        dy = rng.randn(total, *SHAPE[1:]).astype(np.float32)
        feed = dict(zip(xs, split_batches(x, sizes)))
        feed.update(zip(dys, split_batches(dy, sizes)))
        got, _ = sess.run([fetches, updates], feed)
        stats = sess.run(moving)     # in a run of its own (TF1 behaviour's reads)
        for scope, (_, groups, kwargs) in groupings.items():
            g_val, b_val = values[scope]
            ys_got, gs = got[scope]['ys'], got[scope]['grads']
            mm, mv = stats[scope]
            where = '%s, %s' % (scope, name)
            dgamma, dbeta = np.zeros(SHAPE[-1]), np.zeros(SHAPE[-1])
            for members in groups:
                start, end = sum(sizes[:members[0]]), sum(sizes[:members[-1] + 1])
                got_y = np.concatenate([ys_got[t] for t in members])
                got_dx = np.concatenate([gs[t] for t in members])
                if end == start:
                    assert got_y.shape[0] == 0 and got_dx.shape[0] == 0
                    assert members[0] != 0    # the moving statistics' group has examples
                    continue
                xg, dyg = x[start:end], dy[start:end]
                if scope == 'pairs':      # (the others: float64 numpy only)
                    r = sess.run(ref_out, {ref_in['x']: xg, ref_in['dy']: dyg,
                                           ref_in['gamma']: g_val, ref_in['beta']: b_val})
                    np.testing.assert_allclose(got_y, r['y'], rtol=1e-5, atol=3e-5,
                                               err_msg=where)
                    np.testing.assert_allclose(got_dx, r['dx'], rtol=1e-4, atol=1e-4,
                                               err_msg=where)
                f = bn_forward(xg, g_val, b_val, EPS)
                b = bn_backward(dyg, xg, g_val, EPS)
                np.testing.assert_allclose(got_y, f['y'], rtol=1e-4, atol=1e-4, err_msg=where)
                np.testing.assert_allclose(got_dx, b['dx'], rtol=1e-3, atol=1e-4,
                                           err_msg=where)
                dgamma += b['dgamma']
                dbeta += b['dbeta']
                if members[0] == 0:       # the moving statistics follow tower 0's group
                    np.testing.assert_allclose(mm, (1 - DECAY) * f['mean'], rtol=1e-4,
                                               atol=1e-5, err_msg=where)
                    variance = f['var'] if kwargs.get('fused') is False else f['var_unbiased']
                    np.testing.assert_allclose(mv, DECAY + (1 - DECAY) * variance,
                                               rtol=1e-4, atol=1e-5, err_msg=where)
            np.testing.assert_allclose(gs[-2], dgamma, rtol=1e-4, atol=1e-3, err_msg=where)
            np.testing.assert_allclose(gs[-1], dbeta, rtol=1e-4, atol=1e-3, err_msg=where)
    sess.close()


@pytest.mark.once
def test_explicit_groups_sizes_one_and_all(graph, rng):
    """Explicit groups, group_size=1 (each tower alone) and 4 (every tower), in one graph."""
    specs = {'explicit': [[0, 3], [2, 1]], 'one': 1, 'all': 4}

    def model(x):
        return [_layer(spec, scope=name)(x) for name, spec in specs.items()]

    xs, outs = [], []

    def tower():
        x = tf1.placeholder(tf.float32, [None] + list(SHAPE[1:]))
        xs.append(x)
        outs.append(model(x))

    call_for_each_tower(tower, ['/cpu:%d' % i for i in range(4)])
    sizes = [2, 3, 1, 2]
    x = (rng.randn(sum(sizes), *SHAPE[1:]) * rng.randn(sum(sizes), 1, 1, 1) * 3).astype(
        np.float32)
    parts = split_batches(x, sizes)
    with make_session(graph, 4) as sess:
        sess.run(tf1.global_variables_initializer())
        got = sess.run(outs, dict(zip(xs, parts)))
        g_val = sess.run(var('explicit/gamma'))
        b_val = sess.run(var('explicit/beta'))
    for k, (name, groups) in enumerate([('explicit', [[0, 3], [1, 2]]),
                                        ('one', [[0], [1], [2], [3]]),
                                        ('all', [[0, 1, 2, 3]])]):
        for members in groups:
            expected = bn_forward(np.concatenate([parts[t] for t in members]), g_val, b_val,
                                  EPS)['y']
            np.testing.assert_allclose(np.concatenate([got[t][k] for t in members]), expected,
                                       rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.once
@pytest.mark.parametrize('spec, error, match', [
    (3, ValueError, r"sync_batch_norm\(BatchNorm\): group_size=3 does not divide the 4 towers.*"
                    r"one of 1, 2, 4"),
    ([[0, 1], [2]], ValueError, r'group_size=\[\[0, 1\], \[2\]\] must put each of the 4 '
                                r'towers.*no group holds 3'),
    ([[0, 1], [1, 2, 3]], ValueError, 'puts tower 1 in more than one group'),
    (0, ValueError, 'group_size must be a positive int'),
    ('2', TypeError, 'group_size must be None, a positive int'),
])
def test_groups_that_do_not_fit_are_refused_at_build(graph, spec, error, match):
    with pytest.raises(error, match=match):
        build_towers(lambda x: sync_batch_norm(x, group_size=spec,
                                               sync_statistics='collective'), 4, SHAPE)


def test_one_tower_in_all_takes_an_int_group_size_as_its_own_group(graph, rng):
    """A one-device debug run of a script written for groups: plain batch norm.

    Outside any tower and in a one-tower ``call_for_each_tower``, a layer and
    ``moments`` with ``group_size=2`` normalize with the tower's batch, which is
    its group's concatenated batch: outputs, input gradients and moving statistics
    against float64 numpy.
    """
    import tf1_syncbn
    x = tf1.placeholder(tf.float32, SHAPE)
    built = {}

    def model(scope):       # as a script written for groups: sync_statistics left 'auto'
        y = sync_batch_norm(x, scale=True, decay=DECAY, epsilon=EPS, scope=scope, group_size=2)
        mean, variance = tf1_syncbn.moments(x, [0, 1, 2], group_size=2, name=scope + '_moments')
        built[scope] = [y, tf.gradients(tf.reduce_sum(y * y), x)[0], mean, variance]

    model('untowered')
    call_for_each_tower(lambda: model('one_tower'), ['/cpu:0'])
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    assert len(updates) == 4, updates
    moving = {scope: [var(scope + '/moving_mean'), var(scope + '/moving_variance'),
                      var(scope + '/gamma'), var(scope + '/beta')] for scope in built}
    data = (rng.randn(5, *SHAPE[1:]) * 3 + 2).astype(np.float32)
    with make_session(graph, 1) as sess:
        sess.run(tf1.global_variables_initializer())
        params = sess.run(moving)
        got, _ = sess.run([built, updates], {x: data})
        stats = sess.run(moving)
    for scope, (y, dx, mean, variance) in got.items():
        gamma, beta = params[scope][2:]
        f = bn_forward(data, gamma, beta, EPS)
        np.testing.assert_allclose(y, f['y'], rtol=1e-4, atol=1e-4, err_msg=scope)
        np.testing.assert_allclose(dx, bn_backward(2 * f['y'], data, gamma, EPS)['dx'],
                                   rtol=1e-3, atol=1e-3, err_msg=scope)
        np.testing.assert_allclose(mean, f['mean'], rtol=1e-5, atol=1e-5, err_msg=scope)
        np.testing.assert_allclose(variance, f['var'], rtol=1e-4, atol=1e-5, err_msg=scope)
        np.testing.assert_allclose(stats[scope][0], (1 - DECAY) * f['mean'], rtol=1e-4,
                                   atol=1e-5, err_msg=scope)
        np.testing.assert_allclose(stats[scope][1], DECAY + (1 - DECAY) * f['var_unbiased'],
                                   rtol=1e-4, atol=1e-5, err_msg=scope)


@pytest.mark.once
@pytest.mark.parametrize('towers, spec, match', [
    (3, 2, r'group_size=2 does not divide the 3 towers.*one of 1, 3'),
    (1, [[0, 1]], r'(?s)group_size=\[\[0, 1\]\] must put each of the 1 towers.*'
               r'there is no tower 1.*tower.TowerContext.*num_dev=<number of towers>'),
])
def test_more_towers_keep_the_divisibility_rule_and_groups_name_real_towers(graph, towers, spec,
                                                                            match):
    with pytest.raises(ValueError, match=match):
        build_towers(lambda x: sync_batch_norm(x, group_size=spec), towers, SHAPE)


@pytest.mark.once
def test_a_missing_tower_is_named_with_its_group(graph):
    """Name-scope towers (no TowerContext): the first run names the missing tower's group."""
    xs, ys = [], []
    for i in range(4):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower%d' % i):
            x = tf1.placeholder(tf.float32, [None, 3])
            xs.append(x)
            ys.append(x if i == 3 else sync_batch_norm(
                x, num_dev=4, scope='bn', group_size=2, reuse=tf1.AUTO_REUSE,
                sync_statistics=CollectiveBackend(timeout=60)))
    assert_first_run_fails(graph, ys, {x: np.ones((2, 3)) for x in xs},
                           tf.errors.InvalidArgumentError,
                           r'never by tower 3 in sync group 2 of 2 \(towers 2, 3\)', devices=4)


@pytest.mark.once
def test_the_audit_shows_the_groups_and_flags_towers_that_disagree():
    import audit_cases
    from tf1_syncbn import audit_graph

    graph, train_op = audit_cases.tower_contexts(
        sync_batch_norm, towers=4, bn_params={'group_size': 2, 'sync_statistics': 'collective'})
    report = audit_graph(graph, train_op)
    assert report.problems == []
    for entry in report.layers:
        assert entry.groups == (('tower0', 'tower1'), ('tower2', 'tower3'))
        assert entry.sync_summary().startswith('collective (2 groups: tower0, tower1 | '
                                               'tower2, tower3)'), entry.sync_summary()

    # A tower whose all-reduce is keyed apart from its group's (built with other groups,
    # in a graph the registry did not see: the build refuses that in one graph).
    graph_def = graph.as_graph_def()
    for node in graph_def.node:
        if node.op == 'CollectiveReduce' and node.name.startswith('tower3/') and \
                not node.name.startswith('tower3/gradients'):
            node.attr['group_key'].i += 1
    report = audit_graph(graph_def, train_op.name)
    assert len(report.problems) == 4, report.problems     # two groups of one, per layer
    assert 'sync group 2 of 3 (tower2) all-reduces over 2 members but 1 tower of this graph ' \
        'joins it' in report.problems[0], report.problems[0]
    assert 'sync group 3 of 3 (tower3)' in report.problems[1], report.problems[1]


ALONE_AUDITS = [
    ([[0], [1, 2, 3]], 'collective (2 groups: tower0 | tower1..tower3), 6 all-reduces/step'),
    ([[0, 1, 2], [3]], 'collective (2 groups: tower0..tower2 | tower3), 6 all-reduces/step'),
    (1, 'yes (4 groups: tower0 | tower1 | tower2 | tower3), 0 all-reduces/step'),
]


@pytest.mark.parametrize('spec, summary', tf_behavior.pick(ALONE_AUDITS, ALONE_AUDITS[:1]))
def test_the_audit_shows_a_tower_alone_in_its_group_as_a_group(spec, summary):
    """A tower alone in its sync group all-reduces nothing, and is not unsynchronized."""
    import audit_cases
    from tf1_syncbn import audit_graph

    graph, train_op = audit_cases.tower_contexts(
        sync_batch_norm, towers=4, bn_params={'group_size': spec,
                                              'sync_statistics': 'collective'})
    report = audit_graph(graph, train_op)
    assert report.problems == [] and report.layers, report
    groups = [tuple('tower%d' % t for t in members)
              for members in ([[t] for t in range(4)] if spec == 1 else spec)]
    for entry in report.layers:
        assert entry.synchronized is True, entry
        assert list(entry.groups) == groups, entry.groups
        assert entry.sync_summary() == summary, entry.sync_summary()


@pytest.mark.once
def test_towers_that_disagree_on_the_groups_are_refused_at_build(graph):
    def model(x):   # towers 2 and 3 synchronize with every tower
        index = get_current_tower_context().index
        return sync_batch_norm(x, group_size=2 if index < 2 else None,
                               sync_statistics='collective')

    with pytest.raises(ValueError, match=r"tower 2 builds 'BatchNorm:0' in one group of every "
                                         r"tower, but tower 0 built it in sync group 1 of 2 "
                                         r"\(towers 0, 1\)"):
        build_towers(model, 4, SHAPE)


@pytest.mark.once
def test_the_selftest_checks_and_shows_groups(capsys):
    from tf1_syncbn import selftest
    code = selftest.main(['--towers', '4', '--group-size', '2', '--backend', 'collective',
                          '--device', 'cpu', '--steps', '1'])
    out = capsys.readouterr().out
    assert code == 0, out
    assert 'sync groups (group_size=2): group 1: towers 0, 1 | group 2: towers 2, 3' in out
    assert 'collective (2 groups: tower0, tower1 | tower2, tower3)' in out
    assert selftest.main(['--towers', '4', '--group-size', '3', '--device', 'cpu']) == 1
    # One tower is its own group, as in the layers.
    assert selftest.main(['--towers', '1', '--group-size', '2', '--backend', 'collective',
                          '--device', 'cpu', '--steps', '1']) == 0


@pytest.mark.once
@pytest.mark.parametrize('spec, sizes, groups, static', [
    (2, [4, 4, 2, 2], [[0, 1], [2, 3]], True),
    (2, [4, 4, 2, 2], [[0, 1], [2, 3]], False),
    ([[2], [0, 1], [3]], [4, 4, 8, 4], [[0, 1], [2], [3]], False),     # two towers alone
], ids=['pairs-static', 'pairs-dynamic', 'alone-dynamic'])
def test_ghost_batches_within_groups_of_different_batch_sizes(graph, rng, spec, sizes, groups,
                                                              static):
    """Virtual batch k of a group: the k-th run of 4 / (its towers) examples of each tower.

    Static batch sizes are checked per group at build; unknown ones by an
    all-reduce of the group's sizes (one slot per member of the group). The
    sizes are equal within each group, not across groups.
    """
    from tf1_syncbn.tensorpack import BatchNorm
    xs, ys = [], []

    def tower():
        x = tf1.placeholder(tf.float32, [sizes[len(xs)] if static else None, 3])
        xs.append(x)
        ys.append(BatchNorm('bn', x, training=True, epsilon=EPS, virtual_batch_size=4,
                            group_size=spec, sync_statistics=CollectiveBackend(timeout=60)))

    call_for_each_tower(tower, ['/cpu:%d' % i for i in range(4)])
    parts = [(rng.randn(n, 3) * (t + 1) + t).astype(np.float32) for t, n in enumerate(sizes)]
    with make_session(graph, 4) as sess:
        sess.run(tf1.global_variables_initializer())
        got = sess.run(ys, dict(zip(xs, parts)))
    for members in groups:
        length = 4 // len(members)
        for k in range(sizes[members[0]] // length):
            run = slice(length * k, length * (k + 1))
            expected = bn_forward(np.concatenate([parts[t][run] for t in members]),
                                  np.ones(3), np.zeros(3), EPS)['y']
            np.testing.assert_allclose(np.concatenate([got[t][run] for t in members]),
                                       expected, rtol=1e-4, atol=1e-4)

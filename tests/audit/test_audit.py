"""``tf1_syncbn.audit_graph`` and ``python -m tf1_syncbn.audit`` on graphs built as users do.

Each graph comes from a harness written as its users write it
(``tests/support/for_audit/audit_cases.py``): classic ``tower_%d`` loops keeping the last
tower's ``UPDATE_OPS``, tf-slim ``model_deploy``'s ``clone_%d`` keeping the
first's, ``tower.call_for_each_tower``, ``MirroredStrategy.run``, tensorpack's
own trainers, and ``tf_slim.nets`` ResNets through ``sync_arg_scope``. The
plain layers (tf-slim's, ``tf.layers``', Keras', tensorpack's own) only run
with legacy Keras: ``tests/support/for_audit/audit_legacy_graphs.py`` builds those graphs in
a subprocess and exports them as ``MetaGraphDef`` files, which are audited
here, as the command line does. Every broken case must be flagged naming
its layer (and only its problems), every correct case must be clean.
"""

import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import audit_cases
import tf_behavior
from legacy_reference import run_reference
import tf1_syncbn
from tf1_syncbn import audit_graph, backends, sync_batch_norm
from tf1_syncbn import audit as audit_module
from tower import TowerContext, average_gradients, call_for_each_tower

tf1 = tf.compat.v1
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
#: The helpers and the scripts the tests start.
SUPPORT = os.path.join(ROOT, 'tests', 'support', 'for_audit')

#: (kind, text every problem of that kind contains).
KINDS = [('per_tower', "normalizes each tower with its own batch's statistics"),
         ('partial', 'but not in'),
         ('group', 'synchronized over a group of'),
         ('not_run', 'do not run when the train op runs'),
         ('double', 'is assigned by update ops of'),
         ('untowered', 'that no tower name tells apart')]

#: What the audit notes for a layer applied to several inputs in one step.
SEVERAL_INPUTS = 'applied to 2 inputs in one step'


def kinds(report):
    """The report's problems as sorted ``(layer, kind)`` pairs; each names its layer first."""
    found = []
    for problem in report.problems:
        layer = problem.split(': ', 1)[0]
        assert layer in {l.name for l in report.layers}, problem
        assert problem in next(l for l in report.layers if l.name == layer).problems
        matched = [kind for kind, text in KINDS if text in problem]
        assert len(matched) == 1, problem
        found.append((layer, matched[0]))
    assert report.ok == (not found)
    return sorted(found)


def layer(report, name):
    return next(l for l in report.layers if l.name == name)


def per_tower(*names):
    return [(n, 'per_tower') for n in names]


def double(*names):
    return sorted((n, 'double') for n in names for _ in ('moving_mean', 'moving_variance'))


SMALL_NET = ('conv1/BatchNorm', 'conv2/BatchNorm')


def _sync(**extra):
    return dict(sync_statistics='collective', **extra)


# --- The library's layers, built in this process. ------------------------------------------


def test_call_for_each_tower_synchronized_with_a_tensor_is_training():
    graph, train_op = audit_cases.tower_contexts(
        sync_batch_norm, towers=4,
        bn_params=lambda: {'is_training': tf1.placeholder(tf.bool, []), 'scale': True})
    report = audit_graph(graph, train_op)
    assert kinds(report) == [] and report.info == []
    assert [l.name for l in report.layers] == list(SMALL_NET)
    for entry in report.layers:
        assert entry.towers == ('tower0', 'tower1', 'tower2', 'tower3')
        assert entry.mode == 'train+infer'            # both tf.cond branches were found
        assert (entry.synchronized, entry.backend, entry.group_size) == (True, 'collective', 4)
        assert entry.collectives_per_step == 8        # forward and backward, 4 towers
        assert entry.updates == 'train_op'
        assert entry.update_ops and all(n.startswith('tower0/') for n in entry.update_ops)
    assert 'conv1/BatchNorm  tower0..tower3' in str(report)
    assert str(report).endswith('OK: no problems found.')


def test_call_for_each_tower_with_per_tower_statistics_is_flagged():
    graph, train_op = audit_cases.tower_contexts(sync_batch_norm,
                                                 bn_params={'sync_statistics': None})
    report = audit_graph(graph, train_op)
    assert kinds(report) == per_tower(*SMALL_NET)
    assert "sync_statistics='auto'" in report.problems[0]       # the fix for this layer
    assert str(report).endswith('FAILED: 2 problems.')


@pytest.mark.parametrize('harness,keep', [(audit_cases.classic_towers, 'last'),
                                          (audit_cases.classic_towers, 'all'),
                                          (audit_cases.model_deploy_clones, 'first')])
def test_name_scope_harnesses_with_the_library_are_clean(harness, keep):
    # Every tower's UPDATE_OPS holds a trigger of tower 0's updates: keeping all
    # of them still updates each moving variable once per step.
    graph, train_op = harness(sync_batch_norm, keep=keep, bn_params=_sync(num_dev=2))
    report = audit_graph(graph, train_op)
    assert kinds(report) == []
    assert all(l.synchronized and l.group_size == 2 for l in report.layers)


def test_name_scope_harness_with_one_tower_unsynchronized_is_flagged():
    def bn(x, **params):
        i = int(tf1.get_default_graph().get_name_scope().split('/')[0][-1])
        return sync_batch_norm(x, **dict(params, sync_statistics='collective' if i == 0
                                         else None))
    graph, train_op = audit_cases.classic_towers(bn, bn_params={'num_dev': 2})
    report = audit_graph(graph, train_op)
    assert kinds(report) == [(n, 'partial') for n in SMALL_NET]
    assert layer(report, 'conv1/BatchNorm').synchronized is None
    assert 'synchronized in tower_0 but not in tower_1' in report.problems[0]


@pytest.mark.parametrize('towers', [1, 4])
def test_one_layer_applied_to_two_inputs_is_a_note_not_a_problem(towers):
    # A Siamese network: one layer, two calls per step, each with its own
    # (global) batch statistics and its own moving-average update.
    build = audit_cases.single_tower if towers == 1 else audit_cases.tower_contexts
    kwargs = {} if towers == 1 else {'towers': towers}
    graph, train_op = build(sync_batch_norm, net=audit_cases.siamese_net, **kwargs)
    report = audit_graph(graph, train_op)
    assert kinds(report) == [], str(report)
    assert [l.name for l in report.layers] == ['bn'], str(report)
    notes = [n for n in report.info if SEVERAL_INPUTS in n]
    assert len(notes) == 1 and 'move 2 times per step' in notes[0], str(report)
    assert 'tf1_syncbn' not in notes[0]          # no fix suggested: nothing is wrong
    if towers > 1:
        entry = layer(report, 'bn')
        assert entry.synchronized and entry.group_size == towers
        assert entry.collectives_per_step == 2 * 2 * towers   # 2 calls, both ways


@pytest.mark.parametrize('scope', [None, 'gpu_%d'])
def test_an_unnamed_device_loop_is_flagged(scope):
    """Towers the layer cannot name (with 'auto' it refuses to build them; with
    sync_statistics=None it builds them): each copy normalizes alone, never clean."""
    with pytest.raises(ValueError, match='used in training by copies on 2 devices'):
        audit_cases.device_loop(sync_batch_norm, scope=scope)
    graph, train_op = audit_cases.device_loop(sync_batch_norm, scope=scope,
                                              bn_params={'sync_statistics': None})
    report = audit_graph(graph, train_op)
    assert kinds(report) == [(n, 'untowered') for n in SMALL_NET], str(report)
    assert {l.sync_summary() for l in report.layers} == {'no (per device)'}
    assert report.info == []
    for problem in report.problems:
        for advice in ('num_dev=<number of towers>', 'tower.register_tower_pattern',
                       'tower.TowerContext'):
            assert advice in problem


def test_updates_left_out_of_the_train_op_are_flagged_and_inside_the_layer_are_not():
    graph, train_op = audit_cases.tower_contexts(sync_batch_norm, wire_updates=False)
    assert kinds(audit_graph(graph, train_op)) == [(n, 'not_run') for n in SMALL_NET]
    graph, train_op = audit_cases.tower_contexts(
        sync_batch_norm, wire_updates=False, bn_params={'updates_collections': None})
    report = audit_graph(graph, train_op)
    assert kinds(report) == []
    assert {l.updates for l in report.layers} == {'in layer'}


def test_a_group_smaller_than_the_towers_is_flagged():
    """4 towers whose TowerContext says total=2: two groups of 2, each main tower updates."""
    graph = tf.Graph()
    with graph.as_default():
        opt = tf1.train.GradientDescentOptimizer(0.1)
        grads = []
        for i in range(4):
            with tf.device('/cpu:%d' % i), TowerContext('tower%d' % i, index=i % 2, total=2), \
                    tf1.variable_scope('', reuse=tf1.AUTO_REUSE):
                y = sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]), scope='bn')
                grads.append(opt.compute_gradients(tf.reduce_sum(y * y)))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train_op = opt.apply_gradients(average_gradients(grads))
    report = audit_graph(graph, train_op)
    assert kinds(report) == sorted([('bn', 'group')] + double('bn'))
    assert 'group of 2' in report.problems[0] and 'built in 4 towers' in report.problems[0]


def test_mirrored_strategy_replicas():
    graph, step = audit_cases.mirrored_strategy(lambda x: sync_batch_norm(x))
    report = audit_graph(graph, step)
    assert kinds(report) == []
    entry = layer(report, 'net/BatchNorm')
    assert entry.towers == ('replica_0', 'replica_1')      # replica 0 has no name scope
    assert (entry.synchronized, entry.group_size, entry.updates) == (True, 2, 'train_op')
    # Each replica's copy of the moving statistics is updated once per step.
    assert len(entry.moving_variables) == 4 and len(entry.update_ops) == 4
    graph, step = audit_cases.mirrored_strategy(lambda x: sync_batch_norm(x,
                                                                          sync_statistics=None))
    assert kinds(audit_graph(graph, step)) == per_tower('net/BatchNorm')


def test_inference_mode_in_a_training_tower_is_a_note_only():
    def bn(x, **params):
        frozen = tf1.get_variable_scope().name.endswith('conv2')
        return sync_batch_norm(x, is_training=not frozen, **params)
    graph, train_op = audit_cases.tower_contexts(bn)
    report = audit_graph(graph, train_op)
    assert report.ok and kinds(report) == []
    assert layer(report, 'conv2/BatchNorm').mode == 'infer'
    assert len(report.info) == 1 and report.info[0].startswith(
        'conv2/BatchNorm: normalizes with its moving statistics (inference mode) in training '
        'towers tower0, tower1')


def test_nccl_layers_report_their_backend(monkeypatch):
    monkeypatch.setattr(backends.base, 'physical_gpu_count', lambda: 2)
    graph = tf.Graph()
    with graph.as_default():
        ys = call_for_each_tower(lambda: sync_batch_norm(
            tf1.placeholder(tf.float32, [None, 3]), scope='bn', sync_statistics='nccl'),
            ['/gpu:0', '/gpu:1'])
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
            tf.add_n([tf.reduce_sum(y * y) for y in ys]))
    report = audit_graph(graph, train_op)
    entry = layer(report, 'bn')
    assert (entry.backend, entry.group_size, entry.collectives_per_step) == ('nccl', 2, 4)
    assert kinds(report) == [('bn', 'not_run')]          # UPDATE_OPS left out on purpose


def test_layer_norm_on_the_fused_kernel_is_not_batch_norm():
    """Keras' LayerNormalization runs FusedBatchNormV3 on a reshape: no moving statistics."""
    def layer_norm(x, **_):
        flat = tf.reshape(x, [1, -1, 1, 8])
        y, _, _ = tf1.nn.fused_batch_norm(flat, tf.ones([tf.shape(flat)[1]]),
                                          tf.zeros([tf.shape(flat)[1]]), is_training=True)
        return tf.reshape(y, tf.shape(x))
    report = audit_graph(*audit_cases.classic_towers(layer_norm))
    assert report.layers == [] and report.ok


@pytest.mark.parametrize('convention', ['gpu%d', 'gpu_%d', 'GPU-%d'])
def test_other_tower_conventions_with_tower_patterns(convention):
    """The advice gives a pattern that matches the scopes seen (before: gpu_<i>'s for all)."""
    graph = tf.Graph()
    with graph.as_default():
        for i in range(2):
            with tf.device('/cpu:%d' % i), tf1.name_scope(convention % i), \
                    tf1.variable_scope('', reuse=i > 0):
                sync_batch_norm(tf1.placeholder(tf.float32, [None, 3]), scope='bn',
                                sync_statistics=None)
    report = audit_graph(graph)
    scopes = (convention % 0, convention % 1)
    assert layer(report, 'bn').towers == ('',)                # no tower it knows,
    assert kinds(report) == [('bn', 'untowered')]           # but the devices tell the copies
    suggested = re.findall(r"tower\.register_tower_pattern\(r'([^']*)'\) for these (.*?) name "
                           r"scopes, and audit with tower_patterns=\[r'([^']*)'\] / "
                           r"--tower-pattern '([^']*)'", report.problems[0])
    assert len(suggested) == 1, report.problems[0]
    pattern, named, *same = suggested[0]
    assert same == [pattern, pattern] and named == ', '.join(scopes)
    assert [int(re.fullmatch(pattern, s).group(1)) for s in scopes] == [0, 1], pattern
    report = audit_graph(graph, tower_patterns=[pattern])
    assert kinds(report) == per_tower('bn')
    assert layer(report, 'bn').towers == scopes


def test_the_per_tower_advice_names_num_dev_and_sync_statistics_where_it_is_none():
    """Before: "Pass sync_statistics='auto' ... instead of None", where the layer may have
    lacked num_dev only (the graph cannot tell): both fixes, num_dev first."""
    graph, train_op = audit_cases.classic_towers(sync_batch_norm,
                                                 bn_params={'sync_statistics': None})
    report = audit_graph(graph, train_op)
    assert kinds(report) == per_tower(*SMALL_NET)
    problem = report.problems[0]
    assert 'instead of None' not in problem, problem
    assert re.search(r"pass num_dev=2 where no tower context gives the number of towers "
                     r"\(tower_<i> / clone_<i> name scopes, or a convention registered with "
                     r"tower\.register_tower_pattern\), and sync_statistics='auto' \(or a "
                     r"backend\) where it is None \(tensorpack's default", problem), problem


def _hand_written_bn(x, moments):
    """A batch norm written by hand around ``moments`` (docs/hand-written.md)."""
    with tf1.variable_scope('bn', reuse=tf1.AUTO_REUSE):
        channels = x.shape[-1]
        moving = [tf1.get_variable(name, [channels], trainable=False, initializer=init)
                  for name, init in (('moving_mean', tf1.zeros_initializer()),
                                     ('moving_variance', tf1.ones_initializer()))]
        statistics = moments(x, [0])
        for variable, value in zip(moving, statistics):
            tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign_sub(
                variable, (variable - value) * 0.1))
        return tf.nn.batch_normalization(x, *statistics, None, None, 1e-3)


@pytest.mark.parametrize('scope,kind,advice', [
    ('tower_%d', 'per_tower', r'pass tf1_syncbn\.moments\(\.\.\., num_dev=2\) where no tower '
                              r"context .*sync_statistics='auto' \(or a backend\) where it is "
                              r'None\.$'),
    (None, 'untowered', r"Pass tf1_syncbn\.moments\(\.\.\., num_dev=<number of towers>\) "
                        r"\(and sync_statistics='auto', its default, where it is None\) and "
                        r'build tower i')])
def test_hand_written_moments_get_the_advice_of_moments(scope, kind, advice):
    """Before, tf1_syncbn.moments' copies were told to use the layers' num_dev."""
    graph = tf.Graph()
    with graph.as_default():
        ys = []
        for i in range(2):
            with tf.device('/cpu:%d' % i), contextlib.ExitStack() as scopes:
                if scope is not None:
                    scopes.enter_context(tf1.name_scope(scope % i))
                scopes.enter_context(tf1.variable_scope('', reuse=i > 0))
                ys.append(_hand_written_bn(
                    tf1.placeholder(tf.float32, [None, 3]),
                    lambda x, axes: tf1_syncbn.moments(x, axes, sync_statistics=None)))
        train_op = tf.group(*ys, *tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
    report = audit_graph(graph, train_op)
    assert ('bn', kind) in kinds(report), str(report)     # (per tower: every tower's updates)
    problem, = [p for p in report.problems if dict(KINDS)[kind] in p]
    assert re.search(advice, problem), problem


def test_without_train_op_the_graphs_train_op_collection_is_used_else_nothing_is_checked():
    graph, _ = audit_cases.tower_contexts(sync_batch_norm, wire_updates=False)
    # TF1 optimizers put their apply op into the train_op collection.
    assert kinds(audit_graph(graph)) == [(n, 'not_run') for n in SMALL_NET]
    graph.clear_collection(tf1.GraphKeys.TRAIN_OP)
    report = audit_graph(graph)
    assert report.ok and {l.updates for l in report.layers} == {'not checked'}
    assert 'Moving-average updates were not checked' in report.info[-1]


def test_errors_name_the_argument_and_the_fix():
    graph, train_op = audit_cases.tower_contexts(sync_batch_norm)
    with pytest.raises(TypeError, match=r'audit_graph: graph must be a tf.Graph, a GraphDef'):
        audit_graph('model.meta')
    with pytest.raises(ValueError, match=r"audit_graph: train_op 'no_such_op' is not an op"):
        audit_graph(graph, 'no_such_op')
    with pytest.raises(ValueError, match=r'belongs to another graph'):
        audit_graph(tf.Graph(), train_op)
    with pytest.raises(TypeError, match=r'audit_graph: train_op must be an op'):
        audit_graph(graph, 3)
    with pytest.raises(ValueError, match=r'tower_patterns entry .* exactly one group'):
        audit_graph(graph, train_op, tower_patterns=['gpu[0-9]+'])


def test_an_imported_meta_graph_audits_as_the_graph_it_came_from(tmp_path):
    graph, train_op = audit_cases.tower_contexts(sync_batch_norm, wire_updates=False)
    expected = str(audit_graph(graph, train_op))
    path = str(tmp_path / 'model.meta')
    names = audit_cases.export(graph, train_op, path)
    imported = tf.Graph()
    with imported.as_default():
        tf1.train.import_meta_graph(path)
    assert str(audit_graph(imported)) == expected          # train op from its collection
    meta = audit_module.read_meta_graph(path)
    before = meta.SerializeToString()
    assert str(audit_module.audit_graph(meta, names)) == expected
    assert meta.SerializeToString() == before              # the audit only reads it


# --- The command line. -----------------------------------------------------------------------


def _export_per_tower_graph(path):
    """A graph whose two layers normalize per tower, exported to ``path``; its train op's name."""
    return audit_cases.export(*audit_cases.tower_contexts(
        sync_batch_norm, bn_params={'sync_statistics': None}), path)[0]


def test_command_exits_one_on_problems_and_zero_on_a_correct_graph(tmp_path, capsys):
    broken = str(tmp_path / 'broken.meta')
    train_op = _export_per_tower_graph(broken)
    assert audit_module.main([broken, '--train-op', train_op]) == 1
    printed = capsys.readouterr().out
    assert 'PROBLEMS (2):\n  - conv1/BatchNorm: built in 2 towers (tower0, tower1)' in printed
    assert printed.rstrip().endswith('FAILED: 2 problems.')
    correct = str(tmp_path / 'correct.meta')
    audit_cases.export(*audit_cases.tower_contexts(sync_batch_norm), correct)
    assert audit_module.main([correct]) == 0          # the train op from its collection
    assert capsys.readouterr().out.rstrip().endswith('OK: no problems found.')
    assert audit_module.main([correct, '--train-op', 'nope']) == 2
    assert "train_op 'nope' is not an op of the graph" in capsys.readouterr().err
    assert audit_module.main([str(tmp_path / 'missing.meta')]) == 2


@pytest.mark.once(reason='the command (python -m tf1_syncbn.audit) starts as its users start '
                         'it, whatever the TF behaviour of the run: the audit of a graph of '
                         'each behaviour is the previous test\'s (the same main())')
def test_python_m_tf1_syncbn_audit_is_the_command(tmp_path):
    broken = str(tmp_path / 'broken.meta')
    train_op = _export_per_tower_graph(broken)
    proc = subprocess.run([sys.executable, '-m', 'tf1_syncbn.audit', broken, '--train-op',
                           train_op], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert 'PROBLEMS (2):\n  - conv1/BatchNorm: built in 2 towers (tower0, tower1)' in proc.stdout
    assert proc.stdout.rstrip().endswith('FAILED: 2 problems.')


# --- Plain layers: tf-slim, tf.layers, Keras, tensorpack (legacy Keras subprocess). ---------

#: case -> expected (layer, kind) problems.
LEGACY = {
    'slim_tower_last': per_tower(*SMALL_NET),
    'slim_tower_all': sorted(per_tower(*SMALL_NET) + double(*SMALL_NET)),
    'slim_tower_is_training_tensor': per_tower(*SMALL_NET),
    'slim_tower_not_fused': per_tower(*SMALL_NET),
    'slim_clone_first': per_tower(*SMALL_NET),
    'slim_device_loop': [(n, 'untowered') for n in SMALL_NET],
    'tf_layers_gpu_scope_loop': [(n, 'untowered') for n in ('conv1/batch_normalization',
                                                           'conv2/batch_normalization')],
    'slim_clone_sync_arg_scope': [],
    'slim_clone_bound_before_sync_arg_scope': per_tower(*SMALL_NET),
    'tf_layers_single_tower': [],
    'tf_layers_mirrored_strategy': per_tower('net/bn'),
    # One layer on two inputs: two updates per step, as on one device (a note);
    # every tower updating them is still flagged.
    'slim_siamese_single_tower': [],
    'slim_siamese_tower_all': sorted(per_tower('bn') + double('bn')),
    'keras_siamese_single_tower': [],
    'keras_single_tower_unwired': [('bn', 'not_run')],
    'keras_single_tower_wired': [],
    'resnet_sync_arg_scope': [],
    'resnet_missed_head': sorted(per_tower('head/BatchNorm') + double('head/BatchNorm')),
    'tensorpack_ps_own_bn': per_tower('bn'),
    'tensorpack_ps_ours': [],
    'tensorpack_replicated_ours': [],
}


# The TF1-behaviour pass: what TF1 behaviour changes in the graphs the audit
# reads, once per library: reference variables (VariableV2 and the Assign ops of
# the moving averages: an update run by every tower, slim_tower_all, and one
# left out of the train op, keras_single_tower_unwired; two updates per step of
# one layer, keras_siamese_single_tower; tensorpack's own layer and ours with
# its updates in the layer and the replicated trainer's tower copies; the
# replica variables of tf.distribute, tf_layers_mirrored_strategy), slim's
# non-fused updates (slim_tower_not_fused) and a v1 tf.cond (Switch/Merge,
# slim_tower_is_training_tensor). The other cases differ by how towers are
# named, scoped and placed and how the layer was chosen (arg scopes, nets),
# which TF1 behaviour does not change.
LEGACY_V1 = ['slim_tower_all', 'slim_tower_is_training_tensor', 'slim_tower_not_fused',
             'keras_single_tower_unwired', 'keras_siamese_single_tower',
             'tf_layers_mirrored_strategy', 'tensorpack_ps_own_bn', 'tensorpack_replicated_ours']
LEGACY_CASES = tf_behavior.pick(sorted(LEGACY), LEGACY_V1)


@pytest.fixture(scope='module')
def legacy_graphs(tmp_path_factory):
    """``{case: (MetaGraphDef, train op names)}`` from one legacy-Keras subprocess."""
    out = tmp_path_factory.mktemp('audit_legacy_graphs')
    with open(os.path.join(SUPPORT, 'audit_legacy_graphs.py')) as f:
        run_reference(f.read(), out, args=[str(out)] + LEGACY_CASES, timeout=300)
    with open(out / 'cases.json') as f:
        cases = json.load(f)
    return {name: (out / ('%s.meta' % name), value) for name, value in cases.items()}


@pytest.mark.parametrize('case', LEGACY_CASES)
def test_plain_and_converted_layers_in_their_harnesses(legacy_graphs, case):
    path, step = legacy_graphs[case]
    if isinstance(step, dict):
        pytest.fail('building %s failed:\n%s' % (case, step['error']))
    report = audit_graph(audit_module.read_meta_graph(str(path)), step)
    assert kinds(report) == LEGACY[case], str(report)
    names = [l.name for l in report.layers]
    if 'siamese' in case:
        assert names == ['bn'], str(report)
        notes = [n for n in report.info if SEVERAL_INPUTS in n]
        assert len(notes) == ('tower_all' not in case), str(report)
    elif case.startswith('resnet'):
        assert len(names) == 9 + case.endswith('head')
        synced = [l for l in report.layers if l.synchronized]
        assert len(synced) == 9 and {l.group_size for l in synced} == {2}
    elif case.startswith('tensorpack'):
        assert names == ['bn'] and layer(report, 'bn').towers == ('tower0', 'tower1')
        assert layer(report, 'bn').updates == ('in layer' if case.endswith('ours')
                                               else 'train_op')
    elif case.endswith('loop'):
        assert all(l.towers == ('',) and l.sync_summary() == 'no (per device)'
                   for l in report.layers), str(report)
        assert report.info == [], str(report)
    elif case.startswith('slim'):
        assert names == list(SMALL_NET)
        assert layer(report, 'conv1/BatchNorm').towers == (
            ('clone_0', 'clone_1') if 'clone' in case else ('tower_0', 'tower_1'))
        if 'tensor' in case:
            assert {l.mode for l in report.layers} == {'train+infer'}   # tf.cond branches
    elif case == 'tf_layers_single_tower':
        assert names == ['conv1/batch_normalization', 'conv2/batch_normalization']
    elif case == 'tf_layers_mirrored_strategy':
        assert layer(report, 'net/bn').towers == ('replica_0', 'replica_1')
        assert layer(report, 'net/bn').updates == 'train_op'


def test_an_imported_plain_graph_audits_as_its_meta_graph(legacy_graphs):
    path, step = legacy_graphs['slim_tower_all']
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(str(path))
    assert str(audit_graph(graph, step)) == str(
        audit_graph(audit_module.read_meta_graph(str(path)), step))


# --- The documentation's examples. ------------------------------------------------------------


def _page(name):
    with open(os.path.join(ROOT, 'docs', name), encoding='utf-8') as f:
        return f.read()


def _quick_start_graph(edit=lambda code: code):
    """docs/slim.md's quick start up to its session (``edit`` edits its code), and its train op."""
    blocks = re.findall(r'^```python\n(.*?)^```', _page('slim.md'), re.S | re.M)
    code = next(b for b in blocks if 'call_for_each_tower(tower_fn, devices)' in b)
    code = edit(code.split('with tf1.Session', 1)[0])
    namespace = {}
    graph = tf.Graph()
    with graph.as_default():
        exec(compile(code, 'docs/slim.md (quick start)', 'exec'), namespace)   # noqa: S102
    return graph, namespace['train_op']


def _broken(code):
    """Per-tower statistics, and the train op without the update ops."""
    params = "normalizer_params={'decay': 0.9, 'scale': True}"
    wired = ('with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):\n'
             '    train_op = opt.apply_gradients(grads)')
    assert params in code and wired in code, 'the Quick start changed: update this test'
    return code.replace(params, params[:-1] + ", 'sync_statistics': None}").replace(
        wired, 'train_op = opt.apply_gradients(grads)')


def test_the_docs_show_what_the_audit_prints_for_the_quick_start():
    correct, broken = re.findall(r'^```text\n(.*?)^```', _page('audit.md'), re.S | re.M)
    if tf_behavior.is_v1():
        # The page shows TF2 behaviour's update ops; reference variables are
        # assigned by one AssignSub op named AssignMovingAvg.
        broken = broken.replace('/AssignSubVariableOp', '')
    assert str(audit_graph(*_quick_start_graph())) == correct.rstrip('\n')
    assert str(audit_graph(*_quick_start_graph(_broken))) == broken.rstrip('\n')


# --- The demo prints the audit of its training graphs. -------------------------------------


def test_the_demo_prints_the_audit_of_both_training_graphs(capsys):
    sys.path.insert(0, os.path.join(ROOT, 'examples'))
    try:
        import train_multitower as demo
    finally:
        sys.path.pop(0)
    from tf1_syncbn.distributed import setup_cluster
    args = demo.parse_args(['--towers', '2'])
    cluster = setup_cluster(towers=2)
    layers = ['conv1/BatchNorm', 'conv2/BatchNorm', 'conv3/BatchNorm', 'fc1/BatchNorm']
    for name, spec in (('sync', demo.sync_spec('auto', cluster)), ('per_tower', None)):
        net = demo.build_training_graph(args, spec, cluster)
        report = demo.print_audit(name, net)
        printed = capsys.readouterr().out
        assert printed.startswith(name + ': batch-norm audit')
        assert [l.name for l in report.layers] == layers
        # The held-out path (name scope eval/, moving statistics) is found as inference.
        assert {l.towers_summary() for l in report.layers} == {
            'tower0, tower1; infer: (no tower)'}
        assert kinds(report) == ([] if name == 'sync' else per_tower(*layers))
        if name == 'sync':
            assert str(report) in printed
            continue
        # The comparison run normalizes per tower on purpose: the table shows it, and the
        # verdict says it is intended, not FAILED (before: "FAILED: 4 problems.").
        table = str(report).split('\nPROBLEMS')[0]
        assert table in printed and 'no (per tower)' in table
        assert printed.endswith('per-tower run: 4 layers unsynchronized, as intended for the '
                                'comparison; nothing else found.\n'), printed
        assert 'FAILED' not in printed and 'PROBLEMS' not in printed
        # A real problem of that run still fails: here its updates do not run with the
        # step's op (the loss), which the audit finds for each layer.
        broken = demo.print_audit(name, dict(net, train_op=net['loss']))
        printed = capsys.readouterr().out
        assert sorted(kinds(broken)) == sorted(per_tower(*layers) + [
            (l, 'not_run') for l in layers])
        not_run = [p for p in broken.problems if 'do not run when the train op runs' in p]
        assert 'PROBLEMS (4):\n' in printed and all(p in printed for p in not_run)
        assert printed.endswith('per-tower run: 4 layers unsynchronized, as intended for the '
                                'comparison.\nFAILED: 4 problems.\n'), printed


def test_the_selftest_audits_its_graph_and_fails_on_a_problem(monkeypatch, capsys):
    from tf1_syncbn import selftest
    assert selftest.main(['--towers', '2', '--backend', 'collective', '--device', 'cpu',
                          '--steps', '1']) == 0
    printed = capsys.readouterr().out
    assert ('graph audit (collective):\nBatch-norm audit: 1 layer in towers tower0, tower1'
            in printed)
    assert 'bn     tower0, tower1  train  collective (group 2)' in printed
    # A self-test whose layer would normalize per tower fails on the audit, naming the layer.
    monkeypatch.setattr(selftest, 'sync_batch_norm', lambda x, **params: sync_batch_norm(
        x, **dict(params, sync_statistics=None)))
    result = selftest.run_check('collective', towers=2, steps=1, device='cpu')
    assert result.status == 'FAIL' and kinds(result.audit) == per_tower('bn')
    assert result.message.startswith('the graph audit found problems: bn: built in 2 towers')

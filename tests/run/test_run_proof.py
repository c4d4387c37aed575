"""The runner's parts, in this process: what counts as a training step, the report, the switches.

* ``is_training_step``: an optimizer's step (``minimize``, a ``tf.group`` around it, an update
  written by hand from ``tf.gradients``) is one; initializers, evaluations and assignments
  that no gradient reaches (a restore, a broadcast) are not.
* ``fetched_ops``: what ``Session.run`` fetches, ``MonitoredSession``'s dicts keyed by hook
  objects included.
* The report: one row per group of equal layers, so that a ResNet fits one screen; the
  problems first shown, all of them in the JSON; ``{worker}`` and per-worker file names.
* The switches: the runner's ``patch_tf_layers`` and ``patch_slim`` step aside for the
  script's own and come back; ``--num-dev`` reaches tensorpack only where its layer takes
  ``num_dev``, and says so where it cannot.
"""

import inspect
import json
import sys
import types

import pytest
import tensorflow as tf

import tf1_syncbn
from tf1_syncbn._frontend.patching import yielding
from tf1_syncbn.audit.report import AuditReport, LayerAudit
from tf1_syncbn.run import proof, report, startup, switches

tf1 = tf.compat.v1


def test_what_is_a_training_step(graph):
    w = tf1.get_variable('w', initializer=tf.ones([3]))
    v = tf1.get_variable('v', initializer=tf.ones([3]), trainable=False)
    loss = tf.reduce_sum(tf.square(w * v))
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    by_hand = tf1.assign_sub(w, 0.1 * tf.gradients(loss, w)[0])
    restore = tf1.assign(w, tf.zeros([3]))
    stats = tf1.assign(v, tf.ones([3]) * tf.reduce_mean(tf.gradients(loss, w)[0]))
    grouped = tf.group(train_op, tf1.assign_add(v, tf.ones([3])))
    steps = {'minimize': train_op, 'by hand': by_hand, 'grouped': grouped}
    others = {'init': tf1.global_variables_initializer(), 'loss': loss, 'restore': restore,
              'non-trainable from a gradient': stats}
    for name, fetch in list(steps.items()) + list(others.items()):
        assert proof.is_training_step(graph, proof.fetched_ops(graph, [fetch])) == \
            (name in steps), name


def test_fetched_ops_reads_monitored_sessions_dicts(graph):
    x = tf1.placeholder(tf.float32, name='x')
    y = tf.identity(x, name='y')
    sparse = tf.SparseTensor([[0]], tf.reshape(x, [1]), [2])

    class Hook(object):         # not sortable: tf.nest would refuse the dict
        pass

    fetches = {'caller': y.op, Hook(): [x, None, 'y:0'], Hook(): {'s': sparse, 'n': 'y'}}
    names = [op.name for op in proof.fetched_ops(graph, fetches)]
    assert names[:2] == ['y', 'x'] and 'SparseTensor/indices' in names
    assert proof.fetched_ops(graph, ['no_such_op:0', object()]) == []


def _layer(i, synchronized=True, towers=('tower0', 'tower1')):
    return LayerAudit('block%d/bn' % i, towers=towers, training_towers=towers, mode='train',
                      computation='tf1_syncbn', synchronized=synchronized,
                      backend='collective' if synchronized else None,
                      group_size=2 if synchronized else None, collectives_per_step=4,
                      updates='train_op')


def test_the_report_groups_layers_and_shows_the_first_problems():
    layers = [_layer(i) for i in range(50)] + [_layer(50 + i, False) for i in range(12)]
    problems = ['block%d/bn: per tower' % (50 + i) for i in range(12)]
    audit = AuditReport(layers, problems, [], ['train'], ('tower0', 'tower1'))
    graph_proof = report.GraphProof(1, ['train'], audit)
    switched = [report.Switch('tf.layers', 'switched', {'sync_statistics': 'auto',
                                                        'num_dev': 2}),
                report.Switch('tensorpack')]
    text = report.text(graph_proof, switched, strict=True)
    lines = text.splitlines()
    assert len(lines) < 25, text
    assert "switched: tf.layers (sync_statistics='auto', num_dev=2); not loaded: tensorpack" \
        in lines[1]
    assert any(line.startswith('  50 layers: block0/bn, block1/bn, block2/bn, ...')
               for line in lines)
    assert '... and 4 more (all of them: --report PATH)' in text
    assert lines[-1] == ('tf1_syncbn.run --strict: 12 problems: stopped before the first '
                         'training step (exit status %d).' % startup.STRICT_EXIT_STATUS)
    options = startup.parse_environment('--strict')
    document = json.loads(json.dumps(report.payload([graph_proof], switched, options)))
    assert len(document['graphs'][0]['audit']['problems']) == 12
    assert len(document['graphs'][0]['audit']['layers']) == 62


def test_each_worker_writes_its_own_report():
    config = json.dumps({'cluster': {'worker': ['a:1', 'b:2']},
                         'task': {'type': 'worker', 'index': 1}})
    assert report.report_path('/r/audit.json', {'TF_CONFIG': config}) == \
        '/r/audit.worker1.json'
    assert report.report_path('/r/{worker}/audit.json', {'TF_CONFIG': config}) == \
        '/r/1/audit.json'
    assert report.report_path('/r/audit.json', {}) == '/r/audit.json'
    chief = json.dumps({'cluster': {'chief': ['a:1'], 'worker': ['b:2']},
                        'task': {'type': 'worker', 'index': 0}})
    assert report.report_path('a.json', {'TF_CONFIG': chief}) == 'a.worker1.json'


def _slim():
    import tf_slim  # noqa: PLC0415
    return tf_slim


#: A patch of each kind the runner switches in this process, and the name it replaces.
SWITCHES = {
    'tf_layers': (lambda: tf1_syncbn.patch_tf_layers, lambda: tf1.layers.batch_normalization),
    'slim': (lambda: tf1_syncbn.patch_slim, lambda: _slim().batch_norm),
}


@pytest.mark.once
@pytest.mark.parametrize('kind', sorted(SWITCHES))
def test_the_runners_switch_steps_aside_for_the_scripts_own_patch(kind):
    patch, name = SWITCHES[kind]
    try:
        original = name()
    except AttributeError:      # tf.compat.v1.layers' batch norm with Keras 3: none
        original = None
    user = types.ModuleType('user_module')
    sys.modules[user.__name__] = user
    with yielding():
        runner = patch()()
    try:
        switched = name()
        user.bn = switched          # `from ... import batch_norm` while the runner's is active
        own = patch()(num_dev=4)    # a script that patches itself
        assert runner.waiting and own.active
        assert name() is not switched and name() is not original and original is not switched
        assert user.bn is name()    # the script's patch, num_dev=4, where the user imported
        own.restore()
        assert runner.active and name() is switched is user.bn
    finally:
        runner.restore()
        del sys.modules[user.__name__]
    if original is not None:
        assert name() is original


@pytest.mark.once
def test_num_dev_reaches_tensorpack_only_where_its_layer_takes_it():
    options = startup.parse_environment('--num-dev 4')

    def patch(sync_statistics=None, **defaults):
        pass

    def layer(name, inputs, sync_statistics=None, group_size=None, **legacy_kwargs):
        pass

    def layer_with_num_dev(name, inputs, sync_statistics=None, num_dev=None):
        pass

    with pytest.raises(ValueError, match='--num-dev cannot reach tensorpack\'s BatchNorm'):
        switches.tensorpack_defaults(options, patch=patch, layer=layer)
    assert switches.tensorpack_defaults(options, patch=patch, layer=layer_with_num_dev) == {
        'sync_statistics': 'auto', 'num_dev': 4}
    assert switches.tensorpack_defaults(startup.parse_environment('--backend none'), patch=patch,
                                        layer=layer) == {'sync_statistics': None}
    # This tree's tf1_syncbn.BatchNorm: num_dev passed if it takes it, refused otherwise.
    takes = 'num_dev' in inspect.signature(tf1_syncbn.BatchNorm).parameters
    try:
        assert switches.tensorpack_defaults(options)['num_dev'] == 4 and takes
    except ValueError:
        assert not takes

"""Exporting an inference graph (frozen GraphDef, SavedModel) from a training graph.

Two processes, as a user runs them: this file as a script with ``build DIR``
trains a few steps of each case below (in the TF behaviour of the run), and
exports tower 0's output with :mod:`tf1_syncbn.export`, as a frozen
``GraphDef`` and as a SavedModel; it also freezes a one-device graph with a
tensor ``is_training`` with TensorFlow's own ``convert_variables_to_constants``
(which failed before: ``Return readvariableop_3 -> ReadVariableOp_3:value:0
is not found``, a ``tf.cond`` branch returned a variable read). Then ``load
DIR`` runs every exported graph in a TF2 process that never imports the
library: the SavedModels through ``tf.saved_model.load`` and their
``serving_default`` signature, the frozen graphs through ``tf.import_graph_def``.

Before, a multi-tower graph frozen by TensorFlow kept ``SyncBnStepWatchdog``,
``PyFunc`` and ``CollectiveReduce`` ops even on the inference outputs, and
there was no exporter. The references are the training graph's own inference
outputs: tower 0 with ``is_training`` fed False where it is a tensor, and an
``is_training=False`` copy of the model (the variables reused) where it is a
Python bool.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

if __name__ != '__main__':
    from tf_behavior import pick
else:   # the script's processes (the serving one has no tests/support) run no test
    def pick(cases, v1_cases):
        del v1_cases
        return cases

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
#: The helpers and the scripts the tests start.
SUPPORT = os.path.join(ROOT, 'tests', 'support')
TIMEOUT_S = 300
FORBIDDEN = ('SyncBn', 'Collective', 'Nccl', 'Horovod', 'PyFunc', 'EagerPyFunc')


def _model(case, x, training):
    """The layers of ``case`` on ``x`` (every front-end, fused=False, renorm, NCHW, rank 2)."""
    import tensorflow as tf
    import tf_slim as slim

    import tf1_syncbn
    sync = 'auto'
    if case == 'slim':
        net = slim.conv2d(x, 6, [3, 3], normalizer_fn=tf1_syncbn.sync_batch_norm,
                          normalizer_params={'is_training': training, 'sync_statistics': sync,
                                             'scale': True}, scope='conv')
        net = tf1_syncbn.sync_batch_norm(net, is_training=training, renorm=True,
                                         sync_statistics=sync, scope='renorm')
        return tf.reduce_mean(net, [1, 2])
    if case == 'tensorpack':
        net = tf1_syncbn.BatchNorm('bn', x, training=training, sync_statistics=sync)
        net = tf.transpose(slim.conv2d(net, 6, [3, 3], scope='conv'), [0, 3, 1, 2])
        net = tf1_syncbn.BatchNorm('bn_nchw', net, training=training, sync_statistics=sync,
                                   data_format='channels_first')
        net = tf1_syncbn.BatchRenorm('brn', tf.reduce_mean(net, [2, 3]), 3.0, 5.0,
                                     training=training, sync_statistics=sync)
        return net
    assert case == 'layers'
    flat = slim.fully_connected(slim.flatten(x), 7, activation_fn=None, scope='dense')
    net = tf1_syncbn.layers.batch_normalization(flat, training=training, fused=False,
                                                momentum=0.9, name='bn_unfused',
                                                sync_statistics=sync)
    return tf1_syncbn.layers.batch_normalization(net, training=training, renorm=True,
                                                 momentum=0.9, name='bn_renorm',
                                                 sync_statistics=sync)


#: case -> (towers, is_training: 'tensor' or 'python')
CASES = {'slim': (4, 'tensor'), 'tensorpack': (2, 'python'), 'layers': (3, 'tensor')}


def _data(seed, batch):
    return (np.random.RandomState(seed).randn(batch, 5, 5, 3) * 2 + 3).astype(np.float32)


def _training_graph(case, towers, kind):
    """In the default graph: ``case``'s model on ``towers`` towers, an SGD step, an eval copy.

    ``kind``: ``'tensor'`` (a bool placeholder ``is_training``) or
    ``'python'`` (True). Returns ``(images, parts, is_training, outs, train,
    eval_x, eval_y)``: the full batch ``'images'`` and its split ``'parts'``,
    each tower's output, the train op (after the update ops), and the model
    applied in inference mode to ``eval_x`` with the same variables.
    """
    import tensorflow as tf

    from tower import call_for_each_tower, get_current_tower_context
    tf1 = tf.compat.v1
    images = tf1.placeholder(tf.float32, [2 * towers, 5, 5, 3], name='images')
    parts = tf.split(images, towers, name='parts')
    is_training = tf1.placeholder(tf.bool, [], name='is_training') \
        if kind == 'tensor' else True

    def tower():
        return _model(case, parts[get_current_tower_context().index], is_training)

    outs = call_for_each_tower(tower, ['/cpu:%d' % i for i in range(towers)])
    loss = tf.add_n([tf.reduce_sum(tf.square(o - 1.0)) for o in outs])
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train = tf1.train.GradientDescentOptimizer(0.01).minimize(loss)
    with tf1.variable_scope(tf1.get_variable_scope(), reuse=True), tf1.name_scope('eval'):
        eval_x = tf1.placeholder(tf.float32, [None, 5, 5, 3])
        eval_y = _model(case, eval_x, False)
    return images, parts, is_training, outs, train, eval_x, eval_y


def _export_case(case, directory):
    """Trains ``case`` on its towers, exports tower 0; returns the test input and reference."""
    import tensorflow as tf

    import tf1_syncbn
    from tower import virtual_cpu_config
    tf1 = tf.compat.v1
    towers, kind = CASES[case]
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        images, parts, is_training, outs, train, eval_x, eval_y = _training_graph(
            case, towers, kind)
        feed = {is_training: True} if kind == 'tensor' else {}
        constants = {is_training: False} if kind == 'tensor' else None
        with tf1.Session(config=virtual_cpu_config(towers)) as sess:
            sess.run(tf1.global_variables_initializer())
            for step in range(3):
                sess.run(train, {images: _data(step, 2 * towers), **feed})
            x = _data(100, 2 * towers)
            reference = sess.run(eval_y, {eval_x: x[:2]})
            if kind == 'tensor':   # the training graph itself, in inference mode
                tower0 = sess.run(outs[0], {images: x, is_training: False})
                np.testing.assert_allclose(tower0, reference, rtol=1e-5, atol=1e-5)
            graph_def = tf1_syncbn.export.inference_graph_def(
                sess, {'images': parts[0]}, {'output': outs[0]}, constants)
            tf1_syncbn.export.export_saved_model(
                sess, os.path.join(directory, case + '_saved_model'), {'images': parts[0]},
                {'output': outs[0]}, constants)
    with open(os.path.join(directory, case + '.pb'), 'wb') as f:
        f.write(graph_def.SerializeToString())
    return x[:2], reference


def _freeze_with_tensorflow(directory):
    """A one-device graph, tensor is_training, frozen by TensorFlow alone."""
    import tensorflow as tf

    import tf1_syncbn
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 5, 5, 3], name='x')
        is_training = tf1.placeholder(tf.bool, [], name='is_training')
        y = tf.identity(tf1_syncbn.sync_batch_norm(x, is_training=is_training, scale=True),
                        name='y')
        updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for step in range(2):
                sess.run([y, updates], {x: _data(step, 4), is_training: True})
            frozen = tf1.graph_util.convert_variables_to_constants(
                sess, graph.as_graph_def(), ['y'])
            data = _data(7, 4)
            # The training mode's output does not depend on the (updated) moving statistics.
            reference = {str(mode): sess.run(y, {x: data, is_training: mode}).tolist()
                         for mode in (False, True)}
    with open(os.path.join(directory, 'frozen_by_tensorflow.pb'), 'wb') as f:
        f.write(frozen.SerializeToString())
    return data, reference


def build(directory, apply_behavior=True):
    """Trains and exports every case into ``directory``; ``apply_behavior``: in a new process."""
    if apply_behavior:
        import tf_behavior
        tf_behavior.apply()
    expected = {}
    for case in sorted(CASES):
        x, reference = _export_case(case, directory)
        expected[case] = {'x': x.tolist(), 'y': reference.tolist()}
    x, reference = _freeze_with_tensorflow(directory)
    expected['frozen_by_tensorflow'] = {'x': x.tolist(), 'y': reference}
    with open(os.path.join(directory, 'expected.json'), 'w') as f:
        json.dump(expected, f)


def load(directory):
    """A TF2 process without the library runs every exported graph."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    with open(os.path.join(directory, 'expected.json')) as f:
        expected = json.load(f)
    results = {}

    def read_graph(name):
        graph_def = tf1.GraphDef()
        with open(os.path.join(directory, name + '.pb'), 'rb') as f:
            graph_def.ParseFromString(f.read())
        nodes = list(graph_def.node) + [n for f in graph_def.library.function
                                        for n in f.node_def]
        return graph_def, sorted({n.op for n in nodes})

    for case in sorted(CASES):
        x = np.array(expected[case]['x'], np.float32)
        graph_def, types = read_graph(case)
        with tf.Graph().as_default() as graph:
            tf.import_graph_def(graph_def, name='')
            with tf1.Session(graph=graph) as sess:
                frozen = sess.run('output:0', {'images:0': x})
        served = tf.saved_model.load(os.path.join(directory, case + '_saved_model'))
        out = served.signatures['serving_default'](images=tf.constant(x))
        results[case] = {'frozen': frozen.tolist(), 'served': out['output'].numpy().tolist(),
                         'types': types}
    graph_def, types = read_graph('frozen_by_tensorflow')
    x = np.array(expected['frozen_by_tensorflow']['x'], np.float32)
    with tf.Graph().as_default() as graph:
        tf.import_graph_def(graph_def, name='')
        with tf1.Session(graph=graph) as sess:
            results['frozen_by_tensorflow'] = {
                'y': {str(mode): sess.run('y:0', {'x:0': x, 'is_training:0': mode}).tolist()
                      for mode in (False, True)}, 'types': types}
    results['library_imported'] = any(m.startswith('tf1_syncbn') for m in sys.modules)
    return results


def _run(mode, directory, env=None):
    run = subprocess.run([sys.executable, os.path.abspath(__file__), mode, directory],
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', **(env or {})),
                         cwd=directory, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, '%s failed:\n%s' % (mode, run.stderr[-5000:])
    return run.stdout


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp('export'))
    # The training side in this process (in the run's TF behaviour, as the
    # script's ``build DIR`` would in a process of its own, one TensorFlow
    # import less); the serving side in its own process, without the library.
    build(directory, apply_behavior=False)
    # The serving process: no tf1_syncbn on its path, TF2 as installed.
    results = json.loads(_run('load', directory, {'PYTHONPATH': ''}).strip().splitlines()[-1])
    with open(os.path.join(directory, 'expected.json')) as f:
        return results, json.load(f)


def test_the_serving_process_never_imports_the_library(exported):
    assert exported[0]['library_imported'] is False


@pytest.mark.parametrize('case', sorted(CASES))
def test_exported_graphs_hold_plain_ops_and_equal_the_inference_outputs(exported, case):
    results, expected = exported
    got = results[case]
    assert not [t for t in got['types'] if t.startswith(FORBIDDEN)], got['types']
    assert 'FusedBatchNormV3' in got['types']
    assert not {'If', 'StatelessIf', 'Switch', 'Merge'} & set(got['types']), got['types']
    for kind in ('frozen', 'served'):
        np.testing.assert_allclose(got[kind], expected[case]['y'], rtol=1e-5, atol=1e-5,
                                   err_msg=kind)


def test_a_tensor_is_training_graph_frozen_by_tensorflow_runs_without_the_library(exported):
    results, expected = exported
    got = results['frozen_by_tensorflow']
    assert not [t for t in got['types'] if t.startswith(FORBIDDEN)], got['types']
    for mode in ('False', 'True'):
        np.testing.assert_allclose(got['y'][mode], expected['frozen_by_tensorflow']['y'][mode],
                                   rtol=1e-5, atol=1e-5, err_msg='is_training=%s' % mode)


# --- What the exporter refuses, and how it says so (in this process). ----------------------


def _one_layer_graph(graph, in_cond=False):
    import tensorflow as tf

    import tf1_syncbn
    tf1 = tf.compat.v1
    x = tf1.placeholder(tf.float32, [None, 3], name='x')
    is_training = tf1.placeholder(tf.bool, [], name='is_training')
    if in_cond:
        def slow_identity():   # x, after a while: an ungated replacement would arrive first
            big = tf.tile(tf.reshape(x[0, 0], [1, 1]), [600, 600])
            return x + 0.0 * tf.reduce_sum(tf.matmul(big, big))

        y = tf.cond(is_training, lambda: tf1_syncbn.sync_batch_norm(x, is_training=True),
                    slow_identity)
    else:
        y = tf1_syncbn.sync_batch_norm(x, is_training=is_training)
        # A user's op on is_training (as dropout would be): the export needs its value.
        y = tf.where(is_training, y * 2.0, y)
    return x, is_training, y


def test_a_placeholder_the_outputs_need_must_be_an_input_or_a_constant(graph):
    import tensorflow as tf

    from tf1_syncbn import export
    x, is_training, y = _one_layer_graph(graph)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(ValueError, match=r"need the training graph's placeholders "
                                             r"'is_training', .*constants \(for example "
                                             r'constants=\{is_training: False'):
            export.inference_graph_def(sess, {'x': x}, {'y': y})
        graph_def = export.inference_graph_def(sess, {'x': x}, {'y': y}, {is_training: False})
    assert 'FusedBatchNormV3' in {node.op for node in graph_def.node}
    for bad, match in (({'x': x}, 'both in inputs and outputs'),
                       ({'model': x}, "not a usable op name"),
                       ({'x': 'nothing:0'}, "names 'nothing:0', which is no tensor")):
        with tf.compat.v1.Session() as sess, pytest.raises(ValueError, match=match):
            export.inference_graph_def(sess, bad, {'x': y})


def test_a_layer_inside_a_cond_function_body_is_named_not_exported_in_training_mode(graph):
    """Control flow v2 builds the layer in a function, which the exporter cannot rewire."""
    import tensorflow as tf

    import tf_behavior
    from tf1_syncbn import export
    x, is_training, y = _one_layer_graph(graph, in_cond=True)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        if tf_behavior.is_v1():
            # Switch/Merge: the layer is in the graph and replaced; its inference op
            # runs only when its branch is taken (moving statistics 0 and 1 here).
            data = np.arange(6, dtype=np.float32).reshape(2, 3)
            for taken, expected in ((True, data / np.sqrt(1.0 + 1e-3)), (False, data)):
                graph_def = export.inference_graph_def(sess, {'x': x}, {'y': y},
                                                       {is_training: taken})
                assert 'FusedBatchNormV3' in {node.op for node in graph_def.node}
                with tf.Graph().as_default() as served:
                    tf.import_graph_def(graph_def, name='')
                    with tf.compat.v1.Session(graph=served) as serving:
                        np.testing.assert_allclose(serving.run('y:0', {'x:0': data}), expected,
                                                   rtol=1e-6, err_msg=str(taken))
            return
        with pytest.raises(ValueError, match=r'layers built inside a tf.cond or tf.while_loop '
                                             r'function body.*sync_batch_norm\(BatchNorm\)'):
            export.inference_graph_def(sess, {'x': x}, {'y': y}, {is_training: True})



# --- Placement and scoped imports (in this process). ----------------------------------------


def _served_by_one_cpu(graph_def, export_dir, feed):
    """``logits`` served from the GraphDef and the SavedModel by sessions with ONE CPU device.

    No soft placement: a node pinned to another device (in a function body
    too) fails, as on a serving machine without the training machine's GPUs.
    """
    import tensorflow as tf
    tf1 = tf.compat.v1
    one_cpu = tf1.ConfigProto(device_count={'CPU': 1}, allow_soft_placement=False)
    with tf.Graph().as_default() as served:
        tf.import_graph_def(graph_def, name='')
        with tf1.Session(graph=served, config=one_cpu) as sess:
            frozen = sess.run('logits:0', {'images:0': feed})
    with tf.Graph().as_default() as served, tf1.Session(graph=served, config=one_cpu) as sess:
        meta_graph = tf1.saved_model.load(sess, ['serve'], export_dir)
        signature = meta_graph.signature_def['serving_default']
        saved = sess.run(signature.outputs['logits'].name,
                         {signature.inputs['images'].name: feed})
    return frozen, saved, meta_graph.graph_def


def slim_dropout_towers(devices):
    """In the default graph: 2 towers of slim conv, ``sync_batch_norm``, dropout and fc.

    Returns ``(x, is_training, parts, logits)``: the full batch ``'x'`` of
    shape [4, 6, 6, 3], ``'is_training'`` (a ``placeholder_with_default``,
    True) that both the layer and dropout read, ``x``'s split over the
    towers, and each tower's logits. ``devices``: the towers' two devices.
    """
    import tensorflow as tf
    import tf_slim as slim

    import tf1_syncbn
    from tower import call_for_each_tower, get_current_tower_context
    tf1 = tf.compat.v1
    x = tf1.placeholder(tf.float32, [4, 6, 6, 3], name='x')
    is_training = tf1.placeholder_with_default(True, [], name='is_training')
    parts = tf.split(x, 2)

    def tower():
        net = slim.conv2d(parts[get_current_tower_context().index], 8, [3, 3],
                          normalizer_fn=tf1_syncbn.sync_batch_norm,
                          normalizer_params={'is_training': is_training,
                                             'sync_statistics': 'auto'}, scope='conv')
        net = slim.dropout(net, 0.5, is_training=is_training, scope='drop')
        return slim.fully_connected(tf.reduce_mean(net, [1, 2]), 5, activation_fn=None,
                                    scope='fc')

    return x, is_training, parts, call_for_each_tower(tower, devices)


def test_exported_graphs_hold_no_device_even_in_function_bodies(graph, tmp_path):
    """Tower 0 on '/cpu:1' (a training machine's GPU), served where only CPU:0 exists.

    In TF2 behaviour the tensor is_training makes the layer's and dropout's
    tf.cond ``If`` ops whose branch functions kept '/device:CPU:1' (a plain
    session refused them: 'was explicitly assigned to /device:CPU:1 but
    available devices are [ ... CPU:0 ]').
    """
    import tensorflow as tf

    import tf1_syncbn
    import tf_behavior
    from tower import virtual_cpu_config
    tf1 = tf.compat.v1
    x, is_training, parts, logits = slim_dropout_towers(['/cpu:1', '/cpu:2'])
    data = np.random.RandomState(3).rand(4, 6, 6, 3).astype(np.float32)
    export_dir = str(tmp_path / 'serving' / '1')
    with tf1.Session(config=virtual_cpu_config(3)) as sess:
        sess.run(tf1.global_variables_initializer())
        expected = sess.run(logits[0], {x: data, is_training: False})
        args = ({'images': parts[0]}, {'logits': logits[0]}, {is_training: False})
        graph_def = tf1_syncbn.export.inference_graph_def(sess, *args)
        tf1_syncbn.export.export_saved_model(sess, export_dir, *args)
    frozen, saved, saved_graph_def = _served_by_one_cpu(graph_def, export_dir, data[:2])
    np.testing.assert_allclose(frozen, expected[:2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(saved, expected[:2], rtol=1e-5, atol=1e-5)
    for where, exported in (('GraphDef', graph_def), ('SavedModel', saved_graph_def)):
        bodies = [n for f in exported.library.function for n in f.node_def]
        if not tf_behavior.is_v1():
            assert bodies, '%s: the case lost its tf.cond function bodies' % where
        placed = ['%s: %s %s' % (n.name, n.device, list(n.attr['_class'].list.s))
                  for n in list(exported.node) + bodies
                  if n.device or '_class' in n.attr]
        assert placed == [], where


# The TF1-behaviour pass: the tensor is_training case (v1 tf.cond's
# Switch/Merge in the imported graph, tf_behavior.pick); the scope's prefix on
# the records is plain Python, the same in both behaviours.
@pytest.mark.parametrize('towers,kind,scope', pick(
    [(1, 'python', 'restored'), (4, 'tensor', 'restored/run_2')],
    [(4, 'tensor', 'restored/run_2')]))
def test_a_graph_imported_with_an_import_scope_exports(towers, kind, scope, tmp_path):
    """``import_meta_graph(..., import_scope=...)`` prefixes the scope onto the records too.

    Before, the export failed with a raw ``JSONDecodeError``: the collection
    held ``'restored/{...}'``.
    """
    import tensorflow as tf

    import tf1_syncbn
    from tower import virtual_cpu_config
    tf1 = tf.compat.v1
    path = str(tmp_path / 'model.ckpt')
    data = _data(5, 2 * towers)
    with tf.Graph().as_default():
        images, _, is_training, outs, train, eval_x, eval_y = _training_graph('slim', towers,
                                                                              kind)
        feed = {is_training: True} if kind == 'tensor' else {}
        saver = tf1.train.Saver()
        with tf1.Session(config=virtual_cpu_config(towers)) as sess:
            sess.run(tf1.global_variables_initializer())
            for step in range(2):
                sess.run(train, {images: _data(step, 2 * towers), **feed})
            expected = sess.run(eval_y, {eval_x: data[:2]})
            saver.save(sess, path)
        output = outs[0].name
    with tf.Graph().as_default():
        saver = tf1.train.import_meta_graph(path + '.meta', import_scope=scope)
        with tf1.Session(config=virtual_cpu_config(towers)) as sess:
            saver.restore(sess, path)
            graph_def = tf1_syncbn.export.inference_graph_def(
                sess, {'images': scope + '/parts:0'}, {'output': scope + '/' + output},
                {scope + '/is_training:0': False} if kind == 'tensor' else None)
    types = {node.op for node in graph_def.node}
    assert 'FusedBatchNormV3' in types and not [t for t in types if t.startswith(FORBIDDEN)]
    with tf.Graph().as_default() as served:
        tf.import_graph_def(graph_def, name='')
        with tf1.Session(graph=served) as sess:
            np.testing.assert_allclose(sess.run('output:0', {'images:0': data[:2]}), expected,
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('case', ['tensorpack', 'slim'])
def test_layers_that_update_their_moving_averages_inside_export(graph, case):
    """Updates inside the layer: tensorpack's with sync_statistics set, slim's with None.

    TensorFlow's own freeze keeps the output's control dependencies on the
    assign ops, whose variables became constants: that graph does not
    import. The export leaves the updates out (and runs none of them).
    """
    import tensorflow as tf

    import tf1_syncbn
    tf1 = tf.compat.v1
    x = tf1.placeholder(tf.float32, [None, 3], name='x')
    is_training = tf1.placeholder_with_default(True, [], name='is_training')
    if case == 'tensorpack':
        y = tf1_syncbn.BatchNorm('bn', x, training=is_training, sync_statistics='auto')
    else:
        y = tf1_syncbn.sync_batch_norm(x, is_training=is_training, updates_collections=None)
    y = tf.identity(y, name='y')
    assert tf1.get_collection(tf1.GraphKeys.UPDATE_OPS) == []
    data = np.random.RandomState(2).randn(4, 3).astype(np.float32) * 3 + 2
    with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(3):
            sess.run(y, {x: data})
        expected = sess.run(y, {x: data, is_training: False})
        moving = sess.run(tf1.global_variables())
        frozen = tf1.graph_util.convert_variables_to_constants(sess, graph.as_graph_def(), ['y'])
        graph_def = tf1_syncbn.export.inference_graph_def(sess, {'x': x}, {'y': y},
                                                          {is_training: False})
        for before, after in zip(moving, sess.run(tf1.global_variables())):
            np.testing.assert_array_equal(before, after)
    with tf.Graph().as_default(), pytest.raises(ValueError, match='incompatible with expected'):
        tf.import_graph_def(frozen, name='')
    assert not [n.name for n in graph_def.node if n.op.startswith('Assign')]
    with tf.Graph().as_default() as served:
        tf.import_graph_def(graph_def, name='')
        with tf1.Session(graph=served) as sess:
            np.testing.assert_allclose(sess.run('y:0', {'x:0': data}), expected,
                                       rtol=1e-5, atol=1e-5)

if __name__ == '__main__':
    sys.path.insert(0, SUPPORT)
    sys.path.insert(1, ROOT)
    if sys.argv[1] == 'build':
        build(sys.argv[2])
    else:
        sys.path[:] = [p for p in sys.path if p not in (HERE, SUPPORT, ROOT)]
        print(json.dumps(load(sys.argv[2])))

"""What :mod:`tf1_syncbn.export` refuses, and how it says so: arguments that would export
something else than they say, or fail later in a way that does not name them.

Before, each case below failed with TensorFlow's own error (``Attempted to map inputs
that were not found in graph_def``, ``AttributeError: 'list' object has no attribute
'items'``, an ``AssertionError`` of the SavedModel builder), or was accepted: a
``placeholder_with_default`` the outputs need was kept at its default (``is_training``
defaulting to True served dropout in training mode), a constant of another shape than
its placeholder exported (and in TF2 behaviour aborted the serving process with a CHECK
failure), and the full-batch placeholder given as the input served the first tower's
share of each request (split across the towers, or sliced).

One trained 2-tower graph (slim, a tensor ``is_training`` with default True, dropout)
serves every case.
"""

import os

import numpy as np
import pytest

@pytest.fixture(scope='module')
def trained():
    """``(session, tensors)`` of a trained 2-tower graph; the session stays open."""
    import tensorflow as tf

    from test_export_inference import slim_dropout_towers
    from tower import virtual_cpu_config
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x, is_training, parts, logits = slim_dropout_towers(['/cpu:0', '/cpu:1'])
        loss = tf.add_n([tf.reduce_mean(tf.square(t)) for t in logits])
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        sess = tf1.Session(graph=graph, config=virtual_cpu_config(2))
        sess.run(tf1.global_variables_initializer())
        data = np.random.RandomState(0).rand(4, 6, 6, 3).astype(np.float32)
        sess.run(train, {x: data})
        tensors = {'x': x, 'is_training': is_training, 'parts': parts, 'logits': logits,
                   'data': data,
                   'expected': sess.run(logits[0], {x: data, is_training: False})}
    yield sess, tensors
    sess.close()


def _export(sess, tensors, **changes):
    from tf1_syncbn import export
    args = dict(inputs={'images': tensors['parts'][0]}, outputs={'logits': tensors['logits'][0]},
                constants={tensors['is_training']: False})
    args.update(changes)
    return export.inference_graph_def(sess, **args)


def _serve(graph_def, batch):
    import tensorflow as tf
    with tf.Graph().as_default() as served:
        tf.import_graph_def(graph_def, name='')
        with tf.compat.v1.Session(graph=served) as sess:
            return sess.run('logits:0', {'images:0': batch})


def test_the_valid_call_serves_the_inference_outputs(trained):
    sess, tensors = trained
    served = _serve(_export(sess, tensors), tensors['data'][:2])
    np.testing.assert_allclose(served, tensors['expected'], rtol=1e-5, atol=1e-5)


def test_an_input_no_output_depends_on_is_named(trained):
    """Tower 1's share for tower 0's outputs: the same op (split), another tensor."""
    sess, tensors = trained
    with pytest.raises(ValueError, match=r"inputs\['images'\] = split:1: no output depends on "
                                         r"it .*another tower's input"):
        _export(sess, tensors, inputs={'images': tensors['parts'][1]})


def test_a_placeholder_with_default_the_outputs_need_must_be_given(trained):
    """Kept at its default True, the served model ran dropout (and the layers' training mode)."""
    sess, tensors = trained
    with pytest.raises(ValueError, match=r"need the training graph's placeholders "
                                         r"'is_training'.*constants=\{is_training: False\}.* "
                                         r"'is_training' is a placeholder_with_default"):
        _export(sess, tensors, constants=None)
    with pytest.raises(ValueError, match=r"placeholders 'x', which are neither in inputs"):
        _export(sess, tensors, inputs={})


def test_a_constant_must_fit_its_tensor(trained):
    sess, tensors = trained
    with pytest.raises(ValueError, match=r'constants\[is_training:0\] has the shape \[2\], '
                                         r'which does not fit the tensor.s shape \(\)'):
        _export(sess, tensors, constants={tensors['is_training']: [False, False]})
    for value in ('no', None, 1):
        with pytest.raises(TypeError, match=r'constants\[is_training:0\] = .* is no value of '
                                            r'the tensor.s dtype bool'):
            _export(sess, tensors, constants={tensors['is_training']: value})
    # By name, and a numpy value: accepted.
    graph_def = _export(sess, tensors, constants={'is_training:0': np.bool_(False)})
    np.testing.assert_allclose(_serve(graph_def, tensors['data'][:2]), tensors['expected'],
                               rtol=1e-5, atol=1e-5)


def test_the_arguments_of_the_wrong_type_are_named(trained):
    import tensorflow as tf

    from tf1_syncbn import export
    sess, tensors = trained
    with pytest.raises(TypeError, match=r'constants must be a dict \{tensor: value\}'):
        _export(sess, tensors, constants=[(tensors['is_training'], False)])
    for session in (None, sess.graph, tf.Graph()):
        with pytest.raises(TypeError, match=r'tf1_syncbn.export: session must be the '
                                            r'tf.compat.v1.Session'):
            export.inference_graph_def(session, {'images': tensors['parts'][0]},
                                       {'logits': tensors['logits'][0]})
    with pytest.raises(ValueError, match=r"inputs\['a'\] and inputs\['b'\] are both split:0"):
        _export(sess, tensors, inputs={'a': tensors['parts'][0], 'b': tensors['parts'][0]})
    with pytest.raises(ValueError, match=r"split:0 is both inputs\['images'\] and a key of "
                                         r'constants'):
        _export(sess, tensors, constants={tensors['is_training']: False,
                                          tensors['parts'][0]: np.zeros([2, 6, 6, 3])})


def test_the_full_batch_split_across_the_towers_is_no_input(trained):
    """Given the full batch, the served graph split each request and served its first half."""
    sess, tensors = trained
    with pytest.raises(ValueError, match=r"inputs\['images'\] = x:0 reaches the outputs only "
                                         r'through a share of its batch: split \(share 0 of '
                                         r"2\).*tf.split\(images, towers\)\[0\]"):
        _export(sess, tensors, inputs={'images': tensors['x']})
    # Tower 1's outputs from tower 1's share: fine.
    graph_def = _export(sess, tensors, inputs={'images': tensors['parts'][1]},
                        outputs={'logits': tensors['logits'][1]})
    expected = sess.run(tensors['logits'][1], {tensors['x']: tensors['data'],
                                               tensors['is_training']: False})
    np.testing.assert_allclose(_serve(graph_def, tensors['data'][2:]), expected,
                               rtol=1e-5, atol=1e-5)


def _sliced_towers(cut):
    """``(session, x, towers' inputs, towers' logits)``: 2 towers fed ``cut(x, tower)``."""
    import tensorflow as tf
    import tf_slim as slim

    import tf1_syncbn
    from tower import call_for_each_tower, get_current_tower_context, virtual_cpu_config
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 5], name='x')
        shares = []

        def tower():
            shares.append(cut(x, get_current_tower_context().index))
            return slim.fully_connected(shares[-1], 3, activation_fn=None,
                                        normalizer_fn=tf1_syncbn.sync_batch_norm,
                                        normalizer_params={'is_training': False}, scope='fc')

        logits = call_for_each_tower(tower, ['/cpu:0', '/cpu:1'])
        sess = tf.compat.v1.Session(graph=graph, config=virtual_cpu_config(2))
        sess.run(tf.compat.v1.global_variables_initializer())
    return sess, x, shares, logits


@pytest.mark.parametrize('cut, share', [
    (lambda x, i: x[2 * i:2 * i + 2], r'tower0/strided_slice \(rows 0:2\)'),
    (lambda x, i: x[i::2], r'tower0/strided_slice \(rows 0::2\)'),
    (lambda x, i: x[i][None], r'tower0/strided_slice \(row 0\)'),
    (lambda x, i: __import__('tensorflow').slice(x, [2 * i, 0], [2, -1]),
     r'tower0/Slice \(rows 0:2\)'),
], ids=['rows', 'every-other-row', 'one-row', 'tf.slice'])
def test_the_full_batch_sliced_across_the_towers_is_no_input(cut, share):
    """Sliced rather than split: the served graph kept tower 0's rows of each request."""
    from tf1_syncbn import export
    sess, x, shares, logits = _sliced_towers(cut)
    with sess:
        with pytest.raises(ValueError, match=r"inputs\['images'\] = x:0 reaches the outputs "
                                             r'only through a share of its batch: ' + share):
            export.inference_graph_def(sess, {'images': x}, {'logits': logits[0]})
        # The share itself is the input: served whole.
        graph_def = export.inference_graph_def(sess, {'images': shares[0]},
                                               {'logits': logits[0]})
        data = np.random.RandomState(1).rand(4, 5).astype(np.float32)
        batch = sess.run(shares[0], {x: data})
        expected = sess.run(logits[0], {x: data})
    import tensorflow as tf
    with tf.Graph().as_default() as served:
        tf.import_graph_def(graph_def, name='')
        with tf.compat.v1.Session(graph=served) as serving:
            got = serving.run('logits:0', {'images:0': batch})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_slices_that_keep_the_whole_batch_are_inputs():
    """x[:, :4] and tf.slice(x, [0, 1], [-1, 4]) keep every row: no complaint."""
    import tensorflow as tf

    from tf1_syncbn import export
    for cut in (lambda x, i: x[:, :4] * (i + 1), lambda x, i: tf.slice(x, [0, 1], [-1, 4])):
        sess, x, _, logits = _sliced_towers(cut)
        with sess:
            graph_def = export.inference_graph_def(sess, {'images': x}, {'logits': logits[0]})
        assert 'images' in [node.name for node in graph_def.node]


def test_an_export_dir_the_builder_cannot_write_is_named_before_exporting(trained, tmp_path):
    from tf1_syncbn import export
    sess, tensors = trained
    args = ({'images': tensors['parts'][0]}, {'logits': tensors['logits'][0]},
            {tensors['is_training']: False})
    a_file = tmp_path / 'a_file'
    a_file.write_text('')
    full = tmp_path / 'full'
    full.mkdir()
    (full / 'saved_model.pb').write_text('')
    for export_dir, match in ((a_file, r'export_dir .*a_file. exists and is no directory'),
                              (a_file / 'sub', r'export_dir .*sub. is inside .*a_file., which '
                                               r'is a file'),
                              (full, r'export_dir .*full. is a directory that is not empty')):
        with pytest.raises(ValueError, match=r'export_saved_model: ' + match):
            export.export_saved_model(sess, str(export_dir), *args)
    with pytest.raises(TypeError, match=r'export_saved_model: export_dir must be a path'):
        export.export_saved_model(sess, None, *args)
    # An existing empty directory, given as a pathlib path: written.
    empty = tmp_path / 'empty'
    empty.mkdir()
    assert export.export_saved_model(sess, empty, *args) == str(empty)
    assert os.path.exists(os.path.join(str(empty), 'saved_model.pb'))


def test_keras_learning_phase_is_a_placeholder_with_default_too(graph):
    """Keras 2 layers read ``K.learning_phase()``, a placeholder_with_default(False)."""
    import tensorflow as tf
    import tf_keras

    from tf1_syncbn import export
    tf1 = tf.compat.v1
    x = tf1.placeholder(tf.float32, [None, 3], name='x')
    y = tf_keras.layers.Dropout(0.5)(tf_keras.layers.Dense(2)(x))
    with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        with pytest.raises(ValueError, match=r"'keras_learning_phase' is Keras 2's learning "
                                             r'phase: constants=\{tf_keras.backend.'
                                             r'learning_phase\(\): False\}'):
            export.inference_graph_def(sess, {'x': x}, {'y': y})
        graph_def = export.inference_graph_def(
            sess, {'x': x}, {'y': y}, {tf_keras.backend.learning_phase(): False})
        data = np.ones([4, 3], np.float32)
        expected = sess.run(y, {x: data})
    with tf.Graph().as_default() as served:
        tf.import_graph_def(graph_def, name='')
        with tf1.Session(graph=served) as serving:
            np.testing.assert_allclose(serving.run('y:0', {'x:0': data}), expected, rtol=1e-6)


@pytest.mark.once      # a GraphDef check, whatever the TF behaviour
@pytest.mark.parametrize('op_type', ['HorovodAllreduce', 'HorovodBroadcast', 'NcclAllReduce',
                                     'CollectiveReduceV2', 'SyncBnStepWatchdog', 'PyFunc'])
def test_an_op_that_needs_this_process_is_refused_also_horovod(op_type):
    """The exported graph may hold none of the backends' ops, Horovod's included.

    The backends declare their op types (``SyncBackend.op_types``, the
    communication library's ``op_type_prefix``); before, the export kept its
    own list, without Horovod's. A stand-in ``NodeDef`` (no Horovod here), in
    the graph and in a function body.
    """
    import tensorflow as tf

    from tf1_syncbn import backends, export
    from tf1_syncbn.export import checks
    for backend in backends.BACKENDS.values():
        assert backend.op_type_prefix in export.FORBIDDEN_OP_PREFIXES
        assert all(t.startswith(backend.op_type_prefix) for t in backend.op_types)
    for where in ('graph', 'function'):
        graph_def = tf.compat.v1.GraphDef()
        nodes = graph_def.node if where == 'graph' else graph_def.library.function.add().node_def
        nodes.add(name='all_reduce', op=op_type)
        with pytest.raises(ValueError, match=r'only this library or this process can run: '
                                             r'all_reduce \(%s\)' % op_type):
            checks.check_exported(graph_def, {})

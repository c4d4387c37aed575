"""Resuming training from a meta graph in a new process continues the run exactly.

A user saves a 4-tower synchronized training graph (the model of
``tests/data/pre_layout/write.py``) with ``Saver.save``
(checkpoint and ``.meta``), and later, in a new process, runs
``import_meta_graph``, restores and trains on, with nothing but ``import
tf1_syncbn``. Before, this failed: ``Op type not registered
'SyncBnStepWatchdog'`` (only ``tf1_syncbn.kernels.load()`` registered the
compiled ops), then ``Could not find callback with key=pyfunc_0`` (the
run-time tower check was a ``py_func``, whose callback died with the process
that built it).

This file is also the user's script (``python test_resume_meta_graph.py
train|resume DIR``): ``train`` builds the graph, trains ``STEPS_BEFORE``
steps, saves, and trains ``STEPS_AFTER`` more (the uninterrupted run);
``resume`` imports the meta graph in a new process, restores, and trains
``STEPS_AFTER`` steps (``new-gradients``: builds new gradients on the
imported graph, which fails with a clear error). Losses and every variable
must be the same, on the
compiled kernels, on the stock kernels with oneDNN off (the CPU stand-in for
GPU towers), and with no C++ compiler at all, in the TF behaviour of the run.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import suite_scope
import tf_behavior

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
#: The helpers and the scripts the tests start.
SUPPORT = os.path.join(ROOT, 'tests', 'support')
TOWERS = 4
STEPS_BEFORE, STEPS_AFTER = 3, 2
TIMEOUT_S = 240

#: name -> environment of both processes (a compiler-less one gets an empty cache too).
CONFIGS = {
    'compiled': {},
    'stock-onednn-off': {'TF1_SYNCBN_KERNELS': '0', 'TF_ENABLE_ONEDNN_OPTS': '0'},
    'no-compiler': {'CXX': '/nonexistent/g++'},
}


def _load_writer():
    """``tests/data/pre_layout/write.py``, by its path (not a package): this file's model."""
    spec = importlib.util.spec_from_file_location(
        'pre_layout_write', os.path.join(ROOT, 'tests', 'data', 'pre_layout', 'write.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The writer of the old checkpoints: its build_model and batch are this file's model and data.
WRITER = _load_writer()


def _train(directory):
    """The user's training script: 4 synchronized towers, save, and train on."""
    import tensorflow as tf

    import tf_behavior
    tf_behavior.apply()
    from tower import virtual_cpu_config
    tf1 = tf.compat.v1

    graph = tf.Graph()
    with graph.as_default():
        images, labels, loss, train_op = WRITER.build_model(TOWERS)
        saver = tf1.train.Saver()
        with tf1.Session(config=virtual_cpu_config(TOWERS)) as sess:
            sess.run(tf1.global_variables_initializer())
            for s in range(STEPS_BEFORE):
                x, y = WRITER.batch(s, TOWERS)
                sess.run(train_op, {images: x, labels: y})
            saver.save(sess, os.path.join(directory, 'model.ckpt'),
                       global_step=tf1.train.get_global_step())
            return _steps(sess, train_op, loss, images, labels, STEPS_BEFORE)


def _resume(directory):
    """The user's resume script: nothing of the library but ``import tf1_syncbn``."""
    import tensorflow as tf

    import tf_behavior
    tf_behavior.apply()
    import tf1_syncbn  # noqa: F401 - registers what the graph needs
    from tower import virtual_cpu_config
    tf1 = tf.compat.v1

    graph = tf.Graph()
    with graph.as_default():
        path = tf1.train.latest_checkpoint(directory)
        saver = tf1.train.import_meta_graph(path + '.meta')
        train_op = tf1.get_collection('train_op')[0]
        loss = tf1.get_collection('loss')[0]
        images = graph.get_tensor_by_name('images:0')
        labels = graph.get_tensor_by_name('labels:0')
        with tf1.Session(config=virtual_cpu_config(TOWERS)) as sess:
            saver.restore(sess, path)
            start = sess.run(tf1.train.get_global_step())
            result = _steps(sess, train_op, loss, images, labels, int(start))
    result['op_types'] = sorted({op.type for op in graph.get_operations()})
    return result


def _new_gradients(directory):
    """Building new gradients on the imported graph: the layers' gradient functions stay behind."""
    import tensorflow as tf

    import tf_behavior
    tf_behavior.apply()
    import tf1_syncbn  # noqa: F401 - registers what the graph needs
    tf1 = tf.compat.v1
    with tf.Graph().as_default():
        tf1.train.import_meta_graph(tf1.train.latest_checkpoint(directory) + '.meta')
        try:
            tf.gradients(tf1.get_collection('loss')[0], tf1.trainable_variables())
        except LookupError as e:
            return {'error': str(e)}
    return {'error': None}


def _steps(sess, train_op, loss, images, labels, start):
    import tensorflow as tf
    losses = []
    for s in range(start, start + STEPS_AFTER):
        x, y = WRITER.batch(s, TOWERS)
        losses.append(float(sess.run([loss, train_op], {images: x, labels: y})[0]))
    variables = tf.compat.v1.global_variables()
    return {'start': start, 'losses': losses,
            'variables': {v.op.name: value.tolist()
                          for v, value in zip(variables, sess.run(variables))}}


def _run(mode, directory, env):
    run = subprocess.run([sys.executable, os.path.abspath(__file__), mode, directory],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, '%s failed:\n%s' % (mode, run.stderr[-4000:])
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


# make test: the compiled kernels and the stock ones (suite_scope.covering;
# make test-full adds 'no-compiler', which resumes the same stock-kernel graph
# as 'stock-onednn-off': what it adds, the build without a compiler falling back
# to the stock kernels with a message, is test_kernels'
# test_without_a_compiler_layers_fall_back_to_stock_kernels_with_a_warning). The
# TF1-behaviour pass (reference variables restored and assigned): the compiled
# graph (tf_behavior.pick).
RUN_CONFIGS = tf_behavior.pick(suite_scope.covering(sorted(CONFIGS),
                                                    ['compiled', 'stock-onednn-off']),
                               ['compiled'])


@pytest.mark.parametrize('config', RUN_CONFIGS)
def test_import_meta_graph_restore_and_train_on_equals_the_uninterrupted_run(tmp_path, config):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', **CONFIGS[config])
    if config == 'no-compiler':
        env['TF1_SYNCBN_CACHE'] = str(tmp_path / 'empty-cache')
    uninterrupted, built = _run('train', str(tmp_path), env)
    resumed, _ = _run('resume', str(tmp_path), env)
    assert resumed['start'] == uninterrupted['start'] == STEPS_BEFORE
    np.testing.assert_array_equal(resumed['losses'], uninterrupted['losses'])
    assert sorted(resumed['variables']) == sorted(uninterrupted['variables'])
    for name, value in uninterrupted['variables'].items():
        np.testing.assert_array_equal(resumed['variables'][name], value, err_msg=name)
    types = set(resumed['op_types'])
    assert not {'PyFunc', 'EagerPyFunc'} & types
    assert 'Assert' in types                            # the run-time tower check
    assert 'CollectiveReduce' in types or 'CollectiveReduceV2' in types
    if config == 'compiled':
        assert {'SyncBnStepWatchdog', 'SyncBnMoments'} <= types, sorted(types)
    else:
        assert not [t for t in types if t.startswith('SyncBn')], sorted(types)
    if config == 'no-compiler':
        assert "no C++ compiler: '/nonexistent/g++'" in built, built[-2000:]
    if config == 'compiled':
        # New gradients through the imported layers cannot be built: a clear
        # error (it was a KeyError from the library's internals).
        error = _run('new-gradients', str(tmp_path), env)[0]['error']
        assert error and 'built in another process' in error, error
        assert 'build the model in Python again and restore the checkpoint' in error, error


def test_a_scoped_meta_graph_leaves_out_the_tower_check_as_the_docs_say(tmp_path):
    """``export_meta_graph(export_scope=...)`` keeps only that scope; the check is at the root.

    docs/save-resume-export.md and the FAQ quote the import's error: if the
    check moves, or TensorFlow's scoping changes, they must change too.
    """
    import tensorflow as tf

    import tf1_syncbn
    from tower import call_for_each_tower, get_current_tower_context
    tf1 = tf.compat.v1
    path = str(tmp_path / 'scoped.meta')
    with tf.Graph().as_default():
        with tf1.variable_scope('model'):
            x = tf1.placeholder(tf.float32, [4, 3], name='x')
            parts = tf.split(x, 2)
            call_for_each_tower(lambda: tf1_syncbn.sync_batch_norm(
                parts[get_current_tower_context().index], is_training=True,
                sync_statistics='collective'), ['/cpu:0', '/cpu:1'])
        tf1.train.export_meta_graph(path, export_scope='model')
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=r"Unknown input node "
                                             r"'\^\$unbound_inputs_tf1_syncbn_check_towers'"):
            tf1.train.import_meta_graph(path)


if __name__ == '__main__':
    sys.path.insert(0, SUPPORT)
    mode, directory = sys.argv[1:3]
    print(json.dumps({'train': _train, 'resume': _resume,
                      'new-gradients': _new_gradients}[mode](directory)))

"""A meta graph and checkpoint written before the package layout of issue 34 still train on.

``tests/data/pre_layout/`` holds a 2-tower synchronized model (slim's
``sync_batch_norm``, tensorpack's ``BatchNorm``, ``tf1_syncbn.layers``)
saved by the code as it was before the layout change, in each TF behaviour,
on the compiled kernels and on the stock ones (``write.py`` there wrote
them, and says how). In a process with nothing but ``import tf1_syncbn``,
the meta graph of this run's behaviour imports, the checkpoint restores,
and one more training step gives the loss and variables the old code gave
(to float32 rounding: oneDNN may be on here and off where the stock graph
was written).
"""

import gzip
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
from tower import virtual_cpu_config

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'data',
                    'pre_layout')
tf1 = tf.compat.v1


def _batch(step, towers):
    rng = np.random.RandomState(100 + step)
    return (rng.randn(2 * towers, 5, 5, 3).astype(np.float32) * 2 + 1,
            rng.randint(0, 4, 2 * towers).astype(np.int32))


@pytest.mark.parametrize('kernels', ['compiled', 'stock'])
def test_a_checkpoint_of_the_old_layout_restores_and_trains_on(kernels):
    import tf1_syncbn  # noqa: F401 - registers what the graph needs, as a user's script does
    from tf1_syncbn import kernels as library
    directory = os.path.join(DATA, '%s-%s' % (tf_behavior.name(), kernels))
    with open(os.path.join(directory, 'expected.json')) as f:
        expected = json.load(f)
    if kernels == 'compiled':
        assert library.load() is not None, library.status()
    meta = tf1.MetaGraphDef()
    with open(os.path.join(directory, 'model.ckpt.meta.gz'), 'rb') as f:
        meta.ParseFromString(gzip.decompress(f.read()))
    towers = expected['towers']
    graph = tf.Graph()
    with graph.as_default():
        saver = tf1.train.import_meta_graph(meta)
        train_op = tf1.get_collection('train_op')[0]
        loss = tf1.get_collection('loss')[0]
        feed = dict(zip([graph.get_tensor_by_name('images:0'),
                         graph.get_tensor_by_name('labels:0')],
                        _batch(expected['step'], towers)))
        variables = tf1.global_variables()
        with tf1.Session(config=virtual_cpu_config(towers)) as sess:
            saver.restore(sess, os.path.join(directory, 'model.ckpt'))
            assert sess.run(tf1.train.get_global_step()) == expected['step']
            value = sess.run([loss, train_op], feed)[0]
            values = sess.run(variables)       # in a run of their own (TF1 behaviour)
    types = sorted({op.type for op in graph.get_operations()})
    assert [t for t in types if t.startswith('SyncBn')] == expected['library_op_types']
    assert ('SyncBnMoments' in types) == (kernels == 'compiled')
    np.testing.assert_allclose(value, expected['loss'], rtol=1e-5)
    found = {v.op.name: x for v, x in zip(variables, values)}
    assert sorted(found) == sorted(expected['variables'])
    for name, x in found.items():
        np.testing.assert_allclose(x, expected['variables'][name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)

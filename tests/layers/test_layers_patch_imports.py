"""patch_tf_layers() holds when the script imports ``tensorflow.compat.v1.layers`` after it.

``from tensorflow.compat.v1.layers import batch_normalization`` (or ``import
tensorflow.compat.v1.layers``) makes Python load a module of that name, which
replaces TensorFlow's lazy loader as ``tf.compat.v1.layers``. Before, such an
import after the patch undid it silently: with tf-keras the name was tf-keras'
layer again (a tower_%d script trained with per-tower statistics, and only
the audit could tell); with Keras 3 the import failed, and
``tf.compat.v1.layers.batch_normalization`` with it.

Each case runs in a fresh process (what an import does depends on what was
imported before), in the run's TF behaviour, with tf-keras
(``TF_USE_LEGACY_KERAS=1``) and without (Keras 3 from TensorFlow 2.16):
``fresh_script.run``.
"""

import pytest

import fresh_script

pytestmark = pytest.mark.versions

#: After fresh_script.PRELUDE.
SCRIPT = r'''
import tf1_syncbn
from tf1_syncbn import audit_graph

patch = tf1_syncbn.patch_tf_layers(num_dev=2)
from tensorflow.compat.v1.layers import BatchNormalization, batch_normalization  # after the patch
out['imported'] = (getattr(batch_normalization, '__wrapped__', None)
                   is tf1_syncbn.layers.batch_normalization)
out['imported_class'] = issubclass(BatchNormalization, tf1_syncbn.layers.BatchNormalization)
out['attribute'] = (getattr(tf1.layers.batch_normalization, '__wrapped__', None)
                    is tf1_syncbn.layers.batch_normalization)
# A tower_%d loop built with the imported name synchronizes (the audit says so).
graph = tf.Graph()
with graph.as_default():
    x = tf1.placeholder(tf.float32, [4, 3])
    losses = []
    for i, part in enumerate(tf.split(x, 2)):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
            with tf1.variable_scope('', reuse=i > 0):
                losses.append(tf.reduce_sum(batch_normalization(part, training=True,
                                                                 name='bn')))
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.add_n(losses))
    report = audit_graph(graph, train_op)
out['problems'] = list(report.problems)
out['sync'] = [[layer.synchronized, layer.group_size] for layer in report.layers]
patch.restore()
module = sys.modules['tensorflow.compat.v1.layers']
restored = vars(module).get('batch_normalization')
out['restored'] = restored is None or not hasattr(restored, '__wrapped__')
'''


@pytest.mark.parametrize('keras', sorted(fresh_script.KERAS))
def test_an_import_of_the_module_after_the_patch_keeps_it(keras):
    out = fresh_script.run(SCRIPT, keras, timeout=240)
    assert out['imported'] and out['imported_class'] and out['attribute'], out
    assert out['problems'] == [], out
    assert out['sync'] == [[True, 2]], out
    assert out['restored'], out

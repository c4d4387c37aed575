"""Ghost batches over towers of different batch sizes: the library's own errors.

Before, towers of 3 and 5 examples with ``virtual_batch_size=2`` built, and
the first step died inside TensorFlow ("Collective ops is aborted by: Shape
mismatch ... Restart your program"), no layer named, the session's
collectives left unusable. Now static sizes are refused at graph build, and
dynamic ones fail the step with a message naming the layer, the towers'
sizes and what to restart, before a ghost-batch all-reduce of a mismatched
shape can start. (A failed step poisons the collectives of its session
only: each case has a session of its own.)
"""

import numpy as np
import pytest
import tensorflow as tf

from conftest import make_session
import tf1_syncbn

tf1 = tf.compat.v1


def _towers(shapes):
    xs, ys = [], []
    for i, n in enumerate(shapes):
        with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i):
            xs.append(tf1.placeholder(tf.float32, [n, 3]))
            ys.append(tf1_syncbn.layers.batch_normalization(
                xs[-1], training=True, name='bn', reuse=tf1.AUTO_REUSE, num_dev=len(shapes),
                virtual_batch_size=2))
    return xs, ys


def test_static_sizes_that_differ_are_refused_at_graph_build(graph):
    with pytest.raises(ValueError) as info:
        _towers([3, 5])
    message = str(info.value)
    assert 'batch_normalization(bn)' in message and 'virtual_batch_size=2' in message
    assert 'tower 0 has 3 examples and tower 1 has 5' in message
    assert 'same batch size' in message and 'drop_remainder' in message


@pytest.mark.parametrize('shapes', [[None, None], [3, None]], ids=['dynamic', 'static-first'])
def test_dynamic_sizes_that_differ_fail_naming_the_layer_and_sizes(graph, shapes):
    xs, ys = _towers(shapes)
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            sess.run(ys, {xs[0]: np.ones((3, 3)), xs[1]: np.zeros((5, 3))})
    message = info.value.message
    assert 'Shape mismatch' not in message, message
    assert 'batch_normalization(bn)' in message and 'virtual_batch_size=2' in message, message
    assert 'open a new session or restart the process' in message, message
    if shapes[0] is None:
        assert '[3 5]' in message, message
    else:
        assert 'tower 0 has 3 examples (static) and tower 1 has:] [5]' in message, message
    with make_session(graph, 2) as sess:        # equal sizes, in a new session: fine
        sess.run(tf1.global_variables_initializer())
        outs = sess.run(ys, {xs[0]: np.ones((3, 3)), xs[1]: np.zeros((3, 3))})
    assert [o.shape for o in outs] == [(3, 3), (3, 3)]

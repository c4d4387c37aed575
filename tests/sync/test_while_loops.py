"""A synchronized layer inside a while loop is refused at graph build, never a hang.

A loop body drops the control inputs that bound the layer's all-reduces (v1
loops), every tower would have to iterate the same number of times, and
TensorFlow's own errors ("different while loops") say nothing of the layer:
so a synchronized layer built in ``tf.while_loop`` (v1 or v2: whichever the
TF behaviour of the run builds), ``tf.map_fn`` or a ``tf.cond`` inside a
loop is a ``ValueError`` naming the layer, the loop and the fix. Outside
towers, or with ``sync_statistics=None``, the layer still works in a loop,
equal to ``tf.nn.fused_batch_norm``.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from conftest import make_session
from tf1_syncbn import BatchNorm, CollectiveBackend, layers, sync_batch_norm
from tower import call_for_each_tower

tf1 = tf.compat.v1
EPS = 1e-3
DEVICES = ['/cpu:0', '/cpu:1']

FRONT_ENDS = {
    'sync_batch_norm': lambda x, **kw: sync_batch_norm(x, is_training=True, epsilon=EPS, **kw),
    'BatchNorm': lambda x, **kw: BatchNorm('bn', x, training=True, epsilon=EPS, **kw),
    'layers': lambda x, **kw: layers.batch_normalization(x, training=True, epsilon=EPS, **kw),
}


def _in_while_loop(layer):
    def body(i, x):
        return i + 1, layer(x)
    return lambda x: tf.while_loop(lambda i, x: i < 2, body, [0, x])[1]


def _in_map_fn(layer):
    return lambda x: tf.map_fn(lambda row: layer(row[None])[0], x)


def _cond_in_loop(layer):
    flag = tf1.placeholder_with_default(True, [])

    def body(i, x):
        return i + 1, tf.cond(flag, lambda: layer(x), lambda: x)
    return lambda x: tf.while_loop(lambda i, x: i < 2, body, [0, x])[1]


@pytest.mark.parametrize('loop', [_in_while_loop, _in_map_fn, _cond_in_loop])
@pytest.mark.parametrize('front_end', sorted(FRONT_ENDS))
def test_synchronized_layer_in_a_loop_is_refused(graph, front_end, loop):
    layer = FRONT_ENDS[front_end]

    def tower():
        x = tf1.placeholder(tf.float32, [4, 3])
        return loop(lambda v: layer(v, sync_statistics=CollectiveBackend(timeout=5)))(x)

    with pytest.raises(ValueError) as raised:
        call_for_each_tower(tower, DEVICES)
    message = str(raised.value)
    assert 'inside the while loop' in message
    assert "'tower0" in message                              # the loop's name
    assert 'Build the layer outside the loop' in message
    assert 'sync_statistics=None' in message
    # (tf.map_fn's autograph prefixes 'in user code:'.)
    assert re.search(r'(sync_batch_norm|BatchNorm|batch_normalization)\(\S+\): a synchronized',
                     message), message


@pytest.mark.parametrize('front_end', sorted(FRONT_ENDS))
def test_per_tower_statistics_in_a_loop_still_work(graph, front_end, rng):
    layer = FRONT_ENDS[front_end]

    def tower():
        x = tf1.placeholder(tf.float32, [4, 3], name='x')
        return x, _in_while_loop(lambda v: layer(v, sync_statistics=None))(x)

    outputs = call_for_each_tower(tower, DEVICES)
    data = [rng.randn(4, 3).astype(np.float32) for _ in DEVICES]
    with make_session(graph, len(DEVICES)) as sess:
        sess.run(tf1.global_variables_initializer())
        got = sess.run([y for _, y in outputs], {x: d for (x, _), d in zip(outputs, data)})
    for d, y in zip(data, got):
        once = (d - d.mean(0)) / np.sqrt(d.var(0) + EPS)
        twice = (once - once.mean(0)) / np.sqrt(once.var(0) + EPS)
        np.testing.assert_allclose(y, twice, rtol=1e-4, atol=1e-4)

"""sync_batch_norm restores slim.batch_norm checkpoints and matches slim's step.

The reference is tf-slim itself (slim.conv2d with normalizer_fn=slim.batch_norm),
run in a subprocess with legacy Keras.
"""

import json

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import tf_behavior
from conftest import make_session
from legacy_reference import run_reference
from tf1_syncbn import sync_batch_norm

tf1 = tf.compat.v1

MODEL = '''
def model(images, normalizer_fn, is_training, **options):
    params = {'decay': 0.8, 'scale': True, 'epsilon': 1e-3, 'is_training': is_training}
    params.update(options)
    with slim.arg_scope([slim.conv2d], normalizer_fn=normalizer_fn, normalizer_params=params,
                        activation_fn=tf.nn.relu):
        net = slim.conv2d(images, 4, [3, 3], scope='conv1')
        net = slim.conv2d(net, 6, [3, 3], stride=2, scope='conv2')
    return tf.reduce_mean(net, [1, 2])
'''

SLIM_SCRIPT = '''
import json, sys
import numpy as np
import tensorflow as tf
import tf_slim as slim
tf1 = tf.compat.v1
import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
tf_behavior.apply()
''' + MODEL + '''
options = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
rng = np.random.RandomState(0)
train = rng.randn(6, 8, 8, 3).astype(np.float32) * 2 + 1
test = rng.randn(4, 8, 8, 3).astype(np.float32) * 2 + 1
x = tf1.placeholder(tf.float32, [None, 8, 8, 3])
with tf1.variable_scope('net'):
    out = model(x, slim.batch_norm, True, **options)
with tf1.variable_scope('net', reuse=True):
    out_eval = model(x, slim.batch_norm, False, **options)
loss = tf.reduce_sum(out * np.arange(6, dtype=np.float32))
opt = tf1.train.GradientDescentOptimizer(0.1)
with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    train_op = opt.minimize(loss)
saver = tf1.train.Saver()
with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    for _ in range(2):
        sess.run(train_op, {x: train})
    saver.save(sess, 'slim_ckpt/model')
    names = [v.op.name for v in tf1.global_variables()]
    eval_out = sess.run(out_eval, {x: test})
    train_out = sess.run(out, {x: train})
    sess.run(train_op, {x: train})
    after = {v.op.name: sess.run(v) for v in tf1.global_variables()}
np.savez('result.npz', eval_out=eval_out, train_out=train_out, test=test, train=train,
         names=np.array(names), **{'after/' + k: v for k, v in after.items()})
print('RESULT result.npz')
'''


OPTIONS = {
    'default': {},
    'renorm': {'renorm': True, 'renorm_decay': 0.7,
               'renorm_clipping': {'rmax': 1.3, 'rmin': 0.9, 'dmax': 0.2}},
    'no_scale': {'scale': False, 'center': True},
}


# The TF1-behaviour pass: renorm, whose variables TF1 behaviour reads as references.
@pytest.mark.parametrize('option', tf_behavior.pick(sorted(OPTIONS), ['renorm']))
def test_restores_a_slim_checkpoint_and_takes_the_same_step(graph, tmp_path, option):
    options = OPTIONS[option]
    run_reference(SLIM_SCRIPT, tmp_path, args=[json.dumps(options)])
    ref = np.load(tmp_path / 'result.npz')
    namespace = {'tf': tf, 'slim': slim}
    exec(MODEL, namespace)  # noqa: S102 - the same model code, with our normalizer
    model = namespace['model']
    x = tf1.placeholder(tf.float32, [None, 8, 8, 3])
    with tf1.variable_scope('net'):
        out = model(x, sync_batch_norm, True, **options)
    with tf1.variable_scope('net', reuse=True):
        out_eval = model(x, sync_batch_norm, False, **options)
    assert sorted(v.op.name for v in tf1.global_variables()) == sorted(ref['names'])
    loss = tf.reduce_sum(out * np.arange(6, dtype=np.float32))
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    saver = tf1.train.Saver()
    with make_session(graph, 1) as sess:
        saver.restore(sess, str(tmp_path / 'slim_ckpt' / 'model'))
        np.testing.assert_allclose(sess.run(out_eval, {x: ref['test']}), ref['eval_out'],
                                   rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(sess.run(out, {x: ref['train']}), ref['train_out'],
                                   rtol=1e-4, atol=1e-5)
        sess.run(train_op, {x: ref['train']})
        for v in tf1.global_variables():
            np.testing.assert_allclose(sess.run(v), ref['after/' + v.op.name], rtol=1e-4,
                                       atol=1e-5, err_msg=v.op.name)

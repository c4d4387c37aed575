"""docs/horovod.md's migration recipe runs as written under ``horovodrun`` and equals one device.

The page's ``train.py`` block (a TF1 Horovod script with ``hvd.SyncBatchNormalization``
replaced by ``tf1_syncbn.layers.BatchNormalization(sync_statistics='horovod')``,
``hvd.DistributedOptimizer`` and the broadcast of rank 0's variables kept)
runs on 2 processes; process 0's checkpoint holds what the same model,
trained with tf.layers' own ``BatchNormalization`` (``fused=False``) and the
plain optimizer on one device with the whole batch, holds: every variable,
the moving statistics and the optimizer's slots included. The block is marked
``# Fragment`` for ``tests/project/test_readme.py`` (which runs blocks without
Horovod); this test runs it. As ``test_readme`` runs the pages' blocks: the
block's own ``disable_eager_execution()`` in the TF2-behaviour pass,
``disable_v2_behavior()`` prepended in the TF1 pass.
"""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

import tf_behavior
from legacy_reference import run_reference

from .horovod_run import horovodrun

pytestmark = pytest.mark.timeout(600)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, 'docs', 'horovod.md')


def recipe():
    """The page's ``train.py`` block, as written."""
    with open(PAGE, encoding='utf-8') as f:
        blocks = re.findall(r'^```python\n(# Fragment: train\.py.*?)^```', f.read(),
                            re.S | re.M)
    assert len(blocks) == 1, \
        'docs/horovod.md must hold one ```python block starting "# Fragment: train.py"'
    return blocks[0]


# The same model on one device: tf.layers' own layer, the plain optimizer, the whole batch.
REFERENCE = '''
import sys
import numpy as np
import tensorflow as tf
import tf_behavior
tf_behavior.apply()
tf1 = tf.compat.v1
assert tf1.layers.BatchNormalization.__module__.startswith('tf_keras')

rng = np.random.RandomState(0)
images = rng.randn(3, 8, 6, 6, 3).astype(np.float32) * 2 + 1
labels = rng.randint(0, 4, (3, 8))
x = tf1.placeholder(tf.float32, [None, 6, 6, 3])
y = tf1.placeholder(tf.int64, [None])
kernel = tf1.get_variable('conv/kernel', [3, 3, 3, 8],
                          initializer=tf1.glorot_uniform_initializer(seed=1))
net = tf.nn.conv2d(x, kernel, 1, 'SAME')
bn = tf1.layers.BatchNormalization(momentum=0.9, fused=False, name='sync_batch_normalization')
net = tf.nn.relu(bn.apply(net, training=True))
weights = tf1.get_variable('dense/kernel', [8, 4],
                           initializer=tf1.glorot_uniform_initializer(seed=2))
bias = tf1.get_variable('dense/bias', [4], initializer=tf1.zeros_initializer())
logits = tf.matmul(tf.reduce_mean(net, [1, 2]), weights) + bias
loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
step = tf1.train.get_or_create_global_step()
with tf.control_dependencies(bn.updates):
    train_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    for i in range(3):
        sess.run(train_op, {x: images[i], y: labels[i]})
    values = sess.run({v.op.name: v for v in tf1.global_variables()})
np.savez(sys.argv[1], **values)
print('RESULT', sys.argv[1])
'''


def test_the_page_holds_the_recipe():
    code = recipe()
    assert 'tf1.disable_eager_execution()' in code
    assert "sync_statistics='horovod'" in code
    assert 'hvd.DistributedOptimizer' in code and 'hvd.broadcast_global_variables(0)' in code
    compile(code, 'docs/horovod.md', 'exec')


def test_the_recipe_under_horovodrun_equals_one_device(tmp_path):
    code = recipe()
    if tf_behavior.is_v1():
        code = 'import tensorflow\ntensorflow.compat.v1.disable_v2_behavior()\n' + code
    work = tmp_path / 'job'
    work.mkdir()
    (work / 'train.py').write_text(code)
    job = horovodrun(str(work / 'train.py'), cwd=str(work), timeout=400).check()
    assert 'Traceback' not in job.output, job.tail()
    reader = tf.train.load_checkpoint(str(work / 'checkpoints'))
    ours = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    reference = tmp_path / 'reference.npz'
    run_reference(REFERENCE, tmp_path, args=[str(reference)])
    expected = dict(np.load(reference))
    assert sorted(ours) == sorted(expected)
    assert ours['global_step'] == 3
    for name, value in expected.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # The moving statistics moved: the layer's updates ran.
    assert not np.allclose(ours['sync_batch_normalization/moving_mean'], 0.0)

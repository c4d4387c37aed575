"""``patch_tensorpack()`` replaces tensorpack's layers under every name, and ``restore`` undoes it.

Run in a legacy-Keras subprocess (tensorpack 0.11 needs it on TF 2.21), in
the run's TF behaviour, as a user's training script would: names imported
before the patch with ``from tensorpack import *``, under an alias (``from
tensorpack.models import BatchNorm as BN``) and as module attributes of the
user's own modules; a model built through each name while the patch is
active must build this library's layer (its ops are in the graph), and
tensorpack's after ``restore``.
"""

import json

import pytest

from legacy_reference import run_reference

pytestmark = pytest.mark.versions

SCRIPT = r'''
import json, sys, types
import tensorflow as tf
import tf_behavior
tf_behavior.apply()
tf1 = tf.compat.v1
from tensorpack import *                                   # noqa: F401,F403 - as users write it
from tensorpack.models import BatchNorm as BN, BatchRenorm as BRN
from tensorpack.tfutils.tower import TowerContext
import tensorpack.models.batch_norm as tp_batch_norm

user = types.ModuleType('user_model')                       # another module of the user's
user.Norm, user.Renorm = tp_batch_norm.BatchNorm, tp_batch_norm.BatchRenorm
sys.modules['user_model'] = user
originals = {'BatchNorm': BatchNorm, 'BN': BN, 'BRN': BRN, 'user.Norm': user.Norm,
             'user.Renorm': user.Renorm}

import tf1_syncbn


def names():
    return {'BatchNorm': BatchNorm, 'BN': BN, 'BRN': BRN, 'user.Norm': user.Norm,
            'user.Renorm': user.Renorm}


def builds_ours(layer, renorm):
    """Whether ``layer`` is this library's: it takes sync_statistics='collective'.

    tensorpack's BatchNorm only takes None, 'nccl' or 'horovod', and its
    BatchRenorm has no sync_statistics at all: both raise.
    """
    graph = tf.Graph()
    with graph.as_default(), TowerContext('', is_training=True):
        x = tf1.placeholder(tf.float32, [None, 4, 4, 3])
        extra = {'rmax': 3.0, 'dmax': 5.0} if renorm else {}
        try:
            layer('bn', x, sync_statistics='collective', **extra)
        except (AssertionError, TypeError, ValueError):
            return False
    return True


out = {}
with tf1_syncbn.patch_tensorpack(sync_statistics='auto') as patch:
    current = names()
    out['replaced'] = {k: v is not originals[k] for k, v in current.items()}
    out['ours'] = {k: builds_ours(v, 'Renorm' in k or k == 'BRN') for k, v in current.items()}
    out['patched_modules'] = patch.patched_modules
current = names()
out['restored'] = {k: v is originals[k] for k, v in current.items()}
out['theirs_after'] = {k: not builds_ours(v, 'Renorm' in k or k == 'BRN')
                       for k, v in current.items()}
print('RESULT ' + json.dumps(out))
'''


def test_every_name_of_tensorpacks_layers_is_patched_and_restored(tmp_path):
    stdout = run_reference(SCRIPT, tmp_path, timeout=240)
    out = json.loads(stdout.rsplit('RESULT ', 1)[1])
    everything = {k: True for k in ('BatchNorm', 'BN', 'BRN', 'user.Norm', 'user.Renorm')}
    assert out['replaced'] == everything, out
    assert out['ours'] == everything, out
    assert {'__main__', 'user_model', 'tensorpack.models'} <= set(out['patched_modules'])
    assert out['restored'] == everything, out
    assert out['theirs_after'] == everything, out

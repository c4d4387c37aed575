"""tf.distribute strategies in TF1 graphs are harnesses too: N replicas equal one device.

A model trained with ``strategy.run`` (the optimizer inside the replica
function, ``UPDATE_OPS`` as control dependencies, as TF1 code under
``MirroredStrategy`` does) with this library's layers equals the replaced
layer, tf-slim's ``batch_norm`` or tensorpack's ``BatchNorm`` run by the
libraries themselves in a subprocess, on one device with the concatenated
batch: the loss of every step, every variable after three SGD steps, the
moving statistics, identical on every replica. Uneven replicas, one of them
empty, included. Before, the layers normalized each replica with its own
statistics, silently (no collective op, no warning).
"""

import json

import numpy as np
import pytest
import tensorflow as tf

from legacy_reference import run_reference
from strategy_case import train
from tf1_syncbn import BatchNorm, CollectiveBackend, sync_batch_norm
from tower import TowerContext

tf1 = tf.compat.v1

LAYERS = {
    'slim': ('slim.batch_norm(x, scale=True, decay=0.9, is_training=True)',
             lambda x: sync_batch_norm(x, scale=True, decay=0.9)),
    'tensorpack': ("tensorpack_layer(x)",
                   lambda x: BatchNorm('bn', x, momentum=0.9, sync_statistics='auto')),
}
#: (name, layer, sizes per replica, strategy kind, mean_over_replicas)
CASES = [
    ('slim-mirrored-2-uneven', 'slim', [3, 5], 'mirrored', False),
    ('slim-mirrored-3-one-empty', 'slim', [3, 0, 5], 'mirrored', False),
    ('slim-mirrored-4-mean-loss', 'slim', [2, 2, 2, 2], 'mirrored', True),
    ('slim-central-2', 'slim', [5, 3], 'central', False),
    ('slim-one-device', 'slim', [8], 'one_device', False),
    ('slim-default-strategy', 'slim', [8], 'default', False),
    ('tensorpack-mirrored-2-uneven', 'tensorpack', [3, 5], 'mirrored', False),
    ('tensorpack-mirrored-4-mean-loss', 'tensorpack', [2, 2, 2, 2], 'mirrored', True),
]
IDS = [c[0] for c in CASES]

REFERENCE_SCRIPT = '''
import json, sys
import numpy as np
import tensorflow as tf
import tf_slim as slim
import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
tf_behavior.apply()
from tensorpack.models import BatchNorm
from tensorpack.tfutils.tower import TowerContext
from strategy_case import train


def tensorpack_layer(x):
    return BatchNorm('bn', x, momentum=0.9)


def tower_for(name):
    if name == 'tensorpack':     # tensorpack's own layers need its tower context
        return lambda: TowerContext('', is_training=True)
    return None

layers = json.loads(open(sys.argv[1]).read())
arrays = {}
for name, (code, total) in layers.items():
    layer = eval('lambda x: ' + code)
    for key, value in train(layer, [total], tower=tower_for(name)).items():
        arrays[name + '|' + key] = value
np.savez('strategy_reference.npz', **arrays)
print('RESULT strategy_reference.npz')
'''


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """The replaced layers on one device with the whole batch (8 examples), in one subprocess."""
    tmp = tmp_path_factory.mktemp('strategy_reference')
    layers = {name: (code, 8) for name, (code, _) in LAYERS.items()}
    (tmp / 'layers.json').write_text(json.dumps(layers))
    run_reference(REFERENCE_SCRIPT, tmp, args=[str(tmp / 'layers.json')], timeout=600)
    loaded = np.load(tmp / 'strategy_reference.npz')
    results = {name: {} for name in layers}
    for key in loaded.files:
        name, rest = key.split('|', 1)
        results[name][rest] = loaded[key]
    return results


def _assert_same(ours, ref, what):
    assert sorted(k for k in ours if not k.startswith('copies/')) == sorted(ref), what
    for key in sorted(ref):
        expected = ref[key].astype(np.float64)
        scale = max(np.abs(expected).max(), 1.0)
        np.testing.assert_allclose(ours[key], expected, rtol=1e-5, atol=2e-6 * scale,
                                   err_msg='%s: %s' % (what, key))


@pytest.mark.versions
@pytest.mark.parametrize('name,layer,sizes,kind,mean_loss', CASES, ids=IDS)
def test_replicas_equal_the_replaced_layer_on_one_device(reference, name, layer, sizes, kind,
                                                         mean_loss):
    ours = train(LAYERS[layer][1], sizes, kind, mean_over_replicas=mean_loss)
    _assert_same(ours, reference[layer], name)
    # Every replica holds the same values (mirrored variables, statistics included).
    for key, copies in ours.items():
        if key.startswith('copies/'):
            np.testing.assert_array_equal(copies, np.broadcast_to(copies[0], copies.shape),
                                          err_msg=key)
    if kind == 'mirrored':      # (CentralStorageStrategy keeps one copy, on its CPU)
        assert any(k.startswith('copies/') and ('moving' in k or 'EMA' in k) for k in ours)


@pytest.mark.versions
def test_without_the_library_the_replicas_would_differ_from_one_device(reference):
    """The comparison above can fail: per-replica statistics (sync_statistics=None) do."""
    ours = train(lambda x: sync_batch_norm(x, scale=True, decay=0.9, sync_statistics=None),
                 [3, 5], 'mirrored')
    with pytest.raises(AssertionError):
        _assert_same(ours, reference['slim'], 'per-replica statistics')


def _build_under_mirrored(layer, replicas=2):
    """Builds ``layer`` on ``[None, 3]`` placeholders in every replica; returns the graph."""
    graph = tf.Graph()
    with graph.as_default():
        strategy = tf1.distribute.MirroredStrategy(['/cpu:%d' % i for i in range(replicas)])
        with strategy.scope():
            strategy.run(lambda: layer(tf1.placeholder(tf.float32, [None, 3])))
    return graph


def _collectives(graph):
    return [op for op in graph.get_operations() if op.type == 'CollectiveReduce']


def test_auto_synchronizes_over_the_strategys_replicas():
    graph = _build_under_mirrored(lambda x: sync_batch_norm(x), replicas=4)
    collectives = _collectives(graph)
    assert len(collectives) == 4 and all(op.get_attr('group_size') == 4 for op in collectives)
    assert sorted(op.device for op in collectives) == [
        '/replica:0/task:0/device:CPU:%d' % i for i in range(4)]


def test_per_replica_statistics_are_asked_for_explicitly():
    graph = _build_under_mirrored(lambda x: sync_batch_norm(x, sync_statistics=None))
    assert not _collectives(graph)


def test_a_tower_context_inside_a_replica_is_an_error():
    def layer(x):
        with TowerContext('tower0', index=0, total=2):
            return sync_batch_norm(x)

    with pytest.raises(ValueError, match='Towers of two harnesses are being built at once'):
        _build_under_mirrored(layer)


def test_num_dev_that_disagrees_with_the_strategy_is_an_error():
    with pytest.raises(ValueError, match=r'num_dev=3 disagrees with the 2 towers of '
                                         r'tf.distribute MirroredStrategy'):
        _build_under_mirrored(lambda x: sync_batch_norm(x, num_dev=3))


@pytest.mark.parametrize('backend,match', [
    ('nccl', "needs every tower on a GPU"),
    (CollectiveBackend(num_workers=2), r'synchronizes 4 members, but .* has 2 towers in all'),
])
def test_a_backend_that_cannot_serve_the_strategys_group_is_an_error(backend, match):
    with pytest.raises(ValueError, match=match):
        _build_under_mirrored(lambda x: sync_batch_norm(x, sync_statistics=backend))


def test_checkpoints_move_between_the_strategy_and_one_device(tmp_path):
    """Same names and keys: a checkpoint written under the strategy restores without it."""
    layer = LAYERS['slim'][1]
    under = str(tmp_path / 'under_strategy')
    plain = str(tmp_path / 'plain')
    train(layer, [3, 5], 'mirrored', checkpoint_out=under)
    train(layer, [8], 'none', checkpoint_out=plain)
    # Continuing from either checkpoint, either way, gives the same training.
    for start in (under, plain):
        on_one = train(layer, [8], 'none', checkpoint_in=start)
        on_two = train(layer, [3, 5], 'mirrored', checkpoint_in=start)
        _assert_same({k: v for k, v in on_two.items() if not k.startswith('copies/')}, on_one,
                     'from %s' % start)

"""Batch Renormalization: every tower reads ``renorm_mean``/``renorm_stddev`` before their update.

``r`` and ``d`` come from the renorm statistics as they were before the step,
and the main tower updates them in the same step. Towers that do not wait for
the main tower's all-reduce (``sync_statistics=None``; the towers of other
sync groups) read them while the update may already have run: with tensorpack's
``BatchRenorm`` on ``TowerContext`` towers, 3 runs of 4 of the conformance
matrix's cell computed towers 1 to 3 with the updated values. Each tower's
read of them must be an ancestor of their updates, whichever tower builds
first, with ``training`` a Python bool or a tensor (a ``tf.cond`` whose
branches are functions in TF2 behaviour).
"""

import pytest
import tensorflow as tf
from tensorflow.python.ops import op_selector

from tf1_syncbn import CollectiveBackend, sync_batch_norm
from tower import call_for_each_tower, get_current_tower_context

tf1 = tf.compat.v1
TOWERS = 4
READS = ('ReadVariableOp', 'Snapshot')


def _ancestors(ops):
    """``ops`` and every op they wait for (data and control edges)."""
    return set(op_selector.get_backward_walk_ops(list(ops), control_inputs=True))


def _reads_of(graph, variable):
    """The ops of ``graph`` that copy ``variable``'s value (through identities)."""
    reads = []
    for op in graph.get_operations():
        if op.type not in READS:
            continue
        source = op.inputs[0]
        while source.op.type in ('Identity', 'RefIdentity'):
            source = source.op.inputs[0]
        if source.op.name == variable.op.name:
            reads.append(op)
    return reads


def _build(sync, group_size, tensor_training):
    graph = tf.Graph()
    with graph.as_default():
        training = tf1.placeholder_with_default(True, []) if tensor_training else True
        xs = [tf1.placeholder(tf.float32, [2, 3, 3, 4]) for _ in range(TOWERS)]

        def tower():
            index = get_current_tower_context().index
            return sync_batch_norm(xs[index], renorm=True, is_training=training,
                                   sync_statistics=sync, group_size=group_size, scope='bn')

        ys = call_for_each_tower(tower, ['/cpu:%d' % i for i in range(TOWERS)])
    return graph, ys


@pytest.mark.parametrize('tensor_training', [False, True], ids=['bool', 'tensor'])
@pytest.mark.parametrize('sync,group_size', [(None, None), ('collective', 2)],
                         ids=['per-tower', 'groups-of-2'])
def test_every_towers_renorm_reads_come_before_their_update(sync, group_size, tensor_training):
    backend = CollectiveBackend(timeout=60) if sync == 'collective' else None
    graph, ys = _build(backend, group_size, tensor_training)
    for name in ('renorm_mean', 'renorm_stddev'):
        variable, = [v for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
                     if v.op.name == 'bn/' + name]
        updates = [op for op in graph.get_operations()
                   if op.type in ('AssignSubVariableOp', 'AssignSub') and
                   variable.op.name in [t.op.name for t in op.inputs[:1]] +
                   [t.op.inputs[0].op.name for t in op.inputs[:1] if t.op.inputs]]
        assert updates, 'no update of %s' % name
        reads = [op for op in _reads_of(graph, variable)
                 if any(op in _ancestors([y.op]) for y in ys)]
        # One read per tower, each before the update (it waits for all of them).
        assert len({op.name.split('/')[0] for op in reads}) == TOWERS, \
            (name, [op.name for op in reads])
        before = _ancestors([op for op in updates])
        late = [op.name for op in reads if op not in before]
        assert not late, '%s read after its update may have run: %s' % (name, late)

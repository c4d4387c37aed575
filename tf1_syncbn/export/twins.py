"""The inference twin of each recorded layer call: one ``FusedBatchNormV3`` with the
moving statistics, built from the call's record (:mod:`tf1_syncbn._core.records`),
as the layer computes with ``is_training=False``."""

import tensorflow as tf

from tf1_syncbn._compute import math as _math
from tf1_syncbn.export import checks

tf1 = tf.compat.v1

__all__ = ['parameter_ops', 'build_twins']


def parameter_ops(records):
    """The op names of every variable and tensor the records' parameters read."""
    ops = []

    def visit(param):
        if param is None:
            return
        for part in param.get('parts', ()):
            visit(part)
        if 'variable' in param:
            ops.append(param['variable'])
        elif 'tensor' in param:
            ops.append(param['tensor'].rsplit(':', 1)[0])

    for record in records:
        if not record['in_function']:
            for key in ('gamma', 'beta', 'mean', 'variance'):
                visit(record[key])
    return ops


def _parameter(graph, param, channels):
    """A float32 ``[C]`` tensor of ``param`` in ``graph`` (imported), or None."""
    if param is None:
        return None
    if 'parts' in param:
        value = tf.concat([_parameter(graph, p, channels) for p in param['parts']], 0)
    elif 'variable' in param:
        handle = graph.get_tensor_by_name(param['variable'] + ':0')
        if param['op'] == 'VarHandleOp':
            value = tf.raw_ops.ReadVariableOp(resource=handle,
                                              dtype=tf.as_dtype(param['dtype']))
        else:   # a reference variable (TF1 behaviour)
            value = tf.identity(handle)
    elif 'tensor' in param:
        value = graph.get_tensor_by_name(param['tensor'])
    else:
        raise ValueError('tf1_syncbn.export: a batch-norm parameter came from %s, which '
                         'cannot be exported.' % param.get('unknown'))
    return tf.cast(tf.reshape(value, [channels]), tf.float32)


def build_twins(graph, records, input_map):
    """Builds every recorded call's inference op; returns ``{old output: new output}``."""
    present = {op.name for op in graph.get_operations()}
    twins = {}
    for record in records:
        if record['in_function'] or record.get('in_loop') or \
                record['output'].rsplit(':', 1)[0] not in present:
            continue
        name = record['input']
        x = twins[name] if name in twins else input_map[name] if name in input_map else \
            checks.tensor(graph, name, 'the record of %s' % record['layer'])
        if record.get('pivot'):
            # In a v1 tf.cond branch: alive only when the branch is taken, as the layer was.
            with tf.control_dependencies([graph.get_tensor_by_name(record['pivot']).op]):
                x = tf.identity(x)
        channels = record['channels']
        scope = record['output'].rsplit(':', 1)[0].rsplit('/', 1)[0]
        with tf1.name_scope('%s/%s/' % (checks.SCOPE, scope) if scope else '%s/' % checks.SCOPE):
            gamma = _parameter(graph, record['gamma'], channels)
            beta = _parameter(graph, record['beta'], channels)
            mean = _parameter(graph, record['mean'], channels)
            variance = _parameter(graph, record['variance'], channels)
            if gamma is None:
                gamma = tf.ones([channels], tf.float32)
            if beta is None:
                beta = tf.zeros([channels], tf.float32)
            x4, fmt = _math.canonical_view(x, record['channels_last'])
            y4, _ = _math.normalize(x4, gamma, beta, mean, variance, record['epsilon'], fmt,
                                    name='FusedBatchNormV3')
            y = y4 if x4 is x else tf.reshape(y4, tf.shape(x))
            y.set_shape(x.shape)
        twins[record['output']] = y
    return twins

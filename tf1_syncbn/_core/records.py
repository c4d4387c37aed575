"""What an inference twin of each batch-norm call needs, recorded in its graph.

Every call of :func:`tf1_syncbn._core.call.batch_norm` adds one JSON string to the
collection :data:`COLLECTION` of its root graph: the call's input and output
tensors, its layout and epsilon, and where its gamma, beta and moving
statistics come from (a variable's op, the partitions of a partitioned one,
or the tensor a ``custom_getter`` returned). No op is built, so recording
costs nothing per step; collections are saved in meta graphs, so a graph
imported with ``import_meta_graph`` keeps them. :mod:`tf1_syncbn.export`
reads them to replace each call with one inference ``FusedBatchNormV3``.

A record is a dict::

    {'version': 1, 'layer': "sync_batch_norm(tower_0/conv1/BatchNorm)",
     'input': 'tower_0/conv1/Conv2D:0', 'output': 'tower_0/conv1/BatchNorm/...:0',
     'in_function': False, 'function': None, 'pivot': None, 'in_loop': False,
     'rank': 4, 'channels_last': True, 'channels': 32,
     'epsilon': 0.001, 'gamma': None, 'beta': {'variable': 'conv1/BatchNorm/beta',
     'op': 'VarHandleOp', 'dtype': 'float32'}, 'mean': {...}, 'variance': {...}}

A parameter is None (no ``gamma``/``beta``: ones/zeros), ``{'variable': op
name, 'op': 'VarHandleOp' or 'VariableV2', 'dtype': ...}``, ``{'parts':
[parameters]}`` (a partitioned variable, concatenated), or ``{'tensor':
name}``. ``in_function`` marks a call built inside a ``tf.cond`` or
``tf.while_loop`` function body, which an exporter cannot rewire, and
``function`` names that body (the function's name in the graph's library).
In TF1 behaviour (v1 control flow), ``pivot`` names the tensor alive only
when the ``tf.cond`` branch holding the call is taken (None outside one),
and ``in_loop`` marks a call inside a v1 ``tf.while_loop``.
"""

import json

import tensorflow as tf

from tower.graph_state import root_graph

__all__ = ['COLLECTION', 'record', 'records']

#: The graph collection of the records (JSON strings).
COLLECTION = 'tf1_syncbn_inference_records'
_VERSION = 1


def _describe(value):
    """Where a parameter's value comes from (see the module docstring)."""
    if value is None:
        return None
    if isinstance(value, tf.Variable):
        return {'variable': value.op.name, 'op': value.op.type,
                'dtype': value.dtype.base_dtype.name}
    if isinstance(value, tf.Tensor):
        return {'tensor': value.name}
    try:
        parts = list(value)     # a PartitionedVariable: its partitions, in order
    except TypeError:
        return {'unknown': repr(value)}
    return {'parts': [_describe(part) for part in parts]}


def _v1_context(op):
    """``(pivot, in_loop)`` of ``op``'s v1 control flow context (TF1 behaviour).

    ``pivot`` names the tensor that is alive only when the innermost
    ``tf.cond`` branch holding ``op`` is taken (None outside one), which an
    inference op replacing ``op``'s layer must wait for; ``in_loop`` says a
    v1 ``tf.while_loop`` holds it (no exporter can rewire it).
    """
    context = getattr(op, '_get_control_flow_context', lambda: None)()
    pivot, in_loop = None, False
    while context is not None:
        if type(context).__name__ == 'WhileContext':
            in_loop = True
        elif pivot is None and getattr(context, 'pivot', None) is not None:
            pivot = context.pivot.name
        context = getattr(context, 'outer_context', None)
    return pivot, in_loop


def record(x, y, layout, options, params):
    """Adds the record of one call (input ``x``, output ``y``) to its root graph.

    Args:
      x: the call's input.
      y: its output, as the call returns it.
      layout: the input's :class:`~tf1_syncbn._core.options.Layout`.
      options: the call's :class:`~tf1_syncbn._core.options.Options`.
      params: its :class:`~tf1_syncbn._core.variables.Params`.
    """
    root = root_graph(y.graph)
    pivot, in_loop = _v1_context(y.op)
    text = json.dumps({
        'version': _VERSION, 'layer': options.layer, 'input': x.name, 'output': y.name,
        'in_function': x.graph is not root or y.graph is not root,
        'function': None if y.graph is root else getattr(y.graph, 'name', None),
        'pivot': pivot, 'in_loop': in_loop,
        'rank': layout.rank, 'channels_last': bool(layout.channels_last),
        'channels': layout.channels, 'epsilon': float(options.epsilon),
        'gamma': _describe(params.gamma), 'beta': _describe(params.beta),
        'mean': _describe(params.moving_mean), 'variance': _describe(params.moving_variance)})
    root.add_to_collection(COLLECTION, text)


def records(graph):
    """The records of ``graph``, in the order the calls were built."""
    return [json.loads(text) for text in graph.get_collection(COLLECTION)]

"""What the export does to ``GraphDef`` protos: the part some nodes need, without placement,
and the data inputs of the replaced layers pointed at their inference ops."""

import tensorflow as tf

tf1 = tf.compat.v1

__all__ = ['extract', 'rewire']


def extract(graph_def, names):
    """The part of ``graph_def`` that ``names`` need; unused functions dropped.

    Without placement: no device, and no colocation (``_class``), which would
    keep nodes the outputs do not need (an input that became a placeholder).
    """
    _strip_placement(graph_def)
    present = {node.name for node in graph_def.node}
    out = tf1.graph_util.extract_sub_graph(graph_def, [n for n in names if n in present])
    return _prune_library(out)


def _strip_placement(graph_def):
    """Clears the device and colocation of every node, in function bodies too.

    A ``tf.cond`` of control flow v2 (a tensor ``is_training``, ``slim.dropout``)
    is an ``If`` op whose branch functions keep the devices their ops were
    built on (``/device:GPU:0`` of the training tower), which a serving
    machine without that device refuses.
    """
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    for node in nodes:
        node.device = ''
        node.attr.pop('_class', None)


def _prune_library(graph_def):
    """``graph_def`` without the functions no node (or reachable function) calls."""
    functions = {f.signature.name: f for f in graph_def.library.function}
    used, todo = set(), [n for n in graph_def.node]
    while todo:
        node = todo.pop()
        for attr in node.attr.values():
            names = [attr.func.name] + [f.name for f in attr.list.func]
            for name in names:
                if name in functions and name not in used:
                    used.add(name)
                    todo.extend(functions[name].node_def)
    kept = [functions[name] for name in sorted(used)]
    del graph_def.library.function[:]
    graph_def.library.function.extend(kept)
    kept_gradients = [g for g in graph_def.library.gradient if g.function_name in used]
    del graph_def.library.gradient[:]
    graph_def.library.gradient.extend(kept_gradients)
    return graph_def


def rewire(graph_def, twins):
    """``graph_def`` with every data input that named a recorded output naming its twin."""
    renames = {}
    for old, new in twins.items():
        op, index = old.rsplit(':', 1)
        renames[old] = renames[op if index == '0' else old] = _input_name(new)
    for node in graph_def.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    return graph_def


def _input_name(tensor):
    op, index = tensor.name.rsplit(':', 1)
    return op if index == '0' else tensor.name

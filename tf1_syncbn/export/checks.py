"""What :mod:`tf1_syncbn.export` checks of its arguments and of the graph it exports.

Each check raises a ``TypeError`` or ``ValueError`` that names the argument
as the user spelled it and says what to do instead, before TensorFlow fails
in a way that does not name it (or, worse, exports a graph that serves
something else than the user meant: a ``placeholder_with_default`` kept at its
default, a constant TensorFlow accepts at export and aborts on at serving, a
share of the batch where the user meant the whole batch).

It also reads the layers' records (:mod:`tf1_syncbn._core.records`) of
a graph imported with ``import_meta_graph(..., import_scope=...)``:
TensorFlow prefixes the scope onto every string of a bytes-list collection
(``'restored/{...}'``), so the record's JSON follows the scope, and its
tensor and op names are those of the graph before the import.
"""

import json
import os
import re

import numpy as np
import tensorflow as tf

from tf1_syncbn._core import records as _inference_records
from tf1_syncbn.backends import all_op_type_prefixes
from tf1_syncbn.kernels import OP_TYPE_PREFIX

__all__ = ['session_graph', 'tensor', 'tensors', 'constant_values', 'distinct', 'export_dir',
           'consumed', 'records', 'check_needed', 'check_layers', 'check_exported',
           'FORBIDDEN_OP_PREFIXES', 'SCOPE', 'MODEL_SCOPE']

#: Op types an exported graph may not hold: the compiled library's ops, every
#: backend's communication library (TensorFlow's collectives, NCCL, Horovod:
#: what the backends declare) and Python ops (none of them loads without this process).
FORBIDDEN_OP_PREFIXES = ((OP_TYPE_PREFIX,) + all_op_type_prefixes() + ('PyFunc', 'EagerPyFunc'))
#: The name scope of the exporter's own ops while it works, and of the exported model's
#: (every op but the inputs and outputs, which take the names of their keys).
SCOPE = 'tf1_syncbn_export'
MODEL_SCOPE = 'model'
_NAME = re.compile(r'^[A-Za-z0-9.][A-Za-z0-9_.\-]*$')
_WHERE = 'tf1_syncbn.export'
_PLACEHOLDERS = ('Placeholder', 'PlaceholderV2')
_SPLITS = ('Split', 'SplitV')


def session_graph(session):
    """``session``'s graph; a ``TypeError`` naming ``session`` for anything else."""
    graph = getattr(session, 'graph', None)
    if not isinstance(graph, tf.Graph) or not callable(getattr(session, 'run', None)):
        raise TypeError('%s: session must be the tf.compat.v1.Session that holds the trained '
                        'variables (its graph is the one exported), got %r.' % (_WHERE, session))
    return graph


def constant_values(constants, tensor_of):
    """``{tensor: numpy value}`` of ``constants``, each value checked against its tensor.

    Args:
      constants: the user's ``constants`` (None, or ``{tensor or name: value}``).
      tensor_of: ``f(key, what)`` -> the tensor of the session's graph that
        ``key`` names (raising as the exporter does for ``inputs``).
    """
    if constants is None:
        return {}
    if not isinstance(constants, dict):
        raise TypeError('%s: constants must be a dict {tensor: value}, for example '
                        '{is_training: False}, got %r.' % (_WHERE, constants))
    values = {}
    for key, value in constants.items():
        tensor = tensor_of(key, 'constants')
        label = 'constants[%s]' % tensor.name
        dtype = tensor.dtype.base_dtype
        try:
            array = tf.make_ndarray(tf.make_tensor_proto(value, dtype))
        except (TypeError, ValueError) as e:
            raise TypeError('%s: %s = %r is no value of the tensor\'s dtype %s (%s); give a '
                            'value of that dtype (for a bool, True or False).'
                            % (_WHERE, label, value, dtype.name, e)) from None
        if not tensor.shape.is_compatible_with(array.shape):
            raise ValueError('%s: %s has the shape %s, which does not fit the tensor\'s shape '
                             '%s (a value fed for it would be refused too); give a value of '
                             'that shape (a scalar for a scalar placeholder).'
                             % (_WHERE, label, list(array.shape), tensor.shape))
        values[tensor] = array
    return values


def distinct(inputs, constants):
    """Raises when a tensor is given twice (two inputs, or an input and a constant)."""
    keys = {}
    for key, tensor in sorted(inputs.items()):
        if tensor.name in keys:
            raise ValueError('%s: inputs[%r] and inputs[%r] are both %s; serve a tensor once.'
                             % (_WHERE, keys[tensor.name], key, tensor.name))
        keys[tensor.name] = key
    for tensor in constants:
        if tensor.name in keys:
            raise ValueError('%s: %s is both inputs[%r] and a key of constants; a tensor is '
                             'either served or fixed.' % (_WHERE, tensor.name, keys[tensor.name]))


def export_dir(path):
    """``path`` as a string, if the SavedModel builder can write there; else raises."""
    where = _WHERE + '.export_saved_model'
    try:
        path = os.fspath(path)
    except TypeError:
        raise TypeError('%s: export_dir must be a path (a string), got %r.'
                        % (where, path)) from None
    if isinstance(path, bytes):
        path = path.decode('utf-8')
    if not path:
        raise ValueError('%s: export_dir is empty; name a directory that does not exist yet '
                         '(for example serving/1).' % where)
    if tf.io.gfile.exists(path):
        if not tf.io.gfile.isdir(path):
            raise ValueError('%s: export_dir %r exists and is no directory (a file?); name a '
                             'directory that does not exist yet (for example serving/1).'
                             % (where, path))
        if tf.io.gfile.listdir(path):
            raise ValueError('%s: export_dir %r is a directory that is not empty, which '
                             "TensorFlow's SavedModel builder refuses; name a new one (the next "
                             'version folder, serving/2) or empty it first.' % (where, path))
        return path
    parent = os.path.dirname(os.path.normpath(path))
    while parent and not tf.io.gfile.exists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if parent and tf.io.gfile.exists(parent) and not tf.io.gfile.isdir(parent):
        raise ValueError('%s: export_dir %r is inside %r, which is a file, not a directory; '
                         'name a directory elsewhere.' % (where, path, parent))
    return path


def _tensor_name(text):
    """A ``GraphDef`` data input (``op`` or ``op:i``) as a tensor name; None for ``^op``."""
    if text.startswith('^'):
        return None
    return text if ':' in text else text + ':0'


def consumed(graph_def):
    """The names of the tensors that the nodes of ``graph_def`` take as data inputs."""
    names = {_tensor_name(name) for node in graph_def.node for name in node.input}
    names.discard(None)
    return names


def records(graph):
    """The layers' records of ``graph``, with the scope of a scoped import applied.

    ``import_meta_graph(..., import_scope='restored')`` turns a record into
    ``'restored/{...}'``; its names then get the scope too, as the graph's
    ops did (``'restored/tower_0/...'``).
    """
    out = []
    for text in graph.get_collection(_inference_records.COLLECTION):
        if isinstance(text, bytes):
            text = text.decode('utf-8')
        start = text.find('{')
        prefix = text[:start] if start > 0 else ''
        try:
            if start < 0 or (prefix and not prefix.endswith('/')):
                raise ValueError('no JSON object after an import scope')
            record = json.loads(text[start:])
        except ValueError as e:
            raise ValueError(
                '%s: the graph collection %r holds %r, which is no record of this library (%s). '
                'Leave that collection to the library: it is how the exporter finds the '
                'batch-norm layers.' % (_WHERE, _inference_records.COLLECTION, text[:200], e)
            ) from None
        out.append(_in_scope(record, prefix) if prefix else record)
    return out


def _in_scope(record, prefix):
    """``record`` with ``prefix`` (``'scope/'``) before every op and tensor name."""
    for key in ('input', 'output', 'pivot'):
        if record.get(key):
            record[key] = prefix + record[key]

    def visit(param):
        if param is None:
            return
        for part in param.get('parts', ()):
            visit(part)
        for key in ('variable', 'tensor'):
            if key in param:
                param[key] = prefix + param[key]

    for key in ('gamma', 'beta', 'mean', 'variance'):
        visit(record.get(key))
    return record


def check_needed(graph_def, served, scope):
    """Raises when the graph the outputs need does not serve what the arguments say.

    Args:
      graph_def: the part of the exporter's work graph that the outputs need
        (training-graph names; the exporter's own ops under ``scope/``).
      served: ``{key: (placeholder op name, training-graph tensor name)}`` of
        ``inputs``.
      scope: the name scope of the exporter's own ops.
    """
    nodes = {node.name: node for node in graph_def.node}
    for key in sorted(served):
        placeholder, name = served[key]
        if placeholder not in nodes:
            raise ValueError(
                "%s: inputs[%r] = %s: no output depends on it (for example another tower's "
                "input than the outputs' tower); give the tensor the outputs' layers consume."
                % (_WHERE, key, name))
        _check_not_a_share(nodes, key, placeholder, name)
    left = sorted((node.name, node.op) for node in graph_def.node
                  if node.op in _PLACEHOLDERS + ('PlaceholderWithDefault',) and
                  not node.name.startswith(scope + '/'))
    if not left:
        return
    message = ("%s: the outputs need the training graph's placeholders %s, which are neither "
               'in inputs nor in constants; give each tensor in inputs (served) or in constants '
               '(for example constants={is_training: False}).'
               % (_WHERE, ', '.join(repr(name) for name, _ in left)))
    defaults = [name for name, op in left if op == 'PlaceholderWithDefault']
    if defaults:
        message += (' %s %s a placeholder_with_default: the export does not keep its default '
                    '(is_training defaulting to True would serve dropout and the training '
                    'mode).' % (', '.join(map(repr, defaults)),
                                'is' if len(defaults) == 1 else 'are each'))
    keras = [name for name in defaults if name.split('/')[-1] == 'keras_learning_phase']
    if keras:
        message += (" %r is Keras 2's learning phase: constants="
                    '{tf_keras.backend.learning_phase(): False}.' % keras[0])
    raise ValueError(message)


def _check_not_a_share(nodes, key, placeholder, name):
    """Raises when ``inputs[key]`` reaches the outputs only through a share of its batch.

    That is: every node that consumes it takes a constant part of its batch
    (axis 0) of which some rows are not needed: a ``tf.split`` along axis 0
    with some share unused, or a slice (``x[a:b]``, ``tf.slice``) of fixed rows.
    A full-batch placeholder split or sliced across the towers, given where
    tower 0's share was meant: the served graph would cut each request the
    same way and serve that share only (the exported placeholder's batch is
    free, so a slice of fixed rows also drops the rows of a larger request).
    """
    users = [node for node in nodes.values()
             if any(_tensor_name(i) == placeholder + ':0' for i in node.input)]
    if not users:
        return
    needed = {_tensor_name(i) for node in nodes.values() for i in node.input}
    shares = []
    for node in users:
        share = _share_of_batch(nodes, node, needed)
        if share is None:
            return
        shares.append(share)
    raise ValueError(
        '%s: inputs[%r] = %s reaches the outputs only through a share of its batch: %s. The '
        'served graph would cut each request the same way and serve only that share. Give '
        "the share the outputs' layers consume instead (tower 0's: tf.split(images, towers)[0])."
        % (_WHERE, key, name, '; '.join(shares)))


def _constant(nodes, tensor_name):
    """The value of a ``Const`` input (``'name'`` or ``'name:0'``), or None."""
    node = nodes.get(tensor_name.split(':')[0])
    if node is None or node.op != 'Const':
        return None
    return tf.make_ndarray(node.attr['value'].tensor)


def _share_of_batch(nodes, node, needed):
    """``'name (what)'`` when ``node`` passes on only some rows of its input's batch.

    None when it passes on the whole batch, or when constants cannot tell
    (then nothing is said).
    """
    if node.op in _SPLITS:
        axis = _constant(nodes, node.input[0 if node.op == 'Split' else 2])
        if axis is None or np.ndim(axis) != 0 or int(axis) != 0:
            return None
        count = node.attr['num_split'].i
        used = [i for i in range(count) if '%s:%d' % (node.name, i) in needed]
        if len(used) == count:
            return None
        return '%s (share %s of %d)' % (node.name, ', '.join(map(str, used)), count)
    if node.op == 'Slice':
        begin, size = _constant(nodes, node.input[1]), _constant(nodes, node.input[2])
        if begin is None or size is None or np.ndim(begin) != 1 or not len(begin):
            return None
        first, count = int(begin[0]), int(size[0])
        if first == 0 and count == -1:
            return None
        return '%s (rows %d:%s)' % (node.name, first, '' if count == -1 else first + count)
    if node.op == 'StridedSlice':
        values = [_constant(nodes, node.input[i]) for i in (1, 2, 3)]
        if any(v is None or np.ndim(v) != 1 or not len(v) for v in values):
            return None
        (begin, end, stride), masks = [int(v[0]) for v in values], node.attr
        if masks['ellipsis_mask'].i & 1 or masks['new_axis_mask'].i & 1 or stride < 1:
            return None     # axis 0 of the slice is not the batch's, or runs backwards
        if masks['shrink_axis_mask'].i & 1:
            return '%s (row %d)' % (node.name, begin)
        first = 0 if masks['begin_mask'].i & 1 else begin
        stop = None if masks['end_mask'].i & 1 else end
        if first == 0 and stop is None and stride == 1:
            return None
        return '%s (rows %d:%s%s)' % (node.name, first, '' if stop is None else stop,
                                      ':%d' % stride if stride != 1 else '')
    return None


def tensor(graph, value, what):
    """``value`` (a tensor, or a tensor's name) as a tensor of ``graph``."""
    if isinstance(value, str):
        try:
            return graph.get_tensor_by_name(value)
        except (KeyError, ValueError) as e:
            raise ValueError('tf1_syncbn.export: %s names %r, which is no tensor of the '
                             "session's graph (%s)." % (what, value, e)) from None
    if isinstance(value, tf.Variable):
        value = value.value()
    if not isinstance(value, tf.Tensor):
        raise TypeError('tf1_syncbn.export: %s must hold tensors (or their names), got %r.'
                        % (what, value))
    if value.graph is not graph:
        raise ValueError("tf1_syncbn.export: %s holds %s, which is not in the session's graph."
                         % (what, value.name))
    return value


def tensors(graph, mapping, what):
    if not isinstance(mapping, dict):
        raise TypeError('tf1_syncbn.export: %s must be a dict {name: tensor}, got %r.'
                        % (what, mapping))
    out = {}
    for key, value in mapping.items():
        if not isinstance(key, str) or not _NAME.match(key) or key == MODEL_SCOPE or \
                key.startswith(SCOPE):
            raise ValueError('tf1_syncbn.export: %s key %r is not a usable op name (letters, '
                             "digits, '_', '.', '-'; not %r)." % (what, key, MODEL_SCOPE))
        out[key] = tensor(graph, value, '%s[%r]' % (what, key))
    return out


def check_layers(graph_def, records):
    """Raises when the outputs need a layer inside a function body (not replaced).

    Call it before freezing, which renames the functions it rewrites.
    """
    functions = {f.signature.name for f in graph_def.library.function}
    nodes = {node.name for node in graph_def.node}
    kept = sorted({r['layer'] for r in records if r.get('function') in functions or
                   (r.get('in_loop') and r['output'].rsplit(':', 1)[0] in nodes)})
    if kept:
        raise ValueError(
            'tf1_syncbn.export: the outputs need layers built inside a tf.cond or '
            'tf.while_loop function body, or inside a while loop, which the exporter cannot '
            'replace by their inference op: %s. Build them outside it, or build the inference '
            'model with is_training=False.' % ', '.join(kept[:5]))


def check_exported(graph_def, placeholders):
    """Raises when the graph holds ops that need this library, or an unfed placeholder."""
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    bad = sorted({'%s (%s)' % (n.name, n.op) for n in nodes
                  if n.op.startswith(FORBIDDEN_OP_PREFIXES)})
    if bad:
        raise ValueError(
            'tf1_syncbn.export: the outputs still need ops that only this library or this '
            'process can run: %s%s. Export outputs that do not depend on them (a py_func of '
            'your own cannot be exported).' % (
                ', '.join(bad[:5]), ' and %d more' % (len(bad) - 5) if len(bad) > 5 else ''))
    unfed = sorted(n.name for n in graph_def.node
                   if n.op in ('Placeholder', 'PlaceholderV2') and n.name not in placeholders)
    if unfed:
        raise ValueError(
            'tf1_syncbn.export: the outputs need the placeholders %s (names in the exported '
            "graph); give each tensor in inputs (served) or in constants (for example "
            '{is_training: False}).' % ', '.join(unfed))

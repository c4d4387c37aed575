"""Inference graphs from training graphs: a frozen ``GraphDef`` or a SavedModel.

A training graph of this library's layers holds what serving cannot load:
all-reduces between towers (``CollectiveReduce``, ``NcclAllReduce``, Horovod's), the
compiled kernels and the step watchdog (``SyncBn*`` ops), and, with a tensor
``is_training``, a ``tf.cond`` per layer whose training branch holds them.
TensorFlow's own ``convert_variables_to_constants`` keeps all of them, even
on the inference outputs of one tower.

:func:`inference_graph_def` takes a session holding a trained graph (built
with any front-end, on any number of towers, with a Python or tensor
``is_training``; also one imported with ``import_meta_graph`` and restored)
and returns a frozen ``GraphDef`` of the outputs you name, usually tower 0's,
in which every batch-norm call is one inference ``FusedBatchNormV3`` with the
moving statistics (as the layers compute with ``is_training=False``; renorm
and ``fused=False`` layers included). :func:`export_saved_model` writes the
same graph as a SavedModel with a ``serving_default`` signature. Both hold
plain TensorFlow ops only: they load and run where this library is not
installed (``tf.saved_model.load``, TensorFlow Serving, ``tf.import_graph_def``).

How: every layer call records in its graph what such an op needs (its input
and output, variables, epsilon and layout; :mod:`tf1_syncbn._core.records`,
a collection of strings, which meta graphs keep). The exporter imports the
graph into a fresh one (with the named inputs as new placeholders whose batch
dimension is free, and the named constants fed in), builds the inference op
of each layer from its record, points the consumers of the layer's output at
it, keeps the part of the graph the outputs need, and freezes its variables
with ``convert_variables_to_constants``. The session's graph is not changed.

Example (tower 0 of a 4-tower training graph, ``is_training`` a placeholder)::

    # Fragment
    graph_def = tf1_syncbn.export.inference_graph_def(
        sess, inputs={'images': image_parts[0]}, outputs={'logits': tower_logits[0]},
        constants={is_training: False})
    tf1_syncbn.export.export_saved_model(sess, 'serving/1', {'images': image_parts[0]},
                                         {'logits': tower_logits[0]}, {is_training: False})

Layers built inside a user's ``tf.cond``/``tf.while_loop`` function body
(control flow v2) cannot be rewired; the exporter then fails, naming them.
Arguments that would export something else than they say (a placeholder
left at its default, the full batch where a tower's share was meant, a
constant that does not fit its tensor) fail too, naming the argument
(:mod:`tf1_syncbn.export.checks`).
"""

import re

import tensorflow as tf

from tf1_syncbn._compute import math as _math
from tf1_syncbn.backends import all_op_type_prefixes
from tf1_syncbn.kernels import OP_TYPE_PREFIX
from tf1_syncbn.export import checks as _checks

tf1 = tf.compat.v1

__all__ = ['inference_graph_def', 'export_saved_model', 'FORBIDDEN_OP_PREFIXES']

#: Op types an exported graph may not hold: the compiled library's ops, every
#: backend's communication library (TensorFlow's collectives, NCCL, Horovod:
#: what the backends declare) and Python ops (none of them loads without this process).
FORBIDDEN_OP_PREFIXES = ((OP_TYPE_PREFIX,) + all_op_type_prefixes() + ('PyFunc', 'EagerPyFunc'))
_SCOPE = 'tf1_syncbn_export'
_NAME = re.compile(r'^[A-Za-z0-9.][A-Za-z0-9_.\-]*$')
_MODEL_SCOPE = 'model'


def inference_graph_def(session, inputs, outputs, constants=None):
    """A frozen inference ``GraphDef`` of ``outputs``, with plain TensorFlow ops only.

    Args:
      session: a ``tf.compat.v1.Session`` whose graph is the training graph
        and which holds the trained variable values (initialized or restored;
        also a graph imported with ``import_meta_graph``, with or without an
        ``import_scope``).
      inputs: ``{name: tensor}``: tensors of the training graph that become
        the exported graph's placeholders, named ``name``: the tensor the
        exported tower's layers consume (tower 0's share of the batch, for
        example ``tf.split(images, 4)[0]``, not ``images``, which would serve
        that share of each request only). Their batch dimension becomes free
        (``None``). A tensor may be given by its name (``'tower_0/images:0'``).
      outputs: ``{name: tensor}``: the tensors to export (tower 0's logits),
        which become ``Identity`` ops named ``name``.
      constants: ``{tensor: value}``: tensors of the training graph replaced
        by constants, for example ``{is_training: False}`` or a dropout rate;
        each value must fit its tensor's dtype and shape (as a fed value);
        those no output needs are ignored. A ``placeholder_with_default`` the
        outputs need must be given here (or in ``inputs``): its default is
        not kept.

    Returns:
      A ``GraphDef`` with placeholders and outputs named by the keys of
      ``inputs`` and ``outputs``, the rest under ``model/``; no variable, no
      device, no colocation (in function bodies neither).

    Raises:
      TypeError: naming the argument: ``session`` that is no session,
        ``inputs``, ``outputs`` or ``constants`` that is no dict, a value of
        ``constants`` of another dtype.
      ValueError: naming the argument: a name that is no valid op name or a
        tensor given twice, a tensor of another graph, a constant of another
        shape, an input no output depends on, an input the outputs reach
        only through a share of its batch (a ``tf.split`` along the batch,
        or a slice of fixed rows: the full batch where a tower's share was
        meant), a placeholder (``placeholder_with_default``
        included) the outputs need that is neither an input nor a constant,
        or library ops, collectives or Python ops the outputs still need (a
        layer inside a ``tf.cond`` function body, a user's ``py_func``), with
        the ops named.

    Hangs: never; runs no training op (only reads the variables).
    """
    graph = _checks.session_graph(session)
    inputs = _tensors(graph, inputs, 'inputs')
    outputs = _tensors(graph, outputs, 'outputs')
    if not outputs:
        raise ValueError('tf1_syncbn.export: outputs is empty; name at least one tensor.')
    clash = sorted(set(inputs) & set(outputs))
    if clash:
        raise ValueError('tf1_syncbn.export: %s named both in inputs and outputs; give every '
                         'tensor its own name.' % clash)
    fixed = _checks.constant_values(constants, lambda key, what: _tensor(graph, key, what))
    _checks.distinct(inputs, fixed)
    records = _checks.records(graph)
    source = _extract(graph.as_graph_def(), [t.op.name for t in outputs.values()] +
                      _parameter_ops(records))
    consumed = _checks.consumed(source)
    output_names = {t.name for t in outputs.values()}

    work = tf.Graph()
    with work.as_default(), tf1.name_scope(_SCOPE + '/'):
        served, input_map = {}, {}
        for i, (key, tensor) in enumerate(sorted(inputs.items())):
            if tensor.name not in consumed and tensor.name not in output_names:
                raise ValueError('tf1_syncbn.export: inputs[%r] = %s: no output depends on it '
                                 "(for example another tower's input than the outputs' "
                                 "tower); give the tensor the outputs' layers consume."
                                 % (key, tensor.name))
            served[tensor.name] = tf1.placeholder(tensor.dtype.base_dtype,
                                                  _free_batch(tensor.shape),
                                                  name='input_%d' % i)
            if tensor.name in consumed:
                input_map[tensor.name] = served[tensor.name]
        for i, (tensor, value) in enumerate(fixed.items()):
            if tensor.name in consumed:
                input_map[tensor.name] = tf.constant(value, tensor.dtype.base_dtype,
                                                     name='constant_%d' % i)
    with work.as_default():
        tf.import_graph_def(source, input_map=input_map, name='')
        twins = _build_twins(work, records, input_map)
        with tf1.name_scope(_SCOPE + '/'):
            names = {key: tf.identity(served.get(t.name, work.get_tensor_by_name(t.name)),
                                      name='output_%d' % i).op.name
                     for i, (key, t) in enumerate(sorted(outputs.items()))}
    rewired = _rewire(work.as_graph_def(), twins)
    needed = _extract(rewired, list(names.values()))
    placeholders = {key: served[inputs[key].name].op.name for key in inputs}
    _checks.check_needed(needed, {key: (placeholders[key], inputs[key].name) for key in inputs},
                         _SCOPE)
    _check_layers(needed, records)
    frozen = tf1.graph_util.convert_variables_to_constants(session, needed,
                                                           list(names.values()))
    return _finish(frozen, placeholders, names, inputs)


def export_saved_model(session, export_dir, inputs, outputs, constants=None):
    """Writes :func:`inference_graph_def`'s graph as a SavedModel (``serving_default``).

    Args:
      session, inputs, outputs, constants: as for :func:`inference_graph_def`;
        the signature's inputs and outputs are named by the keys.
      export_dir: a directory that does not exist yet (or is empty).

    Returns:
      ``export_dir``. It loads with ``tf.saved_model.load(export_dir)`` (whose
      ``signatures['serving_default'](**{name: tensor})`` returns ``{name:
      tensor}``) or ``tf.compat.v1.saved_model.load``, without this library.

    Raises:
      As :func:`inference_graph_def`; also ``TypeError`` when ``export_dir``
      is no path, ``ValueError`` when it is a file, inside one, or a
      directory that is not empty (checked before anything is exported).
    """
    export_dir = _checks.export_dir(export_dir)
    graph_def = inference_graph_def(session, inputs, outputs, constants)
    graph = tf.Graph()
    with graph.as_default():
        tf.import_graph_def(graph_def, name='')
        signature = tf1.saved_model.signature_def_utils.predict_signature_def(
            inputs={k: graph.get_tensor_by_name(k + ':0') for k in inputs},
            outputs={k: graph.get_tensor_by_name(k + ':0') for k in outputs})
        with tf1.Session(graph=graph) as sess:
            builder = tf1.saved_model.Builder(export_dir)
            builder.add_meta_graph_and_variables(
                sess, [tf1.saved_model.tag_constants.SERVING],
                signature_def_map={'serving_default': signature}, strip_default_attrs=True)
            builder.save()
    return export_dir


def _tensor(graph, value, what):
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


def _tensors(graph, mapping, what):
    if not isinstance(mapping, dict):
        raise TypeError('tf1_syncbn.export: %s must be a dict {name: tensor}, got %r.'
                        % (what, mapping))
    out = {}
    for key, value in mapping.items():
        if not isinstance(key, str) or not _NAME.match(key) or key == _MODEL_SCOPE or \
                key.startswith(_SCOPE):
            raise ValueError('tf1_syncbn.export: %s key %r is not a usable op name (letters, '
                             "digits, '_', '.', '-'; not %r)." % (what, key, _MODEL_SCOPE))
        out[key] = _tensor(graph, value, '%s[%r]' % (what, key))
    return out


def _free_batch(shape):
    if shape.ndims is None or shape.ndims == 0:
        return shape
    return tf.TensorShape([None]).concatenate(shape[1:])


def _parameter_ops(records):
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


def _extract(graph_def, names):
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


def _build_twins(graph, records, input_map):
    """Builds every recorded call's inference op; returns ``{old output: new output}``."""
    present = {op.name for op in graph.get_operations()}
    twins = {}
    for record in records:
        if record['in_function'] or record.get('in_loop') or \
                record['output'].rsplit(':', 1)[0] not in present:
            continue
        name = record['input']
        x = twins[name] if name in twins else input_map[name] if name in input_map else \
            _tensor(graph, name, 'the record of %s' % record['layer'])
        if record.get('pivot'):
            # In a v1 tf.cond branch: alive only when the branch is taken, as the layer was.
            with tf.control_dependencies([graph.get_tensor_by_name(record['pivot']).op]):
                x = tf.identity(x)
        channels = record['channels']
        scope = record['output'].rsplit(':', 1)[0].rsplit('/', 1)[0]
        with tf1.name_scope('%s/%s/' % (_SCOPE, scope) if scope else '%s/' % _SCOPE):
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


def _rewire(graph_def, twins):
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


def _finish(frozen, placeholders, names, inputs):
    """Names the inputs and outputs by their keys, checks the ops and strips placement."""
    graph = tf.Graph()
    with graph.as_default():
        new = {key: tf1.placeholder(inputs[key].dtype.base_dtype,
                                    _free_batch(inputs[key].shape), name=key)
               for key in sorted(placeholders)}
        results = tf.import_graph_def(
            frozen, input_map={placeholders[k] + ':0': new[k] for k in placeholders},
            return_elements=[names[k] + ':0' for k in sorted(names)], name=_MODEL_SCOPE)
        for key, tensor in zip(sorted(names), results):
            out = tf.identity(tensor, name=key)
            if out.op.name != key:
                raise ValueError('tf1_syncbn.export: outputs key %r clashes with another name '
                                 'of the exported graph; choose another.' % key)
    graph_def = _extract(graph.as_graph_def(), sorted(names) + sorted(new))
    _check(graph_def, set(new))
    return graph_def


def _check_layers(graph_def, records):
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


def _check(graph_def, placeholders):
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

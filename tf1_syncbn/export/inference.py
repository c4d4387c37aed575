"""The export itself: :func:`inference_graph_def` and :func:`export_saved_model`.

How (see :mod:`tf1_syncbn.export`): the training graph, imported into a fresh
one with the named inputs as new placeholders and the named constants fed in;
each recorded layer call replaced by its inference twin
(:mod:`~tf1_syncbn.export.twins`) by pointing its consumers at it
(:mod:`~tf1_syncbn.export.graph_defs`); the part the outputs need, frozen,
and checked (:mod:`~tf1_syncbn.export.checks`).
"""

import tensorflow as tf

from tf1_syncbn.export import checks
from tf1_syncbn.export.graph_defs import extract, rewire
from tf1_syncbn.export.twins import build_twins, parameter_ops

tf1 = tf.compat.v1

__all__ = ['inference_graph_def', 'export_saved_model']


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
    graph = checks.session_graph(session)
    inputs = checks.tensors(graph, inputs, 'inputs')
    outputs = checks.tensors(graph, outputs, 'outputs')
    if not outputs:
        raise ValueError('tf1_syncbn.export: outputs is empty; name at least one tensor.')
    clash = sorted(set(inputs) & set(outputs))
    if clash:
        raise ValueError('tf1_syncbn.export: %s named both in inputs and outputs; give every '
                         'tensor its own name.' % clash)
    fixed = checks.constant_values(constants, lambda key, what: checks.tensor(graph, key, what))
    checks.distinct(inputs, fixed)
    records = checks.records(graph)
    source = extract(graph.as_graph_def(), [t.op.name for t in outputs.values()] +
                      parameter_ops(records))
    consumed = checks.consumed(source)
    output_names = {t.name for t in outputs.values()}

    work = tf.Graph()
    with work.as_default(), tf1.name_scope(checks.SCOPE + '/'):
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
        twins = build_twins(work, records, input_map)
        with tf1.name_scope(checks.SCOPE + '/'):
            names = {key: tf.identity(served.get(t.name, work.get_tensor_by_name(t.name)),
                                      name='output_%d' % i).op.name
                     for i, (key, t) in enumerate(sorted(outputs.items()))}
    rewired = rewire(work.as_graph_def(), twins)
    needed = extract(rewired, list(names.values()))
    placeholders = {key: served[inputs[key].name].op.name for key in inputs}
    checks.check_needed(needed, {key: (placeholders[key], inputs[key].name) for key in inputs},
                         checks.SCOPE)
    checks.check_layers(needed, records)
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
    export_dir = checks.export_dir(export_dir)
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


def _free_batch(shape):
    if shape.ndims is None or shape.ndims == 0:
        return shape
    return tf.TensorShape([None]).concatenate(shape[1:])


def _finish(frozen, placeholders, names, inputs):
    """Names the inputs and outputs by their keys, checks the ops and strips placement."""
    graph = tf.Graph()
    with graph.as_default():
        new = {key: tf1.placeholder(inputs[key].dtype.base_dtype,
                                    _free_batch(inputs[key].shape), name=key)
               for key in sorted(placeholders)}
        results = tf.import_graph_def(
            frozen, input_map={placeholders[k] + ':0': new[k] for k in placeholders},
            return_elements=[names[k] + ':0' for k in sorted(names)], name=checks.MODEL_SCOPE)
        for key, tensor in zip(sorted(names), results):
            out = tf.identity(tensor, name=key)
            if out.op.name != key:
                raise ValueError('tf1_syncbn.export: outputs key %r clashes with another name '
                                 'of the exported graph; choose another.' % key)
    graph_def = extract(graph.as_graph_def(), sorted(names) + sorted(new))
    checks.check_exported(graph_def, set(new))
    return graph_def

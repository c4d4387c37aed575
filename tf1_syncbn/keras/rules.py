"""tf-keras' rules for ``BatchNormalization``, as :mod:`tf1_syncbn.keras` translates them.

What tf-keras' ``BatchNormalizationBase.call`` decides before it computes
anything, in small pure functions: which value ``training`` has, which axes
hold the channels, whether the call builds the model's own one-device graph;
and how its ``build`` aggregates the moving statistics under a
``tf.distribute`` strategy when the layer has sync groups.
(Whether the batch is split into ghost batches is tf.layers' rule, the same
code: :func:`tf1_syncbn._frontend.keras2.ghost_batches_in_training`.) Nothing here imports
tf-keras: the layer passes in what it read from tf-keras.

And the layer's arguments in tf-keras' words, in one place: its names for the
core's options (:data:`ARG_NAMES`), where tf-keras' v1 constructor takes
``axis`` and ``fused`` by position (:func:`v1_axis_and_fused`), and the
arguments this library adds in the layer's config (:func:`sync_config`).
"""

import inspect
import os
import warnings

import tensorflow as tf

__all__ = ['ARG_NAMES', 'v1_axis_and_fused', 'sync_config', 'training_value',
           'keras_channel_axes', 'is_model_graph_call', 'check_keras_graph',
           'statistics_aggregation']

tf1 = tf.compat.v1

#: The core's option -> tf-keras' argument, where they differ.
ARG_NAMES = {'is_training': 'training'}


def v1_axis_and_fused(args, kwargs):
    """``(axis, fused)`` as tf-keras' v1 ``BatchNormalization`` received them.

    By keyword, or by position: ``BatchNormalizationBase``'s ``axis`` is its
    first argument and ``fused`` its seventeenth.
    """
    return (args[0] if args else kwargs.get('axis', -1),
            args[16] if len(args) > 16 else kwargs.get('fused'))


def sync_config(config, layer, sync_statistics, num_dev, group_size):
    """tf-keras' ``config``, plus this library's arguments where they are not the defaults.

    Args:
      config: what tf-keras' ``get_config`` returned (completed in place).
      layer: the layer's name for the warning.
      sync_statistics, num_dev, group_size: the layer's arguments.

    Returns:
      ``config``. A ``sync_statistics`` backend object cannot be serialized:
      it is left out, with a warning (a layer made from the config uses
      ``'auto'``).
    """
    for name, value in (('num_dev', num_dev), ('group_size', group_size)):
        if value is not None:
            config[name] = value
    if sync_statistics is None or (isinstance(sync_statistics, str) and
                                   sync_statistics != 'auto'):
        config['sync_statistics'] = sync_statistics
    elif not isinstance(sync_statistics, str):
        warnings.warn('%s: sync_statistics=%r is an object and cannot be serialized; it is '
                      "left out of the config (a layer made from it uses 'auto')."
                      % (layer, sync_statistics))
    return config


def training_value(training):
    """tf-keras' ``training`` (after ``_get_training_value``) as the core takes it.

    Args:
      training: a Python bool or int (``K.set_learning_phase(1)`` gives an
        int), a bool or numeric scalar tensor (``K.learning_phase()``), or None.

    Returns:
      A Python bool where the value is known at graph build (None is False:
      tf-keras' v1 layer reads None as inference), else a scalar bool tensor.
    """
    if training is None:
        return False
    if not tf.is_tensor(training) and not isinstance(training, tf.Variable):
        return bool(training)
    static = tf.get_static_value(training)
    if static is not None:
        return bool(static)
    training = tf.convert_to_tensor(training)
    if training.dtype.base_dtype != tf.bool:
        training = tf.cast(training, tf.bool)
    return training


def keras_channel_axes(layer, axes, axis_argument, virtual_batch_size):
    """The channel axes of a built tf-keras layer, as the input's axes (no batch axis).

    Args:
      layer: the layer's name for messages.
      axes: tf-keras' ``self.axis`` after ``build`` (non-negative ints, each
        shifted by one with ``virtual_batch_size``: the axis Keras inserts).
      axis_argument: ``axis`` as the user passed it, for messages.
      virtual_batch_size: tf-keras' ``virtual_batch_size`` (or None).

    Returns:
      A list of ints in ``[1, rank)``: one channel axis 1 or last goes to the
      core as it is, any other form through a view (:mod:`tf1_syncbn._frontend.axes`).

    Raises:
      ValueError: for the batch axis 0, which normalizes every example by
        its own statistics (tf-keras takes it without ``virtual_batch_size``,
        with variables the size of the batch, which no towers can share).
    """
    axes = [int(a) - (1 if virtual_batch_size is not None else 0) for a in axes]
    if 0 in axes:
        if not isinstance(axis_argument, int):
            axis_argument = [int(a) for a in axis_argument]    # not Keras' ListWrapper
        raise ValueError(
            '%s: axis=%r includes the batch axis 0: that normalizes each example by its own '
            'statistics, with variables the size of the batch, which towers of other sizes '
            'cannot share; this layer normalizes over the batch. Pass the channel axis or '
            'axes.' % (layer, axis_argument))
    return axes


#: Keras 2's ``Model.build``: where it is defined (``tf_keras/src/...``, and
#: ``keras/src/...`` in TensorFlow 2.15's Keras 2.15; the suffix matches both).
_MODEL_BUILD = ('build', os.path.join('keras', 'src', 'engine', 'training.py'))


def in_keras_model_build():
    """Whether the call comes from tf-keras' ``Model.build(input_shape)``.

    In a TF1 graph, ``model.build((None, 3))`` calls the model on
    placeholders it makes for the purpose (without Keras' history), only to
    create the weights; nothing feeds or runs that graph. Such a call, made
    before the towers are built, normalizes on one device like the model's
    own graph (:func:`is_model_graph_call`). Found on the Python stack.
    """
    frame = inspect.currentframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == _MODEL_BUILD[0] and code.co_filename.endswith(_MODEL_BUILD[1]):
            return True
        frame = frame.f_back
    return False


def is_model_graph_call(inputs):
    """Whether a call builds a functional model's own graph on its ``keras.Input`` placeholders.

    In a TF1 graph, Keras' functional API calls every layer once on the
    model's inputs when the model is constructed (``ResNet50(...)``,
    ``Model(inputs, outputs)``). With ``keras.Input(shape=...)`` those are
    placeholders of the model's own, which the towers do not feed (they call
    the model on their batches), wherever the model was constructed: such a
    call normalizes its batch on one device, whatever ``num_dev`` and the
    tower context say (a tower's member that the other towers never build
    would leave its group incomplete). A model constructed on a tower's
    tensor (``keras.Input(tensor=images)``, as tensorpack's
    ``KerasModelCaller`` does in its first tower) is that tower's.

    A layer called inside another layer's ``call`` (``TimeDistributed``, a
    custom layer's ``self.bn(tf.nn.relu(x))``) gets a tensor without Keras'
    history: the graph is then followed back from it, through TensorFlow's
    ops, to the tensors that have one (:func:`_derived_from_model_inputs`).

    Returns:
      True when ``inputs`` carry Keras' history back to input layers that
      created their placeholders, and to nothing else.
    """
    history = getattr(inputs, '_keras_history', None)
    if history is None:
        return _derived_from_model_inputs(inputs)
    return _history_from_placeholders(history)


def _history_from_placeholders(history):
    """Whether Keras' history leads back to input layers that made placeholders, and only there."""
    nodes = getattr(history.layer, '_inbound_nodes', None) or []
    stack = nodes[history.node_index:history.node_index + 1]
    seen, found = set(), False
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        parents = list(getattr(node, 'parent_nodes', ()))
        if not parents:
            if getattr(node.layer, 'is_placeholder', None) is not True:
                return False        # a tower's tensor, or something Keras did not make
            found = True
        stack.extend(parents)
    return found


#: Ops a walk back from a tensor without Keras' history visits at most.
_MAX_WALK = 2000


def _derived_from_model_inputs(tensor):
    """Whether a tensor without Keras' history is computed from the model's own inputs only.

    Follows the tensor's ops back (data inputs) and stops at tensors with
    Keras' history: true when it meets at least one, every one it meets
    leads back to the model's placeholders (:func:`_history_from_placeholders`),
    and no placeholder without history (a tower's data) is on the way.
    Constants and variables are neither.
    """
    if not tf.is_tensor(tensor) or not hasattr(tensor, 'op'):
        return False
    stack, seen, found = [tensor], set(), False
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if len(seen) > _MAX_WALK:
            return False
        history = getattr(t, '_keras_history', None)
        if history is not None:
            if not _history_from_placeholders(history):
                return False
            found = True
            continue
        if t.op.type == 'Placeholder':
            return False
        stack.extend(t.op.inputs)
    return found


def check_keras_graph(layer):
    """Raises ``RuntimeError`` outside a TF1 graph (eager execution, ``tf.function``).

    The layer builds TF1-style graphs (sessions, ``layer.updates``), where
    tf-keras runs its v1 layer machinery; Keras 3 and TF2 eager training are
    out of its scope.
    """
    if tf.executing_eagerly() or tf1.executing_eagerly_outside_functions():
        raise RuntimeError(
            '%s is called eagerly or inside a tf.function (TF2 Keras): it synchronizes '
            'batch norm in TF1-style graphs (sessions, layer.updates) only. Build the model '
            'inside `with tf.Graph().as_default():` or after '
            'tf.compat.v1.disable_eager_execution(); in TF2 code use '
            'tf.keras.layers.BatchNormalization(synchronized=True) under a tf.distribute '
            'strategy.' % layer)


def statistics_aggregation(aggregation, synchronization, group_size, sync_statistics):
    """The aggregation of a weight tf-keras' ``build`` adds: its own, but replica 0's with groups.

    tf-keras creates the moving statistics (``moving_mean``,
    ``moving_variance``; with renorm ``moving_stddev``, ``renorm_mean``,
    ``renorm_stddev``) as on-read variables (``ON_READ``) with ``MEAN``
    aggregation: under a ``tf.distribute`` strategy each replica updates its
    own copy, and reading the variable across replicas, a ``Saver``,
    ``save_weights`` and ``get_weights`` take the mean of the copies; a
    restore sets every copy. Without sync groups every replica updates its
    copy with the same statistics (the global batch's, or tf-keras' own
    per-replica ones with ``sync_statistics=None``), and that stays as it is.
    With ``group_size`` each replica's copy follows its own group, and the
    mean of the groups is no group's statistics: such a layer's moving
    statistics get ``ONLY_FIRST_REPLICA`` instead, which reads replica 0's
    copy, so what is read and saved is global tower 0's group's
    (docs/sync-groups.md). Outside a strategy the aggregation changes
    nothing; the names, checkpoint keys and values are tf-keras'.

    Args:
      aggregation: what tf-keras passes to ``add_weight``.
      synchronization: likewise.
      group_size: the layer's ``group_size`` (None: no groups).
      sync_statistics: the layer's ``sync_statistics`` (None: per-replica
        statistics, where ``group_size`` has no effect).

    Returns:
      A ``tf.VariableAggregation``.
    """
    if group_size is None or sync_statistics is None or \
            synchronization != tf.VariableSynchronization.ON_READ or \
            aggregation != tf.VariableAggregation.MEAN:
        return aggregation
    return tf.VariableAggregation.ONLY_FIRST_REPLICA

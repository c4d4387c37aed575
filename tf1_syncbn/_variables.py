"""The variables of one layer, as the core reads them.

Front-ends create the variables with their own library's names and
collections (slim: ``BatchNorm/gamma``, tensorpack: ``mean/EMA``, tf.layers:
``batch_normalization/moving_mean``) and hand them to the core in a
:class:`Params`. This module holds what is the same for every front-end: the
renorm variables, the zero-debias shadows of a moving mean, and the
collection of fine-tune counters.

A variable may come through a ``custom_getter`` of the enclosing variable
scope, which returns a *transformed* value instead of the variable (fake
quantization, for example). The core reads every variable through
:func:`read` and updates the moving statistics through :func:`assignable`:
the transformed value is what the layer computes with, the variable under it
is what the update assigns.
"""

import collections

import tensorflow as tf

tf1 = tf.compat.v1

__all__ = ['Params', 'RenormVariables', 'FINETUNE_COUNTERS', 'STATISTICS_AGGREGATION',
           'zero_debias_variables', 'read', 'assignable']

#: Collection of the batch counters of fine-tune mode (see start_finetuning).
FINETUNE_COUNTERS = 'tf1_syncbn_finetune_counters'

#: The aggregation of every variable the layers update themselves (moving
#: statistics, renorm statistics, zero-debias shadows, fine-tune counters).
#: Outside ``tf.distribute`` it changes nothing (names, checkpoints and values
#: are the same). Under a strategy (``MirroredStrategy``, ...) the variables
#: are mirrored, every replica builds the same update, and the strategy
#: applies the first replica's to every copy, once per step: the statistics
#: are the global batch's, identical on every replica.
STATISTICS_AGGREGATION = tf.VariableAggregation.ONLY_FIRST_REPLICA

Params = collections.namedtuple('Params', ['beta', 'gamma', 'moving_mean', 'moving_variance',
                                           'renorm', 'finetune_count', 'zero_debias'],
                                defaults=(None, None, None))
Params.__doc__ = """The variables of one layer (``beta``/``gamma`` may be None).

``beta`` and ``gamma`` may be partitioned; the others never are.

Attributes:
  renorm: :class:`RenormVariables` or None.
  finetune_count: the batch counter of fine-tune mode, or None.
  zero_debias: ``(biased, local_step)`` of a zero-debiased moving mean (see
    :func:`zero_debias_variables`), or None.
"""


class RenormVariables(collections.namedtuple('RenormVariables',
                                             ['mean', 'stddev', 'moving_stddev'])):
    """Variables of Batch Renormalization, named as in Keras (and so slim, tensorpack).

    ``renorm_mean`` and ``renorm_stddev`` give ``r`` and ``d``; the inference
    statistics are tracked as ``moving_stddev``, from which ``moving_variance``
    is derived (``moving_stddev**2 - epsilon``).
    """

    @classmethod
    def create(cls, make, mean_initializer, variance_initializer):
        """Creates them with ``make(name, initializer)``.

        Args:
          make: creates one float32 ``[C]`` non-trainable variable.
          mean_initializer: the initializer of ``moving_mean``.
          variance_initializer: the initializer of ``moving_variance``; the
            standard deviations start at its square root.
        """
        def stddev_initializer(*args, **kwargs):
            return tf.sqrt(variance_initializer(*args, **kwargs))

        moving_stddev = make('moving_stddev', stddev_initializer)
        return cls(make('renorm_mean', mean_initializer),
                   make('renorm_stddev', stddev_initializer), moving_stddev)


def read(value):
    """The value a layer computes with, as a ``[C]`` tensor: a variable's, or a getter's.

    Variables of shape ``[1, ..., 1, C]`` (tf.layers' ghost batch norm keeps
    them so) are read as ``[C]``; the updates assign them in their own shape.

    In TF1 behaviour (reference variables), reading a variable gives a tensor
    that shares the variable's buffer: an assignment of the same step (the
    layer's own moving-average updates, an optimizer's update of ``gamma``)
    that runs before the read's consumers would change what they compute.
    Such reads are copied (one ``Snapshot`` of ``[C]`` values), so that every
    consumer sees the value the variable had when the read ran. Reads of
    resource variables are already copies and stay as they are.
    """
    if value is None:
        return None
    tensor = tf.convert_to_tensor(value)
    if _aliases_a_reference_variable(tensor):
        # Snapshot copies a buffer it shares; TensorFlow registers no gradient
        # for it, Identity's is the right one.
        with tf1.get_default_graph().gradient_override_map({'Snapshot': 'Identity'}):
            tensor = tf.raw_ops.Snapshot(input=tensor, name='read_copy')
    if tensor.shape.ndims is not None and tensor.shape.ndims > 1:
        tensor = tf.reshape(tensor, [-1])
    return tensor


# Ops whose outputs are buffers of their inputs (no copy): identities and v1 control flow.
_FORWARDING_OPS = frozenset(['Identity', 'RefIdentity', 'IdentityN', 'Switch', 'RefSwitch',
                             'Merge', 'RefMerge', 'Enter', 'RefEnter', 'Exit', 'RefExit',
                             'NextIteration', 'RefNextIteration'])


def _aliases_a_reference_variable(tensor, limit=64):
    """Whether ``tensor`` may be the buffer of a reference variable (TF1 behaviour).

    Follows the ops that forward a buffer (``tf.identity``, a v1 ``tf.cond``'s
    ``Switch`` and ``Merge``: a ``custom_getter`` returning
    ``tf.cond(flag, lambda: f(v), lambda: tf.identity(v))`` aliases ``v`` in
    one branch) back to a reference, at most ``limit`` ops.
    """
    pending, seen = [tensor], set()
    while pending and len(seen) < limit:
        tensor = pending.pop()
        if tensor.dtype._is_ref_dtype:  # noqa: SLF001 - TensorFlow has no public test
            return True
        op = tensor.op
        if op.type not in _FORWARDING_OPS or op.name in seen:
            continue
        seen.add(op.name)
        if op.type == 'IdentityN':
            pending.append(op.inputs[tensor.value_index])
        elif op.type in ('Merge', 'RefMerge'):
            pending.extend(op.inputs)
        elif op.inputs:
            pending.append(op.inputs[0])
    return False


def assignable(value):
    """The variable under ``value`` for an update (``value`` itself when it is one).

    A ``custom_getter`` that transforms a moving statistic returns a tensor
    computed from the variable; the moving-average update must assign the
    variable itself. The variable is found by walking back from the tensor
    through the ops that read it (``ReadVariableOp`` of a resource variable,
    the ref of a ref variable).

    Raises:
      TypeError: when no variable can be found under ``value``.
    """
    if isinstance(value, tf.Variable) or hasattr(value, 'assign_sub'):
        return value
    found = _variable_under(value)
    if found is None:
        raise TypeError(
            'a moving statistic came out of a custom_getter as %r, which is computed from no '
            'variable of this graph, so its moving average cannot be updated. Return a value '
            'computed from the variable the getter receives (getter(name, *args, **kwargs)).'
            % (value,))
    return found


def _variable_under(tensor):
    """The global variable whose value ``tensor`` is computed from (breadth first), or None."""
    graph = tensor.graph
    with graph.as_default():
        by_handle = {}
        for v in tf1.global_variables() + tf1.local_variables():
            handle = getattr(v, 'handle', None)
            if handle is not None:
                by_handle[handle.op.name] = v
            by_handle.setdefault(v.op.name, v)
    queue, seen = [tensor.op], set()
    while queue:
        op = queue.pop(0)
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.name in by_handle:
            return by_handle[op.name]
        queue.extend(t.op for t in op.inputs)
    return None


def zero_debias_variables(moving_mean, model_variables):
    """Creates the shadow variables of a zero-debiased moving mean.

    Named as ``assign_moving_average(..., zero_debias=True)`` names them:
    ``<scope>/<moving_mean's name>/biased`` and ``.../local_step`` (for example
    ``BatchNorm/BatchNorm/moving_mean/biased``). Call it in the layer's
    variable scope; they are never partitioned.

    Args:
      moving_mean: the moving-mean variable.
      model_variables: also add them to ``MODEL_VARIABLES``. slim does on its
        non-fused path (whose scope makes every variable a model variable),
        not on its fused one.

    Returns:
      ``(biased, local_step)``.
    """
    collections_ = [tf1.GraphKeys.GLOBAL_VARIABLES]
    if model_variables:
        collections_.append(tf1.GraphKeys.MODEL_VARIABLES)
    variable = assignable(moving_mean)
    dtype = variable.dtype.base_dtype
    with tf1.variable_scope(variable.op.name) as scope, tf1.colocate_with(variable.op):
        scope.set_partitioner(None)
        biased = tf1.get_variable('biased', shape=variable.shape, dtype=dtype,
                                  initializer=tf1.zeros_initializer(), trainable=False,
                                  collections=collections_,
                                  aggregation=STATISTICS_AGGREGATION)
        local_step = tf1.get_variable('local_step', shape=[], dtype=dtype,
                                      initializer=tf1.zeros_initializer(), trainable=False,
                                      collections=collections_,
                                      aggregation=STATISTICS_AGGREGATION)
    return biased, local_step

"""The variables of one layer, as the core reads them.

Front-ends create the variables with their own library's names and
collections (slim: ``BatchNorm/gamma``, tensorpack: ``mean/EMA``, tf.layers:
``batch_normalization/moving_mean``) and hand them to the core in a
:class:`Params`. This module holds what is the same for every front-end: the
renorm variables, the zero-debias shadows of a moving mean, and the
collection of fine-tune counters.

A variable may come through a ``custom_getter`` of the enclosing variable
scope, which returns a *transformed* value instead of the variable (fake
quantization, a learned scale, for example). The core reads every variable
through :func:`read` and updates the moving statistics through
:func:`assignable`: the transformed value is what the layer computes with,
the variable the getter received is what the update assigns. Front-ends
create their variables inside :func:`received_variables`, which records, for
each value a getter returns, the variable it received (the value may be
computed from other variables too: ``tf.multiply(scale, variable)``).
"""

import collections
import contextlib

import tensorflow as tf
from tensorflow.python.util import function_utils

from tf1_syncbn._graph.cache import graph_cache

tf1 = tf.compat.v1

__all__ = ['Params', 'RenormVariables', 'FINETUNE_COUNTERS', 'STATISTICS_AGGREGATION',
           'zero_debias_variables', 'read', 'assignable', 'variable_name', 'received_variables']

#: The graph-state slot of what custom getters returned inside
#: :func:`received_variables`: ``{id(value): (value, received variable or None,
#: names the getter asked its own getter for)}``.
_RECEIVED = 'tf1_syncbn.received_variables'

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


@contextlib.contextmanager
def received_variables():
    """Variables created here remember which variable the scope's ``custom_getter`` received.

    Inside, the current variable scope's ``custom_getter`` (a copy of the
    scope: the user's scope is left as it is) is wrapped: the getter gets, as
    its own ``getter``, one that records what it returns. For each value the
    getter returns that is not a variable, :func:`assignable` then knows the
    variable it received under the name it was asked for (or the only one it
    received, for a getter that renames). Without a ``custom_getter``,
    nothing changes.
    """
    scope = tf1.get_variable_scope()
    users = scope.custom_getter
    if users is None:
        yield
        return
    records = graph_cache().slot(_RECEIVED, dict)
    # As TensorFlow calls a custom getter: `constraint` only if it takes it.
    takes_constraint = 'constraint' in function_utils.fn_args(users) or \
        function_utils.has_kwargs(users)

    def capturing(getter, **kwargs):
        calls = []

        def recording(*args, **getter_kwargs):
            variable = getter(*args, **getter_kwargs)
            calls.append((getter_kwargs.get('name', args[0] if args else None), variable))
            return variable

        if not takes_constraint:
            kwargs.pop('constraint', None)
        value = users(getter=recording, **kwargs)
        if not _is_variable(value):
            same = [v for n, v in calls if n == kwargs.get('name')]
            received = same[0] if same else calls[0][1] if len(calls) == 1 else None
            records[id(value)] = (value, received, [n for n, _ in calls])
        return value

    with tf1.variable_scope(scope, auxiliary_name_scope=False) as wrapped:
        wrapped.set_custom_getter(capturing)
        yield


def _is_variable(value):
    return isinstance(value, tf.Variable) or hasattr(value, 'assign_sub')


def variable_name(value):
    """The op name of the variable an update of ``value`` assigns (:func:`assignable`).

    For a custom getter's value computed from no variable: the value's own name.
    """
    try:
        return assignable(value).op.name
    except TypeError:
        return getattr(value, 'name', repr(value))


def assignable(value):
    """The variable an update of ``value`` assigns (``value`` itself when it is one).

    A ``custom_getter`` that transforms a moving statistic returns a tensor
    computed from the variable; the moving-average update must assign the
    variable the getter received (recorded by :func:`received_variables`),
    never another variable the value is computed from (a getter's own
    ``scale`` in ``tf.multiply(scale, variable)``). Without a record, the
    value must be computed from exactly one variable.

    Raises:
      TypeError: when the value is computed from no variable, not from the
        variable the getter received, or (without a record) from several.
    """
    if _is_variable(value):
        return value
    graph = getattr(value, 'graph', None)
    record = None
    if graph is not None:
        record = graph_cache(graph).slots.get(_RECEIVED, {}).get(id(value))
        if record is not None and record[0] is not value:
            record = None
    received = record[1] if record is not None else None
    under = _variables_under(value, received) if graph is not None else []
    if not under:
        raise TypeError(
            'a moving statistic came out of a custom_getter as %r, which is computed from no '
            'variable of this graph, so its moving average cannot be updated. Return a value '
            'computed from the variable the getter receives (getter(name, *args, **kwargs)).'
            % (value,))
    if received is not None and any(v is received for v in under):
        return received
    if record is not None:
        asked = ', '.join(repr(n) for n in record[2]) or 'none'
        raise TypeError(
            'a moving statistic came out of a custom_getter as %r, computed from %s but not '
            'from the variable the getter received under the name it was asked for (it asked '
            'its getter for: %s), so the layer cannot tell which variable its moving average '
            'updates. Return a value computed from the variable getter(name, *args, **kwargs) '
            'returns.' % (value, _names(under), asked))
    if len(under) > 1:
        raise TypeError(
            'a moving statistic came out of a custom_getter as %r, computed from several '
            'variables (%s), so the layer cannot tell which one its moving average updates. '
            'Build the layer where its variables are created through the getter of its own '
            'variable scope, or return the variable itself.' % (value, _names(under)))
    return under[0]


def _names(variables):
    return ', '.join(v.op.name for v in variables)


def _variables_under(tensor, received=None):
    """The variables whose values ``tensor`` is computed from (breadth first).

    Stops at ``received`` when it is met (the only one the caller needs then).
    """
    graph = tensor.graph
    with graph.as_default():
        candidates = ([] if received is None else [received]) + tf1.global_variables() + \
            tf1.local_variables()
    by_op = {}
    for v in candidates:
        handle = getattr(v, 'handle', None)
        if handle is not None:
            by_op.setdefault(handle.op.name, v)
        by_op.setdefault(v.op.name, v)
    queue, seen, found = collections.deque([tensor.op]), set(), []
    while queue:
        op = queue.popleft()
        if op.name in seen:
            continue
        seen.add(op.name)
        variable = by_op.get(op.name)
        if variable is not None:
            if not any(variable is v for v in found):
                found.append(variable)
            if variable is received:
                break
            continue
        queue.extend(t.op for t in op.inputs)
    return found


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

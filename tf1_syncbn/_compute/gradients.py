"""Custom gradients for graph mode that do not keep their graph alive.

``tf.custom_gradient`` in graph mode registers a new gradient function in
TensorFlow's process-wide gradient registry for every call, and never removes
it: each registered closure holds the tensors of its layer, so every graph
that ever built one stays in memory for the life of the process (a
hyper-parameter search or a test suite builds hundreds).

:func:`with_gradient` does what ``tf.custom_gradient`` does in graph mode (an
``IdentityN`` over outputs and inputs whose gradient is the given function)
with one gradient function registered once, which finds the call's own
gradient function in the cache of the op's graph (:mod:`tf1_syncbn._graph.cache`). That
cache lives on the graph object, so the closures go away with their graph.
"""

import contextlib

import tensorflow as tf

from tf1_syncbn._compute.xla import outside_xla_clusters
from tf1_syncbn.backends import all_op_types
from tf1_syncbn._graph.cache import graph_cache

__all__ = ['with_gradient', 'raw_collectives']

_GRADIENT_TYPE = 'Tf1SyncbnCustomGradient'
_RAW_TYPE = 'Tf1SyncbnRawCollective'
_SLOT = 'tf1_syncbn.gradients'
#: The all-reduce ops the backends build (TensorFlow's collectives, NCCL, Horovod).
_COLLECTIVE_TYPES = tuple(sorted(all_op_types()))


@tf.RegisterGradient(_RAW_TYPE)
def _raw_collective_gradient(op, *output_grads):
    del output_grads
    return [None] * len(op.inputs)


@contextlib.contextmanager
def raw_collectives():
    """Builds the backends' all-reduce ops as constants for ``tf.gradients``.

    Every all-reduce of a layer carries its derivative in a wrapper of its
    own (:func:`with_gradient`: the fast path's gradient, the differentiable
    all-reduce), so ``tf.gradients`` never needs to go through the op
    itself. It may still be asked to (and the op treated as a constant is
    right then, since no derivative flows through it that its wrapper does
    not already carry): a TF2 ``tf.cond`` exposes the
    intermediates of a branch to the branch's gradient, and differentiating
    that gradient again (a gradient penalty) sends zeros into them, back to
    the all-reduce, which has no gradient (TensorFlow's collectives) or one
    that would build another all-reduce (NCCL, Horovod).
    """
    with tf.compat.v1.get_default_graph().gradient_override_map(
            {op_type: _RAW_TYPE for op_type in _COLLECTIVE_TYPES}):
        yield


@tf.RegisterGradient(_GRADIENT_TYPE)
def _gradient(op, *output_grads):
    entry = graph_cache(op.graph).slot(_SLOT, dict).get((op.graph, op.name))
    if entry is None:
        raise LookupError(
            'tf1_syncbn: no gradient function for %r: the layer was built in another process '
            '(a graph imported with import_meta_graph or import_graph_def) or another graph, '
            'and its gradient functions live in the Python process and graph that built it. '
            'Running the imported graph (its train op, saved with it) works; to build new '
            'gradients (another loss or optimizer), build the model in Python again and '
            'restore the checkpoint into it.' % op.name)
    grad_fn, num_outputs, with_inputs = entry
    output_grads = output_grads[:num_outputs]
    with outside_xla_clusters():        # the backward all-reduces and what surrounds them
        if with_inputs:
            input_grads = grad_fn(list(op.inputs)[num_outputs:], *output_grads)
        else:
            input_grads = grad_fn(*output_grads)
    return [None] * num_outputs + list(input_grads)


def with_gradient(outputs, inputs, grad_fn, name='with_gradient', with_inputs=False):
    """``outputs`` whose gradient with respect to ``inputs`` is ``grad_fn``.

    The returned tensors equal ``outputs``. Differentiating them never goes
    through the ops that computed ``outputs``: ``tf.gradients`` calls
    ``grad_fn(*output_grads)`` (one upstream gradient per output, None where
    none flows), which returns one gradient (or None) per input.

    Args:
      outputs: a list of tensors computed from ``inputs``.
      inputs: a list of tensors.
      grad_fn: builds the input gradients; it runs when the gradient is built,
        in the graph (or ``tf.cond`` branch) of the gradient computation.
      name: the name of the ``IdentityN`` op.
      with_inputs: call ``grad_fn(inputs, *output_grads)``, with ``inputs``
        as the op that carries the gradient sees them. A gradient function
        that is itself differentiated inside a TF2 ``tf.cond`` runs in a
        gradient graph of the branch's gradient graph, which can reach the
        branch's tensors only through these (a closure over them cannot).

    Returns:
      A list of tensors, one per output.
    """
    outputs = [tf.convert_to_tensor(t) for t in outputs]
    inputs = [tf.convert_to_tensor(t) for t in inputs]
    graph = tf.compat.v1.get_default_graph()
    with graph.gradient_override_map({'IdentityN': _GRADIENT_TYPE}):
        identities = tf.identity_n(outputs + inputs, name=name)
    # Keyed by graph too: a tf.cond branch names its ops in a namespace of its own.
    graph_cache(graph).slot(_SLOT, dict)[(graph, identities[0].op.name)] = (
        grad_fn, len(outputs), with_inputs)
    return identities[:len(outputs)]

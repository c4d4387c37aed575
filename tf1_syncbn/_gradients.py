"""Custom gradients for graph mode that do not keep their graph alive.

``tf.custom_gradient`` in graph mode registers a new gradient function in
TensorFlow's process-wide gradient registry for every call, and never removes
it: each registered closure holds the tensors of its layer, so every graph
that ever built one stays in memory for the life of the process (a
hyper-parameter search or a test suite builds hundreds).

:func:`with_gradient` does what ``tf.custom_gradient`` does in graph mode (an
``IdentityN`` over outputs and inputs whose gradient is the given function)
with one gradient function registered once, which finds the call's own
gradient function in the state of the op's graph (:mod:`tower._state`). That
state lives on the graph object, so the closures go away with their graph.
"""

import tensorflow as tf

from tower._state import get_graph_state

__all__ = ['with_gradient']

_GRADIENT_TYPE = 'Tf1SyncbnCustomGradient'
_SLOT = 'tf1_syncbn.gradients'


@tf.RegisterGradient(_GRADIENT_TYPE)
def _gradient(op, *output_grads):
    grad_fn, num_outputs = get_graph_state(op.graph).slot(_SLOT, dict)[(op.graph, op.name)]
    input_grads = grad_fn(*output_grads[:num_outputs])
    return [None] * num_outputs + list(input_grads)


def with_gradient(outputs, inputs, grad_fn, name='with_gradient'):
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

    Returns:
      A list of tensors, one per output.
    """
    outputs = [tf.convert_to_tensor(t) for t in outputs]
    inputs = [tf.convert_to_tensor(t) for t in inputs]
    graph = tf.compat.v1.get_default_graph()
    with graph.gradient_override_map({'IdentityN': _GRADIENT_TYPE}):
        identities = tf.identity_n(outputs + inputs, name=name)
    # Keyed by graph too: a tf.cond branch names its ops in a namespace of its own.
    get_graph_state(graph).slot(_SLOT, dict)[(graph, identities[0].op.name)] = (
        grad_fn, len(outputs))
    return identities[:len(outputs)]

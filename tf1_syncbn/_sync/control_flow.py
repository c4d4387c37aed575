"""Where in the graph's control flow a layer is built: while loops.

A synchronized layer must run its all-reduces once per step in every tower;
a while loop runs its body any number of times, and a v1 loop frame drops the
control inputs of ops built in it from outside (the guards). The core asks
:func:`enclosing_while_loop` before it plans a synchronized call, and before
it shares moving-average updates across towers (an op inside one tower's
loop cannot be a control input of another tower's).
"""

import re

import tensorflow as tf
from tensorflow.python.ops import control_flow_util, control_flow_util_v2

__all__ = ['enclosing_while_loop']


def enclosing_while_loop(graph=None):
    """The name of the while loop the current op would be built in, or None.

    Both kinds: a v1 loop (TF1 behaviour: a ``WhileContext`` of the graph's
    control-flow context) and a v2 loop (TF2 behaviour: the body or condition
    ``FuncGraph``, possibly with ``tf.cond`` branches nested inside it).
    """
    if graph is None:
        graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        context = graph._get_control_flow_context()  # noqa: SLF001 - no public accessor
        loop = control_flow_util.GetContainingWhileContext(context)
        if loop is not None:
            return loop.name.rsplit('/', 1)[0] if loop.name.endswith('/while_context') \
                else loop.name
        if control_flow_util_v2.in_while_loop_defun(graph):
            # Named '<name scope>_body_<n>' ('tower0_while_body_4').
            return re.sub(r'_(body|cond)_[0-9]+$', '', graph.name)
        graph = getattr(graph, 'outer_graph', None)
    return None

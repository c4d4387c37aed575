"""A graph as the audit reads it: every node, function bodies included, and its edges.

:func:`tf1_syncbn.audit_graph` works on the graph's structure alone (a live
``tf.Graph``, a ``GraphDef`` or an exported ``MetaGraphDef``), never on
Python-side state, so that it can audit a graph imported from a file.
:class:`GraphIndex` flattens the root graph and the body of every function
that the root graph calls (``tf.cond`` branches, ``tf.while_loop`` bodies,
``PartitionedCall``), once per call site, into :class:`Node` records whose
``name`` is the full name scope the op would have had outside the function:
the call site's scope plus the op's name in the body. It answers:

* which node an input refers to, through function arguments to the caller's
  inputs (:meth:`GraphIndex.producer`);
* which variable an assignment targets (:meth:`GraphIndex.variable_of`);
* which nodes run when some nodes run (:meth:`GraphIndex.reachable`): their
  data and control inputs, transitively, and every op of the functions a
  reached node calls.
"""

import re

__all__ = ['GraphIndex', 'Node', 'strip_towers', 'tower_of', 'is_gradient_scope',
           'parent_scope']

#: Ops that hold a variable.
VARIABLE_OPS = frozenset(['VarHandleOp', 'VariableV2', 'Variable', '_VarHandlesOp'])
#: Ops that assign a variable (resource and reference variables).
ASSIGN_OPS = frozenset(['AssignVariableOp', 'AssignSubVariableOp', 'AssignAddVariableOp',
                        'Assign', 'AssignSub', 'AssignAdd'])
#: Ops a variable handle or reference passes through unchanged.
_PASS_THROUGH = frozenset(['Identity', 'RefIdentity', 'Enter', 'RefEnter', 'Switch',
                           'RefSwitch'])
#: Call ops whose first input is not an argument of the called function.
_FIRST_INPUT_NOT_ARG = frozenset(['If', 'StatelessIf', 'Case', 'StatelessCase'])
_GRADIENTS = re.compile(r'gradients(_[0-9]+)?')
_REPLICA = re.compile(r'replica_([0-9]+)')
_MAX_DEPTH = 16


def parent_scope(name):
    """``'a/b/c'`` -> ``'a/b'`` (``''`` for a top-level name)."""
    return name.rsplit('/', 1)[0] if '/' in name else ''


def is_gradient_scope(name):
    """Whether a path component of ``name`` is a ``gradients`` scope (backward code)."""
    return any(_GRADIENTS.fullmatch(part) for part in name.split('/'))


def _tower_index(part, patterns):
    """``(label, index)`` when the path component ``part`` names a tower, else None."""
    match = _REPLICA.fullmatch(part)
    if match:
        return part, int(match.group(1))
    for pattern in patterns:
        match = pattern.fullmatch(part)
        if match:
            return part, int(match.group(1))
    return None


def tower_of(name, patterns):
    """The first path component of ``name`` that names a tower, or None."""
    for part in name.split('/'):
        found = _tower_index(part, patterns)
        if found:
            return found[0]
    return None


def strip_towers(name, patterns):
    """``name`` without the path components that name towers (the same in every tower)."""
    return '/'.join(p for p in name.split('/') if p and _tower_index(p, patterns) is None)


class Node(object):
    """One op, in the root graph or in one call of a function.

    Attributes:
      key: ``(context, name in that context)``, unique in the index.
      name: the full name (call-site scope + name in the function body).
      op: the op type.
      attr: the op's attributes (``AttrValue`` protos).
      context: the :class:`_Call` whose body holds it, or None (root graph).
      inputs: data input strings, as the graph or function body spells them.
      control_inputs: names of the control inputs (without ``^``).
      branch: for an op of a v1 ``tf.cond`` branch (TF1 behaviour), ``(the
        branch's Switch or pivot, True/False)``; else None.
    """

    __slots__ = ('key', 'name', 'op', 'attr', 'context', 'inputs', 'control_inputs', 'device',
                 'branch')

    def __init__(self, context, node_def, prefix):
        self.context = context
        self.key = (id(context), node_def.name)
        self.name = prefix + node_def.name
        self.op = node_def.op
        self.attr = node_def.attr
        self.device = node_def.device
        self.inputs = [i for i in node_def.input if not i.startswith('^')]
        self.control_inputs = [i[1:] for i in node_def.input if i.startswith('^')]
        self.branch = None

    def get_attr(self, name):
        """The attribute ``name`` (an ``AttrValue``), or None; never adds one to the proto."""
        return self.attr[name] if name in self.attr else None

    def __repr__(self):
        return 'Node(%s, %s)' % (self.name, self.op)


def _name_v1_branches_as_v2(root):
    """Names the ops of v1 ``tf.cond`` branches as their v2 counterparts are named.

    In TF1 behaviour a ``tf.cond`` builds its branches in the root graph under
    the cond's name scope (``BatchNorm/cond/FusedBatchNormV3``, between
    ``Switch`` and ``Merge`` ops); in TF2 behaviour, in function bodies that
    the index names with the ``If`` op's scope (``BatchNorm/FusedBatchNormV3``).
    The cond's own scope component is dropped from :attr:`Node.name` here
    (recognized by the ``pred_id`` and ``switch_t`` ops every v1 cond builds),
    so that a layer's ops have one scope in both behaviours. Lookups by the
    names in the graph are unchanged.
    """
    conds = {parent_scope(name) for name in root
             if name.endswith('/pred_id') and parent_scope(name) + '/switch_t' in root}
    if not conds:
        return
    for node in root.values():
        parts, prefix, kept = node.name.split('/'), '', []
        for part in parts[:-1]:
            prefix = prefix + '/' + part if prefix else part
            if prefix not in conds:
                kept.append(part)
        if len(kept) < len(parts) - 1:
            node.branch = _v1_branch(node, root, {})
        node.name = '/'.join(kept + parts[-1:])


def _v1_branch(node, root, memo, depth=0):
    """``(cond scope, True/False)``: the branch of a v1 cond that ``node`` runs in, or None.

    Ops of the true branch take their data from ``Switch`` outputs ``:1`` or
    hang off the ``switch_t`` pivot (constants); the false branch's from
    ``:0`` and ``switch_f``.
    """
    if node.key in memo:
        return memo[node.key]
    memo[node.key] = None
    found = None
    last = node.name.rsplit('/', 1)[-1]
    if node.op == 'Identity' and last in ('switch_t', 'switch_f'):
        found = (parent_scope(node.name), last == 'switch_t')
    elif depth < 64:
        for name in node.inputs + node.control_inputs:
            producer = root.get(name.split(':', 1)[0])
            if producer is None or producer.op == 'Merge':
                continue
            if producer.op in ('Switch', 'RefSwitch'):
                found = (producer.name, name.endswith(':1'))
            else:
                found = _v1_branch(producer, root, memo, depth + 1)
            if found is not None:
                break
    memo[node.key] = found
    return found


class _Call(object):
    """One call of a function: the calling node and the function's body."""

    def __init__(self, caller, function):
        self.caller = caller
        self.function = function
        self.args = {arg.name: i for i, arg in enumerate(function.signature.input_arg)}
        self.offset = 1 if caller.op in _FIRST_INPUT_NOT_ARG else 0
        self.nodes = {}


class GraphIndex(object):
    """Every node of a ``GraphDef``, function bodies included (see the module docstring).

    Args:
      graph_def: a ``tf.compat.v1.GraphDef``.
    """

    def __init__(self, graph_def):
        self._library = {f.signature.name: f for f in graph_def.library.function}
        self.nodes = []
        self._root = {}
        self._calls = {}           # caller key -> [_Call]
        self._consumers = None
        for node_def in graph_def.node:
            node = Node(None, node_def, '')
            self._root[node_def.name] = node
            self.nodes.append(node)
        _name_v1_branches_as_v2(self._root)
        for node in list(self.nodes):
            self._expand(node, 0)

    def _called_functions(self, node):
        names = []
        if node.op in self._library:
            names.append(node.op)
        for value in node.attr.values():
            if value.HasField('func') and value.func.name:
                names.append(value.func.name)
            elif value.HasField('list'):
                names.extend(f.name for f in value.list.func)
        return [self._library[n] for n in names if n in self._library]

    def _expand(self, node, depth):
        if depth >= _MAX_DEPTH:
            return
        calls = []
        prefix = parent_scope(node.name)
        prefix = prefix + '/' if prefix else ''
        for function in self._called_functions(node):
            call = _Call(node, function)
            for node_def in function.node_def:
                inner = Node(call, node_def, prefix)
                call.nodes[node_def.name] = inner
                self.nodes.append(inner)
            calls.append(call)
            for inner in list(call.nodes.values()):
                self._expand(inner, depth + 1)
        if calls:
            self._calls[node.key] = calls

    def node(self, name):
        """The root-graph node named ``name``, or None."""
        return self._root.get(name)

    def _table(self, context):
        return self._root if context is None else context.nodes

    def producer(self, node, input_string, control=False):
        """The node an input of ``node`` comes from, through function arguments.

        Args:
          node: the consuming :class:`Node`.
          input_string: one of its ``inputs`` (or ``control_inputs``).
          control: whether it is a control input.

        Returns:
          A :class:`Node`, or None when it cannot be resolved.
        """
        context = node.context
        name = input_string.split(':', 1)[0]
        for _ in range(_MAX_DEPTH):
            found = self._table(context).get(name)
            if found is not None:
                return found
            if context is None or control or name not in context.args:
                return None
            caller = context.caller
            index = context.offset + context.args[name]
            if index >= len(caller.inputs):
                return None
            name = caller.inputs[index].split(':', 1)[0]
            context = caller.context
        return None

    def variable_of(self, node, input_index=0):
        """The variable node that input ``input_index`` of ``node`` holds, or None."""
        if input_index >= len(node.inputs):
            return None
        current = self.producer(node, node.inputs[input_index])
        for _ in range(_MAX_DEPTH):
            if current is None or current.op in VARIABLE_OPS:
                return current
            if current.op not in _PASS_THROUGH or not current.inputs:
                return None
            current = self.producer(current, current.inputs[0])
        return None

    def calls(self, node):
        """The function calls ``node`` makes (a list of call records)."""
        return self._calls.get(node.key, [])

    def reachable(self, roots):
        """The keys of the nodes that run when ``roots`` run.

        Data and control inputs, transitively; a reached node that calls a
        function reaches every op of its body (TensorFlow runs the stateful
        ops of a function body even when no output depends on them).
        """
        seen = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node is None or node.key in seen:
                continue
            seen.add(node.key)
            for name in node.inputs:
                stack.append(self.producer(node, name))
            for name in node.control_inputs:
                stack.append(self.producer(node, name, control=True))
            for call in self.calls(node):
                stack.extend(call.nodes.values())
        return seen

    def consumers(self, node):
        """``[(consumer, is_control)]`` of ``node`` within its own graph or function body."""
        if self._consumers is None:
            table = {}
            for other in self.nodes:
                for name in other.inputs:
                    producer = self._table(other.context).get(name.split(':', 1)[0])
                    if producer is not None:
                        table.setdefault(producer.key, []).append((other, False))
                for name in other.control_inputs:
                    producer = self._table(other.context).get(name)
                    if producer is not None:
                        table.setdefault(producer.key, []).append((other, True))
            self._consumers = table
        return self._consumers.get(node.key, [])

"""The proof before the first training step: each graph audited once, at its first step.

:func:`install` wraps ``tf.compat.v1.Session``'s ``run``, ``make_callable``
and ``_make_callable_from_options`` (what Keras' graph-mode ``fit`` calls).
Until a graph has trained, each call asks whether it runs a **training step**:
whether its fetches reach, through data and control edges,

* an op of the graph's ``train_op`` collection (TF1 optimizers add theirs),
* an optimizer's update kernel (``Apply*``, ``ResourceApply*``,
  ``SparseApply*``, ``ResourceSparseApply*``: every ``tf.compat.v1.train``
  and Keras optimizer, under ``tf.distribute`` and Horovod too), or
* an assignment to a trainable variable computed from a gradient (an op under
  a ``gradients`` name scope): a hand-written update.

An initializer, a restore, an evaluation or a broadcast is none of these. At
the first call that is one, the graph is audited
(:func:`tf1_syncbn.audit_graph`, with that call's fetches as the train op:
what this step runs is what the audit checks), the report goes to stderr
(:func:`tf1_syncbn.run.report.text`) and to ``--report``'s file, and with
``--strict`` a graph with a problem ends the process before the step runs:
``os._exit`` with :data:`~tf1_syncbn.run.startup.STRICT_EXIT_STATUS`, so that
neither the step nor the script's clean-up (a hook that saves a checkpoint, a
thread join) runs. Afterwards a call on that graph costs one set lookup: a
later step costs nothing measurable (docs/no-code-changes.md).

What it cannot see: a training step that does not go through a session
(eager code, ``tf.function``), a graph whose steps are all of the first step's
kind but one that differs later (only the first training step of each graph
is audited: a GAN's second train op is seen as that step's ``not in step``
layers), and whatever :func:`tf1_syncbn.audit_graph` itself cannot
(docs/audit.md).
"""

import atexit
import functools
import os
import re
import sys
import threading
import weakref

import tensorflow as tf

from tf1_syncbn._frontend.patching import Patch
from tf1_syncbn.audit import audit_graph
from tf1_syncbn.run import report as report_lib
from tf1_syncbn.run.startup import STRICT_EXIT_STATUS

__all__ = ['install', 'is_training_step', 'fetched_ops', 'proofs']

#: Op types that apply an optimizer's update (by prefix).
APPLY_PREFIXES = ('Apply', 'ResourceApply', 'SparseApply', 'ResourceSparseApply')
#: Op types that assign to a variable (the target is their first input).
WRITE_TYPES = frozenset((
    'Assign', 'AssignAdd', 'AssignSub', 'AssignVariableOp', 'AssignAddVariableOp',
    'AssignSubVariableOp', 'ScatterUpdate', 'ScatterAdd', 'ScatterSub', 'ResourceScatterUpdate',
    'ResourceScatterAdd', 'ResourceScatterSub'))
#: A name under ``tf.gradients``' name scope (``gradients``, ``gradients_1``, ...).
_GRADIENT = re.compile(r'(^|/)gradients(_[0-9]+)?/')

_LOCK = threading.Lock()
#: The mark of a graph audited (it trained): an attribute of the graph, so that a later step
#: reads it in one attribute lookup, and it goes with the graph.
_PROVEN = '_tf1_syncbn_run_proven'
_CHECKED = weakref.WeakKeyDictionary()            # graph -> {fetched op names: False}
_STATE = {'options': None, 'switches': [], 'proofs': [], 'runs': 0, 'written': False}


def proofs():
    """The graphs audited so far in this process (:class:`~tf1_syncbn.run.report.GraphProof`)."""
    return list(_STATE['proofs'])


def _leaves(fetches):
    """The fetches of a ``Session.run`` structure (dicts, lists, tuples), in order.

    Not ``tf.nest``: ``MonitoredSession`` fetches dicts keyed by hook objects,
    which it cannot sort.
    """
    if isinstance(fetches, dict):
        for value in fetches.values():
            yield from _leaves(value)
    elif isinstance(fetches, (list, tuple)):
        for value in fetches:
            yield from _leaves(value)
    elif fetches is not None:
        yield fetches


def _element(graph, item):
    try:
        return [graph.as_graph_element(item, allow_tensor=True, allow_operation=True)]
    except (TypeError, ValueError, KeyError):
        pass
    try:                 # a SparseTensor, an IndexedSlices: its tensors
        parts = tf.nest.flatten(item, expand_composites=True)
    except (TypeError, ValueError):
        return []
    if len(parts) == 1 and parts[0] is item:
        return []
    return [e for part in parts for e in _element(graph, part)]


def fetched_ops(graph, fetches):
    """The ops of ``graph`` that ``fetches`` (as ``Session.run`` takes them) name, in order.

    Fetches it cannot resolve are left out (the run itself reports them).
    """
    ops = []
    for item in _leaves(fetches):
        for element in _element(graph, item):
            op = element if isinstance(element, tf.Operation) else getattr(element, 'op', None)
            if op is not None and op not in ops:
                ops.append(op)
    return ops


def is_training_step(graph, ops):
    """Whether running ``ops`` trains (see the module docstring)."""
    collected = set(graph.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP))
    trainable = {v.op.name for v in graph.get_collection(
        tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES) if hasattr(v, 'op')}
    writes, gradient = False, False
    stack, seen = list(ops), set()
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op in collected or op.type.startswith(APPLY_PREFIXES):
            return True
        if op.type in WRITE_TYPES and op.inputs and op.inputs[0].op.name in trainable:
            writes = True
        if not gradient and _GRADIENT.search(op.name):
            gradient = True
        if writes and gradient:
            return True
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return False


def _check(graph, ops):
    """Audits ``graph`` if running ``ops`` is its first training step (once per graph)."""
    with _LOCK:
        _STATE['runs'] += 1
        if getattr(graph, _PROVEN, False):
            return
        key = frozenset(op.name for op in ops)
        checked = _CHECKED.setdefault(graph, {})
        if key in checked or not ops:
            return
        if not is_training_step(graph, ops):
            checked[key] = False
            return
        setattr(graph, _PROVEN, True)
        _prove(graph, ops)


def _prove(graph, ops):
    options = _STATE['options']
    proof = report_lib.GraphProof(len(_STATE['proofs']) + 1, [op.name for op in ops])
    try:
        proof.audit = audit_graph(graph, train_op=ops)
    except Exception as e:  # noqa: BLE001 - reported; --strict stops, as for a problem
        proof.error = '%s: %s' % (type(e).__name__, e)
    _STATE['proofs'].append(proof)
    stop = options.strict and not proof.ok
    proof.stopped = stop
    sys.stderr.write(report_lib.text(proof, _STATE['switches'], options.strict))
    _write(stopped=stop)
    if stop:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STRICT_EXIT_STATUS)


def _write(stopped=False):
    options = _STATE['options']
    if options.report is None:
        return
    _STATE['written'] = True
    report_lib.write_json(report_lib.report_path(options.report), report_lib.payload(
        _STATE['proofs'], _STATE['switches'], options, stopped=stopped))


def _at_exit():
    """Says so when sessions ran but none trained: nothing was audited (never silent)."""
    if _STATE['runs'] and not _STATE['proofs']:
        sys.stderr.write('tf1_syncbn.run: %d session call%s, none of them a training step (no '
                         'optimizer update reached): nothing was audited.\n'
                         % (_STATE['runs'], '' if _STATE['runs'] == 1 else 's'))
    if not _STATE['written'] and _STATE['runs']:
        _write()


def _defining(cls, name):
    return next(klass for klass in cls.__mro__ if name in vars(klass))


class _SessionHook(Patch):
    """``Session.run`` and the session's callables, checked until their graph has trained."""

    api = 'tf1_syncbn.run'
    target = 'tf.compat.v1.Session'

    def _apply(self):
        session = tf.compat.v1.Session
        run_owner = _defining(session, 'run')
        run = vars(run_owner)['run']

        @functools.wraps(run)
        def checked_run(sess, fetches, feed_dict=None, options=None, run_metadata=None):
            graph = sess.graph
            if not getattr(graph, _PROVEN, False):
                _check(graph, fetched_ops(graph, fetches))
            return run(sess, fetches, feed_dict, options, run_metadata)

        self._set(run_owner, 'run', checked_run)
        owner = _defining(session, 'make_callable')
        make_callable = vars(owner)['make_callable']

        @functools.wraps(make_callable)
        def checked_make_callable(sess, fetches, feed_list=None, accept_options=False):
            call = make_callable(sess, fetches, feed_list, accept_options)
            if feed_list is not None:         # it calls sess.run
                return call
            return _checked_callable(call, sess.graph, fetched_ops(sess.graph, fetches))

        self._set(owner, 'make_callable', checked_make_callable)
        name = '_make_callable_from_options'      # what Keras' graph functions call
        owner = _defining(session, name)
        from_options = vars(owner)[name]

        @functools.wraps(from_options)
        def checked_from_options(sess, callable_options):
            call = from_options(sess, callable_options)
            names = list(callable_options.fetch) + list(callable_options.target)
            return _checked_callable(call, sess.graph, fetched_ops(sess.graph, names))

        self._set(owner, name, checked_from_options)


def _checked_callable(call, graph, ops):
    if getattr(graph, _PROVEN, False):
        return call

    def checked(*args, **kwargs):
        if not getattr(graph, _PROVEN, False):
            _check(graph, ops)
        return call(*args, **kwargs)

    return checked


def install(options, switches):
    """Checks every session's first training step from now on.

    Args:
      options: the runner's options (``startup.parse_environment``).
      switches: the list of :class:`~tf1_syncbn.run.report.Switch` the report
        names (filled by :mod:`tf1_syncbn.run.switches`).

    Returns:
      The hook (a :class:`~tf1_syncbn._frontend.patching.Patch`; ``restore()`` removes it).
    """
    _STATE['options'] = options
    _STATE['switches'] = switches
    atexit.register(_at_exit)
    return _SessionHook().apply()

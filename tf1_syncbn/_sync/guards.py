"""The guards every collective of a step waits for: the run-time check and the watchdog.

Two ops, each built once per root graph and host (the CPU of the machine and
worker process that runs a tower), whatever the number of layers, towers and
``tf.cond`` branches; TensorFlow runs an op at most once per step, so each
runs once per step and host:

* **The run-time check** (``tf1_syncbn_check_towers``) fails a run with
  ``InvalidArgumentError`` when some tower of a synchronized group was never
  built (``TowerContext(total=4)`` with two towers built, ``num_dev=4`` with
  two name-scope towers): the graph builder cannot know when a harness has
  built its last tower, and the all-reduce would wait for the missing
  members until the timeout. It is plain TensorFlow: an ``Assert`` on two
  constants, the verdict and the message of
  :meth:`~tf1_syncbn._sync.registry.CallRegistry.run_time_verdict`, which the
  registry rewrites in the graph whenever a registration changes them. So
  it runs no Python, costs nothing per step, and survives the process: a
  meta graph, a ``GraphDef`` or a frozen graph carry it with the verdict of
  the graph as saved. A session reads a graph's ops when it first runs
  them: one that ran the graph before more synchronized layers were built
  into it keeps the earlier verdict (TensorFlow logs a warning that a
  changed op has no effect); open a new session after extending a graph.
  ``TF1_SYNCBN_RUNTIME_CHECK=0`` leaves the check out.
* **The step watchdog** (``SyncBnStepWatchdog``, compiled with the CPU
  kernels; :mod:`tf1_syncbn.kernels`) arms a deadline of ``timeout`` seconds
  when the step reaches the first collective of this host. One thread for
  the whole process keeps every deadline; a step still running when its
  deadline passes has its collectives aborted, and fails with
  ``DeadlineExceededError`` and a message saying why. **The clock measures
  the step's time on this host from the moment its first guarded collective
  could start**, not only the time spent inside all-reduces: a step that is
  slow for other reasons (a huge first-step autotuning, a peer worker
  pausing between steps) counts too. Collectives built under
  :func:`tf1_syncbn.timeouts.watched` then carry no per-op timeout
  (TensorFlow's per-op timeout starts two sleeping threads per collective
  execution). Without the compiled library, collectives fall back to
  TensorFlow's per-op timeout.

Inside ``tf.cond`` branches the guards are built in the root graph and
become control inputs of the branch's ``If`` op (TensorFlow's control
captures), so a tensor ``is_training`` adds no op per layer or step.
"""

import os

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf1_syncbn._sync.registry import get_registry
from tf1_syncbn._graph.cache import graph_cache
from tower.graph_state import root_graph

__all__ = ['step_guards', 'step_watchdog', 'host_cpu', 'TIMEOUT_MESSAGE']

_SLOT = 'tf1_syncbn.guards'

TIMEOUT_MESSAGE = (
    'tf1_syncbn: this step ran more than %g s on this host while a collective of it still '
    'waited (the collective timeout: CollectiveBackend(timeout=...), TF1_SYNCBN_TIMEOUT, or the '
    'cluster\'s collective_timeout). Some tower or worker did not reach a synchronized layer in '
    'this step: a run that fetches some towers\' synchronized ops but not the others\' (e.g. '
    'one tower\'s output of a training graph, for evaluation: switch the layers with an '
    'is_training tensor and feed it False, tf1_syncbn.moments(..., training=is_training) in '
    'a hand-written batch norm, or fetch every tower), a tf.cond that skipped one in some '
    'tower, update ops run without the forward pass of every tower, or a lost, frozen or '
    'paused worker. The collectives of this session are aborted: open a new session.')


def host_cpu(device):
    """The CPU of the host (job, task) that ``device`` is on ('' when unplaced)."""
    if not device:
        return ''
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type='CPU', device_index=0).to_string()


def _runtime_check_enabled():
    return os.environ.get('TF1_SYNCBN_RUNTIME_CHECK', '1') != '0'


def step_guards(device, timeout):
    """The guards of a collective of the tower on ``device``.

    Args:
      device: the tower's canonical device ('' when unplaced).
      timeout: the backend's step timeout in seconds (0: none).

    Returns:
      ``(ops, watched)``: the ops (for ``control_inputs``) and whether a
      watchdog bounds the step (see :func:`tf1_syncbn.timeouts.watched`).
    """
    ops = list(step_watchdog(device, timeout))
    watched_by_dog = bool(ops)
    if _runtime_check_enabled():
        ops.insert(0, _shared_op(('check', host_cpu(device)), _build_check))
    return tuple(ops), watched_by_dog


def step_watchdog(device, timeout):
    """The step watchdog of ``device``'s host for ``timeout`` seconds, as a list of ops.

    Building the first one loads the compiled library (compiling it if the
    cache does not have it, about 20 s, said on stderr).

    Returns:
      ``[op]``, or ``[]`` when ``timeout`` is 0 or the library is unavailable.
    """
    if timeout <= 0:
        return []
    from tf1_syncbn import kernels  # noqa: PLC0415 - compiled on first use, here only
    library = kernels.library()
    if library is None:
        return []

    def build():
        return library.sync_bn_step_watchdog(
            timeout_seconds=float(timeout), message=TIMEOUT_MESSAGE % timeout,
            name='tf1_syncbn_step_watchdog')

    return [_shared_op(('watchdog', host_cpu(device), float(timeout)), build)]


def _shared_op(slot, build):
    """The op of ``slot`` in the root graph, built once there with ``build()``."""
    root = root_graph()
    table = graph_cache(root).slot(_SLOT, dict)
    op = table.get(slot)
    if op is None:
        device = slot[1]
        with root.as_default(), root.name_scope(None), root.control_dependencies(None), \
                root.device(device):
            op = build()
        table[slot] = op
    return op


def _build_check():
    """``Assert(complete, [message])`` on constants that follow the registry's verdict."""
    registry = get_registry()
    complete, message = registry.run_time_verdict()
    flag = tf.constant(complete, name='tf1_syncbn_towers_complete')
    text = tf.constant(message, name='tf1_syncbn_towers_message')
    shown = [complete, message]

    def follow():
        # The constants of the graph are rewritten in place: a session that has
        # not run them yet, and anything exported from now on, sees the new values.
        complete, message = registry.run_time_verdict()
        if complete != shown[0]:
            _set_constant(flag.op, complete, tf.bool)
            shown[0] = complete
        if not complete and message != shown[1]:
            _set_constant(text.op, message, tf.string)
            shown[1] = message

    registry.listeners.append(follow)
    return tf.raw_ops.Assert(condition=flag, data=[text], summarize=1,
                             name='tf1_syncbn_check_towers')


def _set_constant(op, value, dtype):
    """Sets the value of the ``Const`` op ``op`` (a scalar of ``dtype``)."""
    proto = tf.make_tensor_proto(value, dtype)
    op._set_attr('value', attr_value_pb2.AttrValue(tensor=proto))  # noqa: SLF001

"""The synchronized batch-norm engine shared by every layer of this package.

It joins the pure math of :mod:`tf1_syncbn._math` with one communication hook
(a backend's ``all_reduce``) into a single op with a custom gradient:

* forward: local moments -> **one packed all-reduce** -> normalize;
* backward: local ``sum(dy)``, ``sum(dy * xhat)`` -> **one packed all-reduce**
  -> input gradient. The backward all-reduce is built on the forward op's
  device, under keys derived from the layer name.

It also keeps, per graph, the registry that gives every synchronized layer
call a key that is identical on every tower, and that checks at graph build
that all towers built the same synchronized layers.
"""

import collections
import os

import tensorflow as tf

from tf1_syncbn import _math
from tf1_syncbn.backends import SyncKey, stable_hash
from tower import strip_tower_prefix
from tower._state import get_graph_state

Moments = _math.Moments


# --------------------------------------------------------------------------
# Per-graph registry of layer calls.

class _Member(collections.namedtuple('_Member', ['device', 'backend', 'layer'])):
    pass


class SyncRegistry(object):
    """What the towers of one graph built: synchronized calls and shared updates.

    * Every layer call in a tower gets a name that is the same in every tower
      (:meth:`call_name`): its scope without tower prefixes, plus a per-tower
      call index.
    * Synchronized calls are registered per tower (:meth:`register`), which
      catches conflicts at graph build, and checked for missing towers when a
      ``TowerContext`` group has been built (:meth:`on_tower_exit`) and again
      at the first run (:meth:`guard`), since a harness without tower
      contexts never says when its last tower is built.
    * The moving-average updates of a call are built once, by the main
      training tower; every other tower puts a trigger of those same updates
      into its own update collection (:meth:`share_updates`,
      :meth:`trigger_updates`), so a harness that keeps the first, the last or
      every tower's ``UPDATE_OPS`` runs them exactly once per step.
    """

    def __init__(self):
        self.call_counts = collections.defaultdict(int)   # (towers, tower, base) -> calls
        self.members = {}          # key name -> {tower index: _Member}
        self.totals = {}           # key name -> number of towers expected
        self.instance_names = {}   # stable hash -> key name
        self.exited = collections.defaultdict(set)   # total -> tower indices exited
        self.pending = collections.defaultdict(set)  # total -> key names to check
        self.updates = {}          # (towers, call name) -> the main tower's update ops
        self.waiting = collections.defaultdict(list)  # same key -> triggers built before
        self.guards = {}           # (graph, host device) -> run-time check op
        self.watchdogs = {}        # (graph, host device, timeout) -> step watchdog op
        self._version = 0          # bumped on every registration
        self._checked_version = -1

    def call_name(self, towers, tower_index, base_name):
        """The name of this call of ``base_name``, the same in every tower.

        Args:
          towers: the number of towers of the group (None when unknown).
          tower_index: this tower's index.
          base_name: the layer's scope with tower prefixes stripped.

        Returns:
          ``'<base_name>:<k>'`` for the ``k``-th call of ``base_name`` in this
          tower (0 for the first).
        """
        slot = (towers, tower_index, base_name)
        index = self.call_counts[slot]
        self.call_counts[slot] += 1
        return '%s:%d' % (base_name, index)

    def register(self, key, tower_index, total, backend, track):
        """Records that ``tower_index`` builds ``key``; raises on conflicts.

        Args:
          key: the call's :class:`SyncKey`.
          tower_index: this tower's index.
          total: the number of towers of this graph in the group.
          backend: the call's backend.
          track: also check the group when its ``TowerContext`` towers exit.
        """
        h = stable_hash(key.name)
        other = self.instance_names.setdefault(h, key.name)
        if other != key.name:
            raise ValueError('%s: the synchronization key of %r collides with %r. Rename one '
                             'of the two layers (give it another scope).'
                             % (key.layer, key.name, other))
        members = self.members.setdefault(key.name, {})
        if tower_index in members:
            raise ValueError(
                '%s: tower %d builds the synchronized layer %r twice under the same key. '
                'Build each tower once per TowerContext, or give the towers distinct indices.'
                % (key.layer, tower_index, key.name))
        for index, member in members.items():
            if type(member.backend) is not type(backend):
                raise ValueError(
                    '%s: tower %d synchronizes %r with %r but tower %d uses %r. Every tower '
                    'must use the same backend; pass sync_statistics explicitly.'
                    % (key.layer, tower_index, key.name, backend, index, member.backend))
            if key.device and member.device == key.device:
                raise ValueError(
                    '%s: towers %d and %d are both on device %s. Two members of one '
                    'all-reduce on one device would abort the process; place each tower on '
                    'its own device.' % (key.layer, index, tower_index, key.device))
        members[tower_index] = _Member(key.device, backend, key.layer)
        self.totals[key.name] = total
        self._version += 1
        if track:
            self.pending[total].add(key.name)

    def missing_towers(self, names=None):
        """Descriptions of the synchronized calls that some tower never built.

        Args:
          names: the key names to check (default: every registered one).

        Returns:
          A list of strings, empty when every group is complete.
        """
        problems = []
        for name in sorted(self.members if names is None else names):
            members, total = self.members[name], self.totals[name]
            missing = sorted(set(range(total)) - set(members))
            if missing:
                built = sorted(members)
                problems.append('%s (a group of %d towers: built by tower%s %s, never by '
                                'tower%s %s)' % (
                                    members[built[0]].layer, total,
                                    's' if len(built) > 1 else '', ', '.join(map(str, built)),
                                    's' if len(missing) > 1 else '',
                                    ', '.join(map(str, missing))))
        return problems

    def on_tower_exit(self, ctx):
        """Once every tower of a ``TowerContext`` group has been built, checks they match."""
        exited = self.exited[ctx.total]
        exited.add(ctx.index)
        if len(exited) < ctx.total:
            return
        exited.clear()
        pending, self.pending[ctx.total] = self.pending[ctx.total], set()
        problems = self.missing_towers(pending)
        if problems:
            raise ValueError(
                'Towers built different synchronized batch-norm layers; the all-reduce of '
                'these layers would wait forever: %s. Every tower of a sync group must '
                'build the same synchronized layers the same number of times.'
                % '; '.join(problems))

    def guard(self, device, timeout=0.0):
        """The ops every forward all-reduce of a step waits for on ``device``'s host.

        The run-time check that every tower of each group was built, and the
        step watchdog for ``timeout`` seconds (see :meth:`watchdog`).

        The check: an op that fails the first run if some tower of a group was never built.

        The graph builder cannot know when a harness has built its last tower
        (``TowerContext(total=4)`` with only two towers built, or ``num_dev=4``
        with two name-scope towers): the all-reduce would wait for the missing
        members until the collective timeout. This op runs before every
        forward all-reduce of the towers on ``device``'s host; it checks the
        registry (a Python check that is cached after it passes) and raises
        ``InvalidArgumentError`` naming the layers and towers instead.

        The check is a Python op (``tf.numpy_function``): a graph exported with
        ``export_meta_graph`` and imported into another process cannot run it.
        ``TF1_SYNCBN_RUNTIME_CHECK=0`` leaves it out of graphs built for that.

        Args:
          device: the tower's canonical device ('' when unplaced).
          timeout: the backend's :meth:`~tf1_syncbn.SyncBackend.step_timeout`.

        Returns:
          A list of ops, for ``control_inputs``.
        """
        watchdog = self.watchdog(device, timeout)
        if os.environ.get('TF1_SYNCBN_RUNTIME_CHECK', '1') == '0':
            return watchdog
        graph = tf.compat.v1.get_default_graph()   # a tf.cond branch has its own
        slot = (graph, _host_cpu(device))
        op = self.guards.get(slot)
        if op is None:
            with tf.device(slot[1]), graph.name_scope(None), tf.control_dependencies(None):
                op = tf.numpy_function(self._check_at_run_time, [], [],
                                       name='tf1_syncbn_check_towers')
            self.guards[slot] = op
        return [op] + watchdog

    def watchdog(self, device, timeout):
        """Arms the step watchdog of ``device``'s host for ``timeout`` seconds.

        One ``SyncBnStepWatchdog`` op per graph, host and timeout, run at the
        start of every step as a control input of the step's first collectives:
        past ``timeout`` seconds it aborts the step's collectives, which then
        fail with ``DeadlineExceededError`` and a message saying why, using one
        thread for the whole process (TensorFlow's per-op timeouts start two
        per collective). After that the session's collectives stay aborted:
        open a new session.

        Args:
          device: a device on the host to watch ('' when unplaced).
          timeout: seconds; 0 (or no compiled library) arms nothing.

        Returns:
          A list with the op, or an empty list.
        """
        from tf1_syncbn import kernels  # noqa: PLC0415 - compiled lazily, on first use
        library = kernels.library() if timeout > 0 else None
        if library is None:
            return []
        graph = tf.compat.v1.get_default_graph()
        slot = (graph, _host_cpu(device), float(timeout))
        op = self.watchdogs.get(slot)
        if op is None:
            with tf.device(slot[1]), graph.name_scope(None), tf.control_dependencies(None):
                op = library.sync_bn_step_watchdog(
                    timeout_seconds=float(timeout), message=_TIMEOUT_MESSAGE % timeout,
                    name='tf1_syncbn_step_watchdog')
            self.watchdogs[slot] = op
        return [op]

    def _check_at_run_time(self):
        if self._checked_version == self._version:
            return
        problems = self.missing_towers()
        if problems:
            raise ValueError(
                'tf1_syncbn: some towers of a synchronized group were never built, so the '
                'all-reduce of these layers would wait for them until the collective timeout: '
                '%s. Build every tower of the group, or give the tower context total (or '
                'num_dev) the number of towers you build.' % '; '.join(problems))
        self._checked_version = self._version

    def share_updates(self, towers, call_name, updates):
        """Records the main tower's update ops of a call; completes early triggers."""
        key = (towers, call_name)
        self.updates[key] = list(updates)
        for trigger in self.waiting.pop(key, []):
            trigger._add_control_inputs([_as_op(u) for u in updates])  # noqa: SLF001

    def trigger_updates(self, towers, call_name):
        """An op, in the current name scope, that runs the main tower's updates of a call.

        TensorFlow runs an op once per step however many times it is fetched,
        so fetching the updates and any number of triggers updates the moving
        statistics exactly once. A trigger built before the main tower gets its
        control inputs when the main tower builds the updates.
        """
        key = (towers, call_name)
        updates = self.updates.get(key)
        if updates is not None:
            return tf.group(*updates, name='update_moving_averages')
        trigger = tf.no_op(name='update_moving_averages')
        self.waiting[key].append(trigger)
        return trigger


_TIMEOUT_MESSAGE = (
    'tf1_syncbn: this step waited more than %g s in its collective all-reduces (the collective '
    'timeout: CollectiveBackend(timeout=...), TF1_SYNCBN_TIMEOUT, or the cluster\'s '
    'collective_timeout). Some tower or worker did not reach a synchronized layer in this step: '
    'a tf.cond that skipped one in some tower, update ops run without the forward pass of every '
    'tower, or a lost or frozen worker. The collectives of this session are aborted: open a new '
    'session.')


def _as_op(value):
    return value if isinstance(value, tf.Operation) else value.op


def _host_cpu(device):
    """The CPU of the host (job, task) that ``device`` is on ('' when unplaced)."""
    if not device:
        return ''
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type='CPU', device_index=0).to_string()


def get_registry(graph=None):
    """The :class:`SyncRegistry` of ``graph`` (default: the current graph)."""
    state = get_graph_state(graph)

    def create():
        registry = SyncRegistry()
        state.tower_exit_hooks.append(registry.on_tower_exit)
        return registry

    return state.slot('tf1_syncbn.registry', create)


def canonical_device(device):
    """Canonical form of a device string ('' stays '')."""
    if not device:
        return ''
    return tf.DeviceSpec.from_string(device).to_string()


def base_name(layer_scope, ctx):
    """The layer's scope without tower prefixes: the same in every tower."""
    return strip_tower_prefix(layer_scope, ctx) or layer_scope


def make_sync_key(call_name, layer_scope, group_size, device):
    """Builds the :class:`SyncKey` of one call of a synchronized layer.

    Args:
      call_name: the call's name from :meth:`SyncRegistry.call_name`.
      layer_scope: the layer's full variable/name scope in this tower.
      group_size: the number of all-reduce members.
      device: the device the layer's ops are placed on.
    """
    return SyncKey(name=call_name, layer=layer_scope, group_size=group_size,
                   device=canonical_device(device))


# --------------------------------------------------------------------------
# The op.

def train_normalize(x4, fmt, gamma, beta, epsilon, backend=None, key=None, control_inputs=()):
    """Batch norm with batch statistics of the global batch, and its gradient.

    Args:
      x4: canonical 4-D view of the input (see :func:`_math.canonical_view`).
      fmt: ``'NHWC'`` or ``'NCHW'``.
      gamma, beta: float32 ``[C]`` tensors (ones/zeros when not learned).
      epsilon: Python float.
      backend: a :class:`~tf1_syncbn.backends.SyncBackend`, or None for the
        statistics of this tower's batch alone.
      key: the :class:`~tf1_syncbn.backends.SyncKey` of this call (with a
        backend).
      control_inputs: ops that must run before this call's forward all-reduce
        can start (the run-time check that every tower of the group was
        built); they become control inputs of the local-moments op.

    Returns:
      ``(y4, moments)``: the normalized view and the global :class:`Moments`.
      The gradient of ``y4`` reaches ``x4`` through both the normalization and
      the global statistics; ``gamma`` and ``beta`` receive this tower's share
      of their gradient (summing over towers gives the global gradient).
    """
    def all_reduce(tensor, direction):
        if backend is None:
            return tensor
        return backend.all_reduce(tensor, key, direction)

    device = key.device if key is not None else x4.device
    kernels = _math.kernels_for(device)
    stats = []

    # Per tower and layer: the local moments, one all-reduce and the normalize
    # forward; the local sums, one all-reduce and the input gradient backward.
    # Only y4 goes through the custom gradient; the statistics leave beside it
    # and carry no gradient.
    @tf.custom_gradient
    def sync_bn(x4, gamma, beta):
        with tf.control_dependencies(control_inputs):
            packed = kernels.moments(x4, fmt)
        packed_sum = all_reduce(packed, 'forward')
        y4, moments, saved = kernels.normalize(x4, packed_sum, gamma, beta, epsilon, fmt)
        stats.append(moments)

        def grad(dy4):
            with tf.device(device):
                grads, dgamma, dbeta, state = kernels.backward_local(dy4, x4, gamma, saved,
                                                                     epsilon, fmt)
                grads_sum = all_reduce(grads, 'backward')
                dx = kernels.backward_finish(state, dy4, x4, gamma, saved, grads_sum, epsilon,
                                             fmt)
            return dx, dgamma, dbeta

        return y4, grad

    y4 = sync_bn(x4, gamma, beta)
    return y4, stats[0]


def all_reduce_with_gradient(tensor, backend, key):
    """A sum all-reduce whose gradient is the sum all-reduce of the incoming gradient.

    The backward all-reduce is placed on the forward op's device and keyed
    ``'backward'`` from the same layer name, so every tower agrees on it.
    """
    if backend is None:
        return tensor

    @tf.custom_gradient
    def reduce(t):
        out = backend.all_reduce(t, key, 'forward')

        def grad(dy):
            return backend.all_reduce(dy, key, 'backward')

        return out, grad

    return reduce(tensor)


DifferentiableMoments = collections.namedtuple(
    'DifferentiableMoments', ['shifted_inputs', 'shifted_mean', 'mean', 'variance', 'count'])
DifferentiableMoments.__doc__ = """Global moments that carry gradients.

Attributes:
  shifted_inputs: the canonical view minus this tower's shift.
  shifted_mean: float32 ``[C]``, the global mean minus this tower's shift
    (normalize ``shifted_inputs`` with it).
  mean: float32 ``[C]``, the global mean.
  variance: float32 ``[C]``, the global biased (weighted) variance.
  count: float32 scalar, the global element count (or total weight).
"""


def differentiable_moments(x4, fmt, weights, backend, key, control_inputs=()):
    """Global (optionally weighted) moments built from differentiable ops.

    Used by the options that the fused op does not cover (batch weights,
    renorm, adjustment, ``fused=False``): the caller normalizes with separate
    ops and TensorFlow differentiates through the moments, the float64 packing
    and :func:`all_reduce_with_gradient`, which still makes one packed
    all-reduce forward and one backward.
    """
    channels = x4.shape[_math.channel_axis(fmt)]
    shift = _math.batch_shift(x4, fmt)
    xs4 = x4 - tf.reshape(tf.cast(shift, x4.dtype), _math.broadcast_shape(fmt, channels))
    count, mean_s, m2 = _math.weighted_local_moments(xs4, fmt, weights)
    packed = all_reduce_with_gradient(_math.pack_moments(count, shift, mean_s, m2), backend,
                                      key)
    n64, mean64, var64 = _math.unpack_moments(packed, channels)
    shifted_mean = tf.cast(mean64 - tf.cast(shift, mean64.dtype), _math.STAT_DTYPE)
    return DifferentiableMoments(xs4, shifted_mean, tf.cast(mean64, _math.STAT_DTYPE),
                                 tf.cast(var64, _math.STAT_DTYPE),
                                 tf.cast(n64, _math.STAT_DTYPE))


def ghost_normalize(x4, fmt, per_member, groups, backend, key, epsilon, control_inputs=()):
    """Normalizes each virtual batch of ``x4`` by its own (global) statistics.

    This tower's batch is cut into ``groups`` runs of ``per_member``
    consecutive examples; virtual batch ``k`` is run ``k`` of every member of
    the sync group. All groups' moments travel in one packed all-reduce.
    ``control_inputs`` run before it (see :func:`train_normalize`).

    Returns:
      ``(mean, var, xhat4)``: per-virtual-batch mean and biased variance
      (``[groups, C]``, float32) and the normalized view.
    """
    channels = x4.shape[_math.channel_axis(fmt)]
    dyn = tf.shape(x4)
    if fmt == 'NHWC':
        spatial = dyn[1] * dyn[2]
        xg = tf.reshape(x4, tf.stack([groups, per_member, spatial, channels]))
        axes, first = [1, 2], xg[:, 0, 0, :]
        gshape = tf.stack([groups, 1, 1, channels])
    else:
        spatial = dyn[2] * dyn[3]
        xg = tf.reshape(x4, tf.stack([groups, per_member, channels, spatial]))
        axes, first = [1, 3], xg[:, 0, :, 0]
        gshape = tf.stack([groups, 1, channels, 1])
    with tf.control_dependencies(control_inputs):
        shift = tf.stop_gradient(tf.cast(first, _math.STAT_DTYPE))       # [G, C]
    xs = tf.cast(xg, _math.STAT_DTYPE) - tf.reshape(shift, gshape)
    count = tf.cast(per_member * spatial, _math.STAT_DTYPE)
    mean_s = tf.reduce_mean(xs, axes)                                      # [G, C]
    m2 = tf.reduce_sum(tf.square(xs - tf.reshape(mean_s, gshape)), axes)   # [G, C]
    n64 = tf.cast(count, _math.PACK_DTYPE) * tf.ones_like(tf.cast(mean_s[:, :1],
                                                                   _math.PACK_DTYPE))
    mu = tf.cast(shift, _math.PACK_DTYPE) + tf.cast(mean_s, _math.PACK_DTYPE)
    packed = tf.concat([n64, n64 * mu, tf.cast(m2, _math.PACK_DTYPE) + n64 * mu * mu], 1)
    packed = all_reduce_with_gradient(tf.reshape(packed, [-1]), backend, key)
    packed = tf.reshape(packed, tf.stack([groups, 1 + 2 * channels]))
    n = tf.maximum(packed[:, :1], 1.0)
    mean64 = packed[:, 1:1 + channels] / n
    var64 = tf.maximum(packed[:, 1 + channels:] / n - mean64 * mean64, 0.0)
    mean_rel = tf.cast(mean64 - tf.cast(shift, _math.PACK_DTYPE), _math.STAT_DTYPE)
    inv = tf.math.rsqrt(tf.cast(var64, _math.STAT_DTYPE) + epsilon)
    xhat = (xs - tf.reshape(mean_rel, gshape)) * tf.reshape(inv, gshape)
    xhat4 = tf.reshape(tf.cast(xhat, x4.dtype), dyn)
    return tf.cast(mean64, _math.STAT_DTYPE), tf.cast(var64, _math.STAT_DTYPE), xhat4

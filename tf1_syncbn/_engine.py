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

import tensorflow as tf

from tf1_syncbn import _math
from tf1_syncbn.backends import SyncKey, stable_hash
from tower import strip_tower_prefix
from tower._state import get_graph_state

Moments = _math.Moments


# --------------------------------------------------------------------------
# Per-graph registry of synchronized calls.

class _Member(collections.namedtuple('_Member', ['device', 'backend', 'layer'])):
    pass


class SyncRegistry(object):
    """Which towers built which synchronized layer calls, in one graph."""

    def __init__(self):
        self.call_counts = collections.defaultdict(int)   # (group, tower, name) -> calls
        self.members = {}          # key name -> {tower index: _Member}
        self.totals = {}           # key name -> number of towers expected
        self.instance_names = {}   # stable hash -> key name
        self.exited = collections.defaultdict(set)   # total -> tower indices exited
        self.pending = collections.defaultdict(set)  # total -> key names to check

    def next_call_index(self, group, tower_index, base_name):
        """The per-tower call index of ``base_name`` (0 for the first call)."""
        slot = (group, tower_index, base_name)
        index = self.call_counts[slot]
        self.call_counts[slot] += 1
        return index

    def register(self, key, tower_index, total, backend, track):
        """Records that ``tower_index`` builds ``key``; raises on conflicts."""
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
        if track:
            self.pending[total].add(key.name)

    def on_tower_exit(self, ctx):
        """Once every tower of a group has been built, checks they match."""
        exited = self.exited[ctx.total]
        exited.add(ctx.index)
        if len(exited) < ctx.total:
            return
        exited.clear()
        pending, self.pending[ctx.total] = self.pending[ctx.total], set()
        problems = []
        for name in sorted(pending):
            members = self.members[name]
            missing = sorted(set(range(ctx.total)) - set(members))
            if missing:
                built = sorted(members)
                problems.append('%s (built by tower%s %s, missing in tower%s %s)' % (
                    members[built[0]].layer, 's' if len(built) > 1 else '',
                    ', '.join(map(str, built)), 's' if len(missing) > 1 else '',
                    ', '.join(map(str, missing))))
        if problems:
            raise ValueError(
                'Towers built different synchronized batch-norm layers; the all-reduce of '
                'these layers would wait forever: %s. Every tower of a sync group must '
                'build the same synchronized layers the same number of times.'
                % '; '.join(problems))


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


def make_sync_key(layer_scope, tower_index, group_size, device, ctx):
    """Builds the :class:`SyncKey` of one call of a synchronized layer.

    Args:
      layer_scope: the layer's full variable/name scope in this tower.
      tower_index: this tower's index.
      group_size: the number of all-reduce members.
      device: the device the layer's ops are placed on.
      ctx: the current TowerContext or None.
    """
    base = strip_tower_prefix(layer_scope, ctx) or layer_scope
    registry = get_registry()
    call = registry.next_call_index(group_size, tower_index, base)
    return SyncKey(name='%s:%d' % (base, call), layer=layer_scope, group_size=group_size,
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

"""The layer logic shared by ``sync_batch_norm``, ``BatchNorm`` and ``BatchRenorm``.

The public layers create their variables (with their own names) and describe
their options in a :class:`Config`; :func:`batch_norm` then does the rest:
towers, modes (training, frozen, inference, tensor switch), synchronization,
renorm, adjustment and the moving-average updates. The math lives in
:mod:`tf1_syncbn._math` and the communication in :mod:`tf1_syncbn._engine`.
"""

import collections
import numbers
import warnings

import tensorflow as tf

from tf1_syncbn import _engine, _math, backends
from tower import TowerContext, get_current_tower_context, tower_index_from_name
from tower._state import full_name_scope, get_graph_state

tf1 = tf.compat.v1

_FORMATS = {
    'NHWC': (True, None), 'NCHW': (False, None),
    'NDHWC': (True, 5), 'NCDHW': (False, 5),
    'channels_last': (True, None), 'channels_first': (False, None),
}
_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32)
_RENORM_CLIPPING_KEYS = ('rmax', 'rmin', 'dmax')

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


def replaced_layer_is_fused(fused, rank, fused_ranks, unfused_options):
    """Whether the replaced layer normalizes with TensorFlow's fused kernel.

    tf-slim 1.1 and tensorpack 0.11 each run ``tf.nn.fused_batch_norm`` on
    some inputs and ``tf.nn.moments`` / ``tf.nn.batch_normalization`` on the
    others, and what they compute follows the path:

    * fused: the moving variance tracks the kernel's Bessel-corrected
      (unbiased) batch variance;
    * not fused: the moving variance tracks the biased batch variance (or
      the weighted variance, or, with renorm, ``moving_stddev``).

    The layers here keep their own (synchronized) kernels whatever the answer;
    only the tracked variance follows the replaced layer.

    Args:
      fused: the replaced layer's ``fused`` hint: None or True where a fused
        kernel applies, False never.
      rank: the input rank.
      fused_ranks: the ranks for which the replaced layer has a fused path,
        given its other options (slim: 2, 4, and 5 on its Keras path).
      unfused_options: values of the options that no fused kernel computes
        (``batch_weights``, ``renorm``, ``adjustment``, a virtual batch):
        any of them not None and not False means the non-fused path.

    Returns:
      A Python bool.
    """
    return (fused is not False and rank in fused_ranks and
            all(option is None or option is False for option in unfused_options))


#: Collection of the batch counters of fine-tune mode (see start_finetuning).
FINETUNE_COUNTERS = 'tf1_syncbn_finetune_counters'


def check_dict_keys(layer, what, value, allowed):
    """Validates an optional dict argument; returns it (or {})."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError('%s: %s must be a dict, got %r.' % (layer, what, value))
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError('%s: unknown %s key(s) %s; allowed keys are %s.'
                         % (layer, what, unknown, list(allowed)))
    return value


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


class Config(object):
    """The options of one layer call, checked at graph build by :meth:`validate`."""

    def __init__(self, layer, inputs, data_format='NHWC', is_training=True, momentum=0.99,
                 epsilon=1e-3, center=True, scale=True, batch_weights=None, fused=None,
                 renorm=False, renorm_clipping=None, renorm_momentum=0.99, adjustment=None,
                 num_dev=None, sync_statistics=None, zero_debias=False, axis=None,
                 virtual_batch_size=None, arg_names=None):
        self.layer = layer
        # The user's spelling of each argument, for error messages.
        self.arg_names = dict(arg_names or {})
        self.inputs = inputs
        self.data_format = data_format
        self.is_training = is_training
        self.momentum = momentum
        self.epsilon = epsilon
        self.center = center
        self.scale = scale
        self.batch_weights = batch_weights
        self.fused = fused
        self.renorm = renorm
        self.renorm_clipping = renorm_clipping
        self.renorm_momentum = renorm_momentum
        self.adjustment = adjustment
        self.num_dev = num_dev
        self.sync_statistics = sync_statistics
        self.zero_debias = zero_debias
        self.axis = axis
        self.virtual_batch_size = virtual_batch_size
        self.channels_last = True
        self.channels = None
        # What the replaced layer does (see set_replaced_path).
        self.unbiased_variance = True
        self.float32_decay = False

    def error(self, message, exc=ValueError):
        return exc('%s: %s' % (self.layer, message))

    def arg(self, name):
        """The name under which the user passed the option ``name``."""
        return self.arg_names.get(name, name)

    def set_replaced_path(self, fused, float32_decay=False):
        """Follows the replaced layer's path (see :func:`replaced_layer_is_fused`).

        Args:
          fused: whether the replaced layer runs its fused kernel here: the
            moving variance then tracks the unbiased variance, otherwise the
            biased one.
          float32_decay: the replaced layer computes ``1 - decay`` in float32
            (Keras' fused path does), not in double.
        """
        self.unbiased_variance = bool(fused)
        self.float32_decay = bool(float32_decay)

    def validate(self):
        """Checks every option and the input; fills ``channels`` and ``channels_last``."""
        x = self.inputs
        if not isinstance(x, (tf.Tensor, tf.Variable)):
            try:
                x = self.inputs = tf.convert_to_tensor(x)
            except (TypeError, ValueError) as e:
                raise self.error('inputs must be a tensor (%s).' % e, TypeError)
        dtype = x.dtype.base_dtype
        if dtype not in _FLOAT_DTYPES:
            raise self.error('inputs have dtype %s; batch norm needs float16, bfloat16 or '
                             'float32 inputs (cast integers with tf.cast first).'
                             % dtype.name, TypeError)
        rank = x.shape.ndims
        if rank is None:
            raise self.error('inputs have unknown rank; give them a static shape (for '
                             'example with tf.ensure_shape).')
        if not 2 <= rank <= 5:
            raise self.error('inputs have rank %d; batch norm supports rank 2 to 5 '
                             '([N, C] ... [N, D, H, W, C]).' % rank)
        if self.data_format not in _FORMATS:
            raise self.error('unknown data_format %r; use one of %s.'
                             % (self.data_format, sorted(_FORMATS)))
        channels_last, needs_rank = _FORMATS[self.data_format]
        if needs_rank is not None and rank != needs_rank:
            raise self.error('data_format %r needs rank-%d inputs, got rank %d; use %r.'
                             % (self.data_format, needs_rank, rank,
                                'NHWC' if channels_last else 'NCHW'))
        if self.axis is not None:
            if self.axis not in (1, rank - 1, -1):
                raise self.error('axis=%r: only the channel axis 1 or the last axis is '
                                 'supported.' % (self.axis,))
            channels_last = self.axis in (-1, rank - 1)
        if rank == 2:
            channels_last = True
        self.channels_last = channels_last
        channels = x.shape[-1 if channels_last else 1]
        if channels is None:
            raise self.error('the channel dimension (axis %d) of inputs %s is unknown; it '
                             'must be known at graph build to create the variables.'
                             % (-1 if channels_last else 1, x.shape))
        self.channels = int(channels)
        self.momentum = self._check_decay('momentum', self.momentum)
        self._check_number('epsilon', self.epsilon, 0.0, None)
        self.renorm_momentum = self._check_decay('renorm_momentum', self.renorm_momentum)
        if not isinstance(self.is_training, bool):
            t = self.is_training
            if not isinstance(t, (tf.Tensor, tf.Variable)) or t.dtype.base_dtype != tf.bool \
                    or t.shape.ndims not in (0, None):
                raise self.error('%s must be a Python bool or a scalar bool tensor, got %r.'
                                 % (self.arg('is_training'), t), TypeError)
        if self.num_dev is not None and (isinstance(self.num_dev, bool) or
                                         not isinstance(self.num_dev, int) or self.num_dev < 1):
            raise self.error('num_dev must be a positive int or None, got %r.' % (self.num_dev,))
        if self.fused not in (None, True, False):
            raise self.error('fused must be None, True or False, got %r.' % (self.fused,))
        if self.batch_weights is not None:
            self.batch_weights = tf.convert_to_tensor(self.batch_weights)
            w = self.batch_weights
            if w.shape.ndims not in (None, 1):
                raise self.error('batch_weights must have shape [batch], got %s.' % w.shape)
            if not w.shape[:1].is_compatible_with(x.shape[:1]):
                raise self.error('batch_weights shape %s does not match the batch of inputs %s.'
                                 % (w.shape, x.shape))
        if self.renorm:
            self.renorm_clipping = check_dict_keys(self.layer, 'renorm_clipping',
                                                   self.renorm_clipping, _RENORM_CLIPPING_KEYS)
            self._check_renorm_clipping()
        elif self.renorm_clipping:
            raise self.error('renorm_clipping is given but renorm=False; set renorm=True.')
        if self.adjustment is not None and not callable(self.adjustment):
            raise self.error('adjustment must be a callable, got %r.' % (self.adjustment,),
                             TypeError)
        vbs = self.virtual_batch_size
        if vbs is not None:
            if isinstance(vbs, bool) or not isinstance(vbs, int) or vbs < 1:
                raise self.error('virtual_batch_size must be a positive int, got %r.' % (vbs,))
            for option, value in (('renorm', self.renorm), ('batch_weights', self.batch_weights),
                                  ('adjustment', self.adjustment)):
                if value is not None and value is not False:
                    raise self.error('virtual_batch_size cannot be combined with %s.' % option)
            batch = x.shape[0]
            if batch is not None and batch % vbs:
                raise self.error('virtual_batch_size=%d does not divide the batch size %d.'
                                 % (vbs, batch))
        if self.sync_statistics is not None and not isinstance(
                self.sync_statistics, (str, backends.SyncBackend)):
            raise self.error('sync_statistics must be None, a string or a SyncBackend, got %r.'
                             % (self.sync_statistics,), TypeError)
        if isinstance(self.sync_statistics, str) and \
                self.sync_statistics.lower() not in backends.VALID_NAMES:
            raise self.error('unknown sync_statistics=%r; use one of %s or a SyncBackend.'
                             % (self.sync_statistics, backends.VALID_NAMES))

    def _check_number(self, name, value, low, high):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self.error('%s must be a number, got %r.' % (self.arg(name), value), TypeError)
        if value < low or (high is not None and value > high):
            raise self.error('%s=%r is outside [%s, %s].' % (
                self.arg(name), value, low, high if high is not None else 'inf'))

    def _check_decay(self, name, value):
        """A decay: a number in [0, 1], or a float scalar tensor (as slim accepts).

        Returns:
          The number, or the tensor as float32.
        """
        if isinstance(value, (tf.Tensor, tf.Variable)):
            if not value.dtype.base_dtype.is_floating or value.shape.ndims not in (0, None):
                raise self.error('%s must be a number or a float scalar tensor, got %r.'
                                 % (self.arg(name), value), TypeError)
            return tf.cast(value, tf.float32)
        self._check_number(name, value, 0.0, 1.0)
        return value

    def _check_renorm_clipping(self):
        """``0 < rmin <= 1 <= rmax`` and ``dmax >= 0`` where given as numbers."""
        limits = {'rmin': (0.0, 1.0), 'rmax': (1.0, None), 'dmax': (0.0, None)}
        for key in _RENORM_CLIPPING_KEYS:
            value = self.renorm_clipping.get(key)
            if value is None or isinstance(value, (tf.Tensor, tf.Variable)):
                continue  # None: no clipping; tensors are checked by nobody, as in Keras
            name = self.arg_names.get(key, 'renorm_clipping[%r]' % key)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise self.error('%s must be a number or a tensor, got %r.' % (name, value),
                                 TypeError)
            low, high = limits[key]
            if value < low or (key == 'rmin' and value == 0) or (high is not None and
                                                               value > high):
                raise self.error('%s=%r is invalid: Batch Renormalization needs '
                                 '0 < rmin <= 1 <= rmax and dmax >= 0.' % (name, value))

    @property
    def needs_slow_path(self):
        """Options that the fused custom-gradient op does not cover."""
        return (self.batch_weights is not None or self.fused is False or self.renorm or
                self.adjustment is not None or self.virtual_batch_size is not None)


# --------------------------------------------------------------------------
# Towers and backends.

class TowerInfo(collections.namedtuple('TowerInfo', ['ctx', 'index', 'towers', 'main',
                                                     'call'])):
    """Where a layer call is built.

    Attributes:
      ctx: the tower context (this library's, or tensorpack's seen through
        :class:`tower.harness.HarnessTowerContext`), or None.
      index: the tower's index (0 outside any tower).
      towers: the number of towers of this graph in the group: the context's
        ``total``, or ``num_dev`` for name-scope towers, 1 outside any tower,
        and None when the name scope says "tower" but nothing says how many.
      main: whether this call builds the moving-average updates: the main
        training tower (tower 0).
      call: the call's name, the same in every tower (see
        :meth:`_engine.SyncRegistry.call_name`).
    """


def check_graph_mode(layer):
    """Raises ``RuntimeError`` when called eagerly: the layers build TF1 graphs."""
    if tf.executing_eagerly():
        raise RuntimeError(
            '%s needs graph mode (TF1-style graphs, sessions and UPDATE_OPS), but eager '
            'execution is on. Call tf.compat.v1.disable_eager_execution() at the start of '
            'the program, or build the model inside `with tf.Graph().as_default():`.' % layer)


def tower_info(config, prediction_towers_update=False):
    """Finds this call's tower, its index and the number of towers in its group.

    In order: a tower context (:class:`tower.TowerContext` or tensorpack's);
    else a tower name scope (``tower<i>``, ``tower_<i>``, ``clone_<i>`` or a
    registered pattern), with ``num_dev`` giving the number of towers; else a
    single tower.

    Args:
      config: the layer's validated :class:`Config`.
      prediction_towers_update: whether a call with batch statistics in a
        prediction tower updates the moving statistics (tensorpack's layers
        do; slim's run in training towers only).

    Raises:
      ValueError: when ``num_dev`` disagrees with the tower context or the
        name scope, or ``num_dev > 1`` for a training call outside any tower.
    """
    ctx = get_current_tower_context()
    num_dev = config.num_dev
    if ctx is not None:
        if num_dev is not None and num_dev != ctx.total:
            raise config.error('num_dev=%d disagrees with the %d towers of the tower context '
                               '%r; drop num_dev or fix it.' % (num_dev, ctx.total, ctx))
        index, towers = ctx.index, ctx.total
        main = ctx.is_main_training_tower or (prediction_towers_update and not ctx.is_training)
    else:
        scope = full_name_scope()
        index = tower_index_from_name(scope)
        if num_dev is None:
            towers = 1 if index is None else None
        else:
            towers = num_dev
            if index is None and num_dev > 1 and config.is_training is not False:
                raise config.error(
                    'num_dev=%d but the layer is built outside any tower (name scope %r): '
                    'build each tower in tower.TowerContext (or call_for_each_tower), or under '
                    'a name scope tower<i>, tower_<i> or clone_<i> (or a pattern registered with '
                    'tower.register_tower_pattern), so that the tower index is known.'
                    % (num_dev, scope))
            if index is not None and index >= num_dev:
                raise config.error('the name scope %r says tower %d but num_dev=%d.'
                                   % (scope, index, num_dev))
        index = index or 0
        main = index == 0
    base = _engine.base_name(tf1.get_variable_scope().name, ctx)
    call = _engine.get_registry().call_name(towers, index, base)
    return TowerInfo(ctx, index, towers, main, call)


def _is_auto(spec):
    return isinstance(spec, str) and spec.lower() == 'auto'


def resolve_sync(config, info):
    """Chooses how a training call gets its statistics.

    Returns:
      ``(backend, key, control_inputs)`` for a synchronized call, where
      ``control_inputs`` is the run-time check that every tower of the group
      was built; ``(None, None, ())`` for this tower's statistics alone.

    Raises:
      ValueError: when ``sync_statistics`` names a backend but the number of
        towers is unknown (no tower context and no ``num_dev``): the layer
        never falls back to per-tower statistics silently.
    """
    spec = config.sync_statistics
    if spec is None:
        return None, None, ()
    scope = full_name_scope()
    if info.towers is None:
        # A name scope says "tower <i>", but nothing says how many towers.
        if not _is_auto(spec):
            raise _unknown_group_error(config, spec, scope)
        _warn_once(config, 'its name scope %r looks like tower %d of a multi-tower graph, '
                   'but the number of towers is unknown, so it normalizes with this '
                   "tower's statistics alone (no synchronization). Pass num_dev=<number of "
                   'towers> to synchronize, build the towers in tower.TowerContext, or pass '
                   'sync_statistics=None to keep per-tower statistics and silence this '
                   'warning.' % (scope, info.index))
        return None, None, ()
    device = _engine.canonical_device(_current_device())
    backend = backends.resolve(spec, config.layer, device, info.towers)
    if backend is None:
        return None, None, ()
    if info.ctx is None and config.num_dev is None and not backend.implicit_single_tower:
        raise _unknown_group_error(config, spec, scope)
    group_size = backend.group_size(info.towers)
    if group_size == 1:
        return None, None, ()
    key = _engine.make_sync_key(info.call, tf1.get_variable_scope().name, group_size, device)
    backend.check(key)
    registry = _engine.get_registry()
    registry.register(key, info.index, info.towers, backend,
                      track=isinstance(info.ctx, TowerContext))
    return backend, key, registry.guard(key.device, backend.step_timeout())


def _unknown_group_error(config, spec, scope):
    return config.error(
        'sync_statistics=%r asks for synchronized statistics, but the layer cannot tell how '
        'many towers synchronize: it is built outside any tower context (name scope %r) and '
        'num_dev is not given. Build the towers in tower.TowerContext / '
        "tower.call_for_each_tower (or tensorpack's trainers), or pass num_dev=<number of "
        'towers in this graph> (num_dev=1 for one tower) and build tower i under a name scope '
        'tower<i>, tower_<i> or clone_<i> (or a pattern added with '
        'tower.register_tower_pattern).' % (spec, scope))


class SyncBNWarning(UserWarning):
    """A synchronized layer that cannot synchronize (see the message for the fix)."""


def _warn_once(config, message):
    """Warns once per graph and layer."""
    warned = get_graph_state().slot('tf1_syncbn.warned', set)
    if config.layer in warned:
        return
    warned.add(config.layer)
    warnings.warn('%s: %s' % (config.layer, message), SyncBNWarning, stacklevel=4)


def _current_device():
    """The device that ops built here are placed on (the innermost tf.device)."""
    return tf.no_op(name='device_probe').device


# --------------------------------------------------------------------------
# Modes.

def _restore(y4, x):
    """Reshapes a canonical view back to the shape of ``x`` (free when rank 4)."""
    if y4.shape.ndims == x.shape.ndims:
        return y4
    y = tf.reshape(y4, tf.shape(x))
    y.set_shape(x.shape)
    return y


def _vector(value, default):
    """A float32 [C] tensor for an optional variable (beta/gamma)."""
    if value is None:
        return default
    return tf.convert_to_tensor(value)


class BatchStats(collections.namedtuple('BatchStats', ['mean', 'variance', 'count', 'renorm'])):
    """What one training step feeds the moving averages (no gradient).

    Attributes:
      mean: float32 ``[C]``, the global batch mean.
      variance: float32 ``[C]``, the variance the moving variance tracks: the
        unbiased or the biased one, as the replaced layer's path (see
        :func:`replaced_layer_is_fused`).
      count: float32 scalar, elements per channel in the global batch (or
        total weight); 0 means an empty global batch: nothing is updated.
      renorm: ``(mean, stddev)`` for the renorm statistics, or None.
    """


def _moving_variance_target(config, variance, count):
    """The batch variance the moving variance tracks, from the biased one."""
    if config.unbiased_variance:
        return _math.bessel_correct(variance, count)
    return variance


def _train_stats_and_output(config, params, info, x4, fmt):
    """Training mode: normalizes with global batch statistics.

    Returns:
      ``(y, stats)``: the output, and the :class:`BatchStats` that feed the
      moving averages.
    """
    channels = config.channels
    ones = tf.ones([channels], tf.float32)
    zeros = tf.zeros([channels], tf.float32)
    gamma = _vector(params.gamma, ones)
    beta = _vector(params.beta, zeros)
    backend, key, guard = resolve_sync(config, info)
    if not config.needs_slow_path:
        if backend is None:
            y4, mean, var_unbiased = _math.fused_train(x4, gamma, beta, config.epsilon, fmt)
            count = _math.count_per_channel(x4, fmt)
            if not config.unbiased_variance:
                # The kernel's variance is M2 / max(n - 1, 1).
                var_unbiased = var_unbiased * (tf.maximum(count - 1.0, 0.0) /
                                               tf.maximum(count, 1.0))
            return (_restore(y4, config.inputs),
                    BatchStats(tf.stop_gradient(mean), tf.stop_gradient(var_unbiased), count,
                               None))
        y4, moments = _engine.train_normalize(x4, fmt, gamma, beta, config.epsilon, backend, key,
                                              control_inputs=guard)
        return (_restore(y4, config.inputs),
                BatchStats(moments.mean,
                           _moving_variance_target(config, moments.variance, moments.count),
                           moments.count, None))

    if config.virtual_batch_size is not None:
        return _ghost_train(config, gamma, beta, x4, fmt, backend, key, guard)

    # Slow path: differentiable moments through a differentiable all-reduce, then
    # separate ops for renorm / adjustment / weights.
    weights = config.batch_weights
    moments = _engine.differentiable_moments(x4, fmt, weights, backend, key,
                                             control_inputs=guard)
    bshape = _math.broadcast_shape(fmt, channels)
    xs4 = moments.shifted_inputs
    var = moments.variance
    inv = tf.math.rsqrt(var + config.epsilon)
    xhat4 = (xs4 - tf.reshape(tf.cast(moments.shifted_mean, xs4.dtype), bshape)) * \
        tf.reshape(tf.cast(inv, xs4.dtype), bshape)
    xhat = _restore(xhat4, config.inputs)
    oshape = _math.layout_broadcast_shape(config.inputs.shape.ndims,
                                          config.channels_last, channels)
    scale, offset = tf.reshape(ones, oshape), tf.reshape(zeros, oshape)
    renorm_stats = None
    if config.renorm:
        r, d, renorm_stats = _renorm_correction(config, params.renorm, moments.mean, var)
        scale, offset = tf.reshape(r, oshape), tf.reshape(d, oshape)
    if config.adjustment is not None:
        adj_scale, adj_bias = config.adjustment(tf.shape(config.inputs))
        adj_scale = tf.cast(adj_scale, tf.float32)
        adj_bias = tf.cast(adj_bias, tf.float32)
        scale, offset = scale * adj_scale, offset * adj_scale + adj_bias
    g = tf.reshape(gamma, oshape)
    scale, offset = scale * g, offset * g + tf.reshape(beta, oshape)
    y = xhat * tf.cast(scale, xhat.dtype) + tf.cast(offset, xhat.dtype)
    # Weighted moments, renorm (through moving_stddev) and fused=False follow the
    # replaced layer's non-fused path: the biased variance (set_replaced_path).
    target_var = _moving_variance_target(config, var, moments.count)
    # (With batch_weights the count is the total weight: zero updates nothing.)
    return y, BatchStats(tf.stop_gradient(moments.mean), tf.stop_gradient(target_var),
                         tf.stop_gradient(moments.count), renorm_stats)


def _ghost_train(config, gamma, beta, x4, fmt, backend, key, guard):
    """Ghost batch norm: each virtual batch is normalized by its own statistics.

    With a sync group of ``N`` members, virtual batch ``k`` is the ``k``-th
    run of ``virtual_batch_size / N`` consecutive examples of every member, so
    it holds ``virtual_batch_size`` examples in all; every member must then
    have the same local batch size. The moving statistics follow tensorpack:
    the mean and (biased) variance of the first virtual batch.
    """
    members = key.group_size if backend is not None else 1
    vbs = config.virtual_batch_size
    if vbs % members:
        raise config.error('virtual_batch_size=%d is not a multiple of the %d members of the '
                           'sync group; each member contributes virtual_batch_size / %d '
                           'examples to every virtual batch.' % (vbs, members, members))
    per_member = vbs // members
    batch = tf.shape(x4)[0]
    check = tf.debugging.assert_equal(
        tf.math.floormod(batch, per_member), 0,
        message='%s: virtual_batch_size=%d needs a local batch size divisible by %d'
        % (config.layer, vbs, per_member))
    with tf.control_dependencies([check]):
        x4 = tf.identity(x4)
    groups = batch // per_member
    mean, var, xhat4 = _engine.ghost_normalize(x4, fmt, per_member, groups, backend, key,
                                               config.epsilon, control_inputs=guard)
    bshape = _math.broadcast_shape(fmt, config.channels)
    y4 = xhat4 * tf.cast(tf.reshape(gamma, bshape), xhat4.dtype) + \
        tf.cast(tf.reshape(beta, bshape), xhat4.dtype)
    # Every member has the same batch size: an empty local batch is an empty
    # global one. The first virtual batch, or zeros when there is none.
    zeros = tf.zeros([1, config.channels], tf.float32)
    first_mean = tf.concat([mean, zeros], 0)[0]
    first_var = tf.concat([var, zeros], 0)[0]
    count = tf.cast(groups, tf.float32)
    return (_restore(y4, config.inputs),
            BatchStats(tf.stop_gradient(first_mean), tf.stop_gradient(first_var), count, None))


def _renorm_correction(config, renorm_vars, mean, var):
    """Batch Renormalization's ``r`` and ``d`` (no gradient) from global moments."""
    stddev = tf.sqrt(var + config.epsilon)
    renorm_mean = tf.convert_to_tensor(renorm_vars.mean)
    renorm_stddev = tf.maximum(tf.convert_to_tensor(renorm_vars.stddev),
                               tf.sqrt(tf.constant(config.epsilon, tf.float32)))
    r = stddev / renorm_stddev
    d = (mean - renorm_mean) / renorm_stddev
    clip = config.renorm_clipping or {}
    rmin, rmax, dmax = clip.get('rmin'), clip.get('rmax'), clip.get('dmax')
    if rmin is not None:
        r = tf.maximum(r, tf.cast(rmin, r.dtype))
    if rmax is not None:
        r = tf.minimum(r, tf.cast(rmax, r.dtype))
    if dmax is not None:
        dmax = tf.cast(dmax, d.dtype)
        d = tf.clip_by_value(d, -dmax, dmax)
    r, d = tf.stop_gradient(r), tf.stop_gradient(d)
    # The renorm statistics are updated in the same step: read them first.
    with tf.control_dependencies([r, d]):
        new_stats = (tf.identity(tf.stop_gradient(mean)), tf.identity(tf.stop_gradient(stddev)))
    return r, d, new_stats


def _infer_output(config, params, x4, fmt):
    """Inference / frozen statistics: one fused kernel on the moving statistics.

    With ``fused=False`` the same formula is built from separate ops.
    """
    ones = tf.ones([config.channels], tf.float32)
    zeros = tf.zeros([config.channels], tf.float32)
    gamma = _vector(params.gamma, ones)
    beta = _vector(params.beta, zeros)
    mean = tf.convert_to_tensor(params.moving_mean)
    variance = tf.convert_to_tensor(params.moving_variance)
    if config.fused is False:
        x = config.inputs
        shape = _math.layout_broadcast_shape(x.shape.ndims, config.channels_last,
                                             config.channels)
        scale = tf.math.rsqrt(variance + config.epsilon) * gamma
        return ((x - tf.cast(tf.reshape(mean, shape), x.dtype)) *
                tf.cast(tf.reshape(scale, shape), x.dtype) + tf.cast(tf.reshape(beta, shape),
                                                                      x.dtype))
    # Named as tf.nn.fused_batch_norm (and so slim) names it.
    y4, _ = _math.normalize(x4, gamma, beta, mean, variance, config.epsilon, fmt,
                            name='FusedBatchNormV3')
    return _restore(y4, config.inputs)


def _assign_moving_average(variable, value, decay, active, float32_decay=False):
    """``variable -= (variable - value) * (1 - decay)`` where ``active``, else nothing.

    The ops are named as ``moving_averages.assign_moving_average`` (and Keras)
    name them (``AssignMovingAvg``, ``AssignMovingAvg_1``, ... under the
    current name scope), and compute the same numbers.

    Args:
      variable: the moving-average variable (never partitioned).
      value: its new observation.
      decay: a Python number or a float scalar tensor.
      active: a scalar bool tensor; False leaves ``variable`` as it is.
      float32_decay: compute ``1 - decay`` in float32 as Keras' fused path
        does (``assign_moving_average`` computes it in double).
    """
    with tf1.name_scope(None, 'AssignMovingAvg', [variable, value, decay]) as scope:
        if float32_decay and isinstance(decay, numbers.Real):
            decay = tf.constant(decay, tf.float32)
        one_minus = tf.convert_to_tensor(1.0 - decay, name='decay')
        if one_minus.dtype != variable.dtype.base_dtype:
            one_minus = tf.cast(one_minus, variable.dtype.base_dtype)
        delta = (variable - value) * one_minus
        delta = tf.where(active, delta, tf.zeros_like(delta))
        return tf1.assign_sub(variable, delta, name=scope)


def _assign_zero_debiased_average(variable, value, decay, active, debias):
    """``assign_moving_average(..., zero_debias=True)`` that skips inactive steps.

    TensorFlow's version counts every run of the op in ``local_step``, so a step
    without data would change the debiased mean; here an inactive step leaves
    ``biased``, ``local_step`` and ``variable`` as they are. Same names and
    numbers otherwise.

    Args:
      debias: ``(biased, local_step)`` from :func:`zero_debias_variables`.
    """
    biased, local_step = debias
    with tf1.name_scope(None, 'AssignMovingAvg', [variable, value, decay]):
        one_minus = tf.convert_to_tensor(1.0 - decay, name='decay')
        if one_minus.dtype != variable.dtype.base_dtype:
            one_minus = tf.cast(one_minus, variable.dtype.base_dtype)
        delta = (biased - value) * one_minus
        update_biased = tf1.assign_sub(biased, tf.where(active, delta, tf.zeros_like(delta)))
        update_step = tf1.assign_add(local_step, tf.cast(active, local_step.dtype.base_dtype))
        bias_factor = 1 - tf.pow(1.0 - one_minus, update_step)
        new_value = tf.where(active, update_biased / bias_factor,
                             tf.convert_to_tensor(variable))
        return tf1.assign(variable, new_value,
                          name=tf1.get_default_graph().get_name_scope() + '/')


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
    collections = [tf1.GraphKeys.GLOBAL_VARIABLES]
    if model_variables:
        collections.append(tf1.GraphKeys.MODEL_VARIABLES)
    dtype = moving_mean.dtype.base_dtype
    with tf1.variable_scope(moving_mean.op.name) as scope, tf1.colocate_with(moving_mean.op):
        scope.set_partitioner(None)
        biased = tf1.get_variable('biased', shape=moving_mean.shape, dtype=dtype,
                                  initializer=tf1.zeros_initializer(), trainable=False,
                                  collections=collections)
        local_step = tf1.get_variable('local_step', shape=[], dtype=dtype,
                                      initializer=tf1.zeros_initializer(), trainable=False,
                                      collections=collections)
    return biased, local_step


def _update_ops(config, params, stats, finetune=None):
    """The moving-average assignments of one training step.

    An empty global batch (``stats.count == 0``) updates nothing. Names and
    order follow slim / Keras: ``AssignMovingAvg`` (mean), ``AssignMovingAvg_1``
    (variance); with renorm, Keras' ``AssignMovingAvg`` (renorm_mean),
    ``_1`` (renorm_stddev), ``_2`` (moving_mean), ``_3`` (moving_stddev) and
    ``AssignNewValue`` (moving_variance), where the renorm updates run as
    control dependencies of the other two.

    Args:
      finetune: None, or ``(decay, new_count)`` from :func:`finetune_decay`.

    Returns:
      The update ops for the updates collection (the fine-tune counter's
      assignment last, when there is one).
    """
    active = tf.greater(stats.count, 0.0)
    if finetune is None:
        decay, float32_decay = config.momentum, config.float32_decay
    else:
        decay, float32_decay = finetune[0], False

    def average(variable, value, var_decay, f32=False):
        return _assign_moving_average(variable, value, var_decay, active, f32)

    if params.zero_debias is not None:
        mean_update = _assign_zero_debiased_average(params.moving_mean, stats.mean, decay,
                                                    active, params.zero_debias)
    elif stats.renorm is None:
        mean_update = average(params.moving_mean, stats.mean, decay, float32_decay)
    if stats.renorm is None:
        ops = [mean_update, average(params.moving_variance, stats.variance, decay,
                                    float32_decay)]
    else:
        rmean, rstd = stats.renorm
        renorm_updates = [average(params.renorm.mean, rmean, config.renorm_momentum),
                          average(params.renorm.stddev, rstd, config.renorm_momentum)]
        with tf.control_dependencies(renorm_updates):
            rmean, rstd = tf.identity(rmean), tf.identity(rstd)
            if params.zero_debias is None:
                mean_update = average(params.moving_mean, stats.mean, decay)
            # moving_variance follows moving_stddev, as in Keras.
            moving_stddev = average(params.renorm.moving_stddev, rstd, decay)
            with tf1.name_scope(None, 'AssignNewValue') as scope:
                new_variance = tf.where(
                    active, tf.nn.relu(moving_stddev * moving_stddev - config.epsilon),
                    tf.convert_to_tensor(params.moving_variance))
                variance_update = tf1.assign(params.moving_variance, new_variance, name=scope)
        ops = [mean_update, variance_update]
    if finetune is not None:
        count = params.finetune_count
        new_count = tf.where(active, finetune[1], tf.convert_to_tensor(count))
        with tf.control_dependencies(ops):
            ops.append(tf1.assign(count, new_count, name='update_finetune_count'))
    return ops


def finetune_decay(config, count, finetune):
    """Decay ``1 - 1/n`` of fine-tune mode, and the counter's new value.

    Args:
      config: the layer's :class:`Config`.
      count: the layer's batch-counter variable.
      finetune: a Python bool or a scalar bool tensor.

    Returns:
      ``(decay, new_count)``: with fine-tune on, the moving statistics become
      the exact average of the batches seen since the last reset (steps with an
      empty global batch do not count).
    """
    active = tf.cast(tf.convert_to_tensor(finetune, tf.bool), tf.float32)
    new_count = tf.convert_to_tensor(count) + active
    decay = active * (1.0 - 1.0 / tf.maximum(new_count, 1.0)) + \
        (1.0 - active) * config.momentum
    return decay, new_count


def batch_norm(config, params, updates_collections=tf1.GraphKeys.UPDATE_OPS,
               update_moving=True, finetune=None, prediction_towers_update=False):
    """Builds one batch-norm call from a validated :class:`Config`.

    Args:
      config: the options (``validate()`` already called).
      params: the layer's :class:`Params`.
      updates_collections: where the moving-average updates go, or None for
        control dependencies on the output.
      update_moving: False never updates the moving statistics.
      finetune: None, or a Python bool / scalar bool tensor that switches the
        moving statistics to the exact average over batches (needs
        ``params.finetune_count``).
      prediction_towers_update: see :func:`tower_info`.

    Moving-average updates are built once per call, by the main training
    tower. With ``updates_collections``, every other training tower of the
    group adds to its own collections a trigger of those same updates
    (:meth:`_engine.SyncRegistry.trigger_updates`), so a harness that keeps
    the first tower's, the last tower's or every tower's ``UPDATE_OPS`` runs
    them exactly once per step.

    Returns:
      The output tensor, with the shape and dtype of the input.
    """
    x = config.inputs
    info = tower_info(config, prediction_towers_update)
    x4, fmt = _math.canonical_view(x, config.channels_last)
    training = config.is_training
    do_update = update_moving and info.main

    finetune_step = None
    if finetune is not None and params.finetune_count is not None and training is not False:
        active = finetune if training is True else tf.logical_and(
            tf.convert_to_tensor(finetune, tf.bool), training)
        finetune_step = finetune_decay(config, params.finetune_count, active)

    updates = []
    if training is False:
        y = _infer_output(config, params, x4, fmt)
    elif training is True:
        y, stats = _train_stats_and_output(config, params, info, x4, fmt)
        if do_update:
            updates = _update_ops(config, params, stats, finetune_step)
    else:
        def train_branch():
            y, st = _train_stats_and_output(config, params, info, x4, fmt)
            return (y, st.mean, st.variance, st.count) + tuple(st.renorm or ())

        def infer_branch():
            y = _infer_output(config, params, x4, fmt)
            extra = ()
            if config.renorm:
                extra = (tf.convert_to_tensor(params.renorm.mean),
                         tf.convert_to_tensor(params.renorm.stddev))
            return (y, tf.convert_to_tensor(params.moving_mean),
                    tf.convert_to_tensor(params.moving_variance),
                    tf.zeros([], tf.float32)) + extra

        outs = tf.cond(training, train_branch, infer_branch, name='is_training')
        y = outs[0]
        stats = BatchStats(outs[1], outs[2], outs[3],
                           tuple(outs[4:6]) if config.renorm else None)
        if do_update:
            # In inference the count is 0: the updates leave everything as it is
            # (and, as the statistics come from the branch taken, wait for nothing).
            updates = _update_ops(config, params, stats, finetune_step)
    if updates:
        if updates_collections is None:
            with tf.control_dependencies(updates):
                y = tf.identity(y)
        else:
            for op in updates:
                tf1.add_to_collections(updates_collections, op)
    _share_updates(info, updates, update_moving and training is not False,
                   updates_collections)
    y.set_shape(x.shape)
    return y


def _share_updates(info, updates, updating, updates_collections):
    """Puts a trigger of the main tower's updates into every other tower's collections."""
    if info.towers == 1 or updates_collections is None or not updating:
        return
    registry = _engine.get_registry()
    if info.main:
        if updates:
            registry.share_updates(info.towers, info.call, updates)
    elif info.ctx is None or info.ctx.is_training:
        tf1.add_to_collections(updates_collections,
                               registry.trigger_updates(info.towers, info.call))

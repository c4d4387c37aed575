"""tensorpack-compatible ``BatchNorm`` and ``BatchRenorm`` on the shared engine."""

import logging
import types

import tensorflow as tf

from tf1_syncbn._frontend.building import (FINETUNE_COUNTERS, STATISTICS_AGGREGATION, Params,
                                           RenormVariables, assignable, batch_norm,
                                           check_graph_mode, check_inputs, check_options,
                                           received_variables)
from tf1_syncbn.tensorpack.rules import (DATA_FORMATS, DEFAULT_CENTER, DEFAULT_GAMMA_INITIALIZER,
                                         DEFAULT_MOMENTUM, DEFAULT_SCALE, EMA_UPDATES,
                                         batch_norm_arguments, batch_renorm_arguments,
                                         check_format_and_training, reciprocal,
                                         tensorpack_layer, tensorpack_runs_fused_kernel)

__all__ = ['BatchNorm', 'BatchRenorm', 'start_finetuning']

tf1 = tf.compat.v1
_LOG = logging.getLogger('tf1_syncbn')
_WARNED = set()


def _warn_once(message):
    if message not in _WARNED:
        _WARNED.add(message)
        _LOG.warning(message)


def _finetune_counter(finetune):
    if finetune is None:
        return None
    with tf1.variable_scope(tf1.get_variable_scope()) as unpartitioned:
        unpartitioned.set_partitioner(None)  # counters are never partitioned
        counter = tf1.get_variable('finetune_count', [], tf.float32, tf1.zeros_initializer(),
                                   trainable=False, aggregation=STATISTICS_AGGREGATION)
    if counter not in tf1.get_collection(FINETUNE_COUNTERS):
        tf1.add_to_collection(FINETUNE_COUNTERS, counter)
    return counter


def start_finetuning(graph=None):
    """An op that restarts the exact averaging of fine-tune mode in every layer.

    In fine-tune mode (``finetune=True`` or a true ``finetune`` tensor), the
    moving statistics of a layer are the exact average of the batch statistics
    of the training steps since the last reset (ChainerMN's ``finetune``,
    ``decay = 1 - 1/n``). Run this op before collecting population statistics
    again; the counters start at zero, so a first run needs no reset.

    Args:
      graph: the graph whose layers to reset (default: the current graph).

    Returns:
      An op, or a no-op when no layer uses fine-tune mode.
    """
    graph = graph or tf1.get_default_graph()
    with graph.as_default():
        counters = tf1.get_collection(FINETUNE_COUNTERS)
        return tf.group(*[tf1.assign(c, tf.zeros_like(c)) for c in counters],
                        name='start_finetuning')


def _add_model_variables(ctx, variables):
    """Moving statistics are model variables of the main training tower (as tensorpack).

    The collection holds the variables themselves, also where a
    ``custom_getter`` returned a tensor computed from them (so that
    ``Saver(tf.model_variables())`` and tensorpack's checkpoint code work).
    """
    if ctx is None or ctx.is_main_training_tower:
        for v in map(assignable, variables):
            if v not in tf1.get_collection(tf1.GraphKeys.MODEL_VARIABLES):
                tf1.add_to_collection(tf1.GraphKeys.MODEL_VARIABLES, v)


def _get_variable(name, channels, initializer, trainable=True):
    """A float32 ``[C]`` variable; only trainable ones follow the scope's partitioner."""
    if trainable:
        return tf1.get_variable(name, [channels], tf.float32, initializer, trainable=True)
    # Moving statistics are never partitioned (as Keras, which tensorpack uses).
    with tf1.variable_scope(tf1.get_variable_scope()) as unpartitioned:
        unpartitioned.set_partitioner(None)
        return tf1.get_variable(name, [channels], tf.float32, initializer, trainable=False,
                                aggregation=STATISTICS_AGGREGATION)


def _holder(**variables):
    return types.SimpleNamespace(**{k: v for k, v in variables.items() if v is not None})


@tensorpack_layer
@tf.autograph.experimental.do_not_convert     # (see tf1_syncbn._core.call)
def BatchNorm(name, inputs, axis=None, *, training=None, momentum=DEFAULT_MOMENTUM, epsilon=1e-5,
              center=DEFAULT_CENTER, scale=DEFAULT_SCALE, beta_initializer=None,
              gamma_initializer=DEFAULT_GAMMA_INITIALIZER,
              virtual_batch_size=None, data_format='channels_last', ema_update='default',
              sync_statistics=None, finetune=None, group_size=None, num_dev=None,
              **legacy_kwargs):
    """tensorpack's ``BatchNorm`` layer, with synchronized statistics on any device.

    Call it as tensorpack users do: ``BatchNorm('bn', x, sync_statistics='nccl')``.
    Checkpoints written by tensorpack's ``BatchNorm`` restore unchanged.

    Variable names (under ``name``):

    * ``beta``, ``gamma``: offset and scale (when ``center`` / ``scale``).
    * ``mean/EMA``, ``variance/EMA``: the moving statistics, never partitioned
      (``beta``/``gamma`` follow the scope's partitioner). As in tensorpack's
      single-device layer, the variance tracks the Bessel-corrected variance
      of the (global) batch where tensorpack runs the fused kernel (4-D
      inputs, and float16 5-D), and the biased one elsewhere (2-D inputs, a
      virtual batch; ranks 3 and 5, which tensorpack rejects, follow its code
      and are not fused). tensorpack's own synchronized path tracks the biased
      ``E[x^2] - E[x]^2`` even on 4-D inputs: this layer follows its
      single-device path instead, so N synchronized towers equal one device.
      A step whose global batch is empty updates nothing.
    * ``finetune_count``: with ``finetune``, the number of averaged batches.

    When synchronization hangs, and how it fails instead (as for
    :func:`tf1_syncbn.sync_batch_norm`): every tower must build and run the
    same synchronized layers in every step, under the same names. Towers built
    in ``tower.TowerContext`` are checked at graph build; the collective
    backend turns a missing member into ``DeadlineExceededError`` after its
    timeout; NCCL waits forever. With synchronization the moving averages are
    always updated inside the layer (``ema_update='internal'``): update ops in a
    collection would wait for other towers' forward passes (tensorpack issue
    1078).

    Args:
      name: the layer's variable scope.
      inputs: a rank 2 to 5 tensor (float16, bfloat16 or float32).
      axis: the channel axis (1 or the last); default from ``data_format``.
      training: a Python bool or a scalar bool tensor (anything else is a
        TypeError; tensorpack would take ``bool(training)``, so that ``'False'``
        trains). True uses batch statistics; False the moving statistics (and
        still trains beta/gamma: frozen statistics, warned once inside a
        training tower). None follows the tower context (True outside one):
        in tensorpack's ``PredictTowerContext`` (``OfflinePredictor``,
        ``InferenceRunner``) it normalizes with the moving statistics and
        never updates them. As in tensorpack, an explicit ``training=True``
        in a prediction tower uses batch statistics *and* updates them.
        A tensor switches at run time.
      momentum: decay of the moving averages (old name: ``decay``): a number
        in [0, 1] or a float scalar tensor.
      epsilon: added to the variance.
      center, scale: learn ``beta`` / ``gamma`` (old names ``use_bias``,
        ``use_scale``).
      beta_initializer, gamma_initializer: initializers (old name of the
        latter: ``gamma_init``).
      virtual_batch_size: ghost batch norm: normalize each virtual batch of this
        many examples by its own statistics. With synchronization over ``N``
        members, virtual batch ``k`` is the ``k``-th run of
        ``virtual_batch_size / N`` consecutive examples of every member (so
        ``N`` must divide it and every member must have the same batch size).
        The moving statistics are those of the first virtual batch, with its
        biased variance, as in tensorpack. Only used in training.
      data_format: ``'channels_last'`` / ``'NHWC'`` or ``'channels_first'`` /
        ``'NCHW'`` (any rank; rank-2 inputs are ``[N, C]``).
      ema_update: ``'default'`` or ``'collection'`` (update ops in
        ``UPDATE_OPS`` on the main training tower), ``'internal'`` (control
        dependencies of the output) or ``'skip'``.
      sync_statistics: None (per-tower statistics), ``'nccl'``, ``'horovod'``,
        ``'collective'``, ``'auto'`` or a :class:`tf1_syncbn.SyncBackend`.
      finetune: None, or a Python bool / scalar bool tensor: when true, the
        moving statistics become the exact average of the batches seen since
        :func:`start_finetuning` (ChainerMN's fine-tune mode).
      group_size: None (synchronize every tower), or synchronize within groups
        of that many consecutive global towers, or explicit groups (lists of
        global tower indices); as for :func:`tf1_syncbn.sync_batch_norm`. Needs
        a ``sync_statistics`` other than None.
      num_dev: the number of towers in this graph, for towers built under
        name scopes ``tower_<i>`` / ``tower<i>`` / ``clone_<i>`` (or a pattern
        registered with :func:`tower.register_tower_pattern`) without a tower
        context: a plain ``for i: with tf.device(...), tf.name_scope('tower_%d'
        % i):`` loop. Leave it out under tensorpack's trainers and
        ``tower.TowerContext`` (they know the count); ``1`` where copies of
        the layer on several devices are one tower on purpose (one model split
        across devices).
      **legacy_kwargs: tensorpack's old names (``use_bias``, ``use_scale``,
        ``gamma_init``, ``decay``, ``use_local_stat``).

    Returns:
      A tensor named ``<name>/output`` with the shape of ``inputs``; its
      ``variables`` attribute holds ``beta``, ``gamma``, ``mean``/``moving_mean``
      and ``variance``/``moving_variance``.
    """
    layer = 'BatchNorm(%r)' % (name,)
    check_graph_mode(layer)
    values, training, arg_names = batch_norm_arguments(
        layer, legacy_kwargs, training, momentum=momentum, center=center, scale=scale,
        gamma_initializer=gamma_initializer)
    if ema_update not in EMA_UPDATES:
        raise ValueError('%s: ema_update must be one of %s, got %r.'
                         % (layer, EMA_UPDATES, ema_update))
    ctx, training = check_format_and_training(layer, data_format, training)
    if training is False and ctx is not None and ctx.is_training and \
            ctx.is_main_training_tower:
        _warn_once('BatchNorm layers use their moving mean/variance in a training tower '
                   '(training=False): the statistics are frozen, beta/gamma still train.')
    beta_initializer = beta_initializer or tf1.zeros_initializer()

    with tf1.variable_scope(name) as vs:
        options = check_options(
            'BatchNorm(%s)' % vs.name, arg_names=arg_names,
            data_format=DATA_FORMATS[data_format], axis=axis, is_training=training,
            momentum=values['momentum'], epsilon=epsilon, center=values['center'],
            scale=values['scale'], sync_statistics=sync_statistics, group_size=group_size,
            num_dev=num_dev,
            virtual_batch_size=virtual_batch_size if training is not False else None)
        x, layout = check_inputs(options, inputs)
        fused = tensorpack_runs_fused_kernel(layout.rank, x.dtype.base_dtype,
                                             options.virtual_batch_size)
        # Keras' fused path computes 1 - momentum in float32.
        options = options.with_replaced_path(fused, float32_decay=fused)
        channels = layout.channels
        with received_variables():
            beta = _get_variable('beta', channels, beta_initializer) if options.center else None
            gamma = _get_variable('gamma', channels, values['gamma_initializer']) \
                if options.scale else None
            moving_mean = _get_variable('mean/EMA', channels, tf1.zeros_initializer(), False)
            moving_var = _get_variable('variance/EMA', channels, tf1.ones_initializer(), False)
            params = Params(beta, gamma, moving_mean, moving_var,
                            finetune_count=_finetune_counter(finetune))
        _add_model_variables(ctx, (moving_mean, moving_var))
        collections = [tf1.GraphKeys.UPDATE_OPS]
        if ema_update == 'internal' or sync_statistics is not None:
            collections = None
        # As tensorpack's layer: a prediction tower that is asked for batch
        # statistics (training=True) updates the moving statistics too.
        out = batch_norm(x, layout, options, params, updates_collections=collections,
                         update_moving=ema_update != 'skip', finetune=finetune,
                         prediction_towers_update=True)
        out = tf.identity(out, name='output')
    _attach_variables(out, beta=beta, gamma=gamma, moving_mean=moving_mean,
                      mean=moving_mean, moving_variance=moving_var, variance=moving_var)
    return out


def _attach_variables(tensor, **variables):
    try:
        tensor.variables = _holder(**variables)
    except AttributeError:  # pragma: no cover - tensors that refuse attributes
        pass


@tensorpack_layer
@tf.autograph.experimental.do_not_convert     # (see tf1_syncbn._core.call)
def BatchRenorm(name, x, rmax, dmax, *, momentum=0.9, epsilon=1e-5, center=True, scale=True,
                gamma_initializer=None, data_format='channels_last', sync_statistics=None,
                training=None, group_size=None, num_dev=None, **legacy_kwargs):
    """tensorpack's ``BatchRenorm`` (Batch Renormalization, Ioffe 2017), synchronizable.

    It runs the renorm path of :func:`tf1_syncbn.sync_batch_norm`: ``r`` and
    ``d`` come from the global-batch moments when ``sync_statistics`` is set.
    The renorm statistics use ``renorm_momentum=0.99`` and the clipping
    ``rmin = 1 / rmax``, ``rmax``, ``dmax``, as in tensorpack.

    Variable names (under ``name``), as Keras' renorm layer (which tensorpack
    wraps) creates them: ``beta``, ``gamma``, ``moving_mean``,
    ``moving_variance``, ``moving_stddev``, ``renorm_mean``, ``renorm_stddev``.
    As in tensorpack (non-fused Keras layer), ``moving_variance`` follows
    ``moving_stddev``, which averages ``sqrt(var + epsilon)`` of the biased
    batch variance. One difference: with ``gamma_initializer=None``,
    tensorpack's ``gamma`` starts at Keras' default for weights
    (``glorot_uniform``, random); here it starts at ones.

    The update ops go to ``UPDATE_OPS`` on the main training tower, or run
    inside the layer when synchronized (see :func:`BatchNorm` for when sync
    hangs and how it fails instead).

    Args:
      name: the layer's variable scope.
      x: a rank 2 to 5 tensor.
      rmax, dmax: the maximal corrections; Python numbers (checked:
        ``rmax >= 1``, ``dmax >= 0``) or scalar tensors. ``rmin = 1 / rmax``.
      momentum: decay of the moving averages (old name: ``decay``).
      epsilon: added to the variance.
      center, scale: learn ``beta`` / ``gamma`` (old names: ``use_bias``,
        ``use_scale``).
      gamma_initializer: initializer of ``gamma`` (old name: ``gamma_init``).
      data_format: ``'channels_last'`` or ``'channels_first'``.
      sync_statistics: as for :func:`BatchNorm`.
      training: None follows the tower context (True outside one).
      group_size: as for :func:`BatchNorm`.
      num_dev: as for :func:`BatchNorm` (name-scope towers without a tower context).

    Returns:
      A tensor named ``<name>/output`` with the shape of ``x``.
    """
    layer = 'BatchRenorm(%r)' % (name,)
    check_graph_mode(layer)
    values, arg_names = batch_renorm_arguments(
        layer, legacy_kwargs, momentum=momentum, center=center, scale=scale,
        gamma_initializer=gamma_initializer)
    ctx, training = check_format_and_training(layer, data_format, training)
    with tf1.variable_scope(name) as vs:
        options = check_options(
            'BatchRenorm(%s)' % vs.name, arg_names=arg_names,
            data_format=DATA_FORMATS[data_format], is_training=training,
            momentum=values['momentum'], epsilon=epsilon, center=values['center'],
            scale=values['scale'], renorm=True,
            renorm_clipping={'rmin': reciprocal(rmax), 'rmax': rmax, 'dmax': dmax},
            renorm_momentum=0.99, sync_statistics=sync_statistics, group_size=group_size,
            num_dev=num_dev)
        x, layout = check_inputs(options, x)
        # tensorpack builds Keras' layer with fused=False.
        options = options.with_replaced_path(False)
        channels = layout.channels
        gamma_init = values['gamma_initializer'] or tf1.ones_initializer()
        mean_init, var_init = tf1.zeros_initializer(), tf1.ones_initializer()
        with received_variables():
            beta = _get_variable('beta', channels, tf1.zeros_initializer()) \
                if options.center else None
            gamma = _get_variable('gamma', channels, gamma_init) if options.scale else None
            moving_mean = _get_variable('moving_mean', channels, mean_init, False)
            moving_var = _get_variable('moving_variance', channels, var_init, False)
            renorm_vars = RenormVariables.create(
                lambda n, init: _get_variable(n, channels, init, False), mean_init, var_init)
        _add_model_variables(ctx, (moving_mean, moving_var) + tuple(renorm_vars))
        params = Params(beta, gamma, moving_mean, moving_var, renorm_vars)
        collections = None if sync_statistics is not None else [tf1.GraphKeys.UPDATE_OPS]
        out = tf.identity(batch_norm(x, layout, options, params,
                                     updates_collections=collections), name='output')
    _attach_variables(out, beta=beta, gamma=gamma)
    return out

"""``sync_batch_norm``: a drop-in, synchronized ``slim.batch_norm``."""

import tensorflow as tf
from tf_slim.layers import utils as slim_utils
from tf_slim.ops import variables as slim_variables
from tf_slim.ops.arg_scope import add_arg_scope

from tf1_syncbn._frontend.building import (FINETUNE_COUNTERS, STATISTICS_AGGREGATION, Params,
                                           RenormVariables, batch_norm, check_dict_keys,
                                           check_graph_mode, check_inputs, check_options,
                                           received_variables, zero_debias_variables)
from tf1_syncbn.slim.rules import (ARG_NAMES, PARAM_INITIALIZER_KEYS, PARAM_REGULARIZER_KEYS,
                                   slim_runs_fused_kernel)

__all__ = ['sync_batch_norm']

tf1 = tf.compat.v1


@add_arg_scope
@tf.autograph.experimental.do_not_convert     # (see tf1_syncbn._core.call)
def sync_batch_norm(inputs,
                    decay=0.999,
                    center=True,
                    scale=False,
                    epsilon=0.001,
                    activation_fn=None,
                    param_initializers=None,
                    param_regularizers=None,
                    updates_collections=tf1.GraphKeys.UPDATE_OPS,
                    is_training=True,
                    reuse=None,
                    variables_collections=None,
                    outputs_collections=None,
                    trainable=True,
                    batch_weights=None,
                    fused=None,
                    data_format='NHWC',
                    zero_debias_moving_mean=False,
                    scope=None,
                    renorm=False,
                    renorm_clipping=None,
                    renorm_decay=0.99,
                    adjustment=None,
                    num_dev=None,
                    sync_statistics='auto',
                    finetune=None,
                    group_size=None):
    """Synchronized batch normalization with the signature of ``slim.batch_norm``.

    In training, the statistics are those of the *global* batch: every tower of
    the sync group (the tower context's ``total``, or ``num_dev``) contributes
    its examples, and the gradient flows through the global statistics. The
    result, its gradients and every variable equal those of ``slim.batch_norm``
    (tf-slim 1.1) on one device with the concatenation of the towers' batches,
    with the same options, whatever the per-tower batch sizes (uneven or empty
    ones included).

    Communication is one packed all-reduce forward and one backward per call.

    Use it wherever ``slim.batch_norm`` is used::

        with slim.arg_scope([slim.conv2d], normalizer_fn=sync_batch_norm,
                            normalizer_params={'decay': 0.9, 'scale': True}):
            net = slim.conv2d(images, 64, [3, 3])

    Variable names (under ``scope``, default ``'BatchNorm'``), as in slim so
    that slim checkpoints restore unchanged:

    * ``beta``: the offset, when ``center``.
    * ``gamma``: the scale, when ``scale``.
    * ``moving_mean``, ``moving_variance``: the moving statistics, never
      partitioned (``beta`` and ``gamma`` follow the scope's partitioner, as
      in slim). Which batch variance the moving variance tracks follows the
      path slim would take: where slim runs its fused kernel (``fused`` None or
      True, no ``batch_weights``, ``renorm`` or ``adjustment``, and rank 2 or
      4; or rank 5 with the default ``updates_collections`` and no
      ``zero_debias_moving_mean``), the Bessel-corrected (unbiased) variance
      of the global batch; elsewhere (``fused=False``, rank 3, the options
      above) the biased one (the weighted one with ``batch_weights``). This
      layer itself always uses its own fast synchronized kernels, whichever
      variance it tracks.
    * with ``renorm``: ``moving_stddev``, ``renorm_mean`` and
      ``renorm_stddev``, as Keras' renorm (which slim uses) names them. In
      renorm mode ``moving_variance`` is ``moving_stddev**2 - epsilon``, where
      ``moving_stddev`` averages ``sqrt(var + epsilon)`` of the (biased) batch
      variance, as in Keras. (slim rejects renorm together with
      ``batch_weights``, ``zero_debias_moving_mean`` or another
      ``updates_collections``; this layer accepts them.)
    * with ``zero_debias_moving_mean`` (in training): ``<scope>/<scope>/
      moving_mean/biased`` and ``.../local_step``, as ``assign_moving_average``
      names them. They are model variables where slim's non-fused path runs,
      and not where its fused path runs, as in slim.

    The update ops are named as in slim: ``<scope>/AssignMovingAvg`` (mean) and
    ``AssignMovingAvg_1`` (variance); the per-tower fused kernel (training
    without synchronization, and inference) is ``<scope>/FusedBatchNormV3``.
    A step whose global batch is empty (every tower's batch empty) updates
    nothing.

    Float16 and bfloat16 inputs keep float32 variables and float32 statistics.

    When synchronization hangs, and how it fails instead:

    * Every tower of a sync group must build the same synchronized layers the
      same number of times, under the same scope names (tower prefixes are
      stripped). Towers built with ``tower.TowerContext`` are checked when the
      last tower is built, and a mismatch raises ``ValueError``.
    * Every tower must *run* each synchronized layer in the same step. With
      ``sync_statistics='collective'`` a member that waits longer than the
      backend's timeout fails with ``DeadlineExceededError``; NCCL has no
      timeout and waits forever.
    * The moving-average updates (in ``updates_collections``) depend on the
      global statistics: run them in the same ``session.run`` as the forward
      pass of every tower (for example, as a control dependency of the train
      op). Run alone, they wait for the other towers and time out (or hang
      with NCCL). ``updates_collections=None`` avoids the question.

    Args:
      inputs: a tensor of rank 2 to 5 with a known channel dimension:
        ``[N, C]``, ``[N, L, C]``, ``[N, H, W, C]``, ``[N, D, H, W, C]`` (or
        channels first). float16, bfloat16 or float32.
      decay: decay of the moving averages (``1 - momentum``-style, 0.999 means
        slow): a number in [0, 1] or a float scalar tensor.
      center: add the learned offset ``beta``.
      scale: multiply by the learned ``gamma``.
      epsilon: added to the variance.
      activation_fn: applied to the output, or None.
      param_initializers: optional dict with keys among ``beta``, ``gamma``,
        ``moving_mean``, ``moving_variance``.
      param_regularizers: optional dict with keys among ``beta``, ``gamma``.
      updates_collections: collections that receive the moving-average update
        ops, or None to run them as control dependencies of the output.
      is_training: a Python bool or a scalar bool tensor. True normalizes with
        batch statistics (synchronized) and updates the moving averages on the
        main tower; False normalizes with the moving statistics in one fused
        kernel, and still trains ``gamma``/``beta`` (frozen statistics).
      reuse: reuse the variables of ``scope``.
      variables_collections: a list of collections, or a dict from the
        variable keys above to collections, for the variables.
      outputs_collections: collections that receive the output.
      trainable: whether ``beta`` and ``gamma`` are trainable.
      batch_weights: optional ``[batch]`` tensor of per-example weights;
        statistics become weighted moments of the global batch.
      fused: a hint, as in slim: None or True use the fast fused kernels, and
        fall back silently to separate ops where no fused kernel applies
        (``batch_weights``, ``renorm``, ``adjustment``); False uses separate
        ops. It also decides, as slim's rule does, which variance the moving
        variance tracks (see above).
      data_format: ``'NHWC'`` or ``'NCHW'`` (any rank), ``'NDHWC'`` or
        ``'NCDHW'`` (rank 5). Rank-2 inputs are always ``[N, C]``.
      zero_debias_moving_mean: debias the moving mean (slim's option).
      scope: variable scope, default ``'BatchNorm'``.
      renorm: use Batch Renormalization (Ioffe, 2017) with synchronized moments.
      renorm_clipping: dict with keys among ``rmax``, ``rmin``, ``dmax``.
      renorm_decay: decay of the renorm moving statistics.
      adjustment: a function from the input's dynamic shape to a pair
        ``(scale, bias)`` applied to the normalized output, as in slim.
      num_dev: the number of all-reduce members. Inside a ``TowerContext`` it
        must agree with the towers (and may be omitted); outside one, it gives
        the group size and the tower index is read from a ``tower<i>`` name
        scope, as in the classic multi-GPU scripts.
      sync_statistics: ``'auto'`` (NCCL when the tower is on a GPU, collective
        ops otherwise, nothing with a single tower), ``'collective'``,
        ``'nccl'``, ``'horovod'``, None (per-tower statistics) or a
        :class:`tf1_syncbn.SyncBackend` object.
      finetune: None, or a Python bool / scalar bool tensor: when true, the
        moving statistics become the exact average of the batches seen since
        :func:`tf1_syncbn.start_finetuning` (``decay = 1 - 1/n``, ChainerMN's
        fine-tune mode); adds the variable ``finetune_count``.
      group_size: None (synchronize every tower of every worker), or an int:
        synchronize within groups of that many consecutive global towers
        (worker ``w``'s tower ``t`` is ``w * towers + t``), which must divide
        the towers; or explicit groups, a list of lists of global tower
        indices. The moving statistics follow the group of global tower 0
        (see docs/sync-groups.md).

    Returns:
      A tensor with the shape and dtype of ``inputs``.

    Raises:
      ValueError, TypeError: on invalid configuration or input, at graph build.
    """
    check_graph_mode('sync_batch_norm')
    initializers = check_dict_keys('sync_batch_norm', 'param_initializers', param_initializers,
                                   PARAM_INITIALIZER_KEYS)
    regularizers = check_dict_keys('sync_batch_norm', 'param_regularizers', param_regularizers,
                                   PARAM_REGULARIZER_KEYS)
    with tf1.variable_scope(scope, 'BatchNorm', [inputs], reuse=reuse) as sc:
        options = check_options(
            'sync_batch_norm(%s)' % sc.name, arg_names=ARG_NAMES,
            data_format=data_format, is_training=is_training, momentum=decay, epsilon=epsilon,
            center=center, scale=scale, fused=fused, renorm=renorm,
            renorm_clipping=renorm_clipping, renorm_momentum=renorm_decay, adjustment=adjustment,
            num_dev=num_dev, sync_statistics=sync_statistics,
            zero_debias=zero_debias_moving_mean, group_size=group_size)
        x, layout = check_inputs(options, inputs)
        slim_fused, keras_fused = slim_runs_fused_kernel(
            fused, layout.rank, batch_weights, renorm, adjustment, zero_debias_moving_mean,
            updates_collections)
        options = options.with_replaced_path(slim_fused, float32_decay=keras_fused)
        with received_variables():
            params = _slim_variables(layout.channels, options, initializers, regularizers,
                                     variables_collections, trainable, finetune,
                                     zero_debias_moving_mean and is_training is not False,
                                     debias_model_variables=not slim_fused)
        outputs = batch_norm(x, layout, options, params, batch_weights=batch_weights,
                             updates_collections=updates_collections, finetune=finetune)
        if activation_fn is not None:
            outputs = activation_fn(outputs)
        return slim_utils.collect_named_outputs(outputs_collections, sc.name, outputs)


def _slim_variables(channels, options, initializers, regularizers, variables_collections,
                    trainable, finetune, zero_debias, debias_model_variables):
    """The layer's variables, named and collected as slim does, in the current scope.

    ``beta`` and ``gamma`` follow the scope's partitioner, as in slim; the
    statistics never are partitioned (slim clears the partitioner for them).
    """
    def make(name, initializer, trainable_var, regularizer=None):
        return slim_variables.model_variable(
            name, shape=[channels], dtype=tf.float32, initializer=initializer,
            regularizer=regularizer, trainable=trainable_var,
            collections=slim_utils.get_variable_collections(variables_collections, name),
            aggregation=(tf.VariableAggregation.NONE if trainable_var
                         else STATISTICS_AGGREGATION))

    beta = gamma = None
    if options.center:
        beta = make('beta', initializers.get('beta', tf1.zeros_initializer()), trainable,
                    regularizers.get('beta'))
    if options.scale:
        gamma = make('gamma', initializers.get('gamma', tf1.ones_initializer()), trainable,
                     regularizers.get('gamma'))
    with tf1.variable_scope(tf1.get_variable_scope()) as unpartitioned:
        unpartitioned.set_partitioner(None)
        mean_init = initializers.get('moving_mean', tf1.zeros_initializer())
        var_init = initializers.get('moving_variance', tf1.ones_initializer())
        moving_mean = make('moving_mean', mean_init, False)
        moving_var = make('moving_variance', var_init, False)
        renorm_vars = None
        if options.renorm:
            renorm_vars = RenormVariables.create(lambda name, init: make(name, init, False),
                                                 mean_init, var_init)
        counter = None
        if finetune is not None:
            counter = slim_variables.model_variable(
                'finetune_count', shape=[], dtype=tf.float32,
                initializer=tf1.zeros_initializer(), trainable=False,
                aggregation=STATISTICS_AGGREGATION,
                collections=[FINETUNE_COUNTERS] + list(
                    slim_utils.get_variable_collections(variables_collections,
                                                        'finetune_count') or []))
        debias = None
        if zero_debias:
            # slim's non-fused path makes every variable of its scope a model
            # variable; its fused path does not.
            debias = zero_debias_variables(moving_mean, model_variables=debias_model_variables)
    return Params(beta, gamma, moving_mean, moving_var, renorm_vars, counter, debias)


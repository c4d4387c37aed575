"""The two names of :mod:`tf1_syncbn.layers`: :func:`batch_normalization`, the layer class."""

import tensorflow as tf

from tf1_syncbn._frontend.building import (STATISTICS_AGGREGATION, Params, RenormVariables,
                                           adjustment_in_view, batch_norm, check_graph_mode,
                                           check_inputs, check_options, from_view,
                                           ghost_batches_in_training, needs_view,
                                           parameter_shape, plan_view, received_variables,
                                           to_view)
from tf1_syncbn.layers.rules import (ARG_NAMES, BASE_NAME, DTYPES, channel_axes, check_axis_type,
                                     check_callable, check_rank_of_reuse,
                                     tf_layers_runs_fused_kernel, training_value, unique_layer_name)

__all__ = ['BatchNormalization', 'batch_normalization']

tf1 = tf.compat.v1


class BatchNormalization(object):
    """``tf.compat.v1.layers.BatchNormalization``, with synchronized statistics.

    The arguments, defaults and object API of tf.layers' layer (tf-keras'
    legacy ``BatchNormalization``), plus ``sync_statistics`` and ``num_dev``.
    N synchronized towers give what tf.layers gives on one device with the
    concatenated batch: outputs, gradients and every variable, the moving
    variance tracking the Bessel-corrected batch variance where tf.layers runs
    its fused kernel (rank 4 and 5, without renorm or adjustment) and the
    biased one elsewhere (see
    :func:`tf1_syncbn.layers.rules.tf_layers_runs_fused_kernel`).

    Variables (under the layer's variable scope, ``batch_normalization``,
    ``batch_normalization_1``, ... or ``name``): ``gamma``, ``beta``,
    ``moving_mean``, ``moving_variance`` (never partitioned), and with renorm
    ``moving_stddev``, ``renorm_mean``, ``renorm_stddev``. Calling the layer
    adds its moving-average updates to ``UPDATE_OPS`` (``layer.updates``);
    run them with the train op (in the same ``session.run`` as every tower's
    forward pass: see docs/timeouts.md, "Timeouts, hangs and failures"). As in
    tf.layers, a layer with ``trainable=False`` normalizes a training batch
    with its statistics but never updates the moving statistics.

    Args:
      axis: the normalized axis, or a list of axes normalized together, as in
        tf.layers: any axis but the batch axis 0 (negative values count from
        the end). One axis without ``virtual_batch_size`` has variables of
        shape ``[C]``; several axes (or a virtual batch) have variables of
        the input's shape with 1 in every other axis (see
        :mod:`tf1_syncbn._frontend.axes` for how they are computed).
      momentum: decay of the moving averages (a number or a float scalar tensor).
      epsilon: added to the variance.
      center, scale: learn ``beta`` / ``gamma``.
      beta_initializer, gamma_initializer, moving_mean_initializer, moving_variance_initializer:
        initializers (callables, or ``'zeros'`` / ``'ones'``).
      beta_regularizer, gamma_regularizer: callables on the variable; their
        losses go to ``REGULARIZATION_LOSSES`` and ``layer.losses``.
      beta_constraint, gamma_constraint: projections the optimizer applies
        after each update (``variable.constraint``).
      renorm, renorm_clipping, renorm_momentum: Batch Renormalization with
        synchronized moments; ``renorm_clipping`` has keys among ``rmax``,
        ``rmin``, ``dmax``.
      fused: None or True: the fused path where tf.layers has one; False:
        never. It decides which variance the moving variance tracks.
      trainable: whether ``gamma`` and ``beta`` are trainable (and whether the
        moving statistics are updated, as in tf.layers).
      virtual_batch_size: ghost batch norm as tf.layers does it: with
        ``training=True`` (a Python bool), example ``j`` of the global batch
        is in virtual batch ``j % (batch / virtual_batch_size)``, each
        normalized by its own statistics, and the moving statistics follow
        the means over the virtual batches of their means and biased
        variances; the variables have shape ``[1, 1, ..., C]``. Synchronized
        over ``N`` towers, every tower must have the same batch size, a
        multiple of ``virtual_batch_size / N``. With a bool-tensor
        ``training``, tf.layers normalizes the whole batch at once in TF2
        behaviour, and ghost batches in TF1 behaviour
        (``disable_v2_behavior()``), and so does this layer (see
        :func:`tf1_syncbn._frontend.keras2.ghost_batches_in_training`). Not
        with ``renorm``, ``adjustment`` or ``fused=True``.
      adjustment: a function from the input's dynamic shape to ``(scale,
        bias)``, applied to the normalized values in training.
      name: the layer's name and variable scope.
      sync_statistics: ``'auto'`` (default: synchronize over the towers the
        layer is built in, nothing with one tower), ``'collective'``,
        ``'nccl'``, ``'horovod'``, None (per-tower statistics) or a
        :class:`tf1_syncbn.SyncBackend`.
      num_dev: the number of towers, for towers built without a tower context
        (``tower_<i>`` / ``clone_<i>`` name scopes).
      group_size: sync groups, as for :func:`tf1_syncbn.sync_batch_norm`.
      **kwargs: ``dtype`` (the input is cast to it: float16, bfloat16 or
        float32), and tf.layers' private ``_scope`` and ``_reuse``.

    Raises:
      TypeError: for an ``axis``, initializer, regularizer or constraint of
        the wrong type, or an unknown keyword argument.
    """

    _api_name = 'BatchNormalization'

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True,
                 beta_initializer=tf1.zeros_initializer(),
                 gamma_initializer=tf1.ones_initializer(),
                 moving_mean_initializer=tf1.zeros_initializer(),
                 moving_variance_initializer=tf1.ones_initializer(),
                 beta_regularizer=None, gamma_regularizer=None, beta_constraint=None,
                 gamma_constraint=None, renorm=False, renorm_clipping=None,
                 renorm_momentum=0.99, fused=None, trainable=True, virtual_batch_size=None,
                 adjustment=None, name=None, sync_statistics='auto', num_dev=None,
                 group_size=None, **kwargs):
        scope = kwargs.pop('_scope', None)
        self._reuse = kwargs.pop('_reuse', None)
        dtype = kwargs.pop('dtype', None)
        if isinstance(name, tf1.VariableScope):
            self._base_name, self.name = name.name, unique_layer_name(tf1.get_default_graph())
        elif name:
            self._base_name = self.name = name
        else:
            self._base_name, self.name = BASE_NAME, unique_layer_name(tf1.get_default_graph())
        layer = '%s(%s)' % (self._api_name, self.name)
        if kwargs:
            raise TypeError('%s: unexpected keyword argument(s) %s.' % (layer, sorted(kwargs)))
        self.dtype = None if dtype is None else tf.as_dtype(dtype)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise TypeError('%s: dtype=%r is not supported; use float16, bfloat16 or float32.'
                            % (layer, dtype))
        self.axis = check_axis_type(layer, axis)
        self._axis_argument = self.axis     # (self.axis becomes tf.layers' built axes)
        self.momentum = momentum
        self.epsilon = epsilon
        self.center = center
        self.scale = scale
        checked = {}
        for key, value in (('beta_initializer', beta_initializer),
                           ('gamma_initializer', gamma_initializer),
                           ('moving_mean_initializer', moving_mean_initializer),
                           ('moving_variance_initializer', moving_variance_initializer)):
            checked[key] = check_callable(layer, key, value, initializer=True)
        for key, value in (('beta_regularizer', beta_regularizer),
                           ('gamma_regularizer', gamma_regularizer),
                           ('beta_constraint', beta_constraint),
                           ('gamma_constraint', gamma_constraint)):
            checked[key] = check_callable(layer, key, value)
        self.__dict__.update(checked)
        self.renorm = renorm
        self.renorm_clipping = renorm_clipping
        self.renorm_momentum = renorm_momentum
        self.fused = fused
        self._fused_hint = fused
        self.trainable = trainable
        self.virtual_batch_size = virtual_batch_size
        self.adjustment = adjustment
        self.sync_statistics = sync_statistics
        self.num_dev, self.group_size = num_dev, group_size
        self._scope = None
        if scope:
            with tf1.variable_scope(scope) as captured:
                self._scope = captured
        self.built = False
        self.gamma = self.beta = self.moving_mean = self.moving_variance = None
        self._trainable_weights, self._non_trainable_weights = [], []
        self._updates, self._losses = [], []
        self._params = None
        self._outer_name_scope = None

    # -- tf.layers' object API ------------------------------------------------------------

    @property
    def scope_name(self):
        """The layer's variable scope name (known once the layer is called)."""
        if self._scope is None:
            raise ValueError('No name available for layer scope because the layer "%s" has '
                             'not been used yet. Call the layer before querying scope_name.'
                             % self.name)
        return self._scope.name

    @property
    def trainable_weights(self):
        return list(self._trainable_weights) if self.trainable else []

    @property
    def non_trainable_weights(self):
        if self.trainable:
            return list(self._non_trainable_weights)
        return self._trainable_weights + self._non_trainable_weights

    @property
    def weights(self):
        return self.trainable_weights + self.non_trainable_weights

    trainable_variables = trainable_weights
    non_trainable_variables = non_trainable_weights
    variables = weights

    @property
    def updates(self):
        """The moving-average update ops of every call (none when not trainable, as tf.layers)."""
        return list(self._updates) if self.trainable else []

    @property
    def losses(self):
        """The regularization losses of ``gamma`` and ``beta``."""
        return list(self._losses)

    def apply(self, inputs, *args, **kwargs):
        """Same as calling the layer."""
        return self(inputs, *args, **kwargs)

    @tf.autograph.experimental.do_not_convert     # (see tf1_syncbn._core.call)
    def __call__(self, inputs, training=False, **kwargs):
        """Normalizes ``inputs``; the first call creates the variables.

        Args:
          inputs: a float16, bfloat16 or float32 tensor of rank 2 to 5.
          training: a Python bool or a scalar bool tensor: True normalizes with
            the (synchronized) batch statistics and updates the moving ones,
            False with the moving statistics; None is False (tf.layers' default;
            Keras' learning phase is not read). An integer or a numpy bool is
            taken as a bool, as tf.layers takes it (``training=1``).
          **kwargs: ``scope`` (the variable scope of a layer not called yet),
            ``mask`` (must be None).

        Returns:
          A tensor with the shape and dtype of ``inputs``.

        Raises:
          ValueError, TypeError: naming the layer, its scope and the argument.
        """
        scope = kwargs.pop('scope', None)
        if kwargs.pop('mask', None) is not None:
            raise TypeError('%s(%s): mask is not supported.' % (self._api_name, self.name))
        if kwargs:
            raise TypeError('%s(%s): unexpected keyword argument(s) %s.'
                            % (self._api_name, self.name, sorted(kwargs)))
        check_graph_mode('tf1_syncbn.layers.%s' % self._api_name)
        outer = tf1.get_default_graph().get_name_scope()
        self._set_scope(scope)
        if not self.built:
            self._outer_name_scope = outer
        reuse = True if self.built else self._reuse
        with tf1.variable_scope(self._scope, reuse=reuse, auxiliary_name_scope=False) as vs:
            # tf.layers builds every call's ops in the first call's name scope.
            # Called again under another name scope (another tower_<i>), the
            # ops go under this one, where the tower is read from.
            name_scope = vs.original_name_scope if outer == self._outer_name_scope else \
                vs.name.split('/')[-1]
            with tf1.name_scope(name_scope):
                return self._call(inputs, training_value(training), vs.name)

    def _set_scope(self, scope=None):
        """The variable scope of the first call, chosen as tf.layers' ``Layer._set_scope``."""
        if self._scope is not None:
            return
        if self._reuse:
            with tf1.variable_scope(scope if scope is not None else self._base_name) as captured:
                self._scope = captured
        else:
            with tf1.variable_scope(scope, default_name=self._base_name) as captured:
                self._scope = captured

    # -- translation into one call of the core --------------------------------------------

    def _call(self, inputs, training, scope_name):
        layer = '%s(%s)' % (self._api_name, scope_name)
        x = inputs
        if self.dtype is not None:
            x = tf.cast(x, self.dtype)
        if not isinstance(x, (tf.Tensor, tf.Variable)):
            try:
                x = tf.convert_to_tensor(x)
            except (TypeError, ValueError):
                pass                        # check_inputs names the problem
        rank = getattr(getattr(x, 'shape', None), 'ndims', None)
        if self.built and rank is not None:
            check_rank_of_reuse(layer, self._built_rank, rank)
        vbs = self.virtual_batch_size
        axes = channel_axes(layer, self._axis_argument, rank, vbs)
        # Axes other than one channel axis 1 or last: the core normalizes a view
        # of the input in which they are one channel axis (tf1_syncbn._frontend.axes).
        view = self._view(layer, x, axes) if axes and needs_view(rank, axes) else None
        inputs = x
        adjustment = self.adjustment
        if view is not None:
            x, adjustment = to_view(x, view), adjustment_in_view(adjustment, x, view)
        ghost = vbs if ghost_batches_in_training(training) else None
        options = check_options(
            layer, arg_names=ARG_NAMES,
            axis=view.axis if view is not None else (axes[0] if axes else None),
            is_training=training, momentum=self.momentum, epsilon=self.epsilon,
            center=self.center, scale=self.scale, fused=self._fused_hint, renorm=self.renorm,
            renorm_clipping=self.renorm_clipping, renorm_momentum=self.renorm_momentum,
            adjustment=adjustment, num_dev=self.num_dev,
            sync_statistics=self.sync_statistics, virtual_batch_size=ghost,
            virtual_batch_style='strided', group_size=self.group_size)
        if vbs is not None and ghost is None:
            check_options(layer, virtual_batch_size=vbs)   # still a positive int
        x, layout = check_inputs(options, x)
        fused = tf_layers_runs_fused_kernel(self._fused_hint, rank, axes, self.renorm, vbs,
                                            self.adjustment)
        options = options.with_replaced_path(fused, float32_decay=fused)
        dtype = x.dtype.base_dtype
        if not fused and dtype != tf.float32:
            x = tf.cast(x, tf.float32)     # tf.layers' non-fused path computes in float32
        if not self.built:
            with received_variables():
                self._build(parameter_shape(inputs.shape.as_list(), axes, vbs is not None),
                            options)
            # As tf.layers: the axes non-negative, shifted by the virtual-batch axis.
            self.fused = fused
            self.axis = [a + 1 for a in axes] if vbs is not None else list(axes)
            self._built_rank = rank
            self.built = True
        before = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        outputs = batch_norm(x, layout, options, self._params,
                             updates_collections=[tf1.GraphKeys.UPDATE_OPS],
                             update_moving=bool(self.trainable))
        after = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        self._updates.extend(op for op in after[len(before):] if op not in self._updates)
        if view is not None:
            outputs = from_view(outputs, inputs, view)
        return tf.cast(outputs, dtype) if outputs.dtype != dtype else outputs

    def _view(self, layer, x, axes):
        """The view for ``axes`` (:func:`~tf1_syncbn._frontend.axes.plan_view`); known sizes.

        With ``virtual_batch_size`` the view keeps the batch alone on its axis 0
        (whether or not this call splits it into ghost batches, so that every
        call of the layer sees the same view).
        """
        dims = x.shape.as_list()
        if any(dims[a] is None for a in axes):
            raise ValueError('%s: input has an undefined `axis` dimension: inputs %s, axis=%s; '
                             'the normalized dimensions must be known at graph build to '
                             'create the variables.' % (layer, x.shape, axes))
        return plan_view(len(dims), axes, dims, keep_batch=self.virtual_batch_size is not None)

    def _build(self, shape, options):
        """Creates the variables as tf.layers does (names, shapes, order, collections, losses)."""
        existing = {id(v) for v in tf1.global_variables()}

        def make(name, initializer, trainable, regularizer=None, constraint=None):
            variable = tf1.get_variable(
                name, shape=shape, dtype=tf.float32, initializer=initializer,
                trainable=trainable, constraint=constraint,
                aggregation=(tf.VariableAggregation.NONE if trainable
                             else STATISTICS_AGGREGATION))
            parts = [variable]
            if hasattr(variable, '_get_variable_list'):     # a PartitionedVariable
                parts = list(variable)
            (self._trainable_weights if trainable else self._non_trainable_weights).extend(parts)
            if regularizer is not None and not any(id(p) in existing for p in parts):
                # As Keras' add_weight: one loss per new variable (or partition),
                # built now under <layer scope>/<name>/Regularizer.
                for part in parts:
                    with tf1.name_scope(name + '/Regularizer'):
                        loss = regularizer(part)
                    if loss is not None:
                        self._losses.append(loss)
                        tf1.add_to_collection(tf1.GraphKeys.REGULARIZATION_LOSSES, loss)
            return variable

        trainable = bool(self.trainable)
        if options.scale:
            self.gamma = make('gamma', self.gamma_initializer, trainable, self.gamma_regularizer,
                              self.gamma_constraint)
        if options.center:
            self.beta = make('beta', self.beta_initializer, trainable, self.beta_regularizer,
                             self.beta_constraint)
        with tf1.variable_scope(tf1.get_variable_scope()) as unpartitioned:
            unpartitioned.set_partitioner(None)     # statistics are never partitioned
            self.moving_mean = make('moving_mean', self.moving_mean_initializer, False)
            self.moving_variance = make('moving_variance', self.moving_variance_initializer,
                                        False)
            renorm = None
            if options.renorm:
                renorm = RenormVariables.create(lambda n, init: make(n, init, False),
                                                self.moving_mean_initializer,
                                                self.moving_variance_initializer)
                self.moving_stddev, self.renorm_mean, self.renorm_stddev = \
                    renorm.moving_stddev, renorm.mean, renorm.stddev
        self._params = Params(self.beta, self.gamma, self.moving_mean, self.moving_variance,
                              renorm)


class _Function(BatchNormalization):
    """The layer :func:`batch_normalization` builds (its errors name the function)."""

    _api_name = 'batch_normalization'


@tf.autograph.experimental.do_not_convert     # (see tf1_syncbn._core.call)
def batch_normalization(inputs, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True,
                        beta_initializer=tf1.zeros_initializer(),
                        gamma_initializer=tf1.ones_initializer(),
                        moving_mean_initializer=tf1.zeros_initializer(),
                        moving_variance_initializer=tf1.ones_initializer(),
                        beta_regularizer=None, gamma_regularizer=None, beta_constraint=None,
                        gamma_constraint=None, training=False, trainable=True, name=None,
                        reuse=None, renorm=False, renorm_clipping=None, renorm_momentum=0.99,
                        fused=None, virtual_batch_size=None, adjustment=None,
                        sync_statistics='auto', num_dev=None, group_size=None):
    """``tf.compat.v1.layers.batch_normalization``, with synchronized statistics.

    Builds a :class:`BatchNormalization` and calls it, as tf.layers does: with
    ``name``, the variables live in exactly that variable scope (another call
    with the same ``name`` needs ``reuse=True``, or a reusing enclosing
    scope); without, in ``batch_normalization``, ``batch_normalization_1``,
    ... Use it wherever tf.layers' function is used::

        y = tf1_syncbn.layers.batch_normalization(x, training=is_training, momentum=0.9)
        update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
        with tf.control_dependencies(update_ops):
            train_op = optimizer.minimize(loss)

    Args:
      inputs: a float16, bfloat16 or float32 tensor of rank 2 to 5.
      training: a Python bool or a scalar bool tensor (default False, as in
        tf.layers: pass True, or a tensor, to train).
      name: the variable scope; reuse: reuse its variables.
      The others: as for :class:`BatchNormalization`.

    Returns:
      A tensor with the shape and dtype of ``inputs``.
    """
    layer = _Function(
        axis=axis, momentum=momentum, epsilon=epsilon, center=center, scale=scale,
        beta_initializer=beta_initializer, gamma_initializer=gamma_initializer,
        moving_mean_initializer=moving_mean_initializer,
        moving_variance_initializer=moving_variance_initializer,
        beta_regularizer=beta_regularizer, gamma_regularizer=gamma_regularizer,
        beta_constraint=beta_constraint, gamma_constraint=gamma_constraint, renorm=renorm,
        renorm_clipping=renorm_clipping, renorm_momentum=renorm_momentum, fused=fused,
        trainable=trainable, virtual_batch_size=virtual_batch_size, adjustment=adjustment,
        name=name, sync_statistics=sync_statistics, num_dev=num_dev, _reuse=reuse,
        _scope=name, group_size=group_size)
    return layer(inputs, training=training)


# Their public path, as users import them (the patch's subclass and its messages name it).
BatchNormalization.__module__ = batch_normalization.__module__ = 'tf1_syncbn.layers'

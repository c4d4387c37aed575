"""The classes of :mod:`tf1_syncbn.keras`: :class:`BatchNormalization`, its V1 twin.

Subclasses of tf-keras' own classes (:data:`KERAS_PACKAGE`) that compute
through the shared core. Importing this module imports tf-keras.
"""

import contextlib
import importlib
import warnings

import tensorflow as tf
from tensorflow.python.ops import control_flow_util_v2

from tf1_syncbn._frontend.building import (Params, RenormVariables, adjustment_in_view,
                                           batch_norm, check_inputs, check_options, from_view,
                                           ghost_batches_in_training, keras2_package, needs_view,
                                           plan_view, to_view)
from tf1_syncbn.keras.rules import (ARG_NAMES, check_keras_graph, in_keras_model_build,
                                    is_model_graph_call, keras_channel_axes,
                                    statistics_aggregation, sync_config, training_value,
                                    v1_axis_and_fused)

#: The Keras 2 package whose layers this module subclasses: ``tf_keras``, or
#: ``keras`` where ``tf.keras`` is Keras 2.15 (TensorFlow 2.15 without
#: ``TF_USE_LEGACY_KERAS``); see :mod:`tf1_syncbn._frontend.keras2`.
KERAS_PACKAGE = keras2_package()
try:
    importlib.import_module(KERAS_PACKAGE)
    _keras_layer_utils = importlib.import_module(KERAS_PACKAGE + '.src.engine.base_layer_utils')
    _keras_bn = importlib.import_module(KERAS_PACKAGE +
                                        '.src.layers.normalization.batch_normalization')
    _keras_bn_v1 = importlib.import_module(KERAS_PACKAGE +
                                           '.src.layers.normalization.batch_normalization_v1')
except ImportError as _error:  # the message says how to install it
    _version = '.'.join(tf.__version__.split('.')[:2])
    raise ImportError(
        'tf1_syncbn.keras needs Keras 2: tf-keras (the package `tf_keras`), or on TensorFlow '
        '2.15 the `keras` 2.15 it comes with; %s could not be imported (%s). Install the '
        'tf-keras release that matches TensorFlow %s, without its dependencies (they ask for '
        'the full `tensorflow` package): pip install --no-deps "tf-keras~=%s.0"'
        % (KERAS_PACKAGE, _error, tf.__version__, _version)) from _error


__all__ = ['BatchNormalization', 'BatchNormalizationV1', 'KERAS_PACKAGE',
           'KERAS_BATCH_NORMALIZATION', 'KERAS_BATCH_NORMALIZATION_V1']

tf1 = tf.compat.v1

#: tf-keras' classes, as this module found them (before any patch).
KERAS_BATCH_NORMALIZATION = _keras_bn.BatchNormalization
KERAS_BATCH_NORMALIZATION_V1 = _keras_bn_v1.BatchNormalization
#: Where a call's moving-average updates go, on their way to ``layer.add_update``.
_UPDATES_COLLECTION = 'tf1_syncbn_keras_updates'


@contextlib.contextmanager
def _lazy_cond_outputs():
    """``tf.cond`` (v2) outputs its branches' intermediates only when a gradient needs them.

    Inside a Keras layer's call, TensorFlow's ``cond_v2`` exports every
    intermediate of both branches as an optional output (for Keras' own
    session training), and the gradient of the ``If`` op then differentiates
    through all of them, the synchronized statistics' all-reduces included,
    which have no gradient of their own. Outside Keras (the other front-ends)
    it adds the outputs a gradient needs when the gradient is built: so here.
    """
    previous = control_flow_util_v2._EXPERIMENTAL_OUTPUT_ALL_INTERMEDIATES_OVERRIDE  # noqa: SLF001
    control_flow_util_v2._EXPERIMENTAL_OUTPUT_ALL_INTERMEDIATES_OVERRIDE = False  # noqa: SLF001
    try:
        yield
    finally:
        control_flow_util_v2._EXPERIMENTAL_OUTPUT_ALL_INTERMEDIATES_OVERRIDE = previous  # noqa: SLF001


class _Synchronized(object):
    """What both layers add to tf-keras' class: the arguments and the call through the core."""

    def _init_sync(self, sync_statistics, num_dev, axis, fused, group_size=None):
        self.sync_statistics = sync_statistics
        self.num_dev = num_dev
        self.group_size = group_size
        self._axis_argument = axis
        self._fused_argument = fused

    def _layer_label(self):
        return '%s(%s)' % (type(self).__name__, self.name)

    def add_weight(self, *args, **kwargs):
        """tf-keras' ``add_weight``; with sync groups, the moving statistics read replica 0's copy.

        Under a ``tf.distribute`` strategy, a layer with ``group_size`` (and
        ``sync_statistics`` not None) creates its moving statistics with
        ``ONLY_FIRST_REPLICA`` aggregation instead of tf-keras' ``MEAN``, so
        that reading them, a ``Saver`` and ``save_weights`` give global tower
        0's group's statistics, not the mean of the groups'
        (:func:`~tf1_syncbn.keras.rules.statistics_aggregation`).
        """
        if 'aggregation' in kwargs:
            kwargs['aggregation'] = statistics_aggregation(
                kwargs['aggregation'], kwargs.get('synchronization'),
                getattr(self, 'group_size', None), getattr(self, 'sync_statistics', 'auto'))
        return super().add_weight(*args, **kwargs)

    @tf.autograph.experimental.do_not_convert
    def call(self, inputs, training=None, mask=None):
        """Normalizes ``inputs`` with tf-keras' rules and the core's synchronized statistics.

        Args:
          inputs: a float16, bfloat16 or float32 tensor of rank 2 to 5.
          training: as in tf-keras: a Python bool, a bool tensor, or None for
            ``K.learning_phase()``; ``BatchNormalization`` with
            ``trainable=False`` always runs in inference mode (tf-keras' v2
            rule; not ``BatchNormalizationV1``).
          mask: None, or on the non-fused path a ``[batch]`` weight per example
            of a rank-2 input (tf-keras' fused path ignores it, with a warning).

        Returns:
          A tensor with the shape and dtype of ``inputs`` (the compute dtype).

        Raises:
          RuntimeError: eagerly or in a ``tf.function``.
          ValueError, TypeError: naming the layer and the argument.
        """
        layer = self._layer_label()
        check_keras_graph(layer)
        training = training_value(self._get_training_value(training))
        x = tf.cast(inputs, self.compute_dtype)
        rank = x.shape.ndims
        vbs = self.virtual_batch_size
        axes = keras_channel_axes(layer, self.axis, self._axis_argument, vbs)
        weights = self._mask_weights(layer, mask, rank)
        one_device = is_model_graph_call(self._called_on(inputs)) or in_keras_model_build()
        # Axes other than one channel axis 1 or last: the core normalizes a view
        # of the input in which they are one channel axis (tf1_syncbn._frontend.axes).
        view, source, adjustment = None, x, self.adjustment
        if needs_view(rank, axes):
            view = plan_view(rank, axes, x.shape.as_list(), keep_batch=vbs is not None)
            x, adjustment = to_view(x, view), adjustment_in_view(adjustment, x, view)
        renorm = bool(self.renorm)
        options = check_options(
            layer, arg_names=ARG_NAMES,
            axis=view.axis if view is not None else axes[0], is_training=training,
            momentum=self.momentum, epsilon=self.epsilon, center=self.center, scale=self.scale,
            fused=False if self._fused_argument is False or weights is not None else None,
            renorm=renorm, renorm_clipping=getattr(self, 'renorm_clipping', None) if renorm
            else None, renorm_momentum=getattr(self, 'renorm_momentum', 0.99),
            adjustment=adjustment, num_dev=None if one_device else self.num_dev,
            sync_statistics=None if one_device else self.sync_statistics,
            virtual_batch_size=vbs if ghost_batches_in_training(training) else None,
            virtual_batch_style='strided', group_size=None if one_device else self.group_size)
        x, layout = check_inputs(options, x)
        # tf-keras' fused path tracks the fused kernel's Bessel-corrected variance
        # and computes 1 - momentum in float32; its non-fused one, the biased
        # variance and 1 - momentum in double (see BatchNormalizationBase).
        options = options.with_replaced_path(self.fused, float32_decay=self.fused)
        dtype = x.dtype.base_dtype
        if not self.fused and dtype != tf.float32:
            x = tf.cast(x, tf.float32)     # tf-keras' non-fused path computes in float32
        graph = tf1.get_default_graph()
        pending = graph.get_collection_ref(_UPDATES_COLLECTION)
        del pending[:]
        # The variable scope names the call for the towers (every tower calls the
        # same layer object); it creates nothing. The model's own graph gets a
        # name of its own, so that the towers' calls keep their numbers.
        scope = self.name + ('/keras_model_graph' if one_device else '')
        with tf1.variable_scope(scope, auxiliary_name_scope=False), _lazy_cond_outputs():
            # A non-main tower's trigger waits for this tower's output, so that
            # tf-keras files it under get_updates_for(this tower's input).
            outputs = batch_norm(x, layout, options, self._sync_params(),
                                 batch_weights=weights, updates_collections=[_UPDATES_COLLECTION],
                                 trigger_after_output=True)
        updates, pending[:] = list(pending), []
        if updates:
            self.add_update(updates)
        if view is not None:
            outputs = from_view(outputs, source, view)
        return tf.cast(outputs, dtype) if outputs.dtype != dtype else outputs

    def _called_on(self, inputs):
        """What ``__call__`` received: Keras casts it to the compute dtype (mixed
        precision) into a tensor without Keras' history."""
        context = _keras_layer_utils.call_context()
        if context.layer is self and context.inputs is not None:
            return context.inputs
        return inputs

    def _mask_weights(self, layer, mask, rank):
        """tf-keras' ``mask`` as the core's per-example weights (or None)."""
        if mask is None:
            return None
        if self.fused:
            warnings.warn('Masking is not supported with `fused=True`. You should either turn '
                          'off fusing (`fused=False`) or you should not pass a `mask` argument '
                          'when calling the layer. For the moment `mask` will be ignored for '
                          'the normalization.')
            return None
        mask = tf.convert_to_tensor(mask)
        if rank != 2 or mask.shape.ndims != 1:
            raise ValueError(
                '%s: a mask of shape %s on an input of rank %d is not supported: the '
                'synchronized layer weights whole examples (a [batch] mask on a rank-2 input). '
                'Pass mask=None, or normalize a [batch * steps, channels] reshape with a '
                '[batch * steps] mask.' % (self._layer_label(), mask.shape, rank))
        return tf.cast(mask, tf.float32)

    def _sync_params(self):
        """The weights tf-keras' ``build`` created, as the core reads them."""
        renorm = None
        if self.renorm:
            renorm = RenormVariables(self.renorm_mean, self.renorm_stddev, self.moving_stddev)
        return Params(self.beta, self.gamma, self.moving_mean, self.moving_variance, renorm)

    def get_config(self):
        """tf-keras' config, plus :func:`~tf1_syncbn.keras.rules.sync_config`'s arguments."""
        return sync_config(super().get_config(), self._layer_label(), self.sync_statistics,
                           self.num_dev, self.group_size)


class BatchNormalization(_Synchronized, KERAS_BATCH_NORMALIZATION):
    """``tf_keras.layers.BatchNormalization``, synchronized over the towers it is called in.

    The arguments, defaults, weights (``gamma``, ``beta``, ``moving_mean``,
    ``moving_variance``; with renorm ``moving_stddev``, ``renorm_mean``,
    ``renorm_stddev``; under the layer's name, e.g. ``conv1_bn/gamma:0``), config
    and training semantics of tf-keras' layer, so that tf-keras checkpoints and
    weights load unchanged and back. In a TF1 graph (``tf.Graph().as_default()``,
    ``disable_eager_execution()`` or ``disable_v2_behavior()``):

    * **synchronized**: N towers (``tower_<i>`` name scopes with ``num_dev``,
      ``tower.TowerContext``, tensorpack's trainers, ``tf.distribute``
      replicas) normalize a training batch with the statistics of the global
      batch and give what tf-keras' layer gives on one device with the
      concatenated batch: outputs, gradients and every weight. The moving
      variance tracks what tf-keras' tracks: the fused kernel's
      Bessel-corrected batch variance on its fused path (rank 4 or 5, axis 1
      or last, no renorm, ``virtual_batch_size`` or ``adjustment``), the
      biased one elsewhere;
    * **training**: ``training=None`` reads ``K.learning_phase()``; a layer
      with ``trainable=False`` runs in inference mode (tf-keras' rule for
      frozen layers in fine-tuning) and updates nothing;
    * **updates**: as in tf-keras, in ``layer.updates`` / ``model.updates``
      (``model.get_updates_for(inputs)``), not in ``UPDATE_OPS``. The main
      tower holds the update ops; every other training tower holds a trigger
      of them, so running any tower's updates (or all of them) updates the
      moving statistics once per step. Run them in the step that runs every
      tower's forward pass;
    * **the model's own graph**: the call that a functional model makes on its
      ``keras.Input(shape=...)`` placeholders when it is constructed (the
      towers then call the model on their batches) normalizes that batch on
      one device, wherever the model is built; a model built on a tower's
      tensor (``keras.Input(tensor=x)``) is that tower's;
    * **axes**: every form tf-keras takes (a middle axis, several axes, with
      ``virtual_batch_size``) but the batch axis 0, through a view of the
      input (:mod:`tf1_syncbn._frontend.axes`).

    The arguments from ``axis`` to ``gamma_constraint`` are tf-keras' own, with
    its defaults.

    Args:
      synchronized: tf-keras' argument: ``True`` only turns tf-keras' fused
        path off, as in tf-keras; the statistics are synchronized by
        ``sync_statistics``.
      sync_statistics: ``'auto'`` (default: synchronize over the towers the
        layer is called in, nothing with one tower), ``'collective'``,
        ``'nccl'``, ``'horovod'``, None (per-tower statistics, tf-keras'
        behaviour) or a :class:`tf1_syncbn.SyncBackend`.
      num_dev: the number of towers, for towers built as ``tower_<i>`` /
        ``clone_<i>`` name scopes without a tower context.
      group_size: sync groups, as for :func:`tf1_syncbn.sync_batch_norm`. Under
        a ``tf.distribute`` strategy the moving statistics then follow
        replica 0's group: they are tf-keras' on-read variables with
        ``ONLY_FIRST_REPLICA`` instead of ``MEAN`` aggregation (a read, a
        ``Saver``, ``save_weights`` and ``get_weights`` take replica 0's copy,
        a restore sets every copy; until then each replica's copy holds its
        own group's statistics).
      **kwargs: tf-keras' others: ``renorm``, ``renorm_clipping``,
        ``renorm_momentum``, ``fused``, ``trainable``, ``virtual_batch_size``,
        ``adjustment``, ``name``, ``dtype`` (a mixed-precision policy
        included), ...

    Hangs: a synchronized training call waits in its all-reduces for every
    tower of its group, and the updates wait for the towers' statistics: run
    every tower's forward pass in one ``session.run`` (docs/timeouts.md); the
    collective backend's timeout turns a missing tower into an error.
    """

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True,
                 beta_initializer='zeros', gamma_initializer='ones',
                 moving_mean_initializer='zeros', moving_variance_initializer='ones',
                 beta_regularizer=None, gamma_regularizer=None, beta_constraint=None,
                 gamma_constraint=None, synchronized=False, *, sync_statistics='auto',
                 num_dev=None, group_size=None, **kwargs):
        super().__init__(
            axis=axis, momentum=momentum, epsilon=epsilon, center=center, scale=scale,
            beta_initializer=beta_initializer, gamma_initializer=gamma_initializer,
            moving_mean_initializer=moving_mean_initializer,
            moving_variance_initializer=moving_variance_initializer,
            beta_regularizer=beta_regularizer, gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint, gamma_constraint=gamma_constraint,
            synchronized=synchronized, **kwargs)
        self._init_sync(sync_statistics, num_dev, axis, kwargs.get('fused'), group_size)


class BatchNormalizationV1(_Synchronized, KERAS_BATCH_NORMALIZATION_V1):
    """tf-keras' v1 ``BatchNormalization``, synchronized (see :class:`BatchNormalization`).

    What ``tf.compat.v1.keras.layers.BatchNormalization`` is, and what
    ``tf_keras.applications`` models build under ``disable_v2_behavior()``.
    Its differences from :class:`BatchNormalization` are tf-keras': no
    ``synchronized`` argument, ``fused=None`` means True, and
    ``trainable=False`` does not switch to inference mode (a frozen layer
    still normalizes a training batch with its statistics; its updates are
    left out of ``layer.updates``).

    Args:
      *args, **kwargs: tf-keras' ``BatchNormalizationBase`` arguments.
      sync_statistics, num_dev, group_size: as for :class:`BatchNormalization`.
    """

    def __init__(self, *args, sync_statistics='auto', num_dev=None, group_size=None, **kwargs):
        super().__init__(*args, **kwargs)
        axis, fused = v1_axis_and_fused(args, kwargs)
        self._init_sync(sync_statistics, num_dev, axis, fused, group_size)


# tf-keras' v1 class is named BatchNormalization too: Keras derives the default
# layer name (batch_normalization, so the weights' names) and the class name of
# configs from it.
BatchNormalizationV1.__name__ = BatchNormalizationV1.__qualname__ = 'BatchNormalization'
# Their public path, as users import them: Keras records a class's module in the
# configs it saves (and imports it to load one).
BatchNormalization.__module__ = BatchNormalizationV1.__module__ = 'tf1_syncbn.keras'

"""The matrix's rows: each front-end as users call it, and the layer it replaces.

A :class:`FrontEnd` builds one cell's layer on one tower's input, on both
sides of the comparison:

* :meth:`FrontEnd.build`: the library's layer, called as a user of the
  front-end calls it (the direct call, or the replaced library's own call
  under the front-end's patch), with what the harness says users add
  (``num_dev``) and what the option asks (``group_size``, ...);
* :meth:`FrontEnd.build_replaced`: the replaced layer (tf-slim 1.1,
  tensorpack 0.11, tf-keras' legacy tf.layers, tf-keras, ``tf.nn``), run by
  the oracle on one device in a legacy-Keras subprocess.

Both take the same arguments from :meth:`FrontEnd.kwargs`, so a cell
differs from its reference only in the synchronization. The patches are
rows of their own: each is a public entry point with a signature of its
own, and a user reaches the layer through it differently (the replaced
library's name, resolved under the patch).

Imports neither ``tf1_syncbn`` nor ``tower`` at module level (the oracle's
subprocess reads it): :meth:`build` imports the library when it runs.

To add a front-end: a subclass here (its family's base gives most of it),
an instance in :data:`FRONT_ENDS`; its public signature in
``matrix.SIGNATURES`` with the arguments tested elsewhere.
"""

import contextlib
import importlib

import tensorflow as tf

from conformance import options as opts

tf1 = tf.compat.v1


class FrontEnd(object):
    """One row of the matrix.

    Attributes:
      name: the row's id (test ids, the page).
      short: its column label in the page's tables.
      family: ``slim``, ``tensorpack``, ``layers``, ``keras`` or ``moments``.
      reached: ``'direct'`` (the library's own name) or ``'patched'`` (the
        replaced library's name under the patch).
      call: how a user writes it, for the page.
      replaced: the oracle, for the page.
      parameters: the arguments every cell of the row passes (its baseline).
      not_sync_relevant: ``{parameter: (test module, why)}``: arguments of
        the row's signature that do not change how towers synchronize,
        tested by that module.
      outputs: what a tower's call returns, by name.
      uses_weights: the layer takes per-example frequency weights.
    """

    name = None
    short = None
    family = None
    reached = 'direct'
    call = None
    replaced = None
    parameters = ()
    not_sync_relevant = {}
    outputs = ('y',)
    uses_weights = False

    def not_applicable(self, option):
        """Why ``option`` has no meaning for this front-end, or None."""
        del option
        return None

    def kwargs(self, option, training):
        """The layer's arguments for ``option`` that the replaced layer takes too."""
        raise NotImplementedError

    def sync_kwargs(self, option, num_dev):
        """The library's own arguments: synchronization, groups, ``num_dev``.

        In worker processes (:func:`synchronizing_with`), a synchronizing cell
        passes the cluster's backend, as users do (``cluster.backend()``).
        """
        kwargs = {}
        if option.sync is None:
            kwargs['sync_statistics'] = None
        elif _BACKEND:
            kwargs['sync_statistics'] = _BACKEND[-1]
        if option.group_size is not None:
            kwargs['group_size'] = _as_lists(option.group_size)
        if num_dev is not None:
            kwargs['num_dev'] = num_dev
        return kwargs

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        """The library's layer on ``x``: ``{output name: tensor}``."""
        raise NotImplementedError

    def build_replaced(self, x, training, option, weights=None):
        """The replaced layer on ``x``, in the oracle's subprocess: ``{output name: tensor}``."""
        raise NotImplementedError

    def replaced_context(self):
        """A context the oracle builds the replaced layer in (outside any variable scope)."""
        return contextlib.nullcontext()

    def reference_rows(self, option, members):
        """The rows of the global batch, in the order the replaced layer sees a group's batch.

        The group's towers' rows concatenated, in the order of ``members``
        (what matters for ghost batches only).
        """
        import numpy as np  # noqa: PLC0415 - a small module; numpy is there anyway
        rows = opts.tower_rows(option.sizes)
        return np.concatenate([rows[t] for t in members]).astype(int)

    def forget(self):
        """Drops what the row kept of a graph (its layer objects)."""
        objects = getattr(self, 'objects', None)
        if objects is not None:
            objects.clear()

    def patch(self, option, num_dev):
        """The patch a call of this row is built under (a context manager), or None.

        ``build`` enters it around each call unless ``patched`` says the caller
        holds it (around a whole build, as scripts do, where towers are built in
        threads): :meth:`patch_key` tells which cells can share one.
        """
        del option, num_dev
        return None

    def patch_key(self, option, num_dev):
        """``(family, what)``: which of its family's patches a call needs, or None.

        A patch switches its family's layer for the whole process (and may lend
        its arguments to the family's direct calls): where towers are built in
        threads, one graph holds one of a family's keys, ``'direct'`` for the
        direct rows.
        """
        del option, num_dev
        return (self.family, 'direct') if self.family in PATCHED_FAMILIES else None


#: The backend synchronizing cells pass (a stack: :func:`synchronizing_with`).
_BACKEND = []


@contextlib.contextmanager
def synchronizing_with(backend):
    """Within it, a synchronizing cell passes ``sync_statistics=backend`` (worker processes)."""
    _BACKEND.append(backend)
    try:
        yield
    finally:
        _BACKEND.pop()


def recording(created):
    """A variable creator scope that appends every variable created in it to ``created``."""
    def creator(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        created.append(variable)
        return variable
    return tf1.variable_creator_scope(creator)


def _as_lists(group_size):
    if isinstance(group_size, tuple):
        return [list(group) for group in group_size]
    return group_size


# ---------------------------------------------------------------------------
# tf-slim


class _Slim(FrontEnd):
    family = 'slim'
    replaced = 'tf-slim 1.1 `slim.batch_norm`'
    parameters = ('inputs', 'decay', 'epsilon', 'scale', 'is_training', 'num_dev')
    not_sync_relevant = {
        'center': ('tests/slim/test_slim_parity.py', 'no beta: fewer variables'),
        'activation_fn': ('tests/slim/test_slim_parity.py', 'applied to the output'),
        'param_initializers': ('tests/slim/test_slim_options.py', 'initial values'),
        'param_regularizers': ('tests/slim/test_slim_options.py', 'losses on the variables'),
        'updates_collections': ('tests/core/test_updates.py',
                                'where the updates go (None: in place)'),
        'reuse': ('tests/slim/test_slim_parity.py', 'variable sharing'),
        'variables_collections': ('tests/slim/test_slim_options.py', 'collections'),
        'outputs_collections': ('tests/slim/test_slim_options.py', 'collections'),
        'trainable': ('tests/slim/test_slim_options.py', 'collections'),
        'batch_weights': ('tests/slim/test_slim_parity.py',
                          'weighted statistics, synchronized as the others'),
        'zero_debias_moving_mean': ('tests/core/test_updates.py', 'the update rule'),
        'scope': ('tests/slim/test_slim_parity.py', 'variable names'),
        'adjustment': ('tests/slim/test_slim_renorm_claims.py', 'a function of the batch'),
        'finetune': ('tests/core/test_updates.py', 'population statistics'),
    }

    def not_applicable(self, option):
        if option.feature == 'ghost':
            return 'slim.batch_norm has no ghost batches (virtual_batch_size)'
        return None

    def kwargs(self, option, training):
        kwargs = {'decay': opts.MOMENTUM, 'epsilon': opts.EPSILON, 'scale': True,
                  'is_training': training}
        if option.layout == 'NCHW':
            kwargs['data_format'] = 'NCHW'
        if option.feature == 'unfused':
            kwargs['fused'] = False
        if option.feature == 'renorm':
            kwargs.update(renorm=True, renorm_clipping=dict(opts.RENORM_CLIPPING),
                          renorm_decay=opts.RENORM_MOMENTUM)
        return kwargs

    def build_replaced(self, x, training, option, weights=None):
        import tf_slim as slim  # noqa: PLC0415 - the oracle's subprocess
        return {'y': slim.batch_norm(x, **self.kwargs(option, training))}


class SyncBatchNorm(_Slim):
    name = 'sync_batch_norm'
    short = 'slim'
    call = '`sync_batch_norm(x, ...)`'

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        from tf1_syncbn import sync_batch_norm  # noqa: PLC0415
        return {'y': sync_batch_norm(x, **self.kwargs(option, training),
                                     **self.sync_kwargs(option, num_dev))}


class SyncArgScope(_Slim):
    name = 'sync_arg_scope'
    short = 'arg scope'
    reached = 'patched'
    call = '`slim.batch_norm(x, ...)` in `sync_arg_scope(...)`'
    not_sync_relevant = dict(_Slim.not_sync_relevant, **{
        'scope': ('tests/slim/test_slim_nets.py', 'which arg scopes it converts'),
        'add_normalizer_to': ('tests/slim/test_slim_nets.py', 'which layers get the normalizer'),
        'patch': ('tests/slim/test_slim_nets.py', 'direct slim.batch_norm calls'),
        'modules': ('tests/slim/test_slim_nets.py', "which modules' names it switches"),
    })

    def patch(self, option, num_dev):
        from tf1_syncbn import sync_arg_scope  # noqa: PLC0415
        return sync_arg_scope(**self.sync_kwargs(option, num_dev))

    def patch_key(self, option, num_dev):
        return (self.family, repr(sorted(self.sync_kwargs(option, num_dev).items())))

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        import tf_slim as slim  # noqa: PLC0415
        with contextlib.nullcontext() if patched else self.patch(option, num_dev):
            return {'y': slim.batch_norm(x, **self.kwargs(option, training))}


# ---------------------------------------------------------------------------
# tensorpack


class _Tensorpack(FrontEnd):
    family = 'tensorpack'
    replaced = 'tensorpack 0.11 `BatchNorm`'
    parameters = ('name', 'inputs', 'training', 'momentum', 'epsilon', 'sync_statistics',
                  'num_dev')
    not_sync_relevant = {
        'axis': ('tests/tensorpack/test_tensorpack_parity.py', 'another spelling of the layout'),
        'center': ('tests/tensorpack/test_tensorpack_parity.py', 'no beta'),
        'scale': ('tests/tensorpack/test_tensorpack_parity.py', 'no gamma'),
        'beta_initializer': ('tests/tensorpack/test_tensorpack_layer.py', 'initial values'),
        'gamma_initializer': ('tests/tensorpack/test_tensorpack_layer.py', 'initial values'),
        'ema_update': ('tests/tensorpack/test_tensorpack_parity.py',
                       'where the update runs (collection, internal, skip)'),
        'finetune': ('tests/core/test_updates.py', 'population statistics'),
        'legacy_kwargs': ('tests/tensorpack/test_tensorpack_parity.py',
                          "tensorpack's old names (decay, use_bias, ...)"),
    }

    def not_applicable(self, option):
        if option.training_tensor:
            return "tensorpack's layers take a Python bool (`bool(training)`)"
        if option.feature == 'unfused':
            return "tensorpack's layers have no fused argument"
        return None

    def kwargs(self, option, training):
        kwargs = {'momentum': opts.MOMENTUM, 'epsilon': opts.EPSILON, 'training': training}
        if option.layout == 'NCHW':
            kwargs['data_format'] = 'channels_first'
        if option.feature == 'ghost':
            kwargs['virtual_batch_size'] = opts.VIRTUAL_BATCH_SIZE
        return kwargs

    def sync_kwargs(self, option, num_dev):
        kwargs = super(_Tensorpack, self).sync_kwargs(option, num_dev)
        if option.sync is None:
            del kwargs['sync_statistics']          # tensorpack's default: per tower
        elif not _BACKEND:
            kwargs['sync_statistics'] = 'auto'     # as docs/tensorpack.md says to pass
        return kwargs

    def reference_rows(self, option, members):
        """Ghost batches: virtual batch ``k`` is every member's ``k``-th run of examples."""
        if option.feature != 'ghost' or len(members) == 1:
            return super(_Tensorpack, self).reference_rows(option, members)
        import numpy as np  # noqa: PLC0415
        rows = opts.tower_rows(option.sizes)
        per = opts.VIRTUAL_BATCH_SIZE // len(members)
        runs = len(rows[members[0]]) // per
        return np.concatenate([rows[t][k * per:(k + 1) * per]
                               for k in range(runs) for t in members]).astype(int)

    def replaced_context(self):
        """tensorpack's own layers read their mode from its tower context."""
        from tensorpack.tfutils.tower import TowerContext  # noqa: PLC0415
        return TowerContext('', is_training=True)

    def build_replaced(self, x, training, option, weights=None):
        from tensorpack.models import BatchNorm  # noqa: PLC0415
        return {'y': BatchNorm('bn', x, **self.kwargs(option, training))}


class TensorpackBatchNorm(_Tensorpack):
    name = 'BatchNorm'
    short = 'tp BN'
    call = "`tf1_syncbn.BatchNorm('bn', x, sync_statistics='auto', ...)`"

    def not_applicable(self, option):
        if option.feature == 'renorm':
            return "tensorpack's BatchNorm has no renorm (the BatchRenorm row)"
        return super(TensorpackBatchNorm, self).not_applicable(option)

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        from tf1_syncbn import BatchNorm  # noqa: PLC0415
        return {'y': BatchNorm('bn', x, **self.kwargs(option, training),
                               **self.sync_kwargs(option, num_dev))}


class TensorpackBatchRenorm(_Tensorpack):
    name = 'BatchRenorm'
    short = 'tp BRN'
    call = "`tf1_syncbn.BatchRenorm('bn', x, rmax, dmax, sync_statistics='auto', ...)`"
    replaced = 'tensorpack 0.11 `BatchRenorm`'
    parameters = _Tensorpack.parameters + ('x', 'rmax', 'dmax', 'gamma_initializer')
    not_sync_relevant = {k: v for k, v in _Tensorpack.not_sync_relevant.items()
                         if k in ('center', 'scale', 'legacy_kwargs')}

    def not_applicable(self, option):
        if option.feature == 'renorm':
            return 'BatchRenorm renormalizes in every cell'
        if option.feature == 'ghost':
            return "tensorpack's BatchRenorm has no ghost batches"
        return super(TensorpackBatchRenorm, self).not_applicable(option)

    def kwargs(self, option, training):
        kwargs = super(TensorpackBatchRenorm, self).kwargs(option, training)
        # tensorpack's BatchRenorm reads its mode from the tower context only;
        # gamma_initializer=None would be tf.layers' glorot_uniform (random).
        del kwargs['training']
        kwargs['gamma_initializer'] = tf1.ones_initializer()
        return kwargs

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        from tf1_syncbn import BatchRenorm  # noqa: PLC0415
        return {'y': BatchRenorm('bn', x, rmax=opts.BATCH_RENORM_RMAX,
                                 dmax=opts.BATCH_RENORM_DMAX, training=training,
                                 **self.kwargs(option, training),
                                 **self.sync_kwargs(option, num_dev))}

    def build_replaced(self, x, training, option, weights=None):
        """tensorpack's BatchRenorm; on rank 2, on the ``[N, 1, 1, C]`` view of the input.

        (tensorpack 0.11's BatchRenorm squeezes axes 1 and 2 of its output,
        which a rank-2 input does not have; the view is the same batch.)
        """
        from tensorpack.models import BatchRenorm  # noqa: PLC0415
        view = tf.reshape(x, [-1, 1, 1, x.shape[-1]]) if option.layout == 'rank2' else x
        y = BatchRenorm('bn', view, rmax=opts.BATCH_RENORM_RMAX, dmax=opts.BATCH_RENORM_DMAX,
                        **self.kwargs(option, training))
        return {'y': tf.reshape(y, tf.shape(x)) if option.layout == 'rank2' else y}


class PatchTensorpack(_Tensorpack):
    name = 'patch_tensorpack'
    short = 'patch tp'
    reached = 'patched'
    call = "`tensorpack.models.BatchNorm('bn', x, ...)` after " \
        "`patch_tensorpack(sync_statistics='auto', ...)`"
    parameters = _Tensorpack.parameters + ('defaults',)

    def not_applicable(self, option):
        if option.feature == 'renorm':
            return "tensorpack's BatchNorm has no renorm (the BatchRenorm row)"
        return super(PatchTensorpack, self).not_applicable(option)

    def patch(self, option, num_dev):
        from tf1_syncbn import patch_tensorpack  # noqa: PLC0415
        return patch_tensorpack(**self.sync_kwargs(option, num_dev))

    def patch_key(self, option, num_dev):
        return (self.family, repr(sorted(self.sync_kwargs(option, num_dev).items())))

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        import tensorpack.models  # noqa: PLC0415
        with contextlib.nullcontext() if patched else self.patch(option, num_dev):
            return {'y': tensorpack.models.BatchNorm('bn', x, **self.kwargs(option, training))}


# ---------------------------------------------------------------------------
# tf.layers and Keras


class _KerasLike(FrontEnd):
    """tf.layers' and Keras' arguments (the same names)."""

    parameters = ('inputs', 'axis', 'momentum', 'epsilon', 'training', 'name', 'num_dev',
                  'sync_statistics')
    not_sync_relevant = {
        'center': ('tests/layers/test_layers_parity.py', 'no beta'),
        'scale': ('tests/layers/test_layers_parity.py', 'no gamma'),
        'beta_initializer': ('tests/layers/test_layers_parity.py', 'initial values'),
        'gamma_initializer': ('tests/layers/test_layers_parity.py', 'initial values'),
        'moving_mean_initializer': ('tests/layers/test_layers_parity.py', 'initial values'),
        'moving_variance_initializer': ('tests/layers/test_layers_parity.py', 'initial values'),
        'beta_regularizer': ('tests/layers/test_layers_parity.py', 'losses on the variables'),
        'gamma_regularizer': ('tests/layers/test_layers_parity.py', 'losses on the variables'),
        'beta_constraint': ('tests/layers/test_layers_parity.py', "the optimizer's projection"),
        'gamma_constraint': ('tests/layers/test_layers_parity.py', "the optimizer's projection"),
        'trainable': ('tests/layers/test_layers_parity.py', 'no updates, no training'),
        'adjustment': ('tests/layers/test_layers_parity.py', 'a function of the batch'),
    }

    def kwargs(self, option, training):
        kwargs = {'axis': option.channel_axis, 'momentum': opts.MOMENTUM,
                  'epsilon': opts.EPSILON}
        if option.feature == 'unfused':
            kwargs['fused'] = False
        if option.feature == 'renorm':
            kwargs.update(renorm=True, renorm_clipping=dict(opts.RENORM_CLIPPING),
                          renorm_momentum=opts.RENORM_MOMENTUM)
        if option.feature == 'ghost':
            kwargs['virtual_batch_size'] = opts.VIRTUAL_BATCH_SIZE
        return kwargs


class _Layers(_KerasLike):
    family = 'layers'
    replaced = "tf-keras' legacy `tf.compat.v1.layers.batch_normalization`"
    not_sync_relevant = dict(_KerasLike.not_sync_relevant, reuse=(
        'tests/layers/test_layers_parity.py', 'variable sharing'))

    def build_replaced(self, x, training, option, weights=None):
        return {'y': tf1.layers.batch_normalization(x, training=training, name='bn',
                                                    **self.kwargs(option, training))}


class LayersFunction(_Layers):
    name = 'layers.batch_normalization'
    short = 'layers fn'
    call = '`tf1_syncbn.layers.batch_normalization(x, ...)`'

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        from tf1_syncbn import layers  # noqa: PLC0415
        return {'y': layers.batch_normalization(x, training=training, name='bn',
                                                **self.kwargs(option, training),
                                                **self.sync_kwargs(option, num_dev))}


class _LayerObjects(object):
    """One layer object per cell, built in the first tower and called by every tower.

    As a model is built once and called per tower (docs/keras.md: in
    tensorpack's trainers too), under the cell's variable scope.
    """

    def __init__(self):
        self._layers = {}

    def get(self, make):
        scope = tf1.get_variable_scope().name.split('/')[-1]
        key = (tf1.get_default_graph(), scope)
        if key not in self._layers:
            self._layers[key] = make()
        return self._layers[key]

    def clear(self):
        self._layers.clear()


class LayersClass(_Layers):
    name = 'layers.BatchNormalization'
    short = 'layers class'
    call = '`tf1_syncbn.layers.BatchNormalization(...)(x, training=...)`'
    replaced = "tf-keras' legacy `tf.compat.v1.layers.BatchNormalization`"
    parameters = tuple(p for p in _KerasLike.parameters if p not in ('inputs', 'training'))
    not_sync_relevant = dict(_KerasLike.not_sync_relevant, kwargs=(
        'tests/layers/test_layers_parity.py', "Keras' generic layer arguments (dtype, ...)"))
    not_sync_relevant.pop('reuse', None)

    def __init__(self):
        self.objects = _LayerObjects()

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        from tf1_syncbn import layers  # noqa: PLC0415
        layer = self.objects.get(lambda: layers.BatchNormalization(
            name='bn', **self.kwargs(option, training), **self.sync_kwargs(option, num_dev)))
        return {'y': layer(x, training=training)}

    def build_replaced(self, x, training, option, weights=None):
        layer = tf1.layers.BatchNormalization(name='bn', **self.kwargs(option, training))
        return {'y': layer(x, training=training)}


class PatchTfLayers(_Layers):
    name = 'patch_tf_layers'
    short = 'patch layers'
    reached = 'patched'
    call = '`tf.compat.v1.layers.batch_normalization(x, ...)` after `patch_tf_layers(...)`'
    parameters = ('sync_statistics', 'num_dev')
    not_sync_relevant = {}

    def patch(self, option, num_dev):
        from tf1_syncbn import patch_tf_layers  # noqa: PLC0415
        return patch_tf_layers(**self.sync_kwargs(option, num_dev))

    def patch_key(self, option, num_dev):
        return (self.family, repr(sorted(self.sync_kwargs(option, num_dev).items())))

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        with contextlib.nullcontext() if patched else self.patch(option, num_dev):
            return self.build_replaced(x, training, option)


class _Keras(_KerasLike):
    family = 'keras'
    replaced = "tf-keras' `BatchNormalization`"
    parameters = tuple(p for p in _KerasLike.parameters if p not in ('inputs', 'training'))
    not_sync_relevant = dict(_KerasLike.not_sync_relevant, **{
        'synchronized': ('tests/keras/test_keras_api.py',
                         "tf-keras' own switch (refused: the layer always synchronizes)"),
        'kwargs': ('tests/keras/test_keras_api.py', "Keras' generic layer arguments (dtype, ...)"),
    })

    def __init__(self):
        self.objects = _LayerObjects()

    def build_replaced(self, x, training, option, weights=None):
        import tf_keras  # noqa: PLC0415 - the oracle's subprocess
        layer = tf_keras.layers.BatchNormalization(name='bn', **self.kwargs(option, training))
        y = layer(x, training=training)
        for update in layer.get_updates_for(x):   # as users do: Keras keeps them here
            tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
        return {'y': y}

    def _call(self, make, x, training):
        layer = self.objects.get(make)
        y = layer(x, training=training)
        # Keras keeps a call's updates in the layer, not in UPDATE_OPS; users put them
        # there (docs/keras.md), or into their train op's control dependencies.
        for update in layer.get_updates_for(x):
            tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
        return {'y': y}


class KerasClass(_Keras):
    name = 'keras.BatchNormalization'
    short = 'keras'
    call = '`tf1_syncbn.keras.BatchNormalization(...)(x, training=...)`'

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        from tf1_syncbn import keras as sync_keras  # noqa: PLC0415
        return self._call(lambda: sync_keras.BatchNormalization(
            name='bn', **self.kwargs(option, training), **self.sync_kwargs(option, num_dev)),
            x, training)


class PatchKeras(_Keras):
    name = 'patch_keras'
    short = 'patch keras'
    reached = 'patched'
    call = '`tf_keras.layers.BatchNormalization(...)` built after `patch_keras(...)`'
    parameters = ('sync_statistics', 'num_dev')
    not_sync_relevant = {}

    def patch(self, option, num_dev):
        from tf1_syncbn import keras as sync_keras  # noqa: PLC0415
        return sync_keras.patch_keras(**self.sync_kwargs(option, num_dev))

    def patch_key(self, option, num_dev):
        return (self.family, repr(sorted(self.sync_kwargs(option, num_dev).items())))

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        from tf1_syncbn import keras as sync_keras  # noqa: PLC0415

        def make():
            with contextlib.nullcontext() if patched else self.patch(option, num_dev):
                return importlib.import_module(sync_keras.KERAS_PACKAGE).layers.BatchNormalization(
                    name='bn', **self.kwargs(option, training))
        return self._call(make, x, training)


# ---------------------------------------------------------------------------
# moments: a hand-written layer


class Moments(FrontEnd):
    """A batch norm written by hand around ``moments`` (``tf.nn.moments``' place).

    What ``moments`` promises is the group's statistics and their
    gradients: the outputs, the statistics themselves and the gradients are
    compared. Its moving averages are the hand-written layer's own (whose
    towers' update ops a harness keeps is the script's choice), so it keeps
    none.
    """

    name = 'moments'
    short = 'moments'
    family = 'moments'
    call = '`mean, variance = tf1_syncbn.moments(x, axes, keepdims=True)` in a hand-written layer'
    replaced = '`tf.nn.moments` in the same hand-written layer'
    parameters = ('x', 'axes', 'keepdims', 'training', 'sync_statistics', 'num_dev')
    not_sync_relevant = {
        'shift': ('tests/core/test_moments.py', "tf.nn.moments' unused argument"),
        'name': ('tests/core/test_moments.py', 'op names'),
        'keep_dims': ('tests/core/test_moments.py', "TF1's spelling of keepdims"),
    }
    outputs = ('y', 'mean', 'variance')

    def not_applicable(self, option):
        if option.feature is not None:
            return 'a hand-written layer has no %s' % {
                'renorm': 'renorm', 'unfused': 'fused switch', 'ghost': 'ghost batches'}[
                    option.feature]
        return None

    def kwargs(self, option, training):
        axes = [0] if option.layout == 'rank2' else (
            [0, 2, 3] if option.layout == 'NCHW' else [0, 1, 2])
        return {'axes': axes, 'keepdims': True}

    def _layer(self, x, moments_of):
        """Normalizes in float32 (16-bit inputs too), as Keras' layers do."""
        mean, variance = moments_of(x)
        shape = mean.shape               # (keepdims: broadcast against x)
        gamma = tf1.get_variable('gamma', shape, initializer=tf1.ones_initializer())
        beta = tf1.get_variable('beta', shape, initializer=tf1.zeros_initializer())
        y = (tf.cast(x, tf.float32) - tf.cast(mean, tf.float32)) * tf.math.rsqrt(
            tf.cast(variance, tf.float32) + opts.EPSILON) * gamma + beta
        return {'y': tf.cast(y, x.dtype), 'mean': mean, 'variance': variance}

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        import tf1_syncbn  # noqa: PLC0415
        kwargs = self.kwargs(option, training)
        sync = self.sync_kwargs(option, num_dev)
        with tf1.variable_scope('bn'):
            return self._layer(x, lambda x: tf1_syncbn.moments(
                x, kwargs['axes'], keepdims=True, training=training, **sync))

    def build_replaced(self, x, training, option, weights=None):
        kwargs = self.kwargs(option, training)
        with tf1.variable_scope('bn'):
            return self._layer(x, lambda x: tf.nn.moments(x, kwargs['axes'], keepdims=True))


class WeightedMoments(Moments):
    name = 'weighted_moments'
    short = 'weighted'
    call = '`tf1_syncbn.weighted_moments(x, axes, weights, keepdims=True)` in a hand-written ' \
        'layer'
    replaced = '`tf.nn.weighted_moments` in the same hand-written layer'
    parameters = ('x', 'axes', 'frequency_weights', 'keepdims', 'training', 'sync_statistics',
                  'num_dev')
    not_sync_relevant = {k: v for k, v in Moments.not_sync_relevant.items() if k != 'shift'}
    uses_weights = True

    def build(self, x, training, option, num_dev, weights=None, patched=False):
        import tf1_syncbn  # noqa: PLC0415
        kwargs = self.kwargs(option, training)
        sync = self.sync_kwargs(option, num_dev)
        with tf1.variable_scope('bn'):
            return self._layer(x, lambda x: tf1_syncbn.weighted_moments(
                x, kwargs['axes'], _broadcastable(weights, x), keepdims=True,
                training=training, **sync))

    def build_replaced(self, x, training, option, weights=None):
        kwargs = self.kwargs(option, training)
        with tf1.variable_scope('bn'):
            return self._layer(x, lambda x: tf.nn.weighted_moments(
                x, kwargs['axes'], _broadcastable(weights, x), keepdims=True))


def _broadcastable(weights, x):
    """Per-example weights ``[batch]`` as ``[batch, 1, ...]`` (broadcast against ``x``)."""
    weights = tf.cast(weights, x.dtype)
    return tf.reshape(weights, [-1] + [1] * (len(x.shape) - 1))


#: The families with a patch (a row that reaches the layer through it).
PATCHED_FAMILIES = ('slim', 'tensorpack', 'layers', 'keras')

FRONT_ENDS = (SyncBatchNorm(), SyncArgScope(), TensorpackBatchNorm(), TensorpackBatchRenorm(),
              PatchTensorpack(), LayersFunction(), LayersClass(), PatchTfLayers(), KerasClass(),
              PatchKeras(), Moments(), WeightedMoments())
BY_NAME = {front_end.name: front_end for front_end in FRONT_ENDS}
assert len(BY_NAME) == len(FRONT_ENDS)

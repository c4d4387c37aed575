"""tf.layers batch normalization cases, built the same way on both sides.

The tests of ``tf1_syncbn.layers`` compare it with tf.layers' own layer
(tf-keras' legacy ``BatchNormalization``), run in a subprocess with legacy
Keras (``layers_reference.py``). Both sides build every case with the
functions here, given the layers *module* (``tf.compat.v1.layers`` there,
``tf1_syncbn.layers`` here). This module never imports ``tf1_syncbn``.

The cases port tf-keras' own tests of the legacy layer
(``tf_keras/legacy_tf_layers/normalization_test.py``): the numeric ones
(``test3DInputAxis1``, ``test4DInputAxis3Fused``, ``testBooleanLearningPhase``,
``testRenorm``, ``testAdjustment``, ``testRenormWithAdjustment``,
``testHalfPrecision``, ...) become parity cases (:data:`PARITY_CASES`, run by
``parity_harness.train_case``), the structural ones (``testCreateBN``,
``testFunctionalReuse``, ``testNoCenter``, ``testRegularizers``, ...) become
scenarios (:data:`SCENARIOS`) whose names, collections and values both sides
record with :func:`run_scenario`.
"""

import numpy as np
import tensorflow as tf

import suite_scope
import tf_behavior

tf1 = tf.compat.v1

# ---------------------------------------------------------------------------
# Parity cases: a layer trained by parity_harness.train_case.

SHAPES = {  # (rank, channels first) -> the global batch's shape, 3 channels
    (2, False): [8, 3],
    (3, False): [8, 4, 3], (3, True): [8, 3, 4],
    (4, False): [8, 3, 2, 3], (4, True): [8, 3, 3, 2],
    (5, False): [8, 2, 2, 1, 3], (5, True): [8, 3, 2, 1, 2],
}
BASE = {'momentum': 0.8}


def _case(name, rank=4, first=False, axis=None, shape=None, **options):
    """A case; ``axis`` is spelled as given (default: 1 or -1 by ``first``).

    ``shape``: the global batch's shape, where :data:`SHAPES` has none that
    fits (the middle axes and lists of axes).
    """
    shape = list(shape or SHAPES[(rank, first)])
    if options.pop('channels', None):
        shape[1 if first else -1] = 4
    kwargs = dict(BASE, axis=axis if axis is not None else (1 if first else -1))
    kwargs.update(options.pop('kwargs', {}))
    return dict(name=name, shape=shape, kwargs=kwargs, **options)


PARITY_CASES = [
    # fused=None: tf.layers' fused kernel on rank 4 and 5 (unbiased variance),
    # tf.nn.moments on rank 2 and 3 (biased); axis as an int, a list, negative
    # (test3DInputAxis1, test4DInputAxis3, testNegativeAxis, ...). Some carry
    # one more option each.
    _case('rank2', 2),
    _case('rank3-axis-last-scale=False', 3, kwargs={'scale': False}),
    _case('rank3-axis1', 3, True),
    _case('rank4-axis3', 4, axis=3),
    _case('rank4-axis[1]-fused=True', 4, True, axis=[1], kwargs={'fused': True}),
    _case('rank5-axis-last-momentum_tensor', 5, momentum_tensor=True),
    _case('rank5-axis-4-object', 5, True, axis=-4, object=True),
    # fused=False; fused=True where tf.layers has no fused kernel (it takes
    # the non-fused path without a word).
    _case('fused=False-rank4-axis1', 4, True, kwargs={'fused': False}),
    _case('fused=False-rank5-axis-last', 5, kwargs={'fused': False}),
    _case('fused=True-rank3-axis1', 3, True, kwargs={'fused': True}),
    # training as a bool tensor (testBooleanLearningPhase, the placeholders of
    # test3DInputAxis1 ...), fused and not; the layer object with one.
    _case('training_tensor-rank4', 4, training_tensor=True),
    _case('training_tensor-rank3-axis1', 3, True, training_tensor=True),
    _case('training_tensor-rank2-object', 2, object=True, training_tensor=True),
    # testNoCenter / testNoScale; trainable=False (gamma, beta and the moving
    # statistics stay: tf.layers puts no update in UPDATE_OPS).
    _case('no_center_no_scale-rank2', 2, kwargs={'center': False, 'scale': False}),
    _case('trainable=False-rank4', 4, kwargs={'trainable': False}),
    # Defaults (momentum 0.99: 1 - momentum in float32 on the fused path, in
    # double elsewhere, checked tightly); initializers, epsilon and constraints
    # (testConstraints: the optimizer projects gamma and beta).
    _case('defaults-rank4', 4, kwargs={'momentum': 0.99}, loc=3.0, scale=1.0, tight=True),
    _case('defaults-rank2', 2, kwargs={'momentum': 0.99}, loc=3.0, scale=1.0, tight=True),
    _case('initializers-epsilon-constraints-rank4', 4, initializers=True, constraints=True,
          kwargs={'epsilon': 0.1}),
    # testRenorm, testRenormNoClippingSameMomentumGivesSameTestTrain,
    # testAdjustment, testRenormWithAdjustment (tf.layers runs them non-fused).
    _case('renorm-clipped-rank2', 2, kwargs={'renorm': True, 'renorm_momentum': 0.7,
                                             'renorm_clipping': {'rmax': 1.1, 'rmin': 0.9,
                                                                 'dmax': 0.1}}),
    _case('renorm-clipped-rank4-axis1', 4, True, kwargs={
        'renorm': True, 'renorm_momentum': 0.7,
        'renorm_clipping': {'rmax': 1.5, 'rmin': 0.8, 'dmax': 0.3}}),
    # renorm with a bool tensor `training` (every tower must read
    # renorm_mean/renorm_stddev before the main tower updates them in the same
    # step: a race some steps lost, before commit b8e7487).
    _case('renorm-training_tensor-rank4-axis1', 4, True, training_tensor=True, kwargs={
        'renorm': True, 'renorm_momentum': 0.7,
        'renorm_clipping': {'rmax': 1.5, 'rmin': 0.8, 'dmax': 0.3}}),
    _case('renorm-unclipped-rank5-axis1', 5, True, kwargs={'renorm': True}),
    _case('adjustment-rank4-axis1', 4, True, adjustment=True),
    _case('renorm-adjustment-rank2', 2, adjustment=True,
          kwargs={'renorm': True, 'renorm_momentum': 0.8,
                  'renorm_clipping': {'rmax': 1.1, 'rmin': 0.9, 'dmax': 0.1}}),
    # testHalfPrecision / testCreateFusedBNFloat16: 16-bit inputs, float32
    # variables; tf.layers' non-fused path computes in float32.
    _case('float16-rank4', 4, dtype='float16'),
    _case('float16-rank4-axis1-fused=False', 4, True, dtype='float16', kwargs={'fused': False}),
    _case('bfloat16-rank5-axis1', 5, True, dtype='bfloat16'),
    _case('bfloat16-rank3', 3, dtype='bfloat16'),
    # Data whose mean is 10^4 times its spread (the 100 + U(0, 1) of
    # tf-keras' tests, more so), fused and not; learning rate 0 (see
    # parity_harness.tolerances).
    _case('mean1e4-rank4', 4, loc=1e4, scale=1.0, learning_rate=0.0),
    _case('mean1e4-rank3-axis1', 3, True, loc=1e4, scale=1.0, learning_rate=0.0),
    # A partitioned scope: gamma and beta partitioned, the statistics not.
    _case('partitioned-rank4', 4, channels=True, partitions=2),
    # Every other axis form tf.layers takes (test4DInputAxis2, test3DInputMultiAxis12,
    # test5DInputMultiAxis123, testGhostBN5DimsMultiAxis14): a middle axis or
    # several axes, which tf.layers always normalizes without its fused
    # kernel (biased variance), with variables of shape [C] for one axis and
    # the input's shape with 1 elsewhere for several. Here the core
    # normalizes a view (tf1_syncbn._frontend.axes): a middle axis folded into a free
    # reshape [N*P, C, Q, 1]; contiguous axes at the start [N, C, S, 1] or
    # end [N, S, 1, C]; axes apart transposed to [N, ..., axes].
    _case('rank4-axis2-middle', axis=2, shape=[8, 2, 3, 2]),
    _case('rank5-axis-3-middle-training_tensor', axis=-3, shape=[8, 2, 3, 1, 2],
          training_tensor=True),
    _case('rank3-axis[1,2]', axis=[1, 2], shape=[8, 2, 3]),
    _case('rank5-axis[1,2,3]-float16', axis=[1, 2, 3], shape=[8, 2, 3, 1, 2], dtype='float16'),
    _case('rank4-axis[2,-1]-object', axis=[2, -1], shape=[8, 2, 3, 2], object=True),
    _case('rank4-axis[3,1]-apart', axis=[3, 1], shape=[8, 2, 3, 2]),
    _case('rank4-axis2-fused=True-mean1e4', axis=2, shape=[8, 2, 3, 2], loc=1e4, scale=1.0,
          learning_rate=0.0, kwargs={'fused': True}),
    # The separate-ops path (fused=False, renorm, adjustment) on a view.
    _case('fused=False-rank4-axis2', axis=2, shape=[8, 2, 3, 2], kwargs={'fused': False}),
    _case('renorm-rank4-axis[1,3]-training_tensor', axis=[1, 3], shape=[8, 2, 3, 2],
          training_tensor=True, kwargs={'renorm': True, 'renorm_momentum': 0.7,
                                         'renorm_clipping': {'rmax': 1.5, 'rmin': 0.8}}),
    _case('adjustment-rank5-axis2', axis=2, shape=[8, 2, 3, 1, 2], adjustment=True),
    # Ghost batches on a view that keeps the batch alone on axis 0 (a transpose):
    # every tower of equal size (see test_layers_virtual_batch.py for more).
    _case('virtual_batch-rank5-axis[1,4]', axis=[1, 4], shape=[8, 2, 1, 2, 3],
          sizes=[4, 4], kwargs={'virtual_batch_size': 4}),
]
assert len({c['name'] for c in PARITY_CASES}) == len(PARITY_CASES)
#: Every case, whichever the behaviour and the scope (the Horovod suite picks its own).
ALL_PARITY_CASES = PARITY_CASES
# make test runs a covering set of these cases (suite_scope.covering; make
# test-full all 42, in both behaviours). This library's `fused` only chooses
# which variance the moving variance tracks (tf1_syncbn._core.options): every
# rank and axis form reaches the core's kernels as a 4-D view, NHWC or NCHW
# (tf1_syncbn._frontend.axes). The cases left out each repeat, on a rank or view
# another case already brings to the same layout, convention and kernel, an
# option that another kept case carries:
#   rank3-axis-last-scale=False: rank 3 channels last, biased: bfloat16-rank3;
#     scale=False (no gamma): no_center_no_scale-rank2 (and the create scenario);
#   rank3-axis1: rank 3 NCHW, biased: fused=True-rank3-axis1 (tf.layers ignores
#     fused=True there: the same path), training_tensor-rank3-axis1;
#   rank4-axis3: rank 4 NHWC fused: defaults-rank4, trainable=False-rank4,
#     float16-rank4, mean1e4-rank4, training_tensor-rank4, partitioned-rank4;
#   fused=False-rank5-axis-last: fused=False (the separate ops of the core's slow
#     path, tf1_syncbn._core.normalize): fused=False-rank4-axis1; the slow path
#     on NHWC: renorm-adjustment-rank2;
#   training_tensor-rank2-object: a bool tensor, biased: training_tensor-rank3-axis1;
#     the object API: rank5-axis-4-object, rank4-axis[2,-1]-object;
#   renorm-clipped-rank2: renorm clipped on rank 2: renorm-adjustment-rank2;
#   renorm-clipped-rank4-axis1: the same case with a bool-tensor training:
#     renorm-training_tensor-rank4-axis1; renorm with a Python bool on NCHW:
#     renorm-unclipped-rank5-axis1;
#   float16-rank4-axis1-fused=False: float16 where tf.layers is not fused (cast
#     to float32 first, as tf.layers does): rank5-axis[1,2,3]-float16; then the
#     slow path in float32: fused=False-rank4-axis1;
#   mean1e4-rank3-axis1: the large mean biased on an NCHW view:
#     rank4-axis2-fused=True-mean1e4;
#   rank5-axis-3-middle-training_tensor: a middle axis folded: rank4-axis2-middle,
#     adjustment-rank5-axis2 (rank 5); a bool tensor: training_tensor-rank4,
#     training_tensor-rank3-axis1 (a view is built before the core's tf.cond);
#   rank3-axis[1,2]: contiguous axes that end at the last one (a free NHWC
#     view): rank4-axis[2,-1]-object;
#   fused=False-rank4-axis2: the slow path on a folded middle view:
#     adjustment-rank5-axis2; fused=False: fused=False-rank4-axis1;
#   renorm-rank4-axis[1,3]-training_tensor: renorm in a tf.cond, its reads
#     before the main tower's updates: renorm-training_tensor-rank4-axis1; the
#     same view without renorm (axes apart, transposed): rank4-axis[3,1]-apart.
OUT_OF_MAKE_TEST = (
    'rank3-axis-last-scale=False', 'rank3-axis1', 'rank4-axis3', 'fused=False-rank5-axis-last',
    'training_tensor-rank2-object', 'renorm-clipped-rank2', 'renorm-clipped-rank4-axis1',
    'float16-rank4-axis1-fused=False', 'mean1e4-rank3-axis1',
    'rank5-axis-3-middle-training_tensor', 'rank3-axis[1,2]', 'fused=False-rank4-axis2',
    'renorm-rank4-axis[1,3]-training_tensor')
assert set(OUT_OF_MAKE_TEST) <= {c['name'] for c in PARITY_CASES}
PARITY_CASES = suite_scope.covering(
    PARITY_CASES, [c for c in PARITY_CASES if c['name'] not in OUT_OF_MAKE_TEST])
# The TF1-behaviour pass (tf_behavior.pick; the reference script imports this
# module, so both sides run the same cases): one case per path that TF1
# behaviour changes. Dimension shapes: every rank (2: renorm-adjustment-rank2,
# 3: training_tensor-rank3-axis1, bfloat16-rank3, 4, 5) in both layouts, a
# middle axis folded (rank4-axis2-middle), axes apart transposed
# (rank4-axis[3,1]-apart), ghost batches on a transposed view
# (virtual_batch-rank5-axis[1,4], tf.layers' TF1 ghost batches). Reads of
# reference variables: fused and not (fused=False-rank4-axis1), renorm's
# separate ops and their race (renorm-training_tensor-rank4-axis1), adjustment
# (renorm-adjustment-rank2), a momentum tensor, partitioned variables. v1
# tf.cond: a bool-tensor training, fused and not, with renorm. Keras' TF1
# `trainable=False` (batch statistics still: trainable=False-rank4). A 16-bit
# type (bfloat16-rank3). Not again in TF1 behaviour: the large mean, the tiny
# variance, float16 next to bfloat16 (numerics of the same kernels, which TF1
# behaviour does not change), axis spellings and the other views (the same
# reshapes), options that only change values (initializers, constraints,
# epsilon, momentum, center/scale).
V1_NAMES = ('rank5-axis-last-momentum_tensor', 'rank5-axis-4-object', 'fused=False-rank4-axis1',
            'training_tensor-rank4', 'training_tensor-rank3-axis1', 'trainable=False-rank4',
            'renorm-training_tensor-rank4-axis1', 'renorm-adjustment-rank2', 'bfloat16-rank3',
            'partitioned-rank4', 'rank4-axis2-middle', 'rank4-axis[3,1]-apart',
            'virtual_batch-rank5-axis[1,4]')
assert set(V1_NAMES) <= {c['name'] for c in PARITY_CASES}
PARITY_CASES = tf_behavior.pick(PARITY_CASES, [c for c in PARITY_CASES
                                               if c['name'] in V1_NAMES])


def adjustment_for(case):
    """A deterministic adjustment (testAdjustment's random one would differ between sides).

    Per channel, in the shape that broadcasts against the input (``[C]`` for
    the last axis, ``[1, C, 1, ...]`` for axis 1, as tf.layers needs it; the
    input's shape with 1 in every other axis for other axes).
    """
    rank = len(case['shape'])
    axis = case['kwargs']['axis']
    axes = sorted(a % rank for a in (axis if isinstance(axis, list) else [axis]))
    if len(axes) > 1 or axes[0] not in (1, rank - 1):
        shape = [case['shape'][i] if i in axes else 1 for i in range(rank)]

        def adjustment_for_axes(_):
            index = tf.reshape(tf.range(float(np.prod(shape))), shape)
            return 1.0 + 0.25 * index, 0.1 * index - 0.1
        return adjustment_for_axes
    first = case['kwargs']['axis'] in (1, [1], -4, -3) and rank > 2

    def adjustment(shape):
        index = tf.range(tf.cast(shape[1 if first else -1], tf.float32))
        if first:
            index = tf.reshape(index, [1, -1] + [1] * (rank - 2))
        return 1.0 + 0.25 * index, 0.1 * index - 0.1
    return adjustment


def parity_apply(module, case, x, training, tower, extra=None):
    """The case's layer from ``module`` on ``x`` (``tower`` None: the inference call).

    Args:
      module: ``tf.compat.v1.layers`` or ``tf1_syncbn.layers``.
      case: a :data:`PARITY_CASES` entry.
      x, training: as ``parity_harness.train_case`` gives them.
      tower: the tower index, or None for the inference call (which reuses).
      extra: more keyword arguments (this library's ``sync_statistics``).
    """
    kwargs = dict(case['kwargs'], **(extra or {}))
    if case.get('momentum_tensor'):
        kwargs['momentum'] = tf.constant(kwargs['momentum'], tf.float32)
    if case.get('adjustment'):
        kwargs['adjustment'] = adjustment_for(case)
    if case.get('initializers'):
        kwargs.update(beta_initializer=tf1.constant_initializer(0.3),
                      gamma_initializer=tf1.constant_initializer(1.5),
                      moving_mean_initializer=tf1.constant_initializer(0.2),
                      moving_variance_initializer=tf1.constant_initializer(2.0))
    if case.get('constraints'):
        kwargs.update(gamma_constraint=lambda v: tf.clip_by_value(v, 0.9, 1.02),
                      beta_constraint=lambda v: tf.clip_by_value(v, -0.03, 0.03))
    partitioner = tf1.fixed_size_partitioner(case['partitions']) \
        if case.get('partitions') else None
    with tf1.variable_scope('net', reuse=True if tower is None else None,
                            partitioner=partitioner):
        if case.get('object'):
            layer = module.BatchNormalization(name='bn', **kwargs)
            return layer.apply(x, training=training)
        return module.batch_normalization(x, training=training, name='bn', **kwargs)


# ---------------------------------------------------------------------------
# Scenarios: the layer's object API, names, scopes and collections.

def _names(values):
    return [getattr(v, 'name', str(v)) for v in values]


def _collection(key):
    return _names(tf1.get_collection(key))


def _layer_record(layer):
    return {'name': layer.name, 'scope_name': layer.scope_name,
            'variables': _names(layer.variables),
            'trainable_variables': _names(layer.trainable_variables),
            'non_trainable_variables': _names(layer.non_trainable_variables),
            'weights': _names(layer.weights), 'updates': len(layer.updates),
            'losses': len(layer.losses),
            'attributes': [getattr(layer, a) is not None
                           for a in ('gamma', 'beta', 'moving_mean', 'moving_variance')]}


def _scenario_create(module, x4, x3):
    """testCreateBN / testNoCenter / testNoScale / testCreateFusedBNFloat16."""
    training = tf1.placeholder(tf.bool, [])
    records = []
    for kwargs, x in (({'axis': 1}, x3), ({'axis': 1, 'center': False}, x3),
                      ({'axis': 1, 'scale': False}, x3),
                      ({'axis': 1, 'fused': True}, tf.cast(x4, tf.float16)),
                      ({'renorm': True, 'trainable': False}, x4)):
        layer = module.BatchNormalization(**kwargs)
        out = layer(x, training=training)
        record = _layer_record(layer)
        record.update(shape=out.shape.as_list(), dtype=out.dtype.name,
                      gamma=getattr(layer.gamma, 'name', None),
                      moving_mean=layer.moving_mean.name)
        records.append(record)
    return {'layers': records, 'update_ops': len(tf1.get_collection(
        tf1.GraphKeys.UPDATE_OPS)), 'trainable': _collection(tf1.GraphKeys.TRAINABLE_VARIABLES),
        'global': _collection(tf1.GraphKeys.GLOBAL_VARIABLES)}


def _scenario_naming(module, x4, x3):
    """testFunctionalNoReuse / testFunctionalReuse / testFunctionalReuseFromScope, names."""
    training = tf1.placeholder(tf.bool, [])
    record = {}
    module.batch_normalization(x4, training=training)                      # batch_normalization
    module.batch_normalization(x4, training=training)                      # batch_normalization_1
    module.batch_normalization(x4, training=training, name='bn')
    module.batch_normalization(x4, training=training, name='bn', reuse=True)
    try:
        module.batch_normalization(x4, training=training, name='bn')
        record['duplicate'] = 'no error'
    except ValueError as e:
        record['duplicate'] = str(e).split('.')[0]
    with tf1.variable_scope('scope'):
        module.batch_normalization(x4, training=training)
    record['after_scope'] = len(tf1.global_variables())
    with tf1.variable_scope('scope', reuse=True):
        module.batch_normalization(x4, training=training)
    record['after_reuse'] = len(tf1.global_variables())
    unnamed = [module.BatchNormalization(), module.BatchNormalization()]
    named = module.BatchNormalization(name='obj')
    record['names_before_call'] = [layer.name for layer in unnamed + [named]]
    for layer in unnamed + [named]:
        layer.apply(x3, training=True)
    twice = module.BatchNormalization(name='twice')
    twice(x4, training=True)
    twice(x4, training=False)
    twice(x4, training=True)
    record['layers'] = [_layer_record(layer) for layer in unnamed + [named, twice]]
    record['global'] = _collection(tf1.GraphKeys.GLOBAL_VARIABLES)
    record['trainable'] = _collection(tf1.GraphKeys.TRAINABLE_VARIABLES)
    record['update_ops'] = len(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
    return record


def _scenario_regularizers(module, x4, x3):
    """testRegularizers / testConstraints: losses in REGULARIZATION_LOSSES, their values."""
    del x4
    layers = [module.BatchNormalization(axis=1, beta_regularizer=lambda v: 0.1 * tf.reduce_sum(v),
                                        beta_initializer=tf1.constant_initializer(0.5)),
              module.BatchNormalization(axis=1, gamma_regularizer=lambda v: tf.nn.l2_loss(v),
                                        gamma_constraint=lambda v: v / tf.reduce_sum(v),
                                        beta_constraint=lambda v: v / tf.reduce_max(v))]
    for layer in layers:
        layer(x3, training=True)
    with tf1.variable_scope('shared'):
        module.batch_normalization(x3, gamma_regularizer=tf.nn.l2_loss, name='bn', training=True)
    with tf1.variable_scope('shared', reuse=True):
        module.batch_normalization(x3, gamma_regularizer=tf.nn.l2_loss, name='bn', training=True)
    losses = tf1.get_collection(tf1.GraphKeys.REGULARIZATION_LOSSES)
    with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        values = [float(v) for v in sess.run(losses)]
    return {'losses': _names(losses), 'values': values,
            'layer_losses': [len(layer.losses) for layer in layers],
            'constraints': [layers[1].gamma.constraint is not None,
                            layers[1].beta.constraint is not None,
                            layers[0].beta.constraint is None]}


SCENARIOS = {'create': _scenario_create, 'naming': _scenario_naming,
             'regularizers': _scenario_regularizers}


def run_scenario(module, name):
    """Builds scenario ``name`` with ``module``'s layers in a fresh graph; returns its record."""
    with tf.Graph().as_default():
        x4 = tf.constant(np.random.RandomState(0).rand(5, 4, 3, 6), tf.float32)
        x3 = tf.constant(np.random.RandomState(1).rand(5, 4, 3), tf.float32)
        return SCENARIOS[name](module, x4, x3)

"""A ``custom_getter`` that fake-quantizes a batch norm's variables, and a run that records it.

The recipe of StackOverflow's "Batch normalization in tensorflow: variables
and performance" (one of the project's seed documents): one's own ops on a
batch norm's ``gamma``, ``beta``, moving mean and moving variance before
normalizing, here fake quantization switched on by a bool ``tf.cond`` for a
fine-tuning phase, through a ``custom_getter`` on the enclosing variable
scope (TF1's idiom for it).

:func:`train` builds a layer under the getter on one tower or on several
(``tower.call_for_each_tower`` on virtual CPUs) and runs a few SGD steps,
recording every output, gradient and variable, and the ops each layer call
and each getter call built. Both sides of the tests use it: this library's
front-ends in the test process, and tf-slim's ``batch_norm``, tf.layers'
``batch_normalization`` and tensorpack's ``BatchNorm`` in the legacy-Keras
subprocess of ``layers_reference.py``, where they support the getter. It
never imports ``tf1_syncbn``; :func:`seed_layer` is an independent
reference: the seed question's own layer, one device, ``tf.nn.fused_batch_norm``.
"""

import collections
import contextlib

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

#: The fake quantization: 5 bits over [-4, 4] (steps of 8/31, about 0.26),
#: coarse enough that computing with the raw values instead fails every check.
QUANT_MIN, QUANT_MAX, QUANT_BITS = -4.0, 4.0, 5

#: Per front-end: the names of (gamma, beta, moving mean, moving variance).
NAMES = {'slim': ('gamma', 'beta', 'moving_mean', 'moving_variance'),
         'layers': ('gamma', 'beta', 'moving_mean', 'moving_variance'),
         'tensorpack': ('gamma', 'beta', 'mean/EMA', 'variance/EMA')}

#: What the getter transforms: all four variables, or gamma and beta only
#: (what tf-slim, tf.layers and tensorpack support in training: their
#: moving-average updates call ``assign_sub`` on what the getter returned).
WHICH = {'all': 4, 'affine': 2}

#: ``training``: a Python True or False, or a bool tensor (fed per step).
MODES = ('true', 'false', 'tensor')

SHAPE = [8, 3, 2, 3]            # the global batch, NHWC
MOMENTUM, EPSILON, LEARNING_RATE = 0.8, 1e-3, 0.1
QUANT_FEED = (False, True, True)         # quantization off in step 0, then on
TRAINING_FEED = (True, True, False)      # mode 'tensor': the last step in inference
STEPS = len(QUANT_FEED)


def fake_quant(value):
    return tf.quantization.fake_quant_with_min_max_args(value, QUANT_MIN, QUANT_MAX,
                                                        num_bits=QUANT_BITS)


def transform(value, quant):
    """The seed's pipeline: fake quantization where ``quant`` (a bool tensor), else identity."""
    return tf.cond(quant, lambda: fake_quant(value), lambda: tf.identity(value))


def make_getter(quant, names, record):
    """A ``custom_getter`` that transforms the variables whose last names are in ``names``.

    Args:
      quant: the bool tensor that switches quantization on.
      names: the names to transform (``'mean/EMA'`` matches ``.../mean/EMA``).
      record: a :class:`Record`; the getter adds the ops and functions it builds.
    """
    def getter(getter, name, *args, **kwargs):
        variable = getter(name, *args, **kwargs)
        if not name.endswith(tuple('/' + n for n in names)):
            return variable
        graph = tf1.get_default_graph()
        start, functions = len(graph.get_operations()), set(_functions(graph))
        value = transform(variable, quant)
        record.getter_calls += 1
        record.getter_ops.update(op.name for op in graph.get_operations()[start:])
        record.getter_functions.update(set(_functions(graph)) - functions)
        return value
    return getter


class Record(object):
    """What the getter and each layer call built."""

    def __init__(self):
        self.getter_calls = 0
        self.getter_ops = set()
        self.getter_functions = set()
        self.layer_ops = []        # per tower: Counter of the layer call's op types


def _functions(graph):
    return dict(graph._functions)  # noqa: SLF001 - the graph's function library (cond branches)


def op_types(graph):
    """Every op type of ``graph``, its function library (``tf.cond`` branches) included."""
    types = {op.type for op in graph.get_operations()}
    for function in _functions(graph).values():
        types.update(node.op for node in function.definition.node_def)
    return types


def _layer_ops(graph, start, functions, record):
    """The op types a layer call built (graph and cond branches), without the getter's ops.

    ``StatelessIf`` counts as ``If``: ``tf.cond`` picks the stateless op when
    its branches read no variable, as they do not when the getter has read it.
    """
    counts = collections.Counter(op.type for op in graph.get_operations()[start:]
                                 if op.name not in record.getter_ops)
    for name in set(_functions(graph)) - functions - record.getter_functions:
        counts.update('branch:' + node.op
                      for node in _functions(graph)[name].definition.node_def)
    counts['If'] += counts.pop('StatelessIf', 0)
    return +counts


def train(apply, mode, sizes, front_end, which='all', getter=True, steps=STEPS,
          context=None):
    """Builds ``apply`` under the getter on ``len(sizes)`` towers; runs ``steps`` SGD steps.

    Args:
      apply: ``apply(x, training, transformed)`` builds the layer on ``x`` in
        the variable scope ``net`` (whose ``custom_getter`` is the getter) and
        returns its output; ``transformed`` is None, except for
        :func:`seed_layer` (``getter=False``), which creates its variables
        without the getter and calls ``transformed(name, variable)`` itself.
      mode: one of :data:`MODES`.
      sizes: per-tower batch sizes (one: no tower context; more:
        ``tower.call_for_each_tower`` on ``/cpu:<i>``).
      front_end: a key of :data:`NAMES`.
      which: a key of :data:`WHICH`.
      getter: install the getter on ``net`` (False: none, and ``transformed``
        is passed to ``apply``; None: neither, the plain layer).
      steps: how many steps to run (0: build the graph only).
      context: ``context(name)`` gives a context manager entered around each
        tower (``''``) and, in place of the name scope ``eval``, around the
        inference call (``'eval'``): tensorpack's ``TrainTowerContext`` for
        its own layer.

    Returns:
      ``(arrays, record, graph)``: arrays keyed ``y/<step>``, ``dx/<step>``,
      ``grad/<step>/<variable>``, ``var/<step>/<variable>`` (after the step),
      ``eval`` (inference, quantization on, after the last step); the
      :class:`Record`.
    """
    names = NAMES[front_end][:WHICH[which]]
    record = Record()
    graph = tf.Graph()
    rng = np.random.RandomState(7)
    data = {k: [(rng.randn(*SHAPE) + 0.5).astype(np.float32) for _ in range(steps)]
            for k in ('x', 'dy')}
    x_eval = (rng.randn(*SHAPE) + 0.5).astype(np.float32)
    starts = np.cumsum([0] + list(sizes))
    with graph.as_default():
        quant = tf1.placeholder(tf.bool, [], 'quant')
        training = {'true': True, 'false': False,
                    'tensor': tf1.placeholder(tf.bool, [], 'training')}[mode]
        custom_getter = make_getter(quant, names, record) if getter else None

        def transformed(name, variable):
            return transform(variable, quant) if name in names else variable

        xs, dys = [], []

        def layer(x, training_value, reuse=None):
            start, functions = len(graph.get_operations()), set(_functions(graph))
            if getter is False:
                reuse = tf1.AUTO_REUSE
            with tf1.variable_scope('net', custom_getter=custom_getter, reuse=reuse):
                y = apply(x, training_value, transformed if getter is False else None)
            return y, _layer_ops(graph, start, functions, record)

        def tower():
            xs.append(tf1.placeholder(tf.float32, [None] + SHAPE[1:], 'x'))
            dys.append(tf1.placeholder(tf.float32, [None] + SHAPE[1:], 'dy'))
            with context('') if context else contextlib.nullcontext():
                y, ops = layer(xs[-1], training)
            record.layer_ops.append(ops)
            return y

        if len(sizes) == 1:
            ys = [tower()]
        else:
            from tower import call_for_each_tower  # noqa: PLC0415 - the N-tower side only
            ys = call_for_each_tower(tower, ['/cpu:%d' % i for i in range(len(sizes))])
        loss = tf.add_n([tf.reduce_sum(y * dy) for y, dy in zip(ys, dys)])
        variables = tf1.trainable_variables()
        grads = tf.gradients(loss, xs + variables)
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train_op = tf1.train.GradientDescentOptimizer(LEARNING_RATE).apply_gradients(
                list(zip(grads[len(xs):], variables)))
        x_eval_in = tf1.placeholder(tf.float32, [None] + SHAPE[1:], 'x_eval')
        with context('eval') if context else tf.name_scope('eval'):
            y_eval = layer(x_eval_in, False, reuse=True)[0]
        arrays = {}
        if not steps:
            return arrays, record, graph
        with tf1.Session(config=tf1.ConfigProto(device_count={'CPU': len(sizes)})) as sess:
            sess.run(tf1.global_variables_initializer())
            everything = tf1.global_variables()
            for step in range(steps):
                feed = {quant: QUANT_FEED[step]}
                if mode == 'tensor':
                    feed[training] = TRAINING_FEED[step]
                for i in range(len(sizes)):
                    rows = slice(starts[i], starts[i + 1])
                    feed[xs[i]] = data['x'][step][rows]
                    feed[dys[i]] = data['dy'][step][rows]
                y_parts, grad_values, _ = sess.run([ys, grads, train_op], feed)
                arrays['y/%d' % step] = np.concatenate(y_parts)
                arrays['dx/%d' % step] = np.concatenate(grad_values[:len(xs)])
                for v, g in zip(variables, grad_values[len(xs):]):
                    arrays['grad/%d/%s' % (step, v.op.name)] = g
                for v, value in zip(everything, sess.run(everything)):
                    arrays['var/%d/%s' % (step, v.op.name)] = value
            arrays['eval'] = sess.run(y_eval, {x_eval_in: x_eval, quant: True})
    return arrays, record, graph


def seed_layer(front_end):
    """The reference: the seed question's layer, with the getter's transform applied by hand.

    One device, the whole batch: ``tf.nn.fused_batch_norm`` in training
    (batch statistics; the moving variance tracks its Bessel-corrected
    variance, as the fused kernels of all three replaced layers do on 4-D
    inputs) and in inference (the transformed moving statistics), with the
    transformed ``gamma`` and ``beta``; the moving averages assign the
    variables themselves. Named as ``front_end`` names its variables.

    Returns:
      An ``apply`` for :func:`train` with ``getter=False``.
    """
    gamma_name, beta_name, mean_name, variance_name = NAMES[front_end]

    def apply(x, training, transformed):
        channels = x.shape[-1]
        with tf1.variable_scope('bn'):
            gamma = tf1.get_variable(gamma_name, [channels], initializer=tf1.ones_initializer())
            beta = tf1.get_variable(beta_name, [channels], initializer=tf1.zeros_initializer())
            mean = tf1.get_variable(mean_name, [channels], initializer=tf1.zeros_initializer(),
                                    trainable=False)
            variance = tf1.get_variable(variance_name, [channels],
                                        initializer=tf1.ones_initializer(), trainable=False)
        q_gamma, q_beta, q_mean, q_variance = [
            transformed(n, v) for n, v in zip(NAMES[front_end], (gamma, beta, mean, variance))]
        y_train, batch_mean, batch_variance = tf1.nn.fused_batch_norm(
            x, q_gamma, q_beta, epsilon=EPSILON, is_training=True)
        y_infer, _, _ = tf1.nn.fused_batch_norm(x, q_gamma, q_beta, q_mean, q_variance,
                                                epsilon=EPSILON, is_training=False)
        if training is False:
            return y_infer
        active = tf.convert_to_tensor(training)
        for variable, value in ((mean, batch_mean), (variance, batch_variance)):
            delta = tf.where(active, (variable - value) * (1.0 - MOMENTUM),
                             tf.zeros_like(value))
            tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign_sub(variable, delta))
        if training is True:
            return y_train
        return tf.where(active, y_train, y_infer)
    return apply


def legacy_apply(front_end):
    """tf-slim's, tf.layers' or tensorpack's own layer, as the library's front-end is called.

    For the legacy-Keras subprocess (tf-slim, tf.layers as tf-keras' legacy
    layer, tensorpack). Returns ``(apply, context)`` for :func:`train`.
    """
    if front_end == 'slim':
        import tf_slim as slim  # noqa: PLC0415

        def apply(x, training, _):
            return slim.batch_norm(x, decay=MOMENTUM, epsilon=EPSILON, scale=True,
                                   is_training=training, scope='bn')
        return apply, None
    if front_end == 'layers':
        def apply(x, training, _):
            return tf1.layers.batch_normalization(x, momentum=MOMENTUM, epsilon=EPSILON,
                                                  training=training, name='bn')
        return apply, None
    from tensorpack import BatchNorm  # noqa: PLC0415
    from tensorpack.tfutils.tower import TrainTowerContext  # noqa: PLC0415

    def apply(x, training, _):
        return BatchNorm('bn', x, momentum=MOMENTUM, epsilon=EPSILON, training=training)
    return apply, TrainTowerContext


#: The configurations the replaced layers support, run in the legacy subprocess:
#: (front end, mode, which). All four variables transformed only in inference
#: (training False: no moving-average update); gamma and beta in training.
#: tensorpack takes ``bool(training)``, so no bool tensor there.
LEGACY_CASES = [(fe, 'false', 'all') for fe in ('slim', 'layers', 'tensorpack')] + \
    [(fe, mode, 'affine') for fe in ('slim', 'layers') for mode in ('true', 'tensor')] + \
    [('tensorpack', 'true', 'affine')]


def legacy_key(front_end, mode, which):
    return 'getter:%s:%s:%s' % (front_end, mode, which)


#: Where they do not: a transformed moving statistic in training.
UNSUPPORTED_CASES = [(fe, mode, 'all') for fe in ('slim', 'layers', 'tensorpack')
                     for mode in ('true', 'tensor') if (fe, mode) != ('tensorpack', 'tensor')]


def run_legacy_cases():
    """Every :data:`LEGACY_CASES` with the replaced layer itself on one device.

    Returns:
      ``(results, errors)``: ``{legacy_key(...): arrays}`` for the cases that
      ran, ``{legacy_key(...): message}`` for the cases (of
      :data:`LEGACY_CASES` and :data:`UNSUPPORTED_CASES`) that failed.
    """
    results, errors = {}, {}
    for front_end, mode, which in LEGACY_CASES + UNSUPPORTED_CASES:
        apply, context = legacy_apply(front_end)
        key = legacy_key(front_end, mode, which)
        try:
            results[key] = train(apply, mode, [SHAPE[0]], front_end, which, context=context,
                                 steps=STEPS if (front_end, mode, which) in LEGACY_CASES
                                 else 0)[0]
        except Exception as e:  # noqa: BLE001 - reported by the case's test
            errors[key] = '%s: %s' % (type(e).__name__, str(e)[:2000])
    return results, errors

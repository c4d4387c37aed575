"""One training run of a ``tf_keras.applications`` model, on one device or on towers.

The Keras model tests run the same function on both sides: in a subprocess
with tf-keras' own ``BatchNormalization`` on one device with the whole batch
(see ``legacy_reference.py``), and in the test process after
``tf1_syncbn.keras.patch_keras()`` on towers built as users build them:

* ``'towers'``: a ``tower_<i>`` name-scope loop on ``/cpu:<i>``, the model
  built once before the loop and called once per tower (as
  ``multi_gpu_model`` did), the towers' losses summed into one optimizer,
  every tower's ``model.get_updates_for(x_i)`` as control dependencies of
  the train op;
* ``'mirrored'``: ``tf.compat.v1.distribute.MirroredStrategy``, the model
  built in ``strategy.scope()``, ``strategy.run`` with the optimizer inside
  the replica function (``strategy_case.make_strategy``).

It never imports ``tf1_syncbn``. The model is ``MobileNet(alpha=0.25)`` on
32x32 images (27 batch norms, the fused NHWC path; ``MODEL`` names another
``tf_keras.applications`` model for a manual run, e.g. ``ResNet50``), its
weights set from a seeded generator, trained by plain SGD on the softmax
cross-entropy summed over the global batch divided by its size.
"""

import contextlib
import os

import numpy as np
import tensorflow as tf

from strategy_case import make_strategy

tf1 = tf.compat.v1

MODEL = os.environ.get('TF1_SYNCBN_TEST_KERAS_MODEL', 'MobileNet')
INPUT = tuple(int(d) for d in os.environ.get('TF1_SYNCBN_TEST_KERAS_INPUT', '32,32,3').split(','))
CLASSES = 4
STEPS = 3
LEARNING_RATE = 1e-5


def keras2():
    """The Keras 2 that ``tf.keras`` is (Keras 2.15 on TensorFlow 2.15), else tf-keras."""
    import importlib.metadata  # noqa: PLC0415
    if os.environ.get('TF_USE_LEGACY_KERAS') not in ('1', 'true', 'True') and \
            importlib.metadata.version('keras').startswith('2.'):
        import keras  # noqa: PLC0415
        return keras
    import tf_keras  # noqa: PLC0415 - the reference side imports it after its shim
    return tf_keras


def build_model():
    """The application, as its users build it (with whatever ``tf_keras.layers`` holds)."""
    tf_keras = keras2()
    kwargs = dict(weights=None, input_shape=INPUT, classes=CLASSES, classifier_activation=None)
    if MODEL == 'MobileNet':
        kwargs.update(alpha=0.25, dropout=0.0)
    return getattr(tf_keras.applications, MODEL)(**kwargs)


def initial_values(model):
    """Seeded values of every weight, by position (moving variances and gammas near 1).

    The kernels that feed a batch norm are of order 1: the loss does not
    depend on their scale, its gradient is inversely proportional to it, so
    kernels of the usual (Glorot) scale make SGD steps that change them by
    their own size, and a rounding difference in one step a large one in
    the next. The classifier's kernel (the last one) keeps the Glorot scale.
    """
    rng = np.random.RandomState(3)
    kernels = [w for w in model.weights if w.name.split(':')[0].endswith('kernel')]
    values = []
    for weight in model.weights:
        shape = weight.shape.as_list()
        name = weight.name.split(':')[0]
        if name.endswith(('gamma', 'moving_variance')):
            values.append(rng.uniform(0.8, 1.2, shape))
        elif name.endswith(('beta', 'moving_mean', 'bias')):
            values.append(rng.uniform(-0.1, 0.1, shape))
        elif weight is kernels[-1]:
            values.append(rng.uniform(-1, 1, shape) * np.sqrt(6.0 / (shape[-2] + shape[-1])))
        else:
            values.append(rng.uniform(-1, 1, shape))
    return [v.astype(np.float32) for v in values]


def case_data(total, seed=11):
    rng = np.random.RandomState(seed)
    data = {}
    for step in range(STEPS):
        data['x/%d' % step] = (rng.randn(total, *INPUT) * 2 + 1).astype(np.float32)
        data['y/%d' % step] = rng.randint(0, CLASSES, total).astype(np.int32)
    return data


def _loss_share(model, x, y, total):
    logits = model(x, training=True)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    return tf.reduce_sum(losses) / float(total)


def train(sizes, mode='one', inspect=None):
    """Trains ``STEPS`` SGD steps; returns every number worth comparing.

    Args:
      sizes: rows of the global batch per tower (one entry: one device).
      mode: ``'one'``, ``'towers'`` or ``'mirrored'`` (see the module).
      inspect: called as ``inspect(graph, train_op, model)`` once the graph is
        built (for the audit).

    Returns:
      ``{'loss/<step>': ..., 'grad/<name>': ..., 'var/<name>': ..., 'delta/<name>': ...}``:
      the loss of each step, the first step's gradient of every trainable
      weight (summed over the towers), every weight after training and its
      change; and ``'copies/<name>'`` (one value per replica) under the
      strategy.
    """
    total = int(sum(sizes))
    towers = len(sizes)
    data = case_data(total)
    starts = np.cumsum([0] + list(sizes))
    graph = tf.Graph()
    with graph.as_default():
        strategy = make_strategy('mirrored', towers) if mode == 'mirrored' else None
        xs = [tf1.placeholder(tf.float32, (None,) + INPUT, 'x%d' % i) for i in range(towers)]
        ys = [tf1.placeholder(tf.int32, (None,), 'y%d' % i) for i in range(towers)]
        opt = tf1.train.GradientDescentOptimizer(LEARNING_RATE)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = build_model()
        if mode == 'mirrored':
            def replica_fn():
                i = int(tf.get_static_value(
                    tf.distribute.get_replica_context().replica_id_in_sync_group))
                share = _loss_share(model, xs[i], ys[i], total)
                pairs = opt.compute_gradients(share, var_list=model.trainable_weights)
                with tf.control_dependencies(model.get_updates_for(xs[i])):
                    return share, opt.apply_gradients(pairs), [g for g, _ in pairs]

            with strategy.scope():
                loss, step, grads = strategy.run(replica_fn)
                losses = list(strategy.experimental_local_results(loss))
                train_op = tf.group(*strategy.experimental_local_results(step))
                grads = [list(strategy.experimental_local_results(g)) for g in grads]
        else:
            losses = []
            for i in range(towers):
                with tf.device('/cpu:%d' % i) if mode == 'towers' else contextlib.nullcontext(), \
                        tf.name_scope('tower_%d' % i) if mode == 'towers' else \
                        contextlib.nullcontext():
                    losses.append(_loss_share(model, xs[i], ys[i], total))
            pairs = opt.compute_gradients(tf.add_n(losses), var_list=model.trainable_weights)
            grads = [[g] for g, _ in pairs]
            updates = [u for x in xs for u in model.get_updates_for(x)]
            with tf.control_dependencies(updates):
                train_op = opt.apply_gradients(pairs)
        if inspect is not None:
            inspect(graph, train_op, model)
        initial = initial_values(model)
        with strategy.scope() if strategy else contextlib.nullcontext():
            assign = [w.assign(v) for w, v in zip(model.weights, initial)]
        variables = [w for w in model.weights]
        config = tf1.ConfigProto(device_count={'CPU': max(towers, 1)})
        arrays = {}
        with tf1.Session(config=config) as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(assign)
            for s in range(STEPS):
                feed = {}
                for i in range(towers):
                    rows = slice(starts[i], starts[i + 1])
                    feed[xs[i]] = data['x/%d' % s][rows]
                    feed[ys[i]] = data['y/%d' % s][rows]
                values, grad_values, _ = sess.run([losses, grads if s == 0 else [], train_op], feed)
                arrays['loss/%d' % s] = np.float64(sum(values))
                for w, parts in zip(model.trainable_weights, grad_values):
                    arrays['grad/' + w.name.split(':')[0]] = np.sum(parts, axis=0)
            copies = [list(strategy.experimental_local_results(v)) if strategy else []
                      for v in variables]
            values, copy_values = sess.run([variables, copies])  # one run: one executor
            for v, value, copied, start in zip(variables, values, copy_values, initial):
                arrays['var/' + v.name.split(':')[0]] = value
                arrays['delta/' + v.name.split(':')[0]] = value.astype(np.float64) - start
                if strategy is not None:
                    arrays['copies/' + v.name.split(':')[0]] = np.stack(copied)
    return arrays

"""One training run of a small model, on one device or under a tf.distribute strategy.

The strategy tests run the same function on both sides: in a subprocess with
tf-slim / tensorpack themselves on one device with the whole batch (see
``legacy_reference.py``), and in the test process with this library's layer
under ``MirroredStrategy``, ``CentralStorageStrategy``, ... with the batch
split over the replicas. It never imports ``tf1_syncbn``: the layer comes in
as a function, so the reference side is independent of the code under test.

The model: ``batch norm -> relu -> mean over space -> dense 4 -> relu ->
dense 3`` (no convolution: with oneDNN, TensorFlow's Conv2D returns an empty
batch with the channels of its input, a TensorFlow bug an empty replica would
hit), trained by plain SGD on ``sum((logits - y)^2) / B`` where ``B`` is
the global batch size, with the ``UPDATE_OPS`` as control dependencies of the
train op. Under a strategy each replica minimizes its own share of that sum
(``strategy.run``, the optimizer inside the replica function), and the
strategy sums the replicas' gradients, as TensorFlow documents; with
``mean_over_replicas`` it minimizes ``mean((logits_i - y_i)^2) / N`` instead
(even batches), the scaling TensorFlow's guides use.
"""

import contextlib

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

STEPS = 3
LEARNING_RATE = 0.2
SHAPE = (4, 4, 3)


def case_data(total, seed=7, loc=1.0, scale=2.0):
    rng = np.random.RandomState(seed)
    data = {}
    for step in range(STEPS):
        data['x/%d' % step] = (rng.randn(total, *SHAPE) * scale + loc).astype(np.float32)
        data['y/%d' % step] = rng.randn(total, 3).astype(np.float32)
    return data


def make_strategy(kind, replicas):
    """A strategy of ``kind`` over ``replicas`` virtual CPUs (None: plain graph)."""
    devices = ['/cpu:%d' % i for i in range(replicas)]
    if kind == 'none':
        return None
    if kind == 'default':
        return tf.distribute.get_strategy()
    if kind == 'one_device':
        return tf1.distribute.OneDeviceStrategy(devices[0])
    if kind == 'mirrored':
        return tf1.distribute.MirroredStrategy(devices)
    if kind == 'central':
        return tf1.distribute.experimental.CentralStorageStrategy(devices,
                                                                  parameter_device='/cpu:0')
    raise ValueError('unknown strategy kind %r' % kind)


def model(layer, x, y, total, scope='net'):
    """The model's loss share of ``x`` (rows of the global batch of ``total``)."""
    import tf_slim as slim  # noqa: PLC0415 - legacy Keras side imports it after its shim
    with tf1.variable_scope(scope, reuse=tf1.AUTO_REUSE):
        net = tf.reduce_mean(tf.nn.relu(layer(x)), [1, 2])
        net = slim.fully_connected(net, 4, activation_fn=tf.nn.relu, scope='hidden',
                                   weights_initializer=tf1.glorot_uniform_initializer(seed=1))
        logits = slim.fully_connected(net, 3, activation_fn=None,
                                      scope='logits',
                                      weights_initializer=tf1.glorot_uniform_initializer(seed=2))
    return tf.reduce_sum(tf.square(logits - y)) / float(total)


def train(layer, sizes, kind='none', mean_over_replicas=False, checkpoint_in=None,
          checkpoint_out=None, tower=None):
    """Trains ``STEPS`` SGD steps; returns every number worth comparing.

    Args:
      layer: ``layer(x) -> y``, the batch norm under test.
      sizes: rows of the global batch per replica (one entry for one device).
      kind: see :func:`make_strategy`.
      mean_over_replicas: the loss is ``mean / N`` per replica (even batches).
      checkpoint_in: restore this checkpoint instead of initializing.
      checkpoint_out: save a checkpoint here after training.
      tower: a callable returning a context manager to build the model in
        (tensorpack's own layers need tensorpack's ``TowerContext``).

    Returns:
      ``{'loss/<step>': ..., 'var/<name>': ..., 'copies/<name>': [per replica]}``
      (copies only under a strategy).
    """
    total = int(sum(sizes))
    data = case_data(total)
    starts = np.cumsum([0] + list(sizes))
    graph = tf.Graph()
    with graph.as_default():
        strategy = make_strategy(kind, len(sizes))
        xs = [tf1.placeholder(tf.float32, (None,) + SHAPE, 'x%d' % i) for i in range(len(sizes))]
        ys = [tf1.placeholder(tf.float32, (None, 3), 'y%d' % i) for i in range(len(sizes))]
        opt = tf1.train.GradientDescentOptimizer(LEARNING_RATE)

        def replica_fn():
            i = 0
            if strategy is not None:
                context = tf.distribute.get_replica_context()
                i = int(tf.get_static_value(context.replica_id_in_sync_group))
            with tower() if tower is not None else contextlib.nullcontext():
                share = model(layer, xs[i], ys[i], total)   # this replica's part of the loss
            loss = share
            if mean_over_replicas:
                loss = share * total / float(sizes[i]) / float(len(sizes))
            with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                step = opt.minimize(loss)
            return share, step

        if strategy is None:
            loss, step = replica_fn()
            losses, steps = [loss], [step]
        else:
            with strategy.scope():
                loss, step = strategy.run(replica_fn)
                losses = list(strategy.experimental_local_results(loss))
                steps = list(strategy.experimental_local_results(step))
        variables = tf1.global_variables()
        saver = tf1.train.Saver(variables)
        arrays = {}
        config = tf1.ConfigProto(device_count={'CPU': max(len(sizes), 1)})
        with tf1.Session(config=config) as sess:
            if checkpoint_in:
                saver.restore(sess, checkpoint_in)
            else:
                sess.run(tf1.global_variables_initializer())
            for s in range(STEPS):
                feed = {}
                for i in range(len(sizes)):
                    rows = slice(starts[i], starts[i + 1])
                    feed[xs[i]] = data['x/%d' % s][rows]
                    feed[ys[i]] = data['y/%d' % s][rows]
                values = sess.run(losses + steps, feed)
                arrays['loss/%d' % s] = np.float64(sum(values[:len(losses)]))
            for v in variables:
                arrays['var/' + v.op.name] = sess.run(v)
                if strategy is not None and hasattr(v, 'values'):
                    arrays['copies/' + v.op.name] = np.stack(
                        sess.run(list(strategy.experimental_local_results(v))))
            if checkpoint_out:
                saver.save(sess, checkpoint_out)
    return arrays

"""Training graphs built the ways users build them, for the audit's tests.

Imported by ``tests/audit/test_audit.py`` (this library's layers, in the test
process) and by ``tests/support/for_audit/audit_legacy_graphs.py`` (tf-slim's, ``tf.layers``',
Keras' and tensorpack's own layers, in a subprocess with legacy Keras). The
batch norm comes in as a function, so the same harness builds either.

Each builder returns ``(graph, step)``: the graph and what one training step
runs (the train op, or a list of ops).
"""

import contextlib

import tensorflow as tf
import tf_slim as slim

from tower import average_gradients, call_for_each_tower, get_current_tower_context

tf1 = tf.compat.v1
SHAPE = (6, 6, 3)
CLASSES = 4


def small_net(images, bn, bn_params=None):
    """conv1 (batch norm) -> conv2 (batch norm) -> mean -> logits."""
    with slim.arg_scope([slim.conv2d], normalizer_fn=bn, normalizer_params=bn_params):
        net = slim.conv2d(images, 8, [3, 3], scope='conv1')
        net = slim.conv2d(net, 8, [3, 3], scope='conv2')
    return slim.fully_connected(tf.reduce_mean(net, [1, 2]), CLASSES, activation_fn=None,
                                scope='logits')


def siamese_net(images, bn, bn_params=None):
    """One batch-norm layer applied to two views of the batch (a Siamese network).

    The layer is called twice in one step, its variables reused; each call
    updates the moving statistics once, as on one device.
    """
    params = dict(bn_params or {})
    views = [images, tf.image.flip_left_right(images)]
    features = []
    for k, view in enumerate(views):
        net = slim.conv2d(view, 8, [3, 3], activation_fn=None, scope='conv', reuse=k > 0)
        features.append(tf.reduce_mean(bn(net, scope='bn', reuse=k > 0, **params), [1, 2]))
    return slim.fully_connected(tf.concat(features, 1), CLASSES, activation_fn=None,
                                scope='logits')


def _loss(logits, labels):
    return tf1.losses.sparse_softmax_cross_entropy(labels, logits, loss_collection=None)


def _params(bn_params):
    """The batch-norm parameters: a dict, or a function building them in the graph."""
    return bn_params() if callable(bn_params) else dict(bn_params or {})


def _inputs(towers):
    images = tf1.placeholder(tf.float32, (None,) + SHAPE, name='images')
    labels = tf1.placeholder(tf.int32, [None], name='labels')
    return tf.split(images, towers), tf.split(labels, towers)


def _keep(keep, towers, scope_format):
    """The update ops a harness keeps: the first tower's, the last one's, or all."""
    if keep == 'first':
        return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope_format % 0)
    if keep == 'last':
        return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope_format % (towers - 1))
    if keep == 'none':
        return []
    return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)


def _tower_loop(bn, towers, bn_params, net, tower_scope, keep='all', scope_format=None,
                clone_shares=False):
    """The hand-written tower loop of the harnesses below: one copy of ``net`` per tower.

    Args:
      tower_scope: ``tower_scope(i)``: the context tower ``i`` is built in
        (its device, name and variable scopes, the reuse of the variables).
      keep, scope_format: the update ops the train op runs with (:func:`_keep`).
      clone_shares: model_deploy's way: each clone's loss divided by
        ``towers`` and the gradients summed; else cifar10's, the towers'
        gradients averaged.
    """
    graph = tf.Graph()
    with graph.as_default():
        images, labels = _inputs(towers)
        opt = tf1.train.GradientDescentOptimizer(0.1)
        tower_grads, params = [], _params(bn_params)
        for i in range(towers):
            with tower_scope(i):
                loss = _loss(net(images[i], bn, params), labels[i])
                tower_grads.append(opt.compute_gradients(loss / towers if clone_shares else loss))
        if clone_shares:
            grads = [(tf.add_n([g[k][0] for g in tower_grads]), tower_grads[0][k][1])
                     for k in range(len(tower_grads[0]))]
        else:
            grads = average_gradients(tower_grads)
        with tf.control_dependencies(_keep(keep, towers, scope_format)):
            train_op = opt.apply_gradients(grads)
    return graph, train_op


def classic_towers(bn, towers=2, keep='last', bn_params=None, net=small_net):
    """cifar10_multi_gpu_train.py: ``tower_%d`` scopes, reuse_variables(), averaged gradients."""
    @contextlib.contextmanager
    def tower_scope(i):
        with tf.device('/cpu:%d' % i), tf1.name_scope('tower_%d' % i):
            yield
            tf1.get_variable_scope().reuse_variables()

    return _tower_loop(bn, towers, bn_params, net, tower_scope, keep, 'tower_%d')


def device_loop(bn, towers=2, scope=None, bn_params=None, net=small_net):
    """A hand-written loop without tower scopes: ``tf.device`` per copy, variables reused.

    ``for i: with tf.device('/cpu:%d' % i), tf.variable_scope('', reuse=i > 0):``
    or, with ``scope`` (``'gpu_%d'``), a name scope that no tower convention
    knows. Every tower's ``UPDATE_OPS`` run with the train op.
    """
    @contextlib.contextmanager
    def tower_scope(i):
        with tf.device('/cpu:%d' % i):
            if scope is None:
                with tf1.variable_scope('', reuse=i > 0):
                    yield
            else:
                with tf1.name_scope(scope % i), \
                        tf1.variable_scope(tf1.get_variable_scope(), reuse=i > 0):
                    yield

    return _tower_loop(bn, towers, bn_params, net, tower_scope)


def model_deploy_clones(bn, towers=2, keep='first', bn_params=None, clone_scope=None,
                        net=small_net):
    """tf-slim's model_deploy: ``clone_%d`` scopes, reuse for clones > 0, summed gradients.

    Args:
      clone_scope: a context manager factory entered around the network in
        each clone (``clone_fn``'s body), e.g. ``sync_arg_scope``.
    """
    def clone_fn(*args):
        with clone_scope() if clone_scope else contextlib.nullcontext():
            return net(*args)

    @contextlib.contextmanager
    def tower_scope(i):
        with tf1.name_scope('clone_%d' % i), tf.device('/cpu:%d' % i), \
                tf1.variable_scope(tf1.get_variable_scope(), reuse=True if i else None):
            yield

    return _tower_loop(bn, towers, bn_params, clone_fn, tower_scope, keep, 'clone_%d',
                       clone_shares=True)


def tower_contexts(bn, towers=2, bn_params=None, wire_updates=True, net=small_net):
    """``tower.call_for_each_tower``, the library's own harness (the README's Quick start)."""
    graph = tf.Graph()
    with graph.as_default():
        images, labels = _inputs(towers)
        opt = tf1.train.MomentumOptimizer(0.1, 0.9)
        params = _params(bn_params)

        def tower_fn():
            i = get_current_tower_context().index
            return opt.compute_gradients(_loss(net(images[i], bn, params), labels[i]))

        grads = average_gradients(call_for_each_tower(
            tower_fn, ['/cpu:%d' % i for i in range(towers)]))
        updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS) if wire_updates else []
        with tf.control_dependencies(updates):
            train_op = opt.apply_gradients(grads)
    return graph, train_op


def single_tower(bn, bn_params=None, wire_updates=True, net=small_net):
    """One tower, no tower scope: ``minimize`` under the ``UPDATE_OPS`` (or not)."""
    graph = tf.Graph()
    with graph.as_default():
        images, labels = _inputs(1)
        loss = _loss(net(images[0], bn, _params(bn_params)), labels[0])
        updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS) if wire_updates else []
        with tf.control_dependencies(updates):
            train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return graph, train_op


def mirrored_strategy(layer, replicas=2):
    """``MirroredStrategy.run`` in a TF1 graph, UPDATE_OPS as the train op's dependencies.

    ``layer(x)`` is built in variable scope ``net`` of every replica.
    """
    graph = tf.Graph()
    with graph.as_default():
        strategy = tf1.distribute.MirroredStrategy(['/cpu:%d' % i for i in range(replicas)])
        xs = [tf1.placeholder(tf.float32, (None,) + SHAPE) for _ in range(replicas)]
        opt = tf1.train.GradientDescentOptimizer(0.1)

        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            with tf1.variable_scope('net', reuse=tf1.AUTO_REUSE):
                y = layer(xs[int(tf.get_static_value(replica))])
            loss = tf.reduce_sum(tf.square(y))
            with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                return opt.minimize(loss)

        with strategy.scope():
            step = strategy.experimental_local_results(strategy.run(replica_fn))
    return graph, list(step)


def export(graph, step, path):
    """Writes ``graph`` as a MetaGraphDef with ``step`` in its ``train_op`` collection.

    Returns:
      The op names of ``step``.
    """
    steps = step if isinstance(step, (list, tuple)) else [step]
    names = [getattr(s, 'op', s).name for s in steps]
    with graph.as_default():
        for s in steps:
            if getattr(s, 'op', s) not in graph.get_collection(tf1.GraphKeys.TRAIN_OP):
                tf1.add_to_collection(tf1.GraphKeys.TRAIN_OP, getattr(s, 'op', s))
        tf1.train.export_meta_graph(filename=path, graph=graph)
    return names

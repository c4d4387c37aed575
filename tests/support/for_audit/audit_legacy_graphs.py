"""Training graphs with tf-slim's, tf.layers', Keras' and tensorpack's own batch norm, exported.

Run by ``tests/audit/test_audit.py`` through ``legacy_reference.run_reference`` (a
fresh interpreter with legacy Keras, which these layers need on TF 2.21)::

    python audit_legacy_graphs.py OUT_DIR [CASE ...]

Builds each graph of :data:`CASES` (or only the cases named) the way its
users build it (nothing is trained) and writes ``OUT_DIR/<case>.meta`` (``export_meta_graph``, the
train op in its ``train_op`` collection) and ``OUT_DIR/cases.json``
(``{case: [op names one training step runs]}``, or ``{"error": ...}``).
"""

import json
import os
import sys
import traceback

import tensorflow as tf
import tf_slim as slim
from tf_slim.nets import resnet_v1

import audit_cases
import tf1_syncbn
from tf1_syncbn import sync_arg_scope

import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)

tf_behavior.apply()
tf1 = tf.compat.v1
OUT = sys.argv[1]
BLOCKS = [resnet_v1.resnet_v1_block('block1', base_depth=4, num_units=1, stride=2),
          resnet_v1.resnet_v1_block('block2', base_depth=8, num_units=1, stride=1)]


def resnet(missed_head):
    """A tf_slim.nets ResNet under sync_arg_scope; with ``missed_head`` a head the scope missed."""
    def net(images, bn, bn_params):
        del bn, bn_params
        with slim.arg_scope(resnet_v1.resnet_arg_scope()):
            with sync_arg_scope():
                features, _ = resnet_v1.resnet_v1(images, BLOCKS, global_pool=True,
                                                  scope='resnet')
            if missed_head:
                # Added after the sync_arg_scope block: resnet_arg_scope's slim.batch_norm.
                features = slim.conv2d(features, 8, [1, 1], scope='head')
        return slim.fully_connected(tf.reshape(features, [-1, features.shape[-1]]),
                                    audit_cases.CLASSES, activation_fn=None, scope='logits')
    return net


def slim_net_by_name(images, bn, bn_params):
    """The small net as slim nets are written: ``slim.batch_norm`` looked up when built."""
    del bn
    return audit_cases.small_net(images, slim.batch_norm, bn_params)


def keras_single(wired):
    graph = tf.Graph()
    with graph.as_default():
        images = tf1.placeholder(tf.float32, (None,) + audit_cases.SHAPE)
        layer = tf.keras.layers.BatchNormalization(name='bn')
        y = layer(slim.conv2d(images, 8, [3, 3], scope='conv1'), training=True)
        loss = tf.reduce_mean(tf.square(y))
        # Keras layers keep their updates in layer.updates, not in UPDATE_OPS.
        with tf.control_dependencies(layer.updates if wired else []):
            train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return graph, train_op


def keras_siamese():
    """One Keras layer object applied to two inputs, its updates (two per variable) wired."""
    graph = tf.Graph()
    with graph.as_default():
        images = tf1.placeholder(tf.float32, (None,) + audit_cases.SHAPE)
        layer = tf.keras.layers.BatchNormalization(name='bn')
        features = slim.conv2d(images, 8, [3, 3], scope='conv1')
        y = layer(features, training=True) * layer(features * 2.0, training=True)
        loss = tf.reduce_mean(tf.square(y))
        with tf.control_dependencies(layer.updates):
            train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return graph, train_op


def _towers_on_virtual_cpus():
    """tensorpack's trainers put tower k on '/gpu:k': on '/cpu:k' here (no GPU)."""
    from tensorpack_devices import towers_on_virtual_cpus  # noqa: PLC0415
    towers_on_virtual_cpus()


def tensorpack_trainer(trainer_name, ours):
    """tensorpack's own trainer builds the graph (setup_graph, as launch_train_with_config)."""
    import numpy as np
    import tensorpack as tp
    from tensorpack.train.interface import apply_default_prefetch

    def bn(x):
        if ours:
            return tf1_syncbn.BatchNorm('bn', x, sync_statistics='collective')
        return tp.BatchNorm('bn', x)

    class Model(tp.ModelDesc):
        def inputs(self):
            return [tf.TensorSpec((None,) + audit_cases.SHAPE, tf.float32, 'input'),
                    tf.TensorSpec((None,), tf.int32, 'label')]

        def build_graph(self, image, label):
            x = tf.nn.relu(bn(tp.Conv2D('conv', image, 8, 3, use_bias=False)))
            logits = tp.FullyConnected('fc', tp.GlobalAvgPooling('gap', x), audit_cases.CLASSES)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=label, logits=logits), name='cost')

        def optimizer(self):
            return tf1.train.GradientDescentOptimizer(0.1)

    rows = [[np.zeros(audit_cases.SHAPE, np.float32), 0]] * 4
    trainer = {'ps': lambda: tp.SyncMultiGPUTrainerParameterServer(2),
               'replicated': lambda: tp.SyncMultiGPUTrainerReplicated(2, mode='cpu')
               }[trainer_name]()
    graph = tf.Graph()
    with graph.as_default():
        model = Model()
        source = apply_default_prefetch(tp.BatchData(tp.DataFromList(rows, shuffle=False), 2),
                                        trainer)
        trainer.setup_graph(model.get_input_signature(), source, model.build_graph,
                            model.get_optimizer)
        # tensorpack's RunUpdateOps callback fetches UPDATE_OPS with the train op.
        step = [trainer.train_op] + tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    return graph, step


CASES = {
    'slim_tower_last': lambda: audit_cases.classic_towers(slim.batch_norm, keep='last'),
    'slim_tower_all': lambda: audit_cases.classic_towers(slim.batch_norm, keep='all'),
    'slim_tower_is_training_tensor': lambda: audit_cases.classic_towers(
        slim.batch_norm, bn_params=lambda: {'is_training': tf1.placeholder(tf.bool, [])}),
    'slim_tower_not_fused': lambda: audit_cases.classic_towers(
        slim.batch_norm, bn_params={'fused': False}),
    'slim_clone_first': lambda: audit_cases.model_deploy_clones(slim.batch_norm),
    # Hand-written device loops without tower scopes: the audit sees the devices.
    'slim_device_loop': lambda: audit_cases.device_loop(slim.batch_norm),
    'tf_layers_gpu_scope_loop': lambda: audit_cases.device_loop(
        lambda x, **_: tf1.layers.batch_normalization(x, training=True), scope='gpu_%d'),
    # clone_fn wraps the net in sync_arg_scope; the net names slim.batch_norm inside it.
    'slim_clone_sync_arg_scope': lambda: audit_cases.model_deploy_clones(
        None, clone_scope=lambda: sync_arg_scope(num_dev=2), net=slim_net_by_name),
    # The net got slim.batch_norm as a value before the block: sync_arg_scope cannot see it.
    'slim_clone_bound_before_sync_arg_scope': lambda: audit_cases.model_deploy_clones(
        slim.batch_norm, clone_scope=lambda: sync_arg_scope(num_dev=2)),
    'tf_layers_single_tower': lambda: audit_cases.single_tower(
        lambda x: tf1.layers.batch_normalization(x, training=True)),
    'tf_layers_mirrored_strategy': lambda: audit_cases.mirrored_strategy(
        lambda x: tf1.layers.batch_normalization(x, training=True, name='bn')),
    'slim_siamese_single_tower': lambda: audit_cases.single_tower(
        slim.batch_norm, net=audit_cases.siamese_net),
    'slim_siamese_tower_all': lambda: audit_cases.classic_towers(
        slim.batch_norm, keep='all', net=audit_cases.siamese_net),
    'keras_siamese_single_tower': keras_siamese,
    'keras_single_tower_unwired': lambda: keras_single(wired=False),
    'keras_single_tower_wired': lambda: keras_single(wired=True),
    'resnet_sync_arg_scope': lambda: audit_cases.tower_contexts(None, net=resnet(False)),
    'resnet_missed_head': lambda: audit_cases.tower_contexts(None, net=resnet(True)),
    'tensorpack_ps_own_bn': lambda: tensorpack_trainer('ps', ours=False),
    'tensorpack_ps_ours': lambda: tensorpack_trainer('ps', ours=True),
    'tensorpack_replicated_ours': lambda: tensorpack_trainer('replicated', ours=True),
}


def main():
    _towers_on_virtual_cpus()
    results = {}
    names = sys.argv[2:] or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit('audit_legacy_graphs: no such cases: %s' % ', '.join(unknown))
    for name in names:
        build = CASES[name]
        try:
            graph, step = build()
            results[name] = audit_cases.export(graph, step, os.path.join(OUT, name + '.meta'))
        except Exception:  # noqa: BLE001 - reported by that case's test
            results[name] = {'error': traceback.format_exc()[-3000:]}
    with open(os.path.join(OUT, 'cases.json'), 'w') as f:
        json.dump(results, f)
    print('RESULT', os.path.join(OUT, 'cases.json'))


if __name__ == '__main__':
    main()

"""One synchronized 2-tower training run, with or without TensorFlow's graph rewrites.

Run by ``test_graph_rewrites.py`` in the test process (no rewrite, and the
CPU emulation of the float16 rewrite) and as a script in fresh processes
(XLA auto-clustering switched on by ``TF_XLA_FLAGS`` or the session config,
the mixed-precision rewrite by ``TF_ENABLE_AUTO_MIXED_PRECISION_GRAPH_REWRITE``
and ``tf.compat.v1.mixed_precision.enable_mixed_precision_graph_rewrite``).

The model covers the library's paths: a convolution, ``sync_batch_norm``
(the fused synchronized op), ``tf1_syncbn.layers.batch_normalization`` with
``fused=False`` (differentiable moments and all-reduce), a hand-written
batch norm on ``tf1_syncbn.moments``, a dense layer; towers of 3 and 5
examples on ``/cpu:0`` and ``/cpu:1`` (``tower_<i>`` scopes, ``num_dev=2``),
two SGD steps with the ``UPDATE_OPS`` of tower 0.
"""

import json
import sys

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1
SIZES = (3, 5)
STEPS = 2


def _hand_written(x):
    with tf1.variable_scope('hand', reuse=tf1.AUTO_REUSE):
        channels = x.shape[-1]
        gamma = tf1.get_variable('gamma', [channels], initializer=tf1.ones_initializer())
        beta = tf1.get_variable('beta', [channels], initializer=tf1.zeros_initializer())
        moving_mean = tf1.get_variable('moving_mean', [channels], trainable=False,
                                       initializer=tf1.zeros_initializer())
        import tf1_syncbn  # noqa: PLC0415
        mean, var = tf1_syncbn.moments(x, [0, 1, 2], num_dev=len(SIZES))
        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign_sub(
            moving_mean, (moving_mean - mean) * 0.5))
        return tf.nn.batch_normalization(x, mean, var, beta, gamma, 1e-3)


def _model(x):
    import tf1_syncbn  # noqa: PLC0415
    w = tf1.get_variable('w', [3, 3, 3, 4], initializer=tf1.random_normal_initializer(seed=1))
    h = tf.nn.conv2d(x, w, 1, 'SAME')
    h = tf1_syncbn.sync_batch_norm(h, is_training=True, num_dev=len(SIZES), scale=True,
                                   scope='bn1', decay=0.5)
    h = tf1_syncbn.layers.batch_normalization(tf.nn.relu(h), training=True, fused=False,
                                              num_dev=len(SIZES), name='bn2', momentum=0.5)
    h = _hand_written(h)
    v = tf1.get_variable('v', [4, 2], initializer=tf1.random_normal_initializer(seed=2))
    return tf.matmul(tf.reduce_mean(h, [1, 2]), v)


def run(jit=False, amp_api=False, amp_cpu=False):
    """Builds and trains; returns numbers and what the rewritten graphs hold.

    Args:
      jit: ``global_jit_level = ON_1`` in the session config.
      amp_api: wrap the optimizer with ``enable_mixed_precision_graph_rewrite``.
      amp_cpu: run Grappler's CPU emulation of the float16 rewrite alone
        (``auto_mixed_precision_cpu``).

    Returns:
      A dict: ``losses``, ``variables`` (name -> list), ``ops`` (op type ->
      count in the partition graphs of the last step), ``collective_dtypes``,
      ``half_casts`` (casts to float16 in them), ``sync_op_dtypes`` (the T of
      the compiled SyncBn* ops), ``audit`` (layer -> synchronized).
    """
    import tf1_syncbn  # noqa: PLC0415
    from tower import virtual_cpu_config  # noqa: PLC0415
    rng = np.random.RandomState(0)
    data = [(rng.randn(sum(SIZES), 4, 4, 3) * 2 + 1).astype(np.float32)
            for _ in range(STEPS)]
    graph = tf.Graph()
    with graph.as_default():
        xs, losses = [], []
        for i in range(len(SIZES)):
            with tf.device('/cpu:%d' % i), tf.name_scope('tower_%d' % i), \
                    tf1.variable_scope('', reuse=tf1.AUTO_REUSE):
                xs.append(tf1.placeholder(tf.float32, [None, 4, 4, 3]))
                losses.append(tf.reduce_sum(tf.square(_model(xs[-1]) - 1.0)) / sum(SIZES))
        loss = tf.add_n(losses)
        opt = tf1.train.GradientDescentOptimizer(0.1)
        if amp_api:
            opt = tf1.mixed_precision.enable_mixed_precision_graph_rewrite(opt)
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, 'tower_0')):
            train_op = opt.minimize(loss)
        report = tf1_syncbn.audit_graph(graph, train_op)
        config = virtual_cpu_config(len(SIZES))
        if jit:
            config.graph_options.optimizer_options.global_jit_level = tf1.OptimizerOptions.ON_1
        if amp_cpu:
            config.graph_options.rewrite_options.optimizers.append('auto_mixed_precision_cpu')
        variables = tf1.global_variables()
        options = tf1.RunOptions(output_partition_graphs=True)
        metadata = tf1.RunMetadata()
        out = dict(losses=[])
        with tf1.Session(config=config) as sess:
            sess.run(tf1.global_variables_initializer())
            for x in data:
                feed = dict(zip(xs, np.split(x, np.cumsum(SIZES)[:-1])))
                value, _ = sess.run([loss, train_op], feed, options=options,
                                    run_metadata=metadata)
                out['losses'].append(float(value))
            values = sess.run(variables)
        if amp_api:
            tf1.mixed_precision.disable_mixed_precision_graph_rewrite()
    out['variables'] = {v.op.name: np.asarray(x, np.float64).tolist()
                        for v, x in zip(variables, values) if 'loss_scale' not in v.op.name
                        and 'good_steps' not in v.op.name}
    ops, collective_dtypes, sync_dtypes, half_casts = {}, set(), set(), 0
    for partition in metadata.partition_graphs:
        for node in partition.node:
            ops[node.op] = ops.get(node.op, 0) + 1
            if node.op.startswith('Collective'):
                collective_dtypes.add(tf.as_dtype(node.attr['T'].type).name)
            if node.op.startswith('SyncBn') and 'T' in node.attr:
                sync_dtypes.add(tf.as_dtype(node.attr['T'].type).name)
            if node.op == 'Cast' and node.attr['DstT'].type == tf.float16.as_datatype_enum:
                half_casts += 1
    out.update(ops=ops, collective_dtypes=sorted(collective_dtypes),
               sync_op_dtypes=sorted(sync_dtypes), half_casts=half_casts,
               audit={layer.name: layer.synchronized for layer in report.layers},
               audit_ok=report.ok)
    return out


if __name__ == '__main__':
    import tf_behavior  # noqa: PLC0415
    tf_behavior.apply()
    result = run(**json.loads(sys.argv[1]))
    print('RESULT ' + json.dumps(result))

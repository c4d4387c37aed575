"""One worker of tests/distributed/test_sync_groups_workers.py: 2 workers x 2 towers in groups.

Started by :class:`tf1_syncbn.launch.Launcher` (``TF_CONFIG`` set). One graph,
five synchronized layers on the same inputs, each with its own groups
(:data:`GROUPS`): per-worker groups, groups across the workers, each tower
alone, and one tower alone next to a group of three (first, last). The data
is a function of the seed, the same in every process: global tower ``g``
(worker ``w``'s tower ``t``, ``g = w * 2 + t``) takes ``SIZES[g]`` rows from
``START[g]``. One training step (with the moving-average updates), then the
moving statistics in a run of their own. Prints ``RESULT <json>``: per layer
the towers' outputs and input gradients and the moving mean and variance.

For debugging: ``$SYNC_GROUPS_LAYERS`` (names of :data:`GROUPS`, comma-separated)
builds only those layers; ``$SYNC_GROUPS_TIMEOUT`` sets the collective timeout.
"""

import json
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))

import numpy as np  # noqa: E402

SHAPE = (2, 2, 3)
SIZES = [2, 3, 1, 2]           # rows of global towers 0..3
START = [sum(SIZES[:g]) for g in range(len(SIZES))]
DECAY = 0.5
#: layer scope -> group_size
GROUPS = {'per_worker': 2, 'across': [[0, 2], [1, 3]], 'alone': 1,
          'first_alone': [[0], [1, 2, 3]], 'last_alone': [[0, 1, 2], [3]]}


def global_batch(seed=0):
    """Inputs (each tower's rows with their own offset and scale) and upstream gradients."""
    rng = np.random.RandomState(seed)
    n = sum(SIZES)
    x = rng.randn(n, *SHAPE)
    for g in range(len(SIZES)):
        x[START[g]:START[g] + SIZES[g]] = x[START[g]:START[g] + SIZES[g]] * (g + 1) + 3 * g
    return x.astype(np.float32), rng.randn(n, *SHAPE).astype(np.float32)


def main():
    import tensorflow as tf

    from tf1_syncbn import sync_batch_norm
    from tf1_syncbn.distributed import WorkerSession, hard_exit, setup_cluster
    from tower import call_for_each_tower

    tf1 = tf.compat.v1
    if '--tf1-behavior' in sys.argv:
        tf1.disable_v2_behavior()
    else:
        tf1.disable_eager_execution()
    cluster = setup_cluster(towers=2, startup_timeout=120,
                            collective_timeout=float(os.environ.get('SYNC_GROUPS_TIMEOUT', 60)))
    layers = {name: spec for name, spec in GROUPS.items()
              if name in os.environ.get('SYNC_GROUPS_LAYERS', name)}
    data, upstream = global_batch()
    graph = tf.Graph()
    placeholders, outputs = [], []
    with graph.as_default():
        def tower():
            x = tf1.placeholder(tf.float32, (None,) + SHAPE)
            dy = tf1.placeholder(tf.float32, (None,) + SHAPE)
            placeholders.append((x, dy))
            outputs.append([sync_batch_norm(x, decay=DECAY, scope=name, group_size=spec,
                                            sync_statistics=cluster.backend())
                            for name, spec in layers.items()])

        call_for_each_tower(tower, cluster.tower_devices)
        xs = [x for x, _ in placeholders]
        grads = [tf.gradients(tf.add_n([tf.reduce_sum(out[k] * dy) for out, (_, dy)
                                        in zip(outputs, placeholders)]), xs)
                 for k in range(len(layers))]
        updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        moving = {name: [v for v in tf1.global_variables()
                         if v.op.name in ('%s/moving_mean' % name, '%s/moving_variance' % name)]
                  for name in layers}
    feed = {}
    for t, (x, dy) in enumerate(placeholders):
        g = cluster.rank * 2 + t
        feed[x] = data[START[g]:START[g] + SIZES[g]]
        feed[dy] = upstream[START[g]:START[g] + SIZES[g]]
    with WorkerSession(cluster, graph=graph) as session:
        ys, dxs, _ = session.run([outputs, grads, updates], feed)
        stats = session.run(moving)       # a run of its own (TF1 behaviour's reads)
    result = {'rank': cluster.rank, 'layers': {}}
    for k, name in enumerate(layers):
        result['layers'][name] = {
            'outputs': [ys[t][k].tolist() for t in range(2)],
            'input_grads': [dxs[k][t].tolist() for t in range(2)],
            'moving': [value.tolist() for _, value in sorted(
                zip([v.op.name for v in moving[name]], stats[name]))]}
    print('RESULT ' + json.dumps(result), flush=True)
    hard_exit(0)


if __name__ == '__main__':
    main()

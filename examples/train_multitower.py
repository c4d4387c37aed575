"""Main job: builds four towers on virtual CPUs and prints the tower table.

(The full SyncBN training demo replaces this once the layer lands.)
"""

import argparse
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # noqa: E402

from tower import call_for_each_tower, get_current_tower_context, virtual_cpu_config  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--towers', type=int, default=4)
    args = parser.parse_args()
    tf.compat.v1.disable_eager_execution()
    devices = ['/cpu:%d' % i for i in range(args.towers)]

    def build():
        ctx = get_current_tower_context()
        out = tf.identity(tf.constant(float(ctx.index)), name='probe')
        return ctx, out

    rows = call_for_each_tower(build, devices)
    with tf.compat.v1.Session(config=virtual_cpu_config(args.towers)) as sess:
        values = sess.run([out for _, out in rows])
    print('%-8s %-6s %-6s %-9s %-5s %-16s %s' % ('tower', 'index', 'total', 'training', 'main',
                                                  'device', 'op'))
    for (ctx, out), _ in zip(rows, values):
        print('%-8s %-6d %-6d %-9s %-5s %-16s %s' % (
            ctx.name, ctx.index, ctx.total, ctx.is_training, ctx.is_main_training_tower,
            out.device, out.op.name))


if __name__ == '__main__':
    main()

"""Under tf.distribute: a training step with synchronized vs per-replica batch norm.

Two parts, each timed with its variants interleaved in blocks of steps, so
that drift in the machine's load hits them alike (repeat the script for a
range):

1. **A whole network.** ``resnet_v1_50`` from ``tf_slim.nets``, built with
   :func:`tf1_syncbn.sync_arg_scope` inside the replica function of
   ``tf.compat.v1.distribute.MirroredStrategy`` on N virtual CPU replicas
   (default 4 replicas x 4 images of 64x64), in a TF1 graph: the optimizer
   inside the replica function with the ``UPDATE_OPS`` as control
   dependencies, one SGD step per ``Session.run``. ``sync`` is the default
   (``sync_statistics='auto'``: the library's collective backend over the
   strategy's replicas), ``unsync`` the same layer with
   ``sync_statistics=None`` (the anchor).
2. **One layer, for context** (default 4 replicas of 32x28x28x64, forward,
   backward and the moving-average updates):

   * ``ours_unsync`` / ``ours_sync``: this library's ``sync_batch_norm``
     under the same v1 ``MirroredStrategy`` in a TF1 graph (this process);
   * ``keras_unsync`` / ``keras_sync``: Keras 3's
     ``tf.keras.layers.BatchNormalization(synchronized=False / True)`` under a
     TF2 ``tf.distribute.MirroredStrategy`` on 4 logical CPUs
     (``tf.config.set_logical_device_configuration``), eager with the step in
     a ``tf.function``. It runs in a child process (this one runs TF1 graph
     mode), which times a block of steps whenever this process tells it to,
     between this process's blocks: the four variants take turns, one process
     at a time.

Every step fetches a value that depends on every gradient (a sum of their
sums), so no gradient work can be skipped, and runs the updates. Prints the
median step times, the ratios to the anchors (``unsync``; ``keras_unsync``
and ``ours_unsync`` for the layer), and the machine (CPU model, cores,
TensorFlow, load average).

Usage: python bench/strategy_step.py [--replicas 4] [--batch 4] [--size 64]
           [--steps 20] [--warmup 3] [--layer-shape 32,28,28,64]
           [--layer-steps 30] [--no-network] [--no-layer]
"""

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, '..'))
sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

NUM_CLASSES = 10
EPS = 1e-3
MOMENTUM = 0.99      # Keras' default; slim's decay for our layer
#: Seconds the child may take to build, warm up, or time one block.
CHILD_TIMEOUT = 600


def _replica_index():
    import tensorflow as tf  # noqa: PLC0415
    context = tf.distribute.get_replica_context()
    return int(tf.get_static_value(context.replica_id_in_sync_group))


def _per_replica_variables(tf1, replicas, make):
    """Plain (non-mirrored) variables on each replica's CPU: data without feeds."""
    values = []
    for i in range(replicas):
        with tf1.device('/cpu:%d' % i):
            values.append([tf1.Variable(v, trainable=False, name='data%d_%d' % (i, k))
                           for k, v in enumerate(make(i))])
    return values


def build_network(variant, replicas, batch, size):
    """resnet_v1_50 SGD step under the v1 MirroredStrategy; ``(session, fetch, graph)``."""
    import tensorflow as tf  # noqa: PLC0415
    from tf_slim.nets import resnet_v1  # noqa: PLC0415

    from tf1_syncbn import sync_arg_scope  # noqa: PLC0415
    from tower import virtual_cpu_config  # noqa: PLC0415
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        data = _per_replica_variables(tf1, replicas, lambda i: [
            rng.randn(batch, size, size, 3).astype(np.float32),
            rng.randint(0, NUM_CLASSES, batch).astype(np.int32)])
        strategy = tf1.distribute.MirroredStrategy(['/cpu:%d' % i for i in range(replicas)])
        optimizer = tf1.train.GradientDescentOptimizer(0.01)
        sync = {} if variant == 'sync' else {'sync_statistics': None}

        def replica_fn():
            images, labels = data[_replica_index()]
            with sync_arg_scope(resnet_v1.resnet_arg_scope(), **sync):
                logits, _ = resnet_v1.resnet_v1_50(images, num_classes=NUM_CLASSES)
            logits = tf.reshape(logits, [-1, NUM_CLASSES])
            loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits,
                                                           loss_collection=None)
            # The mean over the global batch: each replica's loss over N.
            grads = optimizer.compute_gradients(loss / replicas)
            with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                train = optimizer.apply_gradients(grads)
            # One scalar that depends on every gradient of this replica.
            return tf.add_n([tf.reduce_sum(g) for g, _ in grads if g is not None]), train

        with strategy.scope():
            checksum, train = strategy.run(replica_fn)
            with tf.control_dependencies(strategy.experimental_local_results(train)):
                fetch = tf.add_n(strategy.experimental_local_results(checksum), name='step')
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=graph, config=virtual_cpu_config(replicas))
    sess.run(init)
    return sess, fetch, graph


def build_layer(variant, replicas, shape):
    """One layer's forward+backward+updates under the v1 MirroredStrategy."""
    import tensorflow as tf  # noqa: PLC0415

    from tf1_syncbn import sync_batch_norm  # noqa: PLC0415
    from tower import virtual_cpu_config  # noqa: PLC0415
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        data = _per_replica_variables(tf1, replicas, lambda i: [
            rng.randn(*shape).astype(np.float32), rng.randn(*shape).astype(np.float32)])
        strategy = tf1.distribute.MirroredStrategy(['/cpu:%d' % i for i in range(replicas)])
        # Only to differentiate: it never applies the gradients.
        optimizer = tf1.train.GradientDescentOptimizer(0.0)
        sync = {} if variant == 'ours_sync' else {'sync_statistics': None}

        def replica_fn():
            x, dy = data[_replica_index()]
            y = sync_batch_norm(x, decay=MOMENTUM, epsilon=EPS, scale=True, scope='bn', **sync)
            loss = tf.reduce_sum(y * dy)
            params = [v for v in tf1.trainable_variables() if v.op.name.startswith('bn/')]
            grads = optimizer.compute_gradients(loss, [x] + params)
            with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                return tf.add_n([tf.reduce_sum(g) for g, _ in grads] + [tf.reduce_sum(y)])

        with strategy.scope():
            out = strategy.run(replica_fn)
            fetch = tf.add_n(strategy.experimental_local_results(out), name='step')
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=graph, config=virtual_cpu_config(replicas))
    sess.run(init)
    return sess, fetch, graph


def collectives(graph):
    """The library's all-reduces in ``graph`` (each runs once per step)."""
    return sum(1 for op in graph.get_operations() if op.type == 'CollectiveReduce')


# ---- the Keras 3 child (TF2: eager, the step in a tf.function) ----

def keras_child(args):
    """Builds the Keras variants, then times a block of steps per ``block`` line on stdin."""
    import tensorflow as tf  # noqa: PLC0415
    cpus = tf.config.list_physical_devices('CPU')
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    import keras  # noqa: PLC0415
    shape = tuple(int(s) for s in args.layer_shape.split(','))
    strategy = tf.distribute.MirroredStrategy(['/cpu:%d' % i for i in range(args.replicas)])
    rng = np.random.RandomState(0)
    arrays = [(rng.randn(*shape).astype(np.float32), rng.randn(*shape).astype(np.float32))
              for _ in range(args.replicas)]
    data = strategy.experimental_distribute_values_from_function(
        lambda ctx: tuple(tf.constant(a) for a in arrays[ctx.replica_id_in_sync_group]))
    steps = {}
    for name, synchronized in (('keras_unsync', False), ('keras_sync', True)):
        with strategy.scope():
            layer = tf.keras.layers.BatchNormalization(momentum=MOMENTUM, epsilon=EPS,
                                                       synchronized=synchronized)
            layer.build((None,) + shape[1:])

        def replica_fn(batch, layer=layer):
            x, dy = batch
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)      # updates the moving statistics
                loss = tf.reduce_sum(y * dy)
            grads = tape.gradient(loss, [x] + layer.trainable_variables)
            return tf.add_n([tf.reduce_sum(g) for g in grads] + [tf.reduce_sum(y)])

        @tf.function
        def step(replica_fn=replica_fn):
            out = strategy.run(replica_fn, args=(data,))
            return tf.add_n(strategy.experimental_local_results(out))
        steps[name] = step
    for step in steps.values():
        for _ in range(args.warmup):
            step().numpy()
    print(json.dumps({'ready': True, 'keras': keras.__version__,
                      'layer': tf.keras.layers.BatchNormalization.__module__,
                      'tensorflow': tf.__version__}), flush=True)
    for line in sys.stdin:
        if line.strip() != 'block':
            break
        times = {}
        for name, step in steps.items():
            step().numpy()       # untimed: pays for the caches the others evicted
            times[name] = []
            for _ in range(args.block):
                start = time.perf_counter()
                step().numpy()
                times[name].append(time.perf_counter() - start)
        print(json.dumps(times), flush=True)


class KerasChild(object):
    """The child process of :func:`keras_child`, driven over its stdin and stdout."""

    def __init__(self, args):
        cmd = [sys.executable, os.path.abspath(__file__), '--keras-child',
               '--replicas', str(args.replicas), '--layer-shape', args.layer_shape,
               '--warmup', str(args.warmup), '--block', str(args.block)]
        env = dict(os.environ)
        env.pop('TF_USE_LEGACY_KERAS', None)       # Keras 3, whatever the caller set
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.info = self._read()

    def _read(self):
        import select  # noqa: PLC0415
        ready, _, _ = select.select([self.proc.stdout], [], [], CHILD_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ''
        if not line:
            self.close()
            raise RuntimeError('bench/strategy_step.py: the Keras child process %s'
                               % ('exited with status %s' % self.proc.returncode
                                  if ready else 'did not answer within %d s' % CHILD_TIMEOUT))
        return json.loads(line)

    def block(self):
        self.proc.stdin.write('block\n')
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('quit\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--replicas', type=int, default=4)
    parser.add_argument('--batch', type=int, default=4, help='images per replica')
    parser.add_argument('--size', type=int, default=64, help='image height and width')
    parser.add_argument('--steps', type=int, default=20, help='timed network steps per variant')
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--block', type=int, default=3, help='timed steps per turn')
    parser.add_argument('--layer-shape', default='32,28,28,64', help='per replica, NHWC')
    parser.add_argument('--layer-steps', type=int, default=30,
                        help='timed layer steps per variant')
    parser.add_argument('--no-network', action='store_true', help='skip the resnet_v1_50 part')
    parser.add_argument('--no-layer', action='store_true', help='skip the one-layer part')
    parser.add_argument('--keras-child', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.keras_child:
        keras_child(args)
        return
    import tensorflow as tf  # noqa: PLC0415
    from _timing import machine_line, median_times  # noqa: PLC0415

    from tf1_syncbn import kernels  # noqa: PLC0415
    tf.compat.v1.disable_eager_execution()
    print(machine_line())
    print('kernels: %s' % kernels.status(), flush=True)
    if not args.no_network:
        built = {name: build_network(name, args.replicas, args.batch, args.size)
                 for name in ('unsync', 'sync')}
        med = median_times({name: b[:2] for name, b in built.items()}, args.steps,
                           args.warmup, block=args.block)
        print('resnet_v1_50 SGD step under tf.compat.v1.distribute.MirroredStrategy, %d '
              'replicas (virtual CPUs) x %d images of %dx%d, median of %d steps'
              % (args.replicas, args.batch, args.size, args.size, args.steps))
        for name in ('unsync', 'sync'):
            print('  %-7s %8.1f ms  %.3fx   %4d batch-norm all-reduces/step'
                  % (name, med[name], med[name] / med['unsync'], collectives(built[name][2])))
        print('  ratio sync / unsync: %.3fx  (target <= 1.08x)' % (med['sync'] / med['unsync']))
        print(machine_line(), flush=True)
        for sess, _, _ in built.values():
            sess.close()
    if args.no_layer:
        return
    shape = tuple(int(s) for s in args.layer_shape.split(','))
    child = KerasChild(args)
    try:
        built = {name: build_layer(name, args.replicas, shape)
                 for name in ('ours_unsync', 'ours_sync')}
        med = median_times({name: b[:2] for name, b in built.items()}, args.layer_steps,
                           args.warmup, args.block, between_rounds=child.block)
    finally:
        child.close()
    print('one layer, forward+backward+moving statistics, %d replicas of %s, median of %d '
          'steps, two processes taking turns in blocks'
          % (args.replicas, 'x'.join(map(str, shape)), args.layer_steps))
    rows = [('ours_unsync', 'sync_batch_norm(sync_statistics=None), v1 MirroredStrategy, graph'),
            ('ours_sync', "sync_batch_norm (sync_statistics='auto'), the same"),
            ('keras_unsync', 'Keras %s BatchNormalization(synchronized=False), TF2 '
             'MirroredStrategy, tf.function' % child.info['keras']),
            ('keras_sync', 'Keras BatchNormalization(synchronized=True), the same')]
    for name, what in rows:
        print('  %-12s %8.2f ms  %5.2fx of keras_sync   %s'
              % (name, med[name], med[name] / med['keras_sync'], what))
    print('  ratio ours_sync / ours_unsync:    %.3fx  (%d all-reduces/step)'
          % (med['ours_sync'] / med['ours_unsync'], collectives(built['ours_sync'][2])))
    print('  ratio keras_sync / keras_unsync:  %.3fx' % (med['keras_sync'] / med['keras_unsync']))
    print('  ratio ours_sync / keras_sync:     %.3fx' % (med['ours_sync'] / med['keras_sync']))
    print(machine_line())
    for sess, _, _ in built.values():
        sess.close()


if __name__ == '__main__':
    main()

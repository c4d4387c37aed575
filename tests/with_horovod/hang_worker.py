"""One process of a Horovod job where a process leaves a synchronized layer's all-reduce unmatched.

    horovodrun -np 2 -H localhost:2 --gloo python hang_worker.py SCENARIO

Both processes build the same graph: ``sync_batch_norm`` with
``sync_statistics='horovod'`` and a bool tensor ``is_training``, and the
parameter gradients summed with ``hvd.allreduce``. Step 0 runs on both. Then:

* ``skip``: in step 1, process 1 feeds ``is_training=False``: its layer
  normalizes with the moving statistics and skips the all-reduce, and it
  waits in the gradient all-reduces, while process 0 waits in the layer's.
  Each process prints how its step ended and how long it ran, and exits 1
  when the step failed.
* ``die``: process 1 exits with status 3 before step 1; process 0's step 1
  waits for it.

Every process prints ``WARNED: <message>`` for what ``HorovodBackend`` warned
about Horovod's stall shutdown at graph build (``WARNED: none`` otherwise).
"""

import faulthandler
import os
import sys
import time
import warnings

import numpy as np
import tensorflow as tf

import tf_behavior

tf_behavior.apply()

import horovod.tensorflow as hvd  # noqa: E402

import tf1_syncbn  # noqa: E402

tf1 = tf.compat.v1
SCENARIO = sys.argv[1]
faulthandler.dump_traceback_later(int(os.environ.get('HANG_SECONDS', '180')), exit=True)


def main():
    hvd.init()
    rank = hvd.rank()
    x = tf1.placeholder(tf.float32, [None, 3])
    training = tf1.placeholder(tf.bool, [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        y = tf1_syncbn.sync_batch_norm(x, is_training=training, scope='bn', scale=True,
                                       sync_statistics='horovod')
    stall = [str(w.message) for w in caught if 'HOROVOD_STALL' in str(w.message)]
    print('WARNED: %s' % (stall[0] if stall else 'none'), flush=True)
    loss = tf.reduce_sum(y * y)
    variables = tf1.trainable_variables()
    grads = [hvd.allreduce(g, op=hvd.Sum, name='grad_%d' % k)
             for k, g in enumerate(tf.gradients(loss, variables))]
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train = tf1.train.GradientDescentOptimizer(0.1).apply_gradients(zip(grads, variables))
    data = np.random.RandomState(rank).randn(4, 3).astype(np.float32)
    with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train, {x: data, training: True})
        print('rank %d: step 0 done' % rank, flush=True)
        if SCENARIO == 'die' and rank == 1:
            os._exit(3)
        start = time.time()
        try:
            sess.run(train, {x: data, training: not (SCENARIO == 'skip' and rank == 1)})
        except tf.errors.OpError as e:
            lines = e.message.splitlines()
            print('rank %d: step 1 failed after %.1f s: %s: %s'
                  % (rank, time.time() - start, type(e).__name__,
                     next((line for line in lines if 'Horovod' in line), lines[0])),
                  flush=True)
            sys.exit(1)
        print('rank %d: step 1 done after %.1f s' % (rank, time.time() - start), flush=True)


if __name__ == '__main__':
    main()

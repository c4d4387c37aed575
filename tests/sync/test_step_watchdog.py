"""The collective timeout, kept by one watchdog thread instead of two threads per collective.

TensorFlow's per-op collective timeout (``timeout_seconds``) starts two
sleeping threads per collective execution, each living for the whole timeout:
a network with hundreds of synchronized layers makes thousands of threads per
minute. The compiled step watchdog arms one deadline per step and host
instead.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import support_paths
from bn_reference import towers_skipping_a_layer
from conftest import assert_first_run_fails, make_session
from tf1_syncbn import CollectiveBackend, kernels, sync_batch_norm
from tower import call_for_each_tower

tf1 = tf.compat.v1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = 20
#: Why the process-level cases run in the TF2-behaviour pass only: they test TensorFlow's
#: runtime (per-op timeouts without the library, closing sessions under the watchdog).
RUNTIME = 'the runtime around the watchdog, whatever the TF behaviour'


def _deep_net(timeout):
    xs = []

    def tower():
        x = tf1.placeholder(tf.float32, [None, 3])
        xs.append(x)
        h = x
        for i in range(LAYERS):
            h = sync_batch_norm(h, scope='bn%d' % i, updates_collections=None,
                                sync_statistics=CollectiveBackend(timeout=timeout))
        return h

    ys = call_for_each_tower(tower, ['/cpu:0', '/cpu:1'])
    grads = tf.gradients(tf.add_n([tf.reduce_sum(y * y) for y in ys]), xs)
    return xs, ys, grads


def _threads():
    return len(os.listdir('/proc/self/task'))


@pytest.fixture(autouse=True)
def _library():
    if kernels.library() is None:
        pytest.skip('the compiled library is unavailable: %s' % kernels.status())


def test_one_watchdog_per_host_and_no_per_op_timeouts(graph):
    _deep_net(timeout=600)
    watchdogs = [op for op in graph.get_operations() if op.type == 'SyncBnStepWatchdog']
    assert len(watchdogs) == 1   # both towers are on the same host
    assert watchdogs[0].get_attr('timeout_seconds') == 600
    collectives = [op for op in graph.get_operations() if op.type == 'CollectiveReduce']
    assert len(collectives) == 2 * 2 * LAYERS
    assert all(op.get_attr('timeout_seconds') == 0 for op in collectives)


@pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='counts threads in /proc')
def test_threads_stay_bounded_and_nothing_stays_armed(graph, rng):
    xs, ys, grads = _deep_net(timeout=600)
    armed = kernels.library().sync_bn_armed_watchdogs()
    feed = {x: rng.randn(3, 3).astype(np.float32) for x in xs}
    with make_session(graph, 2) as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(ys + grads, feed)
        before = _threads()
        for _ in range(10):
            sess.run(ys + grads, feed)
        grown = _threads() - before
        assert sess.run(armed) == 0   # every step disarmed its deadline when it ended
    # With TensorFlow's per-op timeout: 2 threads x 80 collectives x 10 steps.
    assert grown < 50, grown


def test_a_step_that_waits_too_long_fails_with_the_reason(graph):
    xs, ys = towers_skipping_a_layer(CollectiveBackend(timeout=2))   # tower 1 skips it
    assert_first_run_fails(graph, ys, {x: np.ones((2, 3)) for x in xs},
                           tf.errors.DeadlineExceededError,
                           r'ran more than 2 s on this host while a collective of it still '
                           r'waited', devices=2)


@pytest.mark.once(reason=RUNTIME)
def test_without_the_library_collectives_carry_tensorflows_timeout(tmp_path):
    code = ('import tensorflow as tf\n'
            'import tf_behavior; tf_behavior.apply()\n'
            'from tf1_syncbn import CollectiveBackend, sync_batch_norm, kernels\n'
            'from tower import call_for_each_tower\n'
            'call_for_each_tower(lambda: sync_batch_norm(\n'
            '    tf.compat.v1.placeholder(tf.float32, [None, 3]),\n'
            '    sync_statistics=CollectiveBackend(timeout=7)), ["/cpu:0", "/cpu:1"])\n'
            'ops = tf.compat.v1.get_default_graph().get_operations()\n'
            'print(kernels.library(), sorted({op.get_attr("timeout_seconds") for op in ops\n'
            '                                 if op.type == "CollectiveReduce"}),\n'
            '      [op.type for op in ops if op.type == "SyncBnStepWatchdog"])\n')
    env = dict(os.environ, TF1_SYNCBN_KERNELS='0', TF_CPP_MIN_LOG_LEVEL='3')
    out = subprocess.run([sys.executable, '-c', code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split('\n')[-2] == 'None [7.0] []'


@pytest.mark.once(reason=RUNTIME)
def test_sessions_closed_right_after_a_timed_out_step_do_not_crash_the_process():
    """The watchdog's abort used to outlive its step: a session closed at once was freed under it.

    TensorFlow's StartAbort wakes the step's waiting collectives, so the step
    could end, and the test close and free its session, while the watchdog
    thread was still inside StartAbort, reading the freed session
    (``std::bad_alloc`` or a segmentation fault in about half of the runs of
    a few timeouts). Now the step's clean-up waits for the abort. Run in a
    child process, so that a crash is a failure and not the end of the suite.
    """
    code = '''
import gc
import numpy as np
import tensorflow as tf
import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
tf_behavior.apply()
from bn_reference import towers_skipping_a_layer
from tf1_syncbn import CollectiveBackend
from tower import virtual_cpu_config
for _ in range(8):
    graph = tf.Graph()
    with graph.as_default():
        xs, ys = towers_skipping_a_layer(CollectiveBackend(timeout=0.5))
        sess = tf.compat.v1.Session(config=virtual_cpu_config(2))
        sess.run(tf.compat.v1.global_variables_initializer())
        try:
            sess.run(ys, {x: np.ones((2, 3)) for x in xs})
        except tf.errors.DeadlineExceededError:
            pass
        sess.close()
    del sess, graph, xs, ys
    gc.collect()
print('survived')
'''
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3',
               PYTHONPATH=support_paths.pythonpath())
    out = subprocess.run([sys.executable, '-c', code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip() == 'survived', \
        (out.returncode, out.stderr[-3000:])

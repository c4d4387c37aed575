"""MultiWorkerMirroredStrategy (v1) across 2 worker processes equals tf-slim on one device.

Two local worker processes (``tests/support/for_tower/distribute_worker.py``, each with its own
``TF_CONFIG``, forked by one interpreter that imported TensorFlow: ``--fork``) each run one
replica of ``tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy``
in a TF1 graph, with a ``tf.distribute.Server`` and a session on its target,
and train the model of ``strategy_case.py`` with two ``sync_batch_norm``
layers (the first with default arguments) under ``strategy.run``: the
optimizer inside the replica function, ``UPDATE_OPS`` as its control
dependencies, each worker feeding its own share of the global batch of 8
(3 and 5 rows; and 0 and 8, the chief's share empty). On *both* workers, the
global loss of each of 3 SGD steps, every variable and the moving statistics
equal tf-slim's ``batch_norm`` run by tf-slim itself (a subprocess with
legacy Keras, ``legacy_reference.py``) on one device with the whole batch.
With ``sync_statistics=None`` (per-worker statistics) the same comparison
fails on both workers.

The three runs (6 worker processes, forked from one TensorFlow import; in the
TF1-behaviour pass one, 2 processes) start together and the reference runs
while they do; they have a deadline (the strategy's own collectives have no
timeout).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import distribute_worker
import tf_behavior
from legacy_reference import run_reference
from strategy_case import STEPS
from tf1_syncbn.launch import free_ports, tf_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, 'tests', 'support', 'for_tower', 'distribute_worker.py')
TOTAL = 8
#: name: (rows per worker, --sync)
ALL_RUNS = {'uneven': ('3,5', 'auto'), 'chief-empty': ('0,8', 'auto'),
            'per-worker': ('3,5', 'none')}
# The TF1-behaviour pass (tf_behavior.pick): the uneven run, the strategy's
# replicas in TF1 graphs; an empty chief (whose share the batch split decides)
# and the per-worker control, which shows the comparison can fail, do not
# depend on the behaviour.
RUNS = {name: ALL_RUNS[name] for name in tf_behavior.pick(ALL_RUNS, ['uneven'])}
#: Seconds the runs (all at once) and the reference may take; workers still
#: running then are stopped.
DEADLINE = 240
#: The layers' collective timeout in the workers (a step waiting longer fails).
COLLECTIVE_TIMEOUT = 120

# Whichever test comes first runs the module fixture (at most DEADLINE, plus
# the stopping of the workers still running then).
pytestmark = pytest.mark.timeout(DEADLINE + 120)

REFERENCE_SCRIPT = '''
import sys
import numpy as np
import tensorflow as tf
import tf_slim as slim
import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
tf_behavior.apply()
from strategy_case import train

layer = eval('lambda x: ' + sys.argv[1])
np.savez('slim_reference.npz', **train(layer, [int(sys.argv[2])]))
print('RESULT slim_reference.npz')
'''


def _output(logs):
    text = []
    for rank, log in enumerate(logs):
        with open(log) as f:
            text += ['[worker %d] %s' % (rank, line) for line in f.read().splitlines()]
    return '\n'.join(text)[-6000:]


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """Every run's worker results, ``{name: [worker 0's, worker 1's]}``, and the reference."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3',
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
    jobs, outs, logs = [], {}, {}
    # Every port at once, so that two runs never get the same one.
    ports = iter(free_ports(2 * len(RUNS)))
    for name, (sizes, sync) in RUNS.items():
        outs[name] = str(tmp_path_factory.mktemp('mwms_' + name))
        addresses = ['localhost:%d' % next(ports) for _ in range(2)]
        logs[name] = [os.path.join(outs[name], 'worker%d.log' % rank) for rank in range(2)]
        jobs += [{'argv': ['--sizes', sizes, '--sync', sync, '--out', outs[name],
                           '--timeout', str(COLLECTIVE_TIMEOUT)],
                  'tf_config': tf_config(addresses, rank), 'log': logs[name][rank]}
                 for rank in range(2)]
    request = str(tmp_path_factory.mktemp('mwms_jobs') / 'jobs.json')
    with open(request, 'w') as f:
        json.dump({'jobs': jobs, 'deadline': DEADLINE}, f)
    # The workers: one interpreter forked per worker (distribute_worker.fork_workers).
    workers = subprocess.Popen([sys.executable, WORKER, '--fork', request], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tmp = tmp_path_factory.mktemp('mwms_reference')
        run_reference(REFERENCE_SCRIPT, tmp, args=[distribute_worker.SLIM_LAYER, str(TOTAL)],
                      timeout=DEADLINE)     # (also within the deadline: it starts at once)
        reference = dict(np.load(str(tmp / 'slim_reference.npz')))
        out, err = workers.communicate(timeout=DEADLINE + 60)
    finally:
        if workers.poll() is None:
            workers.kill()
            workers.wait()
    lines = [line for line in out.splitlines() if line.startswith('STATUSES ')]
    assert lines, 'the workers\' parent failed: status %s\n%s' % (workers.returncode, err[-4000:])
    statuses = iter(json.loads(lines[-1][len('STATUSES '):]))
    results = {}
    for name in RUNS:
        status = [next(statuses) for _ in range(2)]
        assert status == [0, 0], '%s: statuses %s\n%s' % (name, status, _output(logs[name]))
        results[name] = [dict(np.load(os.path.join(outs[name], 'worker%d.npz' % rank)))
                         for rank in range(2)]
    return results, reference


def assert_equals_reference(worker, reference, what):
    """Losses of every step and every variable of ``worker`` equal ``reference``'s."""
    compared = sorted(k for k in worker if k.startswith(('loss/', 'var/')))
    assert compared == sorted(reference), what
    for key in compared:
        expected = reference[key].astype(np.float64)
        scale = max(np.abs(expected).max(), 1.0)
        np.testing.assert_allclose(worker[key], expected, rtol=1e-5, atol=2e-6 * scale,
                                   err_msg='%s: %s' % (what, key))


@pytest.mark.parametrize('name', [n for n in ('uneven', 'chief-empty') if n in RUNS])
def test_both_workers_equal_slim_on_one_device(runs, name):
    results, reference = runs
    # The reference covers what the comparison must: both layers' moving
    # statistics, gamma of the second, three steps of losses.
    assert {'var/net/BatchNorm/moving_mean', 'var/net/BatchNorm/moving_variance',
            'var/net/bn2/moving_mean', 'var/net/bn2/moving_variance',
            'var/net/bn2/gamma'} <= set(reference)
    assert len([k for k in reference if k.startswith('loss/')]) == STEPS
    for rank, worker in enumerate(results[name]):
        assert int(worker['rank']) == rank
        assert_equals_reference(worker, reference, '%s, worker %d' % (name, rank))
        # Each worker trained on its own share: the shares add up to the loss.
        for s in range(STEPS):
            shares = sum(results[name][r]['share/%d' % s] for r in range(2))
            np.testing.assert_allclose(shares, worker['loss/%d' % s], rtol=1e-6)
    if name == 'chief-empty':
        assert all(results[name][0]['share/%d' % s] == 0 for s in range(STEPS))


def test_auto_synchronizes_both_layers_over_both_workers(runs):
    """Each layer all-reduces forward and backward over the 2 replicas; None builds none."""
    results, _ = runs
    for rank in range(2):
        ops = [str(op) for op in results['uneven'][rank]['collectives']]
        assert len(ops) == 4 and all(op.endswith(':2') for op in ops), ops
        for layer in ('net/BatchNorm/', 'net/bn2/'):
            assert len([op for op in ops if op.startswith(layer)]) == 1, ops
            assert len([op for op in ops if op.startswith('gradients/' + layer)]) == 1, ops
        if 'per-worker' in results:     # (the TF2-behaviour pass's control run)
            assert not len(results['per-worker'][rank]['collectives'])


@pytest.mark.once(reason='the control run, whose comparison fails whichever the behaviour')
def test_per_worker_statistics_fail_the_comparison_on_both_workers(runs):
    """The comparison can fail: sync_statistics=None normalizes each worker's share alone."""
    results, reference = runs
    for rank, worker in enumerate(results['per-worker']):
        with pytest.raises(AssertionError):
            assert_equals_reference(worker, reference, 'per-worker, worker %d' % rank)
    # And the workers' moving statistics differ: each kept its own first replica's.
    ours, theirs = results['per-worker']
    assert not np.allclose(ours['var/net/bn2/moving_mean'], theirs['var/net/bn2/moving_mean'])

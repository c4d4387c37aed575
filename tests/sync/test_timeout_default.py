"""``TF1_SYNCBN_TIMEOUT``: the default collective timeout, read when tf1_syncbn is imported.

The README: the collective backend's timeout defaults to "600 s, or
``$TF1_SYNCBN_TIMEOUT``"; the variable is "read when ``tf1_syncbn`` is
imported, for every layer that does not pass a backend object"; "``0`` or
``float('inf')`` (``TF1_SYNCBN_TIMEOUT=inf``) mean no deadline", and
"NaN, negative numbers and anything that is not a number are a
``ValueError`` naming ... the variable". The timeout is kept by the step
watchdog op (``SyncBnStepWatchdog``, attribute ``timeout_seconds``), and
without the compiled library by TensorFlow's per-op collective timeout.

Each value needs a fresh import of tf1_syncbn (the variable is read at
import): a process that has imported TensorFlow only forks one child per
value; each child imports tf1_syncbn in that value's environment, builds a
two-tower graph with one layer on the default backend and one on
``CollectiveBackend(timeout=7)``, and reports what it built.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: name -> extra environment (the variables unset otherwise).
SETTINGS = {
    'unset': {},
    '45': {'TF1_SYNCBN_TIMEOUT': '45'},
    '45-without-library': {'TF1_SYNCBN_TIMEOUT': '45', 'TF1_SYNCBN_KERNELS': '0'},
    'inf': {'TF1_SYNCBN_TIMEOUT': 'inf'},
}

# One interpreter imports TensorFlow (most of a start's cost) but never tf1_syncbn;
# for each setting it forks, and the child, in that setting's environment,
# imports tf1_syncbn for the first time in its process (the import that reads
# the variables), builds its graph and reports. Nothing creates a session or
# runs a graph before the forks (tests/support/forked.py).
SCRIPT = r'''
import json, os, sys
import tensorflow as tf
import forked  # tests/support/forked.py
import tf_behavior  # the case's TF behaviour (TF1_SYNCBN_TEST_BEHAVIOR)
tf_behavior.apply()
assert not [m for m in sys.modules if m.split('.')[0] in ('tf1_syncbn', 'tower')]
SETTINGS = json.loads(sys.argv[1])


def report(name):
    for key in ('TF1_SYNCBN_TIMEOUT', 'TF1_SYNCBN_KERNELS'):
        os.environ.pop(key, None)
    os.environ.update(SETTINGS[name])
    try:
        import tf1_syncbn
    except ValueError as e:
        return {'import_error': str(e)}
    from tf1_syncbn import CollectiveBackend, kernels, sync_batch_norm
    from tower import call_for_each_tower

    report = {'default': CollectiveBackend().timeout, 'library': kernels.library() is not None}
    graph = tf.Graph()
    with graph.as_default():
        def tower():
            x = tf.compat.v1.placeholder(tf.float32, [None, 3])
            return (sync_batch_norm(x, scope='default', sync_statistics='collective') +
                    sync_batch_norm(x, scope='explicit',
                                    sync_statistics=CollectiveBackend(timeout=7)))
        call_for_each_tower(tower, ['/cpu:0', '/cpu:1'])
        ops = graph.get_operations()
        report['watchdogs'] = sorted(op.get_attr('timeout_seconds') for op in ops
                                     if op.type == 'SyncBnStepWatchdog')
        report['collective_ops'] = sum(1 for op in ops if op.type.startswith('CollectiveReduce'))
        report['op_timeouts'] = sorted({op.get_attr('timeout_seconds') for op in ops
                                        if op.type.startswith('CollectiveReduce')})
    return report


for name in SETTINGS:
    # forked.py: the child in its own process group, its report on our stdout.
    forked.wait([forked.fork(lambda: print('REPORT %s %s' % (name, json.dumps(report(name)))))],
                240)
'''


#: The timeout's settings, whatever the TF behaviour: the TF2-behaviour pass only (the
#: guards' and the watchdog's timeouts run in both: test_guards.py, test_step_watchdog.py).
pytestmark = pytest.mark.once


@pytest.fixture(scope='module')
def reports():
    """Every setting's report, from one interpreter forked per setting (one TF import)."""
    env = {k: v for k, v in os.environ.items() if k not in ('TF1_SYNCBN_TIMEOUT',
                                                            'TF1_SYNCBN_KERNELS')}
    env.update(TF_CPP_MIN_LOG_LEVEL='3',
               PYTHONPATH=os.pathsep.join([ROOT, env.get('PYTHONPATH', '')]))
    proc = subprocess.run([sys.executable, '-c', SCRIPT, json.dumps(SETTINGS)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith('REPORT '):
            name, text = line[len('REPORT '):].split(' ', 1)
            results[name] = json.loads(text)
    for name in SETTINGS:
        results.setdefault(name, {'failed': 'exit %d\n%s\n%s' % (
            proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])})
    return results


def _report(reports, name):
    report = reports[name]
    assert 'failed' not in report, report.get('failed')
    return report


def test_default_is_600_seconds(reports):
    report = _report(reports, 'unset')
    assert report['default'] == 600.0
    assert report['library'], 'the compiled library is needed for the watchdog'
    # One watchdog per host and timeout: the default layer's and the explicit one's;
    # the collective ops themselves carry no per-op timeout (no threads per op).
    assert report['watchdogs'] == [7.0, 600.0]
    assert report['collective_ops'] == 4 and report['op_timeouts'] == [0.0]   # forward only


def test_the_variable_sets_the_default_for_layers_without_a_backend_object(reports):
    report = _report(reports, '45')
    assert report['default'] == 45.0
    assert report['watchdogs'] == [7.0, 45.0]   # the backend object keeps its own 7 s
    assert report['op_timeouts'] == [0.0]


def test_without_the_library_the_collectives_carry_the_timeout(reports):
    report = _report(reports, '45-without-library')
    assert not report['library']
    assert report['default'] == 45.0
    assert report['watchdogs'] == []
    assert report['op_timeouts'] == [7.0, 45.0]


def test_inf_waits_forever(reports):
    report = _report(reports, 'inf')
    assert report['default'] == 0.0
    assert report['watchdogs'] == [7.0]   # none armed for the default layer
    assert report['op_timeouts'] == [0.0]


@pytest.mark.parametrize('value', ['soon', '-5', 'nan'])
def test_an_invalid_value_is_a_value_error_naming_the_variable(value):
    """What the import evaluates (``DEFAULT_TIMEOUT = timeout_from_environment()``,
    shown to follow the variable by the forked imports above), here without one
    more interpreter per value."""
    from tf1_syncbn.timeouts import timeout_from_environment  # noqa: PLC0415
    with pytest.raises(ValueError, match='TF1_SYNCBN_TIMEOUT') as info:
        timeout_from_environment({'TF1_SYNCBN_TIMEOUT': value})
    assert value in str(info.value)
    assert timeout_from_environment({}) == 600.0
    assert timeout_from_environment({'TF1_SYNCBN_TIMEOUT': ' 12.5 '}) == 12.5

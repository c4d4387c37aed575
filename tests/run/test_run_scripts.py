"""Unchanged TF1 scripts of each classic style under ``python -m tf1_syncbn.run``.

Each script (``tests/support/unchanged/``) knows nothing of tf1_syncbn. Under the runner, on
4 towers, its variables after training (weights, ``gamma``/``beta``, the moving statistics)
equal those of the same script under plain python on one device with the concatenated batch,
with the replaced library itself (tf.layers', tf-slim's ``batch_norm``, tensorpack's
``BatchNorm``, tf-keras' layer; legacy Keras, ``legacy_reference``); under plain python on 4
towers they differ (per-tower statistics), and on TensorFlow 2.16+ without tf-keras the
tf.layers and tf-slim scripts cannot run at all. The runner's report on stderr says OK.

``--strict`` stops a script with a hand-written ``tf.nn.moments`` batch norm before its first
step, with exit status 3 and a report naming the layer and the fix; without it, the same
script trains and the report says why it should not. A script that imports tf1_syncbn first
and calls ``patch_tf_layers(num_dev=...)`` itself keeps its own patch under the runner.

The runs are forked from an interpreter that has imported TensorFlow (``forked.run_python``):
what ``python -m tf1_syncbn.run`` ``exec``s, ``python tf1_syncbn/run/startup.py script.py``
with ``TF1_SYNCBN_RUN`` (the command line itself: test_run_startup.py), but for the script
that patches itself, a real ``python -m tf1_syncbn.run`` where TensorFlow is imported inside
the script's ``import tf1_syncbn``.
"""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import forked
import tf_behavior
from tf1_syncbn.run import STRICT_EXIT_STATUS
from unchanged import harness

TOWERS = 4
#: style -> (script, TF1_SYNCBN_RUN, needs tf-keras as tf.keras)
STYLES = {
    'layers-tower_loop': ('layers_towers.py', '--num-dev %d' % TOWERS, False),
    'slim-model_deploy': ('slim_clones.py', '--num-dev %d' % TOWERS, False),
    'tensorpack-trainer': ('tensorpack_trainer.py', '1', True),       # its TowerContext
    'keras-tower_loop': ('keras_towers.py', '--num-dev %d' % TOWERS, True),
}
# TF1 behaviour: the reference-variable paths of the two patches the runner adds on its own
# (tf.layers' and the new slim switch); tensorpack's and Keras' patches are the libraries'
# own, tested in both behaviours in their packages.
CASES = tf_behavior.pick(STYLES, ['layers-tower_loop', 'slim-model_deploy'])


@pytest.mark.parametrize('style', CASES)
def test_an_unchanged_script_under_the_runner_equals_one_device(style, tmp_path):
    name, options, legacy = STYLES[style]
    reference, control = harness.plain_runs(name, tmp_path, TOWERS)
    assert harness.differs(control, reference), 'plain python on 4 towers: per-tower statistics'
    status, stdout, stderr, ours = harness.under_runner(name, tmp_path, TOWERS, options, legacy)
    assert status == 0, stdout[-2000:] + stderr[-4000:]
    assert 'tf1_syncbn.run: OK' in stderr, stderr[-4000:]
    harness.assert_same(ours, reference)


@pytest.mark.once
@pytest.mark.parametrize('name', ['layers_towers.py', 'slim_clones.py'])
def test_without_the_runner_they_cannot_run_on_keras_3(name, tmp_path):
    """The same scripts under plain python on TensorFlow 2.16+ without tf-keras (this .venv)."""
    if not tf.__version__.startswith('2.') or tf.__version__.startswith('2.15'):
        pytest.skip('TensorFlow 2.15 runs tf.layers and slim.batch_norm on its Keras 2')
    status, _, stderr = forked.run_python([harness.script(name), str(TOWERS),
                                           str(tmp_path / 'out.npz')], tmp_path,
                                          dict(os.environ), 300)
    assert status != 0
    assert 'Keras 3' in stderr or 'keras' in stderr.lower(), stderr[-3000:]


def test_strict_stops_a_hand_written_batch_norm_before_its_first_step(tmp_path):
    report = tmp_path / 'report.json'
    status, stdout, stderr, _ = harness.under_runner(
        'hand_moments.py', tmp_path, 2, '--strict --report %s' % report)
    assert status == STRICT_EXIT_STATUS, stdout[-2000:] + stderr[-4000:]
    assert 'step 1 done' not in stdout
    assert 'stopped before the first training step' in stderr
    problems = [line for line in stderr.splitlines() if line.startswith('    - my_bn:')]
    assert problems and 'tf1_syncbn.moments' in problems[0], stderr[-4000:]
    document = json.loads(report.read_text())
    assert document['stopped'] and not document['ok']
    audit = document['graphs'][0]['audit']
    assert [layer['name'] for layer in audit['layers']] == ['my_bn']
    assert audit['layers'][0]['synchronized'] is False


@pytest.mark.once
def test_without_strict_the_script_trains_and_the_report_says_why(tmp_path):
    status, stdout, stderr, _ = harness.under_runner('hand_moments.py', tmp_path, 2)
    assert status == 0, stderr[-4000:]
    assert 'step 1 done' in stdout
    assert 'training goes on (--strict stops before the first step)' in stderr
    assert stderr.index('PROBLEMS') < stderr.index('training goes on')


@pytest.mark.once
def test_a_script_that_patches_itself_keeps_its_own_arguments(tmp_path):
    """It imports tf1_syncbn first, from-imports tf.layers' function, patches with num_dev.

    A real ``python -m tf1_syncbn.run`` (not forked): TensorFlow is first imported inside the
    script's ``import tf1_syncbn``, and the runner switches on once that import ends.
    """
    proc = subprocess.run(
        [sys.executable, '-m', 'tf1_syncbn.run', '--strict', harness.script('already_patched.py'),
         '2', str(tmp_path / 'out.npz')],
        cwd=harness.ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'), capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert 'step 1 done' in proc.stdout and 'tf1_syncbn.run: OK' in proc.stderr
    assert '2 layers: bn1, bn2  tower_0, tower_1  train  collective (group 2)' in proc.stderr
    assert 'restored: tf1_syncbn.layers' in proc.stdout   # the runner's switch came back


@pytest.mark.versions
def test_estimator_with_mirrored_strategy_under_the_runner_equals_one_device(tmp_path):
    if not hasattr(tf, 'estimator') or not hasattr(tf.estimator, 'Estimator'):
        pytest.skip('tf.estimator exists up to TensorFlow 2.15 (this is %s)' % tf.__version__)
    reference, control = harness.plain_runs('estimator_mirrored.py', tmp_path, TOWERS)
    assert harness.differs(control, reference)
    status, stdout, stderr, ours = harness.under_runner('estimator_mirrored.py', tmp_path,
                                                        TOWERS)
    assert status == 0, stdout[-2000:] + stderr[-4000:]
    assert 'tf1_syncbn.run: OK' in stderr, stderr[-4000:]
    harness.assert_same(ours, reference)

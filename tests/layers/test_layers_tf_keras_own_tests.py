"""tf-keras' own tests of tf.layers' batch normalization, ported, pass with this library's layer.

tf-keras tests its legacy layer in ``tf_keras/legacy_tf_layers/normalization_test.py``
(43 cases, in its GitHub repository; neither its wheel nor its sdist has it,
and this project does not ship a copy). ``tf_keras_normalization_port.py``
and its four case modules port it case by case (same names, inputs,
options and checks; see that module). This test runs the port in a
legacy-Keras subprocess, in this run's TF behaviour, against this library's
``tf1_syncbn.layers`` and, as a control, against tf-keras' own layer
(``tf_keras.src.legacy_tf_layers.normalization``, what
``tf.compat.v1.layers`` is with legacy Keras). The two runs go in parallel.

Every case passes with this library's layer except:

* :data:`PRIVATE_ATTRIBUTE_CASES`: tf-keras' checkpoint tests, whose model
  sets the private, test-only ``_bessels_correction_test_only = False`` of
  tf-keras' layer, which makes its fused path track the biased batch
  variance; this library follows tf.layers' public behaviour (the fused
  path tracks the Bessel-corrected one), so the moving variances of the
  fused and non-fused models of those tests differ (``testHalfPrecision``
  sets it too, but compares fused models only, and passes);
* in TF2-behaviour graph mode, :data:`TF2_BEHAVIOUR_CASES`, which tf-keras'
  own layer fails too. The original is ``@run_v1_only`` (tf.test would skip
  every case in TF2 behaviour); the port runs its cases in both behaviours,
  and there the layers create resource variables (``testCreateFusedBNFloat16``
  checks for reference variables) and a bool-tensor ``training`` normalizes
  the whole batch instead of ghost batches (the ``testGhostBN*`` cases with
  a placeholder). The library does what tf-keras does, so it fails them too.

Without a CUDA GPU, both runs skip :data:`GPU_CASES` (the original does
nothing in them then).

The tests assert these exact sets: an unexpected failure, or an expected one
that passes, fails them. The control leaves out the private-attribute cases
(tf-keras passes them; they are the port's slowest, about 45 s of CPU time
on its layer): set ``TF1_SYNCBN_TEST_TF_KERAS_CONTROL_ALL=1`` to run them too.
"""

import ast
import concurrent.futures
import glob
import json
import os

import pytest

import tf_behavior
import tf_keras_normalization_port as port
from legacy_reference import run_reference

#: The cases that set private attributes of tf-keras' layer and fail on them
#: (the model of ``_train`` sets ``_bessels_correction_test_only = False``).
PRIVATE_ATTRIBUTE_CASES = frozenset(
    'testCheckpoint%s' % name for name in (
        'FusedCPUAndFusedGPU', 'FusedCPUAndFusedCPU', 'FusedGPUAndFusedGPU',
        'NonFusedCPUAndNonFusedGPU', 'NonFusedCPUAndNonFusedCPU', 'NonFusedGPUAndNonFusedGPU',
        'NonFusedGPUAndFusedGPU', 'NonFusedGPUAndFusedCPU', 'NonFusedCPUAndFusedCPU'))
#: The cases tf-keras' own layer fails in TF2-behaviour graph mode.
TF2_BEHAVIOUR_CASES = frozenset([
    'testCreateFusedBNFloat16', 'testGhostBN2Dims', 'testGhostBN4DimsAxis1',
    'testGhostBN4DimsAxis3', 'testGhostBN5DimsMultiAxis14'])
#: The cases that run only with a CUDA GPU.
GPU_CASES = frozenset(['test4DInputAxis1', 'test4DInputAxis1Fused'])
#: Runs the control on the private-attribute cases too.
CONTROL_ALL_VARIABLE = 'TF1_SYNCBN_TEST_TF_KERAS_CONTROL_ALL'

CODE = '''
import json, sys
import tf_keras_normalization_port
outcomes, seconds = tf_keras_normalization_port.run(
    sys.argv[1], [n for n in sys.argv[2].split(',') if n])
with open('outcomes.json', 'w') as f:
    json.dump({'outcomes': outcomes, 'seconds': seconds}, f, indent=1, sort_keys=True)
print('RESULT outcomes.json')
'''


def _run(layer, leave_out, directory):
    directory.mkdir()
    run_reference(CODE, directory, args=[layer, ','.join(sorted(leave_out))], timeout=900)
    return json.loads((directory / 'outcomes.json').read_text())['outcomes']


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory):
    """``{'tf1_syncbn': {case: [outcome, message]}, 'keras': ...}``, the two runs in parallel."""
    tmp = tmp_path_factory.mktemp('tf_keras_normalization_port')
    control_leaves_out = () if os.environ.get(CONTROL_ALL_VARIABLE) == '1' else \
        PRIVATE_ATTRIBUTE_CASES
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ours = pool.submit(_run, 'tf1_syncbn', (), tmp / 'tf1_syncbn')
        control = pool.submit(_run, 'keras', control_leaves_out, tmp / 'keras')
        return {'tf1_syncbn': ours.result(), 'keras': control.result()}


def _not_passing(outcomes):
    return {name for name, (outcome, _) in outcomes.items()
            if outcome not in ('passed', 'not run', 'skipped')}


def _expected_keras_failures():
    return set() if tf_behavior.is_v1() else set(TF2_BEHAVIOUR_CASES)


def _describe(outcomes, names):
    return '\n'.join('  %s: %s %s' % (n, *outcomes.get(n, ['missing', ''])) for n in sorted(names))


def _check_cases_and_skips(outcomes):
    """Every original case has an outcome; only the GPU cases skip, and only without a GPU."""
    assert sorted(outcomes) == sorted(port.ORIGINAL_CASES), sorted(
        set(outcomes) ^ set(port.ORIGINAL_CASES))
    skipped = {n for n, (outcome, _) in outcomes.items() if outcome == 'skipped'}
    expected = set() if port.has_cuda_gpu() else set(GPU_CASES)
    assert skipped == expected, _describe(outcomes, skipped ^ expected)
    for name in skipped:
        assert outcomes[name][1].endswith(port.NEEDS_CUDA), outcomes[name]


def test_the_port_has_every_case_of_the_original_once():
    """Each of the 43 names is one function of one case module, and every case module runs.

    Read from the source (importing the modules would import tf-keras here).
    """
    found = []
    for name in port.CASE_MODULES:
        with open(os.path.join(port.HERE, name + '.py')) as f:
            tree = ast.parse(f.read())
        found += [node.name for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name.startswith('test')]
    assert sorted(found) == sorted(port.ORIGINAL_CASES)
    assert len(port.ORIGINAL_CASES) == len(set(port.ORIGINAL_CASES)) == 43
    on_disk = {os.path.basename(p)[:-3] for p in
               glob.glob(os.path.join(port.HERE, 'tf_keras_normalization_port_*.py'))}
    assert on_disk == set(port.CASE_MODULES)


@pytest.mark.timeout(900)
def test_tf_keras_passes_its_own_tests(outcomes):
    """The control: the port and its environment are sound (tf-keras' layer passes it)."""
    control = outcomes['keras']
    _check_cases_and_skips(control)
    unexpected = _not_passing(control) ^ _expected_keras_failures()
    assert not unexpected, 'tf-keras\' own layer, unexpected outcomes:\n' + _describe(
        control, unexpected)


@pytest.mark.timeout(900)
def test_the_library_passes_tf_keras_tests_but_the_private_attribute_ones(outcomes):
    ours = outcomes['tf1_syncbn']
    _check_cases_and_skips(ours)
    assert not [n for n, (outcome, _) in ours.items() if outcome == 'not run']
    expected = _expected_keras_failures() | PRIVATE_ATTRIBUTE_CASES
    unexpected = _not_passing(ours) ^ expected
    assert not unexpected, 'tf1_syncbn.layers, unexpected outcomes (failing when expected to ' \
        'pass, or passing when expected to fail):\n' + _describe(ours, unexpected)


@pytest.mark.timeout(900)
def test_the_private_attribute_cases_fail_on_the_tracked_variance_only(outcomes):
    """They fail in the comparison of the two models' moving variances, not with an error."""
    ours = outcomes['tf1_syncbn']
    for name in PRIVATE_ATTRIBUTE_CASES:
        outcome, message = ours[name]
        assert outcome == 'failed' and port.MODELS_DIFFER in message, (name, outcome, message)
        assert 'batch_normalization/moving_variance' in message, (name, message)


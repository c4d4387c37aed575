"""tf-keras' own tests of tf.layers' batch normalization, unchanged, pass with this library's layer.

tf-keras tests its legacy layer in ``tf_keras/legacy_tf_layers/normalization_test.py``
(43 cases; the wheel does not ship it: an unchanged copy is in
``tests/third_party/tf_keras/``). ``tf_keras_own_tests.py`` runs that file in
a legacy-Keras subprocess, in this run's TF behaviour, with the module it
imports as ``normalization_layers`` being this library's ``tf1_syncbn.layers``
and, as a control, tf-keras' own. The two runs go in parallel.

Every case passes with this library's layer except:

* :data:`PRIVATE_ATTRIBUTE_CASES`: tf-keras' checkpoint tests, whose model
  sets the private, test-only ``_bessels_correction_test_only = False`` of
  tf-keras' layer, which makes its fused path track the biased batch
  variance; this library follows tf.layers' public behaviour (the fused
  path tracks the Bessel-corrected one), so the moving variances of the
  "fused" and "non-fused" models of those tests differ;
* in TF2-behaviour graph mode, :data:`TF2_BEHAVIOUR_CASES`, which tf-keras'
  own layer fails too (the file is ``@run_v1_only``; the run lifts that
  decorator so that its cases run in both behaviours): the layers create
  resource variables there (``testCreateFusedBNFloat16`` checks for
  reference variables), and a bool-tensor ``training`` normalizes the whole
  batch instead of ghost batches (the ``testGhostBN*`` cases with a
  placeholder); the library does what tf-keras does, so it fails them too.

The tests assert these exact sets: an unexpected failure, or an expected one
that passes, fails them. The control leaves out the private-attribute cases
(tf-keras passes them; they are the file's slowest, about 45 s of CPU time
on its layer): set ``TF1_SYNCBN_TEST_TF_KERAS_CONTROL_ALL=1`` to run them too.
"""

import concurrent.futures
import hashlib
import json
import os

import pytest

import tf_behavior
import tf_keras_own_tests
from legacy_reference import run_reference

#: The cases that set private attributes of tf-keras' layer (the file's
#: ``_simple_model`` sets ``_bessels_correction_test_only = False``).
PRIVATE_ATTRIBUTE_CASES = frozenset(
    'testCheckpoint%s' % name for name in (
        'FusedCPUAndFusedGPU', 'FusedCPUAndFusedCPU', 'FusedGPUAndFusedGPU',
        'NonFusedCPUAndNonFusedGPU', 'NonFusedCPUAndNonFusedCPU', 'NonFusedGPUAndNonFusedGPU',
        'NonFusedGPUAndFusedGPU', 'NonFusedGPUAndFusedCPU', 'NonFusedCPUAndFusedCPU'))
#: The cases tf-keras' own layer fails in TF2-behaviour graph mode.
TF2_BEHAVIOUR_CASES = frozenset([
    'testCreateFusedBNFloat16', 'testGhostBN2Dims', 'testGhostBN4DimsAxis1',
    'testGhostBN4DimsAxis3', 'testGhostBN5DimsMultiAxis14'])
#: The file's cases (43), read from the copy: a new or renamed case fails the test.
CASES = 43
#: Runs the control on the private-attribute cases too.
CONTROL_ALL_VARIABLE = 'TF1_SYNCBN_TEST_TF_KERAS_CONTROL_ALL'
#: The SHA-256 of the unchanged copy (tests/third_party/tf_keras/README.md).
COPY_SHA256 = 'd1b0cb58d0db406ccec532fc84bf18cb3f51a322ee75cef6876e9affcf3b52de'

CODE = '''
import sys
import tf_keras_own_tests
outcomes, seconds = tf_keras_own_tests.run(sys.argv[1], [n for n in sys.argv[2].split(',') if n])
import json
with open('outcomes.json', 'w') as f:
    json.dump({'outcomes': outcomes, 'seconds': seconds}, f)
print('RESULT outcomes.json')
'''


def _run(layer, leave_out, directory):
    directory.mkdir()
    run_reference(CODE, directory, args=[layer, ','.join(sorted(leave_out))], timeout=900)
    return json.loads((directory / 'outcomes.json').read_text())['outcomes']


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory):
    """``{'tf1_syncbn': {case: [outcome, message]}, 'keras': ...}``, the two runs in parallel."""
    tmp = tmp_path_factory.mktemp('tf_keras_own_tests')
    control_leaves_out = () if os.environ.get(CONTROL_ALL_VARIABLE) == '1' else \
        PRIVATE_ATTRIBUTE_CASES
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ours = pool.submit(_run, 'tf1_syncbn', (), tmp / 'tf1_syncbn')
        control = pool.submit(_run, 'keras', control_leaves_out, tmp / 'keras')
        return {'tf1_syncbn': ours.result(), 'keras': control.result()}


def _not_passing(outcomes):
    return {name for name, (outcome, _) in outcomes.items() if outcome not in ('passed',
                                                                                  'not run')}


def _expected_keras_failures():
    return set() if tf_behavior.is_v1() else set(TF2_BEHAVIOUR_CASES)


def _describe(outcomes, names):
    return '\n'.join('  %s: %s %s' % (n, *outcomes.get(n, ['missing', ''])) for n in sorted(names))


@pytest.mark.timeout(900)
def test_tf_keras_passes_its_own_tests(outcomes):
    """The control: the file and its environment are sound (tf-keras' layer passes it)."""
    control = outcomes['keras']
    assert len(control) == CASES, sorted(control)
    unexpected = _not_passing(control) ^ _expected_keras_failures()
    assert not unexpected, 'tf-keras\' own layer, unexpected outcomes:\n' + _describe(
        control, unexpected)


@pytest.mark.timeout(900)
def test_the_library_passes_tf_keras_tests_but_the_private_attribute_ones(outcomes):
    ours = outcomes['tf1_syncbn']
    assert len(ours) == CASES, sorted(ours)
    assert not [n for n, (outcome, _) in ours.items() if outcome in ('skipped', 'not run')
                and n not in ('test4DInputAxis1', 'test4DInputAxis1Fused')]
    expected = _expected_keras_failures() | PRIVATE_ATTRIBUTE_CASES
    unexpected = _not_passing(ours) ^ expected
    assert not unexpected, 'tf1_syncbn.layers, unexpected outcomes (failing when expected to ' \
        'pass, or passing when expected to fail):\n' + _describe(ours, unexpected)


@pytest.mark.timeout(900)
def test_the_private_attribute_cases_fail_on_the_tracked_variance_only(outcomes):
    """They fail in the comparison of the two models' variables, not with an error."""
    ours = outcomes['tf1_syncbn']
    for name in PRIVATE_ATTRIBUTE_CASES:
        outcome, message = ours[name]
        assert outcome == 'failed' and 'DESIRED' in message, (name, outcome, message)


def test_the_copy_is_tf_keras_file_unchanged():
    """The copy's bytes are those recorded in its README (so no edit goes unnoticed)."""
    with open(tf_keras_own_tests.TEST_FILE, 'rb') as f:
        data = f.read()
    assert data.startswith(b'# Copyright 2015 The TensorFlow Authors. All Rights Reserved.\n')
    assert hashlib.sha256(data).hexdigest() == COPY_SHA256
    readme = os.path.join(os.path.dirname(os.path.dirname(tf_keras_own_tests.TEST_FILE)),
                          'README.md')
    with open(readme) as f:
        assert COPY_SHA256 in f.read()

"""Runs tf-keras' own tests of tf.layers' batch normalization against a given layer module.

tf-keras tests its legacy layer (``tf.compat.v1.layers.batch_normalization``)
in ``tf_keras/legacy_tf_layers/normalization_test.py``, which the wheel does
not ship; an unchanged copy lives in ``tests/third_party/tf_keras/`` (see its
README). This script runs that file in a legacy-Keras process
(``TF_USE_LEGACY_KERAS=1``, started by ``legacy_reference.run_reference``),
in the TF behaviour of the test run (``tf_behavior``), with the module it
imports as ``tf_keras.legacy_tf_layers.normalization`` being either tf-keras'
own (``keras``, the control) or one whose four names are
``tf1_syncbn.layers``' (``tf1_syncbn``)::

    python tf_keras_own_tests.py {keras|tf1_syncbn} OUT.json [CASE,CASE,...]

It writes ``{"outcomes": {test name: [outcome, message]}, "seconds": {test
name: seconds}}`` (outcome ``passed``, ``failed``, ``error``, ``skipped``,
or ``not run`` for the cases listed in the third argument) and prints
``RESULT OUT.json``.

The file's class is decorated ``@run_v1_only``: in TF2-behaviour graph mode
(the ``v2`` run) it would skip every case. There the decorator is lifted
(``test_util.run_v1_only`` is made a no-op before the file is imported), so
that the cases run in the run's behaviour; the file itself is unchanged.
"""

import importlib
import importlib.util
import json
import os
import sys
import time
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
#: The unchanged copy of tf-keras' test file.
TEST_FILE = os.path.join(HERE, 'third_party', 'tf_keras', 'legacy_tf_layers',
                         'normalization_test.py')
#: The test file's own module names (what ``from tf_keras.legacy_tf_layers import`` reads).
PACKAGE = 'tf_keras.legacy_tf_layers'


def _package(normalization):
    """A ``tf_keras.legacy_tf_layers`` package whose ``normalization`` is ``normalization``.

    tf-keras 2.21 keeps the legacy layers under ``tf_keras.src``; the file
    imports them from their old place. ``convolutional`` is tf-keras' own.
    """
    package = types.ModuleType(PACKAGE)
    package.__path__ = []
    package.convolutional = importlib.import_module('tf_keras.src.legacy_tf_layers.convolutional')
    package.normalization = normalization
    sys.modules[PACKAGE] = package
    sys.modules[PACKAGE + '.convolutional'] = package.convolutional
    sys.modules[PACKAGE + '.normalization'] = normalization
    return package


def _library_module():
    """A stand-in for tf-keras' legacy normalization module with the library's layer."""
    from tf1_syncbn import layers  # noqa: PLC0415 - only in the library's run
    module = types.ModuleType(PACKAGE + '.normalization')
    module.BatchNormalization = module.BatchNorm = layers.BatchNormalization
    module.batch_normalization = module.batch_norm = layers.batch_normalization
    return module


class _Outcomes(unittest.TestResult):
    """Records every test's outcome and the last line of its error."""

    def __init__(self):
        super().__init__()
        self.outcomes = {}
        self.seconds = {}

    def startTest(self, test):  # noqa: N802 - unittest's names
        super().startTest(test)
        self._start = time.time()

    def stopTest(self, test):  # noqa: N802
        super().stopTest(test)
        self.seconds[self._name(test)] = round(time.time() - self._start, 2)

    @staticmethod
    def _name(test):
        return test.id().split('.')[-1]

    def _record(self, test, outcome, err=None):
        message = ''
        if err is not None:
            text = self._exc_info_to_string(err, test).strip().splitlines()
            message = text[-1][:500] if text else ''
        self.outcomes[self._name(test)] = [outcome, message]

    def addSuccess(self, test):  # noqa: N802 - unittest's names
        self._record(test, 'passed')

    def addFailure(self, test, err):  # noqa: N802
        self._record(test, 'failed', err)

    def addError(self, test, err):  # noqa: N802
        self._record(test, 'error', err)

    def addSkip(self, test, reason):  # noqa: N802
        self.outcomes[self._name(test)] = ['skipped', reason]


def run(layer, leave_out=()):
    """Runs the file with ``layer`` (``'keras'`` or ``'tf1_syncbn'``), but the cases ``leave_out``.

    Returns:
      ``(outcomes, seconds)``: ``{case: [outcome, message]}`` for every case
      of the file, ``{case: seconds}`` for those that ran.
    """
    import tf_behavior  # noqa: PLC0415 - after the environment is set
    tf_behavior.apply()
    from absl import flags  # noqa: PLC0415
    from tensorflow.python.framework import test_util  # noqa: PLC0415
    flags.FLAGS.mark_as_parsed()     # (tf.test.main() would parse them)
    if not tf_behavior.is_v1():
        test_util.run_v1_only = lambda reason=None, func=None: (
            func if func is not None else (lambda f: f))
    if layer == 'keras':
        normalization = importlib.import_module('tf_keras.src.legacy_tf_layers.normalization')
    elif layer == 'tf1_syncbn':
        normalization = _library_module()
    else:
        raise ValueError('unknown layer %r' % (layer,))
    _package(normalization)
    spec = importlib.util.spec_from_file_location('tf_keras_normalization_test', TEST_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.normalization_layers is normalization
    result = _Outcomes()
    names = [n for n in unittest.defaultTestLoader.getTestCaseNames(module.BNTest)
             if n != 'test_session']          # TestCase's own, "Not a test."
    unknown = set(leave_out) - set(names)
    if unknown:
        raise ValueError('no such case(s) in %s: %s' % (TEST_FILE, sorted(unknown)))
    unittest.TestSuite([module.BNTest(n) for n in names if n not in leave_out]).run(result)
    for name in leave_out:
        result.outcomes[name] = ['not run', '']
    return result.outcomes, result.seconds


if __name__ == '__main__':
    outcomes, seconds = run(sys.argv[1], [n for n in ''.join(sys.argv[3:4]).split(',') if n])
    with open(sys.argv[2], 'w') as f:
        json.dump({'outcomes': outcomes, 'seconds': seconds}, f, indent=1, sort_keys=True)
    print('RESULT ' + sys.argv[2])

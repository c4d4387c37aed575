"""A port of tf-keras' tests of tf.layers' batch normalization: what its cases share, and a runner.

tf-keras tests its legacy layer (``tf.compat.v1.layers.BatchNormalization``
and ``batch_normalization``) in ``tf_keras/legacy_tf_layers/normalization_test.py``
of https://github.com/keras-team/tf-keras: 43 cases, methods of one
``tf.test.TestCase`` class, decorated ``@run_v1_only``. The file is in neither
tf-keras' wheel nor its sdist, and this project does not ship a copy of it.
It runs a port instead: the file as of commit
``6add81a967a830418b1507ac99ddba2d4e43a62b`` (tf-keras 2.15.0; the installed
tf-keras is 2.21), case by case. Every case is a
pytest function with the original's name, making the original's checks with
its inputs, shapes and options: outputs against its numpy formulas and
tolerances, variables and their counts, collections, update ops, errors.
The code is written anew, as plain functions of a ``layers`` argument (the
module under test). The cases are in:

* :mod:`tf_keras_normalization_port_checkpoints`: ``testHalfPrecision`` and
  the nine ``testCheckpoint*`` cases (train, save, restore, infer);
* :mod:`tf_keras_normalization_port_training`: the cases that train a layer
  for 100 steps and check that its output is normalized and its moving
  statistics are the data's (one axis, several axes, functional, reuse);
* :mod:`tf_keras_normalization_port_renorm`: batch renormalization and
  ``adjustment`` against the original's numpy models;
* :mod:`tf_keras_normalization_port_layer`: variables, collections,
  regularizers, constraints, ghost batches and invalid axes.

This module is the pytest plugin those modules need (fixture ``layers``;
an autouse fixture that gives every case what ``tf.test.TestCase.setUp``
gave it: a new default graph with seed ``87654321``, and numpy's and
``random``'s generators seeded the same) and the helpers that stand in for
the test case's methods (:func:`session`, :func:`evaluate`,
:func:`assert_all_close`, :func:`assert_almost_equal`,
:func:`assert_list_equal`), with the same semantics. ``$TF1_SYNCBN_PORT_LAYERS``
names the module under test: ``tf1_syncbn`` (``tf1_syncbn.layers``) or
``keras`` (tf-keras' own, ``tf_keras.src.legacy_tf_layers.normalization``,
what ``tf.compat.v1.layers`` is with legacy Keras).

Where the port differs in form only: the two cases the original guards
with ``is_gpu_available(cuda_only=True)`` skip, visibly, where it would pass
without doing anything; a check the original makes twice in a row (the
number of update ops in ``testCreateBN`` and ``testCreateFusedBNFloat16``) is
made once; ``var.dtype._is_ref_dtype`` is checked as ``dtype !=
dtype.base_dtype``; checkpoints go to pytest's ``tmp_path``; failed
comparisons name what they compare.

``tests/layers/test_layers_tf_keras_own_tests.py`` runs the port with :func:`run`, once per
module, each in a legacy-Keras subprocess in the TF behaviour of the test run.
By hand (``tests/conftest.py`` applies ``$TF1_SYNCBN_TEST_BEHAVIOR``)::

    TF_USE_LEGACY_KERAS=1 TF1_SYNCBN_PORT_LAYERS=keras PYTHONPATH=tests/support/for_layers \\
        .venv/bin/python -m pytest -p tf_keras_normalization_port \\
        tests/support/for_layers/tf_keras_normalization_port_*.py
"""

import contextlib
import importlib
import os
import random
import sys
import time
import types

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

HERE = os.path.dirname(os.path.abspath(__file__))
#: The modules of the port, in the order they run.
CASE_MODULES = ('tf_keras_normalization_port_checkpoints', 'tf_keras_normalization_port_training',
                'tf_keras_normalization_port_renorm', 'tf_keras_normalization_port_layer')
#: The original's 43 cases, in its order: the port has exactly these.
ORIGINAL_CASES = (
    'testHalfPrecision',
    'testCheckpointFusedCPUAndFusedGPU', 'testCheckpointFusedCPUAndFusedCPU',
    'testCheckpointFusedGPUAndFusedGPU', 'testCheckpointNonFusedCPUAndNonFusedGPU',
    'testCheckpointNonFusedCPUAndNonFusedCPU', 'testCheckpointNonFusedGPUAndNonFusedGPU',
    'testCheckpointNonFusedGPUAndFusedGPU', 'testCheckpointNonFusedGPUAndFusedCPU',
    'testCheckpointNonFusedCPUAndFusedCPU',
    'testCreateBN', 'testCreateFusedBNFloat16', 'test3DInputAxis1', 'test3DInputAxis2',
    'test4DInputAxis1', 'test4DInputAxis2', 'test4DInputAxis3', 'test4DInputAxis3Fused',
    'test4DInputAxis1Fused', 'testNegativeAxis', 'testBooleanLearningPhase',
    'testFunctionalNoReuse', 'testFunctionalReuse', 'testFunctionalReuseFromScope',
    'testNoCenter', 'testNoScale', 'testRegularizers', 'testConstraints', 'testRenorm',
    'testRenormNoClippingSameMomentumGivesSameTestTrain', 'testAdjustment',
    'testRenormWithAdjustment', 'testGhostBNNegativeVirtualBatch', 'testGhostBNVirtualBatchFull',
    'testGhostBNInputOutputShapesMatch', 'testGhostBNUnknownBatchSize', 'testGhostBN2Dims',
    'testGhostBN4DimsAxis3', 'testGhostBN4DimsAxis1', 'testMultiAxisInvalid',
    'test3DInputMultiAxis12', 'test5DInputMultiAxis123', 'testGhostBN5DimsMultiAxis14')
#: Selects the module under test.
LAYERS_VARIABLE = 'TF1_SYNCBN_PORT_LAYERS'
LAYER_MODULES = {'tf1_syncbn': 'tf1_syncbn.layers',
                 'keras': 'tf_keras.src.legacy_tf_layers.normalization'}
#: tf.test.TestCase's seed (``random_seed.DEFAULT_GRAPH_SEED``).
SEED = 87654321
#: What the comparison that the nine checkpoint cases fail with tf1_syncbn says.
MODELS_DIFFER = "the fused and the non-fused model's variables differ"
#: The reason the two cases that need a CUDA GPU give when there is none.
NEEDS_CUDA = 'needs a CUDA GPU (the original does nothing without one)'

tf1 = tf.compat.v1


def layer_module(name=None):
    """The module under test: ``name`` (default: ``$TF1_SYNCBN_PORT_LAYERS``).

    The cases call the four names of tf-keras' module (``BatchNormalization``
    and ``batch_normalization``, and its aliases ``BatchNorm`` and
    ``batch_norm``); for tf1_syncbn, whose module has the first two only, a
    namespace that gives the aliases the same layer and function.
    """
    name = name or os.environ.get(LAYERS_VARIABLE, '')
    if name not in LAYER_MODULES:
        raise ValueError('%s=%r: use one of %s' % (LAYERS_VARIABLE, name, sorted(LAYER_MODULES)))
    module = importlib.import_module(LAYER_MODULES[name])
    if name == 'keras':
        return module
    return types.SimpleNamespace(
        __name__=module.__name__, BatchNormalization=module.BatchNormalization,
        BatchNorm=module.BatchNormalization, batch_normalization=module.batch_normalization,
        batch_norm=module.batch_normalization)


@pytest.fixture
def layers():
    """The module under test (``BatchNormalization``, ``batch_normalization``, ``batch_norm``)."""
    return layer_module()


@pytest.fixture(autouse=True)
def _as_in_test_case_set_up():
    """A new default graph seeded as tf.test.TestCase seeds it; numpy and random seeded too."""
    random.seed(SEED)
    np.random.seed(SEED)
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(SEED)
        yield graph


def has_cuda_gpu():
    """Whether TensorFlow sees a CUDA GPU (the original's ``is_gpu_available(cuda_only=True)``)."""
    return tf.test.is_built_with_cuda() and bool(tf.config.list_physical_devices('GPU'))


@contextlib.contextmanager
def session(graph=None, use_gpu=True):
    """A session on ``graph`` (default: the default graph), made default with its graph.

    Configured as tf.test.TestCase configures its sessions: soft placement,
    no graph-level optimizer, no constant folding or pin-to-host rewriting;
    pinned to the CPU when ``use_gpu`` is False.
    """
    graph = graph if graph is not None else tf1.get_default_graph()
    config = tf1.ConfigProto(allow_soft_placement=True)
    config.graph_options.optimizer_options.opt_level = -1
    rewrites = config.graph_options.rewrite_options
    rewrites.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    rewrites.pin_to_host_optimization = rewriter_config_pb2.RewriterConfig.OFF
    with tf1.Session(graph=graph, config=config) as sess, graph.as_default(), sess.as_default():
        if use_gpu:
            yield sess
        else:
            with graph.device('/device:CPU:0'):
                yield sess


def evaluate(fetches):
    """``fetches``' values in the default session."""
    return tf1.get_default_session().run(fetches)


def assert_all_close(first, second, rtol=1e-6, atol=1e-6, what=''):
    """tf.test's ``assertAllClose``: same shape, ``|first - second| <= atol + rtol * |second|``."""
    first, second = np.asarray(first), np.asarray(second)
    if first.shape != second.shape:
        raise AssertionError('%s: shapes differ: %s and %s' % (what, first.shape, second.shape))
    np.testing.assert_allclose(first, second, rtol=rtol, atol=atol, equal_nan=True, err_msg=what)


def assert_almost_equal(value, expected, places, what=''):
    """unittest's ``assertAlmostEqual``: their difference rounds to 0 at ``places`` decimals."""
    if value != expected and round(abs(expected - value), places) != 0:
        raise AssertionError('%s: %r != %r within %d places' % (what, value, expected, places))


def assert_list_equal(first, second, what=''):
    """unittest's ``assertListEqual``: two lists, equal."""
    if not isinstance(first, list) or not isinstance(second, list):
        raise AssertionError('%s: not two lists: %r, %r' % (what, type(first), type(second)))
    if first != second:
        raise AssertionError('%s: %r != %r' % (what, first, second))


class _Recorder:
    """Records each case's outcome, message and time; leaves out the cases asked."""

    def __init__(self, leave_out):
        self.leave_out = frozenset(leave_out)
        self.collected = []
        self.outcomes = {}
        self.seconds = {}

    def pytest_collection_modifyitems(self, config, items):
        self.collected = [item.name for item in items]
        dropped = [item for item in items if item.name in self.leave_out]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if item.name not in self.leave_out]

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.rpartition('::')[2]
        self.seconds[name] = round(self.seconds.get(name, 0.0) + report.duration, 2)
        if report.skipped:
            longrepr = report.longrepr
            outcome = ['skipped', longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)]
        elif report.failed:
            crash = getattr(report.longrepr, 'reprcrash', None)
            message = crash.message if crash is not None else str(report.longrepr)
            failed = report.when == 'call' and message.startswith(('AssertionError', 'Failed'))
            outcome = ['failed' if failed else 'error', message[:2000]]
        elif report.when == 'call':
            outcome = ['passed', '']
        else:
            return
        if self.outcomes.get(name, ['passed'])[0] == 'passed':
            self.outcomes[name] = outcome


def run(layer, leave_out=()):
    """Runs the port with ``layer`` (``'tf1_syncbn'`` or ``'keras'``), but the cases ``leave_out``.

    Call in a fresh process (the legacy-Keras subprocess of
    ``legacy_reference.run_reference``): it puts TensorFlow into the run's
    behaviour (``tf_behavior``) and runs pytest on the case modules.

    Returns:
      ``(outcomes, seconds)``: ``{case: [outcome, message]}`` for every case
      (outcome ``passed``, ``failed`` (a check), ``error``, ``skipped``, or
      ``not run`` for those left out), ``{case: seconds}`` for those that ran.

    Raises:
      ValueError: for a case in ``leave_out`` that the port does not have.
      RuntimeError: when pytest could not run the cases.
    """
    import tf_behavior
    unknown = set(leave_out) - set(ORIGINAL_CASES)
    if unknown:
        raise ValueError('no such case(s): %s' % sorted(unknown))
    if layer not in LAYER_MODULES:
        raise ValueError('unknown layer module %r: use one of %s' % (layer, sorted(LAYER_MODULES)))
    os.environ[LAYERS_VARIABLE] = layer
    tf_behavior.apply()
    recorder = _Recorder(leave_out)
    paths = [os.path.join(HERE, name + '.py') for name in CASE_MODULES]
    start = time.time()
    status = pytest.main(['-q', '--tb=short', '--noconftest', '-p', 'no:cacheprovider',
                          '-p', 'no:warnings']
                         + paths,
                         plugins=[recorder, sys.modules[__name__]])
    if status not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        raise RuntimeError('pytest could not run the port (exit status %s)' % (status,))
    for name in leave_out:
        recorder.outcomes[name] = ['not run', '']
    recorder.seconds['(all)'] = round(time.time() - start, 2)
    return recorder.outcomes, recorder.seconds

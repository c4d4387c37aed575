"""Shared fixtures: the TF behaviour of the run, graph mode and virtual CPU devices.

The whole process runs in one TF behaviour, chosen by
``$TF1_SYNCBN_TEST_BEHAVIOR`` (``v2``: TF2-behaviour graph mode, the default;
``v1``: ``tf.compat.v1.disable_v2_behavior()``); see ``tf_behavior.py``.
``make test`` runs the suite once in each.
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: The helpers (tf_behavior, references, the scripts the tests start): tests/support.
SUPPORT = os.path.join(HERE, 'support')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)
import support_paths  # noqa: E402

# Scripts the tests start import tf_behavior (and the packages) from here: tests/support and
# its for_<package>/ folders (support_paths), then the root.
os.environ['PYTHONPATH'] = support_paths.pythonpath(os.environ.get('PYTHONPATH'))
# The test modules, in tests/<package>/, import the helpers and conftest by name.
if HERE not in sys.path:
    sys.path.insert(0, HERE)
support_paths.install()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_behavior  # noqa: E402

tf_behavior.apply()

from tower import virtual_cpu_config  # noqa: E402

MAX_DEVICES = 8

#: The timing report (`--suite-times=PATH`, tests/support/suite_times.py).
pytest_plugins = ["suite_times"]


@pytest.fixture
def graph():
    """A fresh default graph for the test."""
    g = tf.Graph()
    with g.as_default():
        yield g


def make_session(graph, num_devices=MAX_DEVICES):
    """A session on ``graph`` with ``num_devices`` virtual CPUs."""
    return tf.compat.v1.Session(graph=graph, config=virtual_cpu_config(num_devices))


def assert_first_run_fails(graph, fetches, feed, error, match=None, devices=MAX_DEVICES,
                           within=30):
    """The first run of ``fetches`` (variables initialized) raises ``error`` in ``within`` s.

    For what must stop a step long before any collective's timeout (no hang).

    Args:
      graph: the graph, run in a session on ``devices`` virtual CPUs.
      fetches, feed: the run's.
      error: the ``tf.errors`` class expected.
      match: ``pytest.raises``' pattern for the message.
      devices: the number of virtual CPUs.
      within: the seconds the run may take before it fails.
    """
    with make_session(graph, devices) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        start = time.time()
        with pytest.raises(error, match=match):
            sess.run(fetches, feed)
        assert time.time() - start < within


@pytest.fixture
def rng():
    return np.random.RandomState(1234)


@pytest.fixture(params=['custom', 'stock'])
def kernel_impl(request):
    """Runs a test once with the compiled CPU kernels and once with TF's stock kernels."""
    from tf1_syncbn import kernels
    with kernels.use_custom_kernels(request.param == 'custom'):
        if request.param == 'custom':
            assert kernels.load() is not None, kernels.status()
        yield request.param


@pytest.fixture(scope='session', autouse=True)
def _stock_child_checks():
    """In a child run of ``without_onednn``: oneDNN is off and the custom kernels disabled.

    So that a child that inherited the wrong environment fails instead of
    passing on the configuration it was meant to avoid.
    """
    from without_onednn import in_child  # noqa: PLC0415
    if in_child():
        from tensorflow.python.util import _pywrap_util_port  # noqa: PLC0415
        from tf1_syncbn import kernels  # noqa: PLC0415
        assert not _pywrap_util_port.IsMklEnabled(), 'oneDNN is on in the stock child run'
        assert not kernels.enabled(), 'the custom kernels are enabled in the stock child run'
    yield


def pytest_report_header(config):
    del config
    return 'TF behaviour: %s (%s=%s)' % (
        'TF1 (disable_v2_behavior)' if tf_behavior.is_v1() else 'TF2-behaviour graph mode',
        tf_behavior.VARIABLE, tf_behavior.name())


def pytest_configure(config):
    config.addinivalue_line(
        'markers', 'once: runs in the TF2-behaviour pass only; what it tests does not depend on '
        'the TF behaviour (see tf_behavior.py)')
    config.addinivalue_line(
        'markers', 'versions: in the subset `make test-tf<version>` runs on every supported '
        'TensorFlow (every front-end, every patch, the Estimator harness; docs/testing.md)')


#: The modules that take longest (docs/testing.md, "How long it takes"), longest
#: first. pytest-xdist hands whole modules (--dist loadfile) to its workers in
#: collection order: started first, they do not leave one worker running alone
#: at the end of a pass while the other idles. Each pass keeps the rest in
#: pytest's order.
LONGEST_FIRST = (
    'conformance/test_conformance.py', 'slim/test_slim_parity.py', 'keras/test_keras_models.py',
    'distributed/test_multi_worker_demo.py', 'layers/test_layers_parity.py',
    'project/test_readme.py', 'tensorpack/test_tensorpack_parity.py',
    'tensorpack/test_tensorpack_trainers.py', 'distributed/test_multi_worker_training.py',
    'core/test_resume_meta_graph.py', 'core/test_custom_getter.py',
    'layers/test_layers_tf_keras_own_tests.py', 'tower/test_tower_distribute_multi_worker.py',
    'audit/test_audit.py', 'kernels/test_kernel_build.py', 'layers/test_layers_harness.py',
)


def _longest_first(item):
    path = item.nodeid.split('::')[0]
    for rank, suffix in enumerate(LONGEST_FIRST):
        if path.endswith(suffix):
            return rank
    return len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """Puts the longest modules first; the TF1-behaviour pass leaves out tests marked ``once``."""
    items.sort(key=_longest_first)      # stable: each module's own order stays
    if not tf_behavior.is_v1():
        return
    once = [item for item in items if item.get_closest_marker('once') is not None]
    if once:
        config.hook.pytest_deselected(items=once)
        items[:] = [item for item in items if item.get_closest_marker('once') is None]

"""The exactness and name-scope harness tests on the stock kernel set with oneDNN off.

The exactness, numerics and formats modules run their tests on both kernel
sets in the test process (the ``kernel_impl`` fixture, with TensorFlow's
oneDNN rewrites on, as on any CPU); the name-scope harness module on the
compiled kernels (``without_onednn.kernel_sets``). GPU towers run the stock
set on TensorFlow's plain kernels, whose CPU stand-in is
``TF_ENABLE_ONEDNN_OPTS=0 TF1_SYNCBN_KERNELS=0``: read at process start, so
the modules' stock cases run again in one child pytest (``without_onednn``);
each module's test names every failing case of it with its error. (The parity
modules run their own child, which reuses their reference results.)
"""

import importlib
import os
import sys

import pytest

import tf_behavior
from without_onednn import ChildRun, count_kernel_cases

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The TF1-behaviour pass (tf_behavior.pick): exactness (every path) and formats (every
# rank and layout: Dimension shapes); the parity modules run their own stock child.
MODULES = tf_behavior.pick(['compute/test_exactness.py', 'compute/test_numerics.py',
                            'compute/test_formats.py', 'tower/test_tower_name_scopes.py',
                            'sync/test_sync_groups.py'],
                           ['compute/test_exactness.py', 'compute/test_formats.py'])


def _module(path):
    """The test module at ``path`` (under tests/), imported as pytest does (its folder first on
    ``sys.path``, the file's name as the module's): the same module object pytest runs."""
    folder = os.path.join(TESTS, os.path.dirname(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(os.path.splitext(os.path.basename(path))[0])


@pytest.fixture(scope='module')
def child(tmp_path_factory):
    """One child run over every module (one interpreter start for all)."""
    files = [_module(path).__file__ for path in MODULES]
    return ChildRun(files, tmp_path_factory.mktemp('stock_without_onednn'))


@pytest.mark.parametrize('name', MODULES)
def test_stock_kernels_without_onednn(name, child):
    module = _module(name)
    expected = count_kernel_cases(module)
    assert expected > 0, '%s has no test on both kernel sets' % name
    child.check(module.__file__, expected)

"""The exactness and harness tests on the stock kernel set with oneDNN off.

Each module below runs its tests on both kernel sets in the test process
(the ``kernel_impl`` fixture, with TensorFlow's oneDNN rewrites on, as on any
CPU). GPU towers run the stock set on TensorFlow's plain kernels, whose CPU
stand-in is ``TF_ENABLE_ONEDNN_OPTS=0 TF1_SYNCBN_KERNELS=0``: read at process
start, so each module's stock cases run again in a child pytest
(``without_onednn``), which names every failing case with its error. (The
parity modules run their own child, which reuses their reference results.)
"""

import importlib

import pytest

from without_onednn import count_kernel_cases, run_stock_cases_without_onednn

MODULES = ['test_sync_exactness', 'test_sync_numerics', 'test_sync_formats',
           'test_harness_name_scopes']


@pytest.mark.parametrize('name', MODULES)
def test_stock_kernels_without_onednn(name, tmp_path):
    module = importlib.import_module(name)
    expected = count_kernel_cases(module)
    assert expected > 0, '%s has no test on both kernel sets' % name
    run_stock_cases_without_onednn(module.__file__, tmp_path, expected)

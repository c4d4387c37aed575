"""The conformance matrix: every front-end x harness x option matches the oracle or is refused.

Each cell (``tests/support/conformance/matrix.py``) builds a front-end's
layer (as users call it) in a harness (as its scripts build towers), with
one option, on one kernel set, in this process's TF behaviour, and must
either

* **match** the oracle, the replaced layer on one device with each sync
  group's concatenated batch (``conformance/oracle.py``, one legacy-Keras
  subprocess for every reference of the run): every tower's output, the
  input and parameter gradients, and the variables (the moving statistics,
  of global tower 0's group) read back in a run of their own, as a
  ``Saver`` saved them and as restored into a fresh session; with no
  ``SyncBNWarning`` naming the layer; or
* be **refused** at graph build with the ``ValueError`` / ``TypeError`` the
  matrix names, whose message matches its pattern.

One graph per harness holds every cell of the run that should build (each
front-end on its own towers' inputs, in its own variable scope), and one
step runs them all; each refusal is built alone. ``make test`` runs a
covering set (``matrix.covering_set``: every two values of front-end,
harness, option and kernel set that meet in some cell meet in a chosen
one), the TF1-behaviour pass its picks (``matrix.v1_picks``);
``make test-full`` every cell. The stock kernel set runs here where oneDNN
is off, else in a child pytest with oneDNN off (``without_onednn``), which
reuses this run's references.
"""

import os
import pathlib
import re

import numpy as np
import pytest

from conformance import matrix, oracle, run
from parity_harness import HALF_EPS, assert_same_numbers
from without_onednn import in_child, kernel_sets, run_stock_cases_without_onednn

# The first test of a harness builds and runs its whole graph; the first test of the
# module computes every reference in one subprocess (its own limit: 900 s).
pytestmark = pytest.mark.timeout(1200)

#: Where a child run (without_onednn) finds this run's references.
REFERENCE_DIR_VARIABLE = 'TF1_SYNCBN_TEST_CONFORMANCE_REFERENCE'

CELLS = matrix.selected()
#: The cells this process runs: its kernel sets' (the stock ones in a child where oneDNN is on).
HERE = [cell for cell in CELLS if cell.kernel_set in kernel_sets()]
STOCK_ELSEWHERE = [cell for cell in CELLS if cell.kernel_set not in kernel_sets()]


#: The marks a column's cells may carry (``make test-tf<v>`` collects the modules that name
#: ``pytest.mark.versions``: the Estimator's cells run in the version subset on 2.15).
MARKS = {'versions': pytest.mark.versions}


def _param(cell):
    return pytest.param(cell, id=cell.id, marks=[MARKS[mark] for mark in cell.harness.marks])


def _requests(cells):
    """The references the cells need: (front-end, option, groups), once each."""
    wanted = {}
    for cell in cells:
        outcome = cell.expected
        if outcome.kind == matrix.MATCH:
            wanted.setdefault(oracle.request_key(cell.front_end, cell.option, outcome.groups),
                              (cell.front_end, cell.option, outcome.groups))
    return wanted


#: The comparison can fail: references of other groupings of one option's data, which
#: ``test_the_oracle_tells_the_groupings_apart`` compares.
GROUPINGS_OPTION = 'group_size=2'
GROUPINGS = (((0, 1), (2, 3)), ((0, 1, 2, 3),), ((0,), (1,), (2,), (3,)))


def _grouping_requests():
    from conformance import front_ends, options  # noqa: PLC0415
    option = options.BY_NAME[GROUPINGS_OPTION]
    return {oracle.request_key(front_end, option, groups): (front_end, option, groups)
            for front_end in (front_ends.BY_NAME['sync_batch_norm'],
                              front_ends.BY_NAME['moments'])
            for groups in GROUPINGS}


def _selected(session):
    """The cells of this run's selected tests (``-k``, ``-m``), the stock child's included."""
    cells = [item.callspec.params['cell'] for item in session.items
             if item.originalname == 'test_cell' and item.module.__name__ == __name__]
    if any(item.originalname == 'test_stock_kernel_cells_without_onednn'
           for item in session.items):
        cells += STOCK_ELSEWHERE
    return cells


@pytest.fixture(scope='module')
def reference_dir(request, tmp_path_factory):
    """Where every reference of this run's selected cells is (the stock child's too), computed
    once. A child run (``without_onednn``) reads its parent's.
    """
    if os.environ.get(REFERENCE_DIR_VARIABLE):
        return pathlib.Path(os.environ[REFERENCE_DIR_VARIABLE])
    wanted = _requests(_selected(request.session))
    if any(item.originalname == 'test_the_oracle_tells_the_groupings_apart'
           for item in request.session.items):
        wanted.update(_grouping_requests())
    folder = tmp_path_factory.mktemp('conformance')
    oracle.compute(list(wanted.values()), folder)
    return folder


@pytest.fixture(scope='module')
def references(reference_dir):
    return oracle.load(str(reference_dir / 'oracle.npz'))


@pytest.fixture(scope='module')
def harness_results():
    """``harness_results(harness)``: every cell of that harness here, run once (one graph)."""
    done = {}

    def get(harness):
        if harness.name not in done:
            cells = [cell for cell in HERE if cell.harness is harness]
            match = [c for c in cells if c.expected.kind == matrix.MATCH]
            refused = [c for c in cells if c.expected.kind == matrix.REFUSED]
            if harness.workers:
                # Worker processes (one launch for the column's cells of this run; a failed
                # launch fails each of its cells, and is not launched again for each).
                try:
                    done[harness.name] = run.run_cells_in_workers(harness, match, refused)
                except Exception as e:  # noqa: BLE001 - raised again by each of its cells
                    done[harness.name] = e
            else:
                done[harness.name] = run.run_cells(type(harness), match, refused)
        if isinstance(done[harness.name], Exception):
            raise done[harness.name]
        return done[harness.name]

    return get


def _describe(error):
    return '%s: %s' % (type(error).__name__, ' '.join(str(error).split())[:1500])


@pytest.mark.parametrize('cell', [_param(cell) for cell in HERE])
def test_cell(cell, references, harness_results):
    outcome = cell.expected
    result = harness_results(cell.harness)[cell.id]
    if outcome.kind == matrix.REFUSED:
        assert result.error is not None, (
            'expected a refusal at graph build (%s), but the layer was built%s'
            % (outcome.reason, '; it warned: %s' % result.warnings if result.warnings else ''))
        assert isinstance(result.error, outcome.errors), (
            'expected %s (%s), got %s' % ('/'.join(e.__name__ for e in outcome.errors),
                                          outcome.reason, _describe(result.error)))
        assert re.search(outcome.pattern, str(result.error)), (
            'the refusal does not say what works instead (%s; %r): %s'
            % (outcome.reason, outcome.pattern, _describe(result.error)))
        return
    assert result.error is None, 'expected to match the oracle (%s), got %s' % (
        outcome.reason, _describe(result.error))
    assert not result.warnings, 'a cell that matches may not warn: %s' % result.warnings
    key = oracle.request_key(cell.front_end, cell.option, outcome.groups)
    reference = references[key]
    assert 'error' not in reference, 'the oracle failed: %s' % reference['error']
    option = cell.option
    case = {'name': cell.id, 'dtype': option.dtype, 'loc': option.loc, 'scale': option.scale}
    if cell.front_end.family == 'moments' and option.dtype in HALF_EPS:
        # moments returns statistics of the input's type: where two float32 sums differ
        # by a rounding error, they round one unit apart, and so do the gradients of
        # gamma and beta computed from them (to the type's resolution).
        grads = {k for k in reference if k.startswith('grad/')}
        assert_same_numbers({k: v for k, v in result.arrays.items() if k in grads},
                            {k: v for k, v in reference.items() if k in grads},
                            dict(case, tolerance=HALF_EPS[option.dtype] / 1e-4),
                            len(option.sizes))
        result.arrays = {k: v for k, v in result.arrays.items() if k not in grads}
        reference = {k: v for k, v in reference.items() if k not in grads}
    assert_same_numbers(result.arrays, reference, case, len(option.sizes))
    if cell.kernels == 'stock':
        assert result.kernel_ops == 0, 'the stock kernel set built compiled-kernel ops'


@pytest.mark.once
def test_the_oracle_tells_the_groupings_apart(references):
    """The comparison can fail: on one option's data, the groupings' references all differ."""
    for front_end in ('sync_batch_norm', 'moments'):
        found = [references['%s|%s|%s' % (front_end, GROUPINGS_OPTION, '/'.join(
            ','.join(str(t) for t in group) for group in groups))] for groups in GROUPINGS]
        for one, other in ((0, 1), (0, 2), (1, 2)):
            assert not np.allclose(found[one]['y/0'], found[other]['y/0'], atol=1e-3)
            if front_end == 'sync_batch_norm':
                key = 'var/BatchNorm/moving_mean'
                assert not np.allclose(found[one][key], found[other][key], atol=1e-3)


@pytest.mark.skipif(not STOCK_ELSEWHERE or in_child(),
                    reason='the stock kernel cells ran here (oneDNN is off), or none is selected')
def test_stock_kernel_cells_without_onednn(reference_dir, tmp_path):
    """The stock kernel set's cells, in a child pytest with oneDNN off and this run's references."""
    run_stock_cases_without_onednn(__file__, tmp_path, expected=len(STOCK_ELSEWHERE),
                                   extra_env={REFERENCE_DIR_VARIABLE: str(reference_dir)},
                                   timeout=1200, keyword='stock and test_cell')

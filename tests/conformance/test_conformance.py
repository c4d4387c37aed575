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
reuses this run's references. A column whose cells need what ``make test``
does not have (``Harness.runs_in``: the ``horovod`` column, Horovod) is left
out here: its own module runs its cells with this module's machinery
(``conformance/check.py``), and :func:`test_columns_that_run_elsewhere` says
where.
"""

import os
import pathlib

import numpy as np
import pytest

from conformance import check, harnesses, matrix, oracle
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
    cells = check.selected_cells(session, __name__)
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
    wanted = check.requests(_selected(request.session))
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
def harness_results(request):
    """``harness_results(harness)``: the selected cells of that harness here (``-k``), run
    once (one graph, or one launch of its workers)."""
    return check.HarnessResults(check.selected_cells(request.session, __name__))


@pytest.mark.parametrize('cell', [_param(cell) for cell in HERE])
def test_cell(cell, references, harness_results):
    check.check_cell(cell, harness_results(cell.harness)[cell.id], references)


def test_columns_that_run_elsewhere():
    """The columns left out here (``Harness.runs_in``), named with where their cells run."""
    elsewhere = [h for h in harnesses.HARNESSES if h.runs_in]
    assert not [cell for cell in CELLS if cell.harness.runs_in]
    if elsewhere:
        pytest.skip('left out here: %s' % '; '.join(
            'the %s column (%d cells of this run; they run in %s)'
            % (h.name, len(matrix.selected(h)), h.runs_in) for h in elsewhere))


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
        if front_end == 'sync_batch_norm':
            # ... and per-tower statistics read as tower 0's from their mean over the towers
            # (tf-keras' own variables under a strategy: matrix.Outcome.replica_mean).
            per_tower = found[GROUPINGS.index(((0,), (1,), (2,), (3,)))]
            assert not np.allclose(per_tower['var/BatchNorm/moving_mean'],
                                   per_tower['mean/BatchNorm/moving_mean'], atol=1e-3)


@pytest.mark.skipif(not STOCK_ELSEWHERE or in_child(),
                    reason='the stock kernel cells ran here (oneDNN is off), or none is selected')
def test_stock_kernel_cells_without_onednn(reference_dir, tmp_path):
    """The stock kernel set's cells, in a child pytest with oneDNN off and this run's references."""
    run_stock_cases_without_onednn(__file__, tmp_path, expected=len(STOCK_ELSEWHERE),
                                   extra_env={REFERENCE_DIR_VARIABLE: str(reference_dir)},
                                   timeout=1200, keyword='stock and test_cell')

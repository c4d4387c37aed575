"""The conformance matrix's ``horovod`` column, run under ``horovodrun --gloo`` with 4 processes.

The column (``conformance.harnesses.Horovod``: one process per device, each
building its one tower outside any tower with ``sync_statistics='horovod'``,
as docs/horovod.md tells users) needs Horovod, so ``make test`` leaves it out
(``tests/conformance/test_conformance.py``, its ``runs_in``) and ``make
test-horovod`` runs it here, in both TF behaviours. One ``horovodrun -np 4``
launch runs the column's cells of this run (``matrix.selected(HOROVOD)``: a
covering set in which every front-end and option of the column meets a cell,
every option on both kernel sets, the TF1-behaviour pass its picks; ``make
test-full``: every cell); each process runs them on its tower (``python -m conformance.worker``),
and the test process assembles the 4 towers (``run.run_cells_in_workers``).
The references, the verdict and the refusals are the matrix's own
(``conformance/oracle.py``, ``conformance/check.py``, ``matrix.expect``): a
cell matches the replaced layer on one device with the concatenated batch
(the variables equal in every process, but with ``sync_statistics=None``),
or is refused with the library's message (sync groups, which would span
Horovod processes).
"""

import pytest

from conformance import check, harnesses, matrix, oracle

# The first test runs the references' subprocess and the one horovodrun launch of every
# selected cell: about 40 s for make test-horovod's 32, 7 minutes for make test-full's 348
# on a loaded 2-core machine (the launch's limit grows with its cells: run.workers_timeout).
pytestmark = pytest.mark.timeout(1800)

HOROVOD = harnesses.BY_NAME['horovod']
CELLS = matrix.selected(HOROVOD)


@pytest.fixture(scope='module')
def references(request, tmp_path_factory):
    """The references of this run's selected cells, computed once (one subprocess)."""
    folder = tmp_path_factory.mktemp('horovod_conformance')
    wanted = check.requests(check.selected_cells(request.session, __name__))
    oracle.compute(list(wanted.values()), folder)
    return oracle.load(str(folder / 'oracle.npz'))


@pytest.fixture(scope='module')
def results(request):
    """Every selected cell's result: one launch of the column's 4 processes."""
    return check.HarnessResults(check.selected_cells(request.session, __name__))(HOROVOD)


@pytest.mark.parametrize('cell', [pytest.param(cell, id=cell.id) for cell in CELLS])
def test_cell(cell, references, results):
    check.check_cell(cell, results[cell.id], references)


@pytest.mark.once
def test_the_column_meets_every_front_end_option_and_kernel_set():
    """What the covering set promises (so that trimming it cannot drop a value silently)."""
    column = matrix.runnable([c for c in matrix.all_cells() if c.harness is HOROVOD])
    chosen = matrix.column_covering_set(column)

    def met(cells, *factors):
        return {tuple(matrix._factors(c)[i] for i in factors) for c in cells}  # noqa: SLF001

    for factors in ((0,), (2,), (2, 3)):
        assert met(chosen, *factors) == met(column, *factors), factors
    assert {c.expected.kind for c in chosen} == {matrix.MATCH, matrix.REFUSED}

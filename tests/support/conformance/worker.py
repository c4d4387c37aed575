"""One worker process of a column whose towers are processes (``Harness.workers``).

Started by the column's :meth:`harnesses.Harness.launch` (from
``run.run_cells_in_workers``):
``python -m conformance.worker HARNESS OUT [--tf1-behavior] CELL_ID... refused:CELL_ID...``.
Joins the column's workers (:meth:`harnesses.Harness.join`: the cluster, the
strategy's servers, Horovod), runs ``run.run_cells`` on the towers this
worker builds (``Harness.tower_indices``), and writes its ``{cell id: Result}``
to ``OUT/worker<rank>.pkl``: its towers' rows of the outputs and input
gradients, its towers' sums of the parameter gradients, its variables.
Every worker builds and runs the same graphs in the same order (a cell
refused or failed on one fails the same way on the others), so their
collectives meet; before each graph's step they check that they built the
same cells (``run.Agreement``). A worker that fails, or finds that another
built other cells, exits with status 1 and its error at once (the launcher
then stops the others).
"""

import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def main(argv):
    import support_paths
    support_paths.install()
    import tf_behavior
    if '--tf1-behavior' in argv:
        os.environ[tf_behavior.VARIABLE] = 'v1'
        argv = [a for a in argv if a != '--tf1-behavior']
    tf_behavior.apply()
    from conformance import harnesses, matrix, run

    name, out, ids = argv[0], argv[1], argv[2:]
    harness = harnesses.BY_NAME[name]
    cells = {cell.id: cell for cell in matrix.all_cells() if cell.harness is harness}
    match = [cells[i] for i in ids if not i.startswith('refused:')]
    refused = [cells[i[len('refused:'):]] for i in ids if i.startswith('refused:')]
    rank = harness.join()
    agreement = run.Agreement(out, rank, harness.workers)
    results = run.run_cells(type(harness), match, refused, agreement)
    agreement.end()
    run.save_worker_results(results, os.path.join(out, 'worker%d.pkl' % rank))
    print('conformance worker %d: %d cells' % (rank, len(results)), flush=True)


if __name__ == '__main__':
    # Leaves with os._exit either way: a server (the cluster's, the strategy's) may block a
    # normal interpreter shutdown, and a worker that fails must end now, with its error, so
    # that the launcher stops the others (run.Agreement: a worker that diverges raises).
    import traceback
    try:
        main(sys.argv[1:])
        status = 0
    except BaseException:  # noqa: BLE001 - printed; the exit status says it failed
        traceback.print_exc()
        status = 1
    from tf1_syncbn.distributed import hard_exit
    hard_exit(status)

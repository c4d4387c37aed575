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
collectives meet.
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
    from tf1_syncbn.distributed import hard_exit

    name, out, ids = argv[0], argv[1], argv[2:]
    harness = harnesses.BY_NAME[name]
    cells = {cell.id: cell for cell in matrix.all_cells() if cell.harness is harness}
    match = [cells[i] for i in ids if not i.startswith('refused:')]
    refused = [cells[i[len('refused:'):]] for i in ids if i.startswith('refused:')]
    rank = harness.join()
    results = run.run_cells(type(harness), match, refused)
    run.save_worker_results(results, os.path.join(out, 'worker%d.pkl' % rank))
    print('conformance worker %d: %d cells' % (rank, len(results)), flush=True)
    hard_exit(0)


if __name__ == '__main__':
    main(sys.argv[1:])

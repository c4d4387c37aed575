"""One worker of the conformance matrix's ``multi_worker`` column (``harnesses.MultiWorker``).

Started by :class:`tf1_syncbn.launch.Launcher` (``TF_CONFIG`` set) from
``conformance.run.run_cells_in_workers``, 2 workers x 2 towers:
``python conformance_worker.py OUT [--tf1-behavior] CELL_ID... refused:CELL_ID...``.
Sets up the cluster, then runs ``conformance.run.run_cells`` on the harness
(each layer with ``sync_statistics=cluster.backend()``, global tower ``g`` is
worker ``g // 2``'s tower ``g % 2``) and writes its ``{cell id: Result}`` to
``OUT/worker<rank>.pkl``: its towers' rows of the outputs and input
gradients, its towers' sums of the parameter gradients, its variables.
Every worker builds and runs the same graphs in the same order (a cell
refused or failed on one fails the same way on the other), so their
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
    from tf1_syncbn.distributed import hard_exit, setup_cluster, wait_for_peers

    out, ids = argv[0], argv[1:]
    harness = harnesses.BY_NAME['multi_worker']
    cluster = setup_cluster(towers=harness.LOCAL_TOWERS, startup_timeout=120,
                            collective_timeout=120)
    type(harness).cluster = cluster
    cells = {cell.id: cell for cell in matrix.all_cells() if cell.harness is harness}
    match = [cells[i] for i in ids if not i.startswith('refused:')]
    refused = [cells[i[len('refused:'):]] for i in ids if i.startswith('refused:')]
    wait_for_peers(cluster)
    results = run.run_cells(type(harness), match, refused)
    run.save_worker_results(results, os.path.join(out, 'worker%d.pkl' % cluster.rank))
    print('conformance worker %d: %d cells' % (cluster.rank, len(results)), flush=True)
    hard_exit(0)


if __name__ == '__main__':
    main(sys.argv[1:])

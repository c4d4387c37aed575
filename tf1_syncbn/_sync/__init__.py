"""Synchronization (private): which towers a call joins, and the one door to the collectives.

* :mod:`~tf1_syncbn._sync.group`: the tower, its group and the backend;
* :mod:`~tf1_syncbn._sync.registry`: per-graph call names and each call's
  members, with the build-time checks;
* :mod:`~tf1_syncbn._sync.plan`: ``SyncPlan``, through which every all-reduce
  of a layer is built (backend, key, guards);
* :mod:`~tf1_syncbn._sync.guards`: the run-time tower check and the step watchdog;
* :mod:`~tf1_syncbn._sync.control_flow`: where in the graph's control flow a
  call is built;
* :mod:`~tf1_syncbn._sync.ghost_batches`: ghost batches over a group, whose
  members must have one batch size (checked at build, or all-reduced and
  asserted at run time).

Below it: :mod:`tf1_syncbn._compute` and :mod:`tf1_syncbn.backends`; above
it: :mod:`tf1_syncbn._core`.
"""

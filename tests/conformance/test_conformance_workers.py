"""A worker column's workers end a run at once when they diverge; their results put together.

``run.Agreement`` (each worker, before a graph's step): workers that built
the same cells go on; a worker that built other cells, or ended without
the graph, makes the others raise ``run.WorkersDiverged`` naming the cells
and its errors, in a few seconds, not at the launcher's timeout (the
workers are threads here, their folder a temporary one, as the worker
processes' is). ``run._assemble``: a cell with an error on some workers
only is each worker's error; a refused cell built on every worker is a
result without error (the test then fails it), not a crash of the run.
"""

import threading
import types

import numpy as np
import pytest

from conformance import run

pytestmark = pytest.mark.once(reason='files and threads, no graph')

#: Seconds a check may wait for the other worker here (it never needs more than a moment).
WAIT = 20


def _cells(*ids):
    return [types.SimpleNamespace(id=cell_id) for cell_id in ids]


def _check_in_threads(tmp_path, built, errors=None, ended=()):
    """Each worker's ``check`` of its cells (``built[rank]``), in threads; ``{rank: exception}``.

    ``errors``: build errors a worker had (``{rank: {cell id: text}}``);
    ``ended``: workers that end (:meth:`run.Agreement.end`) instead of checking.
    """
    agreements = [run.Agreement(str(tmp_path), rank, len(built), timeout=WAIT)
                  for rank in range(len(built))]
    for rank, found in (errors or {}).items():
        for cell_id, text in found.items():
            agreements[rank].failed(_cells(cell_id)[0], ValueError(text))
    raised = {}

    def worker(rank):
        try:
            if rank in ended:
                agreements[rank].end()
            else:
                agreements[rank].check(_cells(*built[rank]))
        except Exception as e:  # noqa: BLE001 - the test's result
            raised[rank] = e

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(len(built))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT + 10)
    return raised


def test_workers_that_built_the_same_cells_go_on(tmp_path):
    assert _check_in_threads(tmp_path, [['a', 'b'], ['b', 'a'], ['a', 'b']]) == {}


def test_a_worker_that_built_other_cells_stops_every_worker_with_its_error(tmp_path):
    raised = _check_in_threads(tmp_path, [['a', 'b'], ['a']],
                               errors={1: {'b': 'the broken tower of worker 1'}})
    assert sorted(raised) == [0, 1]
    assert all(isinstance(e, run.WorkersDiverged) for e in raised.values())
    assert "['b']" in str(raised[0]) and 'the broken tower of worker 1' in str(raised[0])
    assert "['b']" in str(raised[1])


def test_a_worker_that_ended_without_the_graph_stops_the_others(tmp_path):
    raised = _check_in_threads(tmp_path, [['a'], []], errors={1: {'a': 'every cell failed'}},
                               ended=(1,))
    assert sorted(raised) == [0]
    assert isinstance(raised[0], run.WorkersDiverged)
    assert 'worker 1 ended after 0 graphs' in str(raised[0])
    assert 'every cell failed' in str(raised[0])


def test_a_cell_that_failed_on_one_worker_only_shows_each_workers_outcome():
    built = run.Result(arrays={'y/0': np.ones(2, np.float32)})
    failed = run.Result(error=ValueError('the broken tower of worker 1'))
    result = run._assemble([built, failed])  # noqa: SLF001 - the function under test
    assert isinstance(result.error, RuntimeError)
    assert 'worker 0 built it' in str(result.error)
    assert 'worker 1 raised ValueError: the broken tower of worker 1' in str(result.error)
    same = run._assemble([failed, failed])  # noqa: SLF001
    assert same.error is failed.error       # the same on every worker: that error


def test_a_refused_cell_built_on_every_worker_is_a_result_without_error():
    result = run._assemble([run.Result(), run.Result()])  # noqa: SLF001
    assert result.error is None and result.arrays is None

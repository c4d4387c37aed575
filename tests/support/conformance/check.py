"""What every conformance test module shares: the references a run needs, the runs, a verdict.

``tests/conformance/test_conformance.py`` (the columns this process builds,
and the worker columns of ``make test``) and
``tests/with_horovod/test_horovod_conformance.py`` (the ``horovod`` column,
under ``horovodrun``) both:

* collect their selected cells' references in one oracle subprocess
  (:func:`requests`, :func:`selected_cells`);
* run each harness's cells once (:class:`HarnessResults`: one graph here, or
  one launch of the column's workers);
* judge each cell with :func:`check_cell`: the refusal the matrix names, or
  the oracle's numbers (``parity_harness.assert_same_numbers``), no warning.
"""

import re

from conformance import matrix, oracle, run


def requests(cells):
    """The references the cells need: ``{key: (front-end, option, groups)}``, once each."""
    wanted = {}
    for cell in cells:
        outcome = cell.expected
        if outcome.kind == matrix.MATCH:
            wanted.setdefault(oracle.request_key(cell.front_end, cell.option, outcome.groups),
                              (cell.front_end, cell.option, outcome.groups))
    return wanted


def selected_cells(session, module_name, test_name='test_cell'):
    """The cells of a pytest session's selected ``test_name`` tests of one module (``-k``)."""
    return [item.callspec.params['cell'] for item in session.items
            if item.originalname == test_name and item.module.__name__ == module_name]


class HarnessResults(object):
    """``results(harness)``: every cell of ``cells`` in that harness, run once (one graph, or
    one launch of the column's worker processes)."""

    def __init__(self, cells):
        self.cells = list(cells)
        self.done = {}

    def __call__(self, harness):
        if harness.name not in self.done:
            cells = [cell for cell in self.cells if cell.harness is harness]
            match = [c for c in cells if c.expected.kind == matrix.MATCH]
            refused = [c for c in cells if c.expected.kind == matrix.REFUSED]
            if harness.workers:
                # Worker processes (one launch for the column's cells of this run; a failed
                # launch fails each of its cells, and is not launched again for each).
                try:
                    self.done[harness.name] = run.run_cells_in_workers(harness, match, refused)
                except Exception as e:  # noqa: BLE001 - raised again by each of its cells
                    self.done[harness.name] = e
            else:
                self.done[harness.name] = run.run_cells(type(harness), match, refused)
        if isinstance(self.done[harness.name], Exception):
            raise self.done[harness.name]
        return self.done[harness.name]


def describe(error):
    """An exception in one line: its type and the start of its message."""
    return '%s: %s' % (type(error).__name__, ' '.join(str(error).split())[:1500])


def check_cell(cell, result, references):
    """Fails (``AssertionError``) unless ``result`` is what the matrix expects of ``cell``.

    A refused cell: the exception type the matrix names, its message matching
    the pattern. A matching cell: built without error or ``SyncBNWarning``,
    its arrays equal to the oracle's reference (``references``:
    ``oracle.load``'s), with the parity suites' tolerances; on the stock
    kernel set, no compiled-kernel op.
    """
    from parity_harness import HALF_EPS, assert_same_numbers  # noqa: PLC0415
    outcome = cell.expected
    if outcome.kind == matrix.REFUSED:
        assert result.error is not None, (
            'expected a refusal at graph build (%s), but the layer was built%s'
            % (outcome.reason, '; it warned: %s' % result.warnings if result.warnings else ''))
        assert isinstance(result.error, outcome.errors), (
            'expected %s (%s), got %s' % ('/'.join(e.__name__ for e in outcome.errors),
                                          outcome.reason, describe(result.error)))
        assert re.search(outcome.pattern, str(result.error)), (
            'the refusal does not say what works instead (%s; %r): %s'
            % (outcome.reason, outcome.pattern, describe(result.error)))
        return
    assert result.error is None, 'expected to match the oracle (%s), got %s' % (
        outcome.reason, describe(result.error))
    assert not result.warnings, 'a cell that matches may not warn: %s' % result.warnings
    key = oracle.request_key(cell.front_end, cell.option, outcome.groups)
    reference = references[key]
    assert 'error' not in reference, 'the oracle failed: %s' % reference['error']
    means = {k[len('mean/'):]: v for k, v in reference.items() if k.startswith('mean/')}
    reference = {k: v for k, v in reference.items() if not k.startswith('mean/')}
    if outcome.replica_mean:
        for kind in ('var', 'saved', 'restored'):
            reference.update(('%s/%s' % (kind, rel), value) for rel, value in means.items())
    option = cell.option
    arrays = result.arrays
    case = {'name': cell.id, 'dtype': option.dtype, 'loc': option.loc, 'scale': option.scale}
    if cell.front_end.family == 'moments' and option.dtype in HALF_EPS:
        # moments returns statistics of the input's type: where two float32 sums differ
        # by a rounding error, they round one unit apart, and so do the gradients of
        # gamma and beta computed from them (to the type's resolution).
        grads = {k for k in reference if k.startswith('grad/')}
        assert_same_numbers({k: v for k, v in arrays.items() if k in grads},
                            {k: v for k, v in reference.items() if k in grads},
                            dict(case, tolerance=HALF_EPS[option.dtype] / 1e-4),
                            len(option.sizes))
        arrays = {k: v for k, v in arrays.items() if k not in grads}
        reference = {k: v for k, v in reference.items() if k not in grads}
    assert_same_numbers(arrays, reference, case, len(option.sizes))
    if cell.kernels == 'stock':
        assert result.kernel_ops == 0, 'the stock kernel set built compiled-kernel ops'

"""The conformance matrix covers every public argument and every harness, and its page is current.

* Every argument of every front-end's public signature (``matrix.SIGNATURES``,
  read with ``inspect.signature``) has an entry: every cell of the row
  passes it, an option of the matrix varies it, or the row names it as not
  sync-relevant with the test module that covers it. A new argument without
  one fails here, naming it (shown with a synthetic signature).
* Every harness that docs/harnesses.md's table lists ("Which harnesses, and
  what you add", the one list of the harnesses the library supports) has a
  column of the matrix, or is named as no harness of its own; a new row
  without one fails here, naming it (shown with a synthetic row).
* Every cell has a complete expected outcome (it matches, is refused, or
  has no meaning in its column, with the reason); a column whose cells run
  in a module of their own (``Harness.runs_in``: Horovod's, in
  ``make test-horovod``) names that module and make target.
* docs/conformance.md is what ``tools/conformance_page.py`` writes.
"""

import collections
import importlib.util
import os
import re

import pytest

from conformance import front_ends, harnesses, matrix, options

pytestmark = pytest.mark.once(reason='reads signatures, docs and the matrix: no graph')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize('row', sorted(matrix.SIGNATURES))
def test_every_argument_of_a_front_end_has_a_matrix_entry(row):
    missing = matrix.missing_arguments(row)
    assert not missing, (
        '%s: the conformance matrix has no entry for the argument(s) %s. Add an option that '
        'varies it (tests/support/conformance/options.py), or list it as not sync-relevant '
        'with the test module that covers it (front_ends.py, the row\'s not_sync_relevant).'
        % (row, missing))
    assert not matrix.stale_entries(row), 'listed, but not in the signature'
    for parameter, (module, why) in front_ends.BY_NAME[row].not_sync_relevant.items():
        assert why and os.path.isfile(os.path.join(ROOT, module)), (row, parameter, module)


def test_a_new_argument_without_an_entry_fails_naming_it():
    from tf1_syncbn import sync_batch_norm

    def sync_batch_norm_with_a_new_option(inputs, decay=0.999, new_option=None):
        del inputs, decay, new_option

    assert matrix.missing_arguments('sync_batch_norm', sync_batch_norm_with_a_new_option) == \
        ['new_option']
    assert matrix.missing_arguments('sync_batch_norm', sync_batch_norm) == []


def test_a_new_argument_behind_keyword_arguments_is_followed():
    # patch_tensorpack(**defaults) passes its defaults to BatchNorm; a Keras layer's
    # **kwargs reach tf-keras' constructor: their arguments need entries too.
    assert 'momentum' in matrix.signature_arguments('patch_tensorpack')
    assert {'renorm', 'fused', 'virtual_batch_size'} <= set(
        matrix.signature_arguments('keras.BatchNormalization'))


def test_every_harness_of_the_docs_has_a_column():
    rows = matrix.harness_table(ROOT)
    assert len(rows) >= 10, 'the harness table of docs/harnesses.md was not found'
    assert not matrix.unmatched_harness_rows(rows), (
        'docs/harnesses.md lists harnesses the conformance matrix has no column for: %s. '
        'Add a column (tests/support/conformance/harnesses.py) whose docs_rows names the row.'
        % matrix.unmatched_harness_rows(rows))
    claimed = [row for harness in harnesses.HARNESSES for row in harness.docs_rows]
    assert sorted(set(claimed) - set(rows)) == [], 'columns name rows the table does not have'
    assert sorted(set(matrix.NOT_HARNESSES) - set(rows)) == []


def test_a_new_harness_without_a_column_fails_naming_it():
    rows = matrix.harness_table(ROOT) + ["a new trainer's `Replica_<i>` towers"]
    assert matrix.unmatched_harness_rows(rows) == ["a new trainer's `Replica_<i>` towers"]


def test_every_cell_has_a_complete_expected_outcome():
    cells = matrix.all_cells()
    assert len(cells) == (len(front_ends.FRONT_ENDS) * len(harnesses.HARNESSES) *
                          len(options.OPTIONS) * len(matrix.KERNEL_SETS))
    assert len({cell.id for cell in cells}) == len(cells)
    for cell in cells:
        outcome = cell.expected
        assert outcome.kind in (matrix.MATCH, matrix.REFUSED, matrix.NOT_APPLICABLE), cell.id
        if outcome.kind == matrix.MATCH:
            towers = sorted(t for group in outcome.groups for t in group)
            assert towers == list(range(len(cell.option.sizes))), cell.id
        elif outcome.kind == matrix.REFUSED:
            assert outcome.errors and outcome.reason, cell.id
            re.compile(outcome.pattern)
        else:
            assert outcome.reason, cell.id
    # Each outcome holds in both kernel sets (and behaviours): the expectation is per cell.
    by_key = collections.defaultdict(set)
    for cell in cells:
        by_key[cell.key].add(cell.expected)
    assert all(len(outcomes) == 1 for outcomes in by_key.values())


def test_the_covering_set_meets_every_pair():
    runnable = [c for c in matrix.runnable(matrix.all_cells()) if c.harness.runs_in is None]
    chosen = matrix.covering_set(runnable)
    for i, j in ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)):
        met = {(f[i], f[j]) for f in map(matrix._factors, chosen)}  # noqa: SLF001
        assert met == {(f[i], f[j]) for f in map(matrix._factors, runnable)}, (i, j)  # noqa: SLF001
    assert {c.expected.kind for c in chosen} == {matrix.MATCH, matrix.REFUSED}


def test_columns_that_run_elsewhere_name_their_module_and_target():
    """A column left out of tests/conformance (``runs_in``) names the module that runs its
    cells (it selects them: ``matrix.selected`` of that column) and the make target."""
    with open(os.path.join(ROOT, 'Makefile'), encoding='utf-8') as f:
        targets = set(re.findall(r'^([\w-]+):', f.read(), re.M))
    for harness in [h for h in harnesses.HARNESSES if h.runs_in]:
        paths = re.findall(r'tests/[\w/]+\.py', harness.runs_in)
        assert len(paths) == 1 and os.path.isfile(os.path.join(ROOT, paths[0])), harness.name
        with open(os.path.join(ROOT, paths[0]), encoding='utf-8') as f:
            source = f.read()
        assert "harnesses.BY_NAME['%s']" % harness.name in source, harness.name
        assert 'matrix.selected(' in source and 'def test_cell(' in source, harness.name
        assert re.search(r'make ([\w-]+)', harness.runs_in).group(1) in targets, harness.name


def _page_module():
    spec = importlib.util.spec_from_file_location(
        'conformance_page', os.path.join(ROOT, 'tools', 'conformance_page.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_page_is_generated_from_the_matrix():
    with open(os.path.join(ROOT, 'docs', 'conformance.md'), encoding='utf-8') as f:
        committed = f.read()
    assert committed == _page_module().render(), (
        'docs/conformance.md is not what the matrix gives: run python tools/conformance_page.py')

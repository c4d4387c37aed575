"""The conformance matrix: every front-end x harness x option, and what each cell must do.

The single source of truth for the library's invariant across its entry
points: **N synchronized towers equal the replaced layer on one device with
each sync group's concatenated batch**: outputs, input and parameter
gradients, and the moving statistics (read back, saved by a ``Saver`` and
restored), which follow global tower 0's group. A cell either matches that
oracle, or is refused at graph build with a ``ValueError`` / ``TypeError``
whose message says what works instead; a cell may not degrade silently (a
``SyncBNWarning`` followed by per-tower statistics counts as degrading).

* rows: ``front_ends.FRONT_ENDS`` (each front-end as users call it, the
  patches included);
* columns: ``harnesses.HARNESSES`` (what builds the towers);
* options: ``options.OPTIONS`` (one deviation from the baseline each);
* and, for every cell, both kernel sets (:data:`KERNEL_SETS`) and both TF
  behaviours (the process's: ``tf_behavior``).

:func:`expect` gives each cell's expected outcome (:class:`Outcome`); the
rules are in one place, in order. ``tests/conformance/test_conformance.py``
runs the cells (``make test`` a covering set, :func:`selected`;
``make test-full`` all); ``test_conformance_completeness.py`` checks that
every public argument and every harness has its entry (:data:`SIGNATURES`,
:data:`HARNESS_TABLE`); ``tools/conformance_page.py`` writes
docs/conformance.md from here.

Expected outcomes are those of the library after issue 42's fixes (its
defects' cells are :data:`REGRESSIONS`): on a library without them, those
cells fail, saying what the layer did instead.
"""

import dataclasses
import functools
import importlib
import inspect
import os
import re

from conformance import front_ends as fes
from conformance import harnesses as hs
from conformance import options as opts

#: The per-device kernel sets: the compiled CPU kernels, and TensorFlow's stock
#: kernels (with oneDNN off: the CPU stand-in for GPU towers, ``without_onednn``).
KERNEL_SETS = ('compiled', 'stock')
#: ``without_onednn.kernel_set``'s names for them.
KERNEL_SET_NAMES = {'compiled': 'custom', 'stock': 'stock'}

MATCH, REFUSED, NOT_APPLICABLE = 'match', 'refused', 'n/a'


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a cell must do.

    Attributes:
      kind: :data:`MATCH`, :data:`REFUSED` or :data:`NOT_APPLICABLE`.
      reason: why (n/a, pending: where it runs; refused: the message's gist;
        match: which statistics).
      groups: (match) the groups of towers whose concatenated batches the
        oracle normalizes with.
      errors: (refused) the exception types accepted.
      pattern: (refused) a regular expression the message must match.
      replica_mean: (match) the variables read, saved and restored are the
        mean over the towers of each one's group's (tf-keras' own variables
        under a ``tf.distribute`` strategy: one copy per replica, averaged on
        read); else global tower 0's group's.
    """

    kind: str
    reason: str = ''
    groups: tuple = ()
    errors: tuple = ()
    pattern: str = ''
    replica_mean: bool = False


def _match(option, reason=None):
    groups = option.oracle_groups()
    if reason is None:
        reason = 'each tower its own statistics' if len(groups) == len(option.sizes) and \
            len(option.sizes) > 1 else ('the whole batch' if len(groups) == 1
                                        else 'each group its own batch')
    return Outcome(MATCH, reason, groups=groups)


def _refused(pattern, reason, errors=(ValueError, TypeError)):
    return Outcome(REFUSED, reason, errors=errors, pattern=pattern)


def expect(front_end, harness, option, here=True):
    """The expected outcome of one cell (the same on both kernel sets and behaviours).

    ``here=False``: the outcome where the harness exists (the docs page shows
    the Estimator's cells as TensorFlow 2.15 runs them).

    The rules, in order (the first that applies decides):

    1. a harness this TensorFlow lacks (``tf.estimator`` after 2.15) is n/a;
    2. an option the front-end does not have, or a cell the harness gives no
       meaning, is n/a;
    3. ``group_size`` with ``sync_statistics=None`` is refused (nothing to
       group; say ``sync_statistics='auto'``);
    4. ``sync_statistics=None`` gives per-tower statistics (tensorpack's
       default, and asked for elsewhere), the replaced layer's own; the Keras
       front-ends then keep tf-keras' own moving statistics, which a
       ``tf.distribute`` strategy keeps per replica and averages on read (as
       tf-keras' own layer there: ``Harness.replica_copies``);
    5. sync groups under Horovod, one tower per process, are refused (a group
       across processes would need a Horovod process set; the message names
       the groups that do work, and ``tf1_syncbn.distributed``); so are sync
       groups under a multi-worker ``tf.distribute`` strategy (its workers
       each keep their first replica's moving statistics; the message says to
       leave ``group_size`` unset, or to use ``tf1_syncbn.distributed``);
    6. a loop that names no tower is refused (the message names ``num_dev``
       and a tower name scope or ``TowerContext``);
    7. a harness that names towers by name scopes only, without ``num_dev``,
       is refused (the message names ``num_dev``);
    8. everything else matches the oracle on each group's batch.
    """
    missing = harness.unavailable() if here else None
    if missing:
        return Outcome(NOT_APPLICABLE, 'not available on this TensorFlow: ' + missing)
    reason = front_end.not_applicable(option) or harness.not_applicable(front_end, option)
    if reason:
        return Outcome(NOT_APPLICABLE, reason)
    if option.group_size is not None and option.sync is None:
        return _refused(r"(?s)group_size.*sync_statistics|sync_statistics.*group_size",
                        "group_size with sync_statistics=None: pass sync_statistics='auto'")
    if option.sync is None:
        if front_end.family == 'keras' and harness.replica_copies:
            return dataclasses.replace(
                _match(option), replica_mean=True,
                reason="each tower its own statistics; tf-keras' moving statistics, one copy "
                       'per replica, read as their mean (as tf-keras\' own layer under the '
                       'strategy)')
        return _match(option)
    if isinstance(harness, hs.Horovod) and len(option.groups) > 1:
        return _refused(r"(?s)sync_statistics='horovod' cannot synchronize the group of towers.*"
                        r'Horovod process set.*group_size that divides.*tf1_syncbn\.distributed',
                        'sync groups across Horovod processes (one tower each): a group '
                        'would need a Horovod process set, which hvd.init registers; the '
                        'message names group_size within a process and tf1_syncbn.distributed')
    if isinstance(harness, hs.MultiWorkerMirrored) and len(option.groups) > 1:
        return _refused(r'(?s)not supported with multi-worker.*group_size unset',
                        'sync groups under a multi-worker strategy: leave group_size unset, '
                        'or use tf1_syncbn.distributed')
    if isinstance(harness, hs.UnnamedLoop):
        return _refused(r'num_dev', 'towers it cannot name: pass num_dev with tower name '
                        'scopes, or build them in TowerContext')
    if not option.num_dev and harness.num_dev is not None:
        return _refused(r'num_dev', 'a tower name scope of unknown tower count: pass num_dev')
    return _match(option)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell of the matrix, on one kernel set (in this process's TF behaviour)."""

    front_end: fes.FrontEnd
    harness: hs.Harness
    option: opts.Option
    kernels: str

    @property
    def id(self):
        return '%s-%s-%s-%s' % (self.harness.name, self.front_end.name, self.option.name,
                                self.kernels)

    @property
    def expected(self):
        return expect(self.front_end, self.harness, self.option)

    @property
    def key(self):
        """The cell without its kernel set (what the page shows)."""
        return (self.front_end.name, self.harness.name, self.option.name)

    @property
    def kernel_set(self):
        """``without_onednn.kernel_set``'s name of the cell's kernel set."""
        return KERNEL_SET_NAMES[self.kernels]

    def data(self):
        return _data(self.option.name)


@functools.lru_cache(maxsize=None)
def _data(option_name):
    return opts.option_data(opts.BY_NAME[option_name])


def all_cells():
    """Every cell: front-end x harness x option x kernel set, in that nesting."""
    return [Cell(front_end, harness, option, kernels)
            for harness in hs.HARNESSES for front_end in fes.FRONT_ENDS
            for option in opts.OPTIONS for kernels in KERNEL_SETS]


def runnable(cells):
    """The cells that run here: their outcome is a match or a refusal."""
    return [cell for cell in cells if cell.expected.kind in (MATCH, REFUSED)]


# ---------------------------------------------------------------------------
# Which cells a run takes.

#: The factors of the covering set: every pair of values of two of them meets in a cell.
def _factors(cell):
    return (cell.front_end.name, cell.harness.name, cell.option.name, cell.kernels)


#: Cells where a defect was found (issue 42), run by ``make test`` whatever the pairs:
#: (front-end, harness, option). A triple the pairs may not take.
REGRESSIONS = (
    ('keras.BatchNormalization', 'mirrored', 'group_size=2'),        # moving statistics: group 0's
    ('keras.BatchNormalization', 'central_storage', 'group_size=2'),
    ('BatchNorm', 'tower_context', 'group_size+sync=None'),           # group_size refused
    ('patch_tensorpack', 'tower_context', 'group_size+sync=None'),
    ('BatchNorm', 'tower_loop', 'whole'),                              # num_dev for tensorpack
    ('patch_tensorpack', 'tower_loop', 'no num_dev'),
    ('moments', 'unnamed_loop', 'whole'),                              # refused like the layers
    ('sync_batch_norm', 'tower_context', 'groups=[[0],[1,2,3]]'),     # one-tower groups
    ('layers.batch_normalization', 'tower_loop', 'groups=[[0,2,3],[1]]'),
    ('sync_batch_norm', 'unnamed_loop', 'group_size=2'),              # the fix the message names
    ('BatchRenorm', 'tower_context', 'sync=None'),     # per tower: reads before the update
)


def covering_set(cells):
    """A covering set of ``cells`` in which every pair of factor values that meets in
    some cell meets in a chosen one (front-end, harness, option, kernel set).

    What a cell exercises depends on its front-end, harness, option and
    kernel set mostly two at a time: the option reaches the front-end's
    arguments and the core's path; the harness, how the layer finds its
    tower and group and whose updates run; the kernel set, the ops of the
    fused synchronized path. Where a triple mattered (a defect found at a
    crossing of three: the Keras layer's moving statistics under a strategy
    with groups), :data:`REGRESSIONS` names the cell, and it runs too, on
    the compiled kernels.
    """
    import suite_scope  # noqa: PLC0415 - tests/support
    chosen = {cell.id for cell in suite_scope.pairwise_of(cells, _factors)}
    return [cell for cell in cells if cell.id in chosen or
            (cell.kernels == 'compiled' and cell.key in REGRESSIONS)]


def column_covering_set(cells):
    """A covering set of one column's ``cells`` (a column whose cells run in a module of
    their own, :attr:`harnesses.Harness.runs_in`): every front-end and every option of
    the column meets it in a chosen cell, and every option meets both kernel sets.

    The pairs of the column with each other factor, as :func:`covering_set`
    over every column meets them, and of option and kernel set (the paths the
    two choose together: fused, renorm, ghost batches on either kernel set);
    the other pairs are met in the other columns' cells.
    """
    import suite_scope  # noqa: PLC0415 - tests/support
    return suite_scope.pairwise_of(cells, _factors, pairs=((1, 0), (1, 2), (2, 3)))


def selected(harness=None):
    """The cells this run takes: ``make test``'s covering set, ``make test-full``'s all.

    Only the cells that run in the matrix (match or refused). In ``make
    test``'s TF1-behaviour pass, :func:`v1_picks` of them; ``make test-full``
    runs every cell in both behaviours.

    Args:
      harness: None: the columns ``tests/conformance/`` runs (their
        :attr:`harnesses.Harness.runs_in` is None), with :func:`covering_set`;
        a column whose cells run in a module of their own: its cells, with
        :func:`column_covering_set`.
    """
    import suite_scope  # noqa: PLC0415
    import tf_behavior  # noqa: PLC0415
    cells = runnable(all_cells())
    if harness is None:
        cells = [cell for cell in cells if cell.harness.runs_in is None]
        chosen = suite_scope.covering(cells, covering_set(cells))
    else:
        cells = [cell for cell in cells if cell.harness is harness]
        chosen = suite_scope.covering(cells, column_covering_set(cells))
    if suite_scope.full():
        return chosen
    return tf_behavior.pick(chosen, v1_picks(chosen))


#: The options whose paths TF1 behaviour changes: reference variables assigned by
#: the updates and read by the step (the moving statistics of the whole batch, of a
#: group, per tower; renorm's statistics), v1 control flow (a bool tensor
#: ``training``), ``Dimension`` shapes (channels first), and the refusals.
V1_OPTIONS = ('whole', 'group_size=2', 'sync=None', 'renorm', 'training=tensor', 'NCHW',
              'group_size+sync=None', 'no num_dev')


def v1_picks(cells):
    """The cells the TF1-behaviour pass runs: on the options whose paths TF1 behaviour
    changes (:data:`V1_OPTIONS`), each with every front-end, every harness and both
    kernel sets (pairs of option and each other factor).

    Numerics that TF1 behaviour does not change (16-bit types, the large mean),
    options that differ from the whole batch only in their data or grouping
    (uneven towers, explicit groups) and ghost batches (the same update code as
    the whole batch) run in the TF2-behaviour pass; a front-end meets a harness
    there too (the layer's paths under TF1 behaviour are the option's, the
    harness's variables and updates are met with every option).
    """
    import suite_scope  # noqa: PLC0415
    kept = [cell for cell in cells if cell.option.name in V1_OPTIONS]
    return suite_scope.pairwise_of(kept, _factors, pairs=((0, 2), (1, 2), (3, 2)))


# ---------------------------------------------------------------------------
# What the completeness test reads.

#: Each row's public callable whose signature lists its arguments (module, attribute).
SIGNATURES = {
    'sync_batch_norm': ('tf1_syncbn', 'sync_batch_norm'),
    'sync_arg_scope': ('tf1_syncbn', 'sync_arg_scope'),
    'BatchNorm': ('tf1_syncbn', 'BatchNorm'),
    'BatchRenorm': ('tf1_syncbn', 'BatchRenorm'),
    'patch_tensorpack': ('tf1_syncbn', 'patch_tensorpack'),
    'layers.batch_normalization': ('tf1_syncbn.layers', 'batch_normalization'),
    'layers.BatchNormalization': ('tf1_syncbn.layers', 'BatchNormalization'),
    'patch_tf_layers': ('tf1_syncbn', 'patch_tf_layers'),
    'keras.BatchNormalization': ('tf1_syncbn.keras', 'BatchNormalization'),
    'patch_keras': ('tf1_syncbn.keras', 'patch_keras'),
    'moments': ('tf1_syncbn', 'moments'),
    'weighted_moments': ('tf1_syncbn', 'weighted_moments'),
}

#: A row's ``**kwargs`` passed on to another signature: (row whose arguments they are).
FORWARDS = {
    'sync_arg_scope': 'sync_batch_norm',          # **bn_overrides
    'patch_tensorpack': 'BatchNorm',              # **defaults (and BatchRenorm's)
}

#: Where docs/harnesses.md lists the harnesses the library supports: the first
#: column of its table under this heading.
HARNESS_TABLE = ('docs/harnesses.md', 'Which harnesses, and what you add')
#: Rows of that table that are no harness of their own: (why, where they are covered).
NOT_HARNESSES = {
    'tf.layers code (`tf.compat.v1.layers.batch_normalization` / `BatchNormalization`) in '
    'any of these': 'a front-end, not a harness: the patch_tf_layers and layers rows, in '
                    'every column',
}


def signature_arguments(row, target=None):
    """The argument names of a row's public callable, its ``**kwargs`` followed.

    A ``**kwargs`` passed on to another row's callable (:data:`FORWARDS`)
    adds that callable's arguments; a class's ``**kwargs`` adds those of its
    bases' constructors from the replaced library's normalization module
    (tf-keras' ``renorm``, ``fused``, ...). The ``**kwargs`` itself stays
    an argument, which needs an entry unless it is forwarded.

    Args:
      row: a front-end's name (a key of :data:`SIGNATURES`).
      target: the callable to read instead of the row's own (the
        completeness test's synthetic signatures).
    """
    if target is None:
        module, attribute = SIGNATURES[row]
        target = getattr(importlib.import_module(module), attribute)
    names = []
    for parameter in inspect.signature(target).parameters.values():
        if parameter.kind != inspect.Parameter.VAR_KEYWORD:
            names.append(parameter.name)
        elif row in FORWARDS:
            names += [n for n in signature_arguments(FORWARDS[row]) if n not in names]
        else:
            names.append(parameter.name)
            for base in getattr(target, '__mro__', ())[1:]:
                if '__init__' in vars(base) and '.normalization.' in base.__module__:
                    names += [n for n, p in inspect.signature(base.__init__).parameters.items()
                              if n not in names and n != 'self' and
                              p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return names


def missing_arguments(row, target=None):
    """The arguments of a row's signature that the matrix has no entry for.

    An argument has an entry when every cell of the row passes it, an option
    of the matrix varies it (``options.Option.parameters``), or the row names
    it as not sync-relevant with the test module that covers it.
    """
    covered = parameters_covered(row)
    return [name for name in signature_arguments(row, target) if name not in covered]


def stale_entries(row):
    """Arguments a row lists as not sync-relevant that its signature does not have."""
    names = set(signature_arguments(row))
    return sorted(p for p in fes.BY_NAME[row].not_sync_relevant if p not in names)


def parameters_covered(row):
    """``{parameter: where}`` of one row: the matrix's options and baseline, and elsewhere.

    Args:
      row: a front-end's name.
    """
    front_end = fes.BY_NAME[row]
    covered = {p: 'every cell of the row' for p in front_end.parameters}
    for option in opts.OPTIONS:
        if front_end.not_applicable(option) is None:
            for p in option.parameters:
                covered.setdefault(p, 'option %s' % option.name)
    for p, (module, why) in front_end.not_sync_relevant.items():
        covered.setdefault(p, 'not sync-relevant (%s): %s' % (why, module))
    return covered


def harness_table(root):
    """The first cells of the rows of docs/harnesses.md's harness table."""
    path, heading = HARNESS_TABLE
    with open(os.path.join(root, path), encoding='utf-8') as f:
        text = f.read()
    section = text.split('## ' + heading, 1)[1].split('\n## ', 1)[0]
    rows = [line for line in section.splitlines() if line.startswith('|')][2:]
    return [re.split(r'(?<!\\)\|', row)[1].strip() for row in rows]


def unmatched_harness_rows(rows):
    """The rows of the harness table that no column and no :data:`NOT_HARNESSES` entry covers."""
    covered = {row for harness in hs.HARNESSES for row in harness.docs_rows}
    return [row for row in rows if row not in covered and row not in NOT_HARNESSES]

"""Runs a test module's stock-kernel cases in a child pytest with oneDNN off.

On CPU, TensorFlow's oneDNN graph rewrites replace some stock ops (fused
batch norm and its gradient among them) with oneDNN kernels that accept what
the plain kernels reject (for example ``FusedBatchNormGrad`` with
``is_training=False`` on NCHW). GPU towers run the stock kernel set on
TensorFlow's plain kernels, so the closest CPU stand-in for them is
``TF_ENABLE_ONEDNN_OPTS=0 TF1_SYNCBN_KERNELS=0``. Both are read at process
start, hence the child process.

:func:`run_stock_cases_without_onednn` runs the tests of one module whose ids
contain ``stock`` (the ``kernel_impl`` fixture's stock parameter) in a child
pytest with those variables, reads its JUnit XML and fails naming every
failing case with its error. The child checks that oneDNN is really off and
that the custom kernels are disabled (``conftest.py``), and the parent checks
that the expected number of cases ran, so that it cannot pass by running
nothing.
"""

import collections
import contextlib
import inspect
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

import tf_behavior

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Set in the child: conftest.py then checks oneDNN and the kernel set.
CHILD_MARKER = 'TF1_SYNCBN_TEST_STOCK_CHILD'
CHILD_ENV = {'TF_ENABLE_ONEDNN_OPTS': '0', 'TF1_SYNCBN_KERNELS': '0', CHILD_MARKER: '1'}

#: The name every parent test carries; the child deselects it.
PARENT_TEST_WORD = 'without_onednn'


def in_child():
    return os.environ.get(CHILD_MARKER) == '1'


def _cases(xml_path):
    """``{module file name: [(test id, outcome, error text)]}`` from a JUnit XML report."""
    cases = collections.defaultdict(list)
    for case in ElementTree.parse(xml_path).getroot().iter('testcase'):
        module = (case.get('classname') or '').split('.')[-1] + '.py'
        outcome, text = 'passed', ''
        for tag in ('failure', 'error', 'skipped'):
            node = case.find(tag)
            if node is not None:
                outcome = tag
                text = '%s\n%s' % (node.get('message') or '', node.text or '')
                break
        cases[module].append((case.get('name'), outcome, text))
    return cases


_TELLING = re.compile(r'Error|[A-Z]{4,}_?[A-Z]*: |Mismatch|Max (absolute|relative)|Not equal|'
                      r'tower\(s\)|assert ')


def error_summary(text, limit=1200):
    """What names the problem: the error lines of a report, without the tracebacks.

    TensorFlow's errors carry long "defined at" tracebacks before the line
    that says what went wrong (``INVALID_ARGUMENT: ...``); assertion errors
    say which array differs and by how much.
    """
    seen, keep = set(), []
    for line in text.splitlines():
        line = re.sub(r'^(E\s+)?(\(\d+\) )?', '', line.strip()).strip()
        if line and _TELLING.search(line) and 'File "' not in line and line not in seen:
            seen.add(line)
            keep.append(line)
    if not keep:
        keep = [line for line in text.splitlines() if line.strip()][-12:]
    return '\n'.join('    ' + line for line in keep[:10])[:limit]


def count_kernel_cases(module):
    """How many tests of ``module`` run once per kernel set (the ``kernel_impl`` fixture).

    Read from the module's own definitions (its ``parametrize`` marks), so that
    a child run that selected fewer of them fails.
    """
    def marks(obj):
        found = getattr(obj, 'pytestmark', [])
        return found if isinstance(found, list) else [found]

    def uses_kernel_impl(obj):
        return any(m.name == 'usefixtures' and 'kernel_impl' in m.args for m in marks(obj))

    everywhere = uses_kernel_impl(module)
    total = 0
    for name, function in vars(module).items():
        if not (name.startswith('test') and inspect.isfunction(function)):
            continue
        if not (everywhere or uses_kernel_impl(function) or
                'kernel_impl' in inspect.signature(function).parameters):
            continue
        if tf_behavior.is_v1() and any(m.name == 'once' for m in marks(function)):
            continue        # the TF2-behaviour pass's only (conftest.py)
        count = 1
        for mark in marks(function):
            if mark.name == 'parametrize' and mark.args[0] != 'kernel_impl':
                count *= len(_stock_values(mark))
        total += count
    return total


def _stock_values(mark):
    """A ``parametrize`` mark's parameter sets that the stock child runs.

    All of them, unless ``kernel_impl`` is one of the mark's names (a covering
    set of kernel set x case, ``suite_scope.covering``): then the sets whose
    ``kernel_impl`` is ``'stock'``, or, where this process leaves the stock
    set to the child (``kernel_sets``: oneDNN on), every set, which the
    module's covering set mirrors case for case on the stock set.
    """
    names = mark.args[0]
    names = [n.strip() for n in names.split(',')] if isinstance(names, str) else list(names)
    values = list(mark.args[1])
    if 'kernel_impl' not in names:
        return values
    where = names.index('kernel_impl')
    stock = [v for v in values if (v.values if hasattr(v, 'values') else v)[where] == 'stock']
    return stock or values


class ChildRun(object):
    """One child pytest over some modules' stock cases; :meth:`check` asserts on one module."""

    def __init__(self, modules, tmp_path, extra_env=None, timeout=600, keyword='stock'):
        """Runs the child.

        Args:
          modules: the test modules' files.
          tmp_path: a directory for the report.
          extra_env: more environment variables for the child (reference results).
          timeout: seconds for the whole child run.
          keyword: the ``-k`` expression that selects the cases.
        """
        skip_if_stock_ran_here()
        report = os.path.join(str(tmp_path), 'stock_without_onednn.xml')
        command = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                   '--tb=short', '-k', '(%s) and not %s' % (keyword, PARENT_TEST_WORD),
                   '--junitxml', report] + [os.path.relpath(m, ROOT) for m in modules]
        env = dict(os.environ, **CHILD_ENV)
        env.update(extra_env or {})
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        self.output = proc.stdout[-3000:]
        if not os.path.exists(report):
            raise AssertionError('the child pytest wrote no report (exit status %d):\n%s\n%s'
                                 % (proc.returncode, proc.stdout[-4000:], proc.stderr[-4000:]))
        self.cases = _cases(report)

    def check(self, module, expected):
        """Every case of ``module`` passed in the child, and ``expected`` of them ran."""
        name = os.path.basename(module)
        cases = self.cases.get(name, [])
        bad = [(case, outcome, text) for case, outcome, text in cases if outcome != 'passed']
        summary = '%d of %d case(s) of %s fail with TF_ENABLE_ONEDNN_OPTS=0 ' \
            'TF1_SYNCBN_KERNELS=0' % (len(bad), len(cases), name)
        by_error = collections.OrderedDict()   # cases that fail the same way, together
        for case, outcome, text in bad:
            by_error.setdefault('%s:\n%s' % (outcome, error_summary(text)), []).append(case)
        details = '\n\n'.join('%s\n  %s' % ('\n'.join('  ' + n for n in names), error)
                              for error, names in by_error.items())
        assert not bad, '%s:\n\n%s' % (summary, details)
        assert len(cases) == expected, (
            'expected %d stock-kernel cases of %s, the child ran %d: %s\n%s'
            % (expected, name, len(cases), [c[0] for c in cases], self.output))
        return cases


def run_stock_cases_without_onednn(module, tmp_path, expected, extra_env=None, timeout=600,
                                   keyword='stock'):
    """Runs ``module``'s ``keyword`` cases with oneDNN off and the stock kernels; asserts all pass.

    Args:
      module: the test module's file (``__file__``).
      tmp_path: a directory for the report.
      expected: how many cases must run (the module's own count of them).
      extra_env: more environment variables for the child (reference results).
      timeout: seconds for the whole child run.
      keyword: the ``-k`` expression that selects the cases.
    """
    return ChildRun([module], tmp_path, extra_env, timeout, keyword).check(module, expected)


#: Set to 1 to run the parity and harness modules' multi-tower cases on the
#: stock kernels with oneDNN on too, in the test process.
ALSO_STOCK_WITH_ONEDNN = 'TF1_SYNCBN_TEST_STOCK_WITH_ONEDNN'


def onednn_off_here():
    """Whether TensorFlow's oneDNN rewrites are off in this process.

    They are off with ``TF_ENABLE_ONEDNN_OPTS=0``, and by default on CPUs
    where TensorFlow does not turn them on (an AMD EPYC without AVX-512, for
    one). The stock kernel set built here then runs on TensorFlow's plain
    kernels, as in the child run: the stock cases run in this process, and
    the child run would repeat them.
    """
    from tensorflow.python.util import _pywrap_util_port  # noqa: PLC0415 - TF-internal
    return not _pywrap_util_port.IsMklEnabled()


def kernel_sets():
    """The kernel sets a parity or harness module's multi-tower tests run on in this process.

    ``['stock']`` in the child run (TensorFlow's kernels, oneDNN off: what GPU
    towers run). In the test process ``['custom']`` (the compiled kernels)
    where oneDNN is on, and both where it is off (:func:`onednn_off_here`:
    the stock cases run here instead of in a child). A case costs about 4x as
    much on the stock set, so with oneDNN on these modules do not also run it
    in the test process unless ``$TF1_SYNCBN_TEST_STOCK_WITH_ONEDNN=1``
    (about +70 s); the exactness, numerics and formats modules always do
    (``kernel_impl``).
    """
    if in_child():
        return ['stock']
    if onednn_off_here() or os.environ.get(ALSO_STOCK_WITH_ONEDNN) == '1':
        return ['custom', 'stock']
    return ['custom']


def kernel_cases(cases, stock_cases, name=lambda case: case['name']):
    """``(kernel set, case)`` parameters of a parity module's multi-tower test, here.

    Every case of ``cases`` on the compiled kernels; those of ``stock_cases``
    on the stock ones with oneDNN off (in the child run, or in this process
    where oneDNN is off); with ``$TF1_SYNCBN_TEST_STOCK_WITH_ONEDNN=1`` and
    oneDNN on, every case on the stock kernels too. Ids are
    ``<kernel set>-<case name>``, so ``-k stock`` selects the stock ones.
    """
    params = []
    for kernels in kernel_sets():
        chosen = stock_cases if kernels == 'stock' and (in_child() or onednn_off_here()) \
            else cases
        params += [pytest.param(kernels, case, id='%s-%s' % (kernels, name(case)))
                   for case in chosen]
    return params


def skip_if_stock_ran_here():
    """Skips a child run's test where oneDNN is off here: the stock cases ran in this process."""
    if onednn_off_here() and not in_child():
        pytest.skip('oneDNN is off in this process (TF_ENABLE_ONEDNN_OPTS=0, or a CPU where '
                    'TensorFlow leaves it off): the stock kernel cases ran here, as the '
                    "tests' [stock-...] ids, and a child run would repeat them")


@contextlib.contextmanager
def kernel_set(name):
    """Builds layers with the kernel set ``name`` (``'custom'`` or ``'stock'``) in the block."""
    from tf1_syncbn import kernels  # noqa: PLC0415
    with kernels.use_custom_kernels(name == 'custom'):
        if name == 'custom':
            assert kernels.load() is not None, kernels.status()
        yield

"""A pytest plugin: where the suite's time goes, per test and per module.

``pytest --suite-times=PATH`` writes one JSON record per test: its node id,
its module, its wall time (setup, call and teardown together, as measured by
pytest) and the CPU time it used (this process's and the child processes'
it waited for, from ``getrusage``, and the scripts it ran forked from a
zygote, ``forked.scripts_cpu_seconds``), and prints each module's share of the
run at the end. With pytest-xdist the records are gathered in the
controlling process (the CPU time travels in the reports'
``user_properties``).

CPU time tells a test's cost apart from the machine's load: on a shared
machine the wall times grow, the CPU times much less. ``tools/suite_times.py``
turns the files of a run's passes into the tables of ``docs/testing.md``.
"""

import collections
import json
import os
import resource
import sys
import time

import pytest

_CPU = 'suite_times_cpu'


def pytest_addoption(parser):
    parser.addoption('--suite-times', metavar='PATH', default=None,
                     help='write each test\'s wall and CPU time to PATH (JSON) and print '
                          'each module\'s share of the run')


def _cpu_seconds():
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Scripts run forked from a zygote (forked.py) are the zygote's children.
    forked = sys.modules.get('forked')
    scripts = forked.scripts_cpu_seconds() if forked else 0.0
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + scripts


def module_totals(records):
    """Each module's tests, wall and CPU time, the module with the most wall time first.

    Args:
      records: the per-test records of a run (``'module'``, ``'wall'``, ``'cpu'``;
        a CPU time of None counts as 0), as the JSON file holds them.

    Returns:
      ``[(module, (tests, wall seconds, CPU seconds))]``.
    """
    by_module = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in records:
        m = by_module[r['module']]
        m[0] += 1
        m[1] += r['wall']
        m[2] += r['cpu'] or 0.0
    return sorted(((module, tuple(m)) for module, m in by_module.items()),
                  key=lambda kv: -kv[1][1])


class _CpuMeter(object):
    """Runs where the tests run: puts each test's CPU time into its teardown report."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        item.stash[_START] = _cpu_seconds()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        if call.when == 'teardown' and _START in item.stash:
            item.user_properties.append((_CPU, _cpu_seconds() - item.stash[_START]))
        yield


class _Recorder(object):
    """Runs where the reports arrive (the controller under xdist): gathers and writes them."""

    def __init__(self, path):
        self.path = path
        self.tests = collections.OrderedDict()
        self.started = time.time()

    def pytest_runtest_logreport(self, report):
        record = self.tests.setdefault(report.nodeid, {
            'test': report.nodeid, 'module': report.nodeid.split('::')[0], 'wall': 0.0,
            'cpu': None, 'outcome': 'passed'})
        record['wall'] += report.duration
        if report.outcome != 'passed' and record['outcome'] == 'passed':
            record['outcome'] = report.outcome
        for name, value in report.user_properties:
            if name == _CPU:
                record['cpu'] = value

    def pytest_terminal_summary(self, terminalreporter):
        records = list(self.tests.values())
        elapsed = time.time() - self.started
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, 'w') as f:
            json.dump({'elapsed': elapsed, 'tests': records}, f, indent=1)
        modules = module_totals(records)
        total = sum(wall for _, (_, wall, _) in modules) or 1.0
        write = terminalreporter.write_line
        terminalreporter.section('suite times (%s)' % os.path.relpath(self.path))
        write('%d tests, %.0f s of test time (wall, summed over workers) in %.0f s'
              % (len(records), total, elapsed))
        write('%7s %6s %7s %5s  %s' % ('wall s', 'share', 'cpu s', 'tests', 'module'))
        for module, (count, wall, cpu) in modules:
            write('%7.1f %5.1f%% %7.1f %5d  %s' % (wall, 100.0 * wall / total, cpu, count,
                                                  module))


_START = pytest.StashKey()


def pytest_configure(config):
    path = config.getoption('--suite-times')
    if not path:
        return
    config.pluginmanager.register(_CpuMeter(), 'suite_times_cpu')
    if not hasattr(config, 'workerinput'):     # not an xdist worker
        config.pluginmanager.register(_Recorder(os.path.abspath(path)), 'suite_times_recorder')

"""Where a test run's time went: tables from the files ``make test`` writes.

Each pass of ``make test`` writes ``.suite-times/<behaviour>.json`` (the
pytest plugin ``tests/support/suite_times.py``: every test's wall time and the CPU
time of its process and the children it waited for). This prints, per file,
the pass's wall time and summed test time, its slowest tests and each
module's share, as Markdown tables for ``docs/testing.md``::

    python tools/suite_times.py .suite-times/v2.json .suite-times/v1.json [--top 15]
"""

import argparse
import json
import os
import sys

# The plugin's own per-module sums (tests/support first: this file is suite_times too).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'tests', 'support'))
from suite_times import module_totals  # noqa: E402


def _load(path):
    with open(path) as f:
        return json.load(f)


def _table(rows, header):
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
    return '\n'.join(lines)


def report(path, top):
    """The Markdown report of one pass's file."""
    data = _load(path)
    tests = data['tests']
    wall = sum(t['wall'] for t in tests)
    cpu = sum(t['cpu'] or 0.0 for t in tests)
    out = ['### %s' % os.path.basename(path),
           '%d tests in %.0f s (wall); summed over tests: %.0f s wall, %.0f s CPU.'
           % (len(tests), data['elapsed'], wall, cpu), '']
    slow = sorted(tests, key=lambda t: -t['wall'])[:top]
    out.append(_table([('%.1f' % t['wall'], '%.1f' % (t['cpu'] or 0), '`%s`' % t['test'])
                       for t in slow], ['wall s', 'CPU s', 'test']))
    ranked = module_totals(tests)
    shown = ranked[:top]
    rest = ranked[top:]
    rows = [('%.0f' % w, '%.1f%%' % (100 * w / wall), '%.0f' % c, n, '`%s`' % m)
            for m, (n, w, c) in shown]
    if rest:
        rows.append(('%.0f' % sum(r[1][1] for r in rest),
                     '%.1f%%' % (100 * sum(r[1][1] for r in rest) / wall),
                     '%.0f' % sum(r[1][2] for r in rest), sum(r[1][0] for r in rest),
                     '%d other modules' % len(rest)))
    out += ['', _table(rows, ['wall s', 'share', 'CPU s', 'tests', 'module'])]
    return '\n'.join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('files', nargs='+', help='.suite-times/<behaviour>.json files')
    parser.add_argument('--top', type=int, default=15, help='tests and modules shown')
    args = parser.parse_args(argv)
    print('\n\n'.join(report(path, args.top) for path in args.files))
    return 0


if __name__ == '__main__':
    sys.exit(main())

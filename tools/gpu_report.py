"""The report of ``make gpu-check``: a Markdown file with every figure and the machine.

Standard library only (``tools/gpu_check.py`` runs before any environment
with TensorFlow exists). The pure parts (:func:`parse_junit`,
:func:`render_report`, :func:`report_path`) are tested with fake inputs in
``tests/gpu/test_gpu_check.py``.
"""

import collections
import os
import re
import sys
import xml.etree.ElementTree as ElementTree

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'bench'))
import _machine  # noqa: E402

#: One step of the check: ``name``; ``command`` (as typed in a shell);
#: ``status`` (``'PASS'``, ``'FAIL'`` or ``'SKIP'``); ``seconds``; ``summary``
#: (one line); ``details`` (Markdown lines: the cases that did not pass, with
#: their messages); ``output`` (what the command printed, or its tail).
Step = collections.namedtuple('Step', ['name', 'command', 'status', 'seconds', 'summary',
                                       'details', 'output'])

#: The pytest outcomes in a JUnit XML report.
OUTCOMES = ('passed', 'failed', 'error', 'skipped')


def parse_junit(path):
    """Counts and cases of a pytest JUnit XML report.

    Returns:
      ``(counts, cases)``: ``counts`` maps each of :data:`OUTCOMES` to a
      number; ``cases`` is a list of ``(name, outcome, message)`` with the
      first line of the failure, error or skip message ('' when passed).
    """
    counts = collections.OrderedDict((outcome, 0) for outcome in OUTCOMES)
    cases = []
    for case in ElementTree.parse(path).getroot().iter('testcase'):
        outcome, message = 'passed', ''
        for tag, name in (('failure', 'failed'), ('error', 'error'), ('skipped', 'skipped')):
            node = case.find(tag)
            if node is not None:
                outcome = name
                text = (node.get('message') or node.text or '').strip()
                message = text.splitlines()[0] if text else ''
                break
        counts[outcome] += 1
        cases.append((case.get('name') or '?', outcome, message))
    return counts, cases


def pytest_step(name, command, rc, seconds, output, junit_path):
    """A :class:`Step` from a pytest run: its exit status and its JUnit XML report.

    FAIL when pytest failed (``rc`` not 0), a case failed, or nothing passed
    (every case skipped: nothing was checked); the details list every case
    that did not pass, with its message; the output is pytest's last lines.
    """
    try:
        counts, cases = parse_junit(junit_path)
    except (OSError, ElementTree.ParseError) as e:
        return Step(name, command, 'FAIL', seconds, 'no test report (%s), exit status %d'
                    % (type(e).__name__, rc), [], tail(output))
    summary = ', '.join('%d %s' % (n, outcome) for outcome, n in counts.items() if n)
    failed = rc != 0 or counts['failed'] or counts['error'] or not counts['passed']
    if not counts['passed']:
        summary = '%s: nothing passed, nothing was checked' % (summary or 'no test ran')
    details = ['- `%s`: %s%s' % (case, outcome, ': ' + message if message else '')
               for case, outcome, message in cases if outcome != 'passed']
    return Step(name, command, 'FAIL' if failed else 'PASS', seconds, summary, details,
                tail(output, 80 if failed else 30))


def tail(text, lines=80):
    """The last ``lines`` lines of ``text``."""
    kept = text.rstrip().splitlines()
    if len(kept) <= lines:
        return '\n'.join(kept)
    return '\n'.join(['[... %d lines before ...]' % (len(kept) - lines)] + kept[-lines:])


def report_path(results_dir, gpus, date):
    """``<results_dir>/gpu-check-<count>x-<model>-<date>.md``, not overwriting a file.

    Args:
      gpus: the :class:`_machine.Gpu` list (the first model names the file).
      date: ``'YYYY-MM-DD'``.
    """
    model = gpus[0].name if gpus else 'unknown-gpu'
    stem = 'gpu-check-%dx-%s-%s' % (len(gpus), _machine.slug(model), date)
    path = os.path.join(results_dir, stem + '.md')
    number = 2
    while os.path.exists(path):
        path = os.path.join(results_dir, '%s-%d.md' % (stem, number))
        number += 1
    return path


def _fence(text):
    """``text`` in a fenced code block that its own backticks cannot close."""
    longest = max([len(m) for m in re.findall(r'`+', text)] + [2])
    fence = '`' * (longest + 1)
    return '%s\n%s\n%s' % (fence, text.rstrip() or '(no output)', fence)


def render_report(report):
    """The Markdown text of a report.

    Args:
      report: a dict with ``date`` (ISO), ``command``, ``revision`` (git),
        ``machine`` (dict: ``gpus`` (:class:`_machine.Gpu` list),
        ``gpu_list`` (``nvidia-smi -L`` lines), ``driver_cuda``, ``cpu``,
        ``os``, ``python``), ``environment`` (dict: ``python``,
        ``description``, ``tensorflow``, ``build`` (CUDA/cuDNN),
        ``tf_gpus``), ``problem`` (why the check could not run, '' if it
        ran) and ``steps`` (:class:`Step` list).
    """
    machine, env, steps = report['machine'], report['environment'], report['steps']
    failed = [s.name for s in steps if s.status == 'FAIL']
    verdict = ('FAIL: ' + report['problem'] if report['problem'] else
               'FAIL: %s' % ', '.join(failed) if failed else 'PASS: every step passed')
    gpus = machine['gpus']
    lines = [
        '# GPU check: %s' % _machine.describe_gpus(gpus),
        '',
        'Written by `%s` (`tools/gpu_check.py`) on %s, at revision %s.'
        % (report['command'], report['date'], report['revision']),
        '',
        '**%s**' % verdict,
        '',
        '## Machine',
        '',
        '| | |',
        '|---|---|',
        '| GPUs | %d: %s |' % (len(gpus), '; '.join(
            '%d: %s, %s MiB' % (g.index, g.name, g.memory_total_mb) for g in gpus) or 'none'),
        '| NVIDIA driver | %s (supports CUDA %s) |' % (
            ', '.join(sorted({g.driver for g in gpus})) or 'unknown',
            machine.get('driver_cuda') or 'unknown'),
        '| CPU | %s |' % machine['cpu'],
        '| OS | %s |' % machine['os'],
        '| Python | %s |' % machine['python'],
        ('| environment | %s (`%s`) |' % (env['description'], env.get('python', '?'))
         if env.get('description') else '| environment | not set up (see below) |'),
        '| TensorFlow | %s%s |' % (env.get('tensorflow') or 'unknown',
                                   ', ' + env['build'] if env.get('build') else ''),
        '| GPUs TensorFlow sees | %s |' % (', '.join(env.get('tf_gpus') or []) or 'none'),
        '',
        '`nvidia-smi -L`:',
        '',
        _fence('\n'.join(machine.get('gpu_list') or [])),
        '',
    ]
    if report['problem']:
        lines += ['## Why the check could not run', '', report['problem'], '']
    if steps:
        lines += ['## Steps', '', '| step | result | time | summary |', '|---|---|---|---|']
        lines += ['| %s | %s | %.0f s | %s |' % (s.name, s.status, s.seconds,
                                                 s.summary.replace('|', '\\|'))
                  for s in steps]
        lines.append('')
    for s in steps:
        lines += ['## %s' % s.name, '', '`%s`: **%s** in %.0f s, %s.' % (
            s.command, s.status, s.seconds, s.summary), '']
        if s.details:
            lines += s.details + ['']
        if s.output:
            lines += [_fence(s.output), '']
    return '\n'.join(lines).rstrip() + '\n'


def write_report(path, report):
    """Writes :func:`render_report` of ``report`` to ``path`` (creating its folder)."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, 'w') as f:
        f.write(render_report(report))
    return path

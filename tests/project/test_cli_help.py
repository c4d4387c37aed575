"""Every command's ``--help`` answers at once, before TensorFlow is imported.

``python -m tf1_syncbn.run`` also starts its script before the package imports TensorFlow
(test_only_the_runner_is_started_early; the script itself: tests/run/test_run_startup.py).

``python -m tf1_syncbn.<command>`` imports the package, which imports
TensorFlow (20 to 30 s on a small machine): before, each ``--help`` (the
demo's too) took that long. Each runs with ``-X importtime``, whose report
must not list ``tensorflow``.
"""

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMANDS = [
    ['-m', 'tf1_syncbn.audit'],
    ['-m', 'tf1_syncbn.selftest'],
    ['-m', 'tf1_syncbn.kernels'],
    ['-m', 'tf1_syncbn.launch'],
    ['-m', 'tf1_syncbn.run'],
    [os.path.join(ROOT, 'examples', 'train_multitower.py')],
    [os.path.join(ROOT, 'examples', 'multi_worker.py')],
]


@pytest.mark.once
@pytest.mark.parametrize('command', COMMANDS, ids=lambda c: c[-1].rsplit(os.sep, 1)[-1])
@pytest.mark.parametrize('flag', ['--help', '-h'])
def test_help_answers_before_tensorflow_loads(command, flag):
    start = time.time()
    proc = subprocess.run([sys.executable, '-X', 'importtime'] + command + [flag],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    elapsed = time.time() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith('usage: '), proc.stdout[:500]
    imported = [line.rsplit('|', 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith('import time:')]
    assert 'tensorflow' not in imported, 'the help imported TensorFlow'
    assert elapsed < 15, 'the help took %.1f s' % elapsed


@pytest.mark.once
def test_only_the_package_commands_own_help_is_answered_early(capsys):
    """A ``--help`` for the worker command of ``launch``, or for another program, is not ours."""
    from tf1_syncbn._cli import answer_help_early  # noqa: PLC0415
    python = sys.executable
    for argv in ([python, '-m', 'tf1_syncbn.launch', '--workers', '1', '--', python, 'w.py',
                  '--help'],
                 [python, 'train.py', '-m', 'tf1_syncbn.audit', '--help'],
                 [python, '-m', 'mypackage', '--help'],
                 [python, '-m', 'tf1_syncbn.audit', 'x.meta']):
        assert answer_help_early(argv) is None, argv
    with pytest.raises(SystemExit) as info:
        answer_help_early([python, '-X', 'importtime', '-m', 'tf1_syncbn.launch', '-h'])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith('usage: python -m tf1_syncbn.launch')


@pytest.mark.once
def test_only_the_runner_is_started_early(monkeypatch):
    """``start_early`` replaces the process for ``-m tf1_syncbn.run`` only (never for a script)."""
    from tf1_syncbn import _cli  # noqa: PLC0415
    from tf1_syncbn._cli import early  # noqa: PLC0415
    started = []
    monkeypatch.setattr(early.importlib, 'import_module', lambda name: type(
        'Runner', (), {'exec_runner': staticmethod(started.append)}))
    python = sys.executable
    for argv in ([python, '-m', 'tf1_syncbn.launch', '--workers', '1', '--', python, '-m',
                  'tf1_syncbn.run', 'w.py'],
                 [python, 'train.py', '-m', 'tf1_syncbn.run'],
                 [python, '/site/tf1_syncbn/run/startup.py', 'train.py']):
        assert _cli.start_early(argv) is None
    assert started == []
    _cli.start_early([python, '-u', '-m', 'tf1_syncbn.run', '--strict', 'train.py', '-x'])
    assert started == [['--strict', 'train.py', '-x']]

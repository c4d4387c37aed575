"""The runner's start: the command line, the script as python runs it, the ``.pth`` start-up hook.

Cheap: no TensorFlow here. ``python -m tf1_syncbn.run`` replaces itself before the package
imports TensorFlow, and the probe script imports none, so each run is an interpreter start.

* The script runs as ``python script.py args`` would: the same ``sys.argv``, ``__name__``,
  ``__file__``, ``sys.path[0]``, exit status, and traceback (without the runner's frames);
  the same for ``-m module``. The options reach it in ``TF1_SYNCBN_RUN``, which its
  subprocesses inherit.
* ``tf1_syncbn_run.pth``, processed by ``site`` as where the package is installed, does
  nothing when ``TF1_SYNCBN_RUN`` is unset, empty or ``0`` (no module imported: measured in
  docs/no-code-changes.md), and installs the hook when it is set, without importing
  TensorFlow; a value that is not the runner's options stops every process with status 2.
"""

import json
import os
import subprocess
import sys

import pytest

from tf1_syncbn.run import startup
from unchanged import harness

pytestmark = pytest.mark.once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = '''
import json, os, sys
print(json.dumps({'argv': sys.argv, 'name': __name__, 'file': __file__, 'path0': sys.path[0],
                  'run': os.environ.get('TF1_SYNCBN_RUN'),
                  'timeout': os.environ.get('TF1_SYNCBN_TIMEOUT'),
                  'tensorflow': 'tensorflow' in sys.modules}))
if 'raise' in sys.argv:
    def inner():
        raise ValueError('boom')
    inner()
if 'exit' in sys.argv:
    sys.exit(7)
'''


def _python(args, cwd, env=None):
    environ = dict(os.environ, **(env or {}))
    environ.pop('TF1_SYNCBN_RUN', None)
    environ.update(env or {})
    return subprocess.run([sys.executable] + args, cwd=str(cwd), env=environ,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def probe(tmp_path):
    folder = tmp_path / 'scripts'
    folder.mkdir()
    (folder / 'probe.py').write_text(PROBE)
    (folder / 'probe_module.py').write_text(PROBE)
    return folder


@pytest.mark.parametrize('args', [['a', '--b'], ['raise'], ['exit', '-m', 'x']],
                         ids=['argv', 'traceback', 'status'])
def test_the_script_runs_as_python_runs_it(probe, tmp_path, args):
    script = str(probe / 'probe.py')
    plain = _python([script] + args, tmp_path)
    ours = _python(['-m', 'tf1_syncbn.run', '--num-dev', '2', '--timeout', '30', script] + args,
                   ROOT)
    assert ours.returncode == plain.returncode, ours.stderr[-3000:]
    seen, expected = json.loads(ours.stdout.splitlines()[0]), json.loads(plain.stdout)
    assert seen.pop('run') == '--num-dev 2 --timeout 30.0' and expected.pop('run') is None
    assert seen.pop('timeout') == '30.0' and expected.pop('timeout') is None
    assert seen == expected and not seen['tensorflow']
    assert ours.stderr == plain.stderr          # the same traceback, or none


def test_dash_m_runs_a_module_as_python_runs_it(probe):
    plain = _python(['-m', 'probe_module', 'x', 'exit'], probe)
    ours = _python(['-m', 'tf1_syncbn.run', '-m', 'probe_module', 'x', 'exit'], probe,
                   env={'PYTHONPATH': ROOT})
    assert ours.returncode == plain.returncode == 7, ours.stderr[-3000:]
    seen, expected = json.loads(ours.stdout), json.loads(plain.stdout)
    assert seen.pop('run') == '1' and expected.pop('run') is None
    assert seen == expected


@pytest.mark.parametrize('args,message', [
    ([], 'give the script to run'), (['--num-dev', '0', 'x.py'], '--num-dev must be at least 1'),
    (['--backend', 'mpi', 'x.py'], "invalid choice: 'mpi'"), (['-m'], 'expected the module')])
def test_a_wrong_command_line_is_status_2(args, message):
    proc = _python(['-m', 'tf1_syncbn.run'] + args, ROOT)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_the_environment_text_round_trips():
    options, command = startup.parse_command_line(
        ['--num-dev', '4', '--group-size', '2', '--backend', 'none', '--strict', '--report',
         'r.json', 'train.py', '--num-dev', '8'])
    assert command == ['train.py', '--num-dev', '8']
    again = startup.parse_environment(startup.options_text(options))
    assert vars(again) == dict(vars(options), command=[])
    assert startup.parse_environment('1').backend == 'auto'
    assert startup.parse_environment('0') is None and startup.parse_environment(' ') is None


CHECK = ('import json, sys; print(json.dumps(sorted(m for m in sys.modules if "syncbn" in m '
         'or m.split(".")[0] == "tensorflow")))')


@pytest.mark.parametrize('value', [None, '', '0'])
def test_the_hook_imports_nothing_when_the_variable_is_unset(tmp_path, value):
    env = {'PYTHONPATH': harness.site_with_hook(tmp_path)}
    if value is not None:
        env['TF1_SYNCBN_RUN'] = value
    proc = _python(['-c', CHECK], tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    loaded = [m for m in json.loads(proc.stdout) if not m.startswith('__editable__')]
    assert loaded == []


def test_the_hook_installs_the_runner_without_importing_tensorflow(tmp_path):
    proc = _python(['-c', CHECK + '; import tf1_syncbn.run.startup as s; print(s.installed())'],
                   tmp_path, {'PYTHONPATH': harness.site_with_hook(tmp_path),
                              'TF1_SYNCBN_RUN': '--timeout 5'})
    assert proc.returncode == 0, proc.stderr
    loaded, installed = proc.stdout.splitlines()
    assert [m for m in json.loads(loaded) if not m.startswith('__editable__')] == [
        '_tf1_syncbn_run', 'tf1_syncbn.run.startup']
    assert installed == 'True'


def test_a_wrong_variable_stops_every_process(tmp_path):
    proc = _python(['-c', 'print("ran")'], tmp_path,
                   {'PYTHONPATH': harness.site_with_hook(tmp_path),
                    'TF1_SYNCBN_RUN': '--num-dev four'})
    assert proc.returncode == 2 and proc.stdout == ''
    assert "TF1_SYNCBN_RUN='--num-dev four': error: argument --num-dev" in proc.stderr
    assert 'Traceback' not in proc.stderr


def test_the_hook_runs_in_subprocesses_and_survives_exec(tmp_path, probe):
    """``python -m tf1_syncbn.run`` leaves the variable to the script's own subprocesses."""
    child = ('import subprocess, sys; subprocess.run([sys.executable, "-c", %r], check=True)'
             % CHECK)
    (probe / 'parent.py').write_text(child)
    proc = _python(['-m', 'tf1_syncbn.run', '--strict', str(probe / 'parent.py')], ROOT,
                   {'PYTHONPATH': harness.site_with_hook(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    loaded = [m for m in json.loads(proc.stdout) if not m.startswith('__editable__')]
    assert loaded == ['_tf1_syncbn_run', 'tf1_syncbn.run.startup']

"""``make gpu-check`` and the GPU options of bench/, on a machine without GPUs.

What runs here: the script's no-GPU exits (no ``nvidia-smi``, one that lists
no GPU, one that fails), its whole flow with a fake ``nvidia-smi`` and fake
commands (environment choice and set-up, the steps it runs, the report it
writes and its exit status), the report's parts, the diagnosis of a
TensorFlow that cannot use the GPUs, the GPU split of ``bench/_devices.py``
and the library's count of logical GPUs, ``--device gpu`` without a GPU in
each benchmark script (a clear error, exit status 2), and
``tests/gpu/test_gpu.py`` itself dry-run on virtual CPUs (its references and
tolerances, on TensorFlow's stock kernels).
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _folder in ('tools', 'bench'):
    if os.path.join(ROOT, _folder) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _folder))

import _devices  # noqa: E402
import _machine  # noqa: E402
import gpu_check  # noqa: E402
import gpu_env  # noqa: E402
import gpu_report  # noqa: E402
import gpu_run  # noqa: E402

import test_gpu  # noqa: E402
import tf_behavior  # noqa: E402
from tf1_syncbn import backends  # noqa: E402

tf1 = tf.compat.v1
SCRIPT = os.path.join(ROOT, 'tools', 'gpu_check.py')
H100 = 'NVIDIA H100 80GB HBM3'

FAKE_SMI = '''#!/bin/sh
case "$1" in
  -L) echo "GPU 0: %(name)s (UUID: GPU-0123)";;
  --query-gpu=*) echo "0, %(name)s, 81559, 81000, 550.54.15";;
  *) echo "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4 |";;
esac
''' % {'name': H100}


def _script(folder, name, body):
    path = os.path.join(str(folder), name)
    with open(path, 'w') as f:
        f.write(body)
    os.chmod(path, 0o755)
    return path


def _run_script(tmp_path, bin_folder):
    results = tmp_path / 'results'
    done = subprocess.run([sys.executable, SCRIPT, '--results-dir', str(results)],
                          env=dict(os.environ, PATH=str(bin_folder)), cwd=str(tmp_path),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=120, check=False)
    return done, results


@pytest.mark.once
def test_without_nvidia_smi_it_says_so_and_exits_0(tmp_path):
    empty = tmp_path / 'bin'
    empty.mkdir()
    done, results = _run_script(tmp_path, empty)
    assert done.returncode == 0, done.stdout
    assert done.stdout.strip() == ('gpu-check: no GPU here: nvidia-smi was not found on PATH. '
                                   'Nothing was checked.')
    assert not results.exists()


@pytest.mark.once
@pytest.mark.parametrize('output, status, why', [
    ('No devices were found', 6, 'nvidia-smi lists no GPU (No devices were found)'),
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9,
     "nvidia-smi failed (NVIDIA-SMI has failed because it couldn't communicate with the "
     "NVIDIA driver.)")], ids=['no-devices', 'no-driver'])
def test_an_nvidia_smi_without_gpus_says_so_and_exits_0(tmp_path, output, status, why):
    folder = tmp_path / 'bin'
    folder.mkdir()
    _script(folder, 'nvidia-smi', '#!/bin/sh\necho "%s"\nexit %d\n' % (output, status))
    done, results = _run_script(tmp_path, folder)
    assert done.returncode == 0, done.stdout
    assert 'gpu-check: no GPU here: %s. Nothing was checked.' % why in done.stdout
    assert not results.exists()


@pytest.mark.once
def test_nvidia_smi_parsing():
    listing = ('GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-1)\n  MIG 3g.20gb Device 0: (UUID: '
               'MIG-1)\nGPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-2)\n')
    assert _machine.parse_gpu_list(listing) == ['GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-1)',
                                                'GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-2)']
    gpus = _machine.parse_gpu_query('0, NVIDIA A100-SXM4-40GB, 40960, 40000, 550.54.15\n'
                                    '1, NVIDIA A100-SXM4-40GB, 40960, 39000, 550.54.15\n'
                                    '2, Tesla K80, rev, B, [N/A], [N/A], 470.1\n'
                                    'garbage\n')
    assert gpus[0] == _machine.Gpu(0, 'NVIDIA A100-SXM4-40GB', 40960, 40000, '550.54.15')
    assert gpus[2] == _machine.Gpu(2, 'Tesla K80, rev, B', None, None, '470.1')
    assert len(gpus) == 3
    assert _machine.describe_gpus(gpus) == (
        '2 x NVIDIA A100-SXM4-40GB (40960 MiB) + 1 x Tesla K80, rev, B, driver 470.1, '
        '550.54.15')
    assert _machine.describe_gpus([]) == 'no GPU'
    assert _machine.slug('NVIDIA H100 80GB HBM3') == 'nvidia-h100-80gb-hbm3'


def _junit(path, cases):
    """A JUnit XML report like pytest's: ``cases`` is ``[(name, outcome, message)]``."""
    body = []
    for name, outcome, message in cases:
        inner = {'passed': '', 'failed': '<failure message="%s">trace</failure>' % message,
                 'error': '<error message="%s"/>' % message,
                 'skipped': '<skipped type="pytest.skip" message="%s"/>' % message}[outcome]
        body.append('<testcase classname="tests.test_gpu" name="%s">%s</testcase>'
                    % (name, inner))
    with open(path, 'w') as f:
        f.write('<?xml version="1.0"?><testsuites><testsuite name="pytest">%s</testsuite>'
                '</testsuites>' % ''.join(body))


@pytest.mark.once
def test_a_pytest_step_fails_on_a_failure_and_when_nothing_passed(tmp_path):
    path = str(tmp_path / 'r.xml')
    _junit(path, [('test_a', 'passed', ''), ('test_b[nccl]', 'skipped', 'NCCL needs 2 GPUs')])
    step = gpu_report.pytest_step('tests', 'cmd', 0, 12.0, 'out', path)
    assert (step.status, step.summary) == ('PASS', '1 passed, 1 skipped')
    assert step.details == ['- `test_b[nccl]`: skipped: NCCL needs 2 GPUs']
    assert step.output == 'out'
    _junit(path, [('test_a', 'failed', 'AssertionError: output'), ('test_c', 'passed', '')])
    step = gpu_report.pytest_step('tests', 'cmd', 1, 12.0, 'the output', path)
    assert (step.status, step.summary, step.output) == ('FAIL', '1 passed, 1 failed',
                                                        'the output')
    _junit(path, [('test_b', 'skipped', 'no GPU')])
    step = gpu_report.pytest_step('tests', 'cmd', 0, 1.0, '', path)
    assert step.status == 'FAIL' and 'nothing was checked' in step.summary
    step = gpu_report.pytest_step('tests', 'cmd', 4, 1.0, '', str(tmp_path / 'missing.xml'))
    assert step.status == 'FAIL' and 'no test report' in step.summary


def _report(steps, problem=''):
    return {'date': '2026-01-02 03:04 UTC', 'command': 'make gpu-check', 'revision': '`abc123`',
            'machine': {'gpus': [_machine.Gpu(0, H100, 81559, 81000, '550.54.15'),
                                 _machine.Gpu(1, H100, 81559, 81000, '550.54.15')],
                        'gpu_list': ['GPU 0: %s (UUID: GPU-0)' % H100],
                        'driver_cuda': '12.4', 'cpu': 'AMD EPYC 9454, 16 cores',
                        'os': 'Linux-6.8', 'python': '3.11.9'},
            'environment': {'python': '/r/.venv-gpu/bin/python', 'description': '.venv-gpu',
                            'tensorflow': '2.21.0', 'build': 'CUDA 12.5.1, cuDNN 9',
                            'tf_gpus': ['/physical_device:GPU:0', '/physical_device:GPU:1']},
            'problem': problem, 'steps': steps}


@pytest.mark.once
def test_the_report_names_the_machine_and_every_figure(tmp_path):
    steps = [gpu_report.Step('tests/gpu/test_gpu.py, TF1 behaviour', 'TF1_SYNCBN_TEST_BEHAVIOR=v1 '
                             'python -m pytest', 'FAIL', 61.0, '15 passed, 1 failed',
                             ['- `test_x`: failed: AssertionError'], 'E   AssertionError'),
             gpu_report.Step('bench/sync_step.py', 'python bench/sync_step.py --device gpu',
                             'PASS', 20.0, 'exit status 0', [],
                             '  ratio sync_batch_norm / fused: 1.07x ```')]
    text = gpu_report.render_report(_report(steps))
    for expected in ('# GPU check: 2 x %s (81559 MiB), driver 550.54.15' % H100,
                     '| GPUs | 2: 0: %s, 81559 MiB; 1: %s, 81559 MiB |' % (H100, H100),
                     '| NVIDIA driver | 550.54.15 (supports CUDA 12.4) |',
                     '| CPU | AMD EPYC 9454, 16 cores |', '| TensorFlow | 2.21.0, CUDA 12.5.1',
                     '2026-01-02 03:04 UTC', 'revision `abc123`',
                     '**FAIL: tests/gpu/test_gpu.py, TF1 behaviour**',
                     '| tests/gpu/test_gpu.py, TF1 behaviour | FAIL | 61 s | 15 passed, 1 failed |',
                     '- `test_x`: failed: AssertionError',
                     '````\n  ratio sync_batch_norm / fused: 1.07x ```\n````'):
        assert expected in text, (expected, text)
    assert '**PASS: every step passed**' in gpu_report.render_report(_report(steps[1:]))
    problem = gpu_report.render_report(_report([], problem='a CPU-only build'))
    assert '**FAIL: a CPU-only build**' in problem and '## Steps' not in problem
    gpus = _report([])['machine']['gpus']
    first = gpu_report.report_path(str(tmp_path), gpus, '2026-01-02')
    assert os.path.basename(first) == 'gpu-check-2x-nvidia-h100-80gb-hbm3-2026-01-02.md'
    gpu_report.write_report(first, _report(steps))
    assert os.path.basename(gpu_report.report_path(str(tmp_path), gpus, '2026-01-02')) == \
        'gpu-check-2x-nvidia-h100-80gb-hbm3-2026-01-02-2.md'


PROBE_OK = {'python': '3.11.9', 'tensorflow': '2.21.0', 'cuda_build': True,
            'cuda_version': '12.5.1', 'cudnn_version': '9', 'compute_error': '',
            'gpus': ['/physical_device:GPU:0'], 'gpu_names': [H100], 'pytest': True,
            'pytest_timeout': True, 'tf1_syncbn': True}


@pytest.mark.once
@pytest.mark.parametrize('probe, driver_cuda, expected', [
    (PROBE_OK, '12.4', ''),
    (dict(PROBE_OK, cuda_build=False, gpus=[]), '12.4', 'a CPU-only build'),
    (dict(PROBE_OK, gpus=[]), '11.8', 'Driver/CUDA mismatch: the NVIDIA driver supports CUDA '
                                      'up to 11.8, older than the CUDA 12.5.1'),
    (dict(PROBE_OK, gpus=[]), '12.4', 'CUDA minor-version compatibility'),
    (dict(PROBE_OK, compute_error='InternalError: no kernel image'), '12.8',
     'sees the GPUs but cannot run an op on GPU:0: InternalError: no kernel image'),
    ({'error': 'import tensorflow: ImportError: libcudart'}, '12.4',
     'does not work in this environment: import tensorflow: ImportError'),
], ids=['ok', 'cpu-build', 'old-driver', 'older-minor', 'no-op', 'no-import'])
def test_the_diagnosis_says_why_tensorflow_cannot_use_the_gpus(probe, driver_cuda, expected):
    log = 'W0000 cuda_dlopen: Could not load dynamic library libcudnn.so.9\nunrelated line\n'
    found = gpu_env.diagnose(probe, log, ['GPU 0: x'], driver_cuda, environ={})
    if not expected:
        assert found == ''
    else:
        assert expected in found, found
    if probe.get('gpus') == [] and probe.get('cuda_build'):
        assert 'Could not load dynamic library libcudnn.so.9' in found
        assert 'unrelated' not in found


class FakeCommands(object):
    """Answers gpu_check's commands: the probe, git, pytest (writing its JUnit XML), the rest."""

    def __init__(self, probe=PROBE_OK, failing_behaviour=None):
        self.probe = probe
        self.failing_behaviour = failing_behaviour
        self.calls = []

    def __call__(self, cmd, env=None, timeout=None, echo=True):
        self.calls.append((list(cmd), dict(env or {})))
        if cmd[0] == 'git':
            return gpu_run.Result(0, 'abc1234\n' if 'rev-parse' in cmd else '', 0.1)
        if cmd[1:3] == ['-c', gpu_env.PROBE]:
            return gpu_run.Result(0, 'log\n%s%s\n' % (gpu_env.PROBE_TAG,
                                                        json.dumps(self.probe)), 2.0)
        if 'pytest' in cmd:
            behaviour = env['TF1_SYNCBN_TEST_BEHAVIOR']
            junit = [a for a in cmd if a.startswith('--junitxml=')][0].split('=', 1)[1]
            failing = behaviour == self.failing_behaviour
            _junit(junit, [('test_renorm[NHWC]', 'failed' if failing else 'passed', 'bad'),
                           ('test_nccl', 'skipped', 'NCCL needs 2 distinct physical GPUs')])
            return gpu_run.Result(1 if failing else 0, 'pytest %s output' % behaviour, 30.0)
        return gpu_run.Result(0, 'figures of %s: 1.03x' % os.path.basename(cmd[1]), 10.0)


def _main(tmp_path, commands, *extra):
    smi = _script(tmp_path, 'nvidia-smi', FAKE_SMI)
    results = tmp_path / 'results'
    status = gpu_check.main(['--nvidia-smi', smi, '--results-dir', str(results)] + list(extra),
                            run=commands)
    reports = sorted(os.listdir(str(results))) if results.exists() else []
    text = (results / reports[0]).read_text() if reports else ''
    return status, reports, text


@pytest.mark.once
def test_the_whole_check_with_fake_commands(tmp_path, capsys):
    commands = FakeCommands(failing_behaviour='v1')
    status, reports, text = _main(tmp_path, commands, '--python', '/fake/python')
    assert status == 1
    assert len(reports) == 1
    assert re.match(r'gpu-check-1x-nvidia-h100-80gb-hbm3-\d{4}-\d\d-\d\d\.md$', reports[0])
    run = [(cmd[1:], env.get('TF1_SYNCBN_TEST_BEHAVIOR')) for cmd, env in commands.calls
           if cmd[0] == '/fake/python' and cmd[1] != '-c']
    assert [(c[:3], b) for c, b in run[:2]] == [(['-m', 'pytest', '-q'], 'v2'),
                                                (['-m', 'pytest', '-q'], 'v1')]
    assert [c for c, _ in run[2:]] == [
        ['-m', 'tf1_syncbn.selftest', '--device', 'gpu', '--towers', '1'],
        ['-m', 'tf1_syncbn.selftest', '--device', 'gpu', '--towers', '1', '--tf1-behavior'],
        ['bench/sync_step.py', '--device', 'gpu'], ['bench/network_step.py', '--device', 'gpu'],
        ['bench/network_step.py', '--device', 'gpu', '--batch', '16', '--size', '128'],
        ['bench/inference.py', '--device', 'gpu']]
    for expected in ('**FAIL: tests/gpu/test_gpu.py, TF1 behaviour**', '1 x %s (81559 MiB)' % H100,
                     '550.54.15 (supports CUDA 12.4)', _machine.cpu_line(),
                     '| TensorFlow | 2.21.0, CUDA 12.5.1, cuDNN 9 |',
                     '| tests/gpu/test_gpu.py, TF2-behaviour graph mode | PASS | 30 s | 1 passed, '
                     '1 skipped |', '- `test_renorm[NHWC]`: failed: bad',
                     '- `test_nccl`: skipped: NCCL needs 2 distinct physical GPUs',
                     'figures of network_step.py: 1.03x', 'revision `abc1234`'):
        assert expected in text, (expected, text)
    assert 'gpu-check: FAIL. Report: ' in capsys.readouterr().out
    commands = FakeCommands()
    passing = tmp_path / 'passing'
    passing.mkdir()
    assert _main(passing, commands, '--python', '/fake/python', '--no-bench')[0] == 0
    assert not [cmd for cmd, _ in commands.calls if 'bench/sync_step.py' in cmd]


@pytest.mark.once
def test_known_causes_of_a_failure_get_a_hint():
    assert gpu_check.known_problems('... libdevice not found at ./libdevice.10.bc', True) == [
        '- hint: ' + gpu_check.KNOWN_PROBLEMS[0][1]]
    assert 'Out of GPU memory' in gpu_check.known_problems('ResourceExhaustedError: OOM', True)[0]
    assert gpu_check.known_problems('libdevice', False) == []


@pytest.mark.once
def test_a_tensorflow_that_cannot_use_the_gpus_fails_after_writing_the_report(tmp_path):
    commands = FakeCommands(probe=dict(PROBE_OK, cuda_build=False, gpus=[]))
    status, reports, text = _main(tmp_path, commands, '--python', '/fake/python')
    assert status == 1 and len(reports) == 1
    assert '## Why the check could not run' in text and 'CPU-only build' in text
    assert '| TensorFlow | 2.21.0, a CPU-only build |' in text
    assert '| environment | given with --python (`/fake/python`) |' in text
    assert not [cmd for cmd, _ in commands.calls if 'pytest' in cmd]


@pytest.mark.once
def test_a_crash_of_the_check_itself_still_writes_what_ran(tmp_path):
    class Crashing(FakeCommands):
        def __call__(self, cmd, env=None, timeout=None, echo=True):
            if 'tf1_syncbn.selftest' in cmd:
                raise RuntimeError('a bug in gpu_check')
            return FakeCommands.__call__(self, cmd, env, timeout, echo)

    status, _, text = _main(tmp_path, Crashing(), '--python', '/fake/python')
    assert status == 1
    assert 'gpu-check itself failed' in text and 'RuntimeError: a bug in gpu_check' in text
    assert '| tests/gpu/test_gpu.py, TF1 behaviour | PASS |' in text


@pytest.mark.once
def test_a_cpu_only_project_venv_leads_to_the_gpu_venv(tmp_path):
    """Without --python: .venv when its TensorFlow sees the GPUs, else the GPU venv."""
    venv = str(tmp_path / 'venv-gpu')
    project = os.path.join(ROOT, '.venv', 'bin', 'python')

    class Commands(FakeCommands):
        def __call__(self, cmd, env=None, timeout=None, echo=True):
            if cmd[1:3] == ['-m', 'venv']:
                os.makedirs(os.path.join(venv, 'bin'))
                open(os.path.join(venv, 'bin', 'python'), 'w').close()
            if cmd[0] == project and cmd[1:3] == ['-c', gpu_env.PROBE]:
                self.calls.append((list(cmd), {}))
                return gpu_run.Result(0, gpu_env.PROBE_TAG + json.dumps(
                    dict(PROBE_OK, cuda_build=False, gpus=[], gpu_names=[])), 1.0)
            if cmd[1:3] == ['-c', 'import tensorflow as tf; print(tf.__version__)']:
                return gpu_run.Result(0, '2.21.0\n', 1.0)
            return FakeCommands.__call__(self, cmd, env, timeout, echo)

    commands = Commands()
    status, _, text = _main(tmp_path, commands, '--venv', venv, '--no-bench')
    assert status == 0, text
    gpu_python = os.path.join(venv, 'bin', 'python')
    assert [c for c, _ in commands.calls if 'pytest' in c][0][0] == gpu_python
    if os.path.exists(project):
        assert '.venv not used (TensorFlow 2.21.0, no GPU)' in text
    assert ['-e', '.[gpu,test]'] in [c[-2:] for c, _ in commands.calls]


@pytest.mark.once
def test_the_gpu_environment_is_set_up_once(tmp_path):
    venv = str(tmp_path / 'venv-gpu')
    calls = []

    def run(cmd, env=None, timeout=None, echo=True):
        calls.append(cmd)
        if cmd[1:3] == ['-m', 'venv']:
            os.makedirs(os.path.join(venv, 'bin'))
            open(os.path.join(venv, 'bin', 'python'), 'w').close()
        return gpu_run.Result(0, '2.21.0\n' if '-c' in cmd else 'ok', 1.0)

    python = gpu_env.ensure_gpu_venv(venv, '/usr/bin/python3', run)
    assert python == os.path.join(venv, 'bin', 'python')
    pip = [python, '-m', 'pip', '--disable-pip-version-check', 'install', '--progress-bar',
           'off']
    assert calls == [['/usr/bin/python3', '-m', 'venv', venv],
                     pip + ['--upgrade', 'pip', 'setuptools', 'wheel'],
                     pip + ['-e', '.[gpu,test]'],
                     [python, '-c', 'import tensorflow as tf; print(tf.__version__)'],
                     pip + ['--no-deps', 'tf-keras~=2.21.0']]
    del calls[:]
    assert gpu_env.ensure_gpu_venv(venv, '/usr/bin/python3', run) == python
    assert calls == []


@pytest.mark.once
def test_without_tf_keras_the_gpu_environment_is_used_and_set_up_again_next_time(tmp_path,
                                                                                   capsys):
    venv = str(tmp_path / 'venv-gpu')
    os.makedirs(os.path.join(venv, 'bin'))
    open(os.path.join(venv, 'bin', 'python'), 'w').close()
    calls = []

    def run(cmd, env=None, timeout=None, echo=True):
        calls.append(cmd)
        if '-c' in cmd:     # TensorFlow's log may come around the version
            return gpu_run.Result(0, 'I0000 port.cc:153] oneDNN\n2.22.0rc1\nW0000 exit\n', 1)
        return gpu_run.Result(1 if 'tf-keras~=2.22.0' in cmd else 0, 'no such version', 1)

    python = gpu_env.ensure_gpu_venv(venv, '/usr/bin/python3', run)
    assert python == os.path.join(venv, 'bin', 'python')
    assert "warning: `" in capsys.readouterr().out
    assert len(calls) == 4     # no venv to create; pip, the project, the version, tf-keras
    gpu_env.ensure_gpu_venv(venv, '/usr/bin/python3', run)
    assert len(calls) == 8


@pytest.mark.once
def test_a_machine_without_network_gets_the_way_round_it(tmp_path):
    """What pip printed on a lent H100 machine with no network (2026-11-27)."""
    offline = ('Requirement already satisfied: pip in ./.venv-gpu/lib/python3.12/site-packages '
               '(24.0)\nERROR: Could not find a version that satisfies the requirement '
               'setuptools (from versions: none)\nERROR: No matching distribution found for '
               'setuptools\n')
    venv = str(tmp_path / 'venv-gpu')

    def run(cmd, env=None, timeout=None, echo=True):
        if cmd[1:3] == ['-m', 'venv']:
            os.makedirs(os.path.join(venv, 'bin'))
            open(os.path.join(venv, 'bin', 'python'), 'w').close()
            return gpu_run.Result(0, '', 1.0)
        return gpu_run.Result(1, offline, 1.0)

    with pytest.raises(gpu_env.SetupError) as raised:
        gpu_env.ensure_gpu_venv(venv, '/usr/bin/python3', run)
    message = str(raised.value)
    assert 'pip reached no package index' in message and "--python PY" in message
    assert 'No matching distribution found for setuptools' in message
    text = gpu_report.render_report({
        'date': 'd', 'command': 'make gpu-check', 'revision': 'r',
        'machine': {'gpus': [], 'gpu_list': [], 'driver_cuda': '', 'cpu': 'c', 'os': 'o',
                    'python': '3.12'},
        'environment': {}, 'problem': message, 'steps': []})
    assert '| environment | not set up (see below) |' in text
    assert gpu_env.setup_hint([venv + '/bin/python', '-m', 'pip'], 'ERROR: a build failed') == ''


@pytest.mark.once
def test_the_gpu_split_of_bench_devices():
    assert [_devices.split_factor(t, p) for t, p in ((4, 1), (3, 2), (4, 4), (1, 8))] == \
        [4, 2, 1, 1]
    assert _devices.logical_memory_mb(4, 4096, 81000) == 4096
    assert _devices.logical_memory_mb(4, 4096, 8000) == 1600
    assert _devices.logical_memory_mb(3, 2048, None) == _devices.FALLBACK_MEMORY_MB
    # Spread over the physical GPUs first; physical GPU p holds logical p*split ...
    assert _devices.tower_gpus(4, 3, 2) == [0, 2, 4, 1]
    assert _devices.tower_gpus(3, 1, 3) == [0, 1, 2]
    with pytest.raises(ValueError):
        _devices.tower_gpus(5, 2, 2)
    config = _devices.gpu_session_config(2, 3, 1600)
    assert [list(v.memory_limit_mb) for v in config.gpu_options.experimental.virtual_devices] \
        == [[1600.0] * 3] * 2
    assert not config.allow_soft_placement and not config.gpu_options.allow_growth
    whole = _devices.gpu_session_config(2, 1, None, soft_placement=True)
    assert whole.gpu_options.allow_growth and whole.allow_soft_placement
    assert not whole.gpu_options.experimental.virtual_devices
    cpu = _devices.towers_on('cpu', 3)
    assert cpu.devices == ['/cpu:0', '/cpu:1', '/cpu:2'] and cpu.notes == []
    assert dict(cpu.config.device_count) == {'CPU': 3}
    with pytest.raises(ValueError, match=r"--device gpu: TensorFlow .* sees no GPU .*CPU-only"):
        _devices.towers_on('gpu', 4)
    with pytest.raises(ValueError, match='--towers must be a positive int'):
        _devices.towers_on('cpu', 0)


@pytest.mark.once
def test_test_gpu_splits_only_in_a_process_of_its_own():
    assert test_gpu.plan_layout(1, []) == (3, '')
    assert test_gpu.plan_layout(2, []) == (2, '')
    assert test_gpu.plan_layout(3, ['test_a.py']) == (1, '')
    split, why = test_gpu.plan_layout(1, ['test_a.py', 'test_b.py', 'test_c.py', 'test_d.py'])
    assert split == 1
    assert why.startswith('1 physical GPU(s), not split into logical GPUs: other test files '
                          'run in this process (test_a.py, test_b.py, test_c.py, ...)')
    assert 'make gpu-check' in why


@pytest.mark.once
def test_logical_gpus_count_as_gpus_for_the_towers(graph, monkeypatch):
    """One physical GPU split into 3: towers on /gpu:0 to /gpu:2 build, /gpu:3 is an error."""
    gpu = tf.config.PhysicalDevice('/physical_device:GPU:0', 'GPU')
    monkeypatch.setattr(tf.config, 'list_physical_devices',
                        lambda kind=None: [gpu] if kind == 'GPU' else [])
    monkeypatch.setattr(tf.config, 'get_logical_device_configuration',
                        lambda device: [tf.config.LogicalDeviceConfiguration(1024)] * 3)
    assert (backends.physical_gpu_count(), backends.local_gpu_count()) == (1, 3)
    backends.check_local_gpu('bn', '/device:GPU:2', 'collective')
    with pytest.raises(ValueError, match=r'on /device:GPU:3, but this process sees 3 GPUs '
                                         r'\(GPU:0 to GPU:2\).*set_logical_device_configuration'):
        backends.check_local_gpu('bn', '/device:GPU:3', 'collective')
    monkeypatch.setattr(tf.config, 'get_logical_device_configuration', lambda device: None)
    assert backends.local_gpu_count() == 1


@pytest.mark.once
@pytest.mark.parametrize('script', ['sync_step', 'network_step', 'inference'])
def test_bench_device_gpu_without_a_gpu_is_a_clear_error(script, capsys):
    module = __import__(script)
    with pytest.raises(SystemExit) as stopped:
        module.main(['--device', 'gpu'])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert 'error: --device gpu: TensorFlow %s sees no GPU' % tf.__version__ in err, err
    assert 'CPU-only build' in err and 'Traceback' not in err
    with pytest.raises(SystemExit):
        module.main(['--device', 'tpu'])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


#: The dry run's cases in the TF1-behaviour pass: those whose reads TF1 behaviour
#: changes (the moving and renorm statistics, reference variables), and one
#: half-precision case.
V1_DRY_RUN = 'tensor_is_training or renorm or (collective and bfloat16 and NCHW)'


@pytest.mark.timeout(600)
@pytest.mark.once(reason='make gpu-check runs test_gpu.py in both behaviours itself')
def test_the_gpu_tests_dry_run_on_virtual_cpus(tmp_path):
    """tests/gpu/test_gpu.py on 3 virtual CPUs, stock kernels, oneDNN off: its references hold.

    The child runs in this process's TF behaviour; the TF1-behaviour pass
    runs :data:`V1_DRY_RUN` only.
    """
    junit = str(tmp_path / 'gpu.xml')
    env = dict(os.environ, TF1_SYNCBN_GPU_TESTS_ON_CPU='1', TF_ENABLE_ONEDNN_OPTS='0')
    select = ['-k', V1_DRY_RUN] if tf_behavior.is_v1() else []
    done = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                           os.path.join(ROOT, 'tests', 'gpu', 'test_gpu.py'), '--junitxml=' + junit]
                          + select, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True, timeout=580,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:]
    counts, cases = gpu_report.parse_junit(junit)
    expected = ({'passed': 5, 'failed': 0, 'error': 0, 'skipped': 0} if select else
                {'passed': 10, 'failed': 0, 'error': 0, 'skipped': 6})
    assert dict(counts) == expected, textwrap.shorten(done.stdout, 3000)
    assert all('nccl' in name for name, outcome, _ in cases if outcome == 'skipped')

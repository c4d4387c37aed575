"""``make gpu-check``: everything this project checks on GPUs, in one command, with a report.

For the first machine with NVIDIA GPUs that runs this project. In order:

1. **GPUs.** ``nvidia-smi -L``. When it is missing, fails, or lists no GPU,
   the script says so, checks nothing and exits 0.
2. **An environment whose TensorFlow sees the GPUs.** The project's ``.venv``
   when its TensorFlow does (and pytest is there); else ``.venv-gpu``
   (git-ignored), created with this script's Python and set up once:
   ``pip install -e '.[gpu,test]'`` (``tensorflow[and-cuda]``) and tf-keras
   pinned to TensorFlow's minor version with ``--no-deps`` (as the Makefile
   does for ``.venv``). Set-up is redone only when ``pyproject.toml``
   changes. ``--python`` names an interpreter to use instead. A probe
   process then checks that TensorFlow sees the GPUs and runs an op on one;
   if not, the check fails saying why (a CPU-only build; a driver older
   than the CUDA TensorFlow was built for; ``CUDA_VISIBLE_DEVICES``;
   TensorFlow's own log lines about CUDA).
3. **The GPU tests**, ``tests/test_gpu.py``, in a process of their own per TF
   behaviour (``TF1_SYNCBN_TEST_BEHAVIOR=v2``, then ``v1``): NCCL (2+
   physical GPUs) and the GPU collective ops, float32/float16/bfloat16,
   NHWC/NCHW, a tensor ``is_training``, renorm. On one GPU the file splits
   it into logical GPUs.
4. **The self-test**, ``python -m tf1_syncbn.selftest --device gpu --towers
   <GPUs>``, then the same with ``--tf1-behavior``: the ``collective``,
   ``nccl`` and ``auto`` backends on one tower per GPU against
   ``tf.nn.fused_batch_norm``.
5. **The benchmarks on GPU towers** (unless ``--no-bench``):
   ``bench/sync_step.py``, ``bench/network_step.py`` (the default size and a
   larger batch), ``bench/inference.py``, each with ``--device gpu``.

Every step's output is shown as it runs. The figures, with the machine (GPU
models and count, driver, CPU and cores, OS, Python, TensorFlow and its
CUDA/cuDNN, the date and git revision), go to
``bench/results/gpu-check-<count>x-<gpu>-<date>.md`` (see
``tools/gpu_report.py``), written also when a step fails: commit it.

Exit status: 0 when every step passed, or when there is no GPU; 1 when a
step failed or the environment could not be set up (after writing the
report); 2 on bad arguments.

Usage::

    make gpu-check [GPU_CHECK_ARGS='--no-bench']
    python3 tools/gpu_check.py [--python PY] [--venv DIR] [--results-dir DIR]
                               [--no-bench] [--timeout S] [--nvidia-smi PATH]
"""

import argparse
import collections
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import gpu_report  # noqa: E402

#: The result of one command: exit status, output (stdout and stderr), seconds.
Result = collections.namedtuple('Result', ['rc', 'output', 'seconds'])

#: Bumped when the set-up of ``.venv-gpu`` changes, so that it is redone.
SETUP_VERSION = '1'
PROBE_TAG = 'GPU_CHECK_PROBE '
#: Run in the environment's Python: what its TensorFlow sees, as one JSON line.
PROBE = r'''
import json, platform
info = {'python': platform.python_version()}
try:
    import tensorflow as tf
except Exception as e:  # noqa: BLE001 - any failure to import is the answer
    info['error'] = 'import tensorflow: %s: %s' % (type(e).__name__, e)
    print('GPU_CHECK_PROBE ' + json.dumps(info))
    raise SystemExit(0)
for module in ('pytest', 'pytest_timeout', 'tf1_syncbn'):
    try:
        __import__(module)
        info[module] = True
    except Exception:  # noqa: BLE001
        info[module] = False
build = tf.sysconfig.get_build_info()
info.update(tensorflow=tf.__version__, cuda_build=bool(tf.test.is_built_with_cuda()),
            cuda_version=str(build.get('cuda_version', '')),
            cudnn_version=str(build.get('cudnn_version', '')), compute_error='')
gpus = tf.config.list_physical_devices('GPU')
info['gpus'] = [d.name for d in gpus]
info['gpu_names'] = [tf.config.experimental.get_device_details(d).get('device_name', '')
                     for d in gpus]
if gpus:
    try:
        with tf.device('/GPU:0'):
            value = tf.reduce_sum(tf.ones([64, 64]))
        info['compute_device'] = value.device
        if float(value.numpy()) != 4096.0:
            info['compute_error'] = 'a sum of 4096 ones on GPU:0 gave %r' % float(value)
    except Exception as e:  # noqa: BLE001
        info['compute_error'] = '%s: %s' % (type(e).__name__, str(e).strip()[:500])
print('GPU_CHECK_PROBE ' + json.dumps(info))
'''


class SetupError(Exception):
    """The environment could not be set up, or its TensorFlow cannot use the GPUs."""


def run_command(cmd, env=None, timeout=None, echo=True):
    """Runs ``cmd`` in the repository, shows its output as it comes, returns a :class:`Result`.

    After ``timeout`` seconds its whole process group is killed (exit status
    124). A command that cannot start gives exit status 127.
    """
    start = time.time()
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, universal_newlines=True,
                                start_new_session=True)
    except OSError as e:
        return Result(127, 'cannot run %s: %s' % (cmd[0], e), time.time() - start)
    expired = []

    def stop():
        expired.append(True)
        try:
            os.killpg(proc.pid, 9)
        except OSError:
            pass

    timer = threading.Timer(timeout, stop) if timeout else None
    if timer:
        timer.start()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if echo:
            sys.stdout.write('    ' + line)
            sys.stdout.flush()
    rc = proc.wait()
    if timer:
        timer.cancel()
    if expired:
        lines.append('[gpu-check: stopped after %d s]\n' % timeout)
        rc = 124
    return Result(rc, ''.join(lines), time.time() - start)


def shell_words(cmd):
    """``cmd`` as one would type it (for the report)."""
    words = [os.path.relpath(w, ROOT) if os.path.isabs(w) and w.startswith(ROOT) else w
             for w in cmd]
    return ' '.join(w if re.match(r'^[\w@%+=:,./-]+$', w) else "'%s'" % w for w in words)


def detect_gpus(nvidia_smi='nvidia-smi'):
    """``(lines, why_none)``: the GPU lines of ``nvidia-smi -L``, or why there are none."""
    status, output = _machine.run_nvidia_smi(['-L'], nvidia_smi)
    if status == 'missing':
        return [], '%s was not found on PATH' % nvidia_smi
    lines = _machine.parse_gpu_list(output)
    first = output.strip().splitlines()[0] if output.strip() else 'no output'
    if not lines:
        return [], ('nvidia-smi lists no GPU (%s)' % first if status == 'ok' or
                    'No devices' in output else 'nvidia-smi failed (%s)' % first)
    return lines, ''


def parse_probe(output):
    """The probe's JSON dict from its output; ``{'error': ...}`` when it printed none."""
    for line in output.splitlines():
        if line.startswith(PROBE_TAG):
            return json.loads(line[len(PROBE_TAG):])
    return {'error': 'the TensorFlow probe printed no result:\n' + gpu_report.tail(output, 20)}


def _version(text):
    return tuple(int(p) for p in re.findall(r'\d+', text)[:3])


def _log_hints(log):
    """TensorFlow's log lines about CUDA, the driver and the GPUs (the last 12)."""
    hints = [line.strip() for line in log.splitlines()
             if re.search(r'(?i)cuda|cudnn|dlopen|libcu|driver|gpu', line)
             and not line.startswith(PROBE_TAG) and 'oneDNN' not in line]
    return hints[-12:]


def diagnose(probe, log, gpus, driver_cuda, environ=None):
    """Why TensorFlow cannot use the GPUs nvidia-smi lists, or '' when it can.

    Args:
      probe: the dict :data:`PROBE` printed.
      log: everything the probe printed (TensorFlow's log included).
      gpus: the ``nvidia-smi -L`` GPU lines.
      driver_cuda: the newest CUDA the driver supports (``'12.4'``), or ''.
      environ: the environment (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    if probe.get('error'):
        return 'TensorFlow does not work in this environment: %s' % probe['error']
    cuda = probe.get('cuda_version', '')
    parts = []
    if not probe.get('gpus'):
        if not probe.get('cuda_build'):
            return ('TensorFlow %s here is a CPU-only build (tensorflow-cpu, or a build without '
                    "CUDA), while nvidia-smi lists %d GPU(s). Install the CUDA build: pip "
                    "install -e '.[gpu]' (tensorflow[and-cuda]), as .venv-gpu does."
                    % (probe.get('tensorflow'), len(gpus)))
        parts.append('TensorFlow %s is built for CUDA %s and cuDNN %s, but sees none of the '
                     '%d GPU(s) nvidia-smi lists.' % (probe.get('tensorflow'), cuda or '?',
                                                      probe.get('cudnn_version') or '?',
                                                      len(gpus)))
    elif probe.get('compute_error'):
        parts.append('TensorFlow %s sees the GPUs but cannot run an op on GPU:0: %s'
                     % (probe.get('tensorflow'), probe['compute_error']))
    else:
        return ''
    if driver_cuda and cuda and _version(driver_cuda)[:1] < _version(cuda)[:1]:
        parts.append('Driver/CUDA mismatch: the NVIDIA driver supports CUDA up to %s, older '
                     'than the CUDA %s TensorFlow needs. Update the driver (or use a '
                     'TensorFlow built for CUDA %s).' % (driver_cuda, cuda, driver_cuda))
    elif driver_cuda and cuda and _version(driver_cuda)[:2] < _version(cuda)[:2]:
        parts.append('The driver supports CUDA up to %s, a minor version older than the CUDA '
                     '%s TensorFlow was built for: that works through CUDA minor-version '
                     'compatibility, unless kernels must be compiled from PTX. Updating the '
                     'driver rules it out.' % (driver_cuda, cuda))
    elif driver_cuda:
        parts.append('The driver supports CUDA up to %s.' % driver_cuda)
    if environ.get('CUDA_VISIBLE_DEVICES') is not None:
        parts.append('CUDA_VISIBLE_DEVICES=%r is set, which may hide GPUs.'
                     % environ['CUDA_VISIBLE_DEVICES'])
    hints = _log_hints(log)
    if hints:
        parts.append("TensorFlow's log:\n\n" + '\n'.join('    ' + h for h in hints))
    return ' '.join(parts)


def probe_environment(python, run):
    """``(probe dict, log)`` of TensorFlow in ``python`` (its log on, at INFO level)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='0')
    result = run([python, '-c', PROBE], env=env, timeout=600, echo=False)
    return parse_probe(result.output), result.output


def _setup_stamp():
    with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
        return hashlib.sha256(f.read() + SETUP_VERSION.encode()).hexdigest()


def ensure_gpu_venv(venv, base_python, run):
    """Creates and sets up ``venv`` (once per ``pyproject.toml``); returns its Python.

    Raises:
      SetupError: naming the command that failed, with its output's tail.
    """
    python = os.path.join(venv, 'bin', 'python')
    stamp = os.path.join(venv, '.installed-gpu-check')
    want = _setup_stamp()
    if os.path.exists(python) and os.path.exists(stamp):
        with open(stamp) as f:
            if f.read().strip() == want:
                return python
    pip = [python, '-m', 'pip', '--disable-pip-version-check', 'install', '--progress-bar',
           'off']
    steps = [] if os.path.exists(python) else [[base_python, '-m', 'venv', venv]]
    steps += [pip + ['--upgrade', 'pip', 'setuptools', 'wheel'],
              pip + ['-e', '.[gpu,test]']]
    for cmd in steps:
        print('gpu-check: %s' % shell_words(cmd))
        result = run(cmd, env=None, timeout=3600, echo=True)
        if result.rc:
            hint = (' (python3 -m venv needs the python3-venv package on Debian/Ubuntu)'
                    if cmd[1:3] == ['-m', 'venv'] else '')
            raise SetupError('setting up %s failed at `%s` (exit status %d)%s:\n\n%s'
                             % (os.path.relpath(venv, ROOT), shell_words(cmd), result.rc, hint,
                                gpu_report.tail(result.output, 30)))
    version = run([python, '-c', 'import tensorflow as tf; print(tf.__version__)'],
                  env=None, timeout=600, echo=False)
    found = re.search(r'^(\d+)\.(\d+)', version.output.strip().splitlines()[-1]
                      if version.output.strip() else '')
    if version.rc or not found:
        raise SetupError('TensorFlow does not import in %s after installing it:\n\n%s'
                         % (venv, gpu_report.tail(version.output, 30)))
    cmd = pip + ['--no-deps', 'tf-keras~=%s.%s.0' % found.groups()]
    print('gpu-check: %s' % shell_words(cmd))
    result = run(cmd, env=None, timeout=1800, echo=True)
    if result.rc:
        raise SetupError('installing tf-keras failed (`%s`, exit status %d):\n\n%s'
                         % (shell_words(cmd), result.rc, gpu_report.tail(result.output, 30)))
    with open(stamp, 'w') as f:
        f.write(want + '\n')
    return python


def choose_environment(args, run, gpus, driver_cuda):
    """The Python to run everything with, as a dict for the report.

    Returns:
      ``{'python', 'description', 'tensorflow', 'build', 'tf_gpus'}``.

    Raises:
      SetupError: set-up failed, or TensorFlow cannot use the GPUs (why).
    """
    notes = []
    if args.python:
        python, description = args.python, 'given with --python'
    else:
        python = os.path.join(ROOT, '.venv', 'bin', 'python')
        description = "the project's .venv"
        usable = False
        if os.path.exists(python):
            probe, _ = probe_environment(python, run)
            usable = (probe.get('gpus') and not probe.get('compute_error') and
                      probe.get('pytest') and probe.get('pytest_timeout') and
                      probe.get('tf1_syncbn'))
            if not usable:
                notes.append(".venv not used (TensorFlow %s, %s)" % (
                    probe.get('tensorflow', 'not importable'),
                    'sees %d GPU(s)' % len(probe.get('gpus') or []) if probe.get('gpus')
                    else 'no GPU'))
        if not usable:
            python = ensure_gpu_venv(os.path.join(ROOT, args.venv), sys.executable, run)
            description = '%s (tensorflow[and-cuda])%s' % (args.venv,
                                                           '; ' + notes[0] if notes else '')
    probe, log = probe_environment(python, run)
    problem = diagnose(probe, log, gpus, driver_cuda)
    if problem:
        raise SetupError(problem)
    return {'python': python, 'description': description, 'tensorflow': probe['tensorflow'],
            'build': 'CUDA %s, cuDNN %s' % (probe.get('cuda_version') or '?',
                                            probe.get('cudnn_version') or '?'),
            'tf_gpus': ['%s (%s)' % (d, n) if n else d
                        for d, n in zip(probe['gpus'], probe.get('gpu_names') or [])],
            'python_version': probe.get('python', '')}


def run_steps(python, gpu_count, args, run, steps):
    """Runs the tests, the self-test and the benchmarks, appending a :class:`Step` to ``steps``.

    (Appended one by one, so that the report keeps what ran before a failure.)
    """
    env = dict(os.environ)
    env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    env.pop('TF1_SYNCBN_GPU_TESTS_ON_CPU', None)
    folder = tempfile.mkdtemp(prefix='gpu-check-')
    try:
        for behaviour, title in (('v2', 'TF2-behaviour graph mode'), ('v1', 'TF1 behaviour')):
            junit = os.path.join(folder, behaviour + '.xml')
            cmd = [python, '-m', 'pytest', '-q', 'tests/test_gpu.py', '--junitxml=' + junit]
            shown = 'TF1_SYNCBN_TEST_BEHAVIOR=%s %s' % (behaviour, shell_words(cmd[:-1]))
            print('gpu-check: ' + shown)
            result = run(cmd, env=dict(env, TF1_SYNCBN_TEST_BEHAVIOR=behaviour),
                         timeout=args.timeout, echo=True)
            steps.append(gpu_report.pytest_step('tests/test_gpu.py, ' + title, shown,
                                                result.rc, result.seconds, result.output,
                                                junit))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    selftest = [python, '-m', 'tf1_syncbn.selftest', '--device', 'gpu', '--towers',
                str(gpu_count)]
    commands = [('self-test, TF2-behaviour graph mode', selftest),
                ('self-test, TF1 behaviour', selftest + ['--tf1-behavior'])]
    if not args.no_bench:
        commands += [
            ('bench/sync_step.py', [python, 'bench/sync_step.py', '--device', 'gpu']),
            ('bench/network_step.py', [python, 'bench/network_step.py', '--device', 'gpu']),
            ('bench/network_step.py, 16 images of 128x128 per tower',
             [python, 'bench/network_step.py', '--device', 'gpu', '--batch', '16', '--size',
              '128']),
            ('bench/inference.py', [python, 'bench/inference.py', '--device', 'gpu'])]
    for name, cmd in commands:
        print('gpu-check: ' + shell_words(cmd))
        result = run(cmd, env=env, timeout=args.timeout, echo=True)
        last = [line for line in result.output.strip().splitlines() if line.strip()]
        summary = ('exit status 0' if not result.rc else 'exit status %d: %s'
                   % (result.rc, last[-1][:200] if last else 'no output'))
        steps.append(gpu_report.Step(name, shell_words(cmd), 'FAIL' if result.rc else 'PASS',
                                     result.seconds, summary, [],
                                     gpu_report.tail(result.output, 200)))


def revision(run):
    """The git revision, and whether tracked files have uncommitted changes."""
    head = run(['git', 'rev-parse', '--short', 'HEAD'], env=None, timeout=60, echo=False)
    if head.rc:
        return 'unknown (not a git checkout)'
    dirty = run(['git', 'status', '--porcelain', '--untracked-files=no'], env=None,
                timeout=60, echo=False)
    return '`%s`%s' % (head.output.strip(),
                       ' with uncommitted changes' if dirty.output.strip() else '')


def _parse(argv):
    parser = argparse.ArgumentParser(prog='tools/gpu_check.py',
                                     description=__doc__.split('\n')[0])
    parser.add_argument('--python', help='run everything with this Python (its TensorFlow '
                        'must see the GPUs) instead of .venv / .venv-gpu')
    parser.add_argument('--venv', default='.venv-gpu',
                        help='the environment set up when .venv cannot use the GPUs '
                        '(default .venv-gpu, relative to the repository)')
    parser.add_argument('--results-dir', default=os.path.join(ROOT, 'bench', 'results'),
                        help='where the report goes (default bench/results)')
    parser.add_argument('--no-bench', action='store_true', help='skip the benchmarks')
    parser.add_argument('--timeout', type=int, default=3600,
                        help='the most seconds one step may take (default 3600)')
    parser.add_argument('--nvidia-smi', default='nvidia-smi', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.timeout < 1:
        parser.error('--timeout must be at least 1')
    return args


def main(argv=None, run=run_command):
    """Runs the check; returns the exit status (see the module docstring).

    Args:
      argv: the arguments without the program name (default ``sys.argv[1:]``).
      run: runs one command, as :func:`run_command` (tests pass a fake).
    """
    args = _parse(argv)
    gpu_lines, why_none = detect_gpus(args.nvidia_smi)
    if not gpu_lines:
        print('gpu-check: no GPU here: %s. Nothing was checked.' % why_none)
        return 0
    gpus = _machine.query_gpus(args.nvidia_smi) or [
        _machine.Gpu(i, re.sub(r'^GPU \d+:\s*|\s*\(UUID.*$', '', line), None, None, '')
        for i, line in enumerate(gpu_lines)]
    print('gpu-check: %s' % _machine.describe_gpus(gpus))
    now = datetime.datetime.now(datetime.timezone.utc)
    report = {
        'date': now.strftime('%Y-%m-%d %H:%M UTC'),
        'command': ('make gpu-check' if os.environ.get('MAKELEVEL') else
                    'python3 tools/gpu_check.py' + ''.join(
                        ' ' + a for a in (sys.argv[1:] if argv is None else argv))),
        'revision': revision(run),
        'machine': {'gpus': gpus, 'gpu_list': gpu_lines,
                    'driver_cuda': _machine.driver_cuda_version(args.nvidia_smi),
                    'cpu': _machine.cpu_line(), 'os': platform.platform(),
                    'python': platform.python_version()},
        'environment': {}, 'problem': '', 'steps': []}
    try:
        env = choose_environment(args, run, gpu_lines, report['machine']['driver_cuda'])
        report['environment'] = env
        report['machine']['python'] = env.get('python_version') or report['machine']['python']
        run_steps(env['python'], len(env['tf_gpus']), args, run, report['steps'])
    except SetupError as e:
        report['problem'] = str(e)
        print('gpu-check: FAIL: %s' % e)
    except Exception:  # noqa: BLE001 - a bug here must still leave the report of what ran
        report['problem'] = 'gpu-check itself failed:\n\n```\n%s```' % traceback.format_exc()
        print('gpu-check: FAIL: ' + report['problem'])
    path = gpu_report.write_report(gpu_report.report_path(args.results_dir, gpus,
                                                          now.strftime('%Y-%m-%d')), report)
    failed = [s.name for s in report['steps'] if s.status == 'FAIL']
    for s in report['steps']:
        print('gpu-check: %-4s %s: %s' % (s.status, s.name, s.summary))
    print('gpu-check: %s. Report: %s (commit it).'
          % ('FAIL' if failed or report['problem'] else 'PASS', os.path.relpath(path, ROOT)))
    return 1 if failed or report['problem'] else 0


if __name__ == '__main__':
    sys.exit(main())

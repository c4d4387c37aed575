"""``make gpu-check``: everything this project checks on GPUs, in one command, with a report.

For the first machine with NVIDIA GPUs that runs this project. In order:

1. **GPUs.** ``nvidia-smi -L``. When it is missing, fails, or lists no GPU,
   the script says so, checks nothing and exits 0.
2. **An environment whose TensorFlow sees the GPUs.** The project's ``.venv``
   when its TensorFlow does (and pytest is there); else ``.venv-gpu``
   (git-ignored), created with this script's Python and set up once:
   ``pip install -e '.[gpu,test]'`` (``tensorflow[and-cuda]``) and tf-keras
   pinned to TensorFlow's minor version with ``--no-deps`` (as the Makefile
   does for ``.venv``; a warning only when that fails, since these checks do
   not use it). Set-up is redone only when ``pyproject.toml`` changes.
   ``--python`` names an interpreter to use instead. A probe process then
   checks that TensorFlow sees the GPUs and runs an op on one;
   if not, the check fails saying why (a CPU-only build; a driver older
   than the CUDA TensorFlow was built for; ``CUDA_VISIBLE_DEVICES``;
   TensorFlow's own log lines about CUDA).
3. **The GPU tests**, ``tests/gpu/test_gpu.py``, in a process of their own per TF
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

The parts: ``tools/gpu_run.py`` runs commands, ``tools/gpu_env.py`` finds or
sets up the environment and says why it cannot use the GPUs,
``tools/gpu_report.py`` writes the report; this module detects the GPUs and
runs the steps.

Exit status: 0 when every step passed, or when there is no GPU; 1 when a
step failed or the environment could not be set up (after writing the
report); 2 on bad arguments.

Usage::

    make gpu-check [GPU_CHECK_ARGS='--no-bench']
    python3 tools/gpu_check.py [--python PY] [--venv DIR] [--results-dir DIR]
                               [--no-bench] [--timeout S] [--nvidia-smi PATH]
"""

import argparse
import datetime
import os
import platform
import re
import shutil
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'bench'))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import gpu_report  # noqa: E402
from gpu_env import SetupError, choose_environment  # noqa: E402
from gpu_run import ROOT, run_command, shell_words  # noqa: E402


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


#: Known causes in a failing step's output: ``(pattern, hint)``.
KNOWN_PROBLEMS = (
    (r'libdevice|ptxas', 'XLA could not compile for the GPU (libdevice or ptxas not found). '
     'TF1_SYNCBN_XLA=0 builds the per-channel vector math from separate ops instead; or '
     'point XLA at CUDA: XLA_FLAGS=--xla_gpu_cuda_data_dir=<CUDA dir>.'),
    (r'CUDA_ERROR_OUT_OF_MEMORY|ResourceExhausted|\bOOM\b',
     'Out of GPU memory: does another process use the GPU (nvidia-smi)?'),
    (r'(?i)duplicate GPU', 'NCCL refused two members on one physical GPU.'),
)


def known_problems(output, failed):
    """Hint lines (Markdown) for the known causes found in a failed step's ``output``."""
    if not failed:
        return []
    return ['- hint: ' + hint for pattern, hint in KNOWN_PROBLEMS if re.search(pattern, output)]


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
            cmd = [python, '-m', 'pytest', '-q', 'tests/gpu/test_gpu.py', '--junitxml=' + junit]
            shown = 'TF1_SYNCBN_TEST_BEHAVIOR=%s %s' % (behaviour, shell_words(cmd[:-1]))
            print('gpu-check: ' + shown)
            result = run(cmd, env=dict(env, TF1_SYNCBN_TEST_BEHAVIOR=behaviour),
                         timeout=args.timeout, echo=True)
            step = gpu_report.pytest_step('tests/gpu/test_gpu.py, ' + title, shown, result.rc,
                                          result.seconds, result.output, junit)
            steps.append(step._replace(details=step.details + known_problems(
                result.output, step.status == 'FAIL')))
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
                                     result.seconds, summary,
                                     known_problems(result.output, result.rc != 0),
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
        run_steps(env['python'], max(1, len(env['tf_gpus'])), args, run, report['steps'])
    except SetupError as e:
        report['problem'] = str(e)
        report['environment'] = e.environment
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

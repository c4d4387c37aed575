"""The environment of ``make gpu-check``: a Python whose TensorFlow uses the GPUs, or why not.

The project's ``.venv`` when its TensorFlow sees the GPUs (and pytest is
there), else ``.venv-gpu``, set up once per ``pyproject.toml``
(:func:`ensure_gpu_venv`); a probe process (:data:`PROBE`) says what
TensorFlow sees there, and :func:`diagnose` says why it cannot use the GPUs
when it cannot. Standard library only (see ``tools/gpu_check.py``).
"""

import hashlib
import json
import os
import re
import sys

import gpu_report
from gpu_run import ROOT, shell_words

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
info['gpu_names'] = []
for d in gpus:
    try:
        info['gpu_names'].append(tf.config.experimental.get_device_details(d)['device_name'])
    except Exception:  # noqa: BLE001 - the name is only for the report
        info['gpu_names'].append('')
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
    """The environment could not be set up, or its TensorFlow cannot use the GPUs.

    ``environment``: what is known of the environment, for the report (``{}``
    when set-up failed before there was one).
    """

    def __init__(self, message, environment=None):
        Exception.__init__(self, message)
        self.environment = environment or {}


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


#: Output of pip that means no package index or wheelhouse could be reached.
NO_INDEX = re.compile(r'from versions: none|No matching distribution found|'
                      r'Failed to establish a new connection|Temporary failure in name '
                      r'resolution|Network is unreachable|ConnectTimeout|ReadTimeout')


def setup_hint(cmd, output):
    """A hint (with a leading space) for a failed set-up command, or ''."""
    if cmd[1:3] == ['-m', 'venv']:
        return ' (python3 -m venv needs the python3-venv package on Debian/Ubuntu)'
    if NO_INDEX.search(output):
        return (". pip reached no package index: this machine seems to have no network "
                "(or no mirror of PyPI). Install TensorFlow's CUDA build (tensorflow[and-cuda], "
                "with pytest and pytest-timeout) into a Python yourself, for instance from "
                "a folder of wheels (PIP_FIND_LINKS=DIR PIP_NO_INDEX=1), and run make "
                "gpu-check GPU_CHECK_ARGS='--python PY'")
    return ''


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
            hint = setup_hint(cmd, result.output)
            raise SetupError('setting up %s failed at `%s` (exit status %d)%s:\n\n%s'
                             % (os.path.relpath(venv, ROOT), shell_words(cmd), result.rc, hint,
                                gpu_report.tail(result.output, 30)))
    version = run([python, '-c', 'import tensorflow as tf; print(tf.__version__)'],
                  env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'), timeout=600, echo=False)
    found = re.findall(r'^(\d+)\.(\d+)\.\S+$', version.output, re.M)
    if version.rc or not found:
        raise SetupError('TensorFlow does not import in %s after installing it:\n\n%s'
                         % (venv, gpu_report.tail(version.output, 30)))
    # tf-keras serves the reference tests of `make test`, not this check: a
    # failure (no tf-keras release for this TensorFlow yet) is a warning, and
    # the set-up is tried again next time.
    cmd = pip + ['--no-deps', 'tf-keras~=%s.%s.0' % found[-1]]
    print('gpu-check: %s' % shell_words(cmd))
    result = run(cmd, env=None, timeout=1800, echo=True)
    if result.rc:
        print('gpu-check: warning: `%s` failed (exit status %d); the GPU check does not need '
              'tf-keras, so it goes on.' % (shell_words(cmd), result.rc))
        return python
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
    build = ('CUDA %s, cuDNN %s' % (probe.get('cuda_version') or '?',
                                    probe.get('cudnn_version') or '?')
             if probe.get('cuda_build') else 'a CPU-only build' if 'cuda_build' in probe else '')
    environment = {'python': python, 'description': description,
                   'tensorflow': probe.get('tensorflow', ''), 'build': build,
                   'tf_gpus': ['%s (%s)' % (d, n) if n else d for d, n in
                               zip(probe.get('gpus') or [], probe.get('gpu_names') or [])],
                   'python_version': probe.get('python', '')}
    problem = diagnose(probe, log, gpus, driver_cuda)
    if problem:
        raise SetupError(problem, environment)
    return environment

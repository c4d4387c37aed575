"""Optional CPU kernels for the synchronized training step, compiled on first use.

TensorFlow's stock CPU kernels need five passes over the tensor and a few
dozen small ops per layer for a synchronized batch-norm step, where
unsynchronized fused batch norm needs two passes and two ops (see the
README's benchmark section). ``sync_bn_ops.cc`` does the step in four
kernels, one pass each, around the two all-reduces.

They are compiled against the installed TensorFlow the first time a
synchronized layer is built on a CPU tower (about 20 s with ``g++``; one line
on stderr says so when it starts and when it is done), and cached in
``$TF1_SYNCBN_CACHE`` (default ``~/.cache/tf1_syncbn``). The cache key is the
source, the compiler flags and the TensorFlow build (version, commit, ABI
flags): not the checkout's or the virtual environment's path, so every
checkout and environment with the same TensorFlow shares one build.

Build them ahead of time (for images and CI) with::

    python -m tf1_syncbn.kernels

Without a working C++ compiler (``g++``, or ``$CXX``), or with
``TF1_SYNCBN_KERNELS=0``, the layers use TensorFlow's stock kernels instead:
same results, slower; a failed build says why in one warning. GPU towers
always use the stock (cuDNN) kernels.

The library also holds the *step watchdog* (``SyncBnStepWatchdog``), used on
every device type: it bounds how long a step may wait in its collectives with
one thread for the whole process, where TensorFlow's own per-op collective
timeout starts two sleeping threads per collective execution. Without the
library, the collective backend falls back to TensorFlow's per-op timeout.
"""

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import tensorflow as tf

__all__ = ['load', 'library', 'build', 'enabled', 'use_custom_kernels', 'status', 'cache_path']

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'sync_bn_ops.cc')
_LOCK = threading.Lock()
_STATE = {'module': None, 'tried': False, 'error': None}
_ALLOWED = os.environ.get('TF1_SYNCBN_KERNELS', '1') != '0'   # build and load the library
_ENABLED = [_ALLOWED]                                           # the layers use its kernels
_OPT_FLAGS = ['-O3', '-shared', '-fPIC']
_OP_TYPES = ('SyncBnMoments', 'SyncBnNormalize', 'SyncBnGradSums', 'SyncBnGradInput')


def enabled():
    """Whether layers built now may use the custom kernels."""
    return _ENABLED[0]


@contextlib.contextmanager
def use_custom_kernels(flag):
    """Builds layers with (True) or without (False) the custom kernels in the block."""
    previous = _ENABLED[0]
    _ENABLED[0] = bool(flag)
    try:
        yield
    finally:
        _ENABLED[0] = previous


def _arch_flags():
    if platform.machine() not in ('x86_64', 'AMD64'):
        return []
    try:
        with open('/proc/cpuinfo') as f:
            flags = set(next((l for l in f if l.startswith('flags')), '').split())
    except OSError:
        return []
    if {'avx2', 'fma', 'bmi2'} <= flags:
        return ['-march=x86-64-v3']
    return []


def _compiler():
    return os.environ.get('CXX') or 'g++'


def _tf_flags():
    """``(compile flags, link flags)`` of the installed TensorFlow."""
    return tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


def _compile_command(output):
    compile_flags, link_flags = _tf_flags()
    return ([_compiler()] + _OPT_FLAGS + [_SOURCE, '-o', output] + _arch_flags() +
            compile_flags + link_flags)


def _cache_key():
    """What the built library depends on: source, flags, TensorFlow build; no paths."""
    with open(_SOURCE, 'rb') as f:
        source = f.read()
    compile_flags, link_flags = _tf_flags()
    # Include and library directories are where this environment keeps
    # TensorFlow: the same build anywhere else gives the same library.
    portable = [flag for flag in compile_flags + link_flags
                if not flag.startswith(('-I', '-L'))]
    build = (tf.__version__, tf.version.GIT_VERSION, tf.version.COMPILER_VERSION,
             platform.machine(), _OPT_FLAGS, _arch_flags(), portable)
    return hashlib.sha256(source + repr(build).encode()).hexdigest()[:16]


def cache_path():
    """Where the compiled library for this TensorFlow build is (or will be) cached."""
    root = os.environ.get('TF1_SYNCBN_CACHE') or os.path.join(
        os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache'),
        'tf1_syncbn')
    return os.path.join(root, _cache_key(), 'sync_bn_ops.so')


def _say(message):
    print('tf1_syncbn: %s' % message, file=sys.stderr, flush=True)


def _compile(path):
    compiler = _compiler()
    if shutil.which(compiler) is None:
        raise RuntimeError('no C++ compiler: %r (g++, or $CXX) was not found' % compiler)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=os.path.dirname(path))
    os.close(fd)
    _say('compiling the CPU kernels (once per TensorFlow build, about 20 s) into %s' % path)
    start = time.time()
    try:
        proc = subprocess.run(_compile_command(tmp), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError('compiling %s with %s failed:\n%s'
                               % (_SOURCE, compiler, proc.stderr[-2000:]))
        os.replace(tmp, path)  # atomic: concurrent builders all leave a valid file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _say('compiled the CPU kernels in %.0f s: %s' % (time.time() - start, path))


def build(force=False):
    """Compiles the kernels into the cache unless they are there; returns the path.

    Args:
      force: compile even when the cache has them.

    Raises:
      RuntimeError: no compiler, or compiling failed (the message says why).
    """
    path = cache_path()
    if force or not os.path.exists(path):
        _compile(path)
    return path


def load():
    """The compiled op module for the layers' compute, or None when unavailable or disabled.

    The first call in a process compiles them if the cache does not have them
    yet. When that fails, it warns once and the layers use the stock kernels.
    ``TF1_SYNCBN_KERNELS=0`` (or :func:`use_custom_kernels`) disables them.
    """
    if not enabled():
        return None
    return library()


def library():
    """The compiled op module whether or not the compute kernels are enabled, or None.

    It also holds the step watchdog (``SyncBnStepWatchdog``), which the
    collective backend uses wherever the library can be built. None with
    ``TF1_SYNCBN_KERNELS=0`` or when building fails (warned once).
    """
    if not _ALLOWED:
        return None
    with _LOCK:
        if not _STATE['tried']:
            _STATE['tried'] = True
            try:
                module = tf.load_op_library(build())
                for op_type in _OP_TYPES:
                    # Statistics and gradient kernels: the engine differentiates the
                    # step as a whole (tf.custom_gradient); no path goes through them.
                    tf.no_gradient(op_type)
                _STATE['module'] = module
            except Exception as e:  # noqa: BLE001 - any failure means: use stock kernels
                _STATE['error'] = e
                warnings.warn("tf1_syncbn: custom CPU kernels unavailable (%s); using "
                              "TensorFlow's stock kernels (same results, slower) and "
                              "TensorFlow's per-op collective timeouts (two threads per "
                              "collective while it runs)." % e, RuntimeWarning, stacklevel=2)
        return _STATE['module']


def status():
    """A one-line description of the kernels in use, for diagnostics."""
    module = load()
    if module is not None:
        return 'custom CPU kernels (%s)' % cache_path()
    if not enabled():
        return 'stock kernels (custom kernels disabled)'
    return 'stock kernels (%s)' % (_STATE['error'],)

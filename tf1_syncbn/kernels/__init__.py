"""Optional CPU kernels for the synchronized training step, compiled on first use.

TensorFlow's stock CPU kernels need five passes over the tensor for a
synchronized batch-norm step where unsynchronized fused batch norm needs two
(see the README's benchmark section). ``sync_bn_ops.cc`` adds the two missing
kernels, a statistics-only reduction and a one-pass input gradient. They are
compiled against the installed TensorFlow the first time a synchronized layer
is built on a CPU tower, and cached in ``$TF1_SYNCBN_CACHE`` (default
``~/.cache/tf1_syncbn``), keyed by the source, the TensorFlow version and the
compiler flags.

Without a C++ compiler, or with ``TF1_SYNCBN_KERNELS=0``, the layers use
TensorFlow's stock kernels instead: same results, slower. GPU towers always
use the stock (cuDNN) kernels.
"""

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import tensorflow as tf

__all__ = ['load', 'enabled', 'use_custom_kernels', 'status']

_LOG = logging.getLogger('tf1_syncbn')
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'sync_bn_ops.cc')
_LOCK = threading.Lock()
_STATE = {'module': None, 'tried': False, 'error': None}
_ENABLED = [os.environ.get('TF1_SYNCBN_KERNELS', '1') != '0']


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


def _compile_command(output):
    compiler = os.environ.get('CXX', 'g++')
    return ([compiler, '-O3', '-shared', '-fPIC', _SOURCE, '-o', output] + _arch_flags() +
            tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags())


def _cache_path():
    with open(_SOURCE, 'rb') as f:
        source = f.read()
    key = hashlib.sha256(source + repr((tf.__version__, _compile_command('x'))).encode())
    root = os.environ.get('TF1_SYNCBN_CACHE',
                          os.path.join(os.path.expanduser('~'), '.cache', 'tf1_syncbn'))
    return os.path.join(root, key.hexdigest()[:16], 'sync_bn_ops.so')


def _build(path):
    if shutil.which(os.environ.get('CXX', 'g++')) is None:
        raise RuntimeError('no C++ compiler (g++ or $CXX) found')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=os.path.dirname(path))
    os.close(fd)
    try:
        proc = subprocess.run(_compile_command(tmp), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError('compiling %s failed:\n%s' % (_SOURCE, proc.stderr[-2000:]))
        os.replace(tmp, path)  # atomic: concurrent builders all leave a valid file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load():
    """The compiled op module, or None when the kernels are unavailable or disabled."""
    if not enabled():
        return None
    with _LOCK:
        if not _STATE['tried']:
            _STATE['tried'] = True
            try:
                path = _cache_path()
                if not os.path.exists(path):
                    _LOG.info('tf1_syncbn: compiling CPU kernels into %s', path)
                    _build(path)
                _STATE['module'] = tf.load_op_library(path)
            except Exception as e:  # noqa: BLE001 - any failure means: use stock kernels
                _STATE['error'] = e
                _LOG.warning('tf1_syncbn: custom CPU kernels unavailable (%s); using '
                             "TensorFlow's stock kernels (same results, slower).", e)
        return _STATE['module']


def status():
    """A one-line description of the kernels in use, for diagnostics."""
    module = load()
    if module is not None:
        return 'custom CPU kernels (%s)' % _cache_path()
    if not enabled():
        return 'stock kernels (custom kernels disabled)'
    return 'stock kernels (%s)' % (_STATE['error'],)

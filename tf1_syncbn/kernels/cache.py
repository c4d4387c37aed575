"""Compiling the CPU kernels, and the cache that keeps each build.

The kernels (``sync_bn_ops.cc``, next to this file) are compiled against the
installed TensorFlow into ``$TF1_SYNCBN_CACHE`` (default
``~/.cache/tf1_syncbn``), one build per cache key: the source, the compiler
flags (the arch flags actually used included, :mod:`tf1_syncbn.kernels.arch`)
and the TensorFlow build (version, commit, ABI flags); not the checkout's or
the virtual environment's path, so every checkout and environment with the
same TensorFlow shares one build. A build already cached for one of the arch
flag sets this CPU may use is taken as it is, without asking a compiler.
"""

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import tensorflow as tf

from tf1_syncbn.kernels import arch

__all__ = ['build', 'cache_path', 'cached_builds']

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'sync_bn_ops.cc')
_OPT_FLAGS = ['-O3', '-shared', '-fPIC']
_COMPILE_TIMEOUT_S = 900


def _tf_flags():
    """``(compile flags, link flags)`` of the installed TensorFlow."""
    return tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


def _compile_command(output, arch_flags):
    compile_flags, link_flags = _tf_flags()
    return ([arch.default_compiler()] + _OPT_FLAGS + [_SOURCE, '-o', output] + list(arch_flags) +
            compile_flags + link_flags)


def _cache_keys(arch_flag_sets):
    """The cache key of a build with each of the arch flag sets given.

    What the built library depends on: the source, every compiler flag (the
    arch flags actually used included), the TensorFlow build; no paths.
    """
    with open(_SOURCE, 'rb') as f:
        source = f.read()
    compile_flags, link_flags = _tf_flags()
    # Include and library directories are where this environment keeps
    # TensorFlow: the same build anywhere else gives the same library.
    portable = [flag for flag in compile_flags + link_flags
                if not flag.startswith(('-I', '-L'))]
    keys = []
    for arch_flags in arch_flag_sets:
        build = (tf.__version__, tf.version.GIT_VERSION, tf.version.COMPILER_VERSION,
                 platform.machine(), _OPT_FLAGS, list(arch_flags), portable)
        keys.append(hashlib.sha256(source + repr(build).encode()).hexdigest()[:16])
    return keys


def _cache_root():
    return os.environ.get('TF1_SYNCBN_CACHE') or os.path.join(
        os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache'),
        'tf1_syncbn')


def _path(key):
    return os.path.join(_cache_root(), key, 'sync_bn_ops.so')


def cached_builds():
    """``[(path, arch flags)]`` of the builds cached for this CPU, best first.

    Asks no compiler anything (nor needs one).
    """
    candidates, _ = arch.arch_candidates()
    return [(path, flags) for flags, path in zip(candidates, map(_path, _cache_keys(candidates)))
            if os.path.exists(path)]


def _target(force=False):
    """``(path, arch flags, description or None)`` of the library to load or build.

    A library already cached for one of the arch flag sets this CPU may use is
    taken as it is, best first, without asking the compiler anything (nor
    needing one); only when none is cached (or ``force``) is the compiler probed.
    """
    cached = [] if force else cached_builds()
    if cached:
        return cached[0] + (None,)
    flags, description = arch.arch_flags()
    return _path(_cache_keys([flags])[0]), flags, description


def cache_path():
    """Where the compiled library for this TensorFlow build is (or will be) cached."""
    return _target()[0]


def _say(message):
    print('tf1_syncbn: %s' % message, file=sys.stderr, flush=True)


def _compile(path, arch_flags, description):
    compiler = arch.default_compiler()
    if shutil.which(compiler) is None:
        raise RuntimeError('no C++ compiler: %r (g++, or $CXX) was not found' % compiler)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=os.path.dirname(path))
    os.close(fd)
    _say('compiling the CPU kernels (once per TensorFlow build, about 20 s; %s) into %s'
         % (description, path))
    start = time.time()
    try:
        try:
            proc = subprocess.run(_compile_command(tmp, arch_flags), capture_output=True,
                                  text=True, timeout=_COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError('compiling %s with %s did not finish in %d s'
                               % (_SOURCE, compiler, _COMPILE_TIMEOUT_S)) from None
        if proc.returncode != 0:
            raise RuntimeError('compiling %s with %s (%s) failed:\n%s'
                               % (_SOURCE, compiler, description, proc.stderr[-2000:]))
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
    path, arch_flags, description = _target(force)
    if force or not os.path.exists(path):
        _compile(path, arch_flags, description)
    return path

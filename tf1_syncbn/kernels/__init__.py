"""Optional CPU kernels for the synchronized training step, compiled on first use.

TensorFlow's stock CPU kernels need five passes over the tensor and a few
dozen small ops per layer for a synchronized batch-norm step, where
unsynchronized fused batch norm needs two passes and two ops (see
docs/benchmarks.md). ``sync_bn_ops.cc`` does the step in four
kernels, one pass each, around the two all-reduces.

They are compiled against the installed TensorFlow the first time a
synchronized layer is built on a CPU tower (about 20 s with ``g++``; one line
on stderr says so when it starts, with the arch flags, and when it is done),
and cached in ``$TF1_SYNCBN_CACHE`` (default ``~/.cache/tf1_syncbn``). The
cache key is the source, the compiler flags (the arch flags actually used
included) and the TensorFlow build (version, commit, ABI flags): not the
checkout's or the virtual environment's path, so every checkout and
environment with the same TensorFlow shares one build.

On a CPU with every feature of x86-64-v3 (AVX2, FMA, BMI1/2, F16C, LZCNT,
MOVBE, XSAVE and v2's), they target that level: ``-march=x86-64-v3`` where the
compiler accepts it (g++ 11+, clang 12+), else the same features as explicit
``-m`` flags, else no arch flag (portable, slower). Which one is decided by
compiling a tiny file (under 0.1 s per flag set, once per process and
compiler), only when no build for this CPU is cached: loading a cached
library runs no compiler, and ``import tf1_syncbn`` none at all.

Build them ahead of time (for images and CI) with::

    python -m tf1_syncbn.kernels

Without a working C++ compiler (``g++``, or ``$CXX``), or with
``TF1_SYNCBN_KERNELS=0``, the layers use TensorFlow's stock kernels instead:
same results, slower; a failed build says why in one warning. GPU towers
always use the stock (cuDNN) kernels.

``import tf1_syncbn`` loads a cached build (:func:`register_cached`; no
compiler is run or asked), so that graphs saved with these ops (a meta graph
for ``import_meta_graph``, a ``GraphDef``) load in a new process.

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

__all__ = ['load', 'library', 'build', 'enabled', 'use_custom_kernels', 'status', 'cache_path',
           'register_cached']

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'sync_bn_ops.cc')
_LOCK = threading.Lock()
_STATE = {'module': None, 'tried': False, 'error': None}
_ALLOWED = os.environ.get('TF1_SYNCBN_KERNELS', '1') != '0'   # build and load the library
_ENABLED = [_ALLOWED]                                           # the layers use its kernels
_OPT_FLAGS = ['-O3', '-shared', '-fPIC']
_OP_TYPES = ('SyncBnMoments', 'SyncBnNormalize', 'SyncBnGradSums', 'SyncBnGradInput')
#: What every op type of the compiled library starts with (the four kernels
#: above and the step watchdog, ``SyncBnStepWatchdog``).
OP_TYPE_PREFIX = 'SyncBn'


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


#: The cpuinfo flags (Linux's names) of every feature that x86-64-v3 requires,
#: v2's included ('pni' is SSE3, 'abm' LZCNT); x86-64 (v1) itself is implied.
_X86_64_V2_CPU_FLAGS = ('cx16', 'lahf_lm', 'pni', 'popcnt', 'sse4_1', 'sse4_2', 'ssse3')
_X86_64_V3_CPU_FLAGS = _X86_64_V2_CPU_FLAGS + (
    'abm', 'avx', 'avx2', 'bmi1', 'bmi2', 'f16c', 'fma', 'movbe', 'xsave')
#: How the kernels target x86-64-v3: the level itself (g++ >= 11, clang >= 12),
#: else the same features one by one, else nothing (a portable build).
_V3_MARCH = ('-march=x86-64-v3',)
_V3_EXPLICIT = ('-mcx16', '-msahf', '-mpopcnt', '-msse3', '-mssse3', '-msse4.1', '-msse4.2',
                '-mavx', '-mavx2', '-mbmi', '-mbmi2', '-mf16c', '-mfma', '-mlzcnt', '-mmovbe',
                '-mxsave')
#: Compiled by the probe: it fails unless the flags really enable the level's
#: instruction sets (a compiler that ignored them would pass a bare file).
_PROBE_SOURCE = """\
#if !defined(__AVX__) || !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__) || \\
    !defined(__BMI__) || !defined(__BMI2__) || !defined(__LZCNT__) || !defined(__POPCNT__) || \\
    !defined(__SSE3__) || !defined(__SSSE3__) || !defined(__SSE4_1__) || !defined(__SSE4_2__)
#error "the flags do not enable x86-64-v3"
#endif
int tf1_syncbn_probe(int x) { return x + 1; }
"""
_PROBE_TIMEOUT_S = 60
_COMPILE_TIMEOUT_S = 900
_PROBES = {}       # (compiler, flags) -> (accepted, the compiler's first error line)
_CPU_FLAGS = []    # this machine's cpuinfo flags, read once


def _cpu_flags(path='/proc/cpuinfo'):
    """The CPU feature flags listed in ``path`` (a cpuinfo file); empty if unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith('flags'):
                    return frozenset(line.partition(':')[2].split())
    except OSError:
        pass
    return frozenset()


def _machine_cpu_flags():
    if not _CPU_FLAGS:
        _CPU_FLAGS.append(_cpu_flags())
    return _CPU_FLAGS[0]


def _arch_candidates(cpu_flags=None, machine=None):
    """The arch flag sets a build for this CPU may use, best first, and why.

    Returns:
      ``(candidates, reason)``: a list of flag tuples, and when it holds only the
      portable ``()``, why (not x86-64, or the CPU features it lacks).
    """
    machine = platform.machine() if machine is None else machine
    if machine not in ('x86_64', 'AMD64'):
        return [()], 'not an x86-64 machine (%s)' % machine
    cpu_flags = _machine_cpu_flags() if cpu_flags is None else frozenset(cpu_flags)
    missing = [flag for flag in _X86_64_V3_CPU_FLAGS if flag not in cpu_flags]
    if missing:
        return [()], 'the CPU lacks x86-64-v3 (no %s)' % ', '.join(missing)
    return [_V3_MARCH, _V3_EXPLICIT, ()], None


def _compiler():
    return os.environ.get('CXX') or 'g++'


def _probe(compiler, flags):
    """Whether ``compiler`` compiles a tiny file with ``flags``: ``(ok, first error line)``.

    Run at most once per compiler and flag set in a process (under 0.1 s), and
    only when the library is not cached yet.
    """
    key = (compiler, tuple(flags))
    if key not in _PROBES:
        if shutil.which(compiler) is None:
            _PROBES[key] = (False, '%r was not found' % compiler)
        else:
            with tempfile.TemporaryDirectory(prefix='tf1_syncbn_probe_') as tmp:
                source = os.path.join(tmp, 'probe.cc')
                with open(source, 'w') as f:
                    f.write(_PROBE_SOURCE)
                command = [compiler] + list(flags) + ['-c', source,
                                                      '-o', os.path.join(tmp, 'probe.o')]
                try:
                    proc = subprocess.run(command, capture_output=True, text=True,
                                          timeout=_PROBE_TIMEOUT_S)
                    errors = [l.strip() for l in proc.stderr.splitlines() if 'error' in l]
                    _PROBES[key] = (proc.returncode == 0,
                                    errors[0] if errors else 'exit status %d' % proc.returncode)
                except subprocess.TimeoutExpired:
                    _PROBES[key] = (False, 'no answer in %d s' % _PROBE_TIMEOUT_S)
                except OSError as e:
                    _PROBES[key] = (False, str(e))
    return _PROBES[key]


def _arch_flags(cpu_flags=None, machine=None, compiler=None):
    """The arch flags to compile with, and a few words on the choice.

    x86-64-v3 when the CPU has every feature of the level: ``-march=x86-64-v3``
    if the compiler accepts it, else the level's features as explicit ``-m``
    flags (g++ 10 and older, clang 11 and older), else no arch flag at all.

    Args:
      cpu_flags: the CPU's cpuinfo flags; None reads ``/proc/cpuinfo``.
      machine: ``platform.machine()``, or another for tests.
      compiler: the compiler to ask; None is ``$CXX`` or ``g++``.

    Returns:
      ``(flags, description)``: a tuple of flags, and words for the compile message.
    """
    candidates, reason = _arch_candidates(cpu_flags, machine)
    if reason:
        return (), 'portable: %s' % reason
    compiler = _compiler() if compiler is None else compiler
    if shutil.which(compiler) is None:
        return (), 'portable: no compiler %r' % compiler
    accepted, why = _probe(compiler, _V3_MARCH)
    if accepted:
        return _V3_MARCH, ' '.join(_V3_MARCH)
    if _probe(compiler, _V3_EXPLICIT)[0]:
        return _V3_EXPLICIT, 'x86-64-v3 as explicit -m flags: %s rejects -march=x86-64-v3 (%s)' % (
            compiler, why)
    return (), 'portable: %s accepts neither -march=x86-64-v3 (%s) nor its -m flags' % (
        compiler, why)


def _tf_flags():
    """``(compile flags, link flags)`` of the installed TensorFlow."""
    return tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


def _compile_command(output, arch_flags):
    compile_flags, link_flags = _tf_flags()
    return ([_compiler()] + _OPT_FLAGS + [_SOURCE, '-o', output] + list(arch_flags) +
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


def _target(force=False):
    """``(path, arch flags, description or None)`` of the library to load or build.

    A library already cached for one of the arch flag sets this CPU may use is
    taken as it is, best first, without asking the compiler anything (nor
    needing one); only when none is cached (or ``force``) is the compiler probed.
    """
    root = _cache_root()
    candidates, _ = _arch_candidates()
    if not force:
        for arch_flags, key in zip(candidates, _cache_keys(candidates)):
            path = os.path.join(root, key, 'sync_bn_ops.so')
            if os.path.exists(path):
                return path, arch_flags, None
    arch_flags, description = _arch_flags()
    return os.path.join(root, _cache_keys([arch_flags])[0], 'sync_bn_ops.so'), arch_flags, \
        description


def cache_path():
    """Where the compiled library for this TensorFlow build is (or will be) cached."""
    return _target()[0]


def _say(message):
    print('tf1_syncbn: %s' % message, file=sys.stderr, flush=True)


def _compile(path, arch_flags, description):
    compiler = _compiler()
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
                _load(build())
            except Exception as e:  # noqa: BLE001 - any failure means: use stock kernels
                _STATE['error'] = e
                warnings.warn("tf1_syncbn: custom CPU kernels unavailable (%s); using "
                              "TensorFlow's stock kernels (same results, slower) and "
                              "TensorFlow's per-op collective timeouts (two threads per "
                              "collective while it runs)." % e, RuntimeWarning, stacklevel=2)
        return _STATE['module']


def _load(path):
    """Loads the library at ``path`` (registering its ops) as this process's module."""
    module = tf.load_op_library(path)
    for op_type in _OP_TYPES:
        # Statistics and gradient kernels: the engine differentiates the
        # step as a whole (tf.custom_gradient); no path goes through them.
        tf.no_gradient(op_type)
    _STATE['module'] = module
    return module


def register_cached():
    """Registers the library's ops when a build for this TensorFlow is cached; compiles nothing.

    ``import tf1_syncbn`` calls it, so that a graph built with the compiled
    kernels or the step watchdog (a meta graph, a ``GraphDef``) loads in a
    new process without building a layer first. It neither runs nor probes a
    compiler: with no cached build (``python -m tf1_syncbn.kernels`` makes
    one), or with ``TF1_SYNCBN_KERNELS=0``, it does nothing, and a failed
    load is left for :func:`library` to report.

    Returns:
      Whether the library is loaded now.
    """
    if not _ALLOWED:
        return False
    with _LOCK:
        if _STATE['tried']:
            return _STATE['module'] is not None
        candidates, _ = _arch_candidates()
        for key in _cache_keys(candidates):
            path = os.path.join(_cache_root(), key, 'sync_bn_ops.so')
            if os.path.exists(path):
                try:
                    _load(path)
                except Exception:  # noqa: BLE001 - library() retries, and warns
                    return False
                _STATE['tried'] = True
                return True
    return False


def status():
    """A one-line description of the kernels in use, for diagnostics."""
    module = load()
    if module is not None:
        return 'custom CPU kernels (%s)' % cache_path()
    if not enabled():
        return 'stock kernels (custom kernels disabled)'
    return 'stock kernels (%s)' % (_STATE['error'],)

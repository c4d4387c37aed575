"""Which arch flags the CPU kernels are compiled with, for this CPU and compiler.

On a CPU with every feature of x86-64-v3 (AVX2, FMA, BMI1/2, F16C, LZCNT,
MOVBE, XSAVE and v2's), the kernels target that level: ``-march=x86-64-v3``
where the compiler accepts it (g++ 11+, clang 12+), else the same features as
explicit ``-m`` flags, else no arch flag (portable, slower). Which one is
decided by compiling a tiny file (:func:`probe`: under 0.1 s per flag set,
once per process and compiler), only when no build for this CPU is cached
(:mod:`tf1_syncbn.kernels.cache`).
"""

import os
import platform
import shutil
import subprocess
import tempfile

__all__ = ['default_compiler', 'cpu_flags', 'arch_candidates', 'probe', 'arch_flags', 'V3_MARCH',
           'V3_EXPLICIT', 'X86_64_V3_CPU_FLAGS']

#: The cpuinfo flags (Linux's names) of every feature that x86-64-v3 requires,
#: v2's included ('pni' is SSE3, 'abm' LZCNT); x86-64 (v1) itself is implied.
X86_64_V2_CPU_FLAGS = ('cx16', 'lahf_lm', 'pni', 'popcnt', 'sse4_1', 'sse4_2', 'ssse3')
X86_64_V3_CPU_FLAGS = X86_64_V2_CPU_FLAGS + (
    'abm', 'avx', 'avx2', 'bmi1', 'bmi2', 'f16c', 'fma', 'movbe', 'xsave')
#: How the kernels target x86-64-v3: the level itself (g++ >= 11, clang >= 12),
#: else the same features one by one, else nothing (a portable build).
V3_MARCH = ('-march=x86-64-v3',)
V3_EXPLICIT = ('-mcx16', '-msahf', '-mpopcnt', '-msse3', '-mssse3', '-msse4.1', '-msse4.2',
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
_PROBES = {}       # (compiler, flags) -> (accepted, the compiler's first error line)
_CPU_FLAGS = []    # this machine's cpuinfo flags, read once


def default_compiler():
    """The C++ compiler: ``$CXX``, else ``g++``."""
    return os.environ.get('CXX') or 'g++'


def cpu_flags(path='/proc/cpuinfo'):
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
        _CPU_FLAGS.append(cpu_flags())
    return _CPU_FLAGS[0]


def arch_candidates(cpu_flags=None, machine=None):
    """The arch flag sets a build for this CPU may use, best first, and why.

    Returns:
      ``(candidates, reason)``: a list of flag tuples, and when it holds only the
      portable ``()``, why (not x86-64, or the CPU features it lacks).
    """
    machine = platform.machine() if machine is None else machine
    if machine not in ('x86_64', 'AMD64'):
        return [()], 'not an x86-64 machine (%s)' % machine
    cpu_flags = _machine_cpu_flags() if cpu_flags is None else frozenset(cpu_flags)
    missing = [flag for flag in X86_64_V3_CPU_FLAGS if flag not in cpu_flags]
    if missing:
        return [()], 'the CPU lacks x86-64-v3 (no %s)' % ', '.join(missing)
    return [V3_MARCH, V3_EXPLICIT, ()], None


def probe(compiler, flags):
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


def arch_flags(cpu_flags=None, machine=None, compiler=None):
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
    candidates, reason = arch_candidates(cpu_flags, machine)
    if reason:
        return (), 'portable: %s' % reason
    compiler = default_compiler() if compiler is None else compiler
    if shutil.which(compiler) is None:
        return (), 'portable: no compiler %r' % compiler
    accepted, why = probe(compiler, V3_MARCH)
    if accepted:
        return V3_MARCH, ' '.join(V3_MARCH)
    if probe(compiler, V3_EXPLICIT)[0]:
        return V3_EXPLICIT, 'x86-64-v3 as explicit -m flags: %s rejects -march=x86-64-v3 (%s)' % (
            compiler, why)
    return (), 'portable: %s accepts neither -march=x86-64-v3 (%s) nor its -m flags' % (
        compiler, why)

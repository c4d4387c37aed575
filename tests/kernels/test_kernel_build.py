"""Building the compiled CPU kernels: which arch flags for which CPU and compiler,
the cache key, when the compiler is (not) asked, and what a failed build says.

The compilers here are small scripts given as ``CXX``: one that rejects
``-march=x86-64-v3`` the way g++ 10 does and otherwise runs the real ``g++``,
one that rejects every ``-m`` flag. Each logs its command lines, so the tests
see every time the library runs a compiler and with which flags.
"""

import os
import platform
import shutil
import subprocess
import sys

import pytest

from test_kernels import _subprocess_env
from tf1_syncbn import kernels
from tf1_syncbn.kernels import arch, cache

#: Compiler flags, the cache and the build's messages, whatever the TF behaviour (the
#: kernels' numerics run in both passes: test_kernels.py): the TF2-behaviour pass only.
pytestmark = pytest.mark.once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GXX = shutil.which('g++')
#: Every cpuinfo flag x86-64-v3 needs (v2's included), written out here rather
#: than taken from the library, so that dropping one there fails a test.
V3_CPU_FLAGS = ('avx', 'avx2', 'bmi1', 'bmi2', 'f16c', 'fma', 'abm', 'movbe', 'xsave',
                'cx16', 'lahf_lm', 'popcnt', 'pni', 'sse4_1', 'sse4_2', 'ssse3')
V3_CPU = frozenset(V3_CPU_FLAGS + ('fpu', 'sse', 'sse2', 'avx512f'))
EXPLICIT = ('-mavx', '-mavx2', '-mfma', '-mbmi', '-mbmi2', '-mf16c', '-mlzcnt', '-mmovbe',
            '-mxsave', '-mcx16', '-msahf', '-mpopcnt', '-msse3', '-mssse3', '-msse4.1',
            '-msse4.2')
GXX10_ERROR = "cc1plus: error: bad value ('x86-64-v3') for '-march=' switch"
SUBPROCESS_TIMEOUT_S = 240
COMPILE_TIMEOUT_S = 840   # a real compile: about 20 s alone, minutes on a loaded machine

needs_gxx = pytest.mark.skipif(GXX is None, reason='no g++ on PATH')
on_x86_64 = pytest.mark.skipif(platform.machine() not in ('x86_64', 'AMD64'),
                               reason='x86-64 arch flags')


def fake_compiler(tmp_path, rejects):
    """A ``CXX`` script that logs each command line to ``<script>.log``.

    Args:
      rejects: 'march-v3' fails on ``-march=x86-64-v3`` with g++ 10's message,
        'any-m' on every ``-m`` flag; either runs ``g++`` on everything else.
    """
    script = tmp_path / ('cxx-' + rejects)
    test = {'march-v3': '-march=x86-64-v3', 'any-m': '-m*'}[rejects]
    message = {'march-v3': GXX10_ERROR,
               'any-m': "g++: error: unrecognized command-line option '$arg'"}[rejects]
    script.write_text('#!/bin/sh\n'
                      'echo "$*" >> "$0.log"\n'
                      'for arg in "$@"; do\n'
                      '  case "$arg" in %s) echo "%s" >&2; exit 1;; esac\n'
                      'done\n'
                      'exec %s "$@"\n' % (test, message, GXX))
    script.chmod(0o755)
    return str(script)


def calls(compiler):
    """The command lines the fake compiler was run with so far."""
    log = compiler + '.log'
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return f.read().splitlines()


@pytest.fixture
def fresh_probes(monkeypatch):
    """No compiler answers remembered from earlier tests."""
    monkeypatch.setattr(arch, '_PROBES', {})


def test_cpuinfo_flags_are_read_from_the_file(tmp_path):
    cpuinfo = tmp_path / 'cpuinfo'
    cpuinfo.write_text('processor\t: 0\nvendor_id\t: AuthenticAMD\n'
                       'flags\t\t: fpu sse2 avx2 bmi2\nbugs\t\t: sysret_ss_attrs\n\n'
                       'processor\t: 1\nflags\t\t: fpu sse2 avx2 bmi2\n')
    assert arch.cpu_flags(str(cpuinfo)) == {'fpu', 'sse2', 'avx2', 'bmi2'}
    assert arch.cpu_flags(str(tmp_path / 'missing')) == frozenset()


@pytest.mark.parametrize('absent', V3_CPU_FLAGS)
def test_a_cpu_missing_any_v3_feature_gets_a_portable_build(absent):
    """The old check looked at avx2, fma and bmi2 only: a CPU without, say, movbe
    got -march=x86-64-v3 code that can fault on it."""
    flags, why = arch.arch_flags(cpu_flags=V3_CPU - {absent}, machine='x86_64',
                                     compiler='/no/compiler/asked')
    assert flags == ()
    assert 'lacks x86-64-v3' in why and absent in why.split('(no ')[1], why


def test_the_three_flags_the_old_check_used_are_not_enough():
    cpu = {'fpu', 'sse', 'sse2', 'avx2', 'fma', 'bmi2'}
    assert arch.arch_candidates(cpu, 'x86_64') == (
        [()], 'the CPU lacks x86-64-v3 (no %s)' % ', '.join(
            f for f in arch.X86_64_V3_CPU_FLAGS if f not in cpu))


def test_other_machines_get_no_arch_flag():
    flags, why = arch.arch_flags(cpu_flags=V3_CPU, machine='aarch64', compiler=GXX)
    assert flags == () and 'aarch64' in why


@needs_gxx
def test_a_compiler_that_accepts_the_level_gets_it(tmp_path, fresh_probes):
    if not arch.probe(GXX, ('-march=x86-64-v3',))[0]:
        pytest.skip('this g++ rejects -march=x86-64-v3 (older than 11)')
    flags, why = arch.arch_flags(cpu_flags=V3_CPU, machine='x86_64', compiler=GXX)
    assert flags == ('-march=x86-64-v3',) and why == '-march=x86-64-v3'


@needs_gxx
def test_a_gxx10_like_compiler_gets_the_explicit_flags_and_is_asked_once(tmp_path,
                                                                         fresh_probes):
    cxx = fake_compiler(tmp_path, 'march-v3')
    flags, why = arch.arch_flags(cpu_flags=V3_CPU, machine='x86_64', compiler=cxx)
    assert sorted(flags) == sorted(EXPLICIT)
    assert 'rejects -march=x86-64-v3' in why and GXX10_ERROR in why, why
    probes = calls(cxx)
    assert len(probes) == 2 and '-march=x86-64-v3' in probes[0].split(), probes
    assert set(EXPLICIT) <= set(probes[1].split()) and '-march' not in probes[1], probes
    # Asked once per process and compiler, however often the flags are wanted.
    assert arch.arch_flags(cpu_flags=V3_CPU, machine='x86_64', compiler=cxx)[0] == flags
    assert len(calls(cxx)) == 2


@needs_gxx
def test_the_explicit_flags_really_enable_the_level(tmp_path, fresh_probes):
    """The probe compiles code that needs the level, not just any file: with a
    subset of the flags (here without -mavx2) it must say no."""
    assert arch.probe(GXX, tuple(EXPLICIT))[0]
    assert not arch.probe(GXX, tuple(f for f in EXPLICIT if f != '-mavx2'))[0]


@needs_gxx
def test_a_compiler_rejecting_every_arch_flag_gets_a_portable_build(tmp_path, fresh_probes):
    cxx = fake_compiler(tmp_path, 'any-m')
    flags, why = arch.arch_flags(cpu_flags=V3_CPU, machine='x86_64', compiler=cxx)
    assert flags == ()
    assert why.startswith('portable: ') and 'accepts neither' in why, why
    assert len(calls(cxx)) == 2


@needs_gxx
@on_x86_64
def test_the_cache_key_holds_the_flags_used_and_a_cached_build_needs_no_compiler(
        tmp_path, monkeypatch, fresh_probes):
    monkeypatch.setattr(arch, '_CPU_FLAGS', [V3_CPU])
    monkeypatch.setenv('TF1_SYNCBN_CACHE', str(tmp_path / 'cache'))
    cxx = fake_compiler(tmp_path, 'march-v3')
    monkeypatch.setenv('CXX', cxx)
    march, explicit, portable = cache._cache_keys(
        [('-march=x86-64-v3',), arch.V3_EXPLICIT, ()])
    assert len({march, explicit, portable}) == 3
    path = lambda key: str(tmp_path / 'cache' / key / 'sync_bn_ops.so')
    # Nothing cached: the compiler is asked, and the path is the explicit flags' build.
    assert kernels.cache_path() == path(explicit)
    assert len(calls(cxx)) == 2
    # Cached: found again in a fresh process (no remembered answers) without a probe ...
    monkeypatch.setattr(arch, '_PROBES', {})
    os.makedirs(os.path.dirname(path(explicit)))
    open(path(explicit), 'w').close()
    assert kernels.cache_path() == path(explicit)
    assert kernels.build() == path(explicit)
    # ... and a build with -march=x86-64-v3 is taken first where there is one.
    os.makedirs(os.path.dirname(path(march)))
    open(path(march), 'w').close()
    assert kernels.cache_path() == path(march)
    # No compiler at all: a cached build is still found.
    monkeypatch.setenv('CXX', str(tmp_path / 'no' / 'g++'))
    assert kernels.cache_path() == path(march)
    assert len(calls(cxx)) == 2


LAYER = '''
import os, sys, warnings
warnings.simplefilter('always')
import numpy as np
import tensorflow as tf
import tf1_syncbn
from tf1_syncbn import CollectiveBackend, kernels, sync_batch_norm
log = sys.argv[1]   # the fake compiler's log of its command lines
print('compiler calls after import:',
      len(open(log).read().splitlines()) if os.path.exists(log) else 0)
from bn_reference import build_towers
from conftest import make_session
graph = tf.Graph()
with graph.as_default():
    net = build_towers(lambda x: sync_batch_norm(x, sync_statistics=CollectiveBackend(60)),
                       2, (None, 3))
    x = np.arange(12, dtype=np.float32).reshape(4, 3) ** 2
    with make_session(graph, 2) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        ys = np.concatenate(sess.run(net['ys'], {net['xs'][0]: x[:1], net['xs'][1]: x[1:]}))
np.testing.assert_allclose(ys, (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-3), rtol=1e-4, atol=1e-4)
print(kernels.status())
'''


@needs_gxx
@on_x86_64
@pytest.mark.timeout(COMPILE_TIMEOUT_S + SUBPROCESS_TIMEOUT_S + 60)
def test_a_gxx10_like_compiler_builds_a_loadable_library_with_the_explicit_flags(tmp_path):
    why = arch.arch_candidates()[1]
    if why:
        pytest.skip('this machine gets a portable build: %s' % why)
    cxx = fake_compiler(tmp_path, 'march-v3')
    cache = tmp_path / 'cache'
    env = _subprocess_env(CXX=cxx, TF1_SYNCBN_CACHE=str(cache))
    run = subprocess.run([sys.executable, '-m', 'tf1_syncbn.kernels'], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    said = [l for l in run.stderr.splitlines() if l.startswith('tf1_syncbn: compiling')]
    assert len(said) == 1 and 'explicit -m flags' in said[0] and GXX10_ERROR in said[0], said
    build = [c for c in calls(cxx) if 'sync_bn_ops.cc' in c]
    assert len(build) == 1 and set(EXPLICIT) <= set(build[0].split()), build
    assert '-march=x86-64-v3' not in build[0]
    before = len(calls(cxx))
    # A new process loads the cached build: no compiler runs, at import or after.
    use = subprocess.run([sys.executable, '-c', LAYER, cxx + '.log'], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert use.returncode == 0, use.stderr
    lines = use.stdout.splitlines()
    assert lines[0] == 'compiler calls after import: %d' % before
    assert lines[-1] == 'custom CPU kernels (%s)' % run.stdout.split('ready: ')[1].strip()
    assert lines[-1].startswith('custom CPU kernels (%s' % cache)
    assert len(calls(cxx)) == before


@needs_gxx
def test_a_failed_compile_says_why_in_one_warning(tmp_path):
    """The compiler accepts the probe but fails on the library: stock kernels, one
    warning with the compiler's message and the arch flags it was given."""
    cxx = tmp_path / 'cxx-broken'
    cxx.write_text('#!/bin/sh\necho "$*" >> "$0.log"\n'
                   'case "$*" in *sync_bn_ops.cc*) '
                   'echo "sync_bn_ops.cc:1:1: error: simulated compiler failure" >&2; exit 1;; '
                   'esac\nexec %s "$@"\n' % GXX)
    cxx.chmod(0o755)
    env = _subprocess_env(CXX=str(cxx), TF1_SYNCBN_CACHE=str(tmp_path / 'cache'))
    run = subprocess.run([sys.executable, '-c', LAYER, str(cxx) + '.log'], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith('compiler calls after import: 0\n'), run.stdout
    assert '\nstock kernels (compiling ' in run.stdout, run.stdout
    warnings = [l for l in run.stderr.splitlines() if 'custom CPU kernels unavailable' in l]
    assert len(warnings) == 1, run.stderr
    why = arch.arch_flags(compiler=str(cxx))[1]   # what the build was told: its flags
    assert why in warnings[0], (why, warnings[0])
    assert run.stderr.count('simulated compiler failure') == 1, run.stderr

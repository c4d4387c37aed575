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

The modules: :mod:`~tf1_syncbn.kernels.arch` (which arch flags, for this CPU
and compiler), :mod:`~tf1_syncbn.kernels.cache` (compiling, and the cache of
builds), :mod:`~tf1_syncbn.kernels.loader` (the library in this process: whether
the layers use it, loading it, its status); ``python -m tf1_syncbn.kernels``:
``__main__.py``.

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

from tf1_syncbn.kernels.cache import build, cache_path
from tf1_syncbn.kernels.loader import (OP_TYPE_PREFIX, enabled, library, load, register_cached,
                                       status, use_custom_kernels)

__all__ = ['load', 'library', 'build', 'enabled', 'use_custom_kernels', 'status', 'cache_path',
           'register_cached', 'OP_TYPE_PREFIX']

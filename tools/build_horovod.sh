#!/usr/bin/env bash
# Builds Horovod 0.28.1 with TensorFlow and Gloo (no MPI, PyTorch or MXNet) from
# PyPI's source distribution into the environment of PYTHON (`make horovod`
# passes the project's .venv). docs/horovod.md says why, and what was run.
#
#   tools/build_horovod.sh PYTHON
#
# Horovod's TensorFlow ops are compiled against the TensorFlow headers and
# library that PYTHON imports, so the build happens in that environment,
# after TensorFlow (pip install --no-build-isolation). Two patches, each
# checked to apply:
#
# 1. xla-ops (only when the installed TensorFlow lacks the headers it needs):
#    horovod/tensorflow/xla_mpi_ops.cc includes TF-XLA headers that the
#    tensorflow-cpu 2.21 wheel does not ship
#    (tensorflow/compiler/xla/client/xla_builder.h); it is left out of
#    horovod/tensorflow/CMakeLists.txt. Its whole body is inside `#if
#    HAVE_GPU` (Horovod's XLA ops for GPUs): a CPU build loses nothing. A
#    CUDA build would lose HOROVOD_ENABLE_XLA_OPS, and the script refuses it.
# 2. gloo-stall: horovod/common/gloo/gloo_controller.cc `reserve`s the vector
#    of global ranks instead of sizing it, so with Gloo the stall inspector
#    sees no rank at all: it never names a missing rank, and
#    HOROVOD_STALL_SHUTDOWN_TIME_SECONDS never ends a stalled job (a process
#    that skips an all-reduce hangs the others forever). `resize` fixes it.
#
# The sdist is built in a temporary directory, removed on exit. The patches
# applied are recorded in the installed package (horovod/TF1_SYNCBN_BUILD),
# so that a Horovod built otherwise is rebuilt. Any failure says why and
# exits non-zero: nothing is skipped.
set -euo pipefail

VERSION=0.28.1
SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
PY=${1:?usage: tools/build_horovod.sh PYTHON}
# Absolute, without resolving the venv's symlink (which would leave the venv).
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
BIN=$(dirname "$PY")

fail() {
    echo "tools/build_horovod.sh: cannot build Horovod $VERSION: $*" >&2
    exit 1
}

TF_INFO=$("$PY" -c 'import tensorflow as tf; print(tf.__version__, tf.sysconfig.get_include())' \
          2>/dev/null) || fail "TensorFlow does not import in $PY (make install first)."
read -r TF_VERSION TF_INCLUDE <<<"$TF_INFO"

# What this script installs: the record it leaves in the package.
record() {
    echo "horovod $VERSION tensorflow $TF_VERSION patches: $1"
}

# Already built here, by this script, against this TensorFlow? (The TF ops
# library loads only against the TensorFlow it was compiled with.)
installed=$("$PY" - <<'PYEOF' 2>/dev/null || true
import os, horovod, horovod.tensorflow as hvd
assert hvd.gloo_built()
print(open(os.path.join(os.path.dirname(horovod.__file__), 'TF1_SYNCBN_BUILD')).read().strip())
PYEOF
)
case "$installed" in
    "horovod $VERSION tensorflow $TF_VERSION patches:"*gloo-stall*) current=1 ;;
    *) current=0 ;;
esac
if [ "$current" = 1 ]; then
    echo "Already installed: $installed"
    exit 0
fi

# A wheel this script built before, for this TensorFlow and Python, is reused
# from the cache (the kernels' cache, $TF1_SYNCBN_CACHE or ~/.cache/tf1_syncbn):
# a fresh clone or a new .venv then installs in seconds instead of building
# for minutes. The key holds this script's hash, so a changed build or patch
# builds again; TF1_SYNCBN_HOROVOD_REBUILD=1 always builds.
PY_TAG=$("$PY" -c 'import sys; print("py%d%d" % sys.version_info[:2])')
SCRIPT_HASH=$(sha256sum "$0" | cut -c1-12)
CACHE_ROOT=${TF1_SYNCBN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tf1_syncbn}
WHEEL_CACHE="$CACHE_ROOT/horovod/$VERSION-tf$TF_VERSION-$PY_TAG-$SCRIPT_HASH"

finish() {  # installs the wheel $1 with its dependencies, checks it, records $2
    "$PY" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$1" &&
        "$PY" -m pip install -q --disable-pip-version-check "$1" ||
        fail "pip could not install $1."
    "$PY" - "$(record "$2")" <<'PYEOF' || fail "the installed Horovod does not load, or lacks Gloo (see above)."
import os, sys
import horovod, horovod.tensorflow as hvd
print('horovod %s: TensorFlow ops load; gloo_built=%s mpi_built=%s'
      % (horovod.__version__, hvd.gloo_built(), hvd.mpi_built()))
assert hvd.gloo_built(), 'Gloo was not built'
with open(os.path.join(os.path.dirname(horovod.__file__), 'TF1_SYNCBN_BUILD'), 'w') as f:
    f.write(sys.argv[1] + '\n')
PYEOF
    [ -x "$BIN/horovodrun" ] || fail "$BIN/horovodrun was not installed."
    echo "Installed: $(record "$2")"
}

CACHED=$(ls "$WHEEL_CACHE"/horovod-*.whl 2>/dev/null | head -1 || true)
if [ -n "$CACHED" ] && [ -s "$WHEEL_CACHE/PATCHES" ] && [ "${TF1_SYNCBN_HOROVOD_REBUILD:-0}" != 1 ]; then
    echo "Installing Horovod $VERSION built earlier by this script: $CACHED"
    finish "$CACHED" "$(cat "$WHEEL_CACHE/PATCHES")"
    exit 0
fi

# Tools: a C++17 compiler, make, CMake >= 3.13 and < 4 (CMake 4 refuses
# Gloo's cmake_minimum_required); pip's cmake wheel when the system has none.
CXX=${CXX:-c++}
command -v "$CXX" >/dev/null || fail "no C++ compiler ($CXX): install g++ (Debian: apt-get install g++)."
command -v make >/dev/null || fail "no make: install make."
cmake_ok() {
    "$1" --version 2>/dev/null | head -1 | grep -Eq 'version 3\.(1[3-9]|[2-9][0-9])'
}
if ! cmake_ok cmake && ! cmake_ok "$BIN/cmake"; then
    echo "No CMake >= 3.13, < 4 on PATH: installing it from PyPI into $(dirname "$BIN")"
    "$PY" -m pip install -q --disable-pip-version-check 'cmake>=3.13,<4' ||
        fail "could not install CMake from PyPI (pip install 'cmake>=3.13,<4')."
fi
# --no-build-isolation: the build needs this environment's TensorFlow, and
# these (setup.py imports packaging).
"$PY" -m pip install -q --disable-pip-version-check setuptools wheel packaging ||
    fail "could not install setuptools, wheel, packaging."

WORK=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

echo "Downloading horovod==$VERSION (sdist) from PyPI"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "horovod==$VERSION" -d "$WORK" || fail "pip could not download horovod==$VERSION's sdist."
SDIST="$WORK/horovod-$VERSION.tar.gz"
echo "$SHA256  $SDIST" | sha256sum -c --quiet - ||
    fail "$SDIST does not have the expected SHA-256 $SHA256."
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/horovod-$VERSION"
PATCHES=""

# Patch 1, xla-ops: only when TensorFlow's headers lack what the file includes.
MISSING=""
for header in $(grep -o '#include "tensorflow/compiler/[^"]*"' \
                "$SRC/horovod/tensorflow/xla_mpi_ops.cc" | cut -d'"' -f2); do
    [ -e "$TF_INCLUDE/$header" ] || MISSING="$MISSING $header"
done
if [ -n "$MISSING" ]; then
    if [ -n "${HOROVOD_GPU_OPERATIONS:-}${HOROVOD_GPU_ALLREDUCE:-}${HOROVOD_GPU:-}" ]; then
        fail "TensorFlow $TF_VERSION's headers lack$MISSING, which
horovod/tensorflow/xla_mpi_ops.cc needs on a GPU build (its XLA ops); this script
leaves that file out of CPU builds only."
    fi
    echo "Patch xla-ops: TensorFlow $TF_VERSION's headers lack$MISSING;"
    echo "  leaving horovod/tensorflow/xla_mpi_ops.cc (GPU-only XLA ops) out of the build."
    sed -i '/horovod\/tensorflow\/xla_mpi_ops\.cc/d' "$SRC/horovod/tensorflow/CMakeLists.txt"
    ! grep -q xla_mpi_ops "$SRC/horovod/tensorflow/CMakeLists.txt" ||
        fail "patch xla-ops did not apply to horovod/tensorflow/CMakeLists.txt."
    PATCHES="$PATCHES xla-ops"
fi

# Patch 2, gloo-stall: size the Gloo controller's vector of global ranks.
CONTROLLER="$SRC/horovod/common/gloo/gloo_controller.cc"
grep -q '^  global_ranks_\.reserve(size_);$' "$CONTROLLER" ||
    fail "patch gloo-stall: horovod/common/gloo/gloo_controller.cc no longer has the line it fixes."
echo "Patch gloo-stall: the Gloo controller's global ranks are sized (resize, not reserve),"
echo "  so that the stall inspector names missing ranks and its shutdown time works."
sed -i 's/^  global_ranks_\.reserve(size_);$/  global_ranks_.resize(size_);/' "$CONTROLLER"
grep -q '^  global_ranks_\.resize(size_);$' "$CONTROLLER" ||
    fail "patch gloo-stall did not apply."
PATCHES="$PATCHES gloo-stall"

JOBS=$(nproc 2>/dev/null || echo 2)
echo "Building Horovod $VERSION against TensorFlow $TF_VERSION (Gloo, CPU; make -j$JOBS)"
LOG="$WORK/build.log"
start=$(date +%s)
if ! (cd "$SRC" && PATH="$BIN:$PATH" \
        HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
        HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$JOBS" \
        "$PY" -m pip wheel -v --disable-pip-version-check --no-build-isolation \
        --no-cache-dir --no-deps -w "$WORK/wheel" . >"$LOG" 2>&1); then
    tail -n 80 "$LOG" >&2
    fail "the build failed (the end of its log is above)."
fi
echo "Built in $(( $(date +%s) - start )) s."
WHEEL=$(ls "$WORK"/wheel/horovod-*.whl)
finish "$WHEEL" "${PATCHES# }"
# Cached only once it installs and loads.
mkdir -p "$WHEEL_CACHE" && cp "$WHEEL" "$WHEEL_CACHE/" &&
    echo "${PATCHES# }" >"$WHEEL_CACHE/PATCHES" &&
    echo "Cached the wheel in $WHEEL_CACHE" || echo "(could not cache the wheel in $WHEEL_CACHE)"

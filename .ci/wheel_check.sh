#!/usr/bin/env bash
# `make wheel-check`: the package as users get it. Builds the sdist and the
# wheel (python -m build: the wheel is built from the sdist), checks that both
# carry the kernel sources, installs the wheel with tensorflow-cpu into a fresh
# virtual environment (pip's cache is reused) and runs the self-check there,
# from a directory outside the checkout, so that the installed package is what
# runs. Leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYTHON=${PYTHON:-python3}
start=$(date +%s)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$PY" -m build --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
wheel=$(ls "$tmp"/dist/*.whl)
sdist=$(ls "$tmp"/dist/*.tar.gz)
echo "wheel-check: built $(basename "$sdist") and $(basename "$wheel")"
"$PY" - "$wheel" "$sdist" <<'PY'
import sys, tarfile, zipfile
wheel = zipfile.ZipFile(sys.argv[1]).namelist()
sdist = [n.split('/', 1)[1] for n in tarfile.open(sys.argv[2]).getnames() if '/' in n]
for name in ('tf1_syncbn/kernels/sync_bn_ops.cc', 'tf1_syncbn/__init__.py', 'tower/__init__.py',
             'tf1_syncbn_run.pth', '_tf1_syncbn_run.py'):
    assert name in wheel, 'the wheel lacks ' + name
    assert name in sdist, 'the sdist lacks ' + name
assert not any(n.startswith(('tests/', 'docs/')) for n in wheel), 'the wheel carries tests or docs'
# The suite needs the whole repository (MANIFEST.in prunes it from the sdist).
assert not any(n.startswith('tests/') for n in sdist), 'the sdist carries a partial test suite'
print('wheel-check: both carry the kernel sources (tf1_syncbn/kernels/sync_bn_ops.cc) and the '
      'runner\'s start-up hook (tf1_syncbn_run.pth)')
PY

"$PYTHON" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --no-compile --disable-pip-version-check "$wheel[cpu]"
cd "$tmp"
"$tmp/venv/bin/python" -c 'import tensorflow as tf, tf1_syncbn; print("wheel-check: installed tf1_syncbn %s (%s) with TensorFlow %s" % (tf1_syncbn.__version__, tf1_syncbn.__file__, tf.__version__))'
"$tmp/venv/bin/python" -m tf1_syncbn.selftest --towers 2
# The start-up hook of python -m tf1_syncbn.run's environment-variable form: on with
# TF1_SYNCBN_RUN (TensorFlow not imported yet), nothing at all without it.
TF1_SYNCBN_RUN=1 "$tmp/venv/bin/python" -c 'import sys; assert "tf1_syncbn.run.startup" in sys.modules and "tensorflow" not in sys.modules'
"$tmp/venv/bin/python" -c 'import sys; assert not [m for m in sys.modules if "tf1_syncbn" in m], sys.modules'
echo "wheel-check: the runner's start-up hook is on with TF1_SYNCBN_RUN=1, and imports nothing without it"
echo "wheel-check: passed in $(( $(date +%s) - start )) s"

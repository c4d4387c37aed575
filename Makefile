# Two commands do all set-up on a fresh machine (Python 3.11 with venv, make, g++;
# make demo also runs without a compiler):
#   make demo   creates .venv, installs the project, runs the main job
#   make test   creates .venv, installs the project and test tools, runs the suite
# Re-running reuses .venv: installs happen again only when pyproject.toml,
# setup.py (which installs the runner's start-up hook) or this Makefile change.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
DEMO_ARGS ?=
# Extra pytest arguments, e.g. `make test PYTEST_ARGS='-k kernels -x'`.
PYTEST_ARGS ?=
# Test processes per pass (pytest-xdist; 0: the tests run in pytest's own
# process). Each module's tests stay together in one process (--dist
# loadfile), so a module's reference run and shared graphs are built once.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile)
# Each pass writes its tests' wall and CPU times here (tests/support/suite_times.py);
# `python tools/suite_times.py .suite-times/*.json` shows where the time went.
TIMES := --suite-times=.suite-times/$$TF1_SYNCBN_TEST_BEHAVIOR.json

.PHONY: demo test install kernels clean bench lint docs wheel-check

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

# Install TensorFlow only when no build is importable yet, so an existing
# tensorflow-cpu / tensorflow / vendor build is never shadowed by a second one.
# --no-compile: pip would byte-compile all of TensorFlow and Keras (half of the
# install's CPU time, most of it modules never imported); Python compiles, and
# caches, what is imported on first import instead.
$(VENV)/.installed: $(VENV)/bin/python pyproject.toml setup.py tf1_syncbn_run.pth Makefile
	@if $(PY) -c "import tensorflow" >/dev/null 2>&1; then \
	    echo "TensorFlow already present: $$($(PY) -c 'import tensorflow as tf; print(tf.__version__)')"; \
	    $(PIP) install -q -e .; \
	else \
	    $(PIP) install -q --no-compile -e '.[cpu]'; \
	fi
	touch $@

# The demo's plot and progress bar (matplotlib, tqdm); not in the test
# environment, where matplotlib would slow every `import tensorflow`.
$(VENV)/.installed-demo: $(VENV)/.installed
	$(PIP) install -q -e '.[demo]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q --no-compile -e '.[test]'
	@# tf-keras is pinned to the installed TF minor version and installed
	@# without dependencies: its metadata asks for the full `tensorflow` build.
	$(PIP) install -q --no-compile --no-deps "tf-keras~=$$($(PY) -c 'import tensorflow as tf; print(".".join(tf.__version__.split(".")[:2]))').0"
	touch $@

# The documentation tools (pyproject.toml's docs extra: Sphinx, MyST, furo). After
# the test tools: the API reference imports tf1_syncbn.keras, which needs tf-keras.
$(VENV)/.installed-docs: $(VENV)/.installed-test
	$(PIP) install -q -e '.[docs]'
	touch $@

install: $(VENV)/.installed

# Compiles the CPU kernels into the cache (~/.cache/tf1_syncbn) once, visibly,
# instead of silently inside the first layer built. Without a compiler the
# layers use TensorFlow's stock kernels: the demo still runs, the tests fail.
kernels: $(VENV)/.installed
	$(PY) -m tf1_syncbn.kernels

demo: $(VENV)/.installed-demo
	-$(PY) -m tf1_syncbn.kernels
	$(PY) examples/train_multitower.py --overwrite $(DEMO_ARGS)

# pytest.ini adds -rs (skip reasons) and a 300 s limit per test (pytest-timeout,
# from pyproject.toml's test extra).
# make test runs the linter and the documentation build first: a lint error,
# or a broken reference or docstring in docs/, fails it. Then the suite twice:
# in TF2-behaviour graph mode, and in TF1 behaviour (disable_v2_behavior(),
# tests/support/tf_behavior.py), where each module runs the cases it picks for what TF1
# behaviour changes (docs/tf-behaviours.md). `make test-v2` / `make test-v1`
# run one pass. tests/with_horovod is make test-horovod's, even where Horovod is built.
SUITE := tests --ignore=tests/with_horovod
test: $(VENV)/.installed-test kernels lint docs
	export TF1_SYNCBN_TEST_BEHAVIOR=v2; $(PY) -m pytest -q $(XDIST) $(TIMES) $(SUITE) $(PYTEST_ARGS)
	export TF1_SYNCBN_TEST_BEHAVIOR=v1; $(PY) -m pytest -q $(XDIST) $(TIMES) $(SUITE) $(PYTEST_ARGS)

.PHONY: test-v2 test-v1 test-full
test-v2 test-v1: $(VENV)/.installed-test kernels
	export TF1_SYNCBN_TEST_BEHAVIOR=$(@:test-%=%); $(PY) -m pytest -q $(XDIST) $(TIMES) $(SUITE) $(PYTEST_ARGS)

# Everything make test leaves out to stay in CI's time budget (docs/testing.md,
# "make test-full"): every case of the products that make test runs a covering
# set of (tests/support/suite_scope.py), in both behaviours, then the version subset on
# every supported TensorFlow before 2.21, then Horovod's tests. About 3 times
# make test's time.
test-full: $(VENV)/.installed-test kernels lint docs
	export TF1_SYNCBN_TEST_FULL=1 TF1_SYNCBN_TEST_BEHAVIOR=v2; $(PY) -m pytest -q $(XDIST) $(SUITE) $(PYTEST_ARGS)
	export TF1_SYNCBN_TEST_FULL=1 TF1_SYNCBN_TEST_BEHAVIOR=v1; $(PY) -m pytest -q $(XDIST) $(SUITE) $(PYTEST_ARGS)
	TF1_SYNCBN_TEST_FULL=1 $(MAKE) test-versions TEST_VERSIONS='$(filter-out 2.21,$(TF_VERSIONS))' \
	    VERSION_BEHAVIORS='v2 v1'
	TF1_SYNCBN_TEST_FULL=1 $(MAKE) test-horovod

# Every supported TensorFlow (pyproject.toml: 2.15 to 2.21), each in its own
# environment, from the pins below: `make venv-tf2.15` creates .venv-tf2.15;
# `make test-tf2.15` runs the version subset there (tests marked `versions`, in
# both TF behaviours, then the kernels build and the self-test);
# `make test-versions` runs it on $(TEST_VERSIONS). `.venv` (make test) is the
# newest version, with the whole suite. docs/installation.md#supported-versions.
#   TF_PINS_<v>:  TensorFlow and the Keras it comes with (Keras 2 `keras` on
#                 2.15, Keras 3 from 2.16);
#   KERAS2_<v>:   tf-keras, installed without dependencies (they ask for the full
#                 `tensorflow` distribution).
TF_PINS_2.15 := tensorflow-cpu==2.15.1 keras==2.15.0
KERAS2_2.15  := tf-keras==2.15.1
TF_PINS_2.16 := tensorflow-cpu==2.16.2 keras==3.3.3
KERAS2_2.16  := tf-keras==2.16.0
TF_PINS_2.17 := tensorflow-cpu==2.17.1 keras==3.4.1
KERAS2_2.17  := tf-keras==2.17.0
TF_PINS_2.18 := tensorflow-cpu==2.18.1 keras==3.6.0
KERAS2_2.18  := tf-keras==2.18.0
TF_PINS_2.19 := tensorflow-cpu==2.19.1 keras==3.9.2
KERAS2_2.19  := tf-keras==2.19.0
TF_PINS_2.20 := tensorflow-cpu==2.20.0 keras==3.11.3
KERAS2_2.20  := tf-keras==2.20.1
TF_PINS_2.21 := tensorflow-cpu==2.21.0 keras==3.15.1
KERAS2_2.21  := tf-keras==2.21.0
TF_VERSIONS   := 2.15 2.16 2.17 2.18 2.19 2.20 2.21
# What `make test-versions` (and CI) runs besides the whole suite on .venv
# (2.21): the oldest and the newest of the others. `make test-full` runs all.
TEST_VERSIONS ?= 2.15 2.20
# The TF behaviours of each version's subset: both on 2.15, the only version
# whose Keras 2 is the `keras` package and whose tf.compat.v1.layers is Keras
# 2.15's, in each behaviour; the TF2-behaviour pass on the others, whose
# TF1-behaviour paths are 2.21's (tf-keras beside Keras 3), which make test
# runs in full. `make test-full` runs both behaviours on every version.
VERSION_BEHAVIORS_2.15 := v2 v1
VERSION_BEHAVIORS ?= v2
# The other packages the subset needs (no linters, docs or demo tools).
VERSION_TEST_PINS := tf-slim==1.1.0 tensorpack==0.11 tqdm pytest "pytest-timeout>=2.1" \
                     "pytest-xdist>=3.3"

.PHONY: $(TF_VERSIONS:%=venv-tf%) $(TF_VERSIONS:%=test-tf%) test-versions
$(TF_VERSIONS:%=venv-tf%): venv-tf%: .venv-tf%/.installed

# The stamp depends on the Makefile (the pins): a changed pin reinstalls.
.venv-tf%/.installed: Makefile pyproject.toml
	@test -n "$(TF_PINS_$*)" || { echo "no pins for TensorFlow $* (supported: $(TF_VERSIONS))"; exit 2; }
	$(PYTHON) -m venv .venv-tf$*
	.venv-tf$*/bin/python -m pip --disable-pip-version-check install -q --upgrade pip setuptools wheel
	.venv-tf$*/bin/python -m pip --disable-pip-version-check install -q --no-compile $(TF_PINS_$*) $(VERSION_TEST_PINS)
	.venv-tf$*/bin/python -m pip --disable-pip-version-check install -q --no-compile --no-deps $(KERAS2_$*)
	.venv-tf$*/bin/python -m pip --disable-pip-version-check install -q --no-deps --no-build-isolation -e .
	touch $@

# The subset in its TF behaviours (VERSION_BEHAVIORS), the kernels build (a fresh compile for this
# TensorFlow, into the shared cache) and the self-test on 2 virtual CPUs. Only
# the modules that mark tests are collected: collecting the others would import
# what they import (tf-keras beside TensorFlow 2.15's Keras 2.15, for one).
VERSION_TESTS = $(shell grep -l 'pytest.mark.versions' tests/*/test_*.py)
$(TF_VERSIONS:%=test-tf%): test-tf%: .venv-tf%/.installed
	.venv-tf$*/bin/python -m tf1_syncbn.kernels
	for behavior in $(or $(VERSION_BEHAVIORS_$*),$(VERSION_BEHAVIORS)); do \
	    TF1_SYNCBN_TEST_BEHAVIOR=$$behavior .venv-tf$*/bin/python -m pytest -q $(XDIST) \
	        -m versions $(VERSION_TESTS) $(PYTEST_ARGS) || exit 1; \
	done
	.venv-tf$*/bin/python -m tf1_syncbn.selftest --towers 2 --steps 2

test-versions: $(TEST_VERSIONS:%=test-tf%)

# $(TEST_VERSIONS), for .ci/run, which runs each version's make test-tf<v> as a
# part of its own, side by side with the others.
.PHONY: test-versions-list
test-versions-list:
	@echo $(TEST_VERSIONS)

# The environments of $(TEST_VERSIONS) alone (pip installs, mostly disk): .ci/run
# creates them while make test runs, so that make test-versions only tests.
.PHONY: venvs-versions
venvs-versions: $(TEST_VERSIONS:%=.venv-tf%/.installed)

# ruff, with the rules in pyproject.toml ([tool.ruff]).
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check --no-cache .

# The documentation site (docs/, Sphinx), offline, warnings as errors, into
# docs/_build/html (git-ignored). Open docs/_build/html/index.html.
docs: $(VENV)/.installed-docs
	$(PY) -m sphinx -E -a -W --keep-going -q -b html docs docs/_build/html

# The package as users get it: sdist and wheel (python -m build), installed with
# tensorflow-cpu into a fresh virtual environment that runs the self-check
# (.ci/wheel_check.sh). CI runs it after make test.
wheel-check: $(VENV)/.installed-test
	PY=$(PY) PYTHON=$(PYTHON) .ci/wheel_check.sh

# Horovod 0.28.1 with Gloo (no MPI), built from PyPI's sdist against the
# installed TensorFlow into .venv by tools/build_horovod.sh (docs/horovod.md).
# Where it cannot build, it fails saying why; it never skips.
.PHONY: horovod test-horovod
horovod: $(VENV)/.installed-horovod

$(VENV)/.installed-horovod: $(VENV)/.installed-test tools/build_horovod.sh
	tools/build_horovod.sh $(PY)
	touch $@

# The Horovod backend run by Horovod itself: tests/with_horovod/ starts
# horovodrun --gloo with 2 processes (4 for the conformance matrix's horovod column);
# both TF behaviours. CI runs it after make test.
test-horovod: horovod kernels
	TF1_SYNCBN_TEST_BEHAVIOR=v2 $(PY) -m pytest -q tests/with_horovod $(PYTEST_ARGS)
	TF1_SYNCBN_TEST_BEHAVIOR=v1 $(PY) -m pytest -q tests/with_horovod $(PYTEST_ARGS)

bench: $(VENV)/.installed kernels
	$(PY) bench/sync_step.py
	$(PY) bench/network_step.py
	$(PY) bench/groups_step.py

# On a machine with NVIDIA GPUs: the GPU tests in both TF behaviours, the
# self-test and bench/ on GPU towers, in .venv when its TensorFlow sees the
# GPUs, else in .venv-gpu (tensorflow[and-cuda], set up once); the figures go
# to bench/results/gpu-check-*.md (docs/gpus.md). Without a GPU it says so and
# exits 0. Extra arguments: GPU_CHECK_ARGS='--no-bench'.
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check:
	$(PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .venv-tf* *.egg-info .pytest_cache docs/_build build dist

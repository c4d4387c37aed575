# Two commands do all set-up on a fresh machine (Python 3.11 and nothing else):
#   make demo   creates .venv, installs the project, runs the main job
#   make test   creates .venv, installs the project and test tools, runs the suite
# Re-running reuses .venv: installs happen again only when pyproject.toml or
# this Makefile change.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
DEMO_ARGS ?=
# Extra pytest arguments, e.g. `make test PYTEST_ARGS='-k kernels -x'`.
PYTEST_ARGS ?=

.PHONY: demo test install kernels clean bench

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

# Install TensorFlow only when no build is importable yet, so an existing
# tensorflow-cpu / tensorflow / vendor build is never shadowed by a second one.
$(VENV)/.installed: $(VENV)/bin/python pyproject.toml Makefile
	@if $(PY) -c "import tensorflow" >/dev/null 2>&1; then \
	    echo "TensorFlow already present: $$($(PY) -c 'import tensorflow as tf; print(tf.__version__)')"; \
	    $(PIP) install -q -e '.[demo]'; \
	else \
	    $(PIP) install -q -e '.[cpu,demo]'; \
	fi
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	@# tf-keras is pinned to the installed TF minor version and installed
	@# without dependencies: its metadata asks for the full `tensorflow` build.
	$(PIP) install -q --no-deps "tf-keras~=$$($(PY) -c 'import tensorflow as tf; print(".".join(tf.__version__.split(".")[:2]))').0"
	touch $@

install: $(VENV)/.installed

# Compiles the CPU kernels into the cache (~/.cache/tf1_syncbn) once, visibly,
# instead of silently inside the first layer built. Without a compiler the
# layers use TensorFlow's stock kernels: the demo still runs, the tests fail.
kernels: $(VENV)/.installed
	$(PY) -m tf1_syncbn.kernels

demo: $(VENV)/.installed
	-$(PY) -m tf1_syncbn.kernels
	$(PY) examples/train_multitower.py --overwrite $(DEMO_ARGS)

# pytest.ini adds -rs (skip reasons) and a 300 s limit per test (pytest-timeout,
# from pyproject.toml's test extra).
test: $(VENV)/.installed-test kernels
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

bench: $(VENV)/.installed kernels
	$(PY) bench/sync_step.py
	$(PY) bench/network_step.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

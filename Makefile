# The two commands of the README:  `make demo`  and  `make test`  (and `make test-all`, the whole CPU suite).
# They create .venv on first use and install jax_ep into it (building the CUDA extension when nvcc is found).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

# After the install, one line: was the CUDA extension jax_ep._C built (it needs an NVIDIA GPU at run time:
# is one usable here?), and if not, why?
EXT_STATUS := import jax_ep.runtime as r; e = r.extension_error(); print(('jax_ep: CUDA extension jax_ep._C built; backend cuda needs an NVIDIA GPU at run time (' + ('one is usable here' if r.available()[0] else 'none usable here: the pure-JAX reference backend runs') + ')') if e is None else 'jax_ep: CUDA extension jax_ep._C not built (' + ' '.join(e.split()) + '): the pure-JAX reference backend runs')

.PHONY: demo test test-slow test-all lint install
install: $(VENV)/.installed
# the native sources too: an edit under cuda/ or xla_ffi/ rebuilds the extension the tests import
$(VENV)/.installed: pyproject.toml constraints.txt CMakeLists.txt $(wildcard cuda/* xla_ffi/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@$(PY) -c "$(EXT_STATUS)"
	touch $@

demo: install
	$(PY) examples/demo.py

# Tests: GPU tests (marker gpu) run on a GPU machine (pytest -m gpu tests/gpu). `make test` is the fast
# default suite: every public op, backend path and the kernel emulator's smoke cases; the long tests
# (marker slow: emulator sweeps, hypothesis pool tails, multi-process and example runs, sweep tails) run
# with `make test-slow`. `make test-all` runs both, each test once. CI (.ci/run) runs `make test` (.ci/run
# says why).
PYTEST_ARGS ?=
test: install
	$(PY) -m pytest -q -m 'not gpu and not slow' $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m 'not gpu and slow' $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest -q -m 'not gpu' $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

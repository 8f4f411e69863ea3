# The two commands of the README:  `make demo`  and  `make test`.
# Both create .venv on first use and install jax_ep into it (building the CUDA extension when nvcc is found).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

# After the install, one line: was the CUDA extension jax_ep._C built (it needs an NVIDIA GPU at run time:
# is one usable here?), and if not, why?
EXT_STATUS := import jax_ep.runtime as r; e = r.extension_error(); print(('jax_ep: CUDA extension jax_ep._C built; backend cuda needs an NVIDIA GPU at run time (' + ('one is usable here' if r.available()[0] else 'none usable here: the pure-JAX reference backend runs') + ')') if e is None else 'jax_ep: CUDA extension jax_ep._C not built (' + ' '.join(e.split()) + '): the pure-JAX reference backend runs')

.PHONY: demo test lint install
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml constraints.txt CMakeLists.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@$(PY) -c "$(EXT_STATUS)"
	touch $@

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .

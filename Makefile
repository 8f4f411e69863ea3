# The two commands of the README:  `make demo`  and  `make test`.
# Both create .venv on first use and install jax_ep into it (building the CUDA extension when nvcc is found).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint install
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml constraints.txt CMakeLists.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .

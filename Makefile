# Two commands on a fresh machine:  make demo   |   make test
# Both create the virtual environment (.venv) themselves.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python

.PHONY: demo test lint venv clean system-deps

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "edgefleet needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# the tests start their own Mosquitto on a free port; install the binary if it is missing
system-deps:
	@bash .ci/ensure-mosquitto

demo: $(VENV)/.installed
	$(VENV)/bin/edgefleet demo

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m mypy

test: $(VENV)/.installed system-deps lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .edgefleet-demo .pytest_cache .mypy_cache .ruff_cache

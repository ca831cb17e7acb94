"""The vLLM adapter, one module per job:

  options.py     option defaults, checks, the mapping to `vllm.LLM(...)` and its environment (pure)
  engine.py      VLLMEngine: load, the step loop (prefill/decode/serve/score), release, close
  introspect.py  every read of vLLM's internals (scheduler, block pool, KV config, threads)

The registry (adapters/__init__.py) names `adapters.vllm.engine:VLLMEngine`. What was checked
against which vLLM version, and how: docs/engines/vllm.md.
"""

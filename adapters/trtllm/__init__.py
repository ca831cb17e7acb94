"""The TensorRT-LLM adapter, one module per job:

  options.py   option defaults, checks, the mapping to LLM(...)/KvCacheConfig/SamplingParams (pure)
  streamer.py  the asyncio loop thread that does every call into the executor (submit, abort, stats)
  timing.py    step and token times from TensorRT-LLM's own per-request / per-iteration metrics (pure)
  engine.py    TRTLLMEngine: availability probe, load, prefill/decode/serve/score, KV info, close

The registry (adapters/__init__.py) names `adapters.trtllm.engine:TRTLLMEngine`. What was checked
against which TensorRT-LLM version, and how: docs/engines/trtllm.md.
"""

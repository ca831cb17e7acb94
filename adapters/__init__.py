"""Engine adapters, one module per engine, behind `adapters.base.Engine`.

Engines come only from this registry: a config names an engine, never code to import.
"""

from __future__ import annotations

import importlib

from adapters.base import Engine

# name -> "module:Class". Order is the order engines run in and are shown in.
REGISTRY: dict[str, str] = {
    "reference": "adapters.reference.engine:ReferenceEngine",
    "hf": "adapters.hf:HFEngine",
    "vllm": "adapters.vllm.engine:VLLMEngine",
    "trtllm": "adapters.trtllm.engine:TRTLLMEngine",
}


def engine_names() -> list[str]:
    return list(REGISTRY)


def engine_class(name: str) -> type[Engine]:
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)

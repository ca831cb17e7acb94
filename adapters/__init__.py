"""Engine adapters, one module per engine, behind `adapters.base.Engine`.

Engines come only from this registry: a config names an engine, never code to import. Engines
written outside this package (a plugin of your own, or a test's deliberately broken engine) are
added by whoever starts the run, through the environment, never through a config:

    INFER_BENCH_ENGINES="name=module:Class[,name2=module2:Class2]"

The module must be importable by the harness and by the engine's worker (PYTHONPATH); the
worker inherits the variable. Such an engine cannot take a registered engine's name.
"""

from __future__ import annotations

import importlib
import os

from adapters.base import Engine

# name -> "module:Class". Order is the order engines run in and are shown in.
REGISTRY: dict[str, str] = {
    "reference": "adapters.reference.engine:ReferenceEngine",
    "hf": "adapters.hf:HFEngine",
    "vllm": "adapters.vllm.engine:VLLMEngine",
    "trtllm": "adapters.trtllm.engine:TRTLLMEngine",
    "llamacpp": "adapters.llamacpp.engine:LlamaCppEngine",
}
EXTRA_ENGINES_ENV = "INFER_BENCH_ENGINES"
# name -> "module:function(shape) -> str | None": why a registered engine cannot run a model of this
# shape (harness.core.shapes.ModelShape), checked when the run is planned; the engine's row is then
# `unavailable` with that line. Engines not listed are asked at load.
MODEL_CHECKS: dict[str, str] = {
    "reference": "adapters.reference.families:unsupported_reason",
    "llamacpp": "adapters.llamacpp.convert:unsupported_reason",
}


def _extra_engines() -> dict[str, str]:
    """The engines named in $INFER_BENCH_ENGINES (malformed entries and registered names ignored)."""
    out: dict[str, str] = {}
    for item in os.environ.get(EXTRA_ENGINES_ENV, "").split(","):
        name, _, target = item.strip().partition("=")
        if name and ":" in target and name not in REGISTRY:
            out[name] = target
    return out


def _registry() -> dict[str, str]:
    return {**REGISTRY, **_extra_engines()}


def engine_names() -> list[str]:
    return list(_registry())


def engine_class(name: str) -> type[Engine]:
    module, cls = _registry()[name].split(":")
    return getattr(importlib.import_module(module), cls)


def unsupported_model(name: str, shape: object) -> str | None:
    """Why engine `name` cannot run a model of `shape` (None: it does not say it cannot)."""
    target = MODEL_CHECKS.get(name)
    if target is None:
        return None
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)(shape)

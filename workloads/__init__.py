"""What to run: each workload plans points from its config and measures one point through the
engine interface. A workload knows nothing about any particular engine."""

from __future__ import annotations

import importlib

from workloads.base import Workload

REGISTRY: dict[str, str] = {
    "sweep": "workloads.sweep:Sweep",
    "kv_ablation": "workloads.kv_ablation:KVAblation",
    "prefix_sharing": "workloads.prefix_sharing:PrefixSharing",
    "serving": "workloads.serving:Serving",
    "kv_memory": "workloads.kv_memory:KVMemory",
    "parity": "workloads.parity:Parity",
    "capacity": "workloads.capacity:Capacity",
    "quality": "workloads.quality:Quality",
    "tune": "workloads.tune:Tune",
    "conversation": "workloads.conversation:Conversation",
    "speculative": "workloads.speculative:Speculative",
    "structured": "workloads.structured:Structured",
}


def workload_names() -> list[str]:
    return list(REGISTRY)


def load_all() -> None:
    """Import every workload's module: each class registers what it is compared on
    (Workload.compared_metrics, in harness.core.compared)."""
    for target in REGISTRY.values():
        importlib.import_module(target.split(":")[0])


def get_workload(name: str) -> Workload:
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)()

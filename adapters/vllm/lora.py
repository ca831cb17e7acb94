"""vLLM in-process LoRA adapters: one LoRARequest per adapter of `lora_adapters`, and the counters
of vLLM's LoRA manager (introspect.LoRACounter) behind the engine's lora_stats()."""

from __future__ import annotations

from typing import Any

from adapters.vllm import introspect


class Adapters:
    """The engine's adapters (empty without `lora_adapters`): `request(name)` gives the name's
    LoRARequest (its int id its 1-based place in lora_adapters; None: the base model)."""

    def __init__(self, adapters: list[dict[str, Any]] | None = None, engine: Any = None):
        self.requests: dict[str, Any] = {}
        self.counter: Any = None
        if adapters:
            from vllm.lora.request import LoRARequest
            self.requests = {a["name"]: LoRARequest(a["name"], i + 1, a["path"]) for i, a in enumerate(adapters)}
            self.counter = introspect.LoRACounter(engine)

    def __bool__(self) -> bool:
        return bool(self.requests)

    def request(self, adapter: str | None) -> Any:
        if adapter is None:
            return None
        if adapter not in self.requests:
            raise ValueError(f"vllm: adapter {adapter} is not among engine_options.vllm.lora_adapters "
                             f"({', '.join(self.requests) or 'none'})")
        return self.requests[adapter]

    def stats(self) -> dict[str, Any] | None:
        c = self.counter
        if c is None:
            return None
        names = {r.lora_int_id: n for n, r in self.requests.items()}
        return {"loads": c.loads, "evictions": c.evictions, "host_loads": c.host_loads, "max_loras": c.slots,
                "resident": [names.get(i, i) for i in c.resident()],
                "source": "vLLM's LoRA manager in this process (LRUCacheLoRAModelManager.activate_adapter counted)"}

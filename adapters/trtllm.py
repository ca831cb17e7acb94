"""TensorRT-LLM through its `tensorrt_llm.LLM` API (PyTorch backend).

Written against TensorRT-LLM 1.2.1 (`pip install tensorrt-llm==1.2.1`; the LLM API of the 1.x
line: `LLM`, `SamplingParams`, `llmapi.KvCacheConfig`, `LLM.generate_async(..., streaming=True)`,
`LLM.get_stats()`). NOT RUN YET: there was no NVIDIA GPU where this was written; the mapping from
our options to TensorRT-LLM's arguments is unit-tested (tests/test_trtllm_mapping.py) and
tests/test_trtllm_gpu.py runs the real engine where a GPU and TensorRT-LLM exist.

TensorRT-LLM runs its own scheduling loop (in-flight batching) in an executor worker; unlike
vLLM it cannot be stepped from outside. So the adapter streams every request
(`generate_async(token_ids, params, streaming=True)`) from a background asyncio thread that stamps
each token with the harness clock the moment it reaches this process, and reads the interface's
operations off those stamps:

  prefill(prompts)  submits every prompt (max_tokens = what still fits in max_seq_len) and waits
                    until every request has streamed its first token: the latency runs from the
                    first submission to the arrival of the last first token.
  decode(n)         the engine keeps generating on its own; decode(n) waits until every sequence
                    has n more tokens. Step i ends when the last sequence's i-th new token arrived
                    and starts where step i-1 ended (in-flight batching advances all sequences in
                    the same iteration, so this is the iteration time as seen by the client).
  release()         aborts the requests (they would otherwise run on to max_tokens).
  serve(requests)   submits each request at its scheduled arrival; one TokenEvent per token, at
                    its arrival time.
Token times include the executor's response path to this process (what a user of the LLM API
sees). Each request's own perf metrics (`return_perf_metrics=True`: arrival, first scheduled,
first/last token times, KV-cache reuse) are kept and reported in kv_cache_info().extra.

Options (`engine_options.trtllm.<name>`, defaults in conf/engine/trtllm.yaml):
  max_batch_size            most requests in flight (null: TensorRT-LLM's default)
  max_num_tokens            most tokens per iteration (null: TensorRT-LLM's default, 8192)
  tensor_parallel_size      GPUs to shard over (default 1)
  free_gpu_memory_fraction  KvCacheConfig: share of free GPU memory for the KV cache (default 0.9)
  kv_cache_max_tokens       KvCacheConfig.max_tokens: cap on KV tokens (null: no cap)
  enable_block_reuse        KvCacheConfig: prefix reuse across requests (default true)
  tokens_per_block          KvCacheConfig: tokens per KV block, a power of two (default 32)
  kv_cache_dtype            KvCacheConfig.dtype: auto | fp8 (default auto = the model's dtype)
  enable_chunked_prefill    default false (TensorRT-LLM's default)
  cuda_graphs               default true (TensorRT-LLM's default CUDA-graph config); false: none
  disable_overlap_scheduler default false (TensorRT-LLM's default)
max_seq_len comes from the workload (ModelSpec.max_model_len); the dtype from the run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from adapters.base import (
    Capabilities, DecodeResult, Engine, EngineUnavailable, KVCacheInfo, LoadInfo, ModelSpec,
    PrefillResult, Request, StepTiming, TokenEvent, is_pos_int, now_ns, option_type_problems,
)

TRTLLM_VERSION_WRITTEN_AGAINST = "1.2.1"
DEFAULTS: dict[str, Any] = {
    "max_batch_size": None,
    "max_num_tokens": None,
    "tensor_parallel_size": 1,
    "free_gpu_memory_fraction": 0.9,
    "kv_cache_max_tokens": None,
    "enable_block_reuse": True,
    "tokens_per_block": 32,
    "kv_cache_dtype": "auto",
    "enable_chunked_prefill": False,
    "cuda_graphs": True,
    "disable_overlap_scheduler": False,
}
OPTIONS = tuple(DEFAULTS)
KV_DTYPES = ("auto", "fp8")
_BOOL_OPTIONS = ("enable_block_reuse", "enable_chunked_prefill", "cuda_graphs", "disable_overlap_scheduler")
INSTALL_HINT = "pip install '.[trtllm]' on a machine with an NVIDIA GPU and CUDA"
WAIT_S = 600.0  # longest wait for one token before the adapter gives up


# ---- pure mapping (unit-tested without TensorRT-LLM) ----------------------------------------

def resolved_options(options: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(DEFAULTS)
    out.update({k: v for k, v in (options or {}).items() if k in DEFAULTS})
    return out


def kv_cache_config_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """Fields of `tensorrt_llm.llmapi.KvCacheConfig(...)`."""
    o = resolved_options(options)
    kw: dict[str, Any] = {
        "free_gpu_memory_fraction": float(o["free_gpu_memory_fraction"]),
        "enable_block_reuse": bool(o["enable_block_reuse"]),
        "tokens_per_block": int(o["tokens_per_block"]),
        "dtype": str(o["kv_cache_dtype"]),
    }
    if o["kv_cache_max_tokens"] is not None:
        kw["max_tokens"] = int(o["kv_cache_max_tokens"])
    return kw


def llm_kwargs(model: ModelSpec, options: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `tensorrt_llm.LLM(...)`, with `kv_cache_config` as the dict of its
    fields (load() turns it into a KvCacheConfig) and `cuda_graph_config` present only when CUDA
    graphs are turned off (then None)."""
    o = resolved_options(options)
    kw: dict[str, Any] = {
        "model": model.path,
        "skip_tokenizer_init": True,
        "dtype": model.dtype,
        "tensor_parallel_size": int(o["tensor_parallel_size"]),
        "max_seq_len": int(model.max_model_len),
        "enable_chunked_prefill": bool(o["enable_chunked_prefill"]),
        "disable_overlap_scheduler": bool(o["disable_overlap_scheduler"]),
        "enable_iter_perf_stats": True,  # LLM.get_stats(): the KV-cache block counts
        "kv_cache_config": kv_cache_config_kwargs(o),
    }
    for k in ("max_batch_size", "max_num_tokens"):
        if o[k] is not None:
            kw[k] = int(o[k])
    if not o["cuda_graphs"]:
        kw["cuda_graph_config"] = None
    return kw


def sampling_kwargs(max_tokens: int, end_id: int) -> dict[str, Any]:
    """Keyword arguments of `tensorrt_llm.SamplingParams(...)`: greedy, forced length, token ids
    only, with the request's perf metrics. Without a tokenizer the LLM API needs an explicit
    end_id (ignore_eos makes it irrelevant to the length)."""
    return {"max_tokens": int(max_tokens), "temperature": 0.0, "ignore_eos": True, "detokenize": False,
            "return_perf_metrics": True, "end_id": int(end_id), "pad_id": int(end_id)}


def unavailable_text(installed: bool, cuda_devices: int | None) -> str | None:
    """Why TensorRT-LLM cannot run here (None: it can). `cuda_devices` None: no NVIDIA driver."""
    reasons = []
    if not installed:
        reasons.append(f"TensorRT-LLM is not installed ({INSTALL_HINT})")
    if not cuda_devices:
        reasons.append("no CUDA device" + ("" if cuda_devices == 0 else " (no NVIDIA driver found)")
                       + ": TensorRT-LLM runs only on NVIDIA GPUs")
    return "; ".join(reasons) or None


def end_id_of(model_path: str) -> int:
    """The checkpoint's EOS id from config.json (-1 when it has none)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return -1
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return int(eos) if isinstance(eos, int) else -1


def _cuda_device_count() -> int | None:
    """NVIDIA devices via NVML (cheap; no torch or CUDA context). None: no driver."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


# ---- token streams ----------------------------------------------------------------------------

class _Stream:
    """The tokens of one request, each stamped when it reached this process."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.tokens: list[int] = []
        self.times: list[int] = []
        self.done = False
        self.error: BaseException | None = None
        self.result: Any = None  # TensorRT-LLM's RequestOutput (for abort)
        self.perf: Any = None


class _Streamer:
    """An asyncio loop in a background thread that runs `generate_async(..., streaming=True)`
    for every request (the LLM API's documented streaming path) and records token arrivals."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.cond = threading.Condition()
        self.events: queue.Queue = queue.Queue()  # (stream, first_index, count) for serve()
        self.thread = threading.Thread(target=self.loop.run_forever, name="trtllm-streams", daemon=True)
        self.thread.start()

    def submit(self, llm: Any, ids: list[int], params: Any, key: str) -> _Stream:
        stream = _Stream(key)
        asyncio.run_coroutine_threadsafe(self._run(llm, ids, params, stream), self.loop)
        return stream

    async def _run(self, llm: Any, ids: list[int], params: Any, stream: _Stream) -> None:
        try:
            result = llm.generate_async(ids, sampling_params=params, streaming=True)
            stream.result = result
            async for out in result:
                t = now_ns()
                comp = out.outputs[0]
                new = list(comp.token_ids[len(stream.tokens):])
                with self.cond:
                    first = len(stream.tokens)
                    stream.tokens.extend(new)
                    stream.times.extend([t] * len(new))
                    if out.finished:
                        stream.done = True
                        stream.perf = getattr(comp, "request_perf_metrics", None)
                    self.cond.notify_all()
                self.events.put((stream, first, len(new)))
        except BaseException as e:  # surfaced to the waiting caller
            with self.cond:
                stream.error, stream.done = e, True
                self.cond.notify_all()
            self.events.put((stream, len(stream.tokens), 0))
        else:
            with self.cond:
                stream.done = True
                self.cond.notify_all()

    def wait_for(self, streams: list[_Stream], count: int) -> None:
        """Block until every stream has `count` tokens (or fails)."""
        deadline = time.monotonic() + WAIT_S
        with self.cond:
            while True:
                for s in streams:
                    if s.error is not None:
                        raise RuntimeError(f"TensorRT-LLM request {s.key} failed: {s.error}") from s.error
                    if s.done and len(s.tokens) < count:
                        raise RuntimeError(f"TensorRT-LLM request {s.key} ended after {len(s.tokens)} tokens; "
                                           f"{count} were needed")
                if all(len(s.tokens) >= count for s in streams):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"TensorRT-LLM streamed no token for {WAIT_S:.0f} s")
                self.cond.wait(left)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# ---- the engine -------------------------------------------------------------------------------

class TRTLLMEngine(Engine):
    name = "trtllm"
    option_names = {"kv_dtype": "kv_cache_dtype", "prefix_caching": "enable_block_reuse",
                    "block_size": "tokens_per_block"}

    @classmethod
    def unavailable_reason(cls) -> str | None:
        installed = importlib.util.find_spec("tensorrt_llm") is not None
        return unavailable_text(installed, _cuda_device_count())

    @classmethod
    def version(cls) -> str | None:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("tensorrt-llm")
        except PackageNotFoundError:
            return None

    @classmethod
    def capabilities(cls, options: dict[str, Any] | None = None) -> Capabilities:
        o = resolved_options(options)
        return Capabilities(
            dtypes=("bfloat16", "float16"), devices=("cuda",), kv_dtypes=KV_DTYPES,
            prefix_caching=bool(o["enable_block_reuse"]), chunked_prefill=bool(o["enable_chunked_prefill"]),
            no_cache_mode=False, contiguous_layout=False, continuous_batching=True, paged=True,
            logits=False, options=OPTIONS,
        )

    @classmethod
    def check_options(cls, options: dict[str, Any], model: ModelSpec) -> list[str]:
        problems = super().check_options(options, model)
        o = resolved_options(options)
        p = "engine_options.trtllm."
        problems += option_type_problems(cls.name, o, _BOOL_OPTIONS,
                                         ("max_batch_size", "max_num_tokens", "kv_cache_max_tokens"))
        if not is_pos_int(o["tensor_parallel_size"]):
            problems.append(f"{p}tensor_parallel_size={o['tensor_parallel_size']}: must be a positive integer.")
        tpb = o["tokens_per_block"]
        if not is_pos_int(tpb) or tpb < 2 or tpb & (tpb - 1):
            problems.append(f"{p}tokens_per_block={tpb}: TensorRT-LLM needs a power of two greater than 1 "
                            "(e.g. 16, 32, 64).")
        f = o["free_gpu_memory_fraction"]
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            problems.append(f"{p}free_gpu_memory_fraction={f}: must be a fraction in (0, 1].")
        if str(o["kv_cache_dtype"]) not in KV_DTYPES:
            problems.append(f"{p}kv_cache_dtype={o['kv_cache_dtype']}: use one of {', '.join(KV_DTYPES)}.")
        if not str(model.device).startswith("cuda"):
            problems.append(f"device={model.device}: TensorRT-LLM runs only on NVIDIA GPUs (device=cuda).")
        return problems

    def __init__(self) -> None:
        self._llm = None
        self._streamer: _Streamer | None = None
        self._live: list[_Stream] = []
        self._gen = 0
        self._stats: dict[str, Any] = {}
        self._perf: list[Any] = []
        self._consumed = 0  # tokens of each live sequence handed out so far

    # ---- life cycle --------------------------------------------------------------------
    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo:
        reason = self.unavailable_reason()
        if reason:
            raise EngineUnavailable(reason)
        self.options = resolved_options(options)
        self.model_spec = model
        t_import = time.perf_counter()
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig
        self._SamplingParams = SamplingParams
        import_s = time.perf_counter() - t_import
        kwargs = llm_kwargs(model, options)
        kwargs["kv_cache_config"] = KvCacheConfig(**kwargs["kv_cache_config"])
        t0 = time.perf_counter()
        self._llm = LLM(**kwargs)
        load_s = time.perf_counter() - t0
        self._streamer = _Streamer()
        self.max_seq_len = int(model.max_model_len)
        self.end_id = end_id_of(model.path)
        info = self.kv_cache_info()
        return LoadInfo(load_time_s=load_s, weights_bytes=None, kv_pool_bytes=info.pool_bytes,
                        engine_version=self.version(),
                        details={"import_s": import_s, "written_against": TRTLLM_VERSION_WRITTEN_AGAINST,
                                 "llm_args": llm_kwargs(model, options) | {"model": None}})

    def close(self) -> None:
        if self._llm is None:
            return
        try:
            self.release()
        finally:
            llm, self._llm = self._llm, None
            try:
                llm.shutdown()
            finally:
                if self._streamer is not None:
                    self._streamer.stop()
                    self._streamer = None

    # ---- requests ----------------------------------------------------------------------
    def _params(self, max_tokens: int):
        return self._SamplingParams(**sampling_kwargs(max_tokens, self.end_id))

    def _submit(self, ids: list[int], max_tokens: int, key: str) -> _Stream:
        assert self._streamer is not None
        return self._streamer.submit(self._llm, list(ids), self._params(max_tokens), key)

    def prefill(self, prompts: list[list[int]], return_logits: bool = False) -> PrefillResult:
        if return_logits:
            raise NotImplementedError("the TensorRT-LLM adapter does not return logits")
        self.release()
        for i, p in enumerate(prompts):
            if not p or len(p) >= self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; max_seq_len={self.max_seq_len} leaves no room "
                                 "for an output token.")
        self._gen += 1
        start = now_ns()
        self._live = [self._submit(p, self.max_seq_len - len(p), f"b{self._gen}-{i}") for i, p in enumerate(prompts)]
        self._streamer.wait_for(self._live, 1)
        end = max(s.times[0] for s in self._live)
        self._consumed = 1
        return PrefillResult([s.tokens[0] for s in self._live], start, end)

    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult:
        if return_logits:
            raise NotImplementedError("the TensorRT-LLM adapter does not return logits")
        if not self._live:
            raise RuntimeError("decode() before prefill()")
        k = self._consumed
        self._streamer.wait_for(self._live, k + steps)
        tokens, timings = [], []
        prev_end = max(s.times[k - 1] for s in self._live)
        for i in range(k, k + steps):
            end = max(s.times[i] for s in self._live)
            tokens.append([s.tokens[i] for s in self._live])
            timings.append(StepTiming(prev_end, end, len(self._live)))
            prev_end = end
        self._consumed = k + steps
        return DecodeResult(tokens, timings)

    def release(self) -> None:
        for s in self._live:
            if not s.done and s.result is not None:
                try:
                    s.result.abort()
                except Exception:
                    pass
            if s.perf is not None:
                self._perf.append(s.perf)
        self._live = []

    def serve(self, requests: list[Request], start_ns: int) -> Iterator[TokenEvent]:
        self.release()
        assert self._streamer is not None
        events = self._streamer.events
        while not events.empty():
            events.get_nowait()
        self._gen += 1
        pending = sorted(requests, key=lambda r: r.arrival_s)
        owner: dict[int, Request] = {}
        nxt, open_ = 0, 0
        try:
            while nxt < len(pending) or open_:
                while nxt < len(pending) and now_ns() >= start_ns + int(pending[nxt].arrival_s * 1e9):
                    r = pending[nxt]
                    s = self._submit(r.prompt_ids, r.max_new_tokens, f"s{self._gen}-{r.request_id}")
                    owner[id(s)] = r
                    self._live.append(s)
                    nxt += 1
                    open_ += 1
                timeout = None
                if nxt < len(pending):
                    timeout = max(0.0, (start_ns + int(pending[nxt].arrival_s * 1e9) - now_ns()) / 1e9)
                try:
                    stream, first, count = events.get(timeout=timeout if timeout is not None else WAIT_S)
                except queue.Empty:
                    if timeout is None:
                        raise TimeoutError(f"TensorRT-LLM streamed no token for {WAIT_S:.0f} s") from None
                    continue
                r = owner.get(id(stream))
                if r is None:
                    continue
                if stream.error is not None:
                    raise RuntimeError(f"TensorRT-LLM request {stream.key} failed: {stream.error}") from stream.error
                for j in range(first, first + count):
                    yield TokenEvent(r.request_id, j, stream.tokens[j], stream.times[j],
                                     finished=j == r.max_new_tokens - 1)
                if stream.done:
                    open_ -= 1
                    owner.pop(id(stream))
        finally:
            self.release()

    # ---- KV cache ----------------------------------------------------------------------
    def _poll_stats(self) -> None:
        """Drain LLM.get_stats() (iteration stats) and keep the newest KV-cache snapshot."""
        try:
            for snap in self._llm.get_stats(timeout=0.05) or []:
                snap = json.loads(snap) if isinstance(snap, str) else snap
                if isinstance(snap, dict) and snap.get("kvCacheStats"):
                    self._stats = snap["kvCacheStats"]
        except Exception:
            pass

    def kv_cache_info(self) -> KVCacheInfo:
        if self._llm is None:
            return KVCacheInfo()
        from harness.core.kvcalc import canonical_kv_dtype
        from harness.core.presets import shape_from_hf_config
        self._poll_stats()
        st = self._stats
        o = self.options
        kv = o["kv_cache_dtype"] if o["kv_cache_dtype"] != "auto" else self.model_spec.dtype
        info = KVCacheInfo(kv_dtype=canonical_kv_dtype(kv), block_size=st.get("tokensPerBlock") or o["tokens_per_block"])
        info.num_blocks = st.get("maxNumBlocks")
        info.blocks_in_use = st.get("usedNumBlocks")
        reused, missed = st.get("reusedBlocks"), st.get("missedBlocks")
        if reused is not None:
            info.prefix_cache_hits = int(reused)
            info.prefix_cache_queries = int(reused) + int(missed or 0)
        try:  # TensorRT-LLM does not report bytes; computed from the model's shape and the KV dtype
            from harness.core.kvcalc import bytes_per_token
            shape = shape_from_hf_config(self.model_spec.path)
            info.bytes_per_token = bytes_per_token(shape, info.kv_dtype)
            info.bytes_per_block = info.bytes_per_token * info.block_size
            if info.num_blocks is not None:
                info.pool_bytes = info.num_blocks * info.bytes_per_block
        except Exception:
            pass
        if info.blocks_in_use is not None:
            info.slots_allocated = info.blocks_in_use * info.block_size
        perf = [_perf_dict(p) for p in self._perf[-64:]]
        info.extra = {"prefix_cache_unit": "blocks", "counters": "cumulative since load",
                      "bytes_source": "model shape x KV dtype (TensorRT-LLM reports blocks, not bytes)",
                      "cache_hit_rate": st.get("cacheHitRate"), "request_perf_metrics": perf}
        return info


def _perf_dict(p: Any) -> dict[str, Any]:
    """A request's RequestPerfMetrics as plain numbers (seconds on TensorRT-LLM's steady clock)."""
    out: dict[str, Any] = {}
    tm = getattr(p, "timing_metrics", None)
    for k in ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time"):
        v = getattr(tm, k, None)
        if v is not None:
            out[k] = v.total_seconds() if hasattr(v, "total_seconds") else v
    km = getattr(p, "kv_cache_metrics", None)
    for k in ("num_total_allocated_blocks", "num_new_allocated_blocks", "num_reused_blocks",
              "num_missed_blocks", "kv_cache_hit_rate"):
        v = getattr(km, k, None)
        if v is not None:
            out[k] = v
    if "first_scheduled_time" in out and "arrival_time" in out:
        out["queue_time_s"] = out["first_scheduled_time"] - out["arrival_time"]
    return out

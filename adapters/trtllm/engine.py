"""TensorRT-LLM through its `tensorrt_llm.LLM` API (PyTorch backend).

Written against TensorRT-LLM 1.2.1 (NVIDIA's package index; the LLM API of the 1.x line: `LLM`,
`SamplingParams`, `llmapi.KvCacheConfig`, `llmapi.SchedulerConfig`, `LLM.generate_async(...,
streaming=True)`, `LLM.get_stats_async()`). NOT RUN on an engine: there was no NVIDIA GPU with
TensorRT-LLM where this was written. docs/engines/trtllm.md says what was checked against which
source, and how; the fakes in tests/test_trtllm_fakes.py reproduce each failure the adapter
handles, and tests/test_trtllm_gpu.py runs the real engine where it exists.

TensorRT-LLM runs its own scheduling loop (in-flight batching) in an executor worker; unlike vLLM
it cannot be stepped from outside. The adapter streams every request from a background asyncio
loop (streamer.py: every call that reaches the executor runs there) and reads the interface's
operations off what comes back:

  prefill(prompts, max_new_tokens)
                    checks the batch fits one iteration (max_batch_size, max_num_tokens), submits
                    every prompt with max_tokens = max_new_tokens (the real output bound: under
                    the default GUARANTEED_NO_EVICT policy TensorRT-LLM reserves KV for all of it
                    before it admits a request; without it, what fits in max_seq_len), waits
                    until every request has its first token, and checks from the requests' perf
                    metrics that all of them started in ONE engine iteration (first_iter) - a
                    batch admitted over several iterations fails the point. Latency: from the
                    first submission to the last first_token_time (TensorRT-LLM's clock), or to
                    the arrival of the last first token when TensorRT-LLM does not report it.
  decode(n)         the engine keeps generating on its own; decode(n) waits until every sequence
                    has n more tokens. Step i lasts the iterLatencyMS of the iteration that
                    produced token k = (tokens so far) + i, i.e. iteration first_iter + k when the
                    requests' last_iter confirms one token per iteration; steps are chained from
                    the prefill's end. Otherwise (no iteration stats, a paused request) step times
                    come from token arrivals, as seen by the client.
  release()         aborts the requests (they would otherwise run on to max_tokens).
  serve(requests)   submits each request at its scheduled arrival; one TokenEvent per token, at
                    its arrival in this process (clock "arrival": tokens come batched per
                    iteration, about one iteration late with the overlap scheduler); the
                    requests' own perf metrics are kept in kv_cache_info().extra.
  score(seqs, start, k)
                    each sequence as a prompt with SamplingParams(max_tokens=1,
                    return_context_logits=True): the context logits are teacher-forced by
                    construction; row p - 1 predicts the token at p; log_softmax in float32 here.
                    (TensorRT-LLM 1.2's `prompt_logprobs` come from the same context logits but,
                    until NVIDIA/TensorRT-LLM#11866, hold the actual token only when it is in
                    the top k, so they cannot give every target's log-probability.)
Which clock each number came from is in LoadInfo.details["clock"] and kv_cache_info().extra["clock"].
Options: adapters/trtllm/options.py.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from typing import Any

from adapters.base import (
    Capabilities, DecodeResult, Engine, EngineUnavailable, KVCacheInfo, LoadInfo, ModelSpec,
    PrefillResult, Request, RequestSource, TokenEvent, TokenScores, as_source, is_pos_int, now_ns,
)
from adapters.trtllm import timing
from adapters.trtllm.options import (
    KV_DTYPES, OPTIONS, VERSION_CHECKED, TRTLLMOptions, check_problems, end_id_of, llm_kwargs, typed,
    sampling_kwargs, this_python, unavailable_text,
)
from adapters.trtllm.streamer import WAIT_S, Stream, Streamer
from harness.core.kvcalc import bytes_per_token, canonical_kv_dtype
from harness.core.presets import shape_from_hf_config

log = logging.getLogger(__name__)
PROBE_S = 180.0  # importing tensorrt_llm initialises CUDA and MPI: it can take a while
_PREFIX = "engine_options.trtllm."
_ADMISSION_HINT = (f"Raise {_PREFIX}max_num_tokens / max_batch_size, give prefill() the real output bound "
                   f"(max_new_tokens), or set {_PREFIX}capacity_scheduler_policy=MAX_UTILIZATION.")


def cuda_device_count() -> int | None:
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


@functools.lru_cache(maxsize=4)
def import_probe(python: str = sys.executable, timeout_s: float = PROBE_S) -> str | None:
    """Import tensorrt_llm in a separate process (its import loads CUDA, MPI and torch
    extensions, and a failure there must not take this process down). None when it imports,
    else the last line of what it said."""
    code = "import tensorrt_llm, sys; sys.stdout.write(tensorrt_llm.__version__)"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"importing tensorrt_llm took more than {timeout_s:.0f} s"
    except OSError as e:
        return f"cannot run {python}: {e}"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


def steady_clock_offset_ns() -> tuple[int | None, str]:
    """perf_counter_ns() - TensorRT-LLM's steady clock, measured now (None when TensorRT-LLM does
    not expose its clock), and how it was measured."""
    try:
        from tensorrt_llm.bindings import steady_clock_now  # TensorRT-LLM's C++ steady_clock
    except Exception as e:
        return None, f"tensorrt_llm.bindings.steady_clock_now unavailable ({e})"
    before = now_ns()
    steady = steady_clock_now().total_seconds()
    after = now_ns()
    return (before + after) // 2 - int(round(steady * 1e9)), f"steady_clock_now() read within {after - before} ns"


class TRTLLMEngine(Engine):
    name = "trtllm"
    option_names = {"kv_dtype": "kv_cache_dtype", "prefix_caching": "enable_block_reuse",
                    "block_size": "tokens_per_block"}
    options_cls = TRTLLMOptions

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Cheap checks first (package, Python version, NVIDIA driver); the import of the engine
        itself in a subprocess only when they pass (cached per process)."""
        installed = importlib.util.find_spec("tensorrt_llm") is not None
        devices = cuda_device_count()
        reason = unavailable_text(installed, devices, this_python())
        if reason is not None:
            return reason
        return unavailable_text(True, devices, this_python(), import_probe())

    @classmethod
    def version(cls) -> str | None:
        try:
            return metadata.version("tensorrt-llm")
        except metadata.PackageNotFoundError:
            return None

    @classmethod
    def capabilities(cls, options: dict[str, Any] | None = None) -> Capabilities:
        o, _ = cls.typed_options(options)
        return Capabilities(
            dtypes=("bfloat16", "float16"), devices=("cuda",), kv_dtypes=KV_DTYPES,
            prefix_caching=o.enable_block_reuse, chunked_prefill=o.enable_chunked_prefill,
            no_cache_mode=False, contiguous_layout=False, continuous_batching=True, paged=True,
            logits=False, scores=True, options=OPTIONS,
        )

    @classmethod
    def check_options(cls, options: dict[str, Any], model: ModelSpec) -> list[str]:
        return check_problems(options, model)

    def __init__(self) -> None:
        self._llm = None
        self._streamer: Streamer | None = None
        self._live: list[Stream] = []
        self._gen = 0
        self._kv_stats: dict[str, Any] = {}
        self._iter_latency_ms: dict[int, float] = {}
        self._perf: list[dict[str, Any]] = []
        self._consumed = 0  # tokens of each live sequence handed out so far
        self._anchor_ns = 0  # where the next decode step starts (engine clock path)
        self._batch_first_iter: int | None = None
        self._clock_offset_ns: int | None = None
        self._clocks: dict[str, str] = {}  # operation -> clock its last call used
        self._admission: str = "not run"

    # ---- life cycle --------------------------------------------------------------------
    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo:
        reason = self.unavailable_reason()
        if reason:
            raise EngineUnavailable(reason)
        self.options = typed(options)
        self.model_spec = model
        t_import = time.perf_counter()
        from tensorrt_llm import LLM, SamplingParams  # heavy, optional: only when the engine is used
        from tensorrt_llm.llmapi import KvCacheConfig
        self._SamplingParams = SamplingParams
        import_s = time.perf_counter() - t_import
        kwargs = llm_kwargs(model, self.options)
        shown = dict(kwargs)
        kwargs["kv_cache_config"] = KvCacheConfig(**kwargs["kv_cache_config"])
        if "scheduler_config" in kwargs:
            from tensorrt_llm.llmapi import CapacitySchedulerPolicy, SchedulerConfig
            kwargs["scheduler_config"] = SchedulerConfig(
                capacity_scheduler_policy=CapacitySchedulerPolicy[kwargs["scheduler_config"]])
        t0 = time.perf_counter()
        self._llm = LLM(**kwargs)
        load_s = time.perf_counter() - t0
        self._streamer = Streamer()
        self.max_seq_len = int(model.max_model_len)
        self.end_id = end_id_of(model.path)
        self._limits = self._engine_limits()
        self._clock_offset_ns, how = steady_clock_offset_ns()
        info = self.kv_cache_info()
        return LoadInfo(load_time_s=load_s, weights_bytes=None, kv_pool_bytes=info.pool_bytes,
                        engine_version=self.version(),
                        details={"import_s": import_s, "written_against": VERSION_CHECKED,
                                 "llm_args": shown | {"model": None}, "limits": dict(self._limits),
                                 "clock": self._clock_policy(), "clock_offset_ns": self._clock_offset_ns,
                                 "clock_offset_how": how, "stats": "LLM.get_stats_async on the adapter's loop"})

    def _clock_policy(self) -> str:
        if self._clock_offset_ns is None:
            return "arrival: the harness clock when tokens reached this process (TensorRT-LLM's clock unavailable)"
        return ("tensorrt-llm: prefill ends at the requests' first_token_time, decode steps last their "
                "iteration's iterLatencyMS (steady clock + measured offset); arrival in this process where "
                "TensorRT-LLM does not report them, and for serve()")

    def _engine_limits(self) -> dict[str, int | None]:
        """max_batch_size / max_num_tokens as the engine resolved them (LLM.args), or the options."""
        args = getattr(self._llm, "args", None)
        out = {}
        for k in ("max_batch_size", "max_num_tokens"):
            v = getattr(args, k, None)
            out[k] = int(v) if isinstance(v, int) else getattr(self.options, k)
        return out

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
    def _params(self, max_tokens: int, **extra: Any):
        return self._SamplingParams(**sampling_kwargs(max_tokens, self.end_id), **extra)

    def _submit(self, ids: list[int], max_tokens: int, key: str) -> Stream:
        assert self._streamer is not None
        return self._streamer.submit(self._llm, list(ids), self._params(max_tokens), key)

    def _check_batch(self, prompts: list[list[int]], max_new_tokens: int | None) -> None:
        if not prompts:
            raise ValueError("prefill() needs at least one prompt")
        if max_new_tokens is not None and not is_pos_int(max_new_tokens):
            raise ValueError(f"prefill(max_new_tokens={max_new_tokens}): must be a positive integer or None")
        need = max_new_tokens or 1
        for i, p in enumerate(prompts):
            if not p or len(p) + need > self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens and {need} output tokens were asked for; "
                                 f"max_seq_len={self.max_seq_len}.")
        most, budget = self._limits.get("max_batch_size"), self._limits.get("max_num_tokens")
        if most and len(prompts) > most:
            raise ValueError(f"a batch of {len(prompts)} sequences is more than {_PREFIX}max_batch_size={most}: "
                             f"TensorRT-LLM would admit it over several iterations. Set {_PREFIX}max_batch_size>="
                             f"{len(prompts)}.")
        total = sum(len(p) for p in prompts)
        if budget and not self.options.enable_chunked_prefill and total > budget:
            raise ValueError(f"this batch has {total} prompt tokens, more than {_PREFIX}max_num_tokens={budget}: "
                             f"TensorRT-LLM would prefill it over several iterations. Set {_PREFIX}max_num_tokens>="
                             f"{total}.")

    def prefill(self, prompts: list[list[int]], return_logits: bool = False,
                max_new_tokens: int | None = None) -> PrefillResult:
        if return_logits:
            raise NotImplementedError("the TensorRT-LLM adapter does not return logits")
        self.release()
        self._check_batch(prompts, max_new_tokens)
        self._gen += 1
        start = now_ns()
        self._live = self._streamer.submit_batch(self._llm, [
            (list(p), self._params(max_new_tokens if max_new_tokens is not None else self.max_seq_len - len(p)),
             f"b{self._gen}-{i}") for i, p in enumerate(prompts)])
        self._streamer.wait_for(self._live, 1)
        first_iters = [s.first_iter for s in self._live]
        problem = timing.admission_problem(first_iters, _ADMISSION_HINT)
        if problem:
            self.release()
            raise RuntimeError(problem)
        self._admission = "one iteration" if timing.admission_checked(first_iters) else \
            "not checked: TensorRT-LLM reported no first_iter"
        self._batch_first_iter = first_iters[0] if timing.admission_checked(first_iters) else None
        end = max(s.times[0] for s in self._live)
        clock = timing.CLOCK_ARRIVAL
        firsts = [timing.perf_fields(s.perf).get("first_token_time") for s in self._live]
        if self._clock_offset_ns is not None and all(t is not None for t in firsts):
            engine_end = timing.to_harness_ns(max(firsts), self._clock_offset_ns)
            if start <= engine_end <= end:  # the engine's stamp lies between submission and arrival
                end, clock = engine_end, timing.CLOCK_ENGINE
        self._clocks["prefill"] = clock
        self._anchor_ns = end
        self._consumed = 1
        return PrefillResult([s.tokens[0] for s in self._live], start, end)

    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult:
        if return_logits:
            raise NotImplementedError("the TensorRT-LLM adapter does not return logits")
        if not self._live:
            raise RuntimeError("decode() before prefill()")
        k = self._consumed
        self._streamer.wait_for(self._live, k + steps)
        tokens = [[s.tokens[i] for s in self._live] for i in range(k, k + steps)]
        timings = None
        if self._batch_first_iter is not None and all(
                timing.iteration_mapping_holds(s.first_iter, s.iters) for s in self._live):
            self._poll_stats(until_iter=self._batch_first_iter + k + steps - 1)
            timings = timing.decode_steps_from_iterations(self._iter_latency_ms, self._batch_first_iter, k, steps,
                                                          self._anchor_ns, len(self._live))
        self._clocks["decode"] = timing.CLOCK_ENGINE if timings is not None else timing.CLOCK_ARRIVAL
        if timings is None:
            timings = timing.steps_from_arrivals([s.times for s in self._live], k, steps, len(self._live))
        self._anchor_ns = timings[-1].end_ns
        self._consumed = k + steps
        return DecodeResult(tokens, timings)

    def release(self) -> None:
        if self._live and self._streamer is not None:
            self._streamer.abort(self._live)
        for s in self._live:
            if s.perf is not None:
                self._perf.append(timing.perf_fields(s.perf))
        self._perf = self._perf[-256:]
        self._live = []

    def serve(self, requests: list[Request] | RequestSource, start_ns: int) -> Iterator[TokenEvent]:
        self.release()
        assert self._streamer is not None
        events = self._streamer.events
        while not events.empty():
            events.get_nowait()
        self._gen += 1
        self._clocks["serve"] = timing.CLOCK_ARRIVAL
        source = as_source(requests, start_ns)
        owner: dict[int, Request] = {}
        open_ = 0
        try:
            while not source.exhausted() or open_:
                for r in source.due(now_ns()):
                    s = self._submit(r.prompt_ids, r.max_new_tokens, f"s{self._gen}-{r.request_id}")
                    owner[id(s)] = r
                    self._live.append(s)
                    open_ += 1
                nxt = source.next_due_ns()
                if not open_ and nxt is None:  # nothing runs and nothing can become due
                    break
                timeout = None if nxt is None else max(0.0, (nxt - now_ns()) / 1e9)
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

    # ---- teacher-forced scores ---------------------------------------------------------
    def score(self, sequences: list[list[int]], start: list[int], top_k: int) -> list[TokenScores]:
        import torch
        if len(start) != len(sequences):
            raise ValueError(f"score(): {len(sequences)} sequences but {len(start)} start positions.")
        if not is_pos_int(top_k):
            raise ValueError(f"score(): top_k={top_k} must be a positive integer.")
        for i, (seq, s0) in enumerate(zip(sequences, start)):
            if not 1 <= s0 <= len(seq):
                raise ValueError(f"score(): start[{i}]={s0} must be in [1, {len(seq)}] (position 0 has no context "
                                 "to predict it from).")
            if len(seq) + 1 > self.max_seq_len:
                raise ValueError(f"score(): sequence {i} has {len(seq)} tokens; max_seq_len={self.max_seq_len} "
                                 "needs room for one output token.")
        self.release()
        out = []
        for seq, s0 in zip(sequences, start):
            res = TokenScores([], [], [])
            if s0 < len(seq):
                result = self._streamer.generate(self._llm, list(seq), self._params(1, return_context_logits=True))
                logits = getattr(result, "context_logits", None)
                if logits is None or logits.shape[0] != len(seq):
                    raise RuntimeError(f"TensorRT-LLM returned context logits of shape "
                                       f"{None if logits is None else tuple(logits.shape)} for a sequence of {len(seq)} "
                                       "tokens")
                logp = logits[s0 - 1:len(seq) - 1].float().log_softmax(dim=-1)
                top = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
                target = logp.gather(1, torch.tensor(seq[s0:], device=logp.device)[:, None])[:, 0]
                res = TokenScores(top.indices.tolist(), top.values.tolist(), target.tolist())
            out.append(res)
        return out

    # ---- KV cache and iteration stats ---------------------------------------------------
    def _poll_stats(self, until_iter: int | None = None, wait_s: float = 2.0) -> None:
        """Drain TensorRT-LLM's iteration stats (on the adapter's loop): the newest KV snapshot and
        every iteration's latency. With `until_iter`, keep draining (up to wait_s) until that
        iteration's stats arrived."""
        if self._llm is None or self._streamer is None:
            return
        deadline = time.monotonic() + wait_s
        while True:
            for snap in self._streamer.drain_stats(self._llm):
                if snap.get("kvCacheStats"):
                    self._kv_stats = snap["kvCacheStats"]
                if "iter" in snap and snap.get("iterLatencyMS") is not None:
                    self._iter_latency_ms[int(snap["iter"])] = float(snap["iterLatencyMS"])
            if until_iter is None or until_iter in self._iter_latency_ms or time.monotonic() > deadline:
                return

    def kv_cache_info(self) -> KVCacheInfo:
        if self._llm is None:
            return KVCacheInfo()
        self._poll_stats()
        st = self._kv_stats
        o = self.options
        kv = o.kv_cache_dtype if o.kv_cache_dtype != "auto" else self.model_spec.dtype
        info = KVCacheInfo(kv_dtype=canonical_kv_dtype(kv), block_size=st.get("tokensPerBlock") or o.tokens_per_block)
        info.num_blocks = st.get("maxNumBlocks")
        info.blocks_in_use = st.get("usedNumBlocks")
        reused, missed = st.get("reusedBlocks"), st.get("missedBlocks")
        if reused is not None:
            info.prefix_cache_hits = int(reused)
            info.prefix_cache_queries = int(reused) + int(missed or 0)
        try:  # TensorRT-LLM does not report bytes; computed from the model's shape and the KV dtype
            shape = shape_from_hf_config(self.model_spec.path)
            info.bytes_per_token = bytes_per_token(shape, info.kv_dtype)
            info.bytes_per_block = info.bytes_per_token * info.block_size
            if info.num_blocks is not None:
                info.pool_bytes = info.num_blocks * info.bytes_per_block
        except Exception as e:
            log.warning("TensorRT-LLM: KV bytes not computed from the model's shape: %s", e)
        if info.blocks_in_use is not None:
            info.slots_allocated = info.blocks_in_use * info.block_size
        info.extra = {"prefix_cache_unit": "blocks", "counters": "cumulative since load",
                      "bytes_source": "model shape x KV dtype (TensorRT-LLM reports blocks, not bytes)",
                      "cache_hit_rate": st.get("cacheHitRate"), "clock": dict(self._clocks),
                      "prefill_admission": self._admission, "request_perf_metrics": self._perf[-64:]}
        return info

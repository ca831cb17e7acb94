"""Hugging Face transformers, driven step by step.

Prefill and every decode step are separate forward passes with the library's own KV cache
(`DynamicCache`), so each is timed on its own — `generate()` is not used as a black box.
Batches of unequal prompt lengths are left-padded, with an attention mask and position ids
that skip the padding, exactly as `generate()` does it.

Options (`engine_options.hf.<name>`): HFOptions below (conf/engine/hf.yaml is generated from it).

serve() is static batching — what plain transformers offers: it takes every request that has
arrived, runs the batch to completion, then takes the next.

Speculative decoding (`speculative_method` ngram | draft) is transformers' own assisted
generation: decode() hands the sequence and its KV cache to `generate()` with
`prompt_lookup_num_tokens` (ngram) or `assistant_model` (draft), and a streamer stamps every
iteration (draft, then one verifying forward pass of the target) as one step. transformers 5.x
runs it at batch 1 only (`_assisted_decoding` raises "assisted generate is only supported for
batch_size = 1"): Capabilities.speculative_max_batch = 1, serve() takes one request at a time.
How the settings are made equal to the other engines', the counters and the two patches on the
loaded model: docs/engines/hf.md.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from adapters.base import (
    Capabilities, DecodeResult, Engine, KVCacheInfo, LoadInfo, ModelSpec, PrefillResult, Request,
    RequestSource, SpecDecodeStats, StepTiming, TokenEvent, TokenScores, as_source, now_ns, option_names, wait_until,
)
from adapters.speculative import SpecCounter, option_problems
from harness.core.constraints import KINDS as STRUCTURED_KINDS
from harness.core.errors import UserError
from harness.core.kvcalc import canonical_kv_dtype
from harness.core.presets import shape_from_hf_config
from harness.core.schema import spec



@dataclass
class HFOptions:
    """Hugging Face transformers, stepped forward pass by forward pass (adapters/hf.py)."""

    attn_implementation: str = spec("sdpa", choices=("sdpa", "eager"), help="sdpa | eager")
    kv_cache: str = spec("on", choices=("on", "none"), help=(
        "on | none (no cache: every step recomputes the whole sequence, the \"without KV cache\" mode)"))
    max_batch_size: int = spec(64, ge=1, tune=[4, 8, 16, 32, 64], help="serve(): static batches of at most this many requests")
    num_threads: int | None = spec(None, ge=1, help=(
        "torch CPU threads; null = the run's equal share (ModelSpec.threads), else torch's default"))
    # speculative decoding (adapters.base.STANDARD_OPTIONS): transformers' assisted generation, batch 1 only
    speculative_method: str = spec("none", choices=("none", "ngram", "draft"), help=(
        "none | ngram (prompt_lookup_num_tokens) | draft (assistant_model); greedy verification, batch 1 only"))
    num_speculative_tokens: int | None = spec(None, ge=1, help=(
        "k, tokens proposed per step: num_assistant_tokens on a constant schedule (draft), "
        "prompt_lookup_num_tokens (ngram)"))
    draft_model: str | None = spec(None, help="method draft: the draft's checkpoint directory (the assistant_model)")
    prompt_lookup_min: int | None = spec(None, ge=1, help=(
        "method ngram: shortest n-gram matched; null = 1 (transformers' own); above 1 the adapter drops "
        "transformers' shorter matches"))
    prompt_lookup_max: int | None = spec(None, ge=1, help=(
        "method ngram: longest n-gram matched (transformers' max_matching_ngram_size); null = 2 (its default)"))
    # LoRA adapters (adapters.base.STANDARD_OPTIONS): PEFT, every adapter loaded at load() and kept
    lora_adapters: list[Any] | None = spec(None, help=(
        "LoRA adapters [{name, path, rank}]: PEFT loads each; a batch mixes them per row (PEFT's adapter_names)"))
    max_loras: int | None = spec(None, ge=1, help="accepted and recorded; PEFT keeps every adapter loaded (no slots)")
    max_lora_rank: int | None = spec(None, ge=1, help="an adapter of a higher rank is refused")
    max_cpu_loras: int | None = spec(None, ge=1, help="accepted and recorded; does not apply to PEFT")


OPTIONS = option_names(HFOptions)
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
SPEC_METHODS = ("ngram", "draft")
BATCH_ONE = ("transformers' assisted generation runs at batch 1 only (its _assisted_decoding raises \"assisted "
             "generate is only supported for batch_size = 1\")")
PEFT_BASE = "__base__"  # PEFT's adapter_names entry for a row served by the base model


class HFEngine(Engine):
    name = "hf"
    options_cls = HFOptions

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("transformers") is None:
            return "transformers is not installed: pip install transformers"
        return None

    @classmethod
    def version(cls) -> str | None:
        return metadata.version("transformers")

    @classmethod
    def capabilities(cls, options: dict[str, Any] | None = None) -> Capabilities:
        peft = importlib.util.find_spec("peft") is not None
        return Capabilities(kv_dtypes=("auto",), no_cache_mode=True, logits=True, scores=True,
                            speculative_methods=SPEC_METHODS, speculative_max_batch=1, options=OPTIONS,
                            lora=peft, lora_slots=False, lora_mixed_batch=peft,
                            structured_output=STRUCTURED_KINDS,
                            lora_unsupported=None if peft else "peft is not installed here: pip install peft")

    @classmethod
    def check_options(cls, options: dict[str, Any], model: ModelSpec) -> list[str]:
        opts, problems = cls.typed_options(options)
        if problems:
            return problems
        problems = option_problems(cls.name, opts, SPEC_METHODS, model.path or None)
        if opts.speculative_method != "none" and opts.kv_cache == "none":
            problems.append("engine_options.hf.kv_cache=none: transformers' assisted generation needs a KV cache; "
                            "use kv_cache=on with speculative_method=" + opts.speculative_method + ".")
        if opts.lora_adapters and opts.speculative_method != "none":
            problems.append("engine_options.hf.lora_adapters with speculative_method=" + opts.speculative_method +
                            ": transformers' assisted generation is not run with PEFT adapters here; use one or the other.")
        for a in opts.lora_adapters or []:
            if opts.max_lora_rank is not None and int(a.get("rank") or 0) > opts.max_lora_rank:
                problems.append(f"engine_options.hf.max_lora_rank={opts.max_lora_rank}: adapter '{a.get('name')}' has "
                                f"rank {a.get('rank')}. Raise max_lora_rank.")
        return problems

    def __init__(self) -> None:
        self.model = None
        self._cache = None
        self._layer_kinds: tuple[str, ...] | None = None
        self._mask = None  # [B, T] attention mask of the live batch
        self._next_pos = None  # [B, 1] position id of the next token
        self._last = None  # [B, 1] last token of every live sequence
        self._ids = None  # [B, T] all tokens so far (used without a cache)
        self._pad_id = 0
        self.spec = None  # HFOptions when speculating, else None
        self.draft = None  # the assistant model (method draft)
        self._seq: list[int] | None = None  # the live sequence's tokens (speculating: batch 1)
        self._counter = SpecCounter()
        self.lora: list[str] = []  # the PEFT adapters loaded (names)
        self._adapter_names: list[str] | None = None  # the live batch's adapter per row (PEFT's adapter_names)
        self._grammars: Any = None  # structured output's compiler (harness.core.constraints.Grammars), on first use

    # ---- life cycle --------------------------------------------------------------------
    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = torch.device(model.device)
        opts, problems = self.typed_options(options)
        problems = problems or self.check_options(options, model)
        if problems:
            raise ValueError(" ".join(problems))
        self.use_cache = opts.kv_cache != "none"
        self.max_batch_size = opts.max_batch_size
        threads = opts.num_threads or model.threads
        if threads:
            torch.set_num_threads(int(threads))
        t0 = time.perf_counter()
        attn, self.attn_note = opts.attn_implementation, None
        try:
            loaded = AutoModelForCausalLM.from_pretrained(model.path, dtype=getattr(torch, _DTYPES[model.dtype]),
                                                          attn_implementation=attn)
        except ValueError as e:  # gpt-oss (its sinks) has no SDPA path in transformers: its own eager one
            if attn != "sdpa" or "does not support an attention implementation" not in str(e):
                raise
            self.attn_note = f"sdpa: {str(e).splitlines()[0][:160]}; ran eager"
            attn = "eager"
            loaded = AutoModelForCausalLM.from_pretrained(model.path, dtype=getattr(torch, _DTYPES[model.dtype]),
                                                          attn_implementation=attn)
        self.model = loaded.to(self.device).eval()
        self.model_path = model.path
        self._sync()
        cfg = self.model.config
        self._pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.kv_dtype = model.dtype
        try:  # each layer's kind, for the per-group report (a family the reader refuses: no groups)
            self._layer_kinds = shape_from_hf_config(model.path).layer_kinds()
        except UserError:
            self._layer_kinds = None
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        details: dict[str, Any] = {"attn_implementation": attn, **({"attn_note": self.attn_note} if self.attn_note else {})}
        if opts.speculative_method != "none":
            details["speculative"] = self._start_speculating(opts, model, attn)
        if opts.lora_adapters:
            details["lora"] = self._load_adapters(opts)
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return LoadInfo(load_time_s=time.perf_counter() - t0, weights_bytes=weights,
                        kv_pool_bytes=None, engine_version=self.version(), compute_threads=torch.get_num_threads(),
                        details=details)

    def _load_adapters(self, opts: HFOptions) -> dict[str, Any]:
        """Wrap the model in PEFT and load every adapter (each keeps its name); a batch's rows then
        name theirs with PEFT's `adapter_names` (the base model: PEFT_BASE)."""
        from peft import PeftModel
        first, *rest = opts.lora_adapters
        self.model = PeftModel.from_pretrained(self.model, first["path"], adapter_name=first["name"]).eval()
        for a in rest:
            self.model.load_adapter(a["path"], adapter_name=a["name"])
        self.lora = [a["name"] for a in opts.lora_adapters]
        self._sync()
        return {"adapters": list(self.lora), "library": f"peft {metadata.version('peft')}",
                "mixed_batch": "PEFT adapter_names: each row of a batch through its own adapter (the base model: "
                               f"{PEFT_BASE})",
                "max_loras": f"{opts.max_loras} asked; does not apply: PEFT keeps every adapter loaded, no slots",
                "max_cpu_loras": "does not apply to PEFT"}

    def lora_stats(self) -> dict[str, Any] | None:
        if not self.lora:
            return None
        return {"loads": len(self.lora), "evictions": 0, "max_loras": None, "resident": list(self.lora),
                "source": "transformers (PEFT): every adapter loaded at load() and kept; none swapped"}

    def _names(self, adapters: list[str | None] | None, n: int) -> list[str] | None:
        """PEFT's adapter_names for a batch of n rows (None without adapters loaded)."""
        if not self.lora:
            if adapters and any(a is not None for a in adapters):
                raise ValueError(f"hf: a request names adapter {next(a for a in adapters if a)} but no LoRA adapter "
                                 "is loaded (engine_options.hf.lora_adapters)")
            return None
        names = [a if a is not None else PEFT_BASE for a in (adapters or [None] * n)]
        unknown = sorted({a for a in names if a != PEFT_BASE and a not in self.lora})
        if unknown:
            raise ValueError(f"hf: adapter(s) {', '.join(unknown)} not loaded (loaded: {', '.join(self.lora)})")
        return names

    # ---- speculative decoding: transformers' assisted generation ----------------------------
    def _start_speculating(self, opts: HFOptions, model: ModelSpec, attn: str) -> dict[str, Any]:
        """Load the draft (method draft), make generate() plain greedy, and put our two patches on
        the loaded model (docs/engines/hf.md): resuming from our prefilled cache, and counting
        what its candidate generator proposed and the target accepted. Returns the settings in
        transformers' own terms, for LoadInfo.details."""
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.spec, self._counter = opts, SpecCounter()
        k = int(opts.num_speculative_tokens)
        # the checkpoint's generation_config.json (sampling, EOS, penalties) would fill every unset
        # field of generate()'s config: plain greedy without EOS instead, as the step path decodes
        self.model.generation_config = GenerationConfig(do_sample=False, num_beams=1, eos_token_id=None,
                                                        pad_token_id=self._pad_id)
        settings: dict[str, Any] = {"method": opts.speculative_method, "num_speculative_tokens": k}
        if opts.speculative_method == "draft":
            dtype = getattr(self.torch, _DTYPES[model.dtype])
            self.draft = AutoModelForCausalLM.from_pretrained(opts.draft_model, dtype=dtype,
                                                              attn_implementation=attn).to(self.device).eval()
            # read by transformers' AssistedCandidateGenerator from the assistant's own config: k tokens
            # every step (a "heuristic" schedule changes k as it goes, a confidence threshold stops early)
            self.draft.generation_config = GenerationConfig(
                do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=self._pad_id,
                num_assistant_tokens=k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
            settings.update(draft_model=str(opts.draft_model), assistant_model=type(self.draft).__name__,
                            num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                            assistant_confidence_threshold=0.0,
                            draft_weights_bytes=sum(p.numel() * p.element_size() for p in self.draft.parameters()))
        else:
            settings.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=self._ngram_max(),
                            prompt_lookup_min=self._ngram_min(), prompt_lookup_max=self._ngram_max())
        self._patch_for_speculation()
        return settings

    def _ngram_max(self) -> int:
        return int(self.spec.prompt_lookup_max or 2)  # transformers' max_matching_ngram_size default

    def _ngram_min(self) -> int:
        return int(self.spec.prompt_lookup_min or 1)  # transformers matches down to one token

    def _patch_for_speculation(self) -> None:
        """Two instance attributes on the loaded model, nothing global:

        - prepare_inputs_for_generation: transformers 5.25's `_assisted_decoding` feeds the whole
          sequence to the target in its first iteration even when the cache passed in holds all
          of it but the last token (since transformers PR #44130 the slicing lives in `_prefill`,
          which assisted decoding does not call): the cache would get the prompt twice. The
          wrapper slices the first iteration's input to what the cache lacks, as `_prefill` does.
        - _get_candidate_generator: wraps the generator transformers picks in `_CountedCandidates`
          (counts, times, prompt_lookup_min)."""
        model = self.model
        prepare = model.prepare_inputs_for_generation

        @functools.wraps(prepare)
        def resume_from_cache(input_ids, *args, next_sequence_length=None, cache=None, is_first_iteration=False,
                              **kwargs):
            if is_first_iteration and next_sequence_length is None and cache is not None:
                held = int(cache.get_seq_length())
                if 0 < held < input_ids.shape[1]:
                    next_sequence_length = input_ids.shape[1] - held
            return prepare(input_ids, *args, next_sequence_length=next_sequence_length, cache=cache,
                           is_first_iteration=is_first_iteration, **kwargs)

        make = model._get_candidate_generator

        @functools.wraps(make)
        def counted(*args, **kwargs):
            min_ngram = self._ngram_min() if self.spec.speculative_method == "ngram" else 1
            return _CountedCandidates(make(*args, **kwargs), self._counter, self._sync, min_ngram)

        model.prepare_inputs_for_generation = resume_from_cache
        model._get_candidate_generator = counted

    def _generation_config(self, steps: int) -> Any:
        from transformers import GenerationConfig
        gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=steps, eos_token_id=None,
                              pad_token_id=self._pad_id, use_cache=True, return_dict_in_generate=True)
        if self.spec.speculative_method == "ngram":
            gc.prompt_lookup_num_tokens = int(self.spec.num_speculative_tokens)
            gc.max_matching_ngram_size = self._ngram_max()
        return gc

    def _spec_decode(self, steps: int, return_logits: bool) -> DecodeResult:
        """One generate() call for all `steps` tokens; every iteration of transformers' assisted
        loop (draft, verify, accept) is one step, stamped when it hands its tokens to the streamer.
        The first step's span starts at the call (generate()'s set-up, and with a draft model the
        assistant's prefill of the sequence so far, fall in it)."""
        if return_logits:
            raise NotImplementedError("hf: logits are not returned while speculating (transformers' assisted "
                                      "generation emits several tokens per step)")
        if steps <= 0:
            return DecodeResult([], [], emitted=[])
        torch = self.torch
        ids = torch.tensor([self._seq], dtype=torch.long, device=self.device)
        clock = _StepClock(self._sync)
        extra = {"assistant_model": self.draft} if self.draft is not None else {}
        self._sync()
        start = now_ns()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=self._cache,
                                      generation_config=self._generation_config(steps), streamer=clock, **extra)
        new = [t for chunk in clock.chunks for t in chunk]
        if new != out.sequences[0, ids.shape[1]:].tolist() or len(new) != steps:
            raise RuntimeError(f"transformers' assisted generation gave {len(new)} tokens for {steps} asked "
                               "(or its streamer and its output disagree)")
        timings, emitted, prev = [], [], start
        for t, chunk in zip(clock.times, clock.chunks):
            timings.append(StepTiming(prev, t, len(chunk)))
            emitted.append([len(chunk)])
            prev = t
        self._cache = out.cache
        self._seq += new
        # the cache holds every token but the newest, as after a plain decode step
        held = len(self._seq) - 1
        if int(self._cache.get_seq_length()) != held:
            raise RuntimeError(f"after assisted generation the KV cache holds {int(self._cache.get_seq_length())} "
                               f"tokens; {held} expected")
        self._mask = torch.ones((1, held), dtype=torch.long, device=self.device)
        self._last = torch.tensor([[self._seq[-1]]], dtype=torch.long, device=self.device)
        self._next_pos = torch.tensor([[held]], dtype=torch.long, device=self.device)
        return DecodeResult([[t] for t in new], timings, None, emitted)

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        if self.spec is None:
            return None
        return self._counter.stats(int(self.spec.num_speculative_tokens))

    def close(self) -> None:
        self.release()
        self.model = self.draft = self.spec = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    # ---- offline path ------------------------------------------------------------------
    def _forward(self, ids, mask, pos, cache):
        lora = {"adapter_names": self._adapter_names} if self._adapter_names is not None else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         past_key_values=cache, use_cache=cache is not None, logits_to_keep=1, **lora)
        return out.logits[:, -1, :]

    def prefill(self, prompts: list[list[int]], return_logits: bool = False,
                max_new_tokens: int | None = None, adapters: list[str | None] | None = None) -> PrefillResult:
        """`adapters` (this adapter's own argument, for serve()): each row's LoRA adapter, None the base model."""
        torch = self.torch
        from transformers import DynamicCache

        self.release()
        self._adapter_names = self._names(adapters, len(prompts))
        if self.spec is not None and len(prompts) > 1:
            raise ValueError(f"hf: a batch of {len(prompts)} sequences with speculative_method="
                             f"{self.spec.speculative_method}: {BATCH_ONE}.")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding
            ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config) if self.use_cache else None
        self._sync()
        start = now_ns()
        with torch.inference_mode():
            logits = self._forward(ids, mask, pos, cache)
            nxt = logits.argmax(-1, keepdim=True)
        first = nxt[:, 0].tolist()  # a host copy: the step is finished
        self._sync()
        end = now_ns()
        self._cache, self._mask, self._last = cache, mask, nxt
        self._next_pos = pos[:, -1:] + 1
        self._ids = torch.cat([ids, nxt], dim=1) if not self.use_cache else None
        self._seq = list(prompts[0]) + first if self.spec is not None else None
        return PrefillResult(first, start, end, logits.float().cpu() if return_logits else None)

    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult:
        torch = self.torch
        if self._last is None:
            raise RuntimeError("decode() before prefill()")
        if self.spec is not None:
            return self._spec_decode(steps, return_logits)
        tokens, timings, all_logits = [], [], []
        ones = torch.ones((self._mask.shape[0], 1), dtype=self._mask.dtype, device=self.device)
        for _ in range(steps):
            self._sync()
            start = now_ns()
            with torch.inference_mode():
                self._mask = torch.cat([self._mask, ones], dim=1)
                if self.use_cache:
                    logits = self._forward(self._last, self._mask, self._next_pos, self._cache)
                else:  # recompute the whole sequence: prompt + every token so far
                    pos = (self._mask.cumsum(-1) - 1).clamp(min=0)
                    logits = self._forward(self._ids, self._mask, pos, None)
                nxt = logits.argmax(-1, keepdim=True)
            row = nxt[:, 0].tolist()
            self._sync()
            end = now_ns()
            if not self.use_cache:
                self._ids = torch.cat([self._ids, nxt], dim=1)
            self._last, self._next_pos = nxt, self._next_pos + 1
            tokens.append(row)
            timings.append(StepTiming(start, end, len(row)))
            if return_logits:
                all_logits.append(logits.float().cpu())
        return DecodeResult(tokens, timings, all_logits if return_logits else None)

    def release(self) -> None:
        self._cache = self._mask = self._next_pos = self._last = self._ids = self._seq = None
        self._adapter_names = None

    # ---- teacher-forced scores (parity) ------------------------------------------------------
    def score(self, sequences: list[list[int]], start: list[int], top_k: int,
              adapter: str | None = None) -> list[TokenScores]:
        """One forward pass over the left-padded batch, logits kept for every position."""
        torch = self.torch
        self.release()
        names = self._names([adapter] * len(sequences), len(sequences))
        lora = {"adapter_names": names} if names is not None else {}
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for b, seq in enumerate(sequences):
            ids[b, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[b, width - len(seq):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **lora).logits
            logp = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for b, (seq, s0) in enumerate(zip(sequences, start)):
            pad = width - len(seq)
            rows = logp[b, pad + s0 - 1: pad + len(seq) - 1]  # column c predicts token c + 1
            top = rows.topk(top_k, dim=-1)
            target = rows.gather(-1, torch.tensor(seq[s0:], device=rows.device).unsqueeze(-1)).squeeze(-1)
            out.append(TokenScores(top.indices.tolist(), top.values.tolist(), target.tolist()))
        return out

    # ---- serving: static batches ---------------------------------------------------------
    def serve(self, requests: list[Request] | RequestSource, start_ns: int) -> Iterator[TokenEvent]:
        source = as_source(requests, start_ns)
        waiting: list[Request] = []
        while True:
            waiting += source.due(now_ns())
            if not waiting:
                nxt = source.next_due_ns()
                if source.exhausted() or nxt is None:
                    return
                wait_until(nxt)
                continue
            size = 1 if self.spec is not None else self.max_batch_size  # assisted generation: batch 1
            if any(r.constraint is not None for r in waiting):  # structured output: constrained batches apart
                batch = [r for r in waiting if r.constraint is not None][:size]
                waiting = [r for r in waiting if r not in batch]
                yield from self._serve_constrained(batch)
                continue
            batch, waiting = waiting[:size], waiting[size:]
            pre = self.prefill([r.prompt_ids for r in batch], adapters=[r.adapter for r in batch])
            for r, tok in zip(batch, pre.first_tokens):
                yield TokenEvent(r.request_id, 0, tok, pre.end_ns, finished=r.max_new_tokens <= 1)
            longest = max(r.max_new_tokens for r in batch)
            if self.spec is not None:  # one generate() call; a step's tokens share its stamp
                (r,) = batch
                res = self.decode(longest - 1)
                index = 1
                for step, (counts,) in zip(res.steps, res.emitted):
                    for _ in range(counts):
                        yield TokenEvent(r.request_id, index, res.tokens[index - 1][0], step.end_ns,
                                         finished=index == r.max_new_tokens - 1)
                        index += 1
                self.release()
                continue
            for step in range(1, longest):
                res = self.decode(1)
                for r, tok in zip(batch, res.tokens[0]):
                    if step < r.max_new_tokens:
                        yield TokenEvent(r.request_id, step, tok, res.steps[0].end_ns,
                                         finished=step == r.max_new_tokens - 1)
            self.release()

    def _serve_constrained(self, batch: list[Request]) -> Iterator[TokenEvent]:
        """Structured output: a batch of constrained requests through xgrammar's transformers
        logits processor (xgrammar.contrib.hf.LogitsProcessor, one grammar per row: it accepts each
        row's last token and masks its next logits with the grammar's token bitmask), greedy over
        the masked logits; a row ends at the stop token (its grammar complete) or its max tokens."""
        from xgrammar.contrib.hf import LogitsProcessor
        if self.spec is not None:
            raise ValueError("hf: a constraint (structured output) with speculative decoding: transformers' "
                             "assisted generation is not run with a grammar here; use speculative_method=none.")
        if self._grammars is None:
            from harness.core.constraints import Grammars
            self._grammars = Grammars(self.model_path, int(self.model.config.vocab_size))
        proc = LogitsProcessor([self._grammars.compiled_for(r.constraint) for r in batch])
        stop = self._grammars.eos_token_id
        pre = self.prefill([r.prompt_ids for r in batch], return_logits=True, adapters=[r.adapter for r in batch])
        last = self._last  # the processor is shown each row's last token: prefill's is not one yet
        toks, last = self._masked_next(proc, last, pre.logits)
        t, live = now_ns(), [True] * len(batch)
        for step in range(max(r.max_new_tokens for r in batch)):
            if step:
                res = self.decode(1, return_logits=True)  # fed `last`; its own argmax is replaced below
                toks, last = self._masked_next(proc, last, res.logits[0])
                t = now_ns()
            for i, (r, tok) in enumerate(zip(batch, toks)):
                if live[i] and step < r.max_new_tokens:
                    live[i] = tok != stop and step < r.max_new_tokens - 1
                    yield TokenEvent(r.request_id, step, tok, t, finished=not live[i])
            if not any(live):
                break
        self.release()

    def _masked_next(self, proc: Any, last: Any, logits: Any) -> tuple[list[int], Any]:
        """(the greedy tokens over `logits` [B, vocab] masked by the processor's grammars, as a
        [B, 1] tensor too); the processor first accepts `last`, each row's previous token. They
        replace the unmasked ones prefill()/decode() took as each row's last token."""
        nxt = proc(last, logits.float().clone()).argmax(-1)
        self._last = nxt.view(-1, 1).to(self.device)
        if self._ids is not None:  # without a cache the whole sequence is fed again: its last token too
            self._ids[:, -1:] = self._last
        return [int(x) for x in nxt.tolist()], self._last

    def kv_cache_info(self) -> KVCacheInfo:
        info = KVCacheInfo(kv_dtype=canonical_kv_dtype(self.kv_dtype) if self.model else None,
                           block_size=None, num_blocks=None, prefix_cache_hits=None)
        if self._cache is None:
            info.pool_bytes, info.tokens_stored, info.slots_allocated = 0, 0, 0
            return info
        nbytes = 0
        for layer in self._cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if t is not None:
                    nbytes += t.numel() * t.element_size()
        length = int(self._cache.get_seq_length())  # some caches (Qwen3-Next's hybrid one) give a 0-d tensor
        batch = self._mask.shape[0]
        info.pool_bytes = nbytes
        info.slots_allocated = batch * length
        # tokens whose K/V are real (not left padding); the newest token is not cached yet
        info.tokens_stored = int(self._mask[:, :length].sum())
        if info.slots_allocated:
            info.bytes_per_token = nbytes // info.slots_allocated
        if self._layer_kinds is not None:
            info.extra["groups"] = cache_groups(self._cache, self._layer_kinds, batch)
        return info


class _StepClock:
    """A transformers streamer (generate(streamer=...) calls put() with the prompt first, then
    once per iteration with the tokens it accepted) that stamps every iteration."""

    def __init__(self, sync: Any) -> None:
        self._sync = sync
        self._prompt_seen = False
        self.times: list[int] = []
        self.chunks: list[list[int]] = []

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self._sync()
        self.times.append(now_ns())
        self.chunks.append([int(t) for t in value.reshape(-1).tolist()])

    def end(self) -> None:
        pass


class _CountedCandidates:
    """transformers' candidate generator (AssistedCandidateGenerator for a draft model,
    PromptLookupCandidateGenerator for n-grams), wrapped: every attribute is the wrapped one's,
    and the two calls `_assisted_decoding` makes per iteration are counted and timed.

    - get_candidates(input_ids) returns the sequence with the proposed tokens appended: proposed
      = its length minus the input's. Its time is the draft time.
    - update_candidate_strategy(input_ids, scores, num_matches) follows the verifying pass:
      num_matches is the accepted count (after transformers' crop at the length limit). The time
      between the two calls is the verify time (the target's pass, the comparison, the cache crop).
    - prompt_lookup_min: transformers matches n-grams from max_matching_ngram_size down to one
      token. It takes the longest size that occurs earlier with a continuation, so its match is
      at least `min_ngram` long exactly when the sequence's last `min_ngram` tokens occur earlier;
      when they do not, this returns no candidates (a plain decode step, as vLLM does)."""

    def __init__(self, inner: Any, counter: SpecCounter, sync: Any, min_ngram: int = 1) -> None:
        self._inner, self._counter, self._sync, self._min_ngram = inner, counter, sync, min_ngram
        self._proposed = 0
        self._verify_start = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_candidates(self, input_ids: Any, **kwargs: Any) -> Any:
        self._sync()
        t0 = time.perf_counter()
        if self._min_ngram > 1 and not _suffix_occurs_earlier(input_ids[0], self._min_ngram):
            out = (input_ids, None)
        else:
            out = self._inner.get_candidates(input_ids, **kwargs)
        self._sync()
        t1 = time.perf_counter()
        self._proposed = int(out[0].shape[-1] - input_ids.shape[-1])
        self._counter.draft_time_s += t1 - t0
        self._verify_start = t1
        return out

    def update_candidate_strategy(self, input_ids: Any, scores: Any, num_matches: Any) -> Any:
        self._counter.verify_time_s += time.perf_counter() - self._verify_start
        self._counter.observe(self._proposed, int(num_matches))
        return self._inner.update_candidate_strategy(input_ids, scores, num_matches)


def _suffix_occurs_earlier(ids: Any, n: int) -> bool:
    """Whether the last n tokens of the 1-D tensor `ids` occur at an earlier start, followed by at
    least one token (windows of ids[:-1]: the suffix itself is not among them)."""
    if ids.shape[0] <= n:
        return False
    return bool((ids[:-1].unfold(0, n, 1) == ids[-n:]).all(-1).any())


def cache_groups(cache: Any, kinds: tuple[str, ...], batch: int) -> list[dict[str, Any]]:
    """What transformers' cache holds, by layer kind (harness.core.kvcalc's groups): the layers,
    the token slots one layer holds per sequence (its keys' length: a sliding layer keeps W - 1),
    bytes per cached token over the group's layers, and a linear layer's state bytes per sequence
    (conv + recurrent)."""
    out: dict[str, dict[str, Any]] = {}
    for kind, layer in zip(kinds, cache.layers):
        g = out.setdefault(kind, {"kind": kind, "layers": 0, "bytes": 0, "tokens_per_sequence": 0,
                                  "bytes_per_token": 0, "state_bytes": 0})
        g["layers"] += 1
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is not None and keys.dim() == 4 and values is not None:
            held = int(keys.shape[-2])
            size = keys.numel() * keys.element_size() + values.numel() * values.element_size()
            g["bytes"] += size
            g["tokens_per_sequence"] = max(g["tokens_per_sequence"], held)
            if held:
                g["bytes_per_token"] += size // (held * batch)
        dtypes = []
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            for t in (states or {}).values():
                if t is not None:
                    g["bytes"] += t.numel() * t.element_size()
                    g["state_bytes"] += t.numel() * t.element_size() // batch
                    dtypes.append(str(t.dtype).removeprefix("torch."))
        if dtypes:
            g["state_dtypes"] = dtypes  # conv, recurrent (transformers keeps the recurrent one in float32)
    return list(out.values())

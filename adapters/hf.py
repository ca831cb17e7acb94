"""Hugging Face transformers, driven step by step.

Prefill and every decode step are separate forward passes with the library's own KV cache
(`DynamicCache`), so each is timed on its own — `generate()` is not used as a black box.
Batches of unequal prompt lengths are left-padded, with an attention mask and position ids
that skip the padding, exactly as `generate()` does it.

Options (`engine_options.hf.<name>`): HFOptions below (conf/engine/hf.yaml is generated from it).

serve() is static batching — what plain transformers offers: it takes every request that has
arrived, runs the batch to completion, then takes the next.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from adapters.base import (
    Capabilities, DecodeResult, Engine, KVCacheInfo, LoadInfo, ModelSpec, PrefillResult, Request,
    RequestSource, StepTiming, TokenEvent, TokenScores, as_source, now_ns, option_names, wait_until,
)
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


OPTIONS = option_names(HFOptions)
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


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
        return Capabilities(kv_dtypes=("auto",), no_cache_mode=True, logits=True, scores=True, options=OPTIONS)

    def __init__(self) -> None:
        self.model = None
        self._cache = None
        self._layer_kinds: tuple[str, ...] | None = None
        self._mask = None  # [B, T] attention mask of the live batch
        self._next_pos = None  # [B, 1] position id of the next token
        self._last = None  # [B, 1] last token of every live sequence
        self._ids = None  # [B, T] all tokens so far (used without a cache)
        self._pad_id = 0

    # ---- life cycle --------------------------------------------------------------------
    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = torch.device(model.device)
        opts, problems = self.typed_options(options)
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
        self._sync()
        cfg = self.model.config
        self._pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.kv_dtype = model.dtype
        try:  # each layer's kind, for the per-group report (a family the reader refuses: no groups)
            self._layer_kinds = shape_from_hf_config(model.path).layer_kinds()
        except UserError:
            self._layer_kinds = None
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return LoadInfo(load_time_s=time.perf_counter() - t0, weights_bytes=weights,
                        kv_pool_bytes=None, engine_version=self.version(), compute_threads=torch.get_num_threads(),
                        details={"attn_implementation": attn, **({"attn_note": self.attn_note} if self.attn_note else {})})

    def close(self) -> None:
        self.release()
        self.model = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    # ---- offline path ------------------------------------------------------------------
    def _forward(self, ids, mask, pos, cache):
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         past_key_values=cache, use_cache=cache is not None, logits_to_keep=1)
        return out.logits[:, -1, :]

    def prefill(self, prompts: list[list[int]], return_logits: bool = False,
                max_new_tokens: int | None = None) -> PrefillResult:
        torch = self.torch
        from transformers import DynamicCache

        self.release()
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
        return PrefillResult(first, start, end, logits.float().cpu() if return_logits else None)

    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult:
        torch = self.torch
        if self._last is None:
            raise RuntimeError("decode() before prefill()")
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
        self._cache = self._mask = self._next_pos = self._last = self._ids = None

    # ---- teacher-forced scores (parity) ------------------------------------------------------
    def score(self, sequences: list[list[int]], start: list[int], top_k: int) -> list[TokenScores]:
        """One forward pass over the left-padded batch, logits kept for every position."""
        torch = self.torch
        self.release()
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for b, seq in enumerate(sequences):
            ids[b, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[b, width - len(seq):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
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
            batch, waiting = waiting[: self.max_batch_size], waiting[self.max_batch_size:]
            pre = self.prefill([r.prompt_ids for r in batch])
            for r, tok in zip(batch, pre.first_tokens):
                yield TokenEvent(r.request_id, 0, tok, pre.end_ns, finished=r.max_new_tokens <= 1)
            longest = max(r.max_new_tokens for r in batch)
            for step in range(1, longest):
                res = self.decode(1)
                for r, tok in zip(batch, res.tokens[0]):
                    if step < r.max_new_tokens:
                        yield TokenEvent(r.request_id, step, tok, res.steps[0].end_ns,
                                         finished=step == r.max_new_tokens - 1)
            self.release()

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

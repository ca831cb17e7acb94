"""Speculative decoding in the in-process adapters: the checks of the standard options
(`adapters.base.STANDARD_OPTIONS`: speculative_method, num_speculative_tokens, draft_model,
prompt_lookup_min / prompt_lookup_max) that every engine shares, and a counter for an adapter
that counts what its engine proposed and accepted itself (SpecDecodeStats source "derived").

Pure: nothing here imports an engine or torch (the harness plans runs without them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapters.base import SpecDecodeStats

METHODS = ("none", "ngram", "draft")  # what the in-process adapters here can be asked for


def _vocab_size(config: dict[str, Any]) -> int | None:
    """config.json's vocabulary size (a multimodal model's text config holds it)."""
    if isinstance(config.get("vocab_size"), int):
        return config["vocab_size"]
    text = config.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("vocab_size"), int):
        return text["vocab_size"]
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _token_table(tokenizer: dict[str, Any]) -> tuple[Any, Any]:
    """What decides the token ids of a tokenizer.json: its model's vocabulary (and merges) and
    the added tokens' ids. Settings such as truncation or padding do not change an id."""
    model = tokenizer.get("model") or {}
    added = sorted((t.get("id"), t.get("content")) for t in tokenizer.get("added_tokens") or [])
    return (model.get("type"), model.get("vocab"), model.get("merges")), added


def draft_problems(engine: str, draft: str, target_path: str | None) -> list[str]:
    """`draft` against the target at `target_path`, one line per problem, naming
    engine_options.<engine>.draft_model and the fix: the directory must be a Hugging Face
    checkpoint whose vocabulary (config.json's vocab_size, and tokenizer.json's token table where
    both ship one) is the target's. A draft with another tokenizer proposes ids that mean other
    words to the target."""
    where = f"engine_options.{engine}.draft_model={draft}"
    path = Path(draft).expanduser()
    if not path.is_dir():
        return [f"{where}: no such checkpoint directory. Give the draft's Hugging Face directory (a preset is "
                "materialised into one by the harness before the engine loads)."]
    cfg = _read_json(path / "config.json")
    if cfg is None:
        return [f"{where}: no readable config.json in it; give a Hugging Face checkpoint directory."]
    if not target_path:
        return []
    target = Path(target_path).expanduser()
    tcfg = _read_json(target / "config.json")
    if tcfg is None:  # the target itself is checked elsewhere
        return []
    dv, tv = _vocab_size(cfg), _vocab_size(tcfg)
    if dv is not None and tv is not None and dv != tv:
        return [f"{where}: its vocabulary has {dv} tokens, the target's {tv}: speculative decoding needs a draft "
                "with the target's tokenizer. Use a draft trained with the target's tokenizer."]
    dtok, ttok = _read_json(path / "tokenizer.json"), _read_json(target / "tokenizer.json")
    if dtok is not None and ttok is not None and _token_table(dtok) != _token_table(ttok):
        return [f"{where}: its tokenizer.json maps tokens to other ids than the target's: speculative decoding "
                "needs a draft with the target's tokenizer. Use a draft trained with the target's tokenizer."]
    return []


def option_problems(engine: str, opts: Any, methods: tuple[str, ...], target_path: str | None,
                    needs_prompt_lookup_max: bool = False) -> list[str]:
    """The standard speculative options of `opts` (an engine's options object with the standard
    field names), each problem naming engine_options.<engine>.<field> and the fix. `methods`: what
    this engine can run ("none" excluded)."""
    p = f"engine_options.{engine}."
    method = opts.speculative_method
    if method == "none":
        return []
    if method not in methods:
        can = ", ".join(methods) or "no method"
        return [f"{p}speculative_method={method}: {engine} runs {can} here; use one of none, {', '.join(methods)}."]
    problems = []
    if opts.num_speculative_tokens is None:
        problems.append(f"{p}num_speculative_tokens: set k >= 1 (tokens proposed per step) with "
                        f"speculative_method={method}.")
    if method == "draft":
        if not opts.draft_model:
            problems.append(f"{p}draft_model: set the draft's checkpoint directory with speculative_method=draft.")
        else:
            problems += draft_problems(engine, str(opts.draft_model), target_path)
    if method == "ngram":
        lo, hi = opts.prompt_lookup_min, opts.prompt_lookup_max
        if lo is not None and hi is not None and lo > hi:
            problems.append(f"{p}prompt_lookup_min={lo} is more than prompt_lookup_max={hi}; make min <= max.")
        if needs_prompt_lookup_max and hi is None and lo is None:
            problems.append(f"{p}prompt_lookup_max: set the longest n-gram to match (and prompt_lookup_min) with "
                            "speculative_method=ngram.")
    return problems


@dataclass
class SpecCounter:
    """Counts drafts as an engine sees them (the reference engine's speculator, the hf adapter's
    candidate generator): `observe(proposed, accepted)` once per sequence per speculative step.
    A step that proposed nothing (n-gram lookup without a match) is no draft, as in vLLM's
    counters. `source` is what its SpecDecodeStats say they come from."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    source: str = "derived"

    def observe(self, proposed: int, accepted: int) -> None:
        if not 0 <= accepted <= proposed:
            raise ValueError(f"a draft of {proposed} tokens cannot have {accepted} accepted")
        if proposed == 0:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def stats(self, k: int | None = None) -> SpecDecodeStats:
        per_pos = list(self.accepted_per_pos)
        if k is not None and len(per_pos) < k:
            per_pos += [0] * (k - len(per_pos))
        return SpecDecodeStats(drafts=self.drafts, draft_tokens=self.draft_tokens,
                               accepted_tokens=self.accepted_tokens, accepted_per_pos=per_pos,
                               draft_time_s=self.draft_time_s, verify_time_s=self.verify_time_s, source=self.source)

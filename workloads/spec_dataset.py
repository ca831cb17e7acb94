"""The speculative workload's prompts from a user's dataset (`workload.dataset`), grouped by
category: acceptance depends on what is decoded, and a user wants it on their own traffic.

Formats (the first object of a .jsonl file tells them apart):
- a JSONL with a `category` field (SpecBench's question.jsonl, MT-Bench's): one prompt per line,
  its text the `prompt` (a string), else the first of `turns` (a list of strings), else the
  first user message of `messages` / `conversations`; its category the `category` value;
- ShareGPT or the chat format (workloads/datasets.py reads them): each conversation's first user
  message, all in one category named after the format (`sharegpt`, `chat`);
- a JSONL of `prompt` lines without categories (the trtllm-bench format): category `dataset`.

A Hub dataset (`hf:ORG/NAME[/FILE]`) reaches here as its cached file's path (the plan resolves
it). The texts are tokenised raw with the model's tokenizer (no chat template), each cut to the
workload's `prompt_len` tokens; request i of a category gets its i-th prompt (cycling).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

from harness.core.errors import UserError
from workloads.datasets import _peek, detect_format, read_chats, read_dataset


def _first_user(messages: Any) -> str | None:
    for m in messages if isinstance(messages, list) else ():
        if isinstance(m, dict) and (m.get("role") or m.get("from")) in ("user", "human"):
            text = m.get("content", m.get("value"))
            return text if isinstance(text, str) else None
    return None


def _prompt_of(obj: dict[str, Any]) -> str | None:
    if isinstance(obj.get("prompt"), str):
        return obj["prompt"]
    turns = obj.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    return _first_user(obj.get("messages") or obj.get("conversations"))


def read_categories(path: str, field: str = "workload.dataset") -> tuple[OrderedDict[str, list[str]], str]:
    """({category: prompt texts, in file order}, format). UserError naming the field when the file
    is missing, unreadable, or has no usable prompt."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{field}={path}: no such file. Give a JSONL with a `category` field (SpecBench, MT-Bench), "
                        "a ShareGPT or chat-format file, or hf:ORG/NAME[/FILE] for a dataset on the Hugging Face Hub.")
    cats: OrderedDict[str, list[str]] = OrderedDict()
    first = _peek(p) if p.suffix == ".jsonl" else None
    if isinstance(first, dict) and "category" in first:
        fmt, bad = "categorized", 0
        with open(p, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{field}={path}: line {n} is not JSON ({e.msg}). One JSON object per line.") from None
                text = _prompt_of(obj) if isinstance(obj, dict) else None
                cat = obj.get("category") if isinstance(obj, dict) else None
                if not text or not text.strip() or not isinstance(cat, str) or not cat:
                    bad += 1
                    continue
                cats.setdefault(cat, []).append(text)
    elif detect_format(p) in ("sharegpt", "chat"):
        chats = read_chats(p, field)
        fmt = chats.format
        cats[fmt] = [c.turns[0][0] for c in chats.chats if c.turns and c.turns[0][0].strip()]
    else:
        fmt = "jsonl"
        cats["dataset"] = [e.prompt_text for e in read_dataset(p, "jsonl", field) if e.prompt_text]
    cats = OrderedDict((k, v) for k, v in cats.items() if v)
    if not cats:
        raise UserError(f"{field}={path}: no usable prompt (a non-empty `prompt`, `turns`, or user message, with a "
                        "`category` where the file has them). Give a file with prompts.")
    return cats, fmt


def texts_digest(texts: list[str]) -> str:
    return hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16]

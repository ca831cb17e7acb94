"""Request datasets for the serving workload.

- JSONL, the `trtllm-bench` format: one object per line with `input_ids` (a list of token ids)
  or `prompt` (text, tokenised with the checkpoint's tokenizer), and `output_tokens` (how many
  tokens to generate). Other keys (e.g. `task_id`) are ignored.
- ShareGPT JSON (a file the user provides): a list of conversations
  `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}`;
  the first human turn is the prompt and the token count of the reply that follows it is the
  output length (as `vllm bench serve` does). Conversations without such a pair are skipped.
  The conversation workload replays whole conversations instead (`read_sharegpt_conversations`:
  every human turn once, in order; the recorded replies give only the output caps, the engine's
  own replies take their place in the history).

- A request trace, Mooncake-style JSONL (as AIPerf, inference-perf and SGLang's bench_serving
  replay it): one request per line with `timestamp` (milliseconds, any origin), `input_length`,
  `output_length` and optionally `hash_ids` (one id per block of prompt tokens; requests whose
  ids start alike share that prompt prefix). Lines are sorted by timestamp.

Every problem names the file and the line (JSONL) or entry (ShareGPT).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from harness.core.errors import UserError


@dataclass
class DatasetEntry:
    prompt_ids: list[int] | None
    prompt_text: str | None
    output_tokens: int | None  # None: to be measured from `output_text`
    output_text: str | None = None


def detect_format(path: Path) -> str:
    return "jsonl" if path.suffix == ".jsonl" else "sharegpt"


def read_dataset(path: str | Path, fmt: str = "auto", field: str = "workload.dataset") -> list[DatasetEntry]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{field}={path}: no such file. Give a JSONL (trtllm-bench format) or ShareGPT JSON file.")
    fmt = detect_format(p) if fmt == "auto" else fmt
    if fmt == "jsonl":
        entries = _read_jsonl(p, field)
    elif fmt == "sharegpt":
        entries = _read_sharegpt(p, field)
    else:
        raise UserError(f"workload.dataset_format={fmt}: use auto, jsonl or sharegpt.")
    if not entries:
        raise UserError(f"{field}={path}: the file holds no usable requests.")
    return entries


def _json_objects(p: Path, field: str, problems: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, object) for every non-blank line of a JSONL file that is a JSON object; a line that is
    not one adds a problem naming the file and line."""
    for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{field}={p} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"{where}: not valid JSON ({e.msg}). Each line must be one JSON object.")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{where}: not a JSON object.")
            continue
        yield where, obj


def _read_jsonl(p: Path, field: str) -> list[DatasetEntry]:
    out, problems = [], []
    for where, obj in _json_objects(p, field, problems):
        ids, text, out_n = obj.get("input_ids"), obj.get("prompt"), obj.get("output_tokens")
        if ids is None and text is None:
            problems.append(f"{where}: needs \"input_ids\" (token ids) or \"prompt\" (text).")
            continue
        if ids is not None and not (isinstance(ids, list) and ids and
                                    all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            problems.append(f"{where}: \"input_ids\" must be a non-empty list of non-negative integers.")
            continue
        if text is not None and ids is None and not (isinstance(text, str) and text):
            problems.append(f"{where}: \"prompt\" must be a non-empty string.")
            continue
        if not (isinstance(out_n, int) and not isinstance(out_n, bool) and out_n >= 1):
            problems.append(f"{where}: \"output_tokens\" must be a positive integer (got {out_n!r}).")
            continue
        out.append(DatasetEntry(ids, text if ids is None else None, out_n))
        if len(problems) > 20:
            break
    if problems:
        raise UserError(problems)
    return out


def _sharegpt_data(p: Path, field: str) -> list[Any]:
    try:
        data = json.loads(p.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise UserError(f"{field}={p}: not valid JSON ({e.msg} at line {e.lineno}). "
                        "A ShareGPT file is one JSON list of conversations.") from None
    if not isinstance(data, list):
        raise UserError(f"{field}={p}: a ShareGPT file is a JSON list of conversations.")
    return data


def _read_sharegpt(p: Path, field: str) -> list[DatasetEntry]:
    data = _sharegpt_data(p, field)
    out = []
    for conv in data:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            continue
        for a, b in zip(turns, turns[1:]):
            if (isinstance(a, dict) and isinstance(b, dict) and a.get("from") == "human"
                    and b.get("from") == "gpt" and isinstance(a.get("value"), str)
                    and isinstance(b.get("value"), str) and a["value"] and b["value"]):
                out.append(DatasetEntry(None, a["value"], None, b["value"]))
                break
    return out


def tokenize_entries(entries: list[DatasetEntry], model_path: str, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) per entry, tokenising text with the checkpoint's tokenizer."""
    tok = None
    out = []
    for e in entries:
        if (e.prompt_ids is None or e.output_tokens is None) and tok is None:
            tok = _tokenizer(model_path, "text prompts need", " Use input_ids instead.")
        ids = e.prompt_ids if e.prompt_ids is not None else tok(e.prompt_text, add_special_tokens=False)["input_ids"]
        n_out = e.output_tokens if e.output_tokens is not None else \
            len(tok(e.output_text, add_special_tokens=False)["input_ids"])
        if not ids or n_out < 1:
            continue
        _check_vocab(ids, vocab_size, "Use ids made for this model.")
        out.append((list(ids), n_out))
    return out


def _tokenizer(model_path: str, what: str, fix: str = ""):
    """The checkpoint's tokenizer, or one clear UserError naming why it is needed."""
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as err:
        raise UserError(f"workload.dataset: {what} the checkpoint's tokenizer, which did "
                        f"not load from {model_path} ({err}).{fix}") from None


def _check_vocab(ids: list[int], vocab_size: int, fix: str) -> None:
    if max(ids) >= vocab_size:
        raise UserError(f"workload.dataset: token id {max(ids)} is outside the model's vocabulary "
                        f"({vocab_size}). {fix}")


def read_sharegpt_conversations(path: str | Path, field: str = "workload.dataset") -> list[list[tuple[str, str]]]:
    """Whole ShareGPT conversations for the conversation workload: per conversation, its
    (human message, recorded gpt reply) pairs in order. Every human turn that a gpt reply follows
    is kept, once, in file order (entries of other roles, e.g. "system", are skipped); a human turn
    with no reply after it (the conversation's last, or one followed by another human turn) ends the
    conversation there, since its reply's length is unknown. The replies' texts give only each
    turn's output cap: when replayed, the engine's own replies take their place in the history."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{field}={path}: no such file. Give a ShareGPT JSON file (a list of "
                        "{\"conversations\": [{\"from\": \"human\", \"value\": ...}, ...]}).")
    out = []
    for conv in _sharegpt_data(p, field):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            continue
        msgs = [t for t in turns if isinstance(t, dict) and t.get("from") in ("human", "gpt")
                and isinstance(t.get("value"), str) and t["value"]]
        pairs: list[tuple[str, str]] = []
        i = 0
        while i + 1 < len(msgs) and msgs[i]["from"] == "human" and msgs[i + 1]["from"] == "gpt":
            pairs.append((msgs[i]["value"], msgs[i + 1]["value"]))
            i += 2
        if pairs:
            out.append(pairs)
    if not out:
        raise UserError(f"{field}={path}: no conversation with a human turn followed by a gpt reply.")
    return out


def tokenize_conversations(convs: list[list[tuple[str, str]]], model_path: str,
                           vocab_size: int) -> list[list[tuple[list[int], int]]]:
    """Per conversation, (user message ids, reply cap in tokens) per turn, with the checkpoint's
    tokenizer (no special tokens added)."""
    tok = _tokenizer(model_path, "a ShareGPT file's text needs")
    out = []
    for conv in convs:
        turns = []
        for user, reply in conv:
            ids = tok(user, add_special_tokens=False)["input_ids"]
            cap = len(tok(reply, add_special_tokens=False)["input_ids"])
            if not ids or cap < 1:
                break
            _check_vocab(ids, vocab_size, "Use a tokenizer made for this model.")
            turns.append((list(ids), cap))
        if turns:
            out.append(turns)
    return out


@dataclass
class TraceEntry:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int | str]


def _pos_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def read_trace(path: str | Path, field: str = "workload.trace") -> list[TraceEntry]:
    """A Mooncake-style JSONL trace, sorted by timestamp."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{field}={path}: no such file. Give a JSONL trace with timestamp, input_length, "
                        "output_length (and optionally hash_ids) on every line.")
    out, problems = [], []
    for where, obj in _json_objects(p, field, problems):
        ts, i, o, h = obj.get("timestamp"), obj.get("input_length"), obj.get("output_length"), obj.get("hash_ids", [])
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
            problems.append(f"{where}: \"timestamp\" must be a non-negative number of milliseconds (got {ts!r}).")
        elif not _pos_int(i) or not _pos_int(o):
            problems.append(f"{where}: \"input_length\" and \"output_length\" must be positive integers "
                            f"(got {i!r}, {o!r}).")
        elif not (isinstance(h, list) and all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in h)):
            problems.append(f"{where}: \"hash_ids\" must be a list of integers.")
        else:
            out.append(TraceEntry(float(ts), i, o, list(h)))
        if len(problems) > 20:
            break
    if problems:
        raise UserError(problems)
    if not out:
        raise UserError(f"{field}={path}: the file holds no requests.")
    return sorted(out, key=lambda e: e.timestamp_ms)

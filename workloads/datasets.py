"""Request datasets for the serving and conversation workloads, as users have them.

- **JSONL, the `trtllm-bench` format**: one object per line with `input_ids` (a list of token
  ids) or `prompt` (text, tokenised with the checkpoint's tokenizer), and `output_tokens` (how
  many tokens to generate). Other keys (e.g. `task_id`) are ignored.
- **ShareGPT** (JSON: a list of `{"conversations": [{"from": ..., "value": ...}, ...]}`, or JSONL
  of such objects) and **the chat format** (JSONL: one `{"messages": [{"role": ..., "content":
  ...}, ...]}` per line, as logs and fine-tuning sets hold it; a JSON list of them too). Both are
  read the same way (`normalize`), as real logs hold them:
  - role names vary: `human` / `user`, `gpt` / `assistant` / `chatgpt` (and `bing`, `bard`,
    `model`), `system`; a message's text is `value` or `content` (a string, or a list of
    `{"type": "text", "text": ...}` parts);
  - system messages at the head become the conversation's system turn, at the head of every
    prompt's history;
  - consecutive messages of one role are merged into one turn (two human messages in a row: one
    question), after empty messages are dropped (an empty reply: the question before it and the
    one after it become one turn);
  - what cannot be replayed is skipped and counted by reason (`SKIPS`): an empty reply, a reply
    before any question, an unanswered last question, a message of an unknown role, a
    conversation with no answered turn. Rows record the counts (`dataset_skipped`,
    `dataset_merged`) and the run prints them at its end.
  `serving` takes one request per conversation: ShareGPT's first answered turn (the user message,
  after the system turn; the reply's token count is the output length: `vllm bench serve`'s
  convention), the chat format's last answered user message with its whole history (system turn,
  earlier messages and their recorded replies). `conversation` replays every answered turn of a
  conversation, once and in order (the engine's own replies take the recorded ones' place).
- **A request trace**, Mooncake-style JSONL (as AIPerf, inference-perf and SGLang's bench_serving
  replay it): one request per line with `timestamp` (milliseconds, any origin), `input_length`,
  `output_length` and optionally `hash_ids` (one id per block of prompt tokens; requests whose
  ids start alike share that prompt prefix). Lines are sorted by timestamp.

A Hub dataset (`workload.dataset=hf:ORG/NAME[@REV][/FILE]`) is downloaded by the harness's plan
(harness/core/hub.py) and reaches the workloads as the cached file's path. Every problem names the
file and the line (JSONL) or entry (JSON).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from harness.core.errors import UserError

FORMATS = ("auto", "jsonl", "sharegpt", "chat")
# role names of real logs -> user | assistant | system
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
# why something of a conversation file is not replayed (the keys of a row's dataset_skipped)
SKIPS = {
    "conversation: not a conversation": "an entry without a list of messages",
    "conversation: no answered turn": "no user message with a reply after it",
    "message: empty reply": "a reply with no text (its question merges with the next one)",
    "message: empty user message": "a user message with no text",
    "message: unknown role": "a message whose role is none of ROLES (tool, function, ...)",
    "message: not text": "a message whose text is not a string (nor text parts)",
    "message: reply before any question": "an assistant message before the first user message",
    "message: system message after the first turn": "a system message that is not at the head",
    "message: unanswered last question": "a last user message with no reply (its output length is unknown)",
    "request: longer than workload.max_len": "serving: prompt + reply longer than the limit",
    "turn: beyond workload.max_len": "conversation: turns cut because the history outgrew the limit",
    "turn: empty after tokenization": "a message the tokenizer turns into no token (its conversation ends there)",
}


@dataclass
class DatasetEntry:
    prompt_ids: list[int] | None
    prompt_text: str | None
    output_tokens: int | None  # None: to be measured from `output_text`
    output_text: str | None = None
    history: list[tuple[str, str]] | None = None  # (role, text) before the prompt's user message


class Entries(list):
    """A dataset's requests (DatasetEntry), with what reading it skipped: `skipped` (reason ->
    count), `merged` (messages merged into the one before), `read` (entries in the file) and the
    `format` it was read as."""

    def __init__(self, items: list[DatasetEntry] = (), fmt: str = "jsonl", read: int = 0,
                 skipped: Counter | None = None, merged: int = 0):
        super().__init__(items)
        self.format, self.read, self.skipped, self.merged = fmt, read, skipped or Counter(), merged


@dataclass
class Chat:
    """One conversation, normalised: its system turn (or None) and its answered turns (user text,
    recorded reply text), in order."""

    system: str | None
    turns: list[tuple[str, str]]


@dataclass
class Chats:
    chats: list[Chat]
    format: str  # sharegpt | chat
    read: int  # conversations in the file
    skipped: Counter = field(default_factory=Counter)
    merged: int = 0

    def row_fields(self) -> dict[str, Any]:
        return {"dataset_format": self.format, "dataset_conversations": self.read,
                "dataset_skipped": dict(sorted(self.skipped.items())), "dataset_merged": self.merged}


def _peek(p: Path) -> Any:
    """The first JSON value of a JSONL file (None if unreadable)."""
    with open(p, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None
    return None


def detect_format(path: Path) -> str:
    """jsonl (trtllm-bench), sharegpt or chat: a .jsonl file by the keys of its first object; any
    other file is JSON conversations (ShareGPT or chat, told apart entry by entry)."""
    if path.suffix != ".jsonl":
        return "sharegpt"
    first = _peek(path)
    if isinstance(first, dict) and "messages" in first:
        return "chat"
    if isinstance(first, dict) and "conversations" in first:
        return "sharegpt"
    return "jsonl"


def read_dataset(path: str | Path, fmt: str = "auto", field: str = "workload.dataset") -> Entries:
    """Serving's requests from a dataset file (trtllm-bench JSONL, ShareGPT, chat format)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{field}={path}: no such file. Give a JSONL (trtllm-bench format), ShareGPT JSON, or "
                        "chat-format JSONL file, or hf:ORG/NAME[/FILE] for a dataset on the Hugging Face Hub.")
    fmt = detect_format(p) if fmt == "auto" else fmt
    if fmt == "jsonl":
        entries = _read_jsonl(p, field)
        entries.read = len(entries)
    elif fmt in ("sharegpt", "chat"):
        chats = read_chats(p, field, fmt)
        entries = Entries([_entry(c, chats.format) for c in chats.chats], chats.format, chats.read,
                          Counter(chats.skipped), chats.merged)
    else:
        raise UserError(f"workload.dataset_format={fmt}: use {', '.join(FORMATS)}.")
    if not entries:
        raise UserError(f"{field}={path}: the file holds no usable requests"
                        + (f" ({_skips_text(entries.skipped)})" if entries.skipped else "") + ".")
    return entries


def _entry(chat: Chat, fmt: str) -> DatasetEntry:
    """Serving's request of a conversation: ShareGPT's first answered turn, the chat format's last
    answered user message with its history."""
    head = [("system", chat.system)] if chat.system else []
    if fmt == "sharegpt":
        user, reply = chat.turns[0]
        return DatasetEntry(None, user, None, reply, head)
    history = head + [m for u, a in chat.turns[:-1] for m in (("user", u), ("assistant", a))]
    user, reply = chat.turns[-1]
    return DatasetEntry(None, user, None, reply, history)


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


def _read_jsonl(p: Path, field: str) -> Entries:
    out, problems = Entries(), []
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


# ---- conversations: ShareGPT and the chat format ------------------------------------------------------

def _conversation_entries(p: Path, field: str) -> list[Any]:
    """The file's entries: a JSON list (or {"data": [...]}), else JSONL (one entry per line)."""
    text = p.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if p.suffix != ".jsonl" and not (e.msg.startswith("Extra data") and text.lstrip().startswith("{")):
            raise UserError(f"{field}={p}: not valid JSON ({e.msg} at line {e.lineno}). A ShareGPT file is one JSON "
                            "list of conversations; a chat-format file is JSONL (.jsonl), one {\"messages\": [...]} "
                            "per line.") from None
        problems: list[str] = []
        entries = [obj for _, obj in _json_objects(p, field, problems)]
        if problems:
            raise UserError(problems[:20])
        return entries
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if isinstance(data, dict):  # a JSONL file of one line
        data = [data]
    if not isinstance(data, list):
        raise UserError(f"{field}={p}: a ShareGPT file is a JSON list of conversations "
                        "({\"conversations\": [...]}); a chat-format file holds {\"messages\": [...]} per line.")
    return data


def _text(value: Any) -> str | None:
    """A message's text: a string, or the text of a list of parts ({"type": "text", "text": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = [v if isinstance(v, str) else v.get("text") for v in value
                 if isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("text"), str))]
        return "\n".join(parts) if parts or not value else None
    return None


def normalize(messages: list[Any], skipped: Counter) -> tuple[Chat | None, int]:
    """One conversation's messages (ShareGPT's {from, value} or the chat format's {role, content})
    as a Chat, and how many messages were merged into the one before; what is dropped is counted in
    `skipped` by reason (SKIPS)."""
    msgs: list[list[str]] = []
    for m in messages:
        if not isinstance(m, dict):
            skipped["message: not text"] += 1
            continue
        raw_role = m.get("from", m.get("role"))
        role = ROLES.get(str(raw_role).strip().lower()) if raw_role is not None else None
        text = _text(m["value"] if "value" in m else m.get("content"))
        if role is None:
            skipped["message: unknown role"] += 1
        elif text is None:
            skipped["message: not text"] += 1
        elif not text.strip():
            skipped["message: empty reply" if role == "assistant" else "message: empty user message"
                    if role == "user" else "message: not text"] += 1
        else:
            msgs.append([role, text])
    system: list[str] = []
    while msgs and msgs[0][0] == "system":
        system.append(msgs.pop(0)[1])
    turns: list[list[str]] = []
    merged = 0
    for role, text in msgs:
        if role == "system":
            skipped["message: system message after the first turn"] += 1
        elif not turns and role == "assistant":
            skipped["message: reply before any question"] += 1
        elif turns and turns[-1][0] == role:
            turns[-1][1] += "\n" + text
            merged += 1
        else:
            turns.append([role, text])
    if len(turns) % 2:
        skipped["message: unanswered last question"] += 1
    pairs = [(turns[i][1], turns[i + 1][1]) for i in range(0, len(turns) - 1, 2)]
    if not pairs:
        skipped["conversation: no answered turn"] += 1
        return None, merged
    return Chat("\n".join(system) or None, pairs), merged


def read_chats(path: str | Path, field: str = "workload.dataset", fmt: str = "auto") -> Chats:
    """Every conversation of a ShareGPT or chat-format file, normalised (`normalize`), with the
    skips counted by reason. UserError where the file is not one, or nothing in it can be replayed."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{field}={path}: no such file. Give a ShareGPT JSON file (a list of {{\"conversations\": "
                        "[{\"from\": \"human\", \"value\": ...}, ...]}}), a chat-format JSONL file (one "
                        "{\"messages\": [{\"role\": \"user\", \"content\": ...}, ...]} per line), or "
                        "hf:ORG/NAME[/FILE] for a dataset on the Hugging Face Hub.")
    entries = _conversation_entries(p, field)
    skipped: Counter = Counter()
    chats, merged, kinds = [], 0, Counter()
    for entry in entries:
        key = next((k for k in ("messages", "conversations") if isinstance(entry, dict)
                    and isinstance(entry.get(k), list)), None)
        if key is None:
            skipped["conversation: not a conversation"] += 1
            continue
        kinds[key] += 1
        chat, m = normalize(entry[key], skipped)
        merged += m
        if chat is not None:
            chats.append(chat)
    found = "chat" if kinds["messages"] > kinds["conversations"] else "sharegpt"
    out = Chats(chats, found if fmt in ("auto", None) else fmt, len(entries), skipped, merged)
    if not chats:
        raise UserError(f"{field}={path}: no conversation with a user message followed by a reply "
                        f"({len(entries)} entries; {_skips_text(skipped) or 'none readable'}). A ShareGPT entry is "
                        "{\"conversations\": [{\"from\": \"human\", \"value\": ...}, {\"from\": \"gpt\", ...}]}; "
                        "a chat-format line is {\"messages\": [{\"role\": \"user\", \"content\": ...}, ...]}.")
    return out


def _skips_text(skipped: Counter | dict[str, int]) -> str:
    return ", ".join(f"{n} {reason.split(': ', 1)[-1]}" for reason, n in sorted(skipped.items()))


def skips_line(row: dict[str, Any]) -> str:
    """The end-of-run line about what a dataset's reading left out (empty: nothing)."""
    skipped, merged = row.get("dataset_skipped") or {}, row.get("dataset_merged") or 0
    if not (skipped or merged):
        return ""
    parts = [f"skipped {_skips_text(skipped)}"] if skipped else []
    if merged:
        parts.append(f"{merged} message{'s' if merged > 1 else ''} merged into the one before (same role)")
    read = row.get("dataset_conversations")
    return (f"dataset {row.get('dataset')}" + (f" ({read} conversations)" if read else "") + ": "
            + "; ".join(parts) + " (docs/conversation.md, \"Dataset formats\")")


# ---- tokenising --------------------------------------------------------------------------------------------

@dataclass
class TokenizedRequest:
    prompt_ids: list[int]
    output_tokens: int
    messages: list[dict[str, Any]] | None = None  # {"role", "ids"} in order, the prompt's user message last


def tokenize_requests(entries: list[DatasetEntry], model_path: str, vocab_size: int,
                      skipped: Counter | None = None) -> list[TokenizedRequest]:
    """Every entry's prompt ids (its history's messages' ids, then its own, concatenated), output
    length and messages, tokenising text with the checkpoint's tokenizer."""
    tok = None
    out = []
    for e in entries:
        if (e.prompt_ids is None or e.output_tokens is None) and tok is None:
            tok = _tokenizer(model_path, "text prompts need", " Use input_ids instead.")
        ids_of = (lambda text: list(tok(text, add_special_tokens=False)["input_ids"]))  # noqa: E731
        ids = list(e.prompt_ids) if e.prompt_ids is not None else ids_of(e.prompt_text)
        n_out = e.output_tokens if e.output_tokens is not None else len(ids_of(e.output_text))
        messages = None
        if e.history:
            messages = [{"role": r, "ids": ids_of(t)} for r, t in e.history] + [{"role": "user", "ids": ids}]
            ids = [i for m in messages for i in m["ids"]]
        if not ids or n_out < 1:
            if skipped is not None:
                skipped["turn: empty after tokenization"] += 1
            continue
        _check_vocab(ids, vocab_size, "Use ids made for this model.")
        out.append(TokenizedRequest(ids, n_out, messages))
    return out


def tokenize_entries(entries: list[DatasetEntry], model_path: str, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) per entry, tokenising text with the checkpoint's tokenizer."""
    return [(r.prompt_ids, r.output_tokens) for r in tokenize_requests(entries, model_path, vocab_size)]


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


@dataclass
class TokenizedChat:
    system: list[int] | None
    turns: list[tuple[list[int], int]]  # (user message ids, reply cap in tokens)


def tokenize_chats(chats: Chats, model_path: str, vocab_size: int) -> Iterator[TokenizedChat]:
    """Per conversation (as they are consumed: a replay that needs 16 sessions tokenises 16), its
    system turn's ids and (user message ids, reply cap in tokens) per turn, with the checkpoint's
    tokenizer (no special tokens added). A turn the tokenizer makes empty ends its conversation
    there (counted in `chats.skipped`)."""
    tok = _tokenizer(model_path, "a conversation file's text needs")
    ids_of = (lambda text: list(tok(text, add_special_tokens=False)["input_ids"]))  # noqa: E731
    for chat in chats.chats:
        system = ids_of(chat.system) if chat.system else None
        turns = []
        for user, reply in chat.turns:
            ids, cap = ids_of(user), len(ids_of(reply))
            if not ids or cap < 1:
                chats.skipped["turn: empty after tokenization"] += len(chat.turns) - len(turns)
                break
            _check_vocab(ids + (system or []), vocab_size, "Use a tokenizer made for this model.")
            turns.append((ids, cap))
        if turns:
            yield TokenizedChat(system or None, turns)


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

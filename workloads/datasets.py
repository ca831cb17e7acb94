"""Request datasets for the serving and conversation workloads, as users have them.

- **JSONL, the `trtllm-bench` format**: one object per line with `input_ids` (a list of token
  ids) or `prompt` (text, tokenised with the checkpoint's tokenizer), and `output_tokens` (how
  many tokens to generate). Other keys (e.g. `task_id`) are ignored.
- **ShareGPT** (JSON: a list of `{"conversations": [{"from": ..., "value": ...}, ...]}`, or JSONL
  of such objects) and **the chat format** (JSONL: one `{"messages": [...], "tools": [...]}` per
  line, the OpenAI chat API's messages as logs and fine-tuning sets hold them; a JSON list of them
  too). Both are read whole (`parse_chat`), as the API defines a conversation:
  - role names vary: `human` / `user`, `gpt` / `assistant` / `chatgpt` (and `bing`, `bard`,
    `model`), `system` and `developer` (a system-level role, sent as `system`), `tool`; a
    message's content is `value` or `content`: a string, a list of parts (`{"type": "text", ...}`,
    `{"type": "image_url", ...}`, ...), or null beside an assistant's `tool_calls`;
  - an assistant message's `tool_calls` ({id, type: function, function: {name, arguments: a JSON
    string}}) and each `tool` message's `tool_call_id`, which answers a call of the assistant
    message before it; the line's `tools` (function schemas) and `tool_choice`; a message's
    `timestamp` (seconds since the epoch, or ISO 8601) gives the recorded think time;
  - bad input is one UserError naming the file, the line (JSONL) or entry (JSON), and the message:
    malformed `tool_calls` or `tools`, a `tool` message that answers no call before it, a call
    left unanswered before the next message, a conversation none of whose messages can be read;
  - what cannot be replayed is skipped and counted by reason (`SKIPS`): a message of an unknown
    role, an empty reply, a reply before any question, an unanswered last question, a
    conversation with no answered turn. Rows record the counts (`dataset_skipped`,
    `dataset_merged`) and the run prints them at its end.
  `conversation` replays every reply of a conversation (a run of assistant messages after a user
  or tool message), once and in order, each one request with the messages before it as logged
  (Chat.messages, Chat.replies). `serving` takes one request per conversation from its text
  (`normalize`: consecutive messages of one role merged, empty messages dropped): ShareGPT's first
  answered turn (the user message, after the system turn; the reply's token count is the output
  length: `vllm bench serve`'s convention), the chat format's last answered user message with its
  whole history (system turn, earlier messages and their recorded replies); a conversation with
  tool calls or non-text parts is skipped there (counted), never sent reshaped.
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
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from harness.core.errors import UserError

FORMATS = ("auto", "jsonl", "sharegpt", "chat")
# role names of real logs -> user | assistant | system
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system", "developer": "system",
         "tool": "tool"}
# why something of a conversation file is not replayed (the keys of a row's dataset_skipped)
SKIPS = {
    "conversation: not a conversation": "an entry without a list of messages",
    "conversation: no answered turn": "no user message with a reply after it",
    "conversation: tool calls or non-text parts": "serving sends a conversation's text turns alone: one with tool "
                                                  "calls or an image/audio part is not sent reshaped "
                                                  "(workload=conversation replays it)",
    "message: empty reply": "a reply with no text and no tool call: no request is made of it (conversation: it "
                            "stays in the history as logged; serving: its question merges with the next one)",
    "message: empty user message": "serving: a user message with no text",
    "message: unknown role": "a message whose role is none of ROLES (function, ipython, ...): left out",
    "message: not text": "a message whose content is neither a string, text and media parts, nor null beside "
                         "tool calls: left out",
    "message: reply before any question": "assistant messages before the first user message: not replayed as a "
                                          "request (conversation: they stay in the history as logged)",
    "message: system message after the first turn": "serving: a system message that is not at the head",
    "message: unanswered last question": "a last user or tool message with no reply (its output length is unknown)",
    "request: longer than workload.max_len": "serving: prompt + reply longer than the limit",
    "turn: beyond workload.max_len": "conversation: turns cut because the history outgrew the limit",
    "turn: empty after tokenization": "a message the tokenizer turns into no token (its conversation ends there)",
    "turn: non-text part the engine does not take": "conversation: a turn whose messages hold an image, audio, ... "
                                                    "part the engine's chat API does not take "
                                                    "(endpoints.<name>.content_parts): it and the rest of its "
                                                    "conversation are not sent",
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
class Reply:
    """One request of a replayed conversation: its recorded reply, the assistant messages
    messages[start:end], to the messages before it; `kind` says what it answers: the user's
    message (`user`) or a tool's result (`tool`)."""

    start: int
    end: int
    kind: str


@dataclass
class Chat:
    """One conversation. Serving's view (`view="text"`): its system turn (or None) and its answered
    turns (user text, recorded reply text). The replay's (`view="replay"`): its messages as the chat
    API carries them (as logged; `developer` as `system`), the replies to replay, the line's
    `tools` and `tool_choice`, each message's timestamp (seconds, or None) and where it is."""

    system: str | None
    turns: list[tuple[str, str]]
    messages: list[dict[str, Any]] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    times: list[float | None] = field(default_factory=list)
    where: str = ""


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

def _conversation_entries(p: Path, field: str) -> list[tuple[str, Any]]:
    """The file's entries with where each is (`FIELD=FILE line N`, or `entry N` of a JSON list):
    a JSON list (or {"data": [...]}), else JSONL (one entry per line)."""
    text = p.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if p.suffix != ".jsonl" and not (e.msg.startswith("Extra data") and text.lstrip().startswith("{")):
            raise UserError(f"{field}={p}: not valid JSON ({e.msg} at line {e.lineno}). A ShareGPT file is one JSON "
                            "list of conversations; a chat-format file is JSONL (.jsonl), one {\"messages\": [...]} "
                            "per line.") from None
        problems: list[str] = []
        entries = list(_json_objects(p, field, problems))
        if problems:
            raise UserError(problems[:20])
        return entries
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if isinstance(data, dict):  # a JSONL file of one line
        return [(f"{field}={p} line 1", data)]
    if not isinstance(data, list):
        raise UserError(f"{field}={p}: a ShareGPT file is a JSON list of conversations "
                        "({\"conversations\": [...]}); a chat-format file holds {\"messages\": [...]} per line.")
    return [(f"{field}={p} entry {i}", e) for i, e in enumerate(data)]


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
    """Serving's text view of one conversation's messages (ShareGPT's {from, value} or the chat
    format's {role, content}): a Chat of its system turn and text turns, and how many messages were
    merged into the one before; what is dropped is counted in `skipped` by reason (SKIPS)."""
    msgs: list[list[str]] = []
    for m in messages:
        if not isinstance(m, dict):
            skipped["message: not text"] += 1
            continue
        raw_role = m.get("from", m.get("role"))
        role = ROLES.get(str(raw_role).strip().lower()) if raw_role is not None else None
        text = _text(m["value"] if "value" in m else m.get("content"))
        if role is None or role == "tool":  # a tool result has no place among text turns
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


def read_chats(path: str | Path, field: str = "workload.dataset", fmt: str = "auto", view: str = "text") -> Chats:
    """Every conversation of a ShareGPT or chat-format file, read whole (`parse_chat`: bad input is
    one UserError naming each line), with the skips counted by reason. `view="replay"`: each Chat's
    messages and replies (workload=conversation); `view="text"`: its system turn and text turns
    (`normalize`; serving), a conversation with tool calls or non-text parts skipped. UserError
    where the file is not one, or nothing in it can be replayed."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{field}={path}: no such file. Give a ShareGPT JSON file (a list of {{\"conversations\": "
                        "[{\"from\": \"human\", \"value\": ...}, ...]}}), a chat-format JSONL file (one "
                        "{\"messages\": [{\"role\": \"user\", \"content\": ...}, ...]} per line), or "
                        "hf:ORG/NAME[/FILE] for a dataset on the Hugging Face Hub.")
    entries = _conversation_entries(p, field)
    skipped: Counter = Counter()
    chats, merged, kinds, problems = [], 0, Counter(), []
    for where, entry in entries:
        key = next((k for k in ("messages", "conversations") if isinstance(entry, dict)
                    and isinstance(entry.get(k), list)), None)
        if key is None:
            skipped["conversation: not a conversation"] += 1
            continue
        kinds[key] += 1
        read: Counter = Counter()  # this conversation's skips: counted in one view only
        chat = parse_chat(entry, key, where, read, problems)
        if view == "replay":
            skipped.update(read)
            if chat is not None:
                chats.append(chat)
        elif chat is not None and _agentic(chat):
            skipped["conversation: tool calls or non-text parts"] += 1
        elif chat is not None or not problems:
            text, m = normalize(entry[key], skipped)
            merged += m
            if text is not None:
                chats.append(text)
        if len(problems) > 20:
            break
    if problems:
        raise UserError(problems[:20])
    found = "chat" if kinds["messages"] > kinds["conversations"] else "sharegpt"
    out = Chats(chats, found if fmt in ("auto", None) else fmt, len(entries), skipped, merged)
    if not chats:
        raise UserError(f"{field}={path}: no conversation with a user message followed by a reply "
                        f"({len(entries)} entries; {_skips_text(skipped) or 'none readable'}). A ShareGPT entry is "
                        "{\"conversations\": [{\"from\": \"human\", \"value\": ...}, {\"from\": \"gpt\", ...}]}; "
                        "a chat-format line is {\"messages\": [{\"role\": \"user\", \"content\": ...}, ...]}.")
    return out


def _agentic(chat: Chat) -> bool:
    """Whether a conversation holds what a text view would drop: tool calls, tool messages,
    non-text parts."""
    return bool(chat.tools) or any(m.get("tool_calls") or m["role"] == "tool" or non_text_parts(m)
                                   for m in chat.messages)


def non_text_parts(message: dict[str, Any]) -> list[str]:
    """The types of a message's parts that are not text (image_url, input_audio, ...)."""
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [p["type"] for p in content if p.get("type") != "text"]


# ---- the chat format read whole ------------------------------------------------------------------------------

CALL_FORM = ('{"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '
             '"{\\"path\\": \\"a.py\\"}"}}')
TOOL_FORM = '{"type": "function", "function": {"name": "read_file", "description": ..., "parameters": {...}}}'


def _content(value: Any) -> bool | None:
    """True: a chat message's content the API defines (a string, or a list of parts each with a
    `type`, text parts with their text); None: null; False: anything else."""
    if value is None:
        return None
    if isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str) and (p["type"] != "text" or isinstance(p.get("text"), str))
        for p in value)


def _call_problem(call: Any) -> str | None:
    if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not call["id"]:
        return "a call needs its \"id\" (a non-empty string)"
    if call.get("type", "function") != "function":
        return f"type {call.get('type')!r}: the chat API's calls are of type \"function\""
    f = call.get("function")
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        return "a call needs \"function\": {\"name\": ..., \"arguments\": ...}"
    args = f.get("arguments", "")
    if not isinstance(args, str):
        return ("\"arguments\" must be a JSON string, as the API carries it (json.dumps of the object), not "
                f"{type(args).__name__}")
    if args.strip():
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError as e:
            return f"\"arguments\" is not valid JSON ({e.msg})"
        if not isinstance(parsed, dict):
            return "\"arguments\" must be a JSON object"
    return None


def _timestamp(m: dict[str, Any], at: str, problems: list[str]) -> float | None:
    ts = m.get("timestamp")
    if ts is None:
        return None
    if isinstance(ts, (int, float)) and not isinstance(ts, bool):
        return float(ts)
    if isinstance(ts, str):
        try:
            return datetime.fromisoformat(ts).timestamp()
        except ValueError:
            pass
    problems.append(f"{at}: \"timestamp\" {ts!r} is neither seconds since the epoch nor an ISO 8601 time "
                    "(2026-12-05T19:28:00Z).")
    return None


def parse_chat(entry: dict[str, Any], key: str, where: str, skipped: Counter, problems: list[str]) -> Chat | None:
    """One conversation read whole (the module docstring): its messages as the chat API carries
    them, the replies to replay, its tools. What is bad input adds a problem naming `where` and the
    message; what cannot be replayed is counted in `skipped`. None: nothing to replay."""
    raw = entry[key]
    msgs: list[dict[str, Any]] = []
    times: list[float | None] = []
    index: list[int] = []  # the raw message's number of each kept message
    n_problems = len(problems)
    for n, m in enumerate(raw):
        at = f"{where} message {n}"
        role = None
        if isinstance(m, dict):
            raw_role = m.get("role", m.get("from"))
            role = ROLES.get(str(raw_role).strip().lower()) if raw_role is not None else None
        if role is None:
            skipped["message: unknown role" if isinstance(m, dict) else "message: not text"] += 1
            continue
        content = m["value"] if "value" in m else m.get("content")
        kind = _content(content)
        calls = m.get("tool_calls") if role == "assistant" else None
        if kind is False or (kind is None and role != "assistant"):  # null: an assistant's (beside tool calls)
            skipped["message: not text"] += 1
            continue
        w: dict[str, Any] = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            w["name"] = m["name"]
        if calls is not None:
            if not isinstance(calls, list):
                problems.append(f"{at}: \"tool_calls\" must be a list of calls, each {CALL_FORM}.")
                continue
            for i, c in enumerate(calls):
                why = _call_problem(c)
                if why:
                    problems.append(f"{at}: malformed tool_calls[{i}]: {why}. A call is {CALL_FORM}.")
            w["tool_calls"] = calls
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                problems.append(f"{at}: a tool message needs \"tool_call_id\": the id of the call it answers.")
                continue
            w["tool_call_id"] = m["tool_call_id"]
        msgs.append(w)
        times.append(_timestamp(m, at, problems))
        index.append(n)
    if raw and not msgs and len(problems) == n_problems:
        roles = sorted({str(m.get("role", m.get("from"))) for m in raw if isinstance(m, dict)})
        problems.append(f"{where}: none of its {len(raw)} messages can be read (roles {', '.join(roles) or 'none'}). "
                        f"Roles: {', '.join(sorted(ROLES))}; content: a string, a list of parts, or null beside "
                        "tool_calls.")
    tools = entry.get("tools")
    if tools is not None and not (isinstance(tools, list) and tools and all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        problems.append(f"{where}: \"tools\" must be a non-empty list of function schemas, each {TOOL_FORM}.")
    _check_calls_answered(msgs, index, where, problems)
    if len(problems) > n_problems:
        return None
    replies = _replies(msgs, skipped)
    if not replies:
        skipped["conversation: no answered turn"] += 1
        return None
    return Chat(None, [], msgs, replies, tools, entry.get("tool_choice"), times, where)


def _check_calls_answered(msgs: list[dict[str, Any]], index: list[int], where: str, problems: list[str]) -> None:
    """Every tool message answers a call of the assistant message before it, and every call is
    answered before the next message that is not a tool result (the API refuses a history
    otherwise); the last calls of a log may stay unanswered."""
    open_calls: dict[str, int] = {}  # call id -> the message (number) that made it
    for w, n in zip(msgs, index):
        at = f"{where} message {n}"
        if w["role"] == "tool":
            if w["tool_call_id"] not in open_calls:
                problems.append(f"{at}: a tool message answers tool_call_id {w['tool_call_id']!r}, which no "
                                "assistant tool_calls before it holds (or another tool message answered it). Each tool "
                                "message answers one call of the assistant message before it.")
            open_calls.pop(w["tool_call_id"], None)
            continue
        if open_calls:
            ids = ", ".join(repr(i) for i in open_calls)
            problems.append(f"{at}: the tool call(s) {ids} of message {next(iter(open_calls.values()))} have no tool "
                            "message before this one; the API takes a history only with every call answered.")
            open_calls = {}
        for c in w.get("tool_calls") or ():
            if not (isinstance(c, dict) and isinstance(c.get("id"), str)):
                continue  # malformed: said already
            if c["id"] in open_calls:
                problems.append(f"{at}: two tool calls with the id {c['id']!r}.")
            open_calls[c["id"]] = n


def _replies(msgs: list[dict[str, Any]], skipped: Counter) -> list[Reply]:
    """The replies to replay: each run of assistant messages after a user or tool message, unless
    it has no text and no call (an empty reply); a run before any question and a last question
    left unanswered are counted."""
    out: list[Reply] = []
    asked: str | None = None  # the role of the last user or tool message since the last reply
    seen_question = False
    i = 0
    while i < len(msgs):
        role = msgs[i]["role"]
        if role != "assistant":
            if role in ("user", "tool"):
                asked, seen_question = role, True
            i += 1
            continue
        j = i
        while j < len(msgs) and msgs[j]["role"] == "assistant":
            j += 1
        if not seen_question:
            skipped["message: reply before any question"] += 1
        elif not any(m.get("tool_calls") or (_text(m.get("content")) or "").strip() for m in msgs[i:j]):
            skipped["message: empty reply"] += 1
        elif asked is not None:
            out.append(Reply(i, j, asked))
            asked = None
        i = j
    if asked is not None:
        skipped["message: unanswered last question"] += 1
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
            tok = tokenizer(model_path, "text prompts need", " Use input_ids instead.")
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
        check_vocab(ids, vocab_size, "Use ids made for this model.")
        out.append(TokenizedRequest(ids, n_out, messages))
    return out


def tokenize_entries(entries: list[DatasetEntry], model_path: str, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) per entry, tokenising text with the checkpoint's tokenizer."""
    return [(r.prompt_ids, r.output_tokens) for r in tokenize_requests(entries, model_path, vocab_size)]


def tokenizer(model_path: str, what: str, fix: str = ""):
    """The checkpoint's tokenizer, or one clear UserError naming why it is needed."""
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as err:
        raise UserError(f"workload.dataset: {what} the checkpoint's tokenizer, which did "
                        f"not load from {model_path} ({err}).{fix}") from None


def check_vocab(ids: list[int], vocab_size: int, fix: str) -> None:
    if max(ids) >= vocab_size:
        raise UserError(f"workload.dataset: token id {max(ids)} is outside the model's vocabulary "
                        f"({vocab_size}). {fix}")


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

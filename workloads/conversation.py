"""Conversations: S sessions of T turns each, turn k's prompt the whole history so far.

A session's turn k sends every earlier user message and **the reply the engine actually gave**
to each, then the new user message (U tokens); the reply is capped at O tokens. With
`system_tokens` every prompt starts with the session's own system turn of that many tokens. The
next turn is due `think time` after the reply's last token (none, fixed, or exponential with the
given mean), and its clock starts then: TTFT counts from the turn's scheduled time, as serving's
requests do.
Sessions compete for the engine (and its KV pool) concurrently: all at once, K in flight (closed
loop: `concurrency`, a new session as one ends) or started at `session_rate` per second (open
loop: a Poisson process, or one every 1 / session_rate seconds with `arrival=constant`). For
every engine with a prefix cache the point runs with caching on and off (`prefix_caching`);
engines without one run "off" only.

In-process engines get the turns' token ids concatenated (with `separator_ids` between messages;
the row's `prompt_template` says which), or a dataset's messages rendered by the chat template,
tools included (`chat_template`; needed where a conversation has tool calls). An endpoint with
`api=chat` gets the messages as the API carries them at /v1/chat/completions, with the
conversation's tools, and the server applies its chat template (adapters/chat.py,
adapters/endpoint/bodies.py); with `api=completions` it gets the same ids as in-process engines.

Every request is recorded (`turn_requests`: session, turn, kind, prompt, history, new and reusable
tokens, the cached tokens the engine reported, TTFT, TPOT, E2EL; the prompt as the engine took it:
a server's own ids where it sends them), every turn index gets a row of `turns` and every turn
kind (user: the reply answers a user's message; tool: a tool's result) one of `turn_kinds`:
  - `history_share`: history tokens (the prompt's head that the session's previous turn held,
    token for token: its prompt and the engine's reply) / prompt tokens;
  - `reusable_share`: the prompt's head, in whole blocks of the engine's block size and never its
    last token, that the engine had computed when it was sent (requests finished by then and those
    in flight past their first token: their prompts and replies, but a reply's last token, which
    is sampled and never fed back), over prompt tokens: what a paged prefix cache can reuse at
    most (ConversationSource.reusable; other sessions' requests count too);
  - `hit_rate`: prompt tokens the engine reported taking from its cache, over prompt tokens
    (per request: the reference engine and vLLM say so; a server's usage
    prompt_tokens_details.cached_tokens where it sends it), and `prefilled_tokens` beside
    `reused_tokens`;
  - TTFT / TPOT / E2EL (p50, p90) of the turn's requests.
The point's engine counters (prefix-cache hits over queries, evictions, preemptions, the KV
pool's peak blocks) come from kv_cache_info() before and after.

Datasets: a ShareGPT file or a chat-format JSONL file (`dataset`; a Hub dataset `hf:ORG/NAME`
reaches here as its cached file) replays its conversations: one session per conversation, every
reply (a run of assistant messages after a user's message or a tool's results) one request, sent
once and in order with the messages before it as logged (tool calls and tool results included),
its cap the token count of the recorded reply (a tool-call reply: its calls'); a text reply's place
in the history is taken by the engine's own reply (`replies=recorded`: the recorded one), a reply
with tool calls keeps the recorded one (the results answer its calls). Think times and session
starts can come from the messages' timestamps. How the chat format is read and what is skipped,
counted in the row by reason: workloads/datasets.py; agentic traces: docs/conversation.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adapters.base import Capabilities, Engine, Request, RequestSource, TokenEvent, now_ns
from adapters.chat import call_text, decoder, is_template_text, read_template, template_ids, text_of, wire
from harness.core.errors import UserError
from harness.core.metrics import RequestTrace, common_prefix, serving_metrics
from harness.core.schema import spec
from harness.core.stats import summarize
from workloads import lora
from workloads.base import Collector, Point, RunContext, Workload, kv_memory_fields
from workloads.datasets import Chat, check_vocab, non_text_parts, read_chats, skips_line, tokenizer
from workloads.kv_tiers import (
    compare_tiers, tier_fields, tier_modes, tier_overrides, tier_param, tier_problems, tier_split, tier_unsupported,
    tiers_label,
)
from workloads.lengths import LengthDist, parse_length
from workloads.prompts import seed_for

THINK_TIMES = ("auto", "none", "fixed", "exponential", "recorded")
REPLIES = ("engine", "recorded")
KINDS = ("user", "tool")  # what a turn answers: a user's message, or a tool's result


@dataclass
class ConversationConfig:
    name: str = spec("conversation")
    sessions: int = spec(16, ge=1, help="conversations per point (S)")
    turns: Any = spec(4, help="turns per session (T): a number, or {dist: uniform, min: .., max: ..}")
    user_tokens: Any = spec(64, help="tokens of each new user message (U): a number or {dist: ...}")
    output_tokens: Any = spec(16, help="tokens of each reply (O, the cap asked for): a number or {dist: ...}")
    system_tokens: int = spec(0, ge=0, help="synthetic sessions: a system turn of this many tokens, each session's "
                                            "own, at the head of every prompt (0: none)")
    think_time: str = spec("auto", choices=THINK_TIMES,
                           help="time between a reply's end and the next turn: auto (a dataset's recorded gaps "
                                "where its messages have timestamps, else none) | none | fixed | exponential | "
                                "recorded (a dataset's gaps; needs timestamps)")
    think_time_s: float = spec(0.0, ge=0, help="the fixed think time, or the exponential's mean, in seconds")
    concurrency: int | None = spec(None, ge=1, help="closed loop: sessions in flight (a new one as one ends); "
                                                    "null: every session at once (or session_rate)")
    session_rate: float | None = spec(None, gt=0, help="open loop: sessions started per second (arrival); "
                                                       "null: all at once (or concurrency)")
    arrival: str = spec("poisson", choices=("poisson", "constant", "recorded"),
                        help="open loop: the sessions' starts, a Poisson process at session_rate or one every "
                             "1 / session_rate seconds (with a fixed think time: one turn in flight at a time); "
                             "recorded: a dataset's sessions start as they did (their first messages' timestamps, "
                             "from the earliest on)")
    prefix_caching: list[bool] = spec([True, False], nonempty=True, help="modes to compare")
    kv_tiers: list[Any] = spec(["off"], nonempty=True, help=(
        "KV tiers, with caching on (docs/metrics.md, \"KV tiers\"): off (the engine's pool alone: what it evicts "
        "is recomputed), full (one tier at the engine's default size, meant to hold every history: the upper "
        "bound), or a size (a second tier of that capacity behind the pool: 256MiB, 1GiB, 5e8)"))
    kv_tiers_full_bytes: Any = spec(None, help=(
        "the kv_tiers=full point's KV pool (kv_cache_bytes: bytes or a size, 512MiB); null: the engine's default "
        "pool, which need not hold every history (the reference engine's CPU default shrinks with max_num_seqs)"))
    separator_ids: list[int] = spec([], help="token ids put between messages when turns are concatenated "
                                             "(in-process engines, api=completions)")
    dataset: str | None = spec(None, help="ShareGPT JSON or chat-format JSONL file, or hf:ORG/NAME[/FILE] (a "
                                          "Hugging Face Hub dataset): its conversations replayed turn by turn "
                                          "(replaces sessions' lengths; sessions caps how many)")
    max_len: int | None = spec(None, ge=2, help="dataset: a conversation is cut before the turn whose prompt + "
                                                "reply would exceed this (default: the model's positions)")
    lora: dict[str, Any] | None = spec({}, help="LoRA adapters, one per session, split as workloads/lora.py says "
                                                "(a session keeps its adapter for every turn)")
    replies: str = spec("engine", choices=REPLIES, help=(
        "dataset: what takes a text reply's place in the later turns' history: the engine's own reply (engine) or "
        "the recorded one, as logged (recorded). A reply with tool calls is always the recorded one: the tool "
        "results that follow answer its calls"))
    chat_template: str | None = spec(None, help=(
        "dataset: the chat template that renders each turn's messages (tools included) for engines without a chat "
        "API (in-process, api=completions): a Jinja file, the template's text, or `checkpoint` (the checkpoint's "
        "own); null: the checkpoint's own where a conversation has tool calls or tools, else the messages' token "
        "ids concatenated (separator_ids between them)"))
    warmup_sessions: int | None = spec(None, ge=0, help="the point's first sessions replayed, all at once, on "
                                                        "unrelated tokens (then forgotten) before it is measured; "
                                                        "null: every session (the same batch shapes once)")


@dataclass
class Turn:
    """One request of a dataset conversation (workloads/datasets.py, Chat.replies): the messages
    since the previous reply (as logged: the chat API's fields, with their token ids beside them
    as `text_ids`), the recorded reply's messages, its length in tokens (the request's output
    length: text and tool calls, adapters.chat.call_text), what it answers (user | tool) and the
    tokens of its new messages (the warm-up's lengths)."""

    new: list[dict[str, Any]]
    reply: list[dict[str, Any]]
    cap: int
    kind: str
    new_tokens: int


@dataclass
class Session:
    """One conversation to play: its turns (synthetic: user messages as token ids; a dataset's:
    `turns`), reply caps, think times and when it starts (open loop); a dataset's tools."""

    index: int
    users: list[list[int]]  # synthetic sessions' user messages ([] for a dataset's: see turns)
    caps: list[int]
    think_s: list[float]
    start_s: float = 0.0
    system: list[int] | None = None  # synthetic sessions' system turn: the head of every prompt
    turns: list[Turn] | None = None  # a dataset conversation's turns
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    adapter: str | None = None  # the LoRA adapter serving every turn (None: the base model)
    first_ts: float | None = None  # a dataset conversation's first message's timestamp (arrival=recorded)


@dataclass
class TurnRecord:
    session: int
    turn: int  # 1-based
    request_id: str
    kind: str  # user | tool: what the turn answers
    prompt_ids: list[int]  # as the workload made them (an endpoint may report the ones it sent)
    messages: list[dict[str, Any]]
    prev: str | None  # the session's previous request


class BlockIndex:
    """The token sequences an engine has computed, as chains of whole blocks (a paged prefix
    cache's unit): `match(prompt)` is how much of a prompt's head a cache holding them could
    supply at most - whole blocks, never the prompt's last token (its logits are needed)."""

    def __init__(self, block_size: int | None):
        self.bs = block_size or 1
        self.keys: set[int] = set()

    def add(self, seq: list[int]) -> None:
        h, bs = 0, self.bs
        for j in range(len(seq) // bs):
            h = hash((h, tuple(seq[j * bs:(j + 1) * bs])))
            self.keys.add(h)

    def match(self, prompt: list[int]) -> int:
        h, bs, n = 0, self.bs, 0
        for j in range((len(prompt) - 1) // bs):
            h = hash((h, tuple(prompt[j * bs:(j + 1) * bs])))
            if h not in self.keys:
                break
            n = (j + 1) * bs
        return n


class ConversationSource(RequestSource):
    """The turns of every session as they become due. A session's first turn is due at its start
    (all at once, its open-loop start time, or when a closed-loop slot frees); every later turn is
    made when the previous one finishes - from the reply the engine gave, read from the collector
    (or, for a dataset's reply with tool calls and with replies=recorded, the recorded one) - and is
    due `think time` after it. A failed turn ends its session. `render(messages, tools)` makes a
    prompt's ids (a chat template's rendering); None: the messages' ids concatenated, `separator`
    between them. It keeps the order requests were handed out and finished in, for the reusable
    share (`reusable`)."""

    def __init__(self, sessions: list[Session], start_ns: int, collector: Collector, separator: list[int],
                 concurrency: int | None, open_loop: bool, block_size: int | None = None,
                 render: Callable[[list[dict[str, Any]], Any], list[int]] | None = None, replies: str = "engine"):
        self.start_ns = start_ns
        self.sessions = {s.index: s for s in sessions}
        self.collector = collector
        self.separator = list(separator)
        self.render = render
        self.replies = replies
        self.unstarted = list(sessions)
        self.ready: list[tuple[int, Request]] = []
        self.in_flight: dict[str, int] = {}  # request id -> session
        self.history: dict[int, list[dict[str, Any]]] = {}  # session -> messages so far
        self.records: dict[str, TurnRecord] = {}
        self.ended: dict[int, str] = {}  # session -> why it ended early
        self.last: dict[int, str] = {}  # session -> its latest request
        self.sent: list[str] = []  # request ids in the order they were handed out
        self.finished_before: dict[str, int] = {}  # request id -> requests finished when it was handed out
        self.finish_order: list[str] = []
        self.running_at: dict[str, dict[str, int]] = {}  # request id -> {request in flight then: its tokens so far}
        self.block_size = block_size
        self.open_loop = open_loop
        first = len(self.unstarted) if concurrency is None or open_loop else min(concurrency, len(self.unstarted))
        for _ in range(first):
            s = self.unstarted.pop(0)
            self._schedule(s, 0, start_ns + round(s.start_s * 1e9) if open_loop else start_ns)

    def prompt_of(self, messages: list[dict[str, Any]]) -> list[int]:
        out: list[int] = []
        for i, m in enumerate(messages):
            if i:
                out += self.separator
            out += m["ids"] if "ids" in m else m["text_ids"]
        return out

    def _schedule(self, s: Session, turn: int, at_ns: int) -> None:
        """Turn `turn` (0-based) of session `s`, due at `at_ns`."""
        history = self.history.setdefault(s.index, [{"role": "system", "ids": list(s.system)}] if s.system else [])
        if s.turns is None:
            new, kind = [{"role": "user", "ids": list(s.users[turn])}], "user"
        else:
            new, kind = s.turns[turn].new, s.turns[turn].kind
        messages = history + new
        prompt = self.render(messages, s.tools) if self.render else self.prompt_of(messages)
        rid = f"s{s.index}t{turn + 1}"
        r = Request(rid, prompt, s.caps[turn], (at_ns - self.start_ns) / 1e9, messages=messages, tools=s.tools,
                    tool_choice=s.tool_choice, adapter=s.adapter)
        self.records[rid] = TurnRecord(s.index, turn + 1, rid, kind, prompt, messages, self.last.get(s.index))
        self.last[s.index] = rid
        self.collector.add(r)
        self.ready.append((at_ns, r))
        self.ready.sort(key=lambda x: x[0])

    def due(self, now_ns: int) -> list[Request]:
        out = [r for at, r in self.ready if at <= now_ns]
        self.ready = [(at, r) for at, r in self.ready if at > now_ns]
        for r in out:
            running = {q: n for q in self.in_flight for n in [self.collector.trace(q).n_out] if n}
            self.in_flight[r.request_id] = self.records[r.request_id].session
            self.sent.append(r.request_id)
            self.finished_before[r.request_id] = len(self.finish_order)
            self.running_at[r.request_id] = running
        return out

    def next_due_ns(self) -> int | None:
        return self.ready[0][0] if self.ready else None

    def exhausted(self) -> bool:
        return not self.unstarted and not self.ready and not self.in_flight

    def _reply(self, s: Session, turn: int, tr: RequestTrace) -> list[dict[str, Any]] | None:
        """What takes turn `turn`'s (1-based) reply's place in the history: the recorded messages
        (replies=recorded, or a reply with tool calls), else the engine's own (None: its ids are
        unknown)."""
        recorded = s.turns[turn - 1].reply if s.turns is not None else None
        if recorded is not None and (self.replies == "recorded" or any(m.get("tool_calls") for m in recorded)):
            return recorded
        if any(t < 0 for t in tr.token_ids):
            return None
        return [{"role": "assistant", "ids": list(tr.token_ids)}]

    def finished(self, request_id: str, time_ns: int) -> None:
        sid = self.in_flight.pop(request_id, None)
        if sid is None:
            return
        self.finish_order.append(request_id)
        s, rec = self.sessions[sid], self.records[request_id]
        tr: RequestTrace = self.collector.trace(request_id)
        reply = None if tr.error or tr.n_out < s.caps[rec.turn - 1] else self._reply(s, rec.turn, tr)
        if reply is None:
            why = tr.error or ("the reply was cut short" if tr.n_out < s.caps[rec.turn - 1]
                               else "the engine's reply token ids are unknown (the server sent none)")
            self.ended[sid] = f"turn {rec.turn}: {why}"
            self._next_session(time_ns)
            return
        self.history[sid] = rec.messages + reply
        if rec.turn < len(s.caps):
            self._schedule(s, rec.turn, time_ns + round(s.think_s[rec.turn - 1] * 1e9))
        else:
            self._next_session(time_ns)

    def _next_session(self, time_ns: int) -> None:
        if self.unstarted and not self.open_loop:
            self._schedule(self.unstarted.pop(0), 0, time_ns)

    def computed(self, tr: RequestTrace, n: int | None = None) -> list[int]:
        """The tokens a request's prefill and decode computed once it had `n` tokens (None: all):
        its prompt (as the engine took it) and its reply but the last token (sampled, not yet fed
        back); nothing for a request that failed before its first token."""
        out = tr.token_ids[:n]
        if not out:
            return []
        prompt = tr.prompt_ids or self.records[tr.request_id].prompt_ids
        return prompt + ([] if any(t < 0 for t in out) else out[:-1])

    def reusable(self, traces: dict[str, RequestTrace]) -> dict[str, int]:
        """Per request, the prompt tokens a prefix cache could supply at most when it was handed
        out: its head, in whole blocks and never its last token, that the engine had computed by
        then - the requests finished before it (BlockIndex), and those in flight that had their
        first token (their prompts, and their replies so far). The session's earlier turns always
        count; a request handed out with it, or prefilling then, does not (an engine that schedules
        it first can report more)."""
        index, added, out = BlockIndex(self.block_size), 0, {}
        bs = self.block_size or 1
        for rid in self.sent:
            while added < self.finished_before[rid]:
                index.add(self.computed(traces[self.finish_order[added]]))
                added += 1
            prompt = traces[rid].prompt_ids or self.records[rid].prompt_ids
            best = index.match(prompt)
            for q, n in self.running_at[rid].items():
                best = max(best, min(common_prefix(prompt, self.computed(traces[q], n)), len(prompt) - 1) // bs * bs)
            out[rid] = best
        return out


def _dist(value: Any, field: str) -> tuple[LengthDist | None, list[str]]:
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        what = "a session needs at least one turn" if field.endswith("turns") else "at least 1 token"
        return None, [f"{field}={value}: {what}. Give a number >= 1 (or {{dist: uniform, min: .., max: ..}})."]
    return parse_length(value, field)


def think_times(kind: str, mean_s: float, n: int, rng: np.random.Generator) -> list[float]:
    if kind in ("none", "auto", "recorded"):  # a dataset's recorded gaps replace these (recorded_gaps)
        return [0.0] * n
    if kind == "fixed":
        return [float(mean_s)] * n
    return [float(x) for x in rng.exponential(mean_s, size=n)] if mean_s > 0 else [0.0] * n


def recorded_gaps(chat: Chat, n: int) -> list[float]:
    """The think time after each of a conversation's first `n` replies, from its messages'
    timestamps: the next turn's last new message (a user's, a tool's result) less the reply's last
    message; 0 where either has none (or the clock went back)."""
    out = []
    for k in range(n):
        gap = 0.0
        if k + 1 < len(chat.replies):
            t0, t1 = chat.times[chat.replies[k].end - 1], chat.times[chat.replies[k + 1].start - 1]
            if t0 is not None and t1 is not None:
                gap = max(0.0, t1 - t0)
        out.append(gap)
    return out


def open_loop(cfg: ConversationConfig) -> bool:
    """Sessions start at their own times (session_rate, or a dataset's recorded starts), not as
    others end."""
    return cfg.session_rate is not None or cfg.arrival == "recorded"


def needs_template(chat: Chat) -> bool:
    """Whether a conversation's prompts need a chat template (tools, tool calls): its messages'
    text alone does not hold them."""
    return bool(chat.tools) or any(m.get("tool_calls") for m in chat.messages)


def template_text(value: str | None) -> str | None:
    """workload.chat_template as a template's text (None: the checkpoint's own)."""
    return None if value in (None, "checkpoint") else read_template(value)


def _skips(skipped: Any) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())) or "nothing skipped"


class Conversation(Workload):
    name = "conversation"
    compared_metrics = ("ttft_s", "tpot_s", "e2el_s")
    config_cls = ConversationConfig
    reset_prefix_cache = True
    summary_columns = [
        ("prefix_caching", "caching", "s"), ("sessions", "sessions", "d"), ("completed", "turns done", "d"),
        ("ttft_s", "TTFT p50 ms", "ms"), ("ttft_later_s", "TTFT turns>1 ms", "ms"),
        ("hit_rate", "hit rate", ".3f"), ("reusable_share", "reusable", ".3f"),
        ("prefix_cache_evictions", "evicted blk", "d"), ("kv_blocks_peak", "peak blocks", "d"),
        ("kv_tiers_label", "tiers", "s"), ("hit_rate_tier2", "tier-2 hit", ".3f"),
    ]

    # ---- planning ------------------------------------------------------------------------------
    def _lengths(self, cfg: ConversationConfig) -> tuple[Any, Any, Any, list[str]]:
        t, p1 = _dist(cfg.turns, "workload.turns")
        u, p2 = _dist(cfg.user_tokens, "workload.user_tokens")
        o, p3 = _dist(cfg.output_tokens, "workload.output_tokens")
        return t, u, o, p1 + p2 + p3

    def check(self, cfg: ConversationConfig, shape: Any) -> list[str]:
        *_, problems = self._lengths(cfg)
        if cfg.think_time in ("fixed", "exponential") and cfg.think_time_s <= 0:
            problems.append(f"workload.think_time={cfg.think_time} needs workload.think_time_s > 0 "
                            "(seconds: the fixed value, or the exponential's mean); or use think_time=none.")
        if cfg.concurrency is not None and cfg.session_rate is not None:
            problems.append("workload.concurrency and workload.session_rate: give one (closed loop: sessions in "
                            "flight; open loop: sessions started per second), not both.")
        if cfg.system_tokens and cfg.dataset:
            problems.append(f"workload.system_tokens={cfg.system_tokens} makes synthetic sessions' system turns; "
                            f"workload.dataset={cfg.dataset} brings its own. Set workload.system_tokens=0.")
        if cfg.arrival == "recorded" and (cfg.session_rate is not None or cfg.concurrency is not None or not cfg.dataset):
            problems.append("workload.arrival=recorded starts a dataset's sessions at their recorded times: give "
                            "workload.dataset and neither session_rate nor concurrency.")
        elif cfg.arrival not in ("poisson", "recorded") and cfg.session_rate is None:
            problems.append(f"workload.arrival={cfg.arrival} spaces the sessions' starts at workload.session_rate, "
                            "which is null (all at once, or concurrency). Give workload.session_rate (sessions per "
                            "second), or leave arrival=poisson.")
        problems += tier_problems(cfg.kv_tiers, cfg.prefix_caching, full_bytes=cfg.kv_tiers_full_bytes)
        problems += lora.problems(cfg.lora, shape, self.name)
        if not cfg.dataset:
            for what, given, fix in (("chat_template", cfg.chat_template is not None, "null"),
                                     ("replies", cfg.replies != "engine", "engine"),
                                     ("think_time", cfg.think_time == "recorded", "none, fixed or exponential")):
                if given:
                    problems.append(f"workload.{what}={getattr(cfg, what)} applies to a dataset's conversations "
                                    f"(workload.dataset is null: synthetic sessions). Give workload.dataset=FILE, or "
                                    f"workload.{what}={fix}.")
        if cfg.chat_template not in (None, "checkpoint") and not is_template_text(cfg.chat_template) \
                and not Path(cfg.chat_template).expanduser().is_file():
            problems.append(f"workload.chat_template={cfg.chat_template}: no such file. Give a Jinja chat template "
                            "file, the template's text, or `checkpoint` (the checkpoint's own).")
        if cfg.dataset:
            try:
                chats = read_chats(cfg.dataset, view="replay")
                if cfg.think_time == "recorded" and not any(t is not None for c in chats.chats for t in c.times):
                    problems.append(f"workload.think_time=recorded: no message of {cfg.dataset} has a \"timestamp\". "
                                    "Use think_time=auto (none without timestamps), fixed or exponential.")
                if cfg.arrival == "recorded" and not all(c.times and c.times[0] is not None for c in chats.chats):
                    problems.append(f"workload.arrival=recorded: a conversation of {cfg.dataset} has no \"timestamp\" "
                                    "on its first message. Give one to every conversation, or use session_rate.")
            except UserError as e:
                problems += e.problems
        return problems or super().check(cfg, shape)

    def check_engines(self, cfg: ConversationConfig, engines: dict[str, type[Engine]]) -> list[str]:
        # the engines that take prompts as token ids (they need a chat template for tool calls): check_models
        def chat_api(cls: Any) -> bool:
            try:
                return bool(cls.capabilities().chat_api)
            except Exception:  # an engine that cannot say (not installed): it is refused elsewhere
                return True
        self._engines_without_chat = [n for n, cls in engines.items() if cls is not None and not chat_api(cls)]
        return []

    def check_models(self, cfg: ConversationConfig, model_path: str, models: dict[str, str]) -> list[str]:
        """A dataset with tool calls on an engine without a chat API needs a chat template; the
        template must render the dataset's conversations (exit 2 before anything runs)."""
        if not cfg.dataset:
            return []
        chats = read_chats(cfg.dataset, view="replay")
        without = getattr(self, "_engines_without_chat", ["an in-process engine"])
        needs = any(needs_template(c) for c in chats.chats)
        if cfg.chat_template is None and not (needs and without):
            return []
        try:
            tok = tokenizer(model_path, "a conversation file's text needs")
            template = template_text(cfg.chat_template)
            if template is None and not getattr(tok, "chat_template", None):
                return [f"workload.dataset={cfg.dataset} has tool calls or tools: {', '.join(without)} take(s) a "
                        f"prompt's token ids, which a chat template renders, and the checkpoint {model_path} has "
                        "none. Give workload.chat_template=FILE (a Jinja chat template that renders tools, tool "
                        "calls and tool messages), or replay it over a chat API (endpoints.<name>.api=chat)."]
            for c in chats.chats[:64]:
                template_ids(tok, c.messages, template, c.tools)
        except UserError as e:
            return e.problems
        except Exception as e:  # a template error: name it and the fix
            return [f"workload.chat_template: the template does not render {c.where}: {type(e).__name__}: {e}. "
                    "A template for tool calls renders the roles system, user, assistant (with tool_calls) and "
                    "tool, and the request's tools."]
        return []

    def max_model_len(self, cfg: ConversationConfig) -> int:
        t, u, o, problems = self._lengths(cfg)
        if problems:
            return 0
        if cfg.dataset:
            return cfg.max_len or 0
        turns = t.bounds()[1]
        system = cfg.system_tokens + len(cfg.separator_ids) if cfg.system_tokens else 0
        return system + turns * (u.bounds()[1] + o.bounds()[1]) + (2 * turns - 1) * len(cfg.separator_ids)

    def max_prefill_batch(self, cfg: ConversationConfig) -> tuple[int, int]:
        return 1, self.max_model_len(cfg)

    def plan(self, cfg: ConversationConfig) -> list[Point]:
        return [Point(self.name, {"prefix_caching": c, "sessions": cfg.sessions,
                                  **tier_param(t, cfg.kv_tiers_full_bytes), **lora.point_params(cfg.lora)})
                for c in dict.fromkeys(cfg.prefix_caching) for t in tier_modes(cfg.kv_tiers, c)]

    def unsupported(self, point: Point, caps: Capabilities) -> str | None:
        if point.params["prefix_caching"] and not caps.prefix_caching:
            return "the engine has no prefix cache"
        return tier_unsupported(point, caps) or lora.unsupported(point.params.get("lora"), caps)

    def engine_overrides(self, point: Point, caps: Capabilities) -> dict[str, Any]:
        out = {"prefix_caching": bool(point.params["prefix_caching"])} if caps.prefix_caching else {}
        return {**out, **tier_overrides(point, caps), **lora.overrides(point.params.get("lora"))}

    def finalize_row(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """A tiered point's turns beside the same engine's recompute (tiers off, caching on) and
        full-pool (`full`) points of this run: TTFT per turn of each, and whether the tiered one lies
        between them; and the break-even of reload against recompute (docs/metrics.md, "KV tiers")."""
        compare_tiers(row, rows, self.name)
        lora.finalize(row, rows)

    # ---- the sessions ----------------------------------------------------------------------------
    def sessions(self, cfg: ConversationConfig, ctx: RunContext, key: str,
                 caps: Capabilities | None = None) -> list[Session]:
        """The point's sessions: synthetic, or a dataset's conversations as the engine (`caps`: its
        chat API, the content parts it takes; None: an in-process engine's) can be sent them; the
        dataset's prompt renderer is left in `self.render` (None: token ids concatenated)."""
        rng = np.random.default_rng(seed_for(ctx.seed, key))
        out: list[Session] = []
        self.dataset_fields: dict[str, Any] = {}  # what reading the dataset skipped, for the row
        self.render: Callable[[list[dict[str, Any]], Any], list[int]] | None = None
        self.prompt_how = "concatenated token ids, " + (f"separator ids {cfg.separator_ids}" if cfg.separator_ids
                                                        else "no separator")
        self.recorded_think = False
        if cfg.dataset:
            caps = caps or Capabilities()
            chats = read_chats(cfg.dataset, view="replay")
            tok = tokenizer(ctx.model_path, "a conversation file's text needs")
            self.render, self.prompt_how = self._renderer(cfg, tok, caps, chats.chats)
            limit = cfg.max_len or ctx.max_model_len or ctx.shape.max_position_embeddings
            for chat in chats.chats:
                s = self._dataset_session(len(out), chat, cfg, tok, caps, limit, chats.skipped, ctx, rng)
                if s is not None:
                    out.append(s)
                if len(out) >= cfg.sessions:
                    break
            self.dataset_fields = chats.row_fields()
            if not out:
                raise ValueError(f"no conversation of {cfg.dataset} has a first turn that can be sent here "
                                 f"({_skips(chats.skipped)})")
        else:
            t, u, o, _ = self._lengths(cfg)
            for i in range(cfg.sessions):
                n = t.sample(1, rng)[0]
                lens, caps = u.sample(n, rng), o.sample(n, rng)
                users = [ctx.prompts(1, m, f"{key}/s{i}/u{k}")[0] for k, m in enumerate(lens)]
                system = ctx.prompts(1, cfg.system_tokens, f"{key}/s{i}/system")[0] if cfg.system_tokens else None
                out.append(Session(i, users, caps, think_times(cfg.think_time, cfg.think_time_s, n, rng), system=system))
        if cfg.arrival == "recorded" and out:
            first = min(s.first_ts for s in out)
            for s in out:
                s.start_s = s.first_ts - first
        elif cfg.session_rate is not None:
            gaps = (np.full(len(out), 1.0 / cfg.session_rate) if cfg.arrival == "constant"
                    else rng.exponential(1.0 / cfg.session_rate, size=len(out)))
            starts = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
            for s, st in zip(out, starts):
                s.start_s = float(st)
        return out

    def _renderer(self, cfg: ConversationConfig, tok: Any, caps: Capabilities,
                  chats: list[Chat]) -> tuple[Callable[[list[dict[str, Any]], Any], list[int]] | None, str]:
        """How a dataset turn's prompt ids are made, and the row's words for it: the chat template
        (workload.chat_template, or the checkpoint's own where a conversation has tool calls or a
        chat API's server renders it) or the messages' ids concatenated."""
        template = template_text(cfg.chat_template)
        own = bool(getattr(tok, "chat_template", None))
        use = cfg.chat_template is not None or (own and (caps.chat_api or any(needs_template(c) for c in chats)))
        if not use:
            if any(needs_template(c) for c in chats) and not caps.chat_api:
                raise UserError(f"workload.dataset={cfg.dataset} has tool calls or tools: an engine that takes token "
                                "ids needs a chat template to render them, and the checkpoint has none. Give "
                                "workload.chat_template=FILE, or replay it over a chat API (endpoints.<name>.api=chat).")
            return None, self.prompt_how
        decode = decoder(tok)

        def render(messages: list[dict[str, Any]], tools: Any) -> list[int]:
            return template_ids(tok, wire(messages, decode), template, tools)
        which = ("the checkpoint's own" if template is None else
                 "workload.chat_template" + ("" if is_template_text(cfg.chat_template) else f"={cfg.chat_template}"))
        return render, f"chat template ({which}), tools included"

    def _dataset_session(self, index: int, chat: Chat, cfg: ConversationConfig, tok: Any, caps: Capabilities,
                         limit: int, skipped: Any, ctx: RunContext, rng: np.random.Generator) -> Session | None:
        """One conversation as a session: each reply a turn, with the messages since the one before
        (as logged, their token ids beside them), its length (the recorded reply's tokens) and what
        it answers; cut before a turn the engine cannot be sent (a content part it does not take)
        or that would not fit in `limit` tokens (each counted), and after an empty one."""
        def ids_of(text: str) -> list[int]:
            return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []

        msgs = [dict(m) for m in chat.messages]
        for m in msgs:  # the message's tokens: its text, then its calls as the model writes them
            m["text_ids"] = ids_of(text_of(m.get("content"))) + [
                i for c in m.get("tool_calls") or () for i in ids_of(call_text(c))]
            if m["text_ids"]:
                check_vocab(m["text_ids"], ctx.shape.vocab_size, "Use a tokenizer made for this model.")
        turns: list[Turn] = []
        prev = 0
        n = len(chat.replies)
        for k, rep in enumerate(chat.replies):
            new, reply = msgs[prev:rep.start], msgs[rep.start:rep.end]
            cap = sum(len(m["text_ids"]) for m in reply)
            if any(p not in caps.content_parts for m in new for p in non_text_parts(m)):
                skipped["turn: non-text part the engine does not take"] += n - k
                break
            if cap < 1:
                skipped["turn: empty after tokenization"] += n - k
                break
            head = msgs[:rep.start]
            prompt = self.render(head, chat.tools) if self.render else sum(
                (m["text_ids"] + list(cfg.separator_ids) for m in head), [])
            if len(prompt) + cap > limit:
                skipped["turn: beyond workload.max_len"] += n - k
                break
            turns.append(Turn(new, reply, cap, rep.kind, sum(len(m["text_ids"]) for m in new)))
            prev = rep.end
        if not turns:
            return None
        think = think_times(cfg.think_time, cfg.think_time_s, len(turns), rng)
        if cfg.think_time in ("auto", "recorded"):
            think = recorded_gaps(chat, len(turns))
            self.recorded_think = self.recorded_think or any(t is not None for t in chat.times)
        return Session(index, [], [t.cap for t in turns], think, turns=turns, tools=chat.tools,
                       tool_choice=chat.tool_choice, first_ts=chat.times[0] if chat.times else None)

    # ---- one point -------------------------------------------------------------------------------
    def warm_up(self, engine: Engine, sessions: list[Session], point: Point, ctx: RunContext,
                cfg: ConversationConfig) -> None:
        """The first `warmup_sessions` sessions' shapes (and the prefix cache's path) served once,
        on unrelated tokens, each with its session's adapter."""
        n_warm = len(sessions) if cfg.warmup_sessions is None else cfg.warmup_sessions
        if not n_warm:
            return
        def lengths(s: Session) -> list[int]:  # a dataset turn's: the tokens of its new messages
            return [len(u) for u in s.users] if s.turns is None else [max(1, t.new_tokens) for t in s.turns]
        warm = [Session(i, [ctx.prompts(1, n, f"{point.key}/warm{i}/{k}")[0] for k, n in enumerate(lengths(s))],
                        list(s.caps), [0.0] * len(s.caps),
                        system=ctx.prompts(1, len(s.system), f"{point.key}/warm{i}/system")[0] if s.system else None)
                for i, s in enumerate(sessions[:n_warm])]
        for w, s in zip(warm, sessions):
            w.adapter = s.adapter
        wc = Collector([], now_ns())
        wc.source = ConversationSource(warm, wc.start_ns, wc, cfg.separator_ids, None, False)
        for ev in engine.serve(wc.source, wc.start_ns):
            wc.feed(ev)

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: ConversationConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        # the same sessions in every mode
        sessions = self.sessions(cfg, ctx, f"conversation/{cfg.sessions}", engine.capabilities())
        point_lora = point.params.get("lora")
        for s, a in zip(sessions, lora.assignment(point_lora, len(sessions), ctx.seed, f"conversation/{cfg.sessions}")):
            s.adapter = a  # the same for every engine and every mode
        self.warm_up(engine, sessions, point, ctx, cfg)
        engine.reset_prefix_cache()
        info0 = engine.kv_cache_info()
        lora0 = engine.lora_stats() if point_lora else None
        tiers0 = info0.extra.get("kv_tiers")
        start = now_ns() + 5_000_000
        collector = Collector([], start)
        source = ConversationSource(sessions, start, collector, cfg.separator_ids, cfg.concurrency,
                                    open_loop(cfg), info0.block_size, self.render, cfg.replies)
        collector.source = source
        # in-process engines: the KV blocks in use at each turn's first token (a server's /metrics is
        # scraped on its own, endpoints.<name>.metrics_interval_s: server_metrics)
        sample_kv = not engine.load_generator
        occupancy: dict[str, int] = {}
        sampler = ctx.sampler().start()
        events = engine.serve(source, start)
        try:
            for ev in events:
                collector.feed(ev)
                if sample_kv and isinstance(ev, TokenEvent) and ev.index == 0:
                    blocks = engine.kv_cache_info().blocks_in_use  # the pool as this turn's prefill left it
                    if blocks is not None:
                        occupancy[ev.request_id] = blocks
        finally:
            events.close()
        mem = sampler.stop()
        info = engine.kv_cache_info()
        traces = collector.traces()
        row = serving_metrics(traces, None, dict(collector.expected))
        if not row["completed"]:
            raise RuntimeError(f"no turn of the point completed: {row['failed_request_reasons']}")
        per_request = request_records(source, traces, occupancy)
        turns = turn_rows(per_request, info.num_blocks)
        later = [r["ttft_s"] for r in per_request if r["turn"] > 1 and r["ttft_s"] is not None and r["ok"]]
        hits = _delta(info.prefix_cache_hits, info0.prefix_cache_hits)
        queries = _delta(info.prefix_cache_queries, info0.prefix_cache_queries)
        evict0, evict1 = (i.extra.get("prefix_cache_evictions") for i in (info0, info))
        row.update(
            prefix_caching=bool(point.params["prefix_caching"]), sessions=len(sessions),
            sessions_cut_short=len(source.ended) or None, session_end_reasons=dict(source.ended) or None,
            turns_planned=sum(len(s.caps) for s in sessions), turns_sent=len(traces),
            turns_max=max(len(s.caps) for s in sessions),
            think_time=("recorded" if self.recorded_think else "none") if cfg.think_time in ("auto", "recorded")
            else cfg.think_time, think_time_s=cfg.think_time_s if cfg.think_time in ("fixed", "exponential") else None,
            load_mode="open" if open_loop(cfg) else "closed" if cfg.concurrency else "all",
            concurrency=cfg.concurrency, session_rate=cfg.session_rate,
            arrival=cfg.arrival if open_loop(cfg) else None, dataset=cfg.dataset, **self.dataset_fields,
            prompt_template=self.prompt_how if not engine.capabilities().chat_api else "the server's chat template "
            "(api=chat: the messages and tools as logged)", replies=cfg.replies if cfg.dataset else None,
            block_size=info0.block_size,
            turns=turns, turn_kinds=kind_rows(per_request), turn_requests=per_request,
            tool_turns=sum(1 for r in per_request if r["kind"] == "tool") if cfg.dataset else None,
            ttft_later_s=summarize(later)["p50"] if later else None,
            hit_rate=_share(per_request, "cached_tokens"), reusable_share=_share(per_request, "reusable_tokens"),
            history_share=_share(per_request, "history_tokens"),
            prefix_hit_rate=hits / queries if hits is not None and queries else None,
            prefix_cache_hits=hits, prefix_cache_queries=queries,
            prefix_counts_in=info.extra.get("prefix_counts_in") or info.extra.get("prefix_cache_unit"),
            prefix_cache_evictions=_delta(evict1, evict0), preemptions=_delta(info.preemptions, info0.preemptions),
            kv_blocks_total=info.num_blocks, kv_blocks_peak=info.blocks_peak, kv_pool_bytes=info.pool_bytes,
            kv_info=info.to_dict(), measured_output_tokens=row["total_output_tokens"], **mem.row_fields(),
            **kv_memory_fields(info, peak=True),
        )
        row.update(tier_fields(point, per_request, tiers0, info.extra.get("kv_tiers"), info, ctx))
        if point_lora:  # a session's turns are its adapter's requests
            row.update(lora.traffic_fields(point_lora, list(collector.requests.values()), traces,
                                           dict(collector.expected), lora0, engine.lora_stats()))
            # the split is drawn per session: its test counts sessions, not turns
            row.update(lora_split_unit="session", lora_sent={e: sum(1 for s in sessions if lora.entry(s.adapter) == e)
                                                            for e in row["lora_shares"]})
        return row

    def post_summary(self, rows: list[dict[str, Any]]) -> str:
        mine = [r for r in rows if r.get("workload") == self.name]
        lines = [line for line in dict.fromkeys(skips_line(r) for r in mine) if line][:1]  # every engine read the same file
        lines += lora.summary_lines(mine)
        for r in rows:
            if r.get("workload") != self.name or not r.get("turns"):
                continue
            tiers = r.get("kv_tiers") or "off"
            lines.append(f"{r.get('engine')} caching={'on' if r.get('prefix_caching') else 'off'}"
                         f"{'' if tiers == 'off' else f' kv_tiers={tiers_label(tiers)}'}: per turn")
            tiered = any(t.get("hit_rate_tier2") is not None for t in r["turns"])
            lines.append("  turn  reqs  prompt  reusable  hit rate  TTFT p50 ms"
                         + ("  tier-1 hit  tier-2 hit  TTFT recompute  TTFT full  between  resolved" if tiered else ""))
            for t in r["turns"]:
                hr = "   -   " if t["hit_rate"] is None else f"{t['hit_rate']:7.3f}"
                ttft = "-" if t["ttft_s"] is None else f"{t['ttft_s'] * 1e3:.1f}"
                line = (f"  {t['turn']:>4}  {t['requests']:>4}  {t['prompt_tokens_mean']:>6.0f}  "
                        f"{t['reusable_share']:>8.3f}  {hr}  {ttft:>11}")
                if tiered:
                    def ms(v: Any) -> str:
                        return "-" if v is None else f"{v * 1e3:.1f}"

                    def share(v: Any) -> str:
                        return "-" if v is None else f"{v:.3f}"
                    def yes(v: Any) -> str:
                        return "-" if v is None else "yes" if v else "no"
                    line += (f"  {share(t.get('hit_rate_tier1')):>10}  {share(t.get('hit_rate_tier2')):>10}  "
                             f"{ms(t.get('ttft_recompute_s')):>14}  {ms(t.get('ttft_full_s')):>9}  "
                             f"{yes(t.get('ttft_between')):>7}  {yes(t.get('ttft_between_resolved')):>8}")
                lines.append(line)
            kinds = r.get("turn_kinds") or []
            if len(kinds) > 1:  # an agent's trace: turns answering a user's message, turns answering a tool's result
                lines.append("  kind  reqs  prompt  growth  reusable  hit rate  TTFT p50 ms  TTFT p90 ms")
                for k in kinds:
                    hr = "   -   " if k["hit_rate"] is None else f"{k['hit_rate']:7.3f}"
                    growth = "-" if k["growth_tokens_mean"] is None else f"{k['growth_tokens_mean']:.0f}"
                    ttft = ["-" if v is None else f"{v * 1e3:.1f}" for v in (k["ttft_s"], k["ttft_s_p90"])]
                    lines.append(f"  {k['kind']:>4}  {k['requests']:>4}  {k['prompt_tokens_mean']:>6.0f}  {growth:>6}  "
                                 f"{k['reusable_share']:>8.3f}  {hr}  {ttft[0]:>11}  {ttft[1]:>11}")
        return "\n".join(lines)


def _delta(after: Any, before: Any) -> Any:
    return after - (before or 0) if after is not None else None


def request_records(source: ConversationSource, traces: list[RequestTrace],
                    occupancy: dict[str, int]) -> list[dict[str, Any]]:
    """One record per request sent: its session, turn and kind; its prompt as the engine took it
    (an endpoint's report, else the workload's ids), how much of it the session's previous turn
    held (history: that turn's prompt and its reply, token for token) and how much a prefix cache
    could supply (reusable: ConversationSource.reusable); the cached tokens the engine reported;
    its timings."""
    by_id = {t.request_id: t for t in traces}
    reusable = source.reusable(by_id)
    out = []
    for tr in traces:
        rec = source.records[tr.request_id]
        prompt = tr.prompt_ids or rec.prompt_ids
        before = by_id.get(rec.prev) if rec.prev else None
        history = 0
        if before is not None:
            prev_prompt = before.prompt_ids or source.records[before.request_id].prompt_ids
            history = common_prefix(prompt, prev_prompt + [t for t in before.token_ids if t >= 0])
            growth = len(prompt) - len(prev_prompt)
        else:
            growth = len(prompt)
        out.append(request_record(rec, tr, len(prompt), history, growth, reusable.get(tr.request_id, 0),
                                  occupancy.get(tr.request_id)))
    return out


def request_record(rec: TurnRecord, tr: RequestTrace, prompt_tokens: int, history: int, growth: int, reusable: int,
                   kv_blocks: int | None = None) -> dict[str, Any]:
    ok = not tr.error and tr.n_out > 0
    return {"session": rec.session, "turn": rec.turn, "kind": rec.kind, "request_id": rec.request_id, "ok": ok,
            "error": tr.error, "prompt_tokens": prompt_tokens, "history_tokens": history,
            "new_tokens": prompt_tokens - history, "growth_tokens": growth, "reusable_tokens": reusable,
            "cached_tokens": tr.cached_tokens, "reloaded_tokens": tr.reloaded_tokens, "output_tokens": tr.n_out,
            "ttft_s": tr.ttft_s, "tpot_s": tr.tpot_s, "e2el_s": tr.e2el_s, "kv_blocks_in_use": kv_blocks}


def _share(reqs: list[dict[str, Any]], key: str) -> float | None:
    """Σ key / Σ prompt tokens over the requests that completed and report `key`."""
    use = [r for r in reqs if r["ok"] and r.get(key) is not None]
    total = sum(r["prompt_tokens"] for r in use)
    return sum(r[key] for r in use) / total if use and total else None


def kind_rows(reqs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per turn kind (user: the reply answers a user's message; tool: a tool's result):
    requests, TTFT (p50, p90), the hit rate beside the reusable share, and the prompt's growth
    (tokens added since the session's previous turn: that turn's reply and the new messages)."""
    out = []
    for kind in [k for k in KINDS if any(r.get("kind") == k for r in reqs)]:
        mine = [r for r in reqs if r.get("kind") == kind]
        ok = [r for r in mine if r["ok"]]
        t = summarize([r["ttft_s"] for r in ok])
        hit, reusable = _share(ok, "cached_tokens"), _share(ok, "reusable_tokens")
        later = [r for r in ok if r["turn"] > 1]
        out.append({
            "kind": kind, "requests": len(mine), "completed": len(ok),
            "prompt_tokens_mean": sum(r["prompt_tokens"] for r in ok) / len(ok) if ok else 0.0,
            "growth_tokens_mean": sum(r["growth_tokens"] for r in later) / len(later) if later else None,
            "new_tokens_mean": sum(r["new_tokens"] for r in ok) / len(ok) if ok else 0.0,
            "output_tokens_mean": sum(r["output_tokens"] for r in ok) / len(ok) if ok else 0.0,
            "reusable_share": reusable or 0.0, "hit_rate": hit,
            "hit_minus_reusable": hit - (reusable or 0.0) if hit is not None else None,
            "ttft_s": t["p50"], "ttft_s_p90": t["p90"],
        })
    return out


def turn_rows(reqs: list[dict[str, Any]], num_blocks: int | None = None) -> list[dict[str, Any]]:
    """One entry per turn index: requests, mean lengths, history / reusable share, the hit rate the
    engine reported, prefilled vs reused tokens, TTFT / TPOT / E2EL, and the KV pool's occupancy
    at the turn's first tokens (blocks in use / the pool's blocks, mean over its requests)."""
    out = []
    for k in sorted({r["turn"] for r in reqs}):
        mine = [r for r in reqs if r["turn"] == k]
        ok = [r for r in mine if r["ok"]]
        cached = [r["cached_tokens"] for r in ok if r["cached_tokens"] is not None]
        t = summarize([r["ttft_s"] for r in ok])
        tp = summarize([r["tpot_s"] for r in ok if r["tpot_s"] is not None])
        e = summarize([r["e2el_s"] for r in ok])
        prompt = sum(r["prompt_tokens"] for r in ok)
        hit = _share(ok, "cached_tokens")
        reusable = _share(ok, "reusable_tokens")
        blocks = [r["kv_blocks_in_use"] for r in ok if r.get("kv_blocks_in_use") is not None]
        split = tier_split(ok)
        out.append({**split,
            "turn": k, "requests": len(mine), "completed": len(ok),
            "kv_occupancy": sum(blocks) / len(blocks) / num_blocks if blocks and num_blocks else None,
            "prompt_tokens_mean": prompt / len(ok) if ok else 0.0,
            "history_tokens_mean": sum(r["history_tokens"] for r in ok) / len(ok) if ok else 0.0,
            "new_tokens_mean": sum(r["new_tokens"] for r in ok) / len(ok) if ok else 0.0,
            "history_share": _share(ok, "history_tokens") or 0.0, "reusable_share": reusable or 0.0,
            "hit_rate": hit, "hit_minus_reusable": hit - (reusable or 0.0) if hit is not None else None,
            "reused_tokens": sum(cached) if cached else None,
            "prefilled_tokens": prompt - sum(cached) if cached and len(cached) == len(ok) else None,
            "ttft_s": t["p50"], "ttft_s_p90": t["p90"], "tpot_s": tp["p50"], "e2el_s": e["p50"],
            "e2el_s_p90": e["p90"],
        })
    return out

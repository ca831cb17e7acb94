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
the row's `prompt_template` says which). An endpoint with `api=chat` gets the messages with their
roles at /v1/chat/completions and the server applies the chat template
(adapters/endpoint/engine.py); with `api=completions` it gets the concatenated ids too.

Every request is recorded (`turn_requests`: session, turn, prompt, history, new and reusable
tokens, the cached tokens the engine reported, TTFT, TPOT, E2EL), and every turn index gets a row
of `turns`:
  - `history_share`: history tokens / prompt tokens (what a perfect cache could skip);
  - `reusable_share`: the history's tokens whose K/V the previous turn computed (all but the
    reply's last token, which is sampled and never fed back) in whole blocks of the engine's
    block size, over prompt tokens: what a paged prefix cache can reuse at most;
  - `hit_rate`: prompt tokens the engine reported taking from its cache, over prompt tokens
    (per request: the reference engine and vLLM say so; a server's usage
    prompt_tokens_details.cached_tokens where it sends it), and `prefilled_tokens` beside
    `reused_tokens`;
  - TTFT / TPOT / E2EL (p50, p90) of the turn's requests.
The point's engine counters (prefix-cache hits over queries, evictions, preemptions, the KV
pool's peak blocks) come from kv_cache_info() before and after.

Datasets: a ShareGPT file or a chat-format JSONL file (`dataset`; a Hub dataset `hf:ORG/NAME`
reaches here as its cached file) replays its conversations: one session per conversation, its
system turn at the head of every prompt, every answered user turn sent once and in order, each
reply's cap the token count of the recorded reply; the recorded replies themselves are not sent:
the engine's own replies take their place in the history. How real logs are read (role names,
two messages of one role in a row, empty replies) and what is skipped, counted in the row by
reason: workloads/datasets.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from adapters.base import Capabilities, Engine, Request, RequestSource, TokenEvent, now_ns
from harness.core.errors import UserError
from harness.core.metrics import RequestTrace, serving_metrics
from harness.core.schema import spec
from harness.core.stats import summarize
from workloads import lora
from workloads.base import Collector, Point, RunContext, Workload, kv_memory_fields
from workloads.datasets import read_chats, skips_line, tokenize_chats
from workloads.kv_tiers import (
    compare_tiers, tier_fields, tier_modes, tier_overrides, tier_param, tier_problems, tier_split, tier_unsupported,
    tiers_label,
)
from workloads.lengths import LengthDist, parse_length
from workloads.prompts import seed_for

THINK_TIMES = ("none", "fixed", "exponential")


@dataclass
class ConversationConfig:
    name: str = spec("conversation")
    sessions: int = spec(16, ge=1, help="conversations per point (S)")
    turns: Any = spec(4, help="turns per session (T): a number, or {dist: uniform, min: .., max: ..}")
    user_tokens: Any = spec(64, help="tokens of each new user message (U): a number or {dist: ...}")
    output_tokens: Any = spec(16, help="tokens of each reply (O, the cap asked for): a number or {dist: ...}")
    system_tokens: int = spec(0, ge=0, help="synthetic sessions: a system turn of this many tokens, each session's "
                                            "own, at the head of every prompt (0: none)")
    think_time: str = spec("none", choices=THINK_TIMES,
                           help="time between a reply's end and the next turn: none | fixed | exponential")
    think_time_s: float = spec(0.0, ge=0, help="the fixed think time, or the exponential's mean, in seconds")
    concurrency: int | None = spec(None, ge=1, help="closed loop: sessions in flight (a new one as one ends); "
                                                    "null: every session at once (or session_rate)")
    session_rate: float | None = spec(None, gt=0, help="open loop: sessions started per second (arrival); "
                                                       "null: all at once (or concurrency)")
    arrival: str = spec("poisson", choices=("poisson", "constant"),
                        help="open loop: the sessions' starts, a Poisson process at session_rate or one every "
                             "1 / session_rate seconds (with a fixed think time: one turn in flight at a time)")
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
    warmup_sessions: int | None = spec(None, ge=0, help="the point's first sessions replayed, all at once, on "
                                                        "unrelated tokens (then forgotten) before it is measured; "
                                                        "null: every session (the same batch shapes once)")


@dataclass
class Session:
    """One conversation to play: its user messages and reply caps (token ids known up front),
    its think times and when it starts (open loop)."""

    index: int
    users: list[list[int]]
    caps: list[int]
    think_s: list[float]
    start_s: float = 0.0
    system: list[int] | None = None  # a dataset conversation's system turn: the head of every prompt
    adapter: str | None = None  # the LoRA adapter serving every turn (None: the base model)


@dataclass
class TurnRecord:
    session: int
    turn: int  # 1-based
    request_id: str
    prompt_tokens: int
    history_tokens: int
    new_tokens: int
    reusable_tokens: int
    messages: list[dict[str, Any]]


def reusable_tokens(history: int, prompt: int, block_size: int | None) -> int:
    """Tokens of a turn's prompt a prefix cache can supply at most: the history's tokens whose K/V
    the previous turn computed (all but its reply's last token), never the prompt's last token
    (its logits are needed), in whole blocks where the engine pages."""
    n = max(0, min(history - 1, prompt - 1))
    bs = block_size or 1
    return n // bs * bs


class ConversationSource(RequestSource):
    """The turns of every session as they become due. A session's first turn is due at its start
    (all at once, its open-loop start time, or when a closed-loop slot frees); every later turn is
    made when the previous one finishes - from the reply the engine gave, read from the collector -
    and is due `think time` after it. A failed turn ends its session."""

    def __init__(self, sessions: list[Session], start_ns: int, collector: Collector, separator: list[int],
                 concurrency: int | None, open_loop: bool, block_size: int | None = None):
        self.start_ns = start_ns
        self.sessions = {s.index: s for s in sessions}
        self.collector = collector
        self.separator = list(separator)
        self.unstarted = list(sessions)
        self.ready: list[tuple[int, Request]] = []
        self.in_flight: dict[str, int] = {}  # request id -> session
        self.history: dict[int, list[dict[str, Any]]] = {}  # session -> messages so far
        self.records: dict[str, TurnRecord] = {}
        self.ended: dict[int, str] = {}  # session -> why it ended early
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
            out += m["ids"]
        return out

    def _schedule(self, s: Session, turn: int, at_ns: int) -> None:
        """Turn `turn` (0-based) of session `s`, due at `at_ns`."""
        history = self.history.setdefault(s.index, [{"role": "system", "ids": list(s.system)}] if s.system else [])
        hist_ids = self.prompt_of(history)
        messages = history + [{"role": "user", "ids": list(s.users[turn])}]
        prompt = self.prompt_of(messages)
        hist_len = len(hist_ids) + (len(self.separator) if history else 0)  # the separator before the new message is history too
        rid = f"s{s.index}t{turn + 1}"
        r = Request(rid, prompt, s.caps[turn], (at_ns - self.start_ns) / 1e9, messages=messages, adapter=s.adapter)
        # the first turn's history (a system turn) was computed by no earlier turn of the session
        reusable = reusable_tokens(len(hist_ids), len(prompt), self.block_size) if turn else 0
        self.records[rid] = TurnRecord(s.index, turn + 1, rid, len(prompt), hist_len, len(prompt) - hist_len,
                                       reusable, messages)
        self.collector.add(r)
        self.ready.append((at_ns, r))
        self.ready.sort(key=lambda x: x[0])

    def due(self, now_ns: int) -> list[Request]:
        out = [r for at, r in self.ready if at <= now_ns]
        self.ready = [(at, r) for at, r in self.ready if at > now_ns]
        for r in out:
            self.in_flight[r.request_id] = self.records[r.request_id].session
        return out

    def next_due_ns(self) -> int | None:
        return self.ready[0][0] if self.ready else None

    def exhausted(self) -> bool:
        return not self.unstarted and not self.ready and not self.in_flight

    def finished(self, request_id: str, time_ns: int) -> None:
        sid = self.in_flight.pop(request_id, None)
        if sid is None:
            return
        s, rec = self.sessions[sid], self.records[request_id]
        tr: RequestTrace = self.collector.trace(request_id)
        if tr.error or tr.n_out < s.caps[rec.turn - 1] or any(t < 0 for t in tr.token_ids):
            why = tr.error or ("the engine's reply token ids are unknown (the server sent none)"
                               if any(t < 0 for t in tr.token_ids) else "the reply was cut short")
            self.ended[sid] = f"turn {rec.turn}: {why}"
            self._next_session(time_ns)
            return
        self.history[sid] = rec.messages + [{"role": "assistant", "ids": list(tr.token_ids)}]
        if rec.turn < len(s.users):
            self._schedule(s, rec.turn, time_ns + round(s.think_s[rec.turn - 1] * 1e9))
        else:
            self._next_session(time_ns)

    def _next_session(self, time_ns: int) -> None:
        if self.unstarted and not self.open_loop:
            self._schedule(self.unstarted.pop(0), 0, time_ns)


def _dist(value: Any, field: str) -> tuple[LengthDist | None, list[str]]:
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        what = "a session needs at least one turn" if field.endswith("turns") else "at least 1 token"
        return None, [f"{field}={value}: {what}. Give a number >= 1 (or {{dist: uniform, min: .., max: ..}})."]
    return parse_length(value, field)


def think_times(kind: str, mean_s: float, n: int, rng: np.random.Generator) -> list[float]:
    if kind == "none":
        return [0.0] * n
    if kind == "fixed":
        return [float(mean_s)] * n
    return [float(x) for x in rng.exponential(mean_s, size=n)] if mean_s > 0 else [0.0] * n


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
        if cfg.think_time != "none" and cfg.think_time_s <= 0:
            problems.append(f"workload.think_time={cfg.think_time} needs workload.think_time_s > 0 "
                            "(seconds: the fixed value, or the exponential's mean); or use think_time=none.")
        if cfg.concurrency is not None and cfg.session_rate is not None:
            problems.append("workload.concurrency and workload.session_rate: give one (closed loop: sessions in "
                            "flight; open loop: sessions started per second), not both.")
        if cfg.system_tokens and cfg.dataset:
            problems.append(f"workload.system_tokens={cfg.system_tokens} makes synthetic sessions' system turns; "
                            f"workload.dataset={cfg.dataset} brings its own. Set workload.system_tokens=0.")
        if cfg.arrival != "poisson" and cfg.session_rate is None:
            problems.append(f"workload.arrival={cfg.arrival} spaces the sessions' starts at workload.session_rate, "
                            "which is null (all at once, or concurrency). Give workload.session_rate (sessions per "
                            "second), or leave arrival=poisson.")
        problems += tier_problems(cfg.kv_tiers, cfg.prefix_caching, full_bytes=cfg.kv_tiers_full_bytes)
        problems += lora.problems(cfg.lora, shape, self.name)
        if cfg.dataset:
            try:
                read_chats(cfg.dataset)
            except UserError as e:
                problems += e.problems
        return problems or super().check(cfg, shape)

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
    def sessions(self, cfg: ConversationConfig, ctx: RunContext, key: str) -> list[Session]:
        rng = np.random.default_rng(seed_for(ctx.seed, key))
        out: list[Session] = []
        self.dataset_fields: dict[str, Any] = {}  # what reading the dataset skipped, for the row
        if cfg.dataset:
            chats = read_chats(cfg.dataset)
            convs = tokenize_chats(chats, ctx.model_path, ctx.shape.vocab_size)
            limit = cfg.max_len or ctx.max_model_len or ctx.shape.max_position_embeddings
            sep = len(cfg.separator_ids)
            for conv in convs:
                users, caps = [], []
                total = len(conv.system) + sep if conv.system else 0
                for user, cap in conv.turns:
                    total += len(user) + cap + (2 * sep if users else 0)
                    if total > limit:
                        chats.skipped["turn: beyond workload.max_len"] += len(conv.turns) - len(users)
                        break
                    users.append(user)
                    caps.append(cap)
                if users:
                    out.append(Session(len(out), users, caps, think_times(cfg.think_time, cfg.think_time_s,
                                                                          len(users), rng), system=conv.system))
                if len(out) >= cfg.sessions:
                    break
            self.dataset_fields = chats.row_fields()
            if not out:
                raise ValueError(f"no conversation of {cfg.dataset} has a first turn that fits in {limit} tokens "
                                 "(workload.max_len)")
        else:
            t, u, o, _ = self._lengths(cfg)
            for i in range(cfg.sessions):
                n = t.sample(1, rng)[0]
                lens, caps = u.sample(n, rng), o.sample(n, rng)
                users = [ctx.prompts(1, m, f"{key}/s{i}/u{k}")[0] for k, m in enumerate(lens)]
                system = ctx.prompts(1, cfg.system_tokens, f"{key}/s{i}/system")[0] if cfg.system_tokens else None
                out.append(Session(i, users, caps, think_times(cfg.think_time, cfg.think_time_s, n, rng), system=system))
        if cfg.session_rate is not None:
            gaps = (np.full(len(out), 1.0 / cfg.session_rate) if cfg.arrival == "constant"
                    else rng.exponential(1.0 / cfg.session_rate, size=len(out)))
            starts = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
            for s, st in zip(out, starts):
                s.start_s = float(st)
        return out

    # ---- one point -------------------------------------------------------------------------------
    def warm_up(self, engine: Engine, sessions: list[Session], point: Point, ctx: RunContext,
                cfg: ConversationConfig) -> None:
        """The first `warmup_sessions` sessions' shapes (and the prefix cache's path) served once,
        on unrelated tokens, each with its session's adapter."""
        n_warm = len(sessions) if cfg.warmup_sessions is None else cfg.warmup_sessions
        if not n_warm:
            return
        warm = [Session(i, [ctx.prompts(1, len(u), f"{point.key}/warm{i}/{k}")[0] for k, u in enumerate(s.users)],
                        list(s.caps), [0.0] * len(s.users),
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
        sessions = self.sessions(cfg, ctx, f"conversation/{cfg.sessions}")  # the same sessions in every mode
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
                                    cfg.session_rate is not None, info0.block_size)
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
        records = [source.records[t.request_id] for t in traces]
        per_request = [request_record(rec, tr, occupancy.get(tr.request_id)) for rec, tr in zip(records, traces)]
        turns = turn_rows(per_request, info.num_blocks)
        later = [r["ttft_s"] for r in per_request if r["turn"] > 1 and r["ttft_s"] is not None and r["ok"]]
        hits = _delta(info.prefix_cache_hits, info0.prefix_cache_hits)
        queries = _delta(info.prefix_cache_queries, info0.prefix_cache_queries)
        evict0, evict1 = (i.extra.get("prefix_cache_evictions") for i in (info0, info))
        row.update(
            prefix_caching=bool(point.params["prefix_caching"]), sessions=len(sessions),
            sessions_cut_short=len(source.ended) or None, session_end_reasons=dict(source.ended) or None,
            turns_planned=sum(len(s.users) for s in sessions), turns_sent=len(traces),
            turns_max=max(len(s.users) for s in sessions),
            think_time=cfg.think_time, think_time_s=cfg.think_time_s if cfg.think_time != "none" else None,
            load_mode="open" if cfg.session_rate is not None else "closed" if cfg.concurrency else "all",
            concurrency=cfg.concurrency, session_rate=cfg.session_rate,
            arrival=cfg.arrival if cfg.session_rate is not None else None, dataset=cfg.dataset, **self.dataset_fields,
            prompt_template=("concatenated token ids, " + (f"separator ids {cfg.separator_ids}" if cfg.separator_ids
                                                          else "no separator")),
            block_size=info0.block_size,
            turns=turns, turn_requests=per_request,
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
        return "\n".join(lines)


def _delta(after: Any, before: Any) -> Any:
    return after - (before or 0) if after is not None else None


def request_record(rec: TurnRecord, tr: RequestTrace, kv_blocks: int | None = None) -> dict[str, Any]:
    ok = not tr.error and tr.n_out > 0
    return {"session": rec.session, "turn": rec.turn, "request_id": rec.request_id, "ok": ok,
            "error": tr.error, "prompt_tokens": rec.prompt_tokens, "history_tokens": rec.history_tokens,
            "new_tokens": rec.new_tokens, "reusable_tokens": rec.reusable_tokens,
            "cached_tokens": tr.cached_tokens, "reloaded_tokens": tr.reloaded_tokens, "output_tokens": tr.n_out,
            "ttft_s": tr.ttft_s, "tpot_s": tr.tpot_s, "e2el_s": tr.e2el_s, "kv_blocks_in_use": kv_blocks}


def _share(reqs: list[dict[str, Any]], key: str) -> float | None:
    """Σ key / Σ prompt tokens over the requests that completed and report `key`."""
    use = [r for r in reqs if r["ok"] and r.get(key) is not None]
    total = sum(r["prompt_tokens"] for r in use)
    return sum(r[key] for r in use) / total if use and total else None


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

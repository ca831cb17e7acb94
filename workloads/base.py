"""The workload interface and the context a workload gets at run time."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from collections.abc import Iterable

from adapters.base import Capabilities, Engine, KVCacheInfo, Request, RequestFailed, TokenEvent
from harness.core.compared import register_compared
from harness.core.memory import MemorySampler
from harness.core.metrics import RequestTrace
from harness.core.presets import ModelShape
from harness.core.summary import summary_table
from workloads.prompts import synthetic_prompts


@dataclass(frozen=True)
class Point:
    """One measured point of a workload: its parameters, JSON-serialisable."""

    workload: str
    params: dict[str, Any]

    @property
    def key(self) -> str:
        """Identity of the point across runs (matching, resume): workload + sorted params."""
        return self.workload + ":" + json.dumps(self.params, sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "params": self.params}

    def bigger_batch_of(self, other: "Point") -> bool:
        """True if this point is `other` with a larger batch size (same everything else): after
        `other` ran out of memory, this one would too, and is skipped."""
        if self.workload != other.workload or "batch_size" not in self.params:
            return False
        rest = {k: v for k, v in self.params.items() if k != "batch_size"}
        other_rest = {k: v for k, v in other.params.items() if k != "batch_size"}
        return rest == other_rest and self.params["batch_size"] > other.params.get("batch_size", 0)


OOM_MARKERS = ("out of memory", "outofmemoryerror", "cannot allocate memory", "can't allocate memory",
               "memoryerror", "failed to allocate")


def is_oom(error: str | None) -> bool:
    return bool(error) and any(m in error.lower() for m in OOM_MARKERS)  # type: ignore[union-attr]


# Memory columns of the terminal summary: the KV pool reserved up front apart from the KV in use
# and from the process tree's peak (which includes any reserved pool).
MEMORY_COLUMNS = [("kv_reserved_bytes", "KV rsv MiB", "mib"), ("kv_used_bytes", "KV used MiB", "mib"),
                  ("peak_memory_bytes", "proc peak MiB", "mib")]


def kv_memory_fields(kv: KVCacheInfo, peak: bool = False) -> dict[str, Any]:
    """`kv_reserved_bytes` (the pool allocated up front, whatever is in use; null for an engine
    that allocates as it goes), `kv_used_bytes` (what the live sequences hold; with peak=True the
    most they held during the point) and `kv_cache_bytes` (the KV storage the engine holds now)."""
    reserved = kv.reserved if kv.reserved is not None else kv.num_blocks is not None
    blocks = kv.blocks_peak if peak and kv.blocks_peak is not None else kv.blocks_in_use
    if blocks is not None and kv.bytes_per_block:
        used = blocks * kv.bytes_per_block
    elif kv.slots_allocated is not None and kv.bytes_per_token:
        used = kv.slots_allocated * kv.bytes_per_token
    else:
        used = None
    return {"kv_reserved_bytes": kv.pool_bytes if reserved else None, "kv_used_bytes": used,
            "kv_cache_bytes": kv.pool_bytes}


def memory_note(rows: list[dict[str, Any]]) -> str:
    """What the memory columns compare, when an engine reserved its KV pool up front."""
    reserving = sorted({r["engine"] for r in rows if r.get("kv_reserved_bytes")})
    if not reserving:
        return ""
    return (f"memory: {', '.join(reserving)} reserve{'s' if len(reserving) == 1 else ''} a KV pool up front (KV rsv), "
            "so its process peak includes that pool whatever the batch needs; compare engines on KV used, "
            "and on process peak minus KV rsv for everything else.")


def oom_skip_reason(point: Point, out_of_memory: list[Point]) -> str | None:
    """The one out-of-memory rule: a point is skipped when the same point with a smaller batch
    already ran out of memory (it would too). Returns the reason, or None to run it."""
    o = next((o for o in out_of_memory if point.bigger_batch_of(o)), None)
    return None if o is None else f"batch_size={o.params['batch_size']} of this point ran out of memory"


class Collector:
    """Token events of a serve() call, grouped by request. Each request's clock starts at its
    scheduled arrival (start_ns + arrival_s, read when the traces are taken: a closed loop sets it
    when the request's slot frees), not when the engine took it. A `RequestFailed` marks its
    request failed with the reason. The request source hears of every request's end."""

    def __init__(self, requests: list[Request], start_ns: int, source: Any = None):
        self.requests = {r.request_id: r for r in requests}
        self.expected = {r.request_id: r.max_new_tokens for r in requests}
        self.start_ns = start_ns
        self.source = source
        self._traces = {r.request_id: RequestTrace(r.request_id, 0, len(r.prompt_ids)) for r in requests}

    def feed(self, ev: TokenEvent | RequestFailed) -> bool:
        """Take one event; True when it was a request's first token."""
        tr = self._traces[ev.request_id]
        if isinstance(ev, RequestFailed):
            tr.error = ev.reason
            if self.source is not None:
                self.source.finished(ev.request_id, ev.time_ns)
            return False
        if ev.cached_tokens is not None:
            tr.cached_tokens = ev.cached_tokens
        if ev.reloaded_tokens is not None:
            tr.reloaded_tokens = ev.reloaded_tokens
        if ev.prompt_ids is not None:  # the prompt as the engine took it: its length is the request's input
            tr.prompt_ids, tr.prompt_len = ev.prompt_ids, len(ev.prompt_ids)
        if ev.index != tr.n_out:
            raise RuntimeError(f"request {ev.request_id}: token {ev.index} arrived after {tr.n_out} tokens")
        tr.token_times_ns.append(ev.time_ns)
        tr.token_ids.append(ev.token_id)
        if self.source is not None and (ev.finished or tr.n_out >= self.expected[ev.request_id]):
            self.source.finished(ev.request_id, ev.time_ns)
        return tr.n_out == 1

    def add(self, r: Request) -> None:
        """A request made while the point runs (a conversation's next turn)."""
        self.requests[r.request_id] = r
        self.expected[r.request_id] = r.max_new_tokens
        self._traces[r.request_id] = RequestTrace(r.request_id, 0, len(r.prompt_ids))

    def trace(self, request_id: str) -> RequestTrace:
        return self._traces[request_id]

    def _arrival_ns(self, request_id: str) -> int:
        return self.start_ns + round(self.requests[request_id].arrival_s * 1e9)

    def first_token_delays(self) -> tuple[list[float], list[float]]:
        """(scheduled arrival in s since the start, TTFT in s) of every request with a first token."""
        out_a, out_t = [], []
        for rid, tr in self._traces.items():
            if tr.token_times_ns:
                a = self._arrival_ns(rid)
                out_a.append((a - self.start_ns) / 1e9)
                out_t.append((tr.token_times_ns[0] - a) / 1e9)
        return out_a, out_t

    def traces(self) -> list[RequestTrace]:
        for rid, tr in self._traces.items():
            tr.arrival_ns = self._arrival_ns(rid)
        return list(self._traces.values())


def collect(requests: list[Request], start_ns: int, events: Iterable[TokenEvent | RequestFailed]) -> list[RequestTrace]:
    """Group an engine's token events by request (see Collector)."""
    c = Collector(requests, start_ns)
    for ev in events:
        c.feed(ev)
    return c.traces()


@dataclass
class RunContext:
    """What the harness hands a workload at run time (in the engine's process)."""

    shape: ModelShape
    dtype: str
    device: str
    model_path: str = ""
    max_model_len: int = 0
    seed: int = 0
    memory_sample_hz: float = 100.0
    token_low: int = 4  # prompts draw token ids from [token_low, token_high) minus avoid_ids
    token_high: int = 4096
    avoid_ids: tuple[int, ...] = ()
    # checkpoints besides the run's model that the workload names (Workload.models: a draft
    # model), as the harness materialised them: reference as given -> local directory
    models: dict[str, str] = field(default_factory=dict)

    def prompts(self, batch: int, length: int, key: str) -> list[list[int]]:
        return synthetic_prompts(batch, length, self.token_low, self.token_high, self.avoid_ids,
                                 seed=self.seed, key=key)

    def sampler(self) -> MemorySampler:
        return MemorySampler(self.memory_sample_hz, self.device)


class Workload(ABC):
    name: ClassVar[str]
    config_cls: ClassVar[type]  # dataclass schema of conf/workload/<name>.yaml
    reset_prefix_cache: ClassVar[bool] = True  # reset between points (False: prefix reuse is the point)
    roofline: ClassVar[bool] = False  # rows get the roofline fractions (decode/prefill vs the machine's ceilings)
    # (row field, column header, format) for the terminal summary
    summary_columns: ClassVar[list[tuple[str, str, str]]] = []
    # What infer-bench-compare (and the report's baseline section) compares and gates this
    # workload's rows on: names in harness.core.compare.METRICS. Empty: never compared (a check).
    compared_metrics: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in vars(cls):
            register_compared(cls.name, cls.compared_metrics)

    @abstractmethod
    def plan(self, cfg: Any) -> list[Point]:
        """The points to measure, in order."""

    @abstractmethod
    def max_model_len(self, cfg: Any) -> int:
        """Longest sequence (prompt + output tokens) any point needs."""

    def max_prefill_batch(self, cfg: Any) -> tuple[int, int]:
        """(sequences, prompt tokens) of the largest batch any point passes to prefill()."""
        return 1, self.max_model_len(cfg)

    def check(self, cfg: Any, shape: ModelShape) -> list[str]:
        """Problems beyond field types and ranges (e.g. lengths over the model's maximum)."""
        need = self.max_model_len(cfg)
        if need > shape.max_position_embeddings:
            return [f"workload: prompt + output lengths reach {need} tokens, more than the model's "
                    f"{shape.max_position_embeddings} positions (max_position_embeddings of {shape.name}). "
                    "Shorten the workload's prompt/output lengths or pick a model with more positions."]
        return []

    def models(self, cfg: Any) -> list[str]:
        """Checkpoints besides the run's model that the points need (speculative decoding's draft
        model): presets or checkpoint directories. The harness materialises each one, as it does
        the run's model, and a worker maps a `draft_model` override naming one to its directory
        (RunContext.models). Default: none."""
        return []

    def check_models(self, cfg: Any, model_path: str, models: dict[str, str]) -> list[str]:
        """Problems that need the checkpoints on disk (the run's model at `model_path`, and
        `models`: reference -> directory), checked in the harness's process after they are
        materialised and before anything runs (exit 2): a draft's tokenizer against the target's.
        Default: none."""
        return []

    def check_engines(self, cfg: Any, engines: dict[str, type[Engine]]) -> list[str]:
        """Problems with the config given the run's engines (tune: each engine's search space
        against its options' schema). Default: none."""
        return []

    def needs_price(self, cfg: Any) -> str | None:
        """The setting of `cfg` that needs the run to have a price (`cost:`, harness.core.cost), if
        any: the plan refuses it without one (tune's objective=cost). Default: none."""
        return None

    def unsupported(self, point: Point, caps: Capabilities) -> str | None:
        """Why this engine cannot run this point (it is then recorded as skipped), or None."""
        return None

    def engine_overrides(self, point: Point, caps: Capabilities) -> dict[str, Any]:
        """Engine options this point needs, by their standard names (adapters.base.STANDARD_OPTIONS),
        given what the engine can do; the engine is reloaded when they change between points."""
        return {}

    # ---- in the harness's process -------------------------------------------------------
    def point_inputs(self, point: Point, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Data the harness computes for a point before sending it to an engine's worker, from the
        rows written so far (e.g. parity's teacher tokens from the baseline engine). Default: none."""
        return None

    def next_points(self, point: Point, row: dict[str, Any], rows: list[dict[str, Any]], cfg: Any) -> list[Point]:
        """Points to run next for this engine, decided from `point`'s row and the engine's rows so
        far (a search: capacity's next probe). They run right after `point`. Default: none."""
        return []

    def compute_in_harness(self, point: Point, engine: str, rows: list[dict[str, Any]],
                           cfg: Any) -> dict[str, Any] | None:
        """A point the harness computes from earlier rows without the engine (capacity's
        conclusion): its row's fields, or None for a point the engine measures (the default).
        Fields `status` and `error` set the row's (e.g. "failed": the computation found nothing)."""
        return None

    def bind_run_dir(self, run_dir: Path) -> None:
        """Where the run writes (in the harness's process), for a workload that keeps state of its
        own there (tune's study). Default: nothing."""

    def expected_failure(self, row: dict[str, Any]) -> bool:
        """A failed row that does not fail the run (tune: a trial whose options cannot run is a
        pruned trial; the run fails only when no trial ran). Default: none."""
        return False

    def run_problems(self, rows: list[dict[str, Any]]) -> list[str]:
        """Why the run must fail beyond its rows' statuses, from this workload's rows (the exit
        code's reasons): a check that compared nothing over the whole run. Default: none."""
        return []

    def finalize_row(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """Complete a row before it is written, after the generic steps (confidence intervals of
        every `*_samples` field), given the rows written so far. Default: nothing."""

    def summary(self, rows: list[dict[str, Any]]) -> str:
        """The terminal summary of this workload's rows: the table of `summary_columns` and the
        lines of `post_summary`."""
        mine = [r for r in rows if r.get("workload") == self.name or r.get("status") == "unavailable"]
        currency = next((r["cost_currency"] for r in mine if r.get("cost_per_good_mtok_output") is not None), None)
        cost = [("cost_per_good_mtok_output", f"{currency}/good Mtok", ".4g")] if currency else []  # priced: cost:
        return "\n".join(t for t in (summary_table(mine, self.summary_columns + cost), self.post_summary(mine)) if t)

    def post_summary(self, rows: list[dict[str, Any]]) -> str:
        """Extra lines for the terminal summary (e.g. fitted slopes across points)."""
        return ""

    @abstractmethod
    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: Any,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Measure one point; return the row's metric fields. `cfg` is the workload's checked
        config (an instance of `config_cls`); `inputs` is what the harness computed for this point
        in its own process (`point_inputs`: parity's teacher tokens), else None."""

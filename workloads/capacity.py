"""Capacity: the highest request rate (or concurrency) an engine serves within latency SLOs.

For each engine the search probes load points (each a `serving` point: `num_requests` requests
at that rate, open loop, or kept in flight, closed loop) and keeps every probe as a row:

1. **Bracket**: start at `start`; while a probe meets every SLO (and is not saturated), double
   the load (up to `max_value`); when the first probe already fails, halve it instead (down to
   `start / 1024`).
2. **Bisect** between the highest load that met the SLOs and the lowest that did not, until the
   bracket is narrower than `resolution` (relative, for rates) or one request (concurrency), or
   `max_probes` probes were spent.
3. **Conclude**: one more row per engine, computed by the harness from the probes, with
   `capacity_rps` (or `capacity_concurrency`): the highest load that met the SLOs, the bracket
   it lies in, and the SLOs it was found under.

A probe meets the SLOs when every SLO given holds at p99 over its completed requests (TTFT,
TPOT, E2EL) and none of its requests failed. An over-saturated open-loop probe stops early
(workloads.serving) and counts as not meeting them. So does a client-limited probe (the load
generator did not keep up: workloads.serving, docs/metrics.md "Client distortion"): its latencies
are partly the client's, so it is never the engine's capacity, and the conclusion says to raise
`client_processes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters.base import Engine
from harness.core.metrics import SLO
from harness.core.schema import spec
from workloads import lora
from workloads.base import Point, RunContext
from workloads.serving import LoadShape, Serving, client_limited_note

WORKLOAD = "capacity"
SEARCHES = ("rate", "concurrency")
_SLO_FIELDS = {"ttft_p99_s": "ttft_s_p99", "tpot_p99_s": "tpot_s_p99", "e2el_p99_s": "e2el_s_p99"}


@dataclass
class CapacityConfig(LoadShape):
    name: str = spec(WORKLOAD)
    search: str = spec("rate", choices=SEARCHES, help="what to find: the highest request rate (open loop) "
                       "or concurrency (closed loop) within the SLOs")
    slo_ttft_p99_s: float | None = spec(None, gt=0, help="SLO: p99 time to first token, seconds")
    slo_tpot_p99_s: float | None = spec(None, gt=0, help="SLO: p99 time per output token, seconds")
    slo_e2el_p99_s: float | None = spec(None, gt=0, help="SLO: p99 end-to-end latency, seconds")
    start: float = spec(1.0, gt=0, help="the first probe's rate (requests/s) or concurrency")
    min_value: float | None = spec(None, gt=0, help="the lowest rate or concurrency probed (default start/16; 1 for concurrency)")
    max_value: float = spec(4096.0, gt=0, help="the highest rate or concurrency probed")
    resolution: float = spec(0.1, gt=0, le=0.5, help="rates: stop when (high - low) / high is below this")
    max_probes: int = spec(12, ge=2, help="most probes per engine")

    def slos(self) -> dict[str, float | None]:
        return {k: getattr(self, f"slo_{k}") for k in _SLO_FIELDS}

    def goodput_slo(self) -> SLO:  # goodput per request under the same bounds
        return SLO(self.slo_ttft_p99_s, self.slo_tpot_p99_s, self.slo_e2el_p99_s)


def slo_violations(row: dict[str, Any], slos: dict[str, float | None]) -> list[str]:
    """Why a probe's row does not meet the SLOs (empty: it meets them)."""
    out = [f"{name.replace('_p99_s', '')} p99 {row.get(field) or 0:.4g} s > {bound:g} s"
           for name, field in _SLO_FIELDS.items() if (bound := slos[name]) is not None
           and (row.get(field) is None or row[field] > bound)]
    if row.get("failed_requests"):
        out.append(f"{row['failed_requests']} requests failed")
    if row.get("saturated"):
        out.append("saturated: the queue grew through the run")
    if row.get("client_limited"):
        out.append("client-limited: the load generator did not keep up ("
                   + "; ".join(row.get("client_limited_reasons") or []) + "); raise workload.client_processes")
    return out


def probe_outcomes(probes: list[dict[str, Any]]) -> list[tuple[float, bool, bool]]:
    """(value, met the SLOs, saturated) of each of a search's probe rows, in order."""
    return [(float(r["point"]["value"]), r.get("status") == "ok" and bool(r.get("meets_slo")),
             bool(r.get("saturated"))) for r in probes]


def _probes(rows: list[dict[str, Any]], search: str) -> list[tuple[float, bool, bool]]:
    """(value, met the SLOs, saturated) of this engine's probes so far, in order."""
    return probe_outcomes([r for r in rows if r.get("workload") == WORKLOAD
                           and (r.get("point") or {}).get("search") == search and "value" in r["point"]])


def bracket(probes: list[tuple[float, bool, bool]]) -> tuple[float | None, float | None]:
    """(the highest load that met the SLOs, the lowest load above it that did not); None: none."""
    lo = max((v for v, ok, _ in probes if ok), default=None)
    hi = min((v for v, ok, _ in probes if not ok and (lo is None or v > lo)), default=None)
    return lo, hi


def round_load(value: float, search: str) -> float:
    """A probe's load as it is recorded: a whole concurrency, a rate to 3 significant digits."""
    if search == "concurrency":
        return float(max(1, int(value)))
    return float(f"{value:.3g}")


def next_value(probes: list[tuple[float, bool, bool]], cfg: CapacityConfig) -> float | None:
    """The next load to probe, or None when the search is done."""
    if not probes or len(probes) >= cfg.max_probes:
        return None
    lo, hi = bracket(probes)
    tried = {v for v, _, _ in probes}
    if hi is None:  # nothing failed yet above the best: go up
        nxt = round_load(min(lo * 2, cfg.max_value), cfg.search)  # type: ignore[operator]
    elif lo is None:  # nothing met the SLOs yet: go down
        nxt = round_load(hi / 2, cfg.search)
        floor = cfg.min_value or (1 if cfg.search == "concurrency" else cfg.start / 16)
        if nxt < floor or nxt in tried:
            return None
    else:
        width_ok = (hi - lo) <= 1 if cfg.search == "concurrency" else (hi - lo) / hi <= cfg.resolution
        if width_ok:
            return None
        nxt = round_load((lo + hi) / 2, cfg.search)
    return None if nxt in tried else nxt


COST_AT_CAPACITY = ("cost_currency", "cost_price_per_hour", "cost_price_basis", "cost_price_source",
                    "cost_per_mtok_output", "cost_per_good_mtok_output", "cost_per_good_mtok_total")
_PRICE_OF = COST_AT_CAPACITY[:4]  # the same for every probe of an engine


def capacity_cost(probes: list[dict[str, Any]], capacity: float | None) -> dict[str, Any]:
    """What a good million tokens cost at the capacity (the probe there: harness.core.cost's
    fields), and the cheapest probe that met the SLOs (`cost_min_*`: its load and cost per good
    Mtok of output); {} when the probes carry no cost (no price given)."""
    priced = [r for r in probes if r.get("status") == "ok" and r.get("cost_currency")]
    if not priced:
        return {}
    at = next((r for r in priced if r.get("meets_slo") and r["point"]["value"] == capacity), None)
    out: dict[str, Any] = {k: priced[0].get(k) if k in _PRICE_OF else (at or {}).get(k) for k in COST_AT_CAPACITY}
    met = [r for r in priced if r.get("meets_slo") and r.get("cost_per_good_mtok_output")]
    cheapest = min(met, key=lambda r: r["cost_per_good_mtok_output"], default=None)
    out.update(cost_min_per_good_mtok_output=cheapest["cost_per_good_mtok_output"] if cheapest else None,
               cost_min_value=cheapest["point"]["value"] if cheapest else None,
               cost_note=None if at else "no probed load met the SLOs: no cost at capacity")
    return out


class Capacity(Serving):
    name = WORKLOAD
    compared_metrics = ("capacity_rps", "capacity_concurrency")  # with the search's bracket
    config_cls = CapacityConfig
    summary_columns = [
        ("capacity_search", "search", "s"), ("value", "probe", "g"), ("meets_slo", "meets SLO", "s"),
        ("output_tok_s", "out tok/s", ".1f"), ("per_user_tok_s", "tok/s/user", ".1f"),
        ("ttft_s_p99", "TTFT p99 ms", "ms"), ("tpot_s_p99", "TPOT p99 ms", "ms"), ("e2el_s_p99", "E2EL p99 ms", "ms"),
        ("saturated", "saturated", "s"), ("client_limited", "client lim", "s"),
    ]

    def check(self, cfg: CapacityConfig, shape: Any) -> list[str]:
        problems = []
        if all(v is None for v in cfg.slos().values()):
            problems.append("workload.slo_ttft_p99_s / slo_tpot_p99_s / slo_e2el_p99_s: give at least one SLO the "
                            "capacity is found under, e.g. workload.slo_ttft_p99_s=0.5.")
        if cfg.start > cfg.max_value:
            problems.append(f"workload.start={cfg.start:g} is above workload.max_value={cfg.max_value:g}.")
        if cfg.trace:
            problems.append("workload.trace: a capacity search sets its own rates; replay a trace with "
                            "workload=serving.")
        if cfg.search == "concurrency" and cfg.start != int(cfg.start):
            problems.append(f"workload.start={cfg.start:g}: a concurrency is a whole number of requests.")
        return problems + super().check(cfg, shape)

    def plan(self, cfg: CapacityConfig) -> list[Point]:
        return [self._probe(cfg, cfg.start, 0), Point(self.name, {"search": cfg.search, "result": True})]

    def _probe(self, cfg: CapacityConfig, value: float, i: int) -> Point:
        return Point(self.name, {"search": cfg.search, "value": round_load(value, cfg.search), "probe": i,
                                 "num_requests": cfg.num_requests, **lora.point_params(cfg.lora)})

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: CapacityConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        value = point.params["value"]
        load = {"concurrency": int(value)} if cfg.search == "concurrency" else {"request_rate": value}
        row = self.measure(engine, cfg, ctx, {**load, "num_requests": point.params["num_requests"],
                                              "lora": point.params.get("lora")}, point.key)
        why = slo_violations(row, cfg.slos())
        row.update(capacity_search=cfg.search, value=value, meets_slo=not why, slo_violations=why,
                   capacity_slo=cfg.slos())
        return row

    # ---- the search, in the harness's process --------------------------------------------
    def next_points(self, point: Point, row: dict[str, Any], rows: list[dict[str, Any]],
                    cfg: CapacityConfig) -> list[Point]:
        if "value" not in point.params:
            return []
        nxt = next_value(_probes(rows, cfg.search), cfg)
        return [] if nxt is None else [self._probe(cfg, nxt, point.params["probe"] + 1)]

    def compute_in_harness(self, point: Point, engine: str, rows: list[dict[str, Any]],
                           cfg: CapacityConfig) -> dict[str, Any] | None:
        if not point.params.get("result"):
            return None
        search = point.params["search"]
        mine = [r for r in rows if r.get("engine") == engine]
        probes = _probes(mine, search)
        lo, hi = bracket(probes)
        slo = cfg.slos()
        key = "capacity_rps" if search == "rate" else "capacity_concurrency"
        limited = sorted(float(r["point"]["value"]) for r in mine if r.get("workload") == WORKLOAD
                         and r.get("client_limited") and "value" in (r.get("point") or {}))
        notes = [] if lo is not None else ["no probed load met the SLOs"]
        if limited:
            notes.append(f"the load generator did not keep up at {', '.join(f'{v:g}' for v in limited)} (client-limited "
                         "probes count as misses, never as capacity): the engine's capacity may be higher; raise "
                         "workload.client_processes")
        search_rows = [r for r in mine if r.get("workload") == WORKLOAD and (r.get("point") or {}).get("search") == search
                       and "value" in r["point"]]
        return {key: lo, "capacity_search": search, "capacity_bracket": [lo, hi], "capacity_slo": slo,
                "capacity_probes": [[v, ok, sat] for v, ok, sat in probes],
                "capacity_resolution": cfg.resolution if search == "rate" else 1,
                "capacity_client_limited": limited or None,
                "capacity_note": "; ".join(notes) or None, **capacity_cost(search_rows, lo)}

    def post_summary(self, rows: list[dict[str, Any]]) -> str:
        lines = []
        for r in rows:
            if r.get("workload") == self.name and (r.get("point") or {}).get("result"):
                slo = ", ".join(f"{k} <= {v:g} s" for k, v in (r.get("capacity_slo") or {}).items() if v is not None)
                value = r.get("capacity_rps", r.get("capacity_concurrency"))
                unit = "requests/s" if r.get("capacity_search") == "rate" else "requests in flight"
                lo, hi = r.get("capacity_bracket") or [None, None]
                cost = r.get("cost_per_good_mtok_output")
                lines.append(f"capacity  {r['engine']:<9} {('-' if value is None else f'{value:g}')} {unit} within "
                             f"{slo or 'no SLO'} (bracket {lo} .. {hi}; {len(r.get('capacity_probes') or [])} probes)"
                             + (f"; {cost:.4g} {r.get('cost_currency')} per good Mtok of output there "
                                f"({r.get('cost_price_basis')})" if cost is not None else ""))
                if r.get("capacity_client_limited"):
                    lines.append(f"          {r['engine']:<9} {r['capacity_note']}")
        note = client_limited_note([r for r in rows if r.get("workload") == self.name])
        return "\n".join(lines + ([note] if note else []))


"""LoRA traffic: many adapters on one base model, as a dimension of `serving`, `capacity` and
`conversation` (`workload.lora`; docs/metrics.md, "LoRA adapters").

Each request is served by one adapter or by the base model, chosen by the split
(harness.core.lora: round robin, uniform, weighted, Zipf; seeded by the run's seed and the point,
so every engine gets the same request -> adapter assignment); a conversation's session keeps its
adapter for every turn. The engine gets the adapters by the standard options
(`adapters.base.STANDARD_OPTIONS`: lora_adapters, max_loras, max_lora_rank, max_cpu_loras) and
each request names its own (`Request.adapter`).

Per point the row has, beside the aggregates of the workload:
- the split configured (`lora_shares`), sent (`lora_sent`) and completed (`lora_completed`), and,
  completed by the harness, its test (`lora_split_test`: exact counts for round robin, chi-squared
  otherwise): a split sent that is not the configured one fails the row;
- per entry (`lora_per_adapter`): requests, completed, tokens, TTFT / ITL / TPOT / E2EL p50, p90, p99;
- the engine's adapter loads and evictions over the point, where it reports them (`lora_stats`);
- serving only, with `check_outputs`: every completed request's output against the same prompt
  with the same adapter served alone, and with the base model alone (`lora_check`); a request
  whose output differs fails the row, naming the request, its adapter and the first differing
  token; an adapter that changes no output of its requests leaves the row `unverified` (the check
  could not tell it from the base model);
- serving's swap points (`swap_cost: [2, 4, 8]`): N adapters in round robin at max_loras=1,
  one request at a time, against the same prompts on one adapter: the swap cost is the difference
  of the p50 TTFTs, with a 95 % interval (a paired bootstrap over the requests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from adapters.base import Capabilities, Engine, Request, now_ns
from harness.core.errors import UserError
from harness.core.lora import (
    BASE, SPLITS, Adapter, assign, first_difference, parse_refs, read_adapter, shape_problems, shares, split_problems,
    split_test,
)
from harness.core.metrics import RequestTrace, serving_metrics
from harness.core.schema import check, spec
from workloads.prompts import seed_for

FIELD = "workload.lora"
LATENCIES = ("ttft_s", "itl_s", "tpot_s", "e2el_s")


@dataclass
class LoraTraffic:
    """workload.lora: the adapters and how requests are split among them (docs/metrics.md, "LoRA adapters")."""

    adapters: Any = spec(None, help="{NAME: PATH, ...}: PEFT adapter directories or Hub ids ORG/NAME "
                                    "(infer-bench-lora make writes adapters); null or {}: no adapters")
    num_adapters: int | None = spec(None, ge=1, help="use the first N adapters (a sweep: -m workload.lora.num_adapters="
                                                     "1,2,4); null: all")
    split: str = spec("uniform", choices=SPLITS, help="how each request picks its adapter (or the base model)")
    base_share: float | None = spec(None, ge=0, le=1, help="the base model's share (the adapters split the rest); "
                                                           "null: the base model is one more entry, ranked first")
    weights: dict[str, Any] | None = spec(None, help="split=weighted: {base: .., NAME: .., ...} summing to 1")
    zipf_alpha: float = spec(1.0, gt=0, help="split=zipf: the entry of rank k gets a share proportional to k^-alpha")
    max_loras: int | None = spec(None, ge=1, help="adapters resident at once (the engine's slots); null: every adapter")
    max_lora_rank: int | None = spec(None, ge=1, help="the largest rank the engine allows; null: the adapters' largest")
    max_cpu_loras: int | None = spec(None, ge=1, help="adapters kept in host memory beyond the slots (vLLM); null: "
                                                      "every adapter")
    check_outputs: bool = spec(True, help="serving: each request's output against the same prompt with the same "
                                          "adapter served alone (and with the base model alone)")
    swap_cost: list[int] = spec([], ge=2, help="serving: for each N, N adapters round robin at max_loras=1 against one "
                                               "adapter, one request at a time (the swap cost's points)")


def typed(raw: Any) -> LoraTraffic:
    """The checked config (the plan refused bad input already)."""
    if isinstance(raw, LoraTraffic):
        return raw
    t, problems = check(LoraTraffic, dict(raw or {}), FIELD)
    if t is None:
        raise ValueError("; ".join(problems))
    return t


def enabled(raw: Any) -> bool:
    return bool((raw or {}).get("adapters")) if isinstance(raw, dict) else bool(getattr(raw, "adapters", None))


def adapters_of(t: LoraTraffic, n: int | None = None) -> list[Adapter]:
    """The first n adapters (all: n None), read from their directories; one that cannot be read is
    left out (the plan is built even when problems() refuses the config, which exits 2)."""
    refs, _ = parse_refs(t.adapters, f"{FIELD}.adapters")
    out = []
    for name, ref in refs[:n] if n is not None else refs:
        a = read_adapter(name, ref, f"{FIELD}.adapters")[0]
        if a is not None:
            out.append(a)
    return out


def problems(raw: Any, shape: Any, workload: str = "serving") -> list[str]:
    """Bad input in workload.lora (exit 2): the schema, the adapters' directories and shapes against
    the base model, names used twice, the split, ranks above max_lora_rank, counts."""
    if not raw:
        return []
    t, out = check(LoraTraffic, dict(raw), FIELD)
    if t is None:
        return out
    refs, out = parse_refs(t.adapters, f"{FIELD}.adapters")
    if not refs:
        return out + ([f"{FIELD}: settings without adapters. Give {FIELD}.adapters={{NAME: PATH, ...}}."]
                      if any(v not in (None, [], {}) for k, v in raw.items() if k not in ("adapters", "check_outputs",
                                                                                           "split", "zipf_alpha"))
                      else [])
    adapters: list[Adapter] = []
    for name, ref in refs:
        a, shapes, more = read_adapter(name, ref, f"{FIELD}.adapters")
        out += more
        if a is not None:
            out += shape_problems(a, shapes, shape, f"{FIELD}.adapters") if shape is not None else []
            adapters.append(a)
    n = t.num_adapters if t.num_adapters is not None else len(refs)
    if n > len(refs):
        out.append(f"{FIELD}.num_adapters={n}: only {len(refs)} adapters are given. Give more adapters or a smaller "
                   "num_adapters.")
    names = [nm for nm, _ in refs[:n]]
    out += split_problems(names, t.split, t.base_share, t.weights, FIELD)
    if t.max_lora_rank is not None:
        for a in adapters:
            if a.rank > t.max_lora_rank:
                out.append(f"{FIELD}.max_lora_rank={t.max_lora_rank}: adapter '{a.name}' has rank {a.rank}. Raise "
                           f"max_lora_rank to at least {a.rank}, or give a lower-rank adapter.")
    if t.max_loras is not None and t.max_cpu_loras is not None and t.max_cpu_loras < t.max_loras:
        out.append(f"{FIELD}.max_cpu_loras={t.max_cpu_loras}: below max_loras={t.max_loras} (the host cache holds "
                   "the resident adapters too). Raise it or lower max_loras.")
    if t.swap_cost:
        if workload != "serving":
            out.append(f"{FIELD}.swap_cost: measured by workload=serving only. Drop it here.")
        elif max(t.swap_cost) > len(refs):
            out.append(f"{FIELD}.swap_cost={t.swap_cost}: {max(t.swap_cost)} adapters are needed, {len(refs)} are "
                       "given. Give more adapters (infer-bench-lora make --count N).")
    return out


def with_hub_adapters(cfg: Any, problems: list[str]) -> Any:
    """A workload config whose `lora.adapters` name Hub repositories (ORG/NAME[@REV], not a directory
    here) with each one's snapshot directory in its place (downloaded into the Hugging Face cache:
    harness.core.hub.resolve_adapter), so that workers read local directories only; problems
    appended for one that cannot be had. A config without such an adapter comes back as it is."""
    from dataclasses import replace

    from harness.core.hub import is_hub_adapter, resolve_adapter
    raw = getattr(cfg, "lora", None) if cfg is not None else None
    if not enabled(raw) or not isinstance(raw, dict):
        return cfg
    refs, _ = parse_refs(raw.get("adapters"), f"{FIELD}.adapters")  # malformed entries: problems() says so
    if not any(is_hub_adapter(ref) for _, ref in refs):
        return cfg
    out = {}
    for name, ref in refs:
        if is_hub_adapter(ref):
            try:
                ref = resolve_adapter(ref, f"{FIELD}.adapters.{name}")[0]
            except UserError as e:
                problems += e.problems
        out[name] = ref
    return replace(cfg, lora={**raw, "adapters": out})


# ---- points and engine options --------------------------------------------------------------------------------
# A point's `lora` parameter holds everything its requests and the engine's options need: the
# adapters {name: directory} in order, the split, the slots and ranks (filled in at plan time), so
# that the engine's process needs nothing else.

def point_params(raw: Any) -> dict[str, Any]:
    """The point's `lora` parameter ({} without adapters)."""
    if not enabled(raw):
        return {}
    t = typed(raw)
    ads = adapters_of(t, t.num_adapters)
    lora: dict[str, Any] = {"adapters": {a.name: a.path for a in ads}, "split": t.split}
    if t.split == "zipf":
        lora["zipf_alpha"] = t.zipf_alpha
    if t.split == "weighted":
        lora["weights"] = dict(t.weights or {})
    elif t.base_share is not None:
        lora["base_share"] = t.base_share
    lora["max_loras"] = t.max_loras or len(ads)
    lora["max_lora_rank"] = t.max_lora_rank or max((a.rank for a in ads), default=1)
    lora["max_cpu_loras"] = max(t.max_cpu_loras or len(ads), lora["max_loras"])
    return {"lora": lora}


def swap_params(raw: Any, n: int) -> dict[str, Any]:
    """A swap point's `lora`: the first n adapters in round robin (no base model), one slot."""
    t = typed(raw)
    ads = adapters_of(t, n)
    return {"lora": {"adapters": {a.name: a.path for a in ads}, "split": "round_robin", "base_share": 0.0, "swap": n,
                     "max_loras": 1, "max_lora_rank": t.max_lora_rank or max((a.rank for a in adapters_of(t)), default=1),
                     "max_cpu_loras": max(t.max_cpu_loras or n, 1)}}


def unsupported(point_lora: dict[str, Any] | None, caps: Capabilities) -> str | None:
    if not point_lora:
        return None
    if not caps.lora:
        return caps.lora_unsupported or "the engine serves no LoRA adapters here"
    if point_lora.get("swap") and not caps.lora_slots:
        return ("the engine keeps every adapter resident (no fixed slots to load into and evict from): there is no "
                "swap to measure")
    return None


def overrides(point_lora: dict[str, Any] | None) -> dict[str, Any]:
    """The point's engine options by their standard names: the adapters, the slots, the ranks."""
    if not point_lora:
        return {}
    ads = [read_adapter(name, path, f"{FIELD}.adapters")[0] for name, path in point_lora["adapters"].items()]
    missing = [n for n, a in zip(point_lora["adapters"], ads) if a is None]
    if missing:
        raise ValueError(f"adapter(s) {', '.join(missing)} cannot be read in the engine's process")
    return {"lora_adapters": [a.option() for a in ads if a is not None], "max_loras": point_lora["max_loras"],
            "max_lora_rank": point_lora.get("max_lora_rank") or max(a.rank for a in ads if a is not None),
            "max_cpu_loras": point_lora["max_cpu_loras"]}


def parity_adapters(raw: Any) -> dict[str, str] | None:
    """The adapters a run's parity scores with ({name: directory}, the points' first num_adapters);
    None without adapters."""
    if not enabled(raw):
        return None
    t = typed(raw)
    return dict(parse_refs(t.adapters, FIELD)[0][:t.num_adapters])


def configured_shares(point_lora: dict[str, Any]) -> dict[str, float]:
    return shares(list(point_lora["adapters"]), point_lora["split"], point_lora.get("base_share"),
                  point_lora.get("weights"), point_lora.get("zipf_alpha", 1.0))


def assignment(point_lora: dict[str, Any] | None, n: int, seed: int, key: str) -> list[str | None]:
    """The adapter of each of n requests (None: the base model); the same for every engine."""
    if not point_lora:
        return [None] * n
    got = assign(configured_shares(point_lora), point_lora["split"], n,
                 np.random.default_rng(seed_for(seed, f"{key}/lora")))
    return [None if e == BASE else e for e in got]


# ---- measuring ------------------------------------------------------------------------------------------------

def entry(adapter: str | None) -> str:
    return BASE if adapter is None else adapter


def per_adapter(traces: list[RequestTrace], adapter_of: dict[str, str | None], expected: dict[str, int],
                order: list[str]) -> list[dict[str, Any]]:
    """One entry per adapter (and the base model): requests, completed, tokens, latencies p50/p90/p99."""
    out = []
    for e in order:
        mine = [t for t in traces if entry(adapter_of.get(t.request_id)) == e]
        m = serving_metrics(mine, None, {t.request_id: expected[t.request_id] for t in mine if t.request_id in expected})
        item: dict[str, Any] = {"adapter": e, "requests": len(mine), "completed": m["completed"],
                                "input_tokens": m["total_input_tokens"], "output_tokens": m["total_output_tokens"]}
        for name in LATENCIES:
            for q in ("p50", "p90", "p99"):
                item[f"{name}_{q}"] = m.get(f"{name}_{q}")
        out.append(item)
    return out


def traffic_fields(point_lora: dict[str, Any], reqs: list[Request], traces: list[RequestTrace],
                   expected: dict[str, int], stats0: dict[str, Any] | None, stats1: dict[str, Any] | None) -> dict[str, Any]:
    """The row's LoRA fields of a served point (the split test and the check's verdict are added later)."""
    shares_ = configured_shares(point_lora)
    adapter_of = {r.request_id: r.adapter for r in reqs}
    sent = [t for t in traces if not (t.error or "").startswith("not sent")]
    count = lambda ts: {e: sum(1 for t in ts if entry(adapter_of.get(t.request_id)) == e) for e in shares_}  # noqa: E731
    done = [t for t in sent if not t.error and t.token_times_ns and t.n_out == expected.get(t.request_id)]
    return {
        "lora_adapters": list(point_lora["adapters"]), "lora_split": point_lora.get("split"),
        "lora_zipf_alpha": point_lora.get("zipf_alpha"), "lora_max_loras": point_lora.get("max_loras"),
        "lora_max_lora_rank": point_lora.get("max_lora_rank"),
        "lora_swap": point_lora.get("swap"), "lora_shares": shares_, "lora_split_unit": "request",
        "lora_sent": count(sent),
        "lora_completed": count(done),
        "lora_per_adapter": per_adapter(traces, adapter_of, expected, list(shares_)),
        "lora_stats": stats_delta(stats0, stats1),
        "request_adapter": {rid: entry(a) for rid, a in adapter_of.items()},
        **({"request_ttft_s": {t.request_id: t.ttft_s for t in done}} if point_lora.get("swap") else {}),
    }


def stats_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """The engine's adapter counters over the point: loads and evictions as differences, the rest as read after."""
    if after is None:
        return None
    out = dict(after)
    for k in ("loads", "evictions"):
        if after.get(k) is not None:
            out[k] = after[k] - ((before or {}).get(k) or 0)
    return out


def _alone(engine: Engine, r: Request, adapter: str | None, tag: str) -> list[int]:
    """The request's output served alone (nothing else in the engine), with `adapter`."""
    one = Request(f"{r.request_id}/{tag}", list(r.prompt_ids), r.max_new_tokens, 0.0, adapter=adapter)
    toks: dict[int, int] = {}
    for ev in engine.serve([one], now_ns()):
        if hasattr(ev, "token_id"):
            toks[ev.index] = ev.token_id
        else:
            raise RuntimeError(f"request {r.request_id} served alone failed: {getattr(ev, 'reason', ev)}")
    return [toks[i] for i in sorted(toks)]


def check_outputs(engine: Engine, reqs: list[Request], traces: list[RequestTrace], expected: dict[str, int],
                  dtype: str) -> dict[str, Any]:
    """Every completed request's output (mixed traffic) against the same prompt with the same adapter
    served alone, and the adapter's alone output against the base model's alone output. The verdict:
    `fail` at the first request (in request order) whose output differs from its alone output, with
    its adapter and the first differing token (outside float32: `unverified`, a rounding of the
    batched pass can flip a near tie); `unverified` where an adapter changes no output of its requests
    (a request served without it would pass unseen) or a server sent no token ids; else `pass`."""
    by_id = {t.request_id: t for t in traces}
    engine.reset_prefix_cache()
    compared: list[str] = []
    passed: list[str] = []  # equal to their alone outputs: the good requests of a cost (harness.core.cost)
    per: dict[str, dict[str, int]] = {}
    mismatch = None
    no_ids = False
    base_cache: dict[tuple[Any, ...], list[int]] = {}
    for r in reqs:
        tr = by_id.get(r.request_id)
        if tr is None or tr.error or tr.n_out != expected.get(r.request_id):
            continue
        e = entry(r.adapter)
        per.setdefault(e, {"requests": 0, "changed": 0})
        if any(t < 0 for t in tr.token_ids):
            no_ids = True
            continue
        alone = _alone(engine, r, r.adapter, "alone")
        compared.append(r.request_id)
        per[e]["requests"] += 1
        base_alone = None
        if r.adapter is not None:
            key = (tuple(r.prompt_ids), r.max_new_tokens)
            if key not in base_cache:
                base_cache[key] = _alone(engine, r, None, "base")
            base_alone = base_cache[key]
            if base_alone != alone:
                per[e]["changed"] += 1
        pos = first_difference(alone, tr.token_ids)
        if pos is None:
            passed.append(r.request_id)
        if pos is not None and mismatch is None:
            mismatch = {"request": r.request_id, "adapter": e, "position": pos,
                        "expected": alone[pos] if pos < len(alone) else None,
                        "got": tr.token_ids[pos] if pos < len(tr.token_ids) else None,
                        "base_alone": base_alone[pos] if base_alone is not None and pos < len(base_alone) else None}
    out: dict[str, Any] = {"compared": len(compared), "per_adapter": per, "mismatch": mismatch,
                           "dtype": dtype, "passed": len(passed), "passed_ids": passed}
    unchanged = sorted(e for e, v in per.items() if e != BASE and v["requests"] and not v["changed"])
    if mismatch is not None:
        m = mismatch
        detail = (f"request {m['request']} (adapter {m['adapter']}): token {m['position']} is {m['got']} in mixed "
                  f"traffic, {m['expected']} served alone with its adapter"
                  + (f" ({m['base_alone']} with the base model alone)" if m.get("base_alone") is not None else ""))
        if dtype == "float32":
            out.update(verdict="fail", detail=detail)
        else:
            out.update(verdict="unverified", detail=detail + f"; in {dtype} a rounding of the batched pass can flip a "
                       "near tie: run dtype=float32 for the verdict")
    elif no_ids:
        out.update(verdict="unverified", detail="the engine sent no token ids: outputs cannot be compared")
    elif not compared:
        out.update(verdict="unverified", detail="no completed request to compare")
    elif unchanged:
        out.update(verdict="unverified", detail=f"adapter(s) {', '.join(unchanged)} changed no output of their "
                   "requests: a request served without its adapter could not be told apart. Give adapters that change "
                   "the outputs (infer-bench-lora make --strength)")
    else:
        n_changed = sum(v["changed"] for v in per.values())
        out.update(verdict="pass", detail=f"{len(compared)} requests equal to their alone outputs token for token; "
                   f"{n_changed} of the {sum(v['requests'] for e, v in per.items() if e != BASE)} adapter requests "
                   "differ from the base model's")
    return out


# ---- completing a row (the harness's process) ----------------------------------------------------------------

def finalize(row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The split test, the outputs check's verdict, and a swap point's cost against one adapter."""
    if row.get("status") != "ok" or row.get("lora_shares") is None:
        return
    sent = row.get("lora_sent") or {}
    row["lora_split_test"] = split_test(row["lora_shares"], sent, "round_robin" if row.get("lora_swap") else
                                        row.get("lora_split") or "uniform", sum(sent.values()))
    problems, unverified = [], []
    if not row["lora_split_test"]["ok"]:
        problems.append(f"the split sent is not the configured one: {row['lora_split_test']['detail']}")
    check_ = row.get("lora_check")
    if check_:
        if check_["verdict"] == "fail":
            problems.append(f"LoRA outputs check failed: {check_['detail']}")
        elif check_["verdict"] == "unverified":
            unverified.append(f"LoRA outputs check could not verify: {check_['detail']}")
    if (row.get("lora_swap") or 0) > 1:
        swap_cost(row, rows)
    if problems:
        row["status"], row["error"] = "failed", "; ".join(problems)
    elif unverified:
        row["status"], row["error"] = "unverified", "; ".join(unverified)


def swap_cost(row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """p50 TTFT at N adapters (round robin, max_loras=1) minus p50 TTFT at one adapter, the same
    prompts: its 95 % interval a paired bootstrap over the requests both points completed."""
    from harness.core.bootstrap import paired_diff_ci
    point = dict(row.get("point") or {})
    rest = {k: v for k, v in point.items() if k != "lora"}
    base = next((r for r in reversed(rows) if r.get("engine") == row.get("engine") and r.get("workload") ==
                 row.get("workload") and ((r.get("point") or {}).get("lora") or {}).get("swap") == 1
                 and {k: v for k, v in r["point"].items() if k != "lora"} == rest and r.get("status") == "ok"), None)
    if base is None:
        row.update(swap_cost_s=None, swap_cost_ci=None, swap_cost_note="no ok row of this engine with one adapter")
        return
    a, b = row.get("request_ttft_s") or {}, base.get("request_ttft_s") or {}
    pairs = [rid for rid in a if rid in b and a[rid] is not None and b[rid] is not None]
    if len(pairs) < 2:
        row.update(swap_cost_s=None, swap_cost_ci=None, swap_cost_note=f"{len(pairs)} requests in both points")
        return
    x, y = [a[r] for r in pairs], [b[r] for r in pairs]
    ci = paired_diff_ci(x, y)
    one_stats = base.get("lora_stats") or {}
    row.update(swap_cost_s=float(np.median(x) - np.median(y)), swap_cost_ci=list(ci) if ci else None,
               swap_cost_pairs=len(pairs), swap_ttft_one_s=float(np.median(y)),
               swap_loads_one=one_stats.get("loads"), swap_evictions_one=one_stats.get("evictions"))


# ---- the terminal summary -------------------------------------------------------------------------------------

def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per LoRA point: the split sent against the configured one, latency per adapter, the outputs
    check, and a swap point's cost."""
    def ms(v: Any) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"
    lines = []
    for r in rows:
        if r.get("lora_shares") is None:
            continue
        p = r.get("point") or {}
        load = f"concurrency {p['concurrency']}" if p.get("concurrency") else f"rate {p.get('request_rate', '-')}/s"
        test = r.get("lora_split_test") or {}
        lines.append(f"{r['engine']} {load}: LoRA {r.get('lora_split')}"
                     + (f" alpha {r['lora_zipf_alpha']:g}" if r.get("lora_zipf_alpha") else "")
                     + f", {len(r.get('lora_adapters') or [])} adapters, max_loras {r.get('lora_max_loras')}"
                     + (f"; split {test.get('test')} {'ok' if test.get('ok') else 'NOT the configured one'}"
                        f" ({test.get('detail')})" if test else ""))
        unit = r.get("lora_split_unit") or "request"
        lines.append(f"  adapter   share  {unit + 's':>8}  done  TTFT p50/p90/p99 ms        TPOT p50 ms  ITL p50 ms  "
                     "E2EL p50 ms")
        for a in r.get("lora_per_adapter") or []:
            e = a["adapter"]
            lines.append(f"  {e:<8} {r['lora_shares'].get(e, 0):6.3f}  {(r.get('lora_sent') or {}).get(e, 0):>8}  "
                         f"{a['completed']:>4}  {ms(a['ttft_s_p50']):>7} {ms(a['ttft_s_p90']):>7} {ms(a['ttft_s_p99']):>7}"
                         f"     {ms(a['tpot_s_p50']):>11}  {ms(a['itl_s_p50']):>10}  {ms(a['e2el_s_p50']):>11}")
        c = r.get("lora_check")
        if c:
            lines.append(f"  outputs check: {c['verdict'].upper()}: {c['detail']}")
        st = r.get("lora_stats") or {}
        if st.get("loads") is not None and r.get("lora_swap"):
            lines.append(f"  adapter loads {st.get('loads')}, evictions {st.get('evictions')} ({st.get('source')})")
        if r.get("swap_cost_s") is not None:
            ci = r.get("swap_cost_ci")
            lines.append(f"  swap cost at {r['lora_swap']} adapters, max_loras 1: {ms(r['swap_cost_s'])} ms of TTFT p50 "
                         + (f"(95% CI {ms(ci[0])} .. {ms(ci[1])})" if ci else "(no interval)")
                         + f" over one adapter's {ms(r.get('swap_ttft_one_s'))} ms")
    return lines

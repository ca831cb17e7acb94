"""The `kv_tiers` dimension of the conversation and prefix_sharing workloads (docs/metrics.md, "KV
tiers"): which tiers a point runs with, what the engine is told (by the standard options of
adapters.base.STANDARD_OPTIONS), and what the row gets.

Modes (`workload.kv_tiers`, with prefix caching on):
  off    the engine's KV pool alone: what it evicts is recomputed when a session comes back
  full   one tier at the engine's default size (kv_cache_bytes null), or of `kv_tiers_full_bytes`
         where given, meant to hold every history: the upper bound (a full point that evicted
         cached blocks is no bound: compare_tiers gives no verdict against it)
  SIZE   a second tier of SIZE bytes behind the pool (kv_offload, kv_offload_bytes): evicted
         blocks go there and are reloaded on a later hit instead of prefilled again
A run whose kv_tiers is just `off` (the default) gives the engine no tier option at all: it runs
as engine_options say, and its points keep their keys.

Row fields: `kv_tiers` (the mode), per turn the prompt tokens each tier supplied and what was
prefilled (`tier1_hit_tokens`, `tier2_hit_tokens`, `miss_tokens`, `hit_rate_tier1`,
`hit_rate_tier2`: where the engine says per request, the reference engine), per point the second
tier's counters over the point (`tier2`: hits, blocks and bytes moved, seconds, evictions,
corrupt entries; a server's from /metrics), and, in the harness's process (`compare_tiers`), each
tiered turn beside the same turn with tiers off (recompute) and with the full pool (the bound):
strictly, within the run's noise, and resolved (bootstrap intervals of the ratios from the
points' requests); and the break-even of reloading against recomputing.
"""

from __future__ import annotations

from typing import Any

from adapters.base import Capabilities, KVCacheInfo
from harness.core.kvcalc import estimate, kv_dtype_of
from harness.core.sizes import human_size, parse_size
from workloads.base import Point, RunContext

MODES = ("off", "full")


def tier_mode(entry: Any) -> str | int | None:
    """"off", "full", a capacity in bytes, or None when `entry` is none of them."""
    if isinstance(entry, str) and entry.strip().lower() in MODES:
        return entry.strip().lower()
    if entry is False:
        return "off"
    return parse_size(entry)


def tier_problems(entries: list[Any], prefix_caching: list[bool], field: str = "workload.kv_tiers",
                  full_bytes: Any = None) -> list[str]:
    """Every entry is off, full or a size; tiers need a point with prefix caching on; the full
    point's pool (`kv_tiers_full_bytes`), where given, is a size."""
    out = [f"{field}: {e!r} is neither off, full nor a size. Give off, full, or a capacity in bytes "
           "(1073741824, 5e8) or with a unit (512MiB, 1GiB, 2GB)." for e in entries if tier_mode(e) is None]
    if full_bytes is not None and (isinstance(full_bytes, bool) or parse_size(full_bytes) is None):
        out.append(f"workload.kv_tiers_full_bytes: {full_bytes!r} is not a size. Give the full point's KV pool in "
                   "bytes (1073741824) or with a unit (512MiB, 1GiB), or null for the engine's default pool.")
    if not out and any(tier_mode(e) != "off" for e in entries) and True not in prefix_caching:
        out.append(f"{field}={entries}: KV tiers need prefix caching (a second tier holds blocks evicted from the "
                   "prefix cache; full measures reuse without eviction), and workload.prefix_caching has no true. "
                   "Add true to workload.prefix_caching, or set workload.kv_tiers=[off].")
    return out


def tier_modes(entries: list[Any], caching: bool) -> list[str | int | None]:
    """The tier modes of the points with prefix caching `caching`, in the order they run: off, full,
    then the capacities from the smallest (a tiered point's finalize then sees the other two). None
    stands for "as engine_options say" (a run whose kv_tiers is only off)."""
    modes = [tier_mode(e) for e in entries]
    if all(m == "off" for m in modes):
        return [None]
    if not caching:
        return ["off"]
    sizes = sorted({m for m in modes if isinstance(m, int)})
    return [m for m in MODES if m in modes] + sizes


def tier_param(mode: str | int | None, full_bytes: Any = None) -> dict[str, Any]:
    """A point's tier parameters: its mode, and for `full` the pool asked for (`kv_tiers_full_bytes`,
    where given: the point's key then says it)."""
    if mode is None:
        return {}
    if mode == "full" and full_bytes is not None:
        return {"kv_tiers": mode, "kv_full_bytes": parse_size(full_bytes)}
    return {"kv_tiers": mode}


def tiers_label(mode: Any) -> str:
    return human_size(mode) if isinstance(mode, int) and not isinstance(mode, bool) else str(mode)


def tier_unsupported(point: Point, caps: Capabilities) -> str | None:
    mode = point.params.get("kv_tiers")
    if not isinstance(mode, int) or isinstance(mode, bool):
        return None
    if not caps.kv_offload:
        return "the engine has no second KV tier (kv_offload)"
    return caps.kv_offload_unsupported


def tier_overrides(point: Point, caps: Capabilities) -> dict[str, Any]:
    """The standard options a point's tier mode asks of the engine."""
    mode = point.params.get("kv_tiers")
    if mode is None:
        return {}
    off = {"kv_offload": False} if caps.kv_offload else {}
    if mode == "off":
        return off
    if mode == "full":  # the pool asked for (kv_tiers_full_bytes), else the engine's own default size
        return {**off, "kv_cache_bytes": point.params.get("kv_full_bytes")}
    return {"kv_offload": True, "kv_offload_bytes": int(mode)}


# ---- the rows ------------------------------------------------------------------------------------

def tier_split(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per turn: the prompt tokens the first tier and the second supplied and those prefilled, and
    their shares, where every completed request says how many of its cached tokens were reloaded
    (else nothing)."""
    use = [r for r in reqs if r.get("cached_tokens") is not None]
    if not use or any(r.get("reloaded_tokens") is None for r in use):
        return {}
    prompt = sum(r["prompt_tokens"] for r in use)
    t2 = sum(r["reloaded_tokens"] for r in use)
    t1 = sum(r["cached_tokens"] for r in use) - t2
    return {"tier1_hit_tokens": t1, "tier2_hit_tokens": t2, "miss_tokens": prompt - t1 - t2,
            "hit_rate_tier1": t1 / prompt if prompt else None, "hit_rate_tier2": t2 / prompt if prompt else None}


_COUNTERS = ("hit_blocks", "blocks_written", "blocks_read", "bytes_written", "bytes_read", "tokens_written",
             "tokens_read", "write_time_s", "read_time_s", "evictions", "corrupt")


def _delta(after: Any, before: Any) -> Any:
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        return {k: _delta(v, before.get(k)) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        return after - (before or 0)
    return after


def tier_counters(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """The second tier's counters over a point (after - before), the tiers' hit tokens and blocks by
    tier, and the engine's own description of the tier (capacity, medium, policy) as it is now."""
    if not after:
        return None
    out = {k: v for k, v in after.items() if k not in _COUNTERS and k != "hit_tokens"}
    for k in _COUNTERS + ("hit_tokens",):
        if k in after:
            out[k] = _delta(after[k], (before or {}).get(k))
    return out


def bytes_per_token_by_group(ctx: RunContext, info: KVCacheInfo) -> list[dict[str, Any]]:
    """The estimator's KV bytes per token per layer group (harness.core.kvcalc) at the engine's KV
    dtype: what a reload of one token moves (latent attention's small latent, a window's layers
    only inside the window)."""
    kv = kv_dtype_of(ctx.dtype, info.kv_dtype)
    est = estimate(ctx.shape, 1, 1, kv)
    return [{"kind": g.kind, "layers": g.layers, "window": g.window, "bytes_per_token": g.bytes_per_token}
            for g in est.groups if g.kind != "linear"]


def tier_fields(point: Point, reqs: list[dict[str, Any]], tiers0: dict[str, Any] | None,
                tiers1: dict[str, Any] | None, info: KVCacheInfo, ctx: RunContext) -> dict[str, Any]:
    """The row's tier fields (module docstring). Nothing for a point that asked nothing of tiers
    and whose engine runs none."""
    mode = point.params.get("kv_tiers")
    counters = tier_counters(tiers0, tiers1)
    if mode is None and counters is None:
        return {}
    out: dict[str, Any] = {"kv_tiers": mode if mode is not None else counters.get("capacity_bytes", "on"),
                           "tier2": counters}
    out["kv_tiers_label"] = tiers_label(out["kv_tiers"])
    if point.params.get("kv_full_bytes") is not None:  # a full point's pool as asked (kv_tiers_full_bytes)
        out["kv_full_bytes"] = point.params["kv_full_bytes"]
    split = tier_split([r for r in reqs if r["ok"]])
    prompt = sum(r["prompt_tokens"] for r in reqs if r["ok"])
    if split:
        out.update(hit_rate_tier1=split["hit_rate_tier1"], hit_rate_tier2=split["hit_rate_tier2"],
                   tier_source="per request (the engine's own counts)")
    elif counters and isinstance(counters.get("hit_tokens"), dict) and prompt:
        hits = counters["hit_tokens"]
        out.update(hit_rate_tier1=hits.get("1", 0) / prompt, hit_rate_tier2=sum(
            v for k, v in hits.items() if k != "1") / prompt, tier_source=f"the point's {counters.get('source')}")
    if counters:
        bw = _rate(counters.get("bytes_read"), counters.get("read_time_s"))
        out.update(tier_read_bytes_s=bw, tier_write_bytes_s=_rate(counters.get("bytes_written"),
                                                                   counters.get("write_time_s")))
        groups = bytes_per_token_by_group(ctx, info)
        bpt = sum(g["bytes_per_token"] for g in groups)
        out.update(kv_bytes_per_token_groups=groups, kv_bytes_per_token_estimate=bpt,
                   reload_s_per_token=bpt / bw if bw else None)
        tokens = (counters.get("hit_tokens") or {}).get("2") if isinstance(counters.get("hit_tokens"), dict) else None
        if tokens and counters.get("read_time_s") is not None:
            out["reload_s_per_token_measured"] = counters["read_time_s"] / tokens
    return out


def _rate(amount: Any, seconds: Any) -> float | None:
    return amount / seconds if isinstance(amount, (int, float)) and isinstance(seconds, (int, float)) \
        and seconds > 0 and amount > 0 else None


# ---- in the harness's process: the tiered point beside recompute and the bound -------------------

def _same_run(row: dict[str, Any], other: dict[str, Any], workload: str) -> bool:
    keep = ("engine", "sessions", "model")
    return (other.get("workload") == workload and other.get("status") == "ok" and other.get("prefix_caching") is True
            and all(other.get(k) == row.get(k) for k in keep))


def compare_tiers(row: dict[str, Any], rows: list[dict[str, Any]], workload: str) -> None:
    """A tiered row (kv_tiers a capacity) gets, per turn, the TTFT of the same turn with tiers off
    (`ttft_recompute_s`) and with the full pool (`ttft_full_s`), whether its own lies between them
    (`ttft_between`: full <= tiered <= recompute), the measured prefill cost per recomputed history
    token at that turn ((TTFT recompute - TTFT full) / the extra tokens the recompute run
    prefilled) and the break-even against the reload cost per token; the row the count of turns in
    between; and, where some turns did the same work in all three points, the run's noise (the
    largest spread of TTFT there) and per turn whether the tiered TTFT lies between within it
    (`ttft_between_within_noise`: full x (1 - noise) <= tiered <= recompute x (1 + noise)); and the
    order with the requests' spread taken into account (`_resolve`: `ttft_between_resolved`). Rows of
    the other two modes get nothing. Fails closed: a row with nothing to compare
    says why (`tier_comparison`), and so does one whose `full` point evicted cached blocks (or
    does not say): that point is no bound, and no turn gets a verdict against it."""
    mode = row.get("kv_tiers")
    if not isinstance(mode, int) or isinstance(mode, bool) or not row.get("turns"):
        return
    off = [r for r in rows if _same_run(row, r, workload) and r.get("kv_tiers") == "off"]
    full = [r for r in rows if _same_run(row, r, workload) and r.get("kv_tiers") == "full"]
    if not off or not full:
        row["tier_comparison"] = ("nothing to compare: the run has no " + " and no ".join(
            n for n, rs in (("kv_tiers=off point", off), ("kv_tiers=full point", full)) if not rs)
            + " of this engine with prefix caching on (workload.kv_tiers=[off,full,SIZE])")
        return
    lost = full[-1].get("prefix_cache_evictions")
    row["tier_full_pool_evictions"] = lost
    why = _not_a_bound(full[-1], lost)
    if why:  # the bound must hold every history: fail closed
        row["tier_comparison"] = (
            f"no bound: the kv_tiers=full point {why}"
            + (f" (its pool: {human_size(full[-1]['kv_full_bytes'])})" if full[-1].get("kv_full_bytes") else
               " (its pool is the engine's default size; the reference engine's CPU default is min(1 GiB, "
               "max_num_seqs x max_model_len tokens))")
            + "; no TTFT verdict. Give the full point a pool that holds every session's history: "
            "workload.kv_tiers_full_bytes=SIZE")
        return
    rec, bound = {t["turn"]: t for t in off[-1]["turns"]}, {t["turn"]: t for t in full[-1]["turns"]}
    reload = row.get("reload_s_per_token_measured") or row.get("reload_s_per_token")
    between = compared = 0
    for t in row["turns"]:
        r, f = rec.get(t["turn"]), bound.get(t["turn"])
        if r is None or f is None:
            continue
        t["ttft_recompute_s"], t["ttft_full_s"] = r.get("ttft_s"), f.get("ttft_s")
        t["hit_rate_full"], t["hit_rate_recompute"] = f.get("hit_rate"), r.get("hit_rate")
        if None in (t.get("ttft_s"), t["ttft_recompute_s"], t["ttft_full_s"]):
            continue
        compared += 1
        t["ttft_between"] = t["ttft_full_s"] <= t["ttft_s"] <= t["ttft_recompute_s"]
        between += t["ttft_between"]
        pr, pf = _mean_prefilled(r), _mean_prefilled(f)
        extra = pr - pf if pr is not None and pf is not None else None
        if extra and extra > 0:
            t["prefill_s_per_token"] = (t["ttft_recompute_s"] - t["ttft_full_s"]) / extra
            if reload:
                t["reload_over_prefill"] = reload / t["prefill_s_per_token"] if t["prefill_s_per_token"] > 0 else None
    row["tier_turns_compared"] = compared
    row["tier_turns_between"] = between
    row["tier_comparison"] = (f"{between} of {compared} turns between the full pool and recompute"
                              if compared else "no turn had TTFT in all three modes")
    noise, same = _noise_floor(row["turns"], rec, bound)
    row["tier_ttft_noise"], row["tier_ttft_noise_turns"] = noise, same
    if noise is not None and compared:
        within = 0
        for t in row["turns"]:
            if t.get("ttft_between") is None:
                continue
            t["ttft_between_within_noise"] = (t["ttft_full_s"] * (1 - noise) <= t["ttft_s"]
                                              <= t["ttft_recompute_s"] * (1 + noise))
            within += t["ttft_between_within_noise"]
        row["tier_turns_between_within_noise"] = within
        row["tier_comparison"] += (f"; {within} of {compared} within the run's noise ({noise:.1%}: the spread of the "
                                   f"three points' TTFT at turn(s) {', '.join(map(str, same))}, where they did the "
                                   "same work)")
    _resolve(row, off[-1], full[-1])


def _ttfts(row: dict[str, Any]) -> dict[int, list[float]]:
    """Every completed request's TTFT by turn (`turn_requests`)."""
    out: dict[int, list[float]] = {}
    for r in row.get("turn_requests") or []:
        if r.get("ok") and r.get("ttft_s") is not None:
            out.setdefault(r["turn"], []).append(r["ttft_s"])
    return out


def _resolve(row: dict[str, Any], off: dict[str, Any], full: dict[str, Any]) -> None:
    """Per compared turn, the tiered TTFT p50 over the bound's and over recompute's
    (`ttft_over_full`, `ttft_over_recompute`), each with the 95 % percentile-bootstrap interval of
    that ratio of medians (every point's requests of the turn resampled independently:
    harness.core.bootstrap.ratio_ci; `*_ci`), and whether the order is resolved
    (`ttft_between_resolved`): true when the interval over the bound lies at or above 1 and the
    one over recompute at or below 1; false when either lies wholly on the wrong side; null when
    the run cannot tell (an interval spans 1, or a point has fewer than 2 requests of the turn).
    The intervals see the jitter between requests of a point, not a drift of the machine between
    points (the noise above): at a turn where nothing was reloaded one can clear 1 by such a
    drift. So the row counts the turns where the second tier supplied tokens
    (`tier_turns_reloaded`) and, of those, the resolved ones."""
    from harness.core.bootstrap import ratio_ci  # the harness's process only (scipy)
    mine, rec, bound = _ttfts(row), _ttfts(off), _ttfts(full)
    reloaded = resolved = 0
    for t in row["turns"]:
        if t.get("ttft_between") is None:
            continue
        k = t["turn"]
        verdict: list[bool | None] = []
        for name, other in (("full", bound), ("recompute", rec)):
            t[f"ttft_over_{name}"] = t["ttft_s"] / t[f"ttft_{name}_s"] if t[f"ttft_{name}_s"] else None
            ci = ratio_ci([mine.get(k, []), other.get(k, [])], lambda a, b: a / b, seed=k)
            t[f"ttft_over_{name}_ci"] = list(ci) if ci else None
            if ci is None:
                verdict.append(None)
            elif name == "full":
                verdict.append(True if ci[0] >= 1 else False if ci[1] < 1 else None)
            else:
                verdict.append(True if ci[1] <= 1 else False if ci[0] > 1 else None)
        t["ttft_between_resolved"] = False if False in verdict else None if None in verdict else True
        if t.get("tier2_hit_tokens"):
            reloaded += 1
            resolved += t["ttft_between_resolved"] is True
    row["tier_turns_reloaded"], row["tier_turns_between_resolved"] = reloaded, resolved
    if reloaded:
        row["tier_comparison"] += (f"; {resolved} of the {reloaded} turns with reloads resolved between (95% "
                                   "bootstrap intervals of tiered/full and tiered/recompute)")
    else:  # nothing compared: say so rather than let a silent row read as a pass
        row["tier_comparison"] += "; no turn reloaded from the second tier: the order was not resolved at any turn"


def _noise_floor(turns: list[dict[str, Any]], rec: dict[int, Any], bound: dict[int, Any]
                 ) -> tuple[float | None, list[int]]:
    """The run's own TTFT noise: over the turns where the tiered, recompute and full points did the
    same work (the same tokens prefilled per request, nothing reloaded: no history yet, or one
    every pool still held), the largest spread max/min - 1 of their three TTFTs; None without
    such a turn."""
    spreads, same = [], []
    for t in turns:
        r, f = rec.get(t["turn"]), bound.get(t["turn"])
        if r is None or f is None or t.get("tier2_hit_tokens"):
            continue
        work = {_mean_prefilled(x) for x in (t, r, f)}
        ttfts = [x.get("ttft_s") for x in (t, r, f)]
        if len(work) != 1 or None in work or None in ttfts or min(ttfts) <= 0:
            continue
        spreads.append(max(ttfts) / min(ttfts) - 1)
        same.append(t["turn"])
    return (max(spreads) if spreads else None), same


def _not_a_bound(full: dict[str, Any], evictions: int | None) -> str | None:
    """Why a `full` point does not bound the others (it lost cached blocks), or None: it evicted
    none, or, where the engine does not count evictions, its hit rate was the reusable share (to
    half a point) at every turn."""
    if evictions is not None:
        return f"evicted {evictions} cached blocks" if evictions > 0 else None
    short = [t["turn"] for t in full.get("turns") or []
             if t.get("hit_rate") is None or t.get("reusable_share") is None
             or t["hit_rate"] < t["reusable_share"] - 0.005]
    if short or not full.get("turns"):
        return (f"does not count evictions, and its hit rate is not the reusable share at turn(s) "
                f"{', '.join(map(str, short))}" if short else "has no turns")
    return None


def _mean_prefilled(turn: dict[str, Any]) -> float | None:
    if turn.get("prefilled_tokens") is None or not turn.get("completed"):
        return None
    return turn["prefilled_tokens"] / turn["completed"]

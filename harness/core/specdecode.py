"""Speculative decoding's figures (docs/metrics.md, "Speculative decoding"): the counters of a
point, what is derived from them, the lossless check and the cross-engine agreement of accepted
tokens. Pure functions of plain data, shared by the workload (workloads/speculative.py), its
report section and its terminal summary.

- `counters_delta(before, after)`: an engine's cumulative `SpecDecodeStats` (as dicts) read
  before and after a point, as the point's own counts.
- `spec_fields(delta, duration_s)`: the row's counters and the figures derived from them:
  acceptance rate = accepted / proposed tokens, mean acceptance length = 1 + accepted / drafts,
  acceptance at draft position i = drafts whose i-th token was accepted / drafts, the draft's
  share of the point's wall time.
- `counters_check(delta, timings)`: the point's counter difference against the server's own
  per-response counts of the same requests (llama-server's `timings`), where it sends them.
- `lossless(baseline, outputs)`: every request's output tokens against the same request's
  output without speculation, token for token; fails closed (nothing compared is not a pass).
- `accepted_agreement(rows)`: for the same target, draft, k and prompts at batch 1, the share of
  requests whose accepted-token count is the same on every engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# lossless verdicts
PASS, FAIL, UNVERIFIED, BASELINE = "pass", "fail", "unverified", "baseline"
COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


def counters_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """The counts of one point: `after` - `before` (SpecDecodeStats.to_dict() of each; `before`
    None: the counters started at zero). None when the engine reports none after the point."""
    if after is None:
        return None
    before = before or {}
    out: dict[str, Any] = {k: int(after.get(k) or 0) - int(before.get(k) or 0) for k in COUNTERS}
    a, b = list(after.get("accepted_per_pos") or []), list(before.get("accepted_per_pos") or [])
    b += [0] * (len(a) - len(b))
    out["accepted_per_pos"] = [int(x) - int(y) for x, y in zip(a, b)]
    for k in ("draft_time_s", "verify_time_s"):
        out[k] = None if after.get(k) is None else float(after[k]) - float(before.get(k) or 0.0)
    out["source"] = after.get("source") or "engine"
    out["aggregate_only"] = list(after.get("aggregate_only") or [])
    return out


def spec_fields(delta: dict[str, Any] | None, duration_s: float | None = None) -> dict[str, Any]:
    """Row fields from a point's counts (`counters_delta`); all null where the engine reported
    none. A figure the engine reports only in aggregate (`aggregate_only`) is null, never derived
    from zeros."""
    names = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_per_pos",
             "spec_draft_time_s", "spec_verify_time_s", "spec_counters_source", "spec_aggregate_only",
             "acceptance_rate", "mean_acceptance_length", "acceptance_per_pos", "draft_time_share")
    if delta is None:
        return dict.fromkeys(names)
    agg = set(delta.get("aggregate_only") or [])
    drafts, proposed, accepted = delta["drafts"], delta["draft_tokens"], delta["accepted_tokens"]
    per_pos = None if "accepted_per_pos" in agg or not delta.get("accepted_per_pos") else delta["accepted_per_pos"]
    draft_time = delta.get("draft_time_s")
    out = {
        "spec_drafts": None if "drafts" in agg else drafts,
        "spec_draft_tokens": None if "draft_tokens" in agg else proposed,
        "spec_accepted_tokens": None if "accepted_tokens" in agg else accepted,
        "spec_accepted_per_pos": per_pos,
        "spec_draft_time_s": draft_time, "spec_verify_time_s": delta.get("verify_time_s"),
        "spec_counters_source": delta.get("source"), "spec_aggregate_only": sorted(agg) or None,
        "acceptance_rate": accepted / proposed if proposed and not agg & {"accepted_tokens", "draft_tokens"} else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts and not agg & {"accepted_tokens", "drafts"} else None,
        "acceptance_per_pos": [a / drafts for a in per_pos] if per_pos and drafts and "drafts" not in agg else None,
        "draft_time_share": draft_time / duration_s if draft_time is not None and duration_s else None,
    }
    return out


def counters_check(delta: dict[str, Any] | None, timings: dict[str, Any] | None) -> dict[str, Any]:
    """The server's cumulative counters' difference over a point (`counters_delta`) beside the
    per-response counts of the point's own requests, summed (`timings`: llama-server's `draft_n`,
    `draft_n_accepted`): {"spec_counters_check": "agree" | "differ: ..." | None (nothing to compare)}.
    The two are counted apart by the server (its /metrics at each slot's release, each response
    as it ends), so a difference means the counters are not the point's own (requests the point
    did not send, counts not yet added)."""
    if delta is None or not timings or "draft_n" not in timings:
        return {"spec_counters_check": None}
    counters = (int(delta["draft_tokens"]), int(delta["accepted_tokens"]))
    timed = (int(timings["draft_n"]), int(timings.get("draft_n_accepted") or 0))
    if counters == timed:
        return {"spec_counters_check": "agree"}
    return {"spec_counters_check": f"differ: counters {counters[0]} proposed / {counters[1]} accepted, the responses' "
                                   f"timings {timed[0]} / {timed[1]} over {timings.get('requests')} requests"}


@dataclass
class Lossless:
    """The lossless verdict of one speculative row against its baseline (method none)."""

    verdict: str  # pass | fail | unverified
    detail: str
    requests: int = 0  # requests compared
    tokens: int = 0  # tokens compared
    mismatch: dict[str, Any] | None = None  # {request, position, expected, got} of the first difference

    def fields(self) -> dict[str, Any]:
        return {"lossless": self.verdict, "lossless_detail": self.detail, "lossless_requests": self.requests,
                "lossless_tokens": self.tokens, "lossless_mismatch": self.mismatch}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def lossless(baseline: dict[str, list[int]] | None, outputs: dict[str, list[int]] | None,
             baseline_name: str = "the run without speculation") -> Lossless:
    """Every request's output against the baseline's output for the same request (same prompt),
    token for token. `fail` names the first request that differs (in request order), the first
    differing position and both tokens. `unverified` when nothing can be compared: no outputs on
    either side, a request the other side lacks, or token ids the engine did not return (< 0)."""
    if not baseline:
        return Lossless(UNVERIFIED, f"no output tokens of {baseline_name} to compare with")
    if not outputs:
        return Lossless(UNVERIFIED, "this row recorded no output tokens")
    missing = [r for r in baseline if r not in outputs] + [r for r in outputs if r not in baseline]
    if missing:
        return Lossless(UNVERIFIED, f"request {missing[0]} is not on both sides ({len(missing)} request(s) "
                        f"unmatched): the two rows did not serve the same requests")
    unknown = next((r for r in baseline if any(t < 0 for t in baseline[r]) or any(t < 0 for t in outputs[r])), None)
    if unknown is not None:
        return Lossless(UNVERIFIED, f"request {unknown}: the engine returned no token ids (-1), so its output "
                        "cannot be compared token by token")
    tokens = 0
    for rid in baseline:  # the baseline's request order (r0, r1, ...)
        exp, got = baseline[rid], outputs[rid]
        at = _first_difference(exp, got)
        if at is not None:
            e = exp[at] if at < len(exp) else None
            g = got[at] if at < len(got) else None
            what = (f"{baseline_name} gave {e}, speculation gave {g}" if e is not None and g is not None else
                    f"lengths differ ({len(exp)} tokens without speculation, {len(got)} with)")
            return Lossless(FAIL, f"request {rid}: output differs at token {at}: {what}", requests=len(baseline),
                            tokens=tokens + at, mismatch={"request": rid, "position": at, "expected": e, "got": g})
        tokens += len(exp)
    if tokens == 0:
        return Lossless(UNVERIFIED, "no output token to compare")
    return Lossless(PASS, f"{len(baseline)} requests, {tokens} tokens identical to {baseline_name}",
                    requests=len(baseline), tokens=tokens)


def lossless_passed(baseline: dict[str, list[int]] | None, outputs: dict[str, list[int]] | None,
                    verdict: str) -> list[str]:
    """The requests whose output is, token for token, the baseline's (each request judged on its
    own, unlike `lossless`, which stops at the first difference): the ones a cost per good token
    counts. None pass a verdict that could not compare (`unverified`: fail closed)."""
    if verdict == UNVERIFIED or not baseline or not outputs:
        return []
    return [rid for rid, got in outputs.items() if rid in baseline and all(t >= 0 for t in [*got, *baseline[rid]])
            and _first_difference(baseline[rid], got) is None]


# ---- the same accepted counts on every engine ---------------------------------------------

def agreement_key(row: dict[str, Any]) -> tuple | None:
    """What must be equal for two rows' accepted counts to be comparable: the model, the
    method's settings (draft, k, n-gram windows), the content and the prompts. Batch 1 only."""
    p = row.get("point") or {}
    if row.get("workload") != "speculative" or p.get("method") in (None, "none") or p.get("batch_size") != 1:
        return None
    return (row.get("model"), p.get("method"), p.get("k"), p.get("draft"), p.get("prompt_lookup_min"),
            p.get("prompt_lookup_max"), p.get("content"), p.get("prompt_len"), p.get("output_len"),
            row.get("prompts_sha256"))


def accepted_counts(row: dict[str, Any]) -> tuple[dict[str, int] | None, str | None]:
    """(accepted tokens per request, where they come from): the accepted tokens each request was
    given (decode tokens - decode steps, from the token times: the same on every engine however it
    counts tokens accepted past a request's last one), else the engine's counters read as each
    request ended (batch 1), else None."""
    if isinstance(row.get("accepted_per_request"), dict) and row["accepted_per_request"]:
        return {k: int(v) for k, v in row["accepted_per_request"].items()}, "token times"
    if isinstance(row.get("accepted_per_request_counters"), dict) and row["accepted_per_request_counters"]:
        return {k: int(v) for k, v in row["accepted_per_request_counters"].items()}, "engine counters"
    return None, None


def accepted_agreement(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per comparable group of ok batch-1 speculative rows from two or more engines: the engines,
    the requests every one of them has, the share of those whose accepted-token count is the
    same on every engine, the first request that differs, and where each engine's counts came
    from."""
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        key = agreement_key(r)
        if key is None or r.get("status") != "ok":
            continue
        counts, source = accepted_counts(r)
        if counts is not None:
            groups.setdefault(key, {})[r["engine"]] = {"counts": counts, "source": source}
    out = []
    for key, by_engine in groups.items():
        if len(by_engine) < 2:
            continue
        engines = sorted(by_engine)
        common = [rid for rid in by_engine[engines[0]]["counts"]
                  if all(rid in by_engine[e]["counts"] for e in engines)]
        same = [rid for rid in common if len({by_engine[e]["counts"][rid] for e in engines}) == 1]
        differ = next((rid for rid in common if rid not in same), None)
        out.append({
            "model": key[0], "method": key[1], "k": key[2], "draft": key[3], "content": key[6],
            "engines": engines, "requests": len(common), "identical": len(same),
            "identical_share": len(same) / len(common) if common else None,
            "first_difference": None if differ is None else
            {"request": differ, **{e: by_engine[e]["counts"][differ] for e in engines}},
            "sources": {e: by_engine[e]["source"] for e in engines},
        })
    return out

"""Quality of a model's next-token distributions on real text, and their distance from a baseline
engine's (docs/metrics.md, "Quality"). Pure numpy; the quality workload (workloads/quality.py)
gets the teacher-forced scores from the engines and compares them here.

Scores are what `Engine.score` returns, per window: for each scored position the top-k token ids
(best first) with their log-probabilities, and the log-probability of the token actually there.
Positions are numbered within their window (the first scored one is 1: position 0 has no
context); `long_from` splits off the "long context" positions, the last ones of every window.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def perplexity(scores: list[dict[str, Any]], start: int = 1, long_from: int | None = None) -> float | None:
    """exp(mean negative log-probability of the actual tokens) over the scored positions (those
    at or past `long_from` only, when given). None when no position is scored."""
    nll: list[float] = []
    for s in scores:
        lp = s["target_logprobs"]
        first = 0 if long_from is None else max(0, long_from - start)
        nll += [-v for v in lp[first:]]
    return float(math.exp(np.mean(nll))) if nll else None


def _kl_bucketed(b_ids: list[int], b_lp: list[float], e_map: dict[int, float], e_floor: float) -> float:
    """KL(P || Q) over k + 1 outcomes: the baseline's top-k tokens, and "any other token". P is the
    baseline's distribution, exact on those outcomes; Q the engine's: a token the engine does not
    list gets its k-th log-probability (the most it could have), and "other" what is left
    (at least 1e-12). Merging outcomes never increases a KL, so this is a lower bound of the full
    KL up to that one approximation."""
    p = np.exp(np.asarray(b_lp, dtype=float))
    q = np.exp(np.asarray([e_map.get(t, e_floor) for t in b_ids], dtype=float))
    p_rest = max(1.0 - p.sum(), 0.0)
    q_rest = max(1.0 - q.sum(), 1e-12)
    q = np.maximum(q, 1e-30)
    kl = float(np.sum(p * (np.log(np.maximum(p, 1e-30)) - np.log(q))))
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(kl, 0.0)


def compare(base: list[dict[str, Any]], eng: list[dict[str, Any]], start: int = 1,
            long_from: int | None = None) -> dict[str, Any]:
    """Top-1 agreement and mean KL of an engine's scores against the baseline's, over all scored
    positions and over the long-context ones (`long_from` and later). Fails loudly when the two
    did not score the same windows."""
    if len(base) != len(eng):
        raise ValueError(f"quality: the baseline scored {len(base)} windows, the engine {len(eng)}")
    agree: list[bool] = []
    kls: list[float] = []
    longs: list[bool] = []
    for bs, es in zip(base, eng):
        if len(bs["target_logprobs"]) != len(es["target_logprobs"]):
            raise ValueError("quality: the baseline and the engine scored windows of different lengths")
        for j in range(len(bs["target_logprobs"])):
            b_ids, b_lp = bs["top_ids"][j], bs["top_logprobs"][j]
            e_ids, e_lp = es["top_ids"][j], es["top_logprobs"][j]
            agree.append(bool(e_ids) and bool(b_ids) and e_ids[0] == b_ids[0])
            kls.append(_kl_bucketed(b_ids, b_lp, dict(zip(e_ids, e_lp)), min(e_lp) if e_lp else -math.inf))
            longs.append(long_from is not None and start + j >= long_from)
    a, k, lg = np.asarray(agree), np.asarray(kls), np.asarray(longs, dtype=bool)
    return {
        "quality_positions": int(len(a)),
        "quality_top1_agreement": float(a.mean()) if len(a) else None,
        "quality_mean_kl": float(k.mean()) if len(k) else None,
        "quality_long_positions": int(lg.sum()),
        "quality_top1_agreement_long": float(a[lg].mean()) if lg.any() else None,
        "quality_mean_kl_long": float(k[lg].mean()) if lg.any() else None,
    }


def median_margin(scores: list[dict[str, Any]]) -> float | None:
    """Median top-1/top-2 log-probability margin over the scored positions."""
    m = [lp[0] - lp[1] for s in scores for lp in s["top_logprobs"] if len(lp) > 1]
    return float(np.median(m)) if m else None

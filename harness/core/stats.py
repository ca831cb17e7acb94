"""Statistics by docs/metrics.md: percentiles by linear interpolation (numpy's default method),
mean/std/min/max/count, and a least-squares line. numpy only: worker processes, which may run
under an engine's own environment, use this module. Confidence intervals (scipy's bootstrap)
are in `harness.core.bootstrap`, computed by the harness's own process."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERCENTILES = (50, 90, 95, 99)
PERCENTILE_METHOD = "linear interpolation between closest ranks (numpy.percentile, method='linear')"


def percentile(samples: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples, dtype=float), q, method="linear"))


def summarize(samples: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, std (sample, ddof=1), min, max, p50, p90, p95, p99."""
    x = np.asarray(samples, dtype=float)
    if x.size == 0:
        return {"count": 0, "mean": None, "std": None, "min": None, "max": None,
                **{f"p{q}": None for q in PERCENTILES}}
    out: dict[str, float | int | None] = {
        "count": int(x.size), "mean": float(x.mean()),
        "std": float(x.std(ddof=1)) if x.size > 1 else 0.0,
        "min": float(x.min()), "max": float(x.max()),
    }
    for q, v in zip(PERCENTILES, np.percentile(x, PERCENTILES, method="linear")):
        out[f"p{q}"] = float(v)
    return out


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares line y = a + b x: returns (b, a), or None with fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(b), float(a)

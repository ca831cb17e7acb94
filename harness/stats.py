"""Statistics by METRICS.md: percentiles by linear interpolation (numpy's default method),
mean/std/min/max/count, and 95% bootstrap confidence intervals."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

PERCENTILES = (50, 90, 95, 99)
PERCENTILE_METHOD = "linear interpolation between closest ranks (numpy.percentile, method='linear')"
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


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


def bootstrap_ci(samples: Sequence[float], statistic: Callable[[np.ndarray], np.ndarray] | str = "median",
                 confidence: float = CONFIDENCE, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = 0) -> tuple[float, float] | None:
    """Percentile-bootstrap CI of `statistic` (median or mean). None for fewer than 2 samples."""
    x = np.asarray(samples, dtype=float)
    if x.size < 2:
        return None
    rng = np.random.default_rng(seed)
    draws = x[rng.integers(0, x.size, size=(resamples, x.size))]
    if statistic == "median":
        stats = np.median(draws, axis=1)
    elif statistic == "mean":
        stats = draws.mean(axis=1)
    else:
        stats = statistic(draws)  # type: ignore[operator]
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(stats, [alpha, 1 - alpha])
    return float(lo), float(hi)


def bootstrap_ratio_ci(baseline: Sequence[float], current: Sequence[float], confidence: float = CONFIDENCE,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple[float, float, float] | None:
    """Ratio of medians current/baseline with a percentile-bootstrap CI (independent resampling
    of both samples). Returns (ratio, low, high), or None without two samples on each side."""
    b = np.asarray(baseline, dtype=float)
    c = np.asarray(current, dtype=float)
    if b.size < 2 or c.size < 2 or np.median(b) == 0:
        return None
    rng = np.random.default_rng(seed)
    mb = np.median(b[rng.integers(0, b.size, size=(resamples, b.size))], axis=1)
    mc = np.median(c[rng.integers(0, c.size, size=(resamples, c.size))], axis=1)
    ok = mb != 0
    ratios = mc[ok] / mb[ok]
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha])
    return float(np.median(c) / np.median(b)), float(lo), float(hi)

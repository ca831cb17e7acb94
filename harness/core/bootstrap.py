"""Confidence intervals: one bootstrap, scipy's (`scipy.stats.bootstrap`, percentile method).

- `median_ci(samples)`: the interval of one sample's median (every `*_ci` field of a row).
- `ratio_ci(samples, ratio)`: the interval of a ratio of medians of independent samples
  (the regression check: current / baseline, optionally normalised by a reference engine).
- `mean_ci(values)`: the interval of a mean (the paired A/B gate: mean of per-round log-ratios).
- `paired_ratio_ci(num, den)`: the interval of median(num) / median(den) where num[i] and den[i]
  were measured on the same unit (speculative decoding's speed-up: one request's TPOT without
  and with speculation), resampled in pairs.

Each resamples `RESAMPLES` times with a fixed seed, so the same data give the same interval.
Only the harness's own process imports this module (scipy need not be in an engine's
environment).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats as _scipy_stats

RESAMPLES = 2000
CONFIDENCE = 0.95
METHOD = "percentile"


def _interval(data: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray], confidence: float,
              seed: int, paired: bool = False) -> tuple[float, float] | None:
    res = _scipy_stats.bootstrap(data, statistic, vectorized=True, axis=-1, paired=paired,
                                 confidence_level=confidence, n_resamples=RESAMPLES, method=METHOD,
                                 random_state=np.random.default_rng(seed))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return None
    return lo, hi


def median_ci(samples: Sequence[float], confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float] | None:
    """Interval of the median; None for fewer than 2 samples."""
    x = np.asarray(samples, dtype=float)
    if x.size < 2:
        return None
    return _interval((x,), lambda s, axis=-1: np.median(s, axis=axis), confidence, seed)


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float] | None:
    """Interval of the mean; None for fewer than 2 values."""
    x = np.asarray(values, dtype=float)
    if x.size < 2:
        return None
    return _interval((x,), lambda s, axis=-1: np.mean(s, axis=axis), confidence, seed)


def mean_t_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Student-t interval of the mean (n - 1 degrees of freedom); None for fewer than 2 values.
    For a handful of paired differences (infer-bench-ab's rounds): a percentile bootstrap of 4
    to 8 values is far too narrow (it cannot see beyond the values it has), and flagged 25 %
    shifts in A/A jobs on a busy machine."""
    x = np.asarray(values, dtype=float)
    if x.size < 2:
        return None
    from scipy import stats
    half = float(stats.t.ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size))
    return float(x.mean()) - half, float(x.mean()) + half


def ratio_ci(samples: Sequence[Sequence[float]], ratio: Callable[..., np.ndarray],
             confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float] | None:
    """Interval of `ratio(median(s0), median(s1), ...)`, every sample resampled independently.
    `ratio` takes arrays of medians (vectorised). None when any sample has fewer than 2 values."""
    arrays = tuple(np.asarray(s, dtype=float) for s in samples)
    if any(a.size < 2 for a in arrays):
        return None

    def statistic(*resampled: np.ndarray, axis: int = -1) -> np.ndarray:
        return ratio(*(np.median(r, axis=axis) for r in resampled))

    with np.errstate(divide="ignore", invalid="ignore"):
        return _interval(arrays, statistic, confidence, seed)


def paired_ratio_ci(num: Sequence[float], den: Sequence[float], confidence: float = CONFIDENCE,
                    seed: int = 0) -> tuple[float, float] | None:
    """Interval of median(num) / median(den), the pairs (num[i], den[i]) resampled together.
    None for fewer than 2 pairs or samples of different lengths."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if a.size < 2 or a.size != b.size:
        return None

    def statistic(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.median(x, axis=axis) / np.median(y, axis=axis)

    with np.errstate(divide="ignore", invalid="ignore"):
        return _interval((a, b), statistic, confidence, seed, paired=True)


def paired_diff_ci(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE,
                   seed: int = 0) -> tuple[float, float] | None:
    """Interval of median(a) - median(b), the pairs (a[i], b[i]) resampled together. None for fewer
    than 2 pairs or samples of different lengths."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.size < 2 or x.size != y.size:
        return None

    def statistic(p: np.ndarray, q: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.median(p, axis=axis) - np.median(q, axis=axis)

    return _interval((x, y), statistic, confidence, seed, paired=True)


SAMPLES_SUFFIX = "_samples"


def add_intervals(row: dict, confidence: float = CONFIDENCE) -> dict:
    """For every `<metric>_samples` list in a row (two or more numbers), set `<metric>_ci`, the
    interval of its median, unless the row already has one. Workers measure; the harness's own
    process adds the intervals (so scipy is needed only here). Returns the row."""
    for key in [k for k in row if k.endswith(SAMPLES_SUFFIX)]:
        ci_key = key[: -len(SAMPLES_SUFFIX)] + "_ci"
        samples = row[key]
        if row.get(ci_key) is not None or not isinstance(samples, list):  # (memory_samples is a count)
            continue
        row[ci_key] = None  # fewer than two samples: no interval, said so
        if isinstance(samples, list) and len(samples) >= 2 and \
                all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in samples):
            ci = median_ci(samples, confidence)
            row[ci_key] = list(ci) if ci else None
    return row

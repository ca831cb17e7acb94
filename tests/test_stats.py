"""Statistics by METRICS.md, on hand-computed examples."""

import numpy as np
import pytest

from harness.stats import bootstrap_ci, bootstrap_ratio_ci, percentile, summarize


def test_percentile_linear_interpolation():
    x = [1.0, 2.0, 3.0, 4.0]
    # rank = q/100 * (n-1): p50 -> 1.5 -> 2.5; p90 -> 2.7 -> 3.7; p99 -> 2.97 -> 3.97
    assert percentile(x, 50) == 2.5
    assert percentile(x, 90) == pytest.approx(3.7)
    assert percentile(x, 99) == pytest.approx(3.97)


def test_summarize():
    s = summarize([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0])
    assert s["count"] == 8 and s["mean"] == 5.0 and s["min"] == 2.0 and s["max"] == 9.0
    assert s["std"] == pytest.approx(np.std([2, 4, 4, 4, 5, 5, 7, 9], ddof=1))
    assert s["p50"] == 4.5
    assert summarize([])["p50"] is None and summarize([3.0])["std"] == 0.0


def test_bootstrap_ci_contains_median_and_shrinks_with_n():
    rng = np.random.default_rng(1)
    small = rng.normal(10, 1, 10)
    large = rng.normal(10, 1, 1000)
    lo_s, hi_s = bootstrap_ci(small)
    lo_l, hi_l = bootstrap_ci(large)
    assert lo_s <= np.median(small) <= hi_s and lo_l <= np.median(large) <= hi_l
    assert hi_l - lo_l < hi_s - lo_s
    assert bootstrap_ci([1.0]) is None


def test_ratio_ci():
    rng = np.random.default_rng(2)
    base = rng.normal(100, 2, 30)
    r, lo, hi = bootstrap_ratio_ci(base, base * 1.2)
    assert r == pytest.approx(1.2) and lo <= 1.2 <= hi and lo > 1.1

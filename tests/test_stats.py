"""Statistics by docs/metrics.md, on hand-computed examples."""

import numpy as np
import pytest

from harness.core.bootstrap import add_intervals, median_ci, ratio_ci
from harness.core.stats import fit_slope, percentile, summarize


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
    lo_s, hi_s = median_ci(small)
    lo_l, hi_l = median_ci(large)
    assert lo_s <= np.median(small) <= hi_s and lo_l <= np.median(large) <= hi_l
    assert hi_l - lo_l < hi_s - lo_s
    assert median_ci([1.0]) is None


def test_ratio_ci():
    rng = np.random.default_rng(2)
    base = rng.normal(100, 2, 30)
    lo, hi = ratio_ci([base, base * 1.2], lambda b, c: c / b)
    assert lo <= 1.2 <= hi and lo > 1.1 and hi < 1.3
    # normalised by a reference engine measured beside each side: the machine's 2x cancels
    ref = rng.normal(50, 1, 30)
    lo, hi = ratio_ci([base, base * 2.4, ref, ref * 2.0], lambda b, c, rb, rc: (c / rc) / (b / rb))
    assert lo <= 1.2 <= hi and lo > 1.1 and hi < 1.3


def test_add_intervals_fills_every_samples_field():
    row = {"ttft_s_samples": [0.1, 0.2, 0.3, 0.4], "itl_s_samples": [0.5], "tpot_s_samples": [1, 2, 3],
           "tpot_s_ci": [9, 9]}
    add_intervals(row)
    lo, hi = row["ttft_s_ci"]
    assert 0.1 <= lo <= 0.25 <= hi <= 0.4
    assert row["itl_s_ci"] is None        # one sample: no interval
    assert row["tpot_s_ci"] == [9, 9]     # given intervals are kept


def test_fit_slope():
    b, a = fit_slope([64, 128, 256], [0.01 + 1e-5 * n for n in (64, 128, 256)])
    assert b == pytest.approx(1e-5) and a == pytest.approx(0.01)
    assert fit_slope([64], [0.1]) is None

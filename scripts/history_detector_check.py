"""How the history's change-point detector (Apache Otava's E-Divisive means, as
harness.core.history calls it) behaves on synthetic series shaped like a backfill: the figures
docs/history.md quotes ("Why Otava").

    .venv/bin/python scripts/history_detector_check.py [--trials 50] [--commits 8] [--runs 5]

Per trial: `commits` commits of `runs` runs each; each run's value is level x (1 + N(0, noise));
with `drift`, every commit's runs also share an offset N(0, drift) (runs measured back to back
while the machine is slower for a while). A series with a 20 % step at the middle commit must
give one change point there; a flat one none. Prints the hit and false-alarm counts per
(drift, minimum magnitude) and the time per series.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from otava.analysis import compute_change_points


def series(rng: np.random.Generator, commits: int, runs: int, step: float, noise: float, drift: float) -> list[float]:
    out: list[float] = []
    for c in range(commits):
        level = (step if c >= commits // 2 else 1.0) * (1 + rng.normal(0, drift))
        out += list(level * (1 + rng.normal(0, noise, runs)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--commits", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--noise", type=float, default=0.03)
    ap.add_argument("--max-pvalue", type=float, default=0.001)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    at = (args.commits // 2) * args.runs
    print(f"{args.commits} commits x {args.runs} runs, noise {args.noise:.0%}, p <= {args.max_pvalue}, "
          f"{args.trials} trials each")
    for drift in (0.0, 0.02, 0.05):
        for floor in (0.0, 0.05, 0.10):
            hits = alarms = 0
            t0 = time.perf_counter()
            for _ in range(args.trials):
                found, _ = compute_change_points(series(rng, args.commits, args.runs, 1.2, args.noise, drift),
                                                 window_len=50, max_pvalue=args.max_pvalue, min_magnitude=floor)
                hits += [c.index for c in found] == [at]
                flat, _ = compute_change_points(series(rng, args.commits, args.runs, 1.0, args.noise, drift),
                                                window_len=50, max_pvalue=args.max_pvalue, min_magnitude=floor)
                alarms += bool(flat)
            ms = (time.perf_counter() - t0) / (2 * args.trials) * 1e3
            print(f"per-commit drift {drift:.0%}, magnitude floor {floor:.0%}: 20 % step found exactly "
                  f"{hits}/{args.trials}; flat series with a change point {alarms}/{args.trials}; {ms:.1f} ms/series")


if __name__ == "__main__":
    main()

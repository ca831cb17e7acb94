"""How steady this machine's CPU speed is: the same pure-Python loop timed over and over on every
core at once (one pinned process per core), the median per 1-second (and 2-second) window
reported relative to the fastest window. docs/reference-engine.md quotes it to say why a 5 %
A/B bar needs many rounds here.

    .venv/bin/python scripts/cpu_noise.py [--seconds 40] [--cores 0,1]

Prints per core the slowdown of the worst 1-s and 2-s windows, and the correlation of the cores'
1-s windows (near 1: the whole machine slows together, so running two sides at once would cancel
it; near 0: each core on its own). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORKER = r"""
import json, sys, time
start, seconds, out = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
def work():
    s = 0
    for i in range(100000):
        s += i * i
    return s
samples = []
while time.time() < start:
    pass
while time.time() < start + seconds:
    t = time.perf_counter()
    work()
    samples.append((time.time() - start, time.perf_counter() - t))
json.dump(samples, open(out, "w"))
"""


def windows(samples: list, width: float) -> np.ndarray:
    """Median loop time per window of `width` seconds."""
    x = np.array(samples)
    idx = (x[:, 0] // width).astype(int)
    return np.array([np.median(x[idx == i, 1]) for i in range(idx.max()) if (idx == i).any()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--cores", default=",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    args = ap.parse_args()
    cores = [int(c) for c in args.cores.split(",")]
    start = time.time() + 2.0
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"core{c}.json" for c in cores]
        procs = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", WORKER, str(start),
                                   str(args.seconds), str(out)]) for c, out in zip(cores, outs)]
        codes = [p.wait() for p in procs]
        if any(codes):
            sys.exit(f"cpu_noise: a worker failed (exit codes {codes}); is taskset installed?")
        samples = [json.loads(out.read_text()) for out in outs]
    per_second = []
    for c, s in zip(cores, samples):
        w1, w2 = windows(s, 1.0), windows(s, 2.0)
        per_second.append(w1)
        print(f"core {c}: {len(s)} loops; worst 1-s window {w1.max() / w1.min():.2f}x the best, "
              f"worst 2-s window {w2.max() / w2.min():.2f}x")
    if len(per_second) > 1:
        n = min(map(len, per_second))
        r = np.corrcoef(np.log(per_second[0][:n]), np.log(per_second[1][:n]))[0, 1]
        print(f"correlation of cores {cores[0]} and {cores[1]} per 1-s window: {r:.2f}")


if __name__ == "__main__":
    main()

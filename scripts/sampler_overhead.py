"""How much the memory sampler costs the work it measures.

Runs a fixed CPU workload (bf16/fp32 matrix products through torch, which releases the GIL
as engines do) for a few seconds with the sampler off and at 100 Hz, alternating, and prints:

- the sampler thread's own CPU time as a share of the wall time (time.thread_time in the
  thread: a direct measurement, insensitive to other load on the machine), and
- the median throughput of the workload with and without sampling (noisy on shared machines).

    .venv/bin/python scripts/sampler_overhead.py [--hz 100] [--rounds 5] [--seconds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from harness.core.memory import MemorySampler


def work(seconds: float) -> float:
    a = torch.randn(512, 512)
    b = torch.randn(512, 512)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hz", type=float, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    work(0.5)
    off, on, shares = [], [], []
    for _ in range(args.rounds):
        off.append(work(args.seconds))
        s = MemorySampler(args.hz).start()
        on.append(work(args.seconds))
        r = s.stop()
        shares.append(r.overhead_frac)
    print(f"sampler at {args.hz:g} Hz: {r.samples} samples in the last round")
    print(f"sampler CPU time / wall time: median {statistics.median(shares) * 100:.3f} % of one core "
          f"(max {max(shares) * 100:.3f} %)")
    slow = 1 - statistics.median(on) / statistics.median(off)
    print(f"workload throughput: off {statistics.median(off):.1f}/s, on {statistics.median(on):.1f}/s "
          f"-> {slow * 100:+.2f} % slower with sampling (noise included)")


if __name__ == "__main__":
    main()

"""How far to trust the CI regression gate on this machine: its false-alarm rate over A/A jobs
(the same commit against itself) and its detection rate of a real slowdown of about 25 % (the
reference engine told to busy-wait 25 % of every forward step, `step_delay_frac=0.25`), at the gate's
own settings (ci/regression_gate.sh) - the figures the README quotes.

    .venv/bin/python scripts/ab_calibrate.py --aa 30 --detect 10 [--rounds 8] [--threshold 10%]

Each job is one `infer-bench-ab` run (baseline and candidate interleaved, paired per round). The
script prints every job's verdict and worst ratio, then the rates, the CPU and the time a job
takes. Run it on an otherwise idle machine: it measures the gate, not the neighbours.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The gate's workload (ci/regression_gate.sh): keep the two in step.
GATE = ["engines=[reference]", "model=tiny", "dtype=float32", "engine_options.reference.num_threads=1",
        "workload.batch_sizes=[1,8]", "workload.prompt_lens=[128]", "workload.output_len=32",
        "workload.warmup=2", "workload.min_repeats=8", "workload.min_duration_s=1"]
HANDICAP = "engine_options.reference.step_delay_frac=0.25"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def job(out: Path, rounds: int, threshold: str, handicap: bool) -> dict:
    cmd = [sys.executable, "-m", "harness.ab", "--baseline-ref", "HEAD", "--candidate-ref", "HEAD",
           "--rounds", str(rounds), "--threshold", threshold, "--out", str(out)]
    if handicap:
        cmd += ["--candidate-override", HANDICAP]
    t0 = time.perf_counter()
    r = subprocess.run([*cmd, "--", *GATE], cwd=REPO, capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise SystemExit(f"infer-bench-ab failed ({r.returncode}):\n{r.stderr[-3000:]}")
    doc = json.loads((out / "ab.json").read_text())
    doc["seconds"] = time.perf_counter() - t0
    return doc


def worst(doc: dict) -> str:
    """The result furthest on the bad side (latency up, throughput down)."""
    def bad(r: dict) -> float:
        if r["ratio"] is None:
            return 0.0
        return r["ratio"] if r["better"] == "lower" else 1 / r["ratio"]
    r = max(doc["results"], key=bad)
    return f"{r['metric']} {r['point'].split(':', 1)[-1]} ratio {r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aa", type=int, default=30, help="A/A jobs (default 30)")
    ap.add_argument("--detect", type=int, default=10, help="jobs with the 25 %% handicap (default 10)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threshold", default="10%")
    ap.add_argument("--out", default="/tmp/ab-calibrate")
    args = ap.parse_args()
    out = Path(args.out)
    print(f"CPU: {cpu_name()}; gate: {args.rounds} rounds, threshold {args.threshold}", flush=True)
    false_alarms, detected, seconds = 0, 0, []
    for i in range(args.aa):
        doc = job(out / f"aa{i}", args.rounds, args.threshold, handicap=False)
        false_alarms += doc["verdict"] == "regressed"
        seconds.append(doc["seconds"])
        print(f"A/A {i + 1:>2}/{args.aa}: {doc['verdict']:<10} worst: {worst(doc)}  ({doc['seconds']:.0f} s)", flush=True)
    for i in range(args.detect):
        doc = job(out / f"slow{i}", args.rounds, args.threshold, handicap=True)
        decode = [r for r in doc["results"] if r["metric"] == "decode_step_latency_s"]
        hit = doc["verdict"] == "regressed"
        detected += hit
        seconds.append(doc["seconds"])
        ratios = ", ".join(f"{r['ratio']:.3f}" for r in decode)
        print(f"+25% {i + 1:>2}/{args.detect}: {doc['verdict']:<10} decode-step ratios {ratios}  ({doc['seconds']:.0f} s)",
              flush=True)
    print(f"\nfalse alarms: {false_alarms} of {args.aa} A/A jobs; detected: {detected} of {args.detect} jobs with a "
          f"25 % slowdown; threshold {args.threshold}, {args.rounds} rounds; a job takes "
          f"{sorted(seconds)[len(seconds) // 2]:.0f} s (median) on {cpu_name()}")


if __name__ == "__main__":
    main()

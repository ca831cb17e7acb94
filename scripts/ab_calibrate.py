"""How far to trust the CI regression gate on this machine: its false-alarm rate over A/A jobs
(the same commit against itself) and its detection rate of real slowdowns (the reference engine
told to busy-wait a share of every forward step, `engine_options.reference.step_delay_frac`: real
extra CPU work in the decode step, not a sleep), each job one run of the gate itself
(ci/regression_gate.sh, so at exactly its settings), the figures README "How far to trust it"
quotes.

    .venv/bin/python scripts/ab_calibrate.py --aa 30 --detect 0.05:20 --detect 0.10:20 --parallel 2

`--parallel 2` runs two jobs at a time, each pinned to a core of its own (`--cpu`): every job
then runs beside another (the "under load" condition the false-alarm rate is quoted for); the
jobs are interleaved across conditions (A/A, 5 %, 10 %, A/A, ...), so a busier stretch of the
machine does not fall on one condition. The script prints every job's verdict, decode ratios and
intervals, then per condition the jobs flagged REGRESSED, the smallest handicap flagged in at
least 90 % of its jobs, the CPU and the time a job takes (`--parallel 1 --aa 0 --detect 0.05:3`:
alone).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import shlex
import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GATE = REPO / "ci" / "regression_gate.sh"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def job_command(out: Path, handicap: float, cpu: int | None, extra: list[str]) -> list[str]:
    """One gate job, the same commit (HEAD) on both sides, `handicap` on the candidate."""
    args = [str(out), "--baseline-ref", "HEAD", "--candidate-ref", "HEAD", *extra]
    if cpu is not None:
        args += ["--cpu", str(cpu)]
    if handicap:
        args += ["--candidate-override", f"engine_options.reference.step_delay_frac={handicap:g}"]
    return ["bash", str(GATE), *args]


def batch(jobs: list[tuple[Path, list[str]]], hold: list[str]) -> list[dict]:
    """Run `jobs` at the same time (each its own gate run), inside one `hold` command (e.g.
    `/work/tools/cpu run`); their verdict documents, each with its seconds and exit code."""
    env = dict(os.environ, HISTORY="", BIN=str(Path(sys.executable).parent))
    script = "\n".join(f"( s=$(date +%s.%N); {shlex.join(cmd)} > {shlex.quote(str(out))}.log 2>&1; "
                       f"echo $? $s $(date +%s.%N) > {shlex.quote(str(out))}.rc ) &" for out, cmd in jobs) + "\nwait\n"
    for out, _ in jobs:
        shutil.rmtree(out, ignore_errors=True)
    subprocess.run([*hold, "bash", "-c", script], cwd=REPO, env=env)
    docs = []
    for out, _ in jobs:
        try:
            code, t0, t1 = Path(f"{out}.rc").read_text().split()
            doc = json.loads((out / "ab.json").read_text())
        except (OSError, ValueError):
            code, t0, t1 = "?", "0", "0"
            log = Path(f"{out}.log").read_text(errors="replace")[-2000:] if Path(f"{out}.log").exists() else ""
            doc = {"verdict": "no verdict file", "results": [], "failed_because": [log]}
        doc["seconds"], doc["exit"] = float(t1) - float(t0), code
        docs.append(doc)
    return docs


def decode_rows(doc: dict) -> str:
    rows = [r for r in doc.get("results", []) if r.get("decisive", True) and r["ratio"] is not None]
    return "; ".join(f"{r['metric'].split('_')[0]} b{json.loads(r['point'].split(':', 1)[1])['batch_size']} {r['ratio']:.3f} "
                     f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]" for r in rows) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aa", type=int, default=30, help="A/A jobs (default 30)")
    ap.add_argument("--detect", action="append", metavar="FRAC:JOBS",
                    help="jobs with a handicap, e.g. 0.05:20 (repeatable; default 0.05:20 and 0.10:20)")
    ap.add_argument("--parallel", type=int, default=2, choices=(1, 2), help="jobs at a time (default 2: under load)")
    ap.add_argument("--out", default="/tmp/ab-calibrate")
    ap.add_argument("--hold", help="a command each batch of jobs runs under, e.g. '/work/tools/cpu run' (a shared "
                                   "hold per batch, so that other work can get in between)")
    ap.add_argument("--log", help="also append every job's verdict document (JSON lines) to this file")
    ap.add_argument("gate_args", nargs="*", help="extra infer-bench-ab options for every job (after --)")
    args = ap.parse_args()
    conditions: list[tuple[float, int]] = [(0.0, args.aa)]
    for d in args.detect or ["0.05:20", "0.10:20"]:
        frac, n = d.split(":")
        conditions.append((float(frac), int(n)))
    # interleave the conditions: A/A, 5 %, 10 %, A/A, ...
    queue: list[tuple[float, int]] = []
    left = {f: n for f, n in conditions}
    while any(left.values()):
        for f, _ in conditions:
            if left[f]:
                queue.append((f, left[f]))
                left[f] -= 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpus = sorted(os.sched_getaffinity(0))
    print(f"CPU: {cpu_name()}, {len(cpus)} cores; {len(queue)} gate jobs (ci/regression_gate.sh), "
          f"{args.parallel} at a time", flush=True)
    hold = shlex.split(args.hold) if args.hold else []
    slots = [cpus[i % len(cpus)] for i in range(args.parallel)] if args.parallel > 1 else [None]
    results: dict[float, list[dict]] = {f: [] for f, _ in conditions}
    for b in range(0, len(queue), args.parallel):
        items = list(zip(queue[b:b + args.parallel], slots))
        jobs = [(out / f"{'aa' if not frac else f'h{frac:g}'}-{i}", job_command(
            out / f"{'aa' if not frac else f'h{frac:g}'}-{i}", frac, cpu, args.gate_args)) for (frac, i), cpu in items]
        for ((frac, _), cpu), doc in zip(items, batch(jobs, hold)):
            results[frac].append(doc)
            label = "A/A" if not frac else f"+{frac:.0%}"
            why = "" if doc["verdict"] in ("regressed", "improved", "unchanged") else \
                f"  ({'; '.join(doc.get('failed_because') or [])[:300]})"
            print(f"{time.strftime('%H:%M:%S')} {label:>5} {len(results[frac]):>2}: {doc['verdict']:<10} "
                  f"{decode_rows(doc)}  ({doc['seconds']:.0f} s, core {cpu}){why}", flush=True)
            if args.log:
                with open(args.log, "a") as f:
                    f.write(json.dumps({"handicap": frac, "cpu": cpu, **doc}) + "\n")
    print(f"\n| condition | jobs | verdict REGRESSED | FAILED | rate | median job |")
    print("|---|---|---|---|---|---|")
    caught = []
    for frac, n in conditions:
        docs = results[frac]
        reg = sum(d["verdict"] == "regressed" for d in docs)
        failed = sum(d["verdict"] not in ("regressed", "improved", "unchanged") for d in docs)
        secs = sorted(d["seconds"] for d in docs)
        label = "A/A (same commit)" if not frac else f"handicap step_delay_frac={frac:g}"
        rate = f"false alarms {reg}/{len(docs)}" if not frac else f"detected {reg}/{len(docs)}"
        print(f"| {label} | {len(docs)} | {reg} | {failed} | {rate} | {secs[len(secs) // 2]:.0f} s |" if docs else
              f"| {label} | 0 | - | - | - | - |")
        if frac and docs and reg >= 0.9 * len(docs):
            caught.append(frac)
    print(f"\nsmallest handicap flagged in >= 90 % of its jobs: {min(caught):.0%}" if caught else
          "\nno handicap was flagged in >= 90 % of its jobs")
    print(f"CPU: {cpu_name()}, {len(cpus)} cores; {args.parallel} job(s) at a time")


if __name__ == "__main__":
    main()

"""`infer-bench-compare`: a regression check that a CI pipeline can trust.

    infer-bench-compare --baseline B --current C [--metric M ...] [--threshold 5%]
                        [--normalize-by ENGINE] [--confidence 0.95] [--allow-other-machine]
                        [--json OUT] [--html OUT]

B and C are results files or run directories (single runs or multiruns). The comparison itself
(matching, bootstrap intervals, verdicts) is `harness.core.compare`.

Where both runs were priced (`cost.*`), the cost per Mtok and per good Mtok of output of every
point priced on both sides are shown as ratios current / baseline after the verdict (a note where
the two were priced differently: the ratio then mixes the price with the engine). They inform and
are not gated on. Runs priced in different currencies: exit 2, unless `--no-cost`.

Baseline and current must come from the same kind of machine (CPU model and ISA, cores, GPUs,
torch and engine versions, as each run's environment.json and rows record them): otherwise the
command refuses, naming what differs (exit 2). `--allow-other-machine` compares anyway and the
verdict then says "different machines". To gate CI on a machine that changes between runs, use
`infer-bench-ab`, which runs baseline and candidate interleaved on one machine.

`--normalize-by ENGINE` divides each engine's metric by ENGINE's metric at the same point of
the same run before comparing (the bootstrap resamples all four sample sets).

Exit codes: 0 nothing regressed (verdict UNCHANGED, or IMPROVED when a metric improved), 1 REGRESSED or FAILED (a point failed or lost a metric, a point
is found on one side only - unless `--allow-missing` - or no metric was compared), 2 unusable
input (missing files, no matching rows at all, rows of another schema version, runs from
different machines).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from harness.core.compare import (
    METHOD, METRICS, compare, format_table, machine_differences, machine_kind, overall_verdict,
    parse_threshold, row_key,
)
from harness.core.cost import compare_costs, format_cost_ratios
from harness.core.errors import EXIT_BAD_INPUT, UserError
from harness.core.results import SCHEMA_VERSION, RunFile, atomic_write_text, load_results
from reports import write_report
from workloads import load_all as load_workloads


def _side(runs: list[RunFile]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of one side and its machine (every run of a side must share one machine)."""
    rows = [r for run in runs for r in run.rows]
    kinds = [machine_kind(run.environment, run.rows) for run in runs]
    merged: dict[str, Any] = {}
    for k in kinds:
        merged.update({key: v for key, v in k.items() if v is not None})
    return rows, merged


def machine_check(base_runs: list[RunFile], cur_runs: list[RunFile]) -> list[str]:
    """What differs between the baseline's and the current run's machines (empty: same kind)."""
    missing = [str(r.path) for r in base_runs + cur_runs if r.environment is None]
    if missing:
        return [f"no environment.json beside {m}" for m in missing]
    return machine_differences(_side(base_runs)[1], _side(cur_runs)[1])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="infer-bench-compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", nargs="+", required=True, help="results files or run directories")
    ap.add_argument("--current", nargs="+", required=True, help="results files or run directories")
    ap.add_argument("--metric", action="append", choices=sorted(METRICS), help="metrics to compare (repeatable)")
    ap.add_argument("--threshold", default="5%", help="smallest change that counts (default 5%%)")
    ap.add_argument("--confidence", type=float, default=0.95, help="confidence of the intervals (default 0.95)")
    ap.add_argument("--normalize-by", metavar="ENGINE", help="divide by this engine's metric from the same run")
    ap.add_argument("--allow-other-machine", action="store_true",
                    help="compare runs from different machines anyway (the verdict says so)")
    ap.add_argument("--allow-missing", action="store_true",
                    help="points found on one side only are listed but do not fail the comparison (a deliberate "
                         "change of points)")
    ap.add_argument("--no-cost", action="store_true",
                    help="leave out the cost ratios (runs priced in different currencies)")
    ap.add_argument("--json", default="compare.json", help="verdict file (default compare.json)")
    ap.add_argument("--html", help="also write the report's comparison section to this HTML file")
    return ap


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    load_workloads()  # each workload registers the metrics it is compared on
    threshold = parse_threshold(args.threshold)
    if not 0.5 < args.confidence < 1:
        raise UserError(f"--confidence {args.confidence}: give a value between 0.5 and 1, e.g. 0.95.")
    base_runs = load_results(args.baseline, "--baseline")
    cur_runs = load_results(args.current, "--current")
    differences = machine_check(base_runs, cur_runs)
    if differences and not args.allow_other_machine:
        raise UserError("--baseline and --current come from different machines, so their timings are not "
                        "comparable: " + "; ".join(differences) + ". Re-run the baseline on this machine "
                        "(infer-bench-ab runs both interleaved), or pass --allow-other-machine to compare anyway.")
    base, cur = _side(base_runs)[0], _side(cur_runs)[0]
    if args.normalize_by and not any(r.get("engine") == args.normalize_by for r in base + cur):
        raise UserError(f"--normalize-by {args.normalize_by}: no rows of that engine in the results.")
    comps, unmatched = compare(base, cur, args.metric, threshold, args.confidence, args.normalize_by)
    if not comps:
        raise UserError("no matching rows: baseline and current share no (engine, model, workload, point, dtype) "
                        "with a metric to compare. Compare runs of the same config.")
    costs, problems = ([], []) if args.no_cost else compare_costs(base, cur, row_key)
    if problems:
        raise UserError(problems)
    print(format_table(comps))
    for side, keys in unmatched.items():
        for k in keys:
            print(f"unmatched ({side.replace('_', ' ')}): {k}")
    overall, counts = overall_verdict(comps)
    why = failure_reasons(comps, unmatched, args.allow_missing)
    if why:
        overall = "failed"
    machines = "different machines" if differences else "same machine"
    print(f"\nverdict: {overall.upper()}  ({', '.join(f'{n} {v}' for v, n in counts.items() if n)}; "
          f"threshold {threshold:.1%}, {args.confidence:.0%} bootstrap CIs"
          + (f", normalised by {args.normalize_by}" if args.normalize_by else "") + f"; {machines}"
          + ("; --allow-missing" if args.allow_missing else "") + ")")
    for w in why:
        print(f"  FAILED: {w}")
    for d in differences:
        print(f"different machines: {d}")
    if costs:  # informational: a cost is the price over the throughput, and is not gated on
        print("\ncost ratios (current / baseline; below 1 is cheaper; not part of the verdict):\n"
              + format_cost_ratios(costs))
    doc = {"verdict": overall, "failed_because": why, "counts": counts, "threshold": threshold,
           "confidence": args.confidence, "allow_missing": args.allow_missing,
           "normalize_by": args.normalize_by, "method": METHOD, "machines": machines,
           "machine_differences": differences, "schema_version": SCHEMA_VERSION, "baseline": args.baseline,
           "current": args.current, "comparisons": [asdict(c) for c in comps], "unmatched": unmatched,
           "cost_ratios": [asdict(c) for c in costs]}
    atomic_write_text(args.json, json.dumps(doc, indent=2))
    print(f"verdict file: {args.json}")
    if args.html:
        print(f"report: {write_report(args.current, args.html, baseline=args.baseline, threshold=threshold)}")
    return 0 if overall in ("unchanged", "improved") else 1


def failure_reasons(comps: list, unmatched: dict[str, list[str]], allow_missing: bool) -> list[str]:
    """Why the comparison fails closed: nothing compared, failed or missing metrics, and points
    found on one side only (unless allow_missing)."""
    why = []
    compared = sum(c.verdict in ("regressed", "improved", "unchanged") for c in comps)
    if not compared:
        why.append("no metric was compared (every matched point lacks the compared values on one side)")
    for c in comps:
        if c.verdict == "failed":
            why.append(f"{c.engine} {c.workload} {(c.point or '').split(':', 1)[-1]} {c.metric}: {c.note}")
    if not allow_missing:
        for side, keys in unmatched.items():
            if keys:
                why.append(f"{len(keys)} point(s) only in the {side.split('_')[0]} run (pass --allow-missing if "
                           f"the change of points is deliberate): {'; '.join(keys[:5])}"
                           + (" ..." if len(keys) > 5 else ""))
    return why


def main(argv: list[str] | None = None) -> None:
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(e.render("infer-bench-compare"), file=sys.stderr)
        code = EXIT_BAD_INPUT
    sys.exit(code)


if __name__ == "__main__":
    main()

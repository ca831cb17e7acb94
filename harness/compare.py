"""`infer-bench-compare`: a regression check that a CI pipeline can trust.

    infer-bench-compare --baseline B --current C [--metric M ...] [--threshold 5%]
                        [--normalize-by ENGINE] [--confidence 0.95] [--json OUT] [--html OUT]

B and C are results files or run directories (single runs or multiruns). Rows are matched by
engine, model, workload, point and dtype; rows found on one side only are listed, not dropped.

For each matched metric the ratio current/baseline of the medians gets a confidence interval
by the percentile bootstrap (both sides' repeat samples resampled independently, 2,000 times).
The verdict is **regressed** only when the whole interval lies beyond the threshold in the
bad direction (slower, less throughput, more memory), **improved** when it lies beyond it in the
good direction, and **unchanged** otherwise. A point that was ok in the baseline and failed in
the current run is a regression too.

`--normalize-by ENGINE` divides each engine's metric by ENGINE's metric at the same point of
the same run before comparing (the bootstrap resamples all four sample sets), so a baseline
recorded on one machine can be checked on another.

Exit codes: 0 nothing regressed, 1 something regressed, 2 unusable input (missing files, no
matching rows, rows of another schema version).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import EXIT_BAD_INPUT, UserError
from harness.results import SCHEMA_VERSION, atomic_write_text, read_rows, results_files
from harness.stats import BOOTSTRAP_RESAMPLES

METHOD = ("ratio of medians (current / baseline) with a percentile-bootstrap confidence interval: each "
          "side's repeat samples resampled independently with replacement, {n} resamples")

# metric -> (samples field, direction): "lower" = lower is better. Throughputs are compared
# through the latency samples they are computed from (throughput ratio = 1 / latency ratio).
METRICS: dict[str, tuple[str | None, str, bool]] = {
    # name: (samples field, better, inverse of the samples' ratio)
    "prefill_latency_s": ("prefill_latency_s_samples", "lower", False),
    "decode_step_latency_s": ("decode_step_latency_s_samples", "lower", False),
    "e2e_latency_s": ("e2e_latency_s_samples", "lower", False),
    "output_tok_s": ("e2e_latency_s_samples", "higher", True),
    "ttft_s": ("ttft_s_samples", "lower", False),
    "tpot_s": ("tpot_s_samples", "lower", False),
    "itl_s": ("itl_s_samples", "lower", False),
    "e2el_s": ("e2el_s_samples", "lower", False),
    "peak_memory_bytes": (None, "lower", False),
}
DEFAULT_METRICS = {
    "sweep": ["prefill_latency_s", "decode_step_latency_s", "output_tok_s", "peak_memory_bytes"],
    "kv_ablation": ["decode_step_latency_s"],
    "serving": ["ttft_s", "tpot_s", "itl_s", "e2el_s"],
    "prefix_sharing": ["ttft_s"],
}
KEY_FIELDS = ("engine", "model", "workload", "point_key", "dtype")


@dataclass
class Comparison:
    engine: str
    model: str
    workload: str
    point: str
    dtype: str
    metric: str
    better: str
    baseline: float | None
    current: float | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    verdict: str  # regressed | improved | unchanged | failed | no-data
    normalized_by: str | None = None
    note: str | None = None


def _key(r: dict[str, Any]) -> tuple:
    return tuple(r.get(k) for k in KEY_FIELDS)


def load(paths: list[str], side: str) -> list[dict[str, Any]]:
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise UserError(f"--{side} {' '.join(missing)}: no such file or directory. "
                        "Give results.jsonl files or run directories.")
    files = results_files(paths)
    if not files:
        raise UserError(f"--{side} {' '.join(paths)}: no results.jsonl found there.")
    rows = []
    for f in files:
        try:
            rows += read_rows(f)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"--{side} {f}: not a readable results file ({e}).") from None
    versions = {r.get("schema_version") for r in rows}
    if versions != {SCHEMA_VERSION}:
        other = sorted(str(v) for v in versions if v != SCHEMA_VERSION)
        raise UserError(f"--{side}: rows of results schema version {', '.join(other)}; this infer-bench reads "
                        f"version {SCHEMA_VERSION} only. Re-run the {side} with this version (no migration "
                        "exists for older files).")
    return [r for r in rows if r.get("workload") != "parity"]


def _bootstrap(ratio_fn, samples: list[np.ndarray], confidence: float, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    meds = [np.median(s[rng.integers(0, s.size, size=(BOOTSTRAP_RESAMPLES, s.size))], axis=1) for s in samples]
    ratios = ratio_fn(*meds)
    ratios = ratios[np.isfinite(ratios)]
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha])
    return float(lo), float(hi)


def verdict(lo: float | None, hi: float | None, better: str, threshold: float) -> str:
    if lo is None or hi is None:
        return "no-data"
    if better == "lower":
        return "regressed" if lo > 1 + threshold else "improved" if hi < 1 - threshold else "unchanged"
    return "regressed" if hi < 1 - threshold else "improved" if lo > 1 + threshold else "unchanged"


def compare_metric(b: dict[str, Any], c: dict[str, Any], metric: str, threshold: float, confidence: float,
                   ref_b: dict[str, Any] | None = None, ref_c: dict[str, Any] | None = None,
                   seed: int = 0) -> tuple[float | None, float | None, float | None, str | None]:
    """(ratio, ci_low, ci_high, note) of current/baseline for one metric."""
    field, better, inverse = METRICS[metric]
    sets = [b, c] + ([ref_b, ref_c] if ref_b is not None else [])
    if field is None:  # a single value per row: the ratio without an interval
        vals = [r.get(metric) for r in sets]
        if any(v is None or v == 0 for v in vals):
            return None, None, None, "missing"
        ratio = vals[1] / vals[0] if ref_b is None else (vals[1] / vals[3]) / (vals[0] / vals[2])
        return ratio, ratio, ratio, "single value: no repeat samples, the ratio is its own interval"
    samples = [np.asarray(r.get(field) or [], dtype=float) for r in sets]
    if any(s.size < 2 for s in samples):
        return None, None, None, f"fewer than 2 samples of {field}"
    if ref_b is None:
        def fn(mb, mc):  # noqa: E306
            return mc / mb
    else:
        def fn(mb, mc, rb, rc):  # noqa: E306
            return (mc / rc) / (mb / rb)
    point = fn(*[np.median(s) for s in samples])
    lo, hi = _bootstrap(fn, samples, confidence, seed)
    if inverse:
        point, lo, hi = 1 / point, 1 / hi, 1 / lo
    return float(point), lo, hi, None


def compare(base_rows: list[dict[str, Any]], cur_rows: list[dict[str, Any]], metrics: list[str] | None,
            threshold: float, confidence: float = 0.95,
            normalize_by: str | None = None) -> tuple[list[Comparison], dict[str, list[str]]]:
    base = {_key(r): r for r in base_rows if r.get("point_key")}
    cur = {_key(r): r for r in cur_rows if r.get("point_key")}
    unmatched = {"baseline_only": sorted(" ".join(map(str, k)) for k in base.keys() - cur.keys()),
                 "current_only": sorted(" ".join(map(str, k)) for k in cur.keys() - base.keys())}
    out: list[Comparison] = []
    for i, k in enumerate(sorted(base.keys() & cur.keys(), key=str)):
        b, c = base[k], cur[k]
        engine, model, workload, point, dtype = k
        if normalize_by and engine == normalize_by:
            continue
        names = metrics or DEFAULT_METRICS.get(workload, [])
        common = dict(engine=engine, model=model, workload=workload, point=point, dtype=dtype,
                      normalized_by=normalize_by)
        if b.get("status") != "ok" or c.get("status") != "ok":
            if b.get("status") == "ok":
                out.append(Comparison(**common, metric="status", better="ok", baseline=None, current=None,
                                      ratio=None, ci_low=None, ci_high=None, verdict="failed",
                                      note=(c.get("error") or c.get("status") or "")[:200]))
            continue
        ref_b = ref_c = None
        if normalize_by:
            rk = (normalize_by, model, workload, point, dtype)
            ref_b, ref_c = base.get(rk), cur.get(rk)
            if not ref_b or not ref_c or ref_b.get("status") != "ok" or ref_c.get("status") != "ok":
                for m in names:
                    out.append(Comparison(**common, metric=m, better=METRICS[m][1], baseline=b.get(m),
                                          current=c.get(m), ratio=None, ci_low=None, ci_high=None,
                                          verdict="no-data", note=f"{normalize_by} has no ok row at this point"))
                continue
        for j, m in enumerate(names):
            ratio, lo, hi, note = compare_metric(b, c, m, threshold, confidence, ref_b, ref_c, seed=i * 131 + j)
            out.append(Comparison(**common, metric=m, better=METRICS[m][1], baseline=b.get(m), current=c.get(m),
                                  ratio=ratio, ci_low=lo, ci_high=hi,
                                  verdict=verdict(lo, hi, METRICS[m][1], threshold), note=note))
    return out, unmatched


def format_table(comps: list[Comparison]) -> str:
    head = ["engine", "workload", "point", "metric", "baseline", "current", "ratio", "95% CI", "verdict"]
    body = []
    for c in comps:
        point = c.point.split(":", 1)[-1] if c.point else ""
        fmt = (lambda v: "-" if v is None else f"{v:.4g}")
        body.append([c.engine, c.workload, point, c.metric, fmt(c.baseline), fmt(c.current),
                     "-" if c.ratio is None else f"{c.ratio:.3f}",
                     "-" if c.ci_low is None else f"[{c.ci_low:.3f}, {c.ci_high:.3f}]",
                     c.verdict.upper() if c.verdict in ("regressed", "failed") else c.verdict])
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def parse_threshold(text: str) -> float:
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise UserError(f"--threshold {text}: give a percentage such as 5% (or a fraction such as 0.05).") from None
    if not 0 <= v < 1:
        raise UserError(f"--threshold {text}: must be between 0% and 100%.")
    return v


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="infer-bench-compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", nargs="+", required=True, help="results files or run directories")
    ap.add_argument("--current", nargs="+", required=True, help="results files or run directories")
    ap.add_argument("--metric", action="append", choices=sorted(METRICS), help="metrics to compare (repeatable)")
    ap.add_argument("--threshold", default="5%", help="smallest change that counts (default 5%%)")
    ap.add_argument("--confidence", type=float, default=0.95, help="confidence of the intervals (default 0.95)")
    ap.add_argument("--normalize-by", metavar="ENGINE", help="divide by this engine's metric from the same run")
    ap.add_argument("--json", default="compare.json", help="verdict file (default compare.json)")
    ap.add_argument("--html", help="also write the report's comparison section to this HTML file")
    args = ap.parse_args(argv)
    threshold = parse_threshold(args.threshold)
    if not 0.5 < args.confidence < 1:
        raise UserError(f"--confidence {args.confidence}: give a value between 0.5 and 1, e.g. 0.95.")
    base, cur = load(args.baseline, "baseline"), load(args.current, "current")
    if args.normalize_by and not any(r.get("engine") == args.normalize_by for r in base + cur):
        raise UserError(f"--normalize-by {args.normalize_by}: no rows of that engine in the results.")
    comps, unmatched = compare(base, cur, args.metric, threshold, args.confidence, args.normalize_by)
    if not comps:
        raise UserError("no matching rows: baseline and current share no (engine, model, workload, point, dtype) "
                        "with a metric to compare. Compare runs of the same config.")
    print(format_table(comps))
    for side, keys in unmatched.items():
        for k in keys:
            print(f"unmatched ({side.replace('_', ' ')}): {k}")
    counts = {v: sum(c.verdict == v for c in comps) for v in ("regressed", "failed", "improved", "unchanged", "no-data")}
    overall = "regressed" if counts["regressed"] or counts["failed"] else "unchanged"
    print(f"\nverdict: {overall.upper()}  ({', '.join(f'{n} {v}' for v, n in counts.items() if n)}; "
          f"threshold {threshold:.1%}, {args.confidence:.0%} bootstrap CIs"
          + (f", normalised by {args.normalize_by}" if args.normalize_by else "") + ")")
    doc = {"verdict": overall, "counts": counts, "threshold": threshold, "confidence": args.confidence,
           "normalize_by": args.normalize_by, "method": METHOD.format(n=BOOTSTRAP_RESAMPLES),
           "schema_version": SCHEMA_VERSION, "baseline": args.baseline, "current": args.current,
           "comparisons": [asdict(c) for c in comps], "unmatched": unmatched}
    atomic_write_text(args.json, json.dumps(doc, indent=2))
    print(f"verdict file: {args.json}")
    if args.html:
        from reports import write_report
        print(f"report: {write_report(args.current, args.html, baseline=args.baseline)}")
    return 1 if overall == "regressed" else 0


def main(argv: list[str] | None = None) -> None:
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(e.render().replace("infer-bench:", "infer-bench-compare:", 1), file=sys.stderr)
        code = EXIT_BAD_INPUT
    sys.exit(code)


if __name__ == "__main__":
    main()

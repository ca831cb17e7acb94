"""`infer-bench-ab`: baseline and candidate code, interleaved on one machine, compared with paired
statistics - the way to gate CI on machines that change from one run to the next.

    infer-bench-ab --baseline-ref REF [--candidate-ref REF] [--rounds 6] [--threshold 10%]
                   [--metric M ...] [--baseline-override K=V ...] [--candidate-override K=V ...]
                   [--out DIR] [--json FILE] -- [infer-bench overrides ...]
    infer-bench-ab --method blocks --baseline-ref REF [--pairs 120] [--threshold 2.5%] [--cpu N] ...

`--method blocks` (the CI gate's, harness.ab_blocks) keeps both sides' engine workers alive at
once on one core and alternates blocks of one sweep iteration (a prefill and a few tens of decode
steps), `--pairs` times per point; a pair's log-ratio of the block's median decode step is the
unit, the estimate their 20 %-trimmed mean with a Yuen interval; the decode step alone decides
(block CPU time and prefill are shown). It needs one engine and the sweep workload. The rest of
this text describes the default, `--method runs`.

The baseline is the commit REF, checked out into a temporary git worktree; the candidate is the
working tree (or `--candidate-ref`). Both run in this Python environment, on this machine, in one
job: A, B, B, A, A, B, ... (the order alternates every round, so a steady drift of the machine
cancels), each run a complete `infer-bench` invocation of the same config on the same
checkpoint. Per round and per (engine, point, metric), the log of the ratio candidate /
baseline of the run medians is taken; the estimate is the geometric mean of those ratios, with a
Student-t interval of their mean (`harness.core.bootstrap.mean_t_ci`: with a handful of rounds a
bootstrap interval is far too narrow). A metric is
**regressed** when the whole interval lies beyond the threshold on the bad side, **improved**
when it lies beyond it on the good side, **unchanged** otherwise.

The gate fails closed: the verdict is **FAILED** (exit 1) when nothing was compared, when an
(engine, point, metric) the baseline has is missing, None, non-positive or not `ok` in any
candidate round (an engine that could not start, a renamed field, a changed point), when fewer
than two rounds are complete, or when the candidate's `infer-bench` exited non-zero. `no-data` is
left only where both sides lack the value; it is listed and never turns FAILED into a pass.
`--allow-missing` accepts missing candidate values (a deliberate change of points) and compares
the complete rounds.

`--relative-to ENGINE` also compares every other engine's value divided by ENGINE's in the same
run ("reference/hf"): on a machine whose speed changes from minute to minute the ratio of two
engines measured in one run moves less than either (the rows of each engine alone stay in the
table and in the verdict).

`--baseline-override` / `--candidate-override` add overrides to one side only, so the same tool
compares two configurations of one tree (e.g. `engine_options.reference.kv_cache=none`).

The job's verdict: REGRESSED when a decisive row regressed, else IMPROVED when one improved, else
UNCHANGED (FAILED before all of them). Exit codes: 0 UNCHANGED or IMPROVED (nothing regressed and
something was compared), 1 REGRESSED or FAILED, 2 unusable
input (an unknown ref, a run that could not start, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.checkpoint import ensure_checkpoint
from harness.ab_blocks import DECISIVE as BLOCK_DECISIVE, TRIM as BLOCK_TRIM
from harness.core.bootstrap import CONFIDENCE, mean_t_ci
from harness.core.compare import parse_threshold, verdict
from harness.core.compared import METRICS as METRIC_TABLE, Metric
from harness.core.errors import EXIT_BAD_INPUT, UserError
from harness.core.paths import REPO_ROOT, model_cache_dir
from harness.core.presets import load_preset, preset_names
from harness.core.results import ENVIRONMENT_FILE, RESULTS_FILE, atomic_write_text, read_rows

# The metrics A/B can compare: those of the one metric table (harness.core.compared.METRICS) with
# a row field of the run's median (`median`); throughput is compared through the end-to-end
# latency it is computed from.
METRICS: dict[str, Metric] = {name: m for name, m in METRIC_TABLE.items() if m.median is not None}
DEFAULT_METRICS = ("decode_step_latency_s", "prefill_latency_s", "output_tok_s")
# Settings every run gets: no parity check, no roofline probe, no progress lines.
FIXED = ["parity=false", "roofline=false", "quiet=true"]
METHOD = ("paired A/B: baseline and candidate runs interleaved (the order alternating every round); per round "
          "the log-ratio candidate/baseline of the run medians; the geometric mean of the ratios with a "
          f"{CONFIDENCE:.0%} Student-t interval of the mean log-ratio (n - 1 degrees of freedom)")


BLOCK_METHOD = ("paired A/B blocks: both sides' engine workers alive at once, pinned to one core, alternating "
                "one sweep iteration (a block) at a time, the order flipping every pair; per pair the log-ratio "
                "candidate/baseline of the worker's CPU time for the block and of its median decode step (its "
                "prefill shown, not decisive); the "
                f"{BLOCK_TRIM:.0%}-trimmed mean log-ratio with a {CONFIDENCE:.0%} Yuen interval")


@dataclass
class Side:
    name: str  # "baseline" | "candidate"
    tree: Path
    commit: str | None
    overrides: list[str]


@dataclass
class PairResult:
    engine: str
    point: str
    metric: str
    better: str
    baseline_median: float | None
    candidate_median: float | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    verdict: str
    round_ratios: list[float] = field(default_factory=list)
    note: str | None = None
    decisive: bool = True  # False: shown (and failing closed when missing) but never REGRESSED alone


# ---- git ----------------------------------------------------------------------------------------

def _git(*args: str, cwd: Path = REPO_ROOT, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=check)


def resolve_commit(ref: str) -> str:
    r = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if r.returncode != 0 or not r.stdout.strip():
        raise UserError(f"--baseline-ref {ref}: no such commit in this repository ({REPO_ROOT}). Name a "
                        "commit, tag or branch that exists here (a shallow clone may need `git fetch "
                        "--unshallow`).")
    return r.stdout.strip()


def add_worktree(commit: str, where: Path) -> Path:
    r = _git("worktree", "add", "--detach", "--force", str(where), commit, check=False)
    if r.returncode != 0:
        raise UserError(f"git worktree add {commit[:12]}: {r.stderr.strip() or r.stdout.strip()}")
    return where


def remove_worktree(where: Path) -> None:
    _git("worktree", "remove", "--force", str(where), check=False)
    shutil.rmtree(where, ignore_errors=True)
    _git("worktree", "prune", check=False)


# ---- the config both sides run --------------------------------------------------------------

def pin_model(overrides: list[str], cache: Path) -> list[str]:
    """The same checkpoint for both sides: a preset is materialised once (by this, the candidate's,
    code) and both sides load it as `model=local model.path=DIR`."""
    model = next((o.split("=", 1)[1] for o in overrides if o.startswith("model=")), "tiny")
    if model == "local" or any(o.startswith("model.path=") for o in overrides):
        return overrides
    if model not in preset_names():
        raise UserError(f"model={model}: unknown model preset. Choose one of {', '.join(preset_names())}.")
    path = ensure_checkpoint(load_preset(model), cache)
    rest = [o for o in overrides if not o.startswith("model=")]
    return rest + ["model=local", f"model.path={path}"]


def run_once(side: Side, overrides: list[str], out: Path, python: str, timeout_s: float) -> tuple[Path, int, list[str]]:
    """One complete infer-bench run of `side`'s tree into `out`: (the run directory, its exit code,
    the reasons it gave for a non-zero exit)."""
    cmd = [python, "-m", "harness.cli", *overrides, *side.overrides, *FIXED, f"hydra.run.dir={out}"]
    env = dict(os.environ, PYTHONPATH=str(side.tree))
    try:
        r = subprocess.run(cmd, cwd=side.tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(f"{side.name} run timed out after {timeout_s:g} s: {' '.join(cmd)}") from None
    (out / "ab-run.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "ab-run.log").write_text(r.stdout + r.stderr)
    if r.returncode not in (0, 1) or not (out / RESULTS_FILE).exists():
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-12:])
        raise UserError(f"{side.name} run failed (exit {r.returncode}): {' '.join(cmd)}\n{tail}")
    _check_tree(side, out)
    reasons = [ln.split(": ", 2)[-1] for ln in r.stderr.splitlines() if ln.startswith("infer-bench: exit ")]
    return out, r.returncode, reasons


def _check_tree(side: Side, out: Path) -> None:
    """The run must have executed `side`'s code: its environment.json names the tree's commit."""
    try:
        env = json.loads((out / ENVIRONMENT_FILE).read_text())
    except (OSError, ValueError):
        return
    commit = (env.get("git") or {}).get("commit")
    if side.commit and commit and commit != side.commit:
        raise UserError(f"{side.name} run executed commit {commit[:12]}, not {side.commit[:12]}: another "
                        "installation of infer-bench shadows the worktree on sys.path.")


# ---- statistics ---------------------------------------------------------------------------------

# A round's values: (engine, point_key, metric) -> (the run's median of the compared field, the
# metric as the row shows it), or the row's status when it is not ok; and (engine, None, None) ->
# "unavailable: why" for an engine that did not run at all.
Values = dict[tuple[str, Any, Any], "tuple[float, float] | str"]


def run_medians(results: Path, metrics: list[str]) -> Values:
    """(engine, point_key, metric) -> (the run's median of the compared field, the metric's value as
    the row shows it), or the row's status when it is not ok. A value that is absent, None or not
    positive is left out (the comparison then finds it missing). An engine's `unavailable` row
    (no point) is kept as (engine, None, None) -> 'unavailable: reason'."""
    out: Values = {}
    for r in read_rows(results):
        if not r.get("point_key"):
            if r.get("status") not in (None, "ok"):
                out[(r.get("engine"), None, None)] = f"{r['status']}: {(r.get('error') or '').splitlines()[0][:200]}" \
                    if r.get("error") else str(r["status"])
            continue
        for m in metrics:
            key = (r["engine"], r["point_key"], m)
            if r.get("status") != "ok":
                err = (r.get("error") or "").strip().splitlines()
                out[key] = (r.get("status") or "?") + (f" ({err[-1][:160]})" if err else "")
                continue
            v = r.get(METRICS[m].median)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v):
                shown = r.get(m)
                out[key] = (float(v), float(shown) if isinstance(shown, (int, float)) else float(v))
    return out


def relative(values: Values, control: str) -> Values:
    """`values` (one run's medians) plus, for every other engine's (point, metric), the value
    divided by the `control` engine's in the same run, under the engine name "ENGINE/CONTROL":
    the ratio of the two engines (e.g. reference/hf output tok/s), in which whatever slowed the
    whole run down (a busy neighbour, a slower minute of the machine) cancels. Where the control's
    value is missing the ratio is the reason, so that the comparison fails closed."""
    out = dict(values)
    for (engine, point, metric), v in values.items():
        if point is None or engine == control or "/" in str(engine):
            continue
        c = values.get((control, point, metric))
        name = f"{engine}/{control}"
        if isinstance(v, tuple) and isinstance(c, tuple):
            out[(name, point, metric)] = (v[0] / c[0], v[1] / c[1])
        elif isinstance(v, tuple):
            why = c if isinstance(c, str) else (values.get((control, None, None)) or "no value")
            out[(name, point, metric)] = f"the control engine {control}: {why}"
        else:
            out[(name, point, metric)] = v
    return out


def _why_missing(values: Values, key: tuple) -> str:
    v = values.get(key)
    if isinstance(v, str):
        return v
    engine_status = values.get((key[0], None, None))
    if engine_status:
        return f"engine {engine_status}"
    return f"no value (the row or its field {METRICS[key[2]].median} is absent, None or <= 0)"


def paired(rounds: list[tuple[Values, Values]], metrics: list[str], threshold: float,
           confidence: float = CONFIDENCE, allow_missing: bool = False) -> list[PairResult]:
    """Per (engine, point, metric): the geometric-mean ratio candidate/baseline over the rounds,
    its interval, and the verdict. Fails closed: a value the baseline has that is missing from any
    candidate round is `failed` (unless allow_missing), and so is a key with fewer than two
    complete rounds; `no-data` only where neither side has the value in any round."""
    keys = list(dict.fromkeys(k for a, b in rounds for k in list(a) + list(b) if k[1] is not None))
    out = []
    for key in keys:
        engine, point, metric = key
        better, inverse = METRICS[metric].better, METRICS[metric].inverse
        base_vals = [a.get(key) for a, _ in rounds]
        cand_vals = [b.get(key) for _, b in rounds]
        common = dict(engine=engine, point=point, metric=metric, better=better)
        none = dict(baseline_median=None, candidate_median=None, ratio=None, ci_low=None, ci_high=None)
        base_has = any(isinstance(v, tuple) for v in base_vals)
        cand_has = any(isinstance(v, tuple) for v in cand_vals)
        if not base_has:
            why = "; ".join(dict.fromkeys(_why_missing(a, key) for a, _ in rounds))
            out.append(PairResult(**common, **none, verdict="no-data" if not cand_has else "new",
                                  note=f"the baseline has no value ({why})"
                                  + ("" if not cand_has else "; only the candidate has it")))
            continue
        bad = [i for i, v in enumerate(cand_vals) if not isinstance(v, tuple)]
        if bad and not allow_missing:
            why = "; ".join(dict.fromkeys(_why_missing(rounds[i][1], key) for i in bad))
            out.append(PairResult(**common, **none, verdict="failed",
                                  note=f"the candidate lacks it in round{'s' if len(bad) > 1 else ''} "
                                  f"{', '.join(str(i + 1) for i in bad)} of {len(rounds)}: {why}"))
            continue
        pairs = [(a, b) for a, b in zip(base_vals, cand_vals) if isinstance(a, tuple) and isinstance(b, tuple)]
        if len(pairs) < 2:
            out.append(PairResult(**common, **none, verdict="no-data" if allow_missing else "failed",
                                  note=f"{len(pairs)} complete rounds of {len(rounds)}: too few to compare"))
            continue
        logs = np.log([b[0] / a[0] for a, b in pairs])
        if inverse:  # a throughput: its ratio is the inverse of the latencies' it is computed from
            logs = -logs
        ci = mean_t_ci(logs, confidence)
        lo, hi = (math.exp(ci[0]), math.exp(ci[1])) if ci else (None, None)
        out.append(PairResult(
            **common, baseline_median=float(np.median([a[1] for a, _ in pairs])),
            candidate_median=float(np.median([b[1] for _, b in pairs])),
            ratio=math.exp(float(logs.mean())), ci_low=lo, ci_high=hi, verdict=verdict(lo, hi, better, threshold),
            round_ratios=[round(float(math.exp(v)), 4) for v in logs]))
    return out


def compare(rounds: list[tuple[Values, Values]], metrics: list[str], threshold: float, allow_missing: bool = False,
            relative_to: str | None = None) -> list[PairResult]:
    """paired() over the rounds, and with `relative_to` also over every engine's ratio to that
    engine (relative()). A control engine that no run measured is a failed row: nothing relative
    was compared."""
    if not relative_to:
        return paired(rounds, metrics, threshold, allow_missing=allow_missing)
    results = paired([(relative(a, relative_to), relative(b, relative_to)) for a, b in rounds], metrics, threshold,
                     allow_missing=allow_missing)
    if not any(k[0] == relative_to and k[1] is not None for a, b in rounds for k in list(a) + list(b)):
        results.append(PairResult(f"*/{relative_to}", "-", ",".join(metrics), "-", None, None, None, None, None,
                                  "failed", note=f"--relative-to {relative_to}: no run measured that engine "
                                  "(name one of the engines the runs use, engines=[...])"))
    return results


def block_results(pairs: dict[str, dict[str, list[tuple[float | None, float | None]]]], threshold: float,
                  engine: str = "reference", confidence: float = CONFIDENCE, trim: float | None = None) -> list[PairResult]:
    """Per (point, metric) of an interleaved block job (harness.ab_blocks): the trimmed-mean ratio
    candidate/baseline over the pairs, its Yuen interval and the verdict. Fails closed: a pair
    with a side's value missing makes the row `failed`, and so do fewer than three pairs."""
    from harness.ab_blocks import BLOCK_METRICS, DECISIVE, TRIM, trimmed_ci
    out = []
    for key, metrics in pairs.items():
        for metric, ps in metrics.items():
            common = dict(engine=engine, point=key, metric=metric, better=BLOCK_METRICS[metric],
                          decisive=metric in DECISIVE)
            limit = threshold * DECISIVE.get(metric, 1.0)
            none = dict(baseline_median=None, candidate_median=None, ratio=None, ci_low=None, ci_high=None)
            bad = [i + 1 for i, (a, b) in enumerate(ps) if a is None or b is None]
            if bad:
                shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
                out.append(PairResult(**common, **none, verdict="failed",
                                      note=f"a side lacks the value in pair{'s' if len(bad) > 1 else ''} {shown} of {len(ps)}"))
                continue
            ci = trimmed_ci(np.log([b / a for a, b in ps]), confidence, TRIM if trim is None else trim) \
                if len(ps) >= 3 else None
            if ci is None:
                out.append(PairResult(**common, **none, verdict="failed",
                                      note=f"{len(ps)} pairs: too few to compare (3 at least)"))
                continue
            logs = np.log([b / a for a, b in ps])
            lo, hi = math.exp(ci[1]), math.exp(ci[2])
            out.append(PairResult(
                **common, baseline_median=float(np.median([a for a, _ in ps])),
                candidate_median=float(np.median([b for _, b in ps])), ratio=math.exp(ci[0]), ci_low=lo, ci_high=hi,
                verdict=verdict(lo, hi, BLOCK_METRICS[metric], limit),
                note=f"{len(ps)} pairs, per-pair log-ratio sd {float(logs.std(ddof=1)):.1%}"
                     + (f", threshold {limit:.1%}" if limit != threshold else "")))
    return out


VERDICTS = ("regressed", "failed", "improved", "unchanged", "new", "no-data")
PASSING = ("unchanged", "improved")  # the job verdicts that exit 0


def overall(results: list[PairResult], candidate_exits: list[tuple[int, int, list[str]]]) -> tuple[str, list[str]]:
    """The job's verdict (failed | regressed | improved | unchanged) and, for FAILED, what is
    missing: regressed when a decisive row regressed, improved when none did and a decisive row
    improved, else unchanged (a row that is not decisive never sets it).
    `candidate_exits`: (round, exit code, reasons) of every candidate run that exited non-zero."""
    why = []
    compared = sum(r.verdict in ("regressed", "improved", "unchanged") for r in results)
    if compared == 0:
        why.append("nothing was compared: no (engine, point, metric) has a value on both sides in two rounds")
    for r in results:
        if r.verdict == "failed":
            why.append(f"{r.engine} {r.point.split(':', 1)[-1]} {r.metric}: {r.note}")
    grouped: dict[tuple[int, str], list[int]] = {}
    for rnd, code, reasons in candidate_exits:
        grouped.setdefault((code, "; ".join(reasons)), []).append(rnd)
    for (code, reasons), rnds in grouped.items():
        why.append(f"the candidate's infer-bench exited {code} in round{'s' if len(rnds) > 1 else ''} "
                   f"{', '.join(map(str, rnds))}" + (f": {reasons}" if reasons else ""))
    if why:
        return "failed", list(dict.fromkeys(why))
    decisive = {r.verdict for r in results if r.decisive}
    return ("regressed" if "regressed" in decisive else "improved" if "improved" in decisive else "unchanged"), []


def format_table(results: list[PairResult]) -> str:
    head = ["engine", "point", "metric", "baseline", "candidate", "ratio", "interval", "verdict", "per-round ratios"]
    body = []
    for r in results:
        fmt = (lambda v: "-" if v is None else f"{v:.4g}")
        body.append([r.engine, r.point.split(":", 1)[-1], r.metric, fmt(r.baseline_median), fmt(r.candidate_median),
                     "-" if r.ratio is None else f"{r.ratio:.3f}",
                     "-" if r.ci_low is None else f"[{r.ci_low:.3f}, {r.ci_high:.3f}]",
                     r.verdict.upper() if r.verdict in ("regressed", "failed") else r.verdict,
                     " ".join(f"{x:.3f}" for x in r.round_ratios) or (r.note or "")])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


# ---- the command --------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="infer-bench-ab", description=__doc__.split("\n\n")[0],
                                 epilog="Everything after -- is passed to every infer-bench run.")
    ap.add_argument("--baseline-ref", required=True, help="the baseline commit (e.g. the one named in ci/baseline-ref)")
    ap.add_argument("--candidate-ref", help="the candidate commit (default: the working tree)")
    ap.add_argument("--method", choices=("runs", "blocks"), default="runs",
                    help="runs: whole infer-bench runs per side, interleaved by rounds (any engines and workload); "
                         "blocks: both sides' engine workers alive at once on one core, alternating blocks of one "
                         "sweep iteration (one engine, the sweep workload; the CI gate's method)")
    ap.add_argument("--rounds", type=int, default=6, help="--method runs: A/B rounds (default 6)")
    ap.add_argument("--pairs", type=int, default=120,
                    help="--method blocks: block pairs per point (default 120)")
    ap.add_argument("--warmup-blocks", type=int, default=3,
                    help="--method blocks: blocks per side and point run and discarded first (default 3)")
    ap.add_argument("--worker-pairs", type=int, default=3,
                    help="--method blocks: worker processes per side (default 3), taking the pairs in turn: one "
                         "process of the same code can run a few per cent faster than another")
    ap.add_argument("--cpu", type=int,
                    help="--method blocks: the one core both workers are pinned to (default: the last core this "
                         "process may use)")
    ap.add_argument("--threshold", default="10%", help="smallest change that counts (default 10%%)")
    ap.add_argument("--metric", action="append", choices=sorted(METRICS), help="metrics to compare (repeatable)")
    ap.add_argument("--baseline-override", action="append", default=[], metavar="KEY=VALUE",
                    help="an infer-bench override for the baseline side only (repeatable)")
    ap.add_argument("--candidate-override", action="append", default=[], metavar="KEY=VALUE",
                    help="an infer-bench override for the candidate side only (repeatable)")
    ap.add_argument("--out", help="where the runs go (default: a new directory under runs/ab)")
    ap.add_argument("--json", help="verdict file (default OUT/ab.json)")
    ap.add_argument("--allow-missing", action="store_true",
                    help="accept values missing from candidate rounds (a deliberate change of points): compare "
                         "the complete rounds instead of failing")
    ap.add_argument("--relative-to", metavar="ENGINE",
                    help="also compare every other engine's metric divided by this engine's in the same run "
                         "(e.g. hf: the reference/hf ratio), which cancels whatever slowed a whole run down; "
                         "the control engine must run in every round")
    ap.add_argument("--python", default=sys.executable, help="interpreter for both sides (default: this one)")
    ap.add_argument("--run-timeout-s", type=float, default=900.0, help="longest one infer-bench run may take")
    ap.add_argument("overrides", nargs="*", help="infer-bench overrides for both sides (after --)")
    return ap


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    threshold = parse_threshold(args.threshold)
    if args.method == "blocks" and args.pairs < 3:
        raise UserError(f"--pairs {args.pairs}: at least 3 block pairs are needed for an interval (120 is the default).")
    if args.method == "blocks" and args.worker_pairs < 1:
        raise UserError(f"--worker-pairs {args.worker_pairs}: at least 1.")
    if args.method == "blocks" and args.relative_to:
        raise UserError("--relative-to compares engines of one run: it needs --method runs.")
    if args.rounds < 2:
        raise UserError(f"--rounds {args.rounds}: at least 2 rounds are needed for an interval (6 is the default).")
    metrics = args.metric or list(DEFAULT_METRICS)
    base_commit = resolve_commit(args.baseline_ref)
    cand_commit = resolve_commit(args.candidate_ref) if args.candidate_ref else None
    # absolute: each side runs with its own tree as the working directory, and a relative
    # hydra.run.dir would land inside the temporary worktree
    out = Path(args.out or REPO_ROOT / "runs" / "ab" / f"{base_commit[:10]}-vs-{(cand_commit or 'worktree')[:10]}").resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    overrides = pin_model(list(args.overrides), model_cache_dir(None))
    work = Path(tempfile.mkdtemp(prefix="infer-bench-ab-"))
    trees = []
    try:
        base = Side("baseline", add_worktree(base_commit, work / "baseline"), base_commit, args.baseline_override)
        trees.append(base.tree)
        if cand_commit:
            cand = Side("candidate", add_worktree(cand_commit, work / "candidate"), cand_commit, args.candidate_override)
            trees.append(cand.tree)
        else:
            head = _git("rev-parse", "HEAD").stdout.strip()
            dirty = bool(_git("status", "--porcelain", "--untracked-files=no").stdout.strip())
            cand = Side("candidate", REPO_ROOT, None if dirty else head, args.candidate_override)
        print(f"infer-bench-ab: baseline {base_commit[:12]} vs candidate "
              f"{(cand_commit or 'working tree')[:12]}, "
              + (f"{args.pairs} block pairs" if args.method == "blocks" else f"{args.rounds} rounds") + f" -> {out}",
              flush=True)
        if args.method == "blocks":
            results, failure = blocks_job(args, base, cand, overrides, out, threshold)
            candidate_exits = []
        else:
            rounds, candidate_exits = interleaved_rounds(args, base, cand, overrides, out, metrics)
    finally:
        for t in trees:
            remove_worktree(t)
        shutil.rmtree(work, ignore_errors=True)
    if args.method == "blocks":
        return report(args, results, [], threshold, base_commit, cand_commit, overrides, out, failure)
    results = compare(rounds, metrics, threshold, args.allow_missing, args.relative_to)
    return report(args, results, candidate_exits, threshold, base_commit, cand_commit, overrides, out)


def blocks_job(args: argparse.Namespace, base: Side, cand: Side, overrides: list[str], out: Path,
               threshold: float) -> tuple[list[PairResult], str | None]:
    """--method blocks (harness.ab_blocks): both sides' workers, interleaved block by block; the
    results per (point, metric) and why the job failed as a whole (an engine that could not
    start, a worker that died), or None."""
    from harness import ab_blocks
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    cpu = allowed[-1] if args.cpu is None else args.cpu
    if cpu not in allowed:
        raise UserError(f"--cpu {cpu}: this process may use cores {allowed}; name one of them.")
    fixed = [*FIXED, *ab_blocks.FIXED, f"cpus=[{cpu}]"]
    plan_a, model_path = ab_blocks.plan_side([*overrides, *base.overrides, *fixed])
    plan_b, _ = ab_blocks.plan_side([*overrides, *cand.overrides, *fixed])
    engine = plan_a.engines[0]
    if plan_b.engines != [engine]:
        raise UserError(f"the sides run different engines ({engine} and {', '.join(plan_b.engines)}): "
                        "--method blocks compares one engine's two versions.")
    keys = [p.key for p in plan_a.points]
    if [p.key for p in plan_b.points] != keys:
        raise UserError("the sides plan different points (a --baseline-override or --candidate-override changes "
                        "the workload): --method blocks compares the same points.")
    points = [{"workload": p.workload, "params": p.params} for p in plan_a.points]
    sides = {s.name: [ab_blocks.BlockWorker(s.name, ab_blocks.worker_command(args.python, s.tree),
                                            ab_blocks.job_for(plan, model_path, engine, out),
                                            out / f"{s.name}-worker{k + 1}.log") for k in range(args.worker_pairs)]
             for s, plan in ((base, plan_a), (cand, plan_b))}
    print(f"  {args.pairs} block pairs per point x {len(points)} points, {args.worker_pairs} worker(s) per side, "
          f"all on core {cpu}", flush=True)
    try:
        blocks = ab_blocks.interleave(sides["baseline"], sides["candidate"], points, keys, args.pairs,
                                      args.warmup_blocks, args.run_timeout_s, say=lambda m: print(m, flush=True))
    finally:
        for ws in sides.values():
            for w in ws:
                w.stop()
    atomic_write_text(out / "blocks.json", json.dumps({"pairs": blocks.pairs, "missing": blocks.missing,
                                                       "failure": blocks.failure, "seconds": blocks.seconds}))
    if blocks.failure:
        return [], blocks.failure
    return block_results(blocks.pairs, threshold, engine), None


def interleaved_rounds(args: argparse.Namespace, base: Side, cand: Side, overrides: list[str], out: Path,
                       metrics: list[str]) -> tuple[list[tuple[Values, Values]], list[tuple[int, int, list[str]]]]:
    """`args.rounds` rounds of one run per side, the order alternating (baseline first in even
    rounds): ([(baseline medians, candidate medians)] per round, [(round, exit code, reasons)] of
    the candidate's runs that did not exit 0)."""
    rounds = []
    candidate_exits: list[tuple[int, int, list[str]]] = []
    for i in range(args.rounds):
        order = (base, cand) if i % 2 == 0 else (cand, base)
        medians = {}
        for side in order:
            res, code, reasons = run_once(side, overrides, out / f"round{i}-{side.name}", args.python,
                                          args.run_timeout_s)
            medians[side.name] = run_medians(res / RESULTS_FILE, metrics)
            if code != 0:
                print(f"  round {i + 1}: the {side.name}'s infer-bench exited {code}"
                      + (f": {'; '.join(reasons)}" if reasons else ""), flush=True)
                if side is cand:
                    candidate_exits.append((i + 1, code, reasons))
        rounds.append((medians["baseline"], medians["candidate"]))
        print(f"  round {i + 1}/{args.rounds} done ({order[0].name} first)", flush=True)
    return rounds, candidate_exits


def report(args: argparse.Namespace, results: list[PairResult], candidate_exits: list[tuple[int, int, list[str]]],
           threshold: float, base_commit: str, cand_commit: str | None, overrides: list[str], out: Path,
           failure: str | None = None) -> int:
    """Print the table and the verdict, write the verdict file; the exit code (0: unchanged or
    improved, 1: regressed or failed).
    `failure`: why the job as a whole failed (FAILED whatever the results)."""
    print(format_table(results))
    counts = {v: sum(r.verdict == v for r in results) for v in VERDICTS}
    verdict_, why = overall(results, candidate_exits)
    if failure:
        verdict_, why = "failed", [failure, *(w for w in why if not w.startswith("nothing was compared"))]
    how = (f"{args.pairs} interleaved block pairs per point, {CONFIDENCE:.0%} Yuen intervals of the "
           f"{BLOCK_TRIM:.0%}-trimmed mean log-ratio; decisive: "
           + ", ".join(f"{m} at {threshold * k:.1%}" for m, k in BLOCK_DECISIVE.items())
           if args.method == "blocks" else
           f"{args.rounds} interleaved rounds, {CONFIDENCE:.0%} t-intervals of the mean log-ratio")
    print(f"\nverdict: {verdict_.upper()}  ({', '.join(f'{n} {v}' for v, n in counts.items() if n) or 'no results'}; "
          f"threshold {threshold:.1%}, {how}" + ("; --allow-missing" if args.allow_missing else "") + ")")
    for w in why:
        print(f"  FAILED: {w}")
    doc = {"verdict": verdict_, "failed_because": why, "counts": counts, "threshold": threshold,
           "rounds": args.rounds if args.method == "runs" else None,
           "pairs": args.pairs if args.method == "blocks" else None,
           "method": BLOCK_METHOD if args.method == "blocks" else METHOD, "allow_missing": args.allow_missing,
           "baseline_ref": args.baseline_ref, "baseline_commit": base_commit,
           "candidate": cand_commit or "working tree", "overrides": overrides,
           "relative_to": args.relative_to, "baseline_overrides": args.baseline_override, "candidate_overrides": args.candidate_override,
           "results": [asdict(r) for r in results]}
    verdict_file = Path(args.json) if args.json else out / "ab.json"
    atomic_write_text(verdict_file, json.dumps(doc, indent=2))
    print(f"verdict file: {verdict_file}")
    return 0 if verdict_ in PASSING else 1


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through run(): the current run is killed, the worktrees removed


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(e.render("infer-bench-ab"), file=sys.stderr)
        code = EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("infer-bench-ab: interrupted; the finished runs are kept, the worktrees removed", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()

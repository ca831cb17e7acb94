"""`infer-bench-history`: performance history in a DuckDB file (docs/history.md).

    infer-bench-history [--store runs/history.duckdb] ingest RUN_DIR...
    infer-bench-history changes [--metric M ...] [--engine E] [--since REF] [--check]
    infer-bench-history backfill --commits A..B [--every N] [--repeats R] -- [infer-bench overrides]
    infer-bench-history report [-o PAGE]   (default: trends.html next to the store)
    infer-bench-history export --parquet DIR

Exit codes: 0 done; 1 `changes --check` listed a change point (or compared nothing), `ingest`
left out a line that is not a row, or `backfill` had a commit that could not run; 2 bad input
(a missing store, an unknown metric, a commit range that does not exist), with one message
naming the field.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.core import history as h
from harness.core.errors import EXIT_BAD_INPUT, UserError
from harness.core.paths import REPO_ROOT, model_cache_dir

PROG = "infer-bench-history"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)


def resolve(repo: Path, ref: str, field: str) -> str:
    r = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if r.returncode != 0 or not r.stdout.strip():
        raise UserError(f"{field} {ref}: no such commit in {repo}. Name a commit, tag or branch that exists "
                        "there (a shallow clone may need `git fetch --unshallow`).")
    return r.stdout.strip()


def commit_range(repo: Path, spec: str, every: int) -> list[str]:
    """The commits of A..B (git's meaning: reachable from B, not from A; first-parent), oldest
    first, every N-th of them counted back from B (B always included)."""
    if ".." not in spec or spec.count("..") != 1 or "..." in spec:
        raise UserError(f"--commits {spec}: give a range A..B (the commits after A up to and including B).")
    a, b = spec.split("..")
    resolve(repo, a or "HEAD", "--commits")
    resolve(repo, b or "HEAD", "--commits")
    r = _git(repo, "rev-list", "--reverse", "--first-parent", spec)
    commits = r.stdout.split()
    if r.returncode != 0 or not commits:
        raise UserError(f"--commits {spec}: the range holds no commit. A must be an ancestor of B "
                        "(e.g. --commits HEAD~6..HEAD).")
    if every < 1:
        raise UserError(f"--every {every}: must be 1 or more.")
    return commits[::-1][::every][::-1]


# ---- subcommands ----------------------------------------------------------------------------

def cmd_ingest(args: argparse.Namespace) -> int:
    rep = h.ingest(args.store, args.run_dirs, Path(args.repo))
    for b in rep.bad_lines:
        print(f"{PROG}: warning: {b}", file=sys.stderr)
    print(f"{args.store}: {rep.rows_added} rows added ({rep.runs_added} new runs), {rep.rows_present} already there")
    return 1 if rep.bad_lines else 0


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def cmd_changes(args: argparse.Namespace) -> int:
    since = None
    if args.since:
        commit = resolve(Path(args.repo), args.since, "--since")
        since = h.commit_date(commit, Path(args.repo))
    series, found = h.find_changes(args.store, args.metric, args.engine, since, args.max_pvalue, args.min_magnitude)
    compared = [s for s in series if len(s.commits()) >= 2]
    head = ["commits", "engine", "point", "metric", "machine", "before", "after", "ratio", "p-value", "n before",
            "n after"]
    body = [[cp.commit_range, cp.series.engine, cp.series.point_label, cp.series.metric,
             cp.series.machine, _fmt(cp.mean_before), _fmt(cp.mean_after), f"{cp.magnitude:.3f}",
             f"{cp.pvalue:.2g}", str(cp.n_before), str(cp.n_after)] for cp in found]
    if body:
        widths = [max(len(x), *(len(b[i]) for b in body)) for i, x in enumerate(head)]
        print("  ".join(x.ljust(w) for x, w in zip(head, widths)))
        print("  ".join("-" * w for w in widths))
        for b in body:
            print("  ".join(x.ljust(w) for x, w in zip(b, widths)))
    print(f"{len(found)} change points in {len(compared)} series with 2 or more commits ({len(series)} series; "
          f"E-Divisive means, p <= {args.max_pvalue:g}, |ratio - 1| >= {args.min_magnitude:g}"
          f"{', after ' + args.since if args.since else ''})")
    if args.json:
        doc = [{"commit_before": cp.commit_before, "commit_after": cp.commit_after, "engine": cp.series.engine,
                "point_key": cp.series.point_key, "model": cp.series.model, "config_hash": cp.series.config_hash,
                "metric": cp.series.metric, "machine": cp.series.machine, "mean_before": cp.mean_before,
                "mean_after": cp.mean_after, "ratio": cp.magnitude, "pvalue": cp.pvalue,
                "n_before": cp.n_before, "n_after": cp.n_after} for cp in found]
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.check:
        if found:
            return 1
        if not compared and not args.allow_nothing:
            print(f"{PROG}: nothing compared: no series has runs of two commits yet (--allow-nothing accepts "
                  "that, e.g. for the first runs of a new history)", file=sys.stderr)
            return 1
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    for p in h.export_parquet(args.store, args.parquet):
        print(p)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from reports.trends import write_trends
    series, found = h.find_changes(args.store, args.metric, args.engine, None, args.max_pvalue, args.min_magnitude)
    if not series:
        raise UserError(f"--store {args.store}: no series to draw (no ok rows{' of these metrics' if args.metric else ''}).")
    out = write_trends(series, found, args.output or Path(args.store).parent / "trends.html", title=args.title)
    print(f"trends: {out} ({len(series)} series, {len(found)} change points)")
    return 0


def cmd_backfill(args: argparse.Namespace) -> int:
    repo = Path(args.repo).resolve()
    commits = commit_range(repo, args.commits, args.every)
    if args.repeats < 1:
        raise UserError(f"--repeats {args.repeats}: must be 1 or more.")
    from harness import ab  # (imports the checkpoint code: only backfill needs it, once its input is good)
    from harness.core.env import environment
    pinned = ab.pin_model(list(args.overrides), model_cache_dir(None))
    chash = h.config_hash(pinned)
    machine, desc = h.machine_fingerprint(environment())
    out = Path(args.out or Path("runs") / "backfill" / chash).resolve()
    out.mkdir(parents=True, exist_ok=True)
    store = Path(args.store).resolve()
    print(f"{PROG} backfill: {len(commits)} commits x {args.repeats} repeats, config {chash} "
          f"({' '.join(h.config_of(pinned)) or 'defaults'}), machine {machine} ({desc}) -> {store}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="infer-bench-history-"))
    trees: dict[str, Path] = {}
    failed = 0
    try:
        for r in range(args.repeats):  # rounds: each commit once per round, so a slow spell hits all
            done = h.runs_of(store, chash, machine) if store.exists() else {}
            for c in commits:
                have = done.get(c, {})
                if have.get("failed") or have.get("ok", 0) > r:
                    continue
                if c not in trees:
                    trees[c] = ab.add_worktree(c, work / c[:12]) if repo == ab.REPO_ROOT else _add_tree(repo, c, work)
                run_dir = out / f"{c[:12]}-r{r}"
                if run_dir.exists():
                    shutil.rmtree(run_dir)
                side = ab.Side(f"commit {c[:12]}", trees[c], c, [])
                try:
                    ab.run_once(side, pinned, run_dir, args.python, args.run_timeout_s)
                except UserError as e:
                    failed += 1
                    print(f"  {c[:12]} round {r + 1}: FAILED ({e.problems[0].splitlines()[0]})", flush=True)
                    env = None
                    try:
                        env = json.loads((run_dir / "environment.json").read_text())
                    except (OSError, ValueError):
                        env = environment()
                    h.record_failure(store, c, pinned, str(e), run_dir, env, repo)
                    continue
                rep = h.ingest(store, [run_dir], repo, overrides=pinned)
                print(f"  {c[:12]} round {r + 1}/{args.repeats}: {rep.rows_added} rows ingested", flush=True)
    finally:
        for c, t in trees.items():
            if repo == ab.REPO_ROOT:
                ab.remove_worktree(t)
            else:
                _git(repo, "worktree", "remove", "--force", str(t))
        shutil.rmtree(work, ignore_errors=True)
        if repo != ab.REPO_ROOT:
            _git(repo, "worktree", "prune")
    print(f"{PROG} backfill: done ({failed} failed runs); see `{PROG} --store {args.store} changes`")
    return 1 if failed else 0


def _add_tree(repo: Path, commit: str, work: Path) -> Path:
    """A worktree of `commit` in another repository than this checkout (harness.ab.add_worktree is
    for this one)."""
    where = work / commit[:12]
    r = _git(repo, "worktree", "add", "--detach", "--force", str(where), commit)
    if r.returncode != 0:
        raise UserError(f"git worktree add {commit[:12]} in {repo}: {r.stderr.strip() or r.stdout.strip()}")
    return where


# ---- the command ----------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default=h.DEFAULT_STORE, help=f"the DuckDB file (default {h.DEFAULT_STORE})")
    ap.add_argument("--repo", default=str(REPO_ROOT), help="the git repository the commits belong to (default: "
                    "this checkout)")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ingest", help="add run directories to the store (idempotent)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.set_defaults(func=cmd_ingest)

    def detector(p: argparse.ArgumentParser) -> None:
        p.add_argument("--metric", action="append", help="a metric (repeatable; default: each workload's headline "
                       f"metrics, {', '.join(h.DEFAULT_METRICS)})")
        p.add_argument("--engine", help="one engine only")
        p.add_argument("--max-pvalue", type=float, default=h.MAX_PVALUE,
                       help=f"significance a change point needs (default {h.MAX_PVALUE})")
        p.add_argument("--min-magnitude", type=float, default=h.MIN_MAGNITUDE,
                       help=f"smallest relative change reported (default {h.MIN_MAGNITUDE})")

    p = sub.add_parser("changes", help="list the change points of every series, newest first")
    detector(p)
    p.add_argument("--since", metavar="REF", help="only change points after this commit (by commit date)")
    p.add_argument("--check", action="store_true", help="exit 1 when a change point is listed (for CI)")
    p.add_argument("--allow-nothing", action="store_true",
                   help="with --check: no series of two commits yet is not a failure")
    p.add_argument("--json", help="also write the change points to this JSON file")
    p.set_defaults(func=cmd_changes)
    p = sub.add_parser("backfill", help="run one config at each commit of a range and ingest the runs",
                       epilog="Everything after -- is passed to every infer-bench run.")
    p.add_argument("--commits", required=True, metavar="A..B", help="the commits after A up to B (first parent)")
    p.add_argument("--every", type=int, default=1, help="every N-th commit (counted back from B)")
    p.add_argument("--repeats", type=int, default=3, help="runs per commit, in rounds over the commits (default 3)")
    p.add_argument("--out", help="where the runs go (default runs/backfill/<config hash>)")
    p.add_argument("--python", default=sys.executable, help="interpreter of every run (default: this one)")
    p.add_argument("--run-timeout-s", type=float, default=900.0)
    p.add_argument("overrides", nargs="*", help="infer-bench overrides (after --)")
    p.set_defaults(func=cmd_backfill)
    p = sub.add_parser("report", help="write the trend page")
    detector(p)
    p.add_argument("-o", "--output", help="the page (default: trends.html next to the store, where a run "
                   "report's history links point)")
    p.add_argument("--title", default=None)
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("export", help="write the store as Parquet, partitioned by machine fingerprint")
    p.add_argument("--parquet", required=True, metavar="DIR")
    p.set_defaults(func=cmd_export)
    return ap


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(e.render(PROG), file=sys.stderr)
        code = EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; what was ingested is kept (backfill resumes where it stopped)", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()

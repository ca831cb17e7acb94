"""Performance history: every ingested run in one DuckDB file, series of one metric over commits,
and change points found in them with E-Divisive means (Apache Otava's implementation).

The store is an ordinary DuckDB database (docs/results-schema.md, "History store"):

- `runs`: one row per ingested run (or per `failed` backfill entry) with its provenance: commit,
  commit date, machine fingerprint, packages, config hash;
- `rows`: one row per results.jsonl line, the provenance columns repeated first-class, the whole
  row kept as JSON;
- `metrics`: every numeric field of every row, long format (run_id, line, metric, value);
- `meta`: the store's schema version; `MIGRATIONS` bring an older store up to date.

A **series** is one metric of one (engine, workload point, model, config hash) on one machine
fingerprint, ordered by commit date (then by the time of the run). Every run of a commit stays in
the series: the detector sees each run's value, so a commit's spread is part of the test.

Writes take an exclusive flock on `<store>.lock` (two ingesters wait for each other; DuckDB
itself allows one writing process) and happen in one transaction: a store is never left half
written.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from harness.core.errors import UserError
from harness.core.paths import REPO_ROOT
from harness.core.results import ENVIRONMENT_FILE, RESULTS_FILE

STORE_SCHEMA_VERSION = 1
DEFAULT_STORE = "runs/history.duckdb"
LOCK_TIMEOUT_S = 600.0

# Each step brings a store from version (key - 1) to version key, inside one transaction.
MIGRATIONS: dict[int, list[str]] = {
    1: [
        "CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR)",
        """CREATE TABLE IF NOT EXISTS runs (
            run_id VARCHAR PRIMARY KEY, status VARCHAR NOT NULL, error VARCHAR,
            "commit" VARCHAR, commit_date TIMESTAMP, dirty BOOLEAN,
            machine VARCHAR NOT NULL, machine_desc VARCHAR, hostname VARCHAR,
            config_hash VARCHAR NOT NULL, config VARCHAR,
            python VARCHAR, packages VARCHAR, started TIMESTAMP, ingested TIMESTAMP,
            run_dir VARCHAR, n_rows INTEGER, bad_lines VARCHAR)""",
        """CREATE TABLE IF NOT EXISTS rows (
            run_id VARCHAR NOT NULL, line INTEGER NOT NULL,
            "commit" VARCHAR, commit_date TIMESTAMP, machine VARCHAR NOT NULL, config_hash VARCHAR NOT NULL,
            engine VARCHAR, engine_version VARCHAR, engine_versions VARCHAR,
            model VARCHAR, workload VARCHAR, point_key VARCHAR,
            batch_size INTEGER, prompt_len INTEGER, output_len INTEGER, dtype VARCHAR, device VARCHAR,
            status VARCHAR, error VARCHAR, "timestamp" TIMESTAMP,
            decode_step_latency_s DOUBLE, prefill_latency_s DOUBLE, output_tok_s DOUBLE,
            "row" VARCHAR,
            PRIMARY KEY (run_id, line))""",
        """CREATE TABLE IF NOT EXISTS metrics (
            run_id VARCHAR NOT NULL, line INTEGER NOT NULL, metric VARCHAR NOT NULL, value DOUBLE,
            PRIMARY KEY (run_id, line, metric))""",
    ],
}

# Overrides that change where or how verbosely a run is written, not what it measures: left out
# of the config hash. model / model.path are replaced by the checkpoint's identity (the row's
# model_path directory), so `model=tiny` and the same checkpoint pinned by path are one config.
_NOT_CONFIG = ("hydra", "quiet", "parity", "roofline", "resume", "history", "model", "model_cache_dir",
               "point_timeout_s", "memory_sample_hz", "parity_tokens")


def _import_duckdb() -> Any:
    try:
        import duckdb
    except ImportError:
        raise UserError("the history store needs DuckDB: pip install duckdb (it is a dependency of "
                        "infer-bench; reinstall with pip install -e .)") from None
    return duckdb


# ---- provenance -----------------------------------------------------------------------------

def config_of(overrides: list[str]) -> list[str]:
    """The overrides that define what a run measures, normalised (no +/++, sorted)."""
    out = []
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key.split(".")[0].split("@")[0] in _NOT_CONFIG:
            continue
        out.append(o.lstrip("+"))
    return sorted(out)


def config_hash(overrides: list[str]) -> str:
    return hashlib.sha256(json.dumps(config_of(overrides)).encode()).hexdigest()[:12]


def machine_fingerprint(env: dict[str, Any] | None) -> tuple[str, str]:
    """(fingerprint, description) of the hardware a run measured: CPU model, cores the run could
    use, ISA, memory, GPUs. The hostname is left out: a CI runner has a new one every job."""
    env = env or {}
    cpu = env.get("cpu") or {}
    gpus = [(g.get("name"), g.get("memory_total_bytes")) for g in env.get("gpus") or []]
    mem_gib = round((env.get("memory_total_bytes") or 0) / 2**30)
    ident = {"cpu": cpu.get("model"), "arch": cpu.get("machine"), "cores": cpu.get("logical_cores"),
             "affinity": cpu.get("affinity"), "isa": cpu.get("isa"), "mem_gib": mem_gib, "gpus": gpus}
    fp = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]
    desc = f"{cpu.get('model') or '?'} x{cpu.get('affinity') or cpu.get('logical_cores') or '?'}, {mem_gib} GiB"
    if gpus:
        desc += ", " + ", ".join(str(g[0]) for g in gpus)
    return fp, desc


def commit_date(commit: str | None, repo: Path = REPO_ROOT) -> datetime | None:
    """The committer date of `commit` in `repo` (None when git does not know it there)."""
    if not commit:
        return None
    try:
        r = subprocess.run(["git", "show", "-s", "--format=%cI", commit], cwd=repo, capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or not r.stdout.strip():
        return None
    return utc(datetime.fromisoformat(r.stdout.strip()))


def utc(t: datetime) -> datetime:
    """A naive UTC datetime (the store's TIMESTAMP columns are UTC)."""
    return t.astimezone(timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return utc(datetime.fromisoformat(value))
    except ValueError:
        return None


def run_overrides(run_dir: Path) -> list[str]:
    """The command-line overrides a run was started with (Hydra's .hydra/overrides.yaml)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        import yaml
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, ImportError):
        return []
    return [str(o) for o in data] if isinstance(data, list) else []


# ---- reading a run --------------------------------------------------------------------------

@dataclass
class ParsedRun:
    run_id: str
    run_dir: Path
    rows: list[tuple[int, dict[str, Any]]]  # (line number, row)
    bad_lines: list[str] = field(default_factory=list)  # "results.jsonl line N: why"
    env: dict[str, Any] | None = None
    overrides: list[str] = field(default_factory=list)


def read_run(results: Path) -> list[ParsedRun]:
    """The rows of one results.jsonl, grouped by run_id. A line that is not a JSON object is
    named in `bad_lines` and left out; every other line is kept."""
    run_dir = results.parent
    good: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    bad: list[str] = []
    text = results.read_bytes().decode("utf-8", errors="replace")
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            bad.append(f"{results} line {n}: not JSON ({e}); left out")
            continue
        if not isinstance(row, dict) or not row.get("engine"):
            bad.append(f"{results} line {n}: not a results row (no engine); left out")
            continue
        rid = str(row.get("run_id") or "path-" + hashlib.sha256(str(results.resolve()).encode()).hexdigest()[:12])
        good.setdefault(rid, []).append((n, row))
    try:
        env = json.loads((run_dir / ENVIRONMENT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        env = None
    overrides = run_overrides(run_dir)
    runs = [ParsedRun(rid, run_dir, rows, [], env, overrides) for rid, rows in good.items()]
    if bad:
        if runs:
            runs[0].bad_lines = bad
        else:
            runs = [ParsedRun("", run_dir, [], bad, env, overrides)]
    return runs


def _numeric(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if isinstance(v, bool) or k == "schema_version":
            continue
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[k] = float(v)
    return out


# ---- the store ------------------------------------------------------------------------------

@contextmanager
def _locked(store: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    store.parent.mkdir(parents=True, exist_ok=True)
    with open(str(store) + ".lock", "a+") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise UserError(f"history store {store}: another process has held it for {timeout_s:g} s; "
                                    "wait for it to finish or stop it.") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def schema_version(con: Any) -> int:
    has_meta = con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'meta'").fetchone()[0]
    if not has_meta:
        return 0
    row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return int(row[0]) if row else 0


def migrate(con: Any, store: Path) -> int:
    """Bring the store to STORE_SCHEMA_VERSION, one step per version, each in a transaction."""
    current = schema_version(con)
    if current > STORE_SCHEMA_VERSION:
        raise UserError(f"history store {store}: schema version {current}, newer than this infer-bench reads "
                        f"({STORE_SCHEMA_VERSION}). Upgrade infer-bench.")
    for version in range(current + 1, STORE_SCHEMA_VERSION + 1):
        con.execute("BEGIN TRANSACTION")
        try:
            for sql in MIGRATIONS[version]:
                con.execute(sql)
            con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [str(version)])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    return STORE_SCHEMA_VERSION


@contextmanager
def open_store(store: str | Path, write: bool = False) -> Iterator[Any]:
    """A DuckDB connection to the store, migrated. Reading a store that does not exist is bad
    input (UserError naming --store)."""
    duckdb = _import_duckdb()
    store = Path(store)
    if not write and not store.exists():
        raise UserError(f"--store {store}: no history store there. Create one with `infer-bench-history "
                        "--store PATH ingest RUN_DIR...` (or a run with history.path=PATH), or name an existing file.")
    with _locked(store):
        try:
            con = duckdb.connect(str(store))
        except duckdb.Error as e:
            raise UserError(f"--store {store}: cannot open it as a DuckDB database ({str(e).splitlines()[0]}).") from None
        try:
            if write:
                migrate(con, store)
            elif schema_version(con) != STORE_SCHEMA_VERSION:
                v = schema_version(con)
                if v > STORE_SCHEMA_VERSION or v == 0:
                    raise UserError(f"--store {store}: not an infer-bench history store of schema version "
                                    f"{STORE_SCHEMA_VERSION} (found version {v}).")
                migrate(con, store)
            yield con
        finally:
            con.close()


@dataclass
class IngestReport:
    runs_added: int = 0
    rows_added: int = 0
    rows_present: int = 0
    bad_lines: list[str] = field(default_factory=list)


def _insert_run(con: Any, run: ParsedRun, repo: Path, status: str = "ok", error: str | None = None,
                commit: str | None = None, overrides: list[str] | None = None) -> tuple[int, int]:
    env = run.env or {}
    git = env.get("git") or {}
    commit = commit or git.get("commit")
    machine, desc = machine_fingerprint(env)
    ov = overrides if overrides is not None else run.overrides
    chash = config_hash(ov)
    started = _parse_time(env.get("timestamp")) or (
        _parse_time(run.rows[0][1].get("timestamp")) if run.rows else None) or utc(datetime.now(timezone.utc))
    cdate = commit_date(commit, repo) or started
    existing = {n for (n,) in con.execute("SELECT line FROM rows WHERE run_id = ?", [run.run_id]).fetchall()}
    new = [(n, r) for n, r in run.rows if n not in existing]
    known_run = con.execute("SELECT count(*) FROM runs WHERE run_id = ?", [run.run_id]).fetchone()[0]
    if known_run and not new:
        return 0, len(existing)
    con.execute("BEGIN TRANSACTION")
    try:
        if not known_run:
            con.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [run.run_id, status, error, commit, cdate, git.get("dirty"), machine, desc, env.get("hostname"),
                 chash, json.dumps(config_of(ov)), env.get("python"), json.dumps(env.get("packages") or {}),
                 started, utc(datetime.now(timezone.utc)), str(run.run_dir), len(run.rows),
                 json.dumps(run.bad_lines) if run.bad_lines else None])
        else:
            con.execute("UPDATE runs SET n_rows = ?, bad_lines = ? WHERE run_id = ?",
                        [len(run.rows), json.dumps(run.bad_lines) if run.bad_lines else None, run.run_id])
        for n, r in new:
            model = Path(str(r.get("model_path"))).name if r.get("model_path") else r.get("model")
            versions = r.get("worker_versions") or {}
            con.execute(
                "INSERT INTO rows VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [run.run_id, n, commit, cdate, machine, chash, r.get("engine"), r.get("engine_version"),
                 json.dumps(versions) if versions else None, model, r.get("workload"), r.get("point_key"),
                 _int(r.get("batch_size")), _int(r.get("prompt_len")), _int(r.get("output_len")),
                 r.get("dtype"), r.get("device"), r.get("status"), r.get("error"), _parse_time(r.get("timestamp")),
                 _float(r.get("decode_step_latency_s")), _float(r.get("prefill_latency_s")),
                 _float(r.get("output_tok_s")), json.dumps(r, default=str)])
            values = [(run.run_id, n, k, v) for k, v in _numeric(r).items()]
            if values:
                con.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?)", values)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return len(new), len(existing)


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def ingest(store: str | Path, paths: list[str | Path], repo: Path = REPO_ROOT,
           overrides: list[str] | None = None) -> IngestReport:
    """Add every run under `paths` (run directories, multirun directories, results files) to the
    store. Idempotent: rows already there (same run_id and line) are not added again. Lines that
    are not rows are reported in `bad_lines`; the good rows of the file are still added.
    `overrides` replaces what the runs' .hydra/overrides.yaml say (backfill passes the config it ran)."""
    files: list[Path] = []
    problems = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.rglob(RESULTS_FILE))
            if not found:
                problems.append(f"RUN_DIR {p}: no {RESULTS_FILE} in this directory or below it. Give an "
                                "infer-bench run directory (or a multirun directory).")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            problems.append(f"RUN_DIR {p}: no such file or directory.")
    if problems:
        raise UserError(problems)
    report = IngestReport()
    with open_store(store, write=True) as con:
        for f in dict.fromkeys(x.resolve() for x in files):
            for run in read_run(f):
                report.bad_lines += run.bad_lines
                if not run.rows:
                    continue
                added, present = _insert_run(con, run, repo, overrides=overrides)
                report.rows_added += added
                report.rows_present += present
                report.runs_added += bool(added) and not present
    return report


def ingest_after_run(store: str | Path, run_dir: Path) -> None:
    """What `infer-bench` does at the end of a run when history.path is set: ingest the run and
    say so. A store that cannot take it is a warning: the run's results are already on disk."""
    try:
        rep = ingest(store, [run_dir])
    except (UserError, OSError) as e:
        print(f"history: warning: run not ingested into {store}: {e}", file=sys.stderr)
        return
    for b in rep.bad_lines:
        print(f"history: warning: {b}", file=sys.stderr)
    print(f"history: {rep.rows_added} rows ingested into {store}")


def record_failure(store: str | Path, commit: str, overrides: list[str], error: str, run_dir: Path,
                   env: dict[str, Any] | None, repo: Path = REPO_ROOT) -> str:
    """A `failed` entry in `runs` for a commit whose code could not run the config (backfill)."""
    run_id = "failed-" + hashlib.sha256(f"{commit}{config_hash(overrides)}{time.time()}".encode()).hexdigest()[:12]
    run = ParsedRun(run_id, run_dir, [], [], env, overrides)
    with open_store(store, write=True) as con:
        _insert_run(con, run, repo, status="failed", error=error[-2000:], commit=commit, overrides=overrides)
    return run_id


def runs_of(store: str | Path, chash: str, machine: str) -> dict[str, dict[str, int]]:
    """commit -> {status: number of runs} for one config on one machine (what backfill skips)."""
    out: dict[str, dict[str, int]] = {}
    with open_store(store) as con:
        for commit, status, n in con.execute(
                'SELECT "commit", status, count(*) FROM runs WHERE config_hash = ? AND machine = ? '
                'GROUP BY ALL', [chash, machine]).fetchall():
            out.setdefault(commit, {})[status] = n
    return out


def export_parquet(store: str | Path, out: str | Path) -> list[Path]:
    """Write every table as Parquet under `out`: runs/, rows/ and metrics/ partitioned by machine
    fingerprint (machine=<fp>/...), meta.parquet. DuckDB reads them back with
    read_parquet('out/rows/**/*.parquet', hive_partitioning = true)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with open_store(store) as con:
        for table, query in (
                ("runs", "SELECT * FROM runs"), ("rows", "SELECT * FROM rows"),
                ("metrics", "SELECT m.*, r.machine FROM metrics m JOIN rows r USING (run_id, line)")):
            target = out / table
            con.execute(f"COPY ({query}) TO '{_sql_path(target)}' "
                        "(FORMAT parquet, PARTITION_BY (machine), OVERWRITE_OR_IGNORE true)")
            written.append(target)
        con.execute(f"COPY meta TO '{_sql_path(out / 'meta.parquet')}' (FORMAT parquet)")
        written.append(out / "meta.parquet")
    return written


def _sql_path(p: Path) -> str:
    return str(p.resolve()).replace("'", "''")


# ---- series and change points ---------------------------------------------------------------

@dataclass
class Point:
    commit: str | None
    commit_date: datetime
    run_id: str
    value: float
    started: datetime | None = None
    dirty: bool | None = None


@dataclass
class Series:
    machine: str
    machine_desc: str
    engine: str
    workload: str
    point_key: str
    model: str
    config_hash: str
    metric: str
    points: list[Point]
    failed_commits: list[tuple[str, datetime]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return "|".join([self.machine, self.engine, self.point_key, self.model, self.config_hash, self.metric])

    @property
    def anchor(self) -> str:
        """The id of the series' chart on the trend page (the run report links to it)."""
        return series_anchor(self.machine, self.engine, self.point_key, self.model, self.config_hash, self.metric)

    @property
    def point_label(self) -> str:
        """The point's parameters, short: `batch_size=1 output_len=8 prompt_len=32`."""
        text = self.point_key.split(":", 1)[-1]
        try:
            params = json.loads(text)
        except ValueError:
            return text
        return " ".join(f"{k}={v}" for k, v in params.items()) if isinstance(params, dict) else text

    @property
    def label(self) -> str:
        return f"{self.engine} · {self.workload} {self.point_label} · {self.metric}"

    def commits(self) -> list[str]:
        return list(dict.fromkeys(p.commit or "?" for p in self.points))


# The metrics a series is made of when none is named: each workload's headline figures.
DEFAULT_METRICS = ("decode_step_latency_s", "prefill_latency_s", "output_tok_s", "ttft_s", "tpot_s", "e2el_s")


def series_anchor(machine: str, engine: str, point_key: str, model: str, chash: str, metric: str) -> str:
    key = "|".join([machine, engine, point_key or "", model or "", chash, metric])
    return "trend-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def run_series_anchors(run_dir: Path, rows: list[dict[str, Any]],
                       metrics: tuple[str, ...] = DEFAULT_METRICS) -> list[tuple[dict[str, Any], str, str]]:
    """(row, metric, anchor of its series) for every ok row of a run and every headline metric it
    has: where the run's points are drawn on the trend page."""
    try:
        env = json.loads((run_dir / ENVIRONMENT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        env = None
    machine, _ = machine_fingerprint(env)
    chash = config_hash(run_overrides(run_dir))
    out = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        model = Path(str(r.get("model_path"))).name if r.get("model_path") else r.get("model")
        for m in metrics:
            if _float(r.get(m)) is not None:
                out.append((r, m, series_anchor(machine, str(r.get("engine")), str(r.get("point_key") or ""),
                                                str(model or ""), chash, m)))
    return out


def known_metrics(con: Any) -> list[str]:
    return [m for (m,) in con.execute("SELECT DISTINCT metric FROM metrics ORDER BY metric").fetchall()]


def load_series(store: str | Path, metrics: list[str] | None = None, engine: str | None = None,
                machine: str | None = None) -> list[Series]:
    """Every series in the store (ok rows only), optionally of some metrics / one engine / one
    machine. Unknown metric or engine names are bad input."""
    with open_store(store) as con:
        known = known_metrics(con)
        if metrics:
            unknown = [m for m in metrics if m not in known]
            if unknown:
                raise UserError(f"--metric {', '.join(unknown)}: no such metric in {store}. Metrics there: "
                                f"{', '.join(known[:40]) or '(none: the store has no rows yet)'}.")
        engines = [e for (e,) in con.execute("SELECT DISTINCT engine FROM rows ORDER BY 1").fetchall()]
        if engine and engine not in engines:
            raise UserError(f"--engine {engine}: no rows of this engine in {store}. Engines there: "
                            f"{', '.join(engines) or '(none)'}.")
        if not metrics:
            metrics = [m for m in DEFAULT_METRICS if m in known]
        # a run of a tree with uncommitted changes measured no commit: kept in the store, not in a series
        where, args = ["r.status = 'ok'", "m.value IS NOT NULL", "ru.dirty IS NOT TRUE"], []
        if metrics:
            where.append(f"m.metric IN ({', '.join('?' * len(metrics))})")
            args += metrics
        if engine:
            where.append("r.engine = ?")
            args.append(engine)
        if machine:
            where.append("r.machine = ?")
            args.append(machine)
        data = con.execute(f"""
            SELECT r.machine, ru.machine_desc, r.engine, r.workload, r.point_key, r.model, r.config_hash,
                   m.metric, r."commit", r.commit_date, r.run_id, m.value, ru.started, ru.dirty
            FROM metrics m JOIN rows r USING (run_id, line) JOIN runs ru USING (run_id)
            WHERE {' AND '.join(where)}
            ORDER BY r.machine, r.engine, r.point_key, r.model, r.config_hash, m.metric,
                     r.commit_date, ru.started, r.run_id, r.line""", args).fetchall()
        failed = con.execute("""SELECT machine, config_hash, "commit", commit_date FROM runs
                                WHERE status = 'failed' ORDER BY commit_date""").fetchall()
    series: dict[tuple, Series] = {}
    for (mach, desc, eng, wl, pk, model, ch, metric, commit, cdate, run_id, value, started, dirty) in data:
        key = (mach, eng, pk, model, ch, metric)
        if key not in series:
            series[key] = Series(mach, desc or mach, eng, wl, pk or "", model or "", ch, metric, [])
        series[key].points.append(Point(commit, cdate, run_id, float(value), started, dirty))
    for s in series.values():
        # by commit date; commits of one date in the order they were first run; a commit's runs
        # together, in the order they ran
        first: dict[str | None, datetime] = {}
        for p in s.points:
            if p.started is not None and (p.commit not in first or p.started < first[p.commit]):
                first[p.commit] = p.started
        s.points.sort(key=lambda p: (p.commit_date, first.get(p.commit) or p.commit_date, p.commit or "",
                                     p.started or p.commit_date))
        s.failed_commits = [(c, d) for (mach, ch, c, d) in failed if mach == s.machine and ch == s.config_hash]
    return list(series.values())


@dataclass
class ChangePoint:
    series: Series
    index: int                # first point after the change, in series.points
    commit_before: str        # the last commit before the change
    commit_after: str         # the first commit after it
    commit_after_date: datetime
    mean_before: float
    mean_after: float
    pvalue: float
    n_before: int
    n_after: int

    @property
    def magnitude(self) -> float:
        """mean after / mean before, over the points between the neighbouring change points."""
        return self.mean_after / self.mean_before if self.mean_before else math.inf

    @property
    def commit_range(self) -> str:
        return f"{self.commit_before[:10]}..{self.commit_after[:10]}"


MAX_PVALUE = 0.001
MIN_MAGNITUDE = 0.05
WINDOW = 50


def _commit_starts(points: list[Point]) -> list[int]:
    """Index of the first point of every commit's block (the series is ordered by commit)."""
    starts, prev = [], object()
    for i, p in enumerate(points):
        if p.commit != prev:
            starts.append(i)
            prev = p.commit
    return starts


def change_points(s: Series, max_pvalue: float = MAX_PVALUE, min_magnitude: float = MIN_MAGNITUDE,
                  window: int = WINDOW) -> list[ChangePoint]:
    """E-Divisive means (Otava's split-and-merge with a t-test significance) over every run's value
    of the series. A change can only fall between two commits: a change point Otava places inside
    one commit's block of repeats is moved to the nearer commit boundary, and the statistics of
    every change point are then recomputed with Otava's t-test over the segments between them."""
    try:
        from otava.analysis import TTestSignificanceTester, compute_change_points
        from otava.change_point_divisive.base import CandidateChangePoint
    except ImportError:
        raise UserError("change points need Apache Otava's E-Divisive means: pip install --no-deps "
                        "apache-otava==0.8.0 (make venv does; --no-deps because its metadata pins numpy 2.2 "
                        "and pulls clients infer-bench does not use: docs/history.md)") from None

    values = [p.value for p in s.points]
    starts = _commit_starts(s.points)
    if len(starts) < 2:
        return []
    # Otava 0.8's sliding window slices a list but not a numpy array: give it a list
    found, _ = compute_change_points(list(values), window_len=window, max_pvalue=max_pvalue,
                                     min_magnitude=min_magnitude)
    boundaries = starts[1:]
    snapped = sorted({min(boundaries, key=lambda b: (abs(b - cp.index), b)) for cp in found})
    if not snapped:
        return []
    tester = TTestSignificanceTester(max_pvalue)
    candidates = [CandidateChangePoint(index=i, qhat=0.0) for i in snapped]
    stats_cps = []
    for c in candidates:
        intervals = tester.get_intervals(candidates)
        stats_cps.append(tester.change_point(c, values, intervals))
    out = []
    edges = [0] + snapped + [len(values)]
    for k, cp in enumerate(stats_cps):
        lo, i, hi = edges[k], edges[k + 1], edges[k + 2]
        before, after = s.points[i - 1], s.points[i]
        st = cp.stats
        if st.pvalue > max_pvalue or abs(st.mean_2 / st.mean_1 - 1) < min_magnitude:
            continue  # moving it to a commit boundary left it below the bar
        out.append(ChangePoint(s, i, before.commit or "?", after.commit or "?", after.commit_date,
                               float(st.mean_1), float(st.mean_2), float(st.pvalue), i - lo, hi - i))
    return out


def find_changes(store: str | Path, metrics: list[str] | None = None, engine: str | None = None,
                 since: datetime | None = None, max_pvalue: float = MAX_PVALUE,
                 min_magnitude: float = MIN_MAGNITUDE) -> tuple[list[Series], list[ChangePoint]]:
    """Every series and its change points, newest first; `since`: only changes whose first
    commit after the change is newer than that date."""
    series = load_series(store, metrics, engine)
    found = [cp for s in series for cp in change_points(s, max_pvalue, min_magnitude)]
    if since is not None:
        found = [cp for cp in found if cp.commit_after_date > since]
    found.sort(key=lambda cp: (cp.commit_after_date, cp.series.key), reverse=True)
    return series, found

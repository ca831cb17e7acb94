"""The history store, its series and the change-point glue, on synthetic runs: run directories
written here the way infer-bench writes them (results.jsonl, environment.json,
.hydra/overrides.yaml), with values drawn from known distributions. The detector itself is
Apache Otava's E-Divisive means; these tests check what we build around it: ingest, series
boundaries (machine, config), commit ordering and snapping, and the command line."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import duckdb
import numpy as np
import pytest

from harness import history_cli
from harness.core import history as h

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
MACHINE_A = {"model": "Synthetic CPU A", "machine": "x86_64", "logical_cores": 2, "affinity": 2, "isa": ["avx2"]}
MACHINE_B = {"model": "Synthetic CPU B", "machine": "x86_64", "logical_cores": 8, "affinity": 8, "isa": ["avx2"]}
OVERRIDES = ["engines=[reference]", "model=tiny", "workload.batch_sizes=[1]", "workload.prompt_lens=[32]"]
POINT = 'sweep:{"batch_size":1,"output_len":8,"prompt_len":32}'


def write_run(root: Path, name: str, commit: str, when: datetime, values: dict[str, float],
              cpu: dict = MACHINE_A, overrides: list[str] = OVERRIDES, status: str = "ok",
              extra_lines: list[str] | None = None) -> Path:
    """One synthetic run directory, in infer-bench's layout, not produced by an engine."""
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    env = {"timestamp": when.isoformat(), "hostname": f"host-{name}", "python": "3.11", "packages": {},
           "cpu": cpu, "memory_total_bytes": 16 * 2**30, "gpus": [], "git": {"commit": commit, "dirty": False}}
    (d / "environment.json").write_text(json.dumps(env))
    row = {"schema_version": 1, "run_id": f"run-{name}", "timestamp": when.isoformat(), "engine": "reference",
           "engine_version": "0.1", "model": "tiny", "model_path": "/cache/tiny-abc", "workload": "sweep",
           "point": {"batch_size": 1}, "point_key": POINT, "batch_size": 1, "prompt_len": 32, "output_len": 8,
           "dtype": "float32", "device": "cpu", "status": status, "error": None, **values}
    lines = [json.dumps(row)] + list(extra_lines or [])
    (d / "results.jsonl").write_text("\n".join(lines) + "\n")
    return d


def series_runs(root: Path, levels: list[float], repeats: int, noise: float, seed: int = 0,
                cpu: dict = MACHINE_A, prefix: str = "c", start: datetime = T0) -> list[Path]:
    """Runs of len(levels) commits (one day apart), `repeats` runs each, the decode step at
    level * (1 + N(0, noise))."""
    rng = np.random.default_rng(seed)
    out = []
    for c, level in enumerate(levels):
        for r in range(repeats):
            v = level * (1 + rng.normal(0, noise))
            out.append(write_run(root, f"{prefix}{c}-r{r}-{cpu['model'][-1]}", f"{prefix}{c:039d}",
                                 start + timedelta(days=c, minutes=r), {"decode_step_latency_s": v}, cpu))
    return out


def test_known_step_is_found_at_its_commit(tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    runs = series_runs(tmp_path / "runs", [0.010] * 4 + [0.012] * 4, repeats=4, noise=0.02)
    h.ingest(store, runs)
    series, changes = h.find_changes(store, ["decode_step_latency_s"])
    assert len(series) == 1 and len(series[0].points) == 32
    assert len(changes) == 1
    cp = changes[0]
    assert (cp.commit_before, cp.commit_after) == (f"c{3:039d}", f"c{4:039d}")
    assert cp.magnitude == pytest.approx(1.2, rel=0.03)
    assert (cp.n_before, cp.n_after) == (16, 16)
    assert cp.pvalue < h.MAX_PVALUE


def test_two_steps_found_newest_first(tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    h.ingest(store, series_runs(tmp_path / "runs", [1.0] * 4 + [1.3] * 4 + [1.0] * 4, repeats=3, noise=0.02, seed=3))
    _, changes = h.find_changes(store, ["decode_step_latency_s"])
    assert [cp.commit_after for cp in changes] == [f"c{8:039d}", f"c{4:039d}"]
    assert changes[0].magnitude == pytest.approx(1 / 1.3, rel=0.04)


def test_flat_noisy_series_has_no_change_point(tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    for seed in range(3):
        h.ingest(store, series_runs(tmp_path / f"runs{seed}", [1.0] * 10, repeats=3, noise=0.05, seed=seed,
                                    prefix=f"s{seed}c", start=T0 + timedelta(days=100 * seed)))
    series, changes = h.find_changes(store, ["decode_step_latency_s"])
    assert len(series[0].points) == 90
    assert changes == []


def test_a_change_inside_a_commits_repeats_is_moved_to_a_commit_boundary(tmp_path: Path) -> None:
    # commit 2's runs are half old level, half new: the change is drawn between two commits
    root, runs = tmp_path / "runs", []
    levels = [[1.0] * 4, [1.0] * 4, [1.0, 1.0, 1.5, 1.5], [1.5] * 4, [1.5] * 4]
    for c, vals in enumerate(levels):
        for r, v in enumerate(vals):
            runs.append(write_run(root, f"c{c}r{r}", f"c{c:039d}", T0 + timedelta(days=c, minutes=r),
                                  {"decode_step_latency_s": v * (1 + 0.01 * ((r * 7 + c) % 3))}))
    store = tmp_path / "h.duckdb"
    h.ingest(store, runs)
    _, changes = h.find_changes(store, ["decode_step_latency_s"])
    assert len(changes) == 1
    assert changes[0].index % 4 == 0


def test_series_are_split_by_machine(tmp_path: Path) -> None:
    # machine B is twice as slow: interleaved in time with A, it would look like steps
    store = tmp_path / "h.duckdb"
    h.ingest(store, series_runs(tmp_path / "a", [1.0] * 6, repeats=3, noise=0.02, cpu=MACHINE_A))
    h.ingest(store, series_runs(tmp_path / "b", [2.0] * 6, repeats=3, noise=0.02, cpu=MACHINE_B, seed=1))
    series, changes = h.find_changes(store, ["decode_step_latency_s"])
    assert len(series) == 2
    assert sorted(round(float(np.mean([p.value for p in s.points]))) for s in series) == [1, 2]
    assert changes == []


def test_series_are_split_by_config(tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    a = series_runs(tmp_path / "a", [1.0] * 3, repeats=2, noise=0.01)
    b = [write_run(tmp_path / "b", f"b{i}", f"c{i:039d}", T0 + timedelta(days=i, hours=1),
                   {"decode_step_latency_s": 3.0}, overrides=OVERRIDES + ["dtype=bfloat16"]) for i in range(3)]
    h.ingest(store, a + b)
    assert len(h.load_series(store, ["decode_step_latency_s"])) == 2


def test_config_hash_ignores_where_and_how_verbosely_a_run_writes() -> None:
    pinned = ["engines=[reference]", "model=local", "model.path=/c/tiny-abc", "quiet=true", "parity=false",
              "roofline=false", "workload.batch_sizes=[1]"]
    assert h.config_hash(pinned) == h.config_hash(["workload.batch_sizes=[1]", "model=tiny", "engines=[reference]"])
    assert h.config_hash(pinned) != h.config_hash(pinned + ["dtype=bfloat16"])


def test_ingest_is_idempotent_and_keeps_what_is_there(tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    runs = series_runs(tmp_path / "runs", [1.0, 1.0], repeats=2, noise=0.01)
    first = h.ingest(store, runs[:3])
    assert (first.rows_added, first.runs_added) == (3, 3)
    again = h.ingest(store, runs)
    assert (again.rows_added, again.rows_present) == (1, 3)
    third = h.ingest(store, [tmp_path / "runs"])
    assert (third.rows_added, third.rows_present) == (0, 4)
    con = duckdb.connect(str(store), read_only=True)
    assert con.execute("select count(*) from rows").fetchone()[0] == 4
    assert con.execute("select count(*) from runs").fetchone()[0] == 4
    assert con.execute("select count(*) from metrics where metric = 'decode_step_latency_s'").fetchone()[0] == 4


def _ingest_worker(args: tuple[str, list[str]]) -> int:
    store, paths = args
    return h.ingest(store, paths).rows_added


def test_two_ingesters_at_once_lose_nothing(tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    a = series_runs(tmp_path / "a", [1.0] * 10, repeats=2, noise=0.01)
    b = series_runs(tmp_path / "b", [2.0] * 10, repeats=2, noise=0.01, cpu=MACHINE_B)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        added = pool.map(_ingest_worker, [(str(store), [str(p) for p in a]), (str(store), [str(p) for p in b])])
    assert added == [20, 20]
    con = duckdb.connect(str(store), read_only=True)
    assert con.execute("select count(*) from rows").fetchone()[0] == 40
    assert con.execute("select count(distinct machine) from rows").fetchone()[0] == 2


def test_a_corrupt_line_is_named_and_the_good_rows_kept(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good2 = json.dumps({"schema_version": 1, "run_id": "run-x", "engine": "reference", "point_key": POINT,
                        "status": "ok", "decode_step_latency_s": 0.5})
    d = write_run(tmp_path, "x", "c" * 40, T0, {"decode_step_latency_s": 0.4},
                  extra_lines=['{"schema_version": 1, "run_id": "run-x", "engine": "refer', good2, '{"torn'])
    store = tmp_path / "h.duckdb"
    code = history_cli.run(["--store", str(store), "ingest", str(d)])
    err = capsys.readouterr().err
    assert code == 1
    assert "results.jsonl line 2: not JSON" in err and "results.jsonl line 4: not JSON" in err
    con = duckdb.connect(str(store), read_only=True)
    assert sorted(con.execute("select line from rows").fetchall()) == [(1,), (3,)]


def test_store_is_a_plain_duckdb_file_with_a_schema_version(tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    h.ingest(store, series_runs(tmp_path / "runs", [1.0], repeats=2, noise=0.01))
    r = subprocess.run([sys.executable, "-c", "import duckdb, sys; print(duckdb.connect(sys.argv[1])"
                        ".execute('select count(*) from rows').fetchone()[0])", str(store)],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "2"
    con = duckdb.connect(str(store))
    assert con.execute("select value from meta where key = 'schema_version'").fetchone()[0] == str(h.STORE_SCHEMA_VERSION)
    cols = [c for (c,) in con.execute("select column_name from information_schema.columns where table_name = 'rows'").fetchall()]
    for c in ("commit", "commit_date", "machine", "engine_version", "config_hash"):
        assert c in cols
    con.execute("update meta set value = '99' where key = 'schema_version'")
    con.close()
    with pytest.raises(h.UserError, match="schema version 99"):
        h.ingest(store, [tmp_path / "runs"])


def test_export_parquet_is_partitioned_by_machine(tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    h.ingest(store, series_runs(tmp_path / "a", [1.0] * 2, repeats=2, noise=0.01))
    h.ingest(store, series_runs(tmp_path / "b", [1.0] * 3, repeats=1, noise=0.01, cpu=MACHINE_B))
    out = tmp_path / "pq"
    assert history_cli.run(["--store", str(store), "export", "--parquet", str(out)]) == 0
    parts = sorted(p.name for p in (out / "rows").iterdir())
    assert len(parts) == 2 and all(p.startswith("machine=") for p in parts)
    con = duckdb.connect()
    counts = con.execute(f"select machine, count(*) from read_parquet('{out}/rows/**/*.parquet', "
                         "hive_partitioning = true) group by machine order by 2").fetchall()
    assert [n for _, n in counts] == [3, 4]


# ---- bad input: exit 2, one message naming the field ------------------------------------------

def _cli(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """The command's entry point (its error handling included), in this process."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        history_cli.main(args)
    return int(e.value.code), capsys.readouterr().err


def test_bad_input_exits_2_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _cli = lambda args: globals()["_cli"](args, capsys)  # noqa: E731
    code, err = _cli(["--store", str(tmp_path / "none.duckdb"), "changes"])
    assert code == 2 and "--store" in err and "Traceback" not in err
    store = tmp_path / "h.duckdb"
    h.ingest(store, series_runs(tmp_path / "runs", [1.0], repeats=1, noise=0.01))
    code, err = _cli(["--store", str(store), "changes", "--metric", "decode_step_latencyy"])
    assert code == 2 and "--metric decode_step_latencyy" in err and "decode_step_latency_s" in err
    code, err = _cli(["--store", str(store), "backfill", "--commits", "no-such-ref..HEAD"])
    assert code == 2 and "--commits no-such-ref" in err and "Traceback" not in err
    code, err = _cli(["--store", str(store), "changes", "--since", "no-such-ref"])
    assert code == 2 and "--since no-such-ref" in err
    code, err = _cli(["--store", str(store), "ingest", str(tmp_path / "missing")])
    assert code == 2 and "RUN_DIR" in err


def test_check_fails_on_a_change_and_on_nothing_compared(tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    h.ingest(store, series_runs(tmp_path / "one", [1.0], repeats=2, noise=0.01))
    assert history_cli.run(["--store", str(store), "changes", "--check"]) == 1
    assert history_cli.run(["--store", str(store), "changes", "--check", "--allow-nothing"]) == 0
    h.ingest(store, series_runs(tmp_path / "more", [1.0] * 3 + [1.3] * 3, repeats=3, noise=0.01, prefix="m",
                                start=T0 + timedelta(days=10)))
    assert history_cli.run(["--store", str(store), "changes", "--check"]) == 1


@pytest.mark.slow
def test_a_run_with_history_path_ingests_itself(tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[reference]", "model=tiny",
                        "workload.batch_sizes=[1]", "workload.prompt_lens=[16]", "workload.output_len=4",
                        "workload.warmup=1", "workload.min_repeats=2", "workload.min_duration_s=0", "parity=false",
                        "roofline=false", "quiet=true", f"history.path={store}", f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"history: 1 rows ingested into {store}" in r.stdout
    con = duckdb.connect(str(store), read_only=True)
    assert con.execute("select engine, status from rows").fetchall() == [("reference", "ok")]
    # its report links the point's decode step to the trend-page chart of the series the store holds
    machine, engine, point_key, model, chash = con.execute(
        "select machine, engine, point_key, model, config_hash from rows").fetchone()
    anchor = h.series_anchor(machine, engine, point_key, model, chash, "decode_step_latency_s")
    report = (tmp_path / "run" / "report.html").read_text()
    assert f'href="../trends.html#{anchor}"' in report


def test_trend_links_are_relative_and_never_a_url_scheme(tmp_path: Path) -> None:
    from reports.sections.history_links import trends_href
    assert trends_href(str(tmp_path / "h.duckdb"), tmp_path / "run", "trend-x") == "../trends.html#trend-x"
    assert trends_href(str(tmp_path / "javascript:alert(1)" / "h.duckdb"), tmp_path,
                       "a").startswith("./javascript:alert(1)/trends.html")


def test_since_keeps_only_changes_after_that_commit_date(tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    h.ingest(store, series_runs(tmp_path / "runs", [1.0] * 4 + [1.25] * 4, repeats=3, noise=0.02))
    # the change's first commit after it is commit 4, dated T0 + 4 days
    assert len(h.find_changes(store, since=h.utc(T0 + timedelta(days=3, hours=12)))[1]) == 1
    assert h.find_changes(store, since=h.utc(T0 + timedelta(days=4)))[1] == []


def test_an_older_store_is_migrated_and_a_foreign_file_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    store = tmp_path / "old.duckdb"
    duckdb.connect(str(store)).close()  # a DuckDB file of schema version 0: no tables at all
    with pytest.raises(h.UserError, match="not an infer-bench history store"):
        h.load_series(store)
    h.ingest(store, series_runs(tmp_path / "runs", [1.0], repeats=1, noise=0.01))  # writing migrates it
    con = duckdb.connect(str(store), read_only=True)
    assert con.execute("select value from meta").fetchall() == [(str(h.STORE_SCHEMA_VERSION),)]
    con.close()
    text = tmp_path / "text.duckdb"
    text.write_text("not a database")
    code, err = _cli(["--store", str(text), "changes"], capsys)
    assert code == 2 and f"--store {text}" in err and "Traceback" not in err

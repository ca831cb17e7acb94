"""`infer-bench-history backfill` over the commits of a small git repository whose `harness.cli`
is a PROTOCOL FAKE of infer-bench (it measures nothing: it writes a run directory in
infer-bench's layout with the decode step its tree's speed.txt names). What is tested is the
backfill's own logic: a worktree per commit, rounds, ingest, resume, and a commit whose code
cannot run becoming a `failed` entry."""

from __future__ import annotations

import subprocess
from pathlib import Path

import duckdb
import pytest

from harness import history_cli
from harness.core import history as h

FAKE_CLI = r'''
"""PROTOCOL FAKE of infer-bench's command line, for the backfill tests: no engine runs."""
import json, random, subprocess, sys, uuid
from pathlib import Path
FAKE_MACHINE = {"cpu": {"model": "fake"}, "memory_total_bytes": 0, "gpus": []}
args = sys.argv[1:]
out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
here = Path(__file__).resolve().parents[1]
speed = (here / "speed.txt").read_text().split()[0]
if speed == "broken":
    sys.exit("ImportError: this commit cannot run the config")
commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
(out / ".hydra").mkdir(parents=True, exist_ok=True)
(out / ".hydra" / "overrides.yaml").write_text("".join(f"- {a}\n" for a in args if not a.startswith("hydra.")))
(out / "environment.json").write_text(json.dumps({"timestamp": "2026-01-01T00:00:00+00:00", "git": {"commit": commit},
    **FAKE_MACHINE}))
row = {"schema_version": 1, "run_id": uuid.uuid4().hex[:12], "engine": "fake", "workload": "sweep",
       "point_key": "sweep:{}", "model_path": "/m/fake", "status": "ok", "decode_step_latency_s": float(speed) * random.uniform(0.99, 1.01)}
(out / "results.jsonl").write_text(json.dumps(row) + "\n")
'''


def git(repo: Path, *args: str, date: str | None = None) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    if date:
        env["GIT_COMMITTER_DATE"] = env["GIT_AUTHOR_DATE"] = date
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, list[str]]:
    """A repository of 5 commits: speeds 1, 1, broken, 2, 2 (the base commit is not in the range)."""
    r = tmp_path / "repo"
    (r / "harness").mkdir(parents=True)
    (r / "harness" / "__init__.py").write_text("")
    (r / "harness" / "cli.py").write_text(FAKE_CLI)
    git(r, "init", "-q")
    commits = []
    for i, speed in enumerate(["1.0", "1.0", "1.0", "broken", "2.0", "2.0"]):
        (r / "speed.txt").write_text(f"{speed}\ncommit {i}\n")
        git(r, "add", "-A")
        git(r, "commit", "-q", "-m", f"speed {speed}", date=f"2026-01-01T00:0{i}:00Z")
        commits.append(git(r, "rev-parse", "HEAD"))
    return r, commits


def backfill(repo: Path, store: Path, out: Path, repeats: int, commits: str = "HEAD~5..HEAD") -> int:
    return history_cli.run(["--store", str(store), "--repo", str(repo), "backfill", "--commits", commits,
                            "--repeats", str(repeats), "--out", str(out), "--",
                            "engines=[fake]", "model=local", "model.path=/m/fake"])


@pytest.mark.slow
def test_backfill_runs_each_commit_records_failures_and_resumes(repo: tuple[Path, list[str]], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    r, commits = repo
    # the machine the backfill resumes for is the one its runs record: the fake's
    monkeypatch.setattr("harness.core.env.environment", lambda: {"cpu": {"model": "fake"}, "memory_total_bytes": 0,
                                                                 "gpus": []})
    store, out = tmp_path / "h.duckdb", tmp_path / "runs"
    assert backfill(r, store, out, repeats=1) == 1  # the broken commit
    con = duckdb.connect(str(store), read_only=True)
    by_commit = dict(con.execute('select "commit", list(status) from runs group by 1').fetchall())
    con.close()
    assert set(by_commit) == set(commits[1:])  # A..B: A itself is not run
    assert by_commit[commits[3]] == ["failed"]
    assert all(by_commit[c] == ["ok"] for c in commits[1:] if c != commits[3])
    # a second round: only what is missing runs (the failed commit is not retried)
    capsys.readouterr()
    assert backfill(r, store, out, repeats=2) == 0
    ran = [line for line in capsys.readouterr().out.splitlines() if "round" in line]
    assert len(ran) == 4 and all("round 2/2" in line for line in ran)
    assert backfill(r, store, out, repeats=2) == 0  # everything there: nothing runs
    series, changes = h.find_changes(store, ["decode_step_latency_s"])
    assert len(series) == 1 and [p.commit for p in series[0].points] == [c for c in commits[1:] if c != commits[3]
                                                                        for _ in range(2)]
    assert [(cp.commit_before, cp.commit_after) for cp in changes] == [(commits[2], commits[4])]
    assert series[0].failed_commits[0][0] == commits[3]
    assert git(r, "worktree", "list").count("\n") == 0  # every worktree removed


def test_every_nth_commit_counted_back_from_the_end(repo: tuple[Path, list[str]]) -> None:
    r, commits = repo
    assert history_cli.commit_range(r, "HEAD~5..HEAD", 2) == [commits[1], commits[3], commits[5]]
    with pytest.raises(h.UserError, match="--commits HEAD..HEAD~5"):
        history_cli.commit_range(r, "HEAD..HEAD~5", 1)

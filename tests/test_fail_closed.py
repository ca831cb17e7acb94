"""Verdicts that cannot pass on nothing, driven through the command lines: an engine that breaks
while its worker sets it up, an engine the user named that cannot run, and parity rows that must
fail or stay unverified. The broken engines are the reference engine with a fault put in on
purpose (tests/plugins/broken_engines.py), registered for the run through INFER_BENCH_ENGINES,
never in the product's registry."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.core.paths import REPO_ROOT
from harness.core.results import read_rows

PLUGINS = Path(__file__).parent / "plugins"
BROKEN = ("shifted=broken_engines:ChunkedShiftedBlockReads,cannot_score=broken_engines:CannotScore,"
          "scores_too_few=broken_engines:ScoresTooFew,setup_raises=broken_engines:SetupRaises")
QUICK = ["workload.batch_sizes=[1]", "workload.prompt_lens=[16]", "workload.output_len=4", "workload.warmup=1",
         "workload.min_repeats=1", "workload.min_duration_s=0", "roofline=false", "quiet=true"]


def infer_bench(tmp_path: Path, ckpt: Path, *args: str, env: dict | None = None) -> tuple[int, list[dict], str]:
    out = tmp_path / "run"
    environ = dict(os.environ, INFER_BENCH_ENGINES=BROKEN,
                   PYTHONPATH=os.pathsep.join([str(PLUGINS), str(REPO_ROOT)]), **(env or {}))
    r = subprocess.run([sys.executable, "-m", "harness.cli", "model=local", f"model.path={ckpt}", *args,
                        f"hydra.run.dir={out}"], capture_output=True, text=True, timeout=600, env=environ)
    rows = read_rows(out / "results.jsonl") if (out / "results.jsonl").exists() else []
    return r.returncode, rows, r.stdout + r.stderr


def test_an_engine_that_raises_while_its_worker_sets_up_fails_the_run(tmp_path, tiny_ckpt):
    # used to be an `unavailable` row without a point, and exit 0
    code, rows, out = infer_bench(tmp_path, tiny_ckpt, "engines=[setup_raises]", "parity=false", *QUICK)
    assert code == 1, out
    (row,) = rows
    assert row["status"] == "failed" and row["point_key"], row
    assert "RuntimeError: version() is broken" in row["error"]
    assert "exit 1: 1 point failed (setup_raises)" in out


@pytest.mark.skipif(not shutil.which("python3"), reason="needs a bare python3 to make an environment without psutil")
def test_a_named_engine_that_is_unavailable_fails_the_run(tmp_path, tiny_ckpt):
    # an environment without the engine's packages (here: a bare venv, no psutil, no torch) used to
    # measure nothing and exit 0
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    code, rows, out = infer_bench(tmp_path, tiny_ckpt, "engines=[hf]", f"engine_options.hf.python={bare}/bin/python",
                                  "parity=false", *QUICK)
    assert code == 1, out
    assert [r["status"] for r in rows] == ["unavailable"]
    assert "hf was named in engines= and is unavailable" in out and "is missing there" in out


@pytest.mark.skipif(not shutil.which("python3"), reason="needs a bare python3 to make an environment without psutil")
def test_a_parallel_multirun_fails_when_its_jobs_fail(tmp_path, tiny_ckpt):
    # joblib runs the jobs in other processes, whose exit codes used to be lost: each job said
    # "exit 1" (hf named and unavailable) and the multirun exited 0
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    sweep = tmp_path / "sweep"
    quick = [q for q in QUICK if not q.startswith("workload.batch_sizes=")]
    r = subprocess.run([sys.executable, "-m", "harness.cli", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                        "model=local", f"model.path={tiny_ckpt}", "engines=[hf]", f"engine_options.hf.python={bare}/bin/python",
                        "parity=false", "workload.batch_sizes=[1],[2]", *quick, f"hydra.sweep.dir={sweep}"],
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert out.count("hf was named in engines= and is unavailable") == 2, out
    assert r.returncode == 1, out


def test_a_parallel_multirun_whose_jobs_wrote_no_rows_keeps_their_exit_code(tmp_path):
    # each job refuses its input (resume= names another directory) and writes no results: the
    # multirun's end used to stop at "no results" before reading the jobs' codes, and exit 0
    r = subprocess.run([sys.executable, "-m", "harness.cli", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                        "engines=[reference]", "model=tiny", "workload.batch_sizes=[1],[2]", *QUICK[1:],
                        f"+resume={tmp_path / 'elsewhere'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert out.count("this run writes to") == 2 and "no results.jsonl" in out, out
    assert r.returncode == 2, out


@pytest.mark.slow
def test_parity_fails_a_broken_engine_through_the_workload(tmp_path, tiny_ckpt):
    # the bug-injection tests call the comparison functions directly; this drives Parity.finalize_row
    code, rows, out = infer_bench(tmp_path, tiny_ckpt, "engines=[reference,shifted,scores_too_few]",
                                  "workload=parity", "dtype=float32", "quiet=true", "roofline=false")
    assert code == 1, out
    by = {r["engine"]: r for r in rows}
    assert by["reference"]["status"] == "ok" and by["reference"]["positions_compared"] == by["reference"]["positions_expected"]
    assert by["shifted"]["status"] == "failed", by["shifted"]
    short = by["scores_too_few"]
    assert short["status"] == "failed" and short["positions_compared"] == short["positions_expected"] // 2
    assert f"compared {short['positions_compared']} of the {short['positions_expected']} positions" in short["error"]


@pytest.mark.slow
def test_an_engine_parity_cannot_score_is_unverified_in_bfloat16(tmp_path, tiny_ckpt):
    # greedy agreement alone decides nothing in bfloat16: such a row used to say ok
    code, rows, out = infer_bench(tmp_path, tiny_ckpt, "engines=[reference,cannot_score]", "workload=parity",
                                  "dtype=bfloat16", "quiet=true", "roofline=false")
    by = {r["engine"]: r for r in rows}
    assert by["cannot_score"]["status"] == "unverified", by["cannot_score"]
    assert "decides nothing" in by["cannot_score"]["error"]
    assert code == 1, out
    assert "UNVERIFIED" in out and "cannot_score: parity unverified" in out  # the summary and the exit reason
    assert "1 parity row(s) unverified" in (tmp_path / "run" / "report.html").read_text()  # and the report


def _plan(*overrides: str):
    from harness.cli import compose_job
    from harness.config import build_plan
    return build_plan(compose_job(["model=tiny", "workload.batch_sizes=[1]", "workload.prompt_lens=[16]",
                                   "workload.output_len=4", *overrides]))


def test_vllm_finds_its_own_environment_by_default(tmp_path, monkeypatch):
    # `engines=[vllm]` after `make demo` said "vLLM is not installed" although .venv-vllm was there
    fake = tmp_path / ".venv-vllm" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.delenv("INFER_BENCH_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("harness.config.REPO_ROOT", tmp_path)
    plan = _plan("engines=[reference,vllm]")
    assert plan.engine_envs["vllm"].python == str(fake) and "vllm" not in plan.unavailable
    monkeypatch.setenv("INFER_BENCH_VLLM_PYTHON", sys.executable)  # the variable wins
    assert _plan("engines=[reference,vllm]").engine_envs["vllm"].python == sys.executable


def test_vllm_not_found_says_where_it_looked(tmp_path, monkeypatch):
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this interpreter: the not-found message cannot appear")
    monkeypatch.delenv("INFER_BENCH_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("harness.config.REPO_ROOT", tmp_path)
    why = _plan("engines=[reference,vllm]").unavailable["vllm"]
    assert str(tmp_path / ".venv-vllm" / "bin" / "python") in why and "engine_options.vllm.python=PATH" in why


def test_an_endpoint_without_token_ids_is_unverified_not_failed():
    # trtllm-serve streams text with token id -1: greedy agreement would "fail" for the wrong reason
    from workloads.parity import Parity
    point = {"prompt_lens": [4, 4], "tokens": 3, "top_k": 8}
    base = {"workload": "parity", "engine": "reference", "status": "ok", "dtype": "float32", "point": point,
            "parity_tokens": [[1, 2, 3], [4, 5, 6]], "parity_scores": None}
    Parity().finalize_row(base, [])
    row = {"workload": "parity", "engine": "trtllm-serve", "status": "ok", "dtype": "float32", "point": point,
           "parity_tokens": [[-1, -1, -1], [-1, -1, -1]], "parity_scores": None}
    Parity().finalize_row(row, [base])
    assert row["status"] == "unverified" and "no token ids" in row["error"], row
    short = {**row, "status": "ok", "parity_tokens": [[1, 2, 3], [4, 5]]}  # a real shortfall still fails
    Parity().finalize_row(short, [base])
    assert short["status"] == "failed" and "compared 5 of the 6 positions" in short["error"], short

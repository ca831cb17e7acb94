"""workload=speculative end to end through the CLI, on the real engines that speculate: every
speculative row verified lossless against the same engine without speculation, every field
documented, the exit code 0, and the accepted-token counts per request compared across engines
at batch 1. An engine that cannot speculate here is skipped with the reason; the whole grid is
behind the `heavy` marker (make test-heavy)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from adapters import engine_class
from harness.core.results import read_rows
from harness.core.specdecode import accepted_agreement
from tests_support import documented_fields, vllm_python

REPO = Path(__file__).resolve().parent.parent


def speculating(engine: str) -> str | None:
    """Why `engine` cannot run the speculative grid here (None: it can)."""
    cls = engine_class(engine)
    why = cls.unavailable_reason() if engine != "vllm" else (None if vllm_python() else "no vLLM environment")
    if why:
        return why
    if not cls.capabilities({}).speculative_methods:
        return f"{engine} declares no speculative method (Capabilities.speculative_methods)"
    return None


def run_grid(tmp_path: Path, engines: list[str], *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "harness.cli", f"engines=[{','.join(engines)}]", "model=tiny-trained",
           "workload=speculative", "parity=false", "quiet=true", f"hydra.run.dir={out}", *extra]
    if "vllm" in engines:
        cmd.append(f"engine_options.vllm.python={vllm_python()}")
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    return r, read_rows(out / "results.jsonl") if (out / "results.jsonl").exists() else []


def check_rows(rows: list[dict], engine: str) -> None:
    doc = documented_fields()
    mine = [r for r in rows if r["engine"] == engine and r["workload"] == "speculative"]
    assert mine, f"no row of {engine}"
    for r in mine:
        assert not set(r) - doc, f"undocumented fields {sorted(set(r) - doc)}"
        assert r["status"] in ("ok", "skipped"), (r["point"], r.get("error"))
    spec = [r for r in mine if r["point"]["method"] != "none" and r["status"] == "ok"]
    assert spec, f"{engine}: no speculative point ran"
    for r in spec:
        assert r["lossless"] == "pass" and r["lossless_tokens"] == r["completed"] * r["output_len"], r["lossless_detail"]
        assert r["speedup"] > 0 and r["mean_acceptance_length"] >= 1 and r["spec_drafts"] > 0
        assert len(r["acceptance_per_pos"]) == r["k"]


@pytest.mark.heavy  # CI time: test_grid_on_every_engine_and_accepted_counts_agree runs a grid on it
def test_reference_engine_small_grid(tmp_path):
    why = speculating("reference")
    if why:
        pytest.skip(why)
    r, rows = run_grid(tmp_path, ["reference"], "workload.num_speculative_tokens=[2]", "workload.batch_sizes=[1,2]",
                       "workload.contents=[code,random]", "workload.prompt_len=48", "workload.output_len=12",
                       "workload.min_requests=3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_rows(rows, "reference")
    assert "lossless: 8 speculative point(s) token-for-token identical" in r.stdout


@pytest.mark.heavy
def test_grid_on_every_engine_and_accepted_counts_agree(tmp_path):
    engines = [e for e in ("reference", "hf", "vllm") if speculating(e) is None]
    missing = {e: speculating(e) for e in ("reference", "hf", "vllm") if speculating(e)}
    if len(engines) < 2:
        pytest.skip(f"fewer than two engines speculate here: {missing}")
    r, rows = run_grid(tmp_path, engines, "workload.num_speculative_tokens=[2,4]", "workload.batch_sizes=[1,4]",
                       "workload.prompt_len=64", "workload.output_len=24", "workload.min_requests=4")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for e in engines:
        check_rows(rows, e)
    groups = [g for g in accepted_agreement(rows) if g["method"] == "draft"]
    assert groups and all(len(g["engines"]) == len(engines) for g in groups)
    assert all(g["identical_share"] == 1.0 for g in groups), groups

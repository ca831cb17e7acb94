"""Equal resources by default: every engine's worker is pinned to the same cores and
uses as many compute threads; rows record it; one run directory, one writer; memory reported as
reserved vs used."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from harness.config import resolve_cpus
from harness.core.results import read_rows

BASE = ["model=tiny", "quiet=true", "roofline=false", "parity=false", "workload.batch_sizes=[2]",
        "workload.prompt_lens=[16]", "workload.output_len=3", "workload.min_repeats=1", "workload.warmup=1",
        "workload.min_duration_s=0"]
ALLOWED = sorted(os.sched_getaffinity(0))


def run(args, cache, **kw):
    env = {**os.environ, "INFER_BENCH_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600, **kw)


@pytest.fixture(scope="module")
def cache(tiny_ckpt, model_cache):
    return model_cache.parent


def test_cpus_setting_resolves_and_refuses_what_is_not_there():
    problems: list[str] = []
    assert resolve_cpus("all", problems) == ALLOWED
    assert resolve_cpus(1, problems) == ALLOWED[:1]
    assert resolve_cpus([ALLOWED[-1]], problems) == [ALLOWED[-1]]
    assert problems == []
    resolve_cpus(len(ALLOWED) + 1, problems)
    resolve_cpus([10_000], problems)
    resolve_cpus("half", problems)
    assert len(problems) == 3 and all(p.startswith("cpus=") for p in problems)
    assert "10000" in problems[1]


@pytest.mark.slow
def test_every_engine_gets_the_same_cores_and_threads_and_rows_say_so(cache, tmp_path):
    out = tmp_path / "run"
    r = run(["engines=[reference,hf]", "cpus=1", *BASE, f"hydra.run.dir={out}"], cache)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [x for x in read_rows(out / "results.jsonl") if x["workload"] == "sweep"]
    assert {x["engine"] for x in rows} == {"reference", "hf"}
    for x in rows:
        assert x["cpu_affinity"] == ALLOWED[:1], x["engine"]   # the worker was pinned to it
        assert x["compute_threads"] == 1, x["engine"]          # and the engine used one thread
    default = tmp_path / "default"
    r = run(["engines=[hf]", *BASE, f"hydra.run.dir={default}"], cache)
    (row,) = [x for x in read_rows(default / "results.jsonl") if x["workload"] == "sweep"]
    assert row["cpu_affinity"] == ALLOWED and row["compute_threads"] == len(ALLOWED)


@pytest.mark.slow
def test_memory_columns_keep_a_reserved_pool_apart(cache, tmp_path):
    out = tmp_path / "run"
    r = run(["engines=[reference,hf]", *BASE, f"hydra.run.dir={out}"], cache)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {x["engine"]: x for x in read_rows(out / "results.jsonl") if x["workload"] == "sweep"}
    ref, hf = rows["reference"], rows["hf"]
    assert ref["kv_reserved_bytes"] == ref["kv_info"]["pool_bytes"] > 0  # the pool, whatever is in use
    assert 0 < ref["kv_used_bytes"] < ref["kv_reserved_bytes"]
    assert ref["kv_used_bytes"] == ref["kv_info"]["blocks_in_use"] * ref["kv_info"]["bytes_per_block"]
    assert hf["kv_reserved_bytes"] is None and hf["kv_used_bytes"] > 0  # transformers allocates as it goes
    assert "KV rsv MiB" in r.stdout and "KV used MiB" in r.stdout and "proc peak MiB" in r.stdout
    assert "reference reserves a KV pool up front" in r.stdout


@pytest.mark.slow
def test_a_second_run_into_a_live_run_directory_stops_and_a_stale_lock_is_taken_over(cache, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "INFER_BENCH_CACHE": str(cache)}
    first = subprocess.Popen([sys.executable, "-m", "harness.cli", "engines=[hf]", *BASE,
                              "workload.min_duration_s=20", f"hydra.run.dir={out}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(600):  # until the first run holds the lock
            if (out / ".infer-bench.lock").exists() and (out / ".infer-bench.lock").read_text():
                break
            time.sleep(0.1)
        second = run(["engines=[hf]", *BASE, f"+resume={out}", f"hydra.run.dir={out}"], cache)
        assert second.returncode == 2
        assert f"process {first.pid}" in second.stderr and "writing into this run directory" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.kill()
        first.communicate()
    # the holder is gone (killed): its lock is stale and the next run takes it over
    third = run(["engines=[hf]", *BASE, f"+resume={out}", f"hydra.run.dir={out}"], cache)
    assert third.returncode == 0, third.stderr[-2000:]

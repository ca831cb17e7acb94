"""infer-bench-ab --method blocks (harness.ab_blocks): its statistic on synthetic pairs with known
effects, its fail-closed rules, and real worker processes that cannot start or serve a block
(the end-to-end timing checks are in test_ab_e2e.py)."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from harness.ab import block_results, overall
from harness.ab_blocks import BlockWorker, interleave, trimmed_ci, worker_command
from harness.core.paths import REPO_ROOT

B1 = 'sweep:{"batch_size":1,"output_len":16,"prompt_len":32}'
B8 = 'sweep:{"batch_size":8,"output_len":16,"prompt_len":32}'


def synthetic(effect: float, seed: int, n: int = 120, outliers: float = 0.1) -> dict:
    """Pairs like a busy 2-core machine's: per pair a common speed (both blocks of a pair see the
    same second), 4 % per-block noise, and a share of pairs one side of which a burst of
    contention slowed 1.3-2x; the candidate `effect` times slower."""
    rng = np.random.default_rng(seed)
    out = {}
    for key in (B1, B8):
        metrics = {}
        for m in ("decode_step_latency_s", "block_cpu_s", "prefill_latency_s"):
            speed = rng.lognormal(0, 0.2, n)
            a = 0.005 * speed * rng.lognormal(0, 0.04, n)
            b = 0.005 * effect * speed * rng.lognormal(0, 0.04, n)
            hit = rng.random(n) < outliers
            burst = rng.uniform(1.3, 2.0, n)
            side = rng.random(n) < 0.5
            a = np.where(hit & side, a * burst, a)
            b = np.where(hit & ~side, b * burst, b)
            metrics[m] = list(zip(a.tolist(), b.tolist()))
        out[key] = metrics
    return out


def test_trimmed_ci_matches_a_hand_computed_yuen_interval():
    x = np.array([0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 1.0])  # one wild pair
    tm, lo, hi = trimmed_ci(x, 0.95, trim=0.2)
    # g = 2: mean of x[2:8]; winsorized: [.02,.02,.02,...,.07,.07,.07]
    assert tm == pytest.approx(0.045)
    w = np.array([0.02, 0.02, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.07, 0.07])
    from scipy import stats
    se = math.sqrt(w.var(ddof=1) * 9 / (6 * 5))
    assert hi - tm == pytest.approx(stats.t.ppf(0.975, 5) * se)
    assert lo < tm < hi < 0.1  # the wild pair does not drag it
    assert trimmed_ci([0.1, 0.2], 0.95) is None


def test_same_code_under_bursty_noise_is_unchanged_over_many_jobs():
    flagged = 0
    for seed in range(100):
        res = block_results(synthetic(1.0, seed), 0.025)
        flagged += overall(res, [])[0] != "unchanged"
    assert flagged == 0


def test_a_5_percent_slowdown_is_regressed_under_the_same_noise():
    hits = 0
    for seed in range(50):
        res = block_results(synthetic(1.05, 1000 + seed), 0.025)
        hits += overall(res, [])[0] == "regressed"
        dec = [r for r in res if r.metric == "decode_step_latency_s"]
        assert all(1.02 < r.ratio < 1.08 for r in dec)
    assert hits >= 48


def test_prefill_alone_beyond_the_threshold_is_shown_but_not_decisive():
    data = synthetic(1.0, 7)
    for key in (B1, B8):
        data[key]["prefill_latency_s"] = [(a, b * 1.3) for a, b in data[key]["prefill_latency_s"]]
    res = block_results(data, 0.025)
    pre = [r for r in res if r.metric == "prefill_latency_s"]
    assert all(r.verdict == "regressed" and not r.decisive for r in pre)
    assert overall(res, [])[0] == "unchanged"


def test_a_decisive_improvement_is_improved_and_prefill_alone_is_not():
    res = block_results(synthetic(0.93, 21), 0.025)  # the candidate 7 % faster in every metric
    assert {r.verdict for r in res if r.metric == "block_cpu_s"} == {"improved"}
    assert overall(res, [])[0] == "improved"
    data = synthetic(1.0, 7)
    for key in (B1, B8):
        data[key]["prefill_latency_s"] = [(a, b * 0.7) for a, b in data[key]["prefill_latency_s"]]
    res = block_results(data, 0.025)
    assert {r.verdict for r in res if r.metric == "prefill_latency_s"} == {"improved"}
    assert overall(res, [])[0] == "unchanged"


def test_the_wall_clock_step_decides_at_four_times_the_threshold():
    """The worker's CPU time decides at the threshold; the wall-clock decode step (where a
    regression that waits rather than computes shows) only beyond 4x it."""
    def wall_only(slower: float) -> list:
        data = synthetic(1.0, 11)
        for key in (B1, B8):
            data[key]["decode_step_latency_s"] = [(a, b * slower) for a, b in data[key]["decode_step_latency_s"]]
        return block_results(data, 0.025)
    res = wall_only(1.06)  # beyond 2.5 %, inside 10 %: the CPU time says unchanged
    assert {r.verdict for r in res if r.metric == "decode_step_latency_s"} == {"unchanged"}
    assert all("threshold 10.0%" in r.note for r in res if r.metric == "decode_step_latency_s")
    assert overall(res, [])[0] == "unchanged"
    res = wall_only(1.3)  # a step that sleeps 30 % longer: no CPU time, still REGRESSED
    assert {r.verdict for r in res if r.metric == "decode_step_latency_s"} == {"regressed"}
    assert {r.verdict for r in res if r.metric == "block_cpu_s"} == {"unchanged"}
    assert overall(res, [])[0] == "regressed"


def _main_thread_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def test_cpu_ns_counts_every_thread_of_the_worker():
    """A worker whose main thread waits while another thread computes has used CPU time."""
    import subprocess
    import time
    from harness.ab_blocks import cpu_ns
    code = ("import threading, time\n"
            "def spin():\n    t = time.time()\n    while time.time() - t < 30: pass\n"
            "threading.Thread(target=spin, daemon=True).start()\nprint('go', flush=True)\ntime.sleep(30)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "go"
        c0, m0 = cpu_ns(p.pid), _main_thread_ns(p.pid)
        deadline = time.monotonic() + 20  # however busy the machine, the spinner gets 0.3 s of CPU
        while cpu_ns(p.pid) - c0 < 0.3e9 and time.monotonic() < deadline:
            time.sleep(0.1)
        c1, m1 = cpu_ns(p.pid), _main_thread_ns(p.pid)
    finally:
        p.kill()
        p.wait()
    assert c0 is not None and c1 - c0 >= 0.3e9  # the spinning thread's time is counted
    assert m1 - m0 < 0.1e9  # while the main thread alone slept through it
    assert cpu_ns(p.pid) is None  # a worker that is gone says nothing


def test_a_missing_block_value_or_too_few_pairs_fails_closed():
    data = synthetic(1.0, 8)
    pairs = data[B8]["prefill_latency_s"]
    pairs[5] = (pairs[5][0], None)  # the candidate's block failed once: not a pass, even on a non-decisive metric
    data[B1]["decode_step_latency_s"] = data[B1]["decode_step_latency_s"][:2]
    res = {(r.point, r.metric): r for r in block_results(data, 0.025)}
    assert res[(B8, "prefill_latency_s")].verdict == "failed" and "pair 6 of 120" in res[(B8, "prefill_latency_s")].note
    assert res[(B1, "decode_step_latency_s")].verdict == "failed" and "too few" in res[(B1, "decode_step_latency_s")].note
    verdict, why = overall(list(res.values()), [])
    assert verdict == "failed" and len(why) == 2


def test_nothing_compared_is_failed():
    assert overall(block_results({}, 0.025), [])[0] == "failed"
    empty = {B1: {"decode_step_latency_s": []}}
    assert overall(block_results(empty, 0.025), [])[0] == "failed"


# ---- real worker processes ----------------------------------------------------------------------

POINT = {"workload": "sweep", "params": {"batch_size": 1, "prompt_len": 8, "output_len": 4}}


def test_a_worker_that_dies_at_start_fails_the_job(tmp_path):
    dead = BlockWorker("candidate", [sys.executable, "-c", "import sys; sys.exit(3)"], {}, tmp_path / "c.log")
    base = BlockWorker("baseline", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "b.log")
    try:
        out = interleave([base], [dead], [POINT], ["k"], 5, 1, timeout_s=5, say=None)
    finally:
        for w in (base, dead):
            w.stop()
    assert out.failure and "candidate's worker ended while answering the handshake (exit 3)" in out.failure
    assert not out.pairs["k"]["decode_step_latency_s"]  # nothing measured to compare


def test_an_engine_that_cannot_be_set_up_fails_the_job(tmp_path):
    # the real harness.worker of this tree, given a job naming no engine it knows: Ready, then
    # SetupFailed. The job must fail, not compare the baseline with nothing.
    job = {"engine": "no-such-engine", "endpoint": None, "options": {}, "model_spec": {"path": "x", "name": "x"},
           "context": {}, "workloads": {}}
    w = BlockWorker("candidate", worker_command(sys.executable, REPO_ROOT), job, tmp_path / "c.log")
    try:
        w.start(60)
        got = w.block(POINT, 60)
    finally:
        w.stop()
    assert isinstance(got, str) and w.failure == got
    assert "candidate's engine could not be set up" in got and "no-such-engine" in got


def test_the_worker_runs_the_named_tree_or_refuses(tmp_path):
    # a tree without harness/: the worker must not fall back to another installation
    w = BlockWorker("baseline", worker_command(sys.executable, tmp_path), {}, tmp_path / "b.log")
    try:
        w.start(30)
    finally:
        w.stop()
    assert w.failure and "ended while answering the handshake" in w.failure
    assert "not from" in (tmp_path / "b.log").read_text() or "No module named" in (tmp_path / "b.log").read_text()


def test_a_block_job_sends_only_the_options_the_run_sets():
    """The baseline is an older tree: an option added since, left at its default (null), must not
    reach it (the LoRA options made every baseline worker of CI's gate refuse its job: 'unknown
    option', nothing compared); an option the run sets is sent to both sides."""
    from harness.ab_blocks import set_options
    from adapters.reference.config import EngineConfig
    import dataclasses
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    sent = set_options({**defaults, "max_loras": None, "num_threads": 1})
    assert "lora_adapters" not in sent and "max_loras" not in sent and sent["num_threads"] == 1
    assert sent["block_size"] == defaults["block_size"] and sent["prefix_caching"] is True
    assert EngineConfig(**sent) == EngineConfig(**{**defaults, "num_threads": 1})  # what the engine fills is the same

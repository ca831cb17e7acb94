"""Timing comparisons end to end, the only way this project makes them: baseline and candidate
interleaved on this machine (infer-bench-ab), paired per round. The same code twice is unchanged;
the reference engine with a real handicap (its KV cache switched off) is regressed. And
infer-bench-compare's same-machine path on real runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from harness.core.paths import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.alone,  # it times engines and checks the repository's worktrees
              pytest.mark.skipif(shutil.which("git") is None or not (REPO_ROOT / ".git").exists(),
                                 reason="infer-bench-ab checks commits out of a git repository; this is not one")]

CONFIG = ["engines=[reference]", "model=local", "dtype=float32", "workload.batch_sizes=[8]",
          "workload.prompt_lens=[128]", "workload.output_len=32", "workload.min_repeats=6",
          "workload.min_duration_s=0.5", "engine_options.reference.num_threads=1"]


# The handicapped side is slow (no KV cache: every decode step recomputes the whole sequence, about
# 18x the step at batch 8): fewer steps and repeats keep each of its runs to seconds, and the
# handicap still dwarfs the threshold.
HANDICAP_CONFIG = [*CONFIG, "workload.output_len=8", "workload.min_repeats=3"]


def ab(out, ckpt, *extra, cwd=None, config=CONFIG):
    r = subprocess.run([sys.executable, "-m", "harness.ab", "--baseline-ref", "HEAD", "--candidate-ref", "HEAD",
                        "--rounds", "3", "--threshold", "10%", "--out", str(out), *extra, "--", *config,
                        f"model.path={ckpt}"], capture_output=True, text=True, timeout=1200, cwd=cwd,
                       env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert r.returncode in (0, 1), r.stderr[-3000:]
    return r.returncode, json.loads(((cwd or REPO_ROOT) / out / "ab.json").read_text()), r.stdout


@pytest.mark.heavy  # CI time (docs/platform.md, "CI time"): CI's own regression gate runs unchanged code through infer-bench-ab on every stop
def test_same_code_twice_is_unchanged(tmp_path, tiny_ckpt):
    # a relative --out, as ci/regression_gate.sh passes it: each side runs inside its own worktree,
    # and the runs must still land under the caller's directory
    code, doc, out = ab("aa", tiny_ckpt, cwd=tmp_path)
    assert code == 0, out
    assert doc["verdict"] == "unchanged" and {r["verdict"] for r in doc["results"]} == {"unchanged"}
    assert {r["metric"] for r in doc["results"]} == {"decode_step_latency_s", "prefill_latency_s", "output_tok_s"}
    assert all(len(r["round_ratios"]) == 3 for r in doc["results"])


@pytest.mark.heavy  # CI time (docs/platform.md, "CI time"): the block method's regression test below stays in CI, and it is the gate's method
def test_reference_without_kv_cache_is_regressed(tmp_path, tiny_ckpt):
    code, doc, out = ab(tmp_path / "handicap", tiny_ckpt, "--candidate-override",
                        "engine_options.reference.kv_cache=none", config=HANDICAP_CONFIG)
    assert code == 1, out
    verdicts = {r["metric"]: r["verdict"] for r in doc["results"]}
    assert verdicts["decode_step_latency_s"] == "regressed"
    assert verdicts["output_tok_s"] == "regressed"
    assert "REGRESSED" in out


BLOCKS = ["--method", "blocks", "--pairs", "20", "--warmup-blocks", "1"]
BLOCK_CONFIG = [*CONFIG[:3], "workload.batch_sizes=[1,8]", "workload.prompt_lens=[32]", "workload.output_len=8",
                "engine_options.reference.num_threads=1"]


@pytest.mark.heavy  # CI time (docs/platform.md, "CI time"): CI's own regression gate is this method on this engine
def test_blocks_same_code_twice_is_unchanged(tmp_path, tiny_ckpt):
    code, doc, out = ab(tmp_path / "aa", tiny_ckpt, *BLOCKS, config=BLOCK_CONFIG)
    assert code == 0, out
    assert doc["verdict"] == "unchanged" and doc["pairs"] == 20
    assert {(r["metric"], r["decisive"]) for r in doc["results"]} == {
        ("decode_step_latency_s", True), ("block_cpu_s", True), ("prefill_latency_s", False)}
    assert len(doc["results"]) == 6 and all(0.85 < r["ratio"] < 1.15 for r in doc["results"])
    blocks = json.loads((tmp_path / "aa" / "blocks.json").read_text())
    assert all(len(v) == 20 for m in blocks["pairs"].values() for v in m.values())


def test_blocks_reference_without_kv_cache_is_regressed(tmp_path, tiny_ckpt):
    code, doc, out = ab(tmp_path / "handicap", tiny_ckpt, *BLOCKS, "--candidate-override",
                        "engine_options.reference.kv_cache=none", config=BLOCK_CONFIG)
    assert code == 1, out
    assert doc["verdict"] == "regressed" and "REGRESSED" in out
    assert {r["verdict"] for r in doc["results"] if r["metric"] in ("decode_step_latency_s", "block_cpu_s")} == {"regressed"}


def test_compare_on_one_machine_matches_a_run_with_itself(tmp_path, tiny_ckpt):
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "harness.cli", *CONFIG, f"model.path={tiny_ckpt}",
                        "workload.min_repeats=3", "parity=false", "roofline=false", "quiet=true",
                        f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "harness.compare_cli", "--baseline", str(run_dir), "--current",
                        str(run_dir), "--json", str(tmp_path / "v.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["machines"] == "same machine" and doc["verdict"] == "unchanged"
    assert all(c["ratio"] == pytest.approx(1.0) for c in doc["comparisons"] if c["ratio"] is not None)


@pytest.mark.parametrize("method, config, child", [
    ([], CONFIG, "harness.cli"),  # whole runs: a side's infer-bench run under way
    (BLOCKS, BLOCK_CONFIG, "harness.worker"),  # blocks: the engine workers alive
], ids=["runs", "blocks"])
def test_a_terminated_job_leaves_no_worktree_and_no_process(tmp_path, tiny_ckpt, method, config, child):
    import signal
    import time

    import psutil

    def worktrees():
        out = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
                             text=True).stdout
        return {line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("worktree ")}

    before = worktrees()
    p = subprocess.Popen([sys.executable, "-m", "harness.ab", "--baseline-ref", "HEAD", "--candidate-ref", "HEAD",
                          "--rounds", "3", "--out", str(tmp_path / "ab"), *method, "--", *config,
                          f"model.path={tiny_ckpt}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    deadline = time.monotonic() + 300
    children: list = []
    while time.monotonic() < deadline and not children:  # until a side's run is under way
        time.sleep(0.5)
        children = [c for c in psutil.Process(p.pid).children(recursive=True) if child in " ".join(c.cmdline())]
    assert children, "no infer-bench run started"
    # this job's worktrees only: other worktrees of the repository may come and go meanwhile
    added = {w for w in worktrees() - before if "infer-bench-ab-" in w}
    assert added, "the job made no worktree"
    time.sleep(3)  # the run has its engine worker by now
    children = psutil.Process(p.pid).children(recursive=True)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    assert "interrupted" in err
    assert not added & worktrees()
    assert not any(w.exists() for w in map(__import__("pathlib").Path, added))
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left behind: {[(c.pid, c.cmdline()) for c in alive]}"

"""LoRA adapters served by the engines, through the whole command line: a mixed-adapter serving
point whose every request is checked against the same prompt with the same adapter served alone,
and an engine made to serve one request with the wrong adapter (tests/plugins/broken_engines.py,
registered for the run through INFER_BENCH_ENGINES) failing its row, naming the request."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.core.paths import REPO_ROOT
from harness.core.results import read_rows
from harness.lora_cli import main as lora_main

PLUGINS = Path(__file__).parent / "plugins"
NAMES = ("lora0", "lora1", "lora2", "lora3")
QUICK = ["model=tiny-trained", "workload=serving", "workload.request_rates=[]", "workload.num_requests=12",
         "workload.input_len=24", "workload.output_len=6", "workload.warmup_requests=1", "parity=false", "roofline=false"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("adapters")
    # strong adapters: each must change the 6-token output of every request it serves, or the outputs
    # check is (rightly) unverified; at the default strength a rare adapter of the Zipf split, one request
    # of 12, sometimes left its output as the base model's (the point key, and so the prompts and the
    # split, follow the adapters' temporary paths)
    assert lora_main(["make", "--model", "tiny-trained", "--out", str(out), "--count", "4", "--strength", "8"]) == 0
    return out


def run(tmp_path: Path, adapters: Path, *args: str) -> tuple[int, list[dict], str]:
    out = tmp_path / "run"
    env = dict(os.environ, INFER_BENCH_ENGINES="wrong_adapter=broken_engines:WrongAdapter",
               PYTHONPATH=os.pathsep.join([str(PLUGINS), str(REPO_ROOT)]))
    arg = "workload.lora.adapters={" + ",".join(f"{n}:{adapters / n}" for n in NAMES) + "}"
    r = subprocess.run([sys.executable, "-m", "harness.cli", *QUICK, arg, *args, f"hydra.run.dir={out}"],
                       capture_output=True, text=True, timeout=900, env=env)
    rows = read_rows(out / "results.jsonl") if (out / "results.jsonl").exists() else []
    return r.returncode, rows, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "reference"])
def test_an_engine_serves_mixed_adapters_and_every_request_is_its_own_adapters(tmp_path, adapters, engine):
    code, rows, out = run(tmp_path, adapters, f"engines=[{engine}]", "workload.concurrency=[4]",
                          "workload.lora.split=zipf", "workload.lora.zipf_alpha=1.5")
    assert code == 0, out[-3000:]
    (row,) = rows
    assert row["status"] == "ok" and row["lora_check"]["verdict"] == "pass", row.get("error")
    assert row["lora_check"]["compared"] == 12 and row["lora_split_test"]["ok"]
    assert row["good_requests"] == row["lora_check"]["passed"] == 12 and row["good_verdict"] == "LoRA outputs check"
    per = {a["adapter"]: a for a in row["lora_per_adapter"]}
    assert list(per) == ["base", *NAMES] and sum(a["requests"] for a in per.values()) == 12
    assert all(a["ttft_s_p50"] is not None for a in per.values() if a["completed"])
    changed = row["lora_check"]["per_adapter"]
    assert all(v["changed"] == v["requests"] for e, v in changed.items() if e != "base")  # each adapter changes output
    assert "outputs check: PASS" in out and "lora0" in out
    from tests_support import documented_fields
    assert not set(row) - documented_fields()


@pytest.mark.slow
def test_a_request_served_with_the_wrong_adapter_fails_the_row_naming_it(tmp_path, adapters):
    code, rows, out = run(tmp_path, adapters, "engines=[wrong_adapter]", "workload.concurrency=[4]",
                          "workload.lora.split=round_robin")
    assert code == 1, out[-3000:]
    (row,) = rows
    assert row["status"] == "failed", row
    m = row["lora_check"]["mismatch"]
    assert m["request"] in row["request_adapter"] and m["adapter"] == row["request_adapter"][m["request"]] != "base"
    assert f"request {m['request']} (adapter {m['adapter']}): token {m['position']}" in row["error"]
    assert m["got"] != m["expected"] and m["got"] == m["base_alone"]  # the fault: served by the base model
    # only the requests equal to their alone outputs are good tokens of a cost (harness.core.cost)
    assert row["good_requests"] == row["lora_check"]["passed"] < row["lora_check"]["compared"]


@pytest.mark.slow
def test_a_conversation_keeps_each_sessions_adapter_for_every_turn(tmp_path, adapters):
    from tests_support import documented_fields
    out = tmp_path / "run"
    arg = "workload.lora.adapters={" + ",".join(f"{n}:{adapters / n}" for n in NAMES[:2]) + "}"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "model=tiny-trained", "engines=[hf]", "workload=conversation",
                        "workload.sessions=6", "workload.turns=2", "workload.user_tokens=8", "workload.output_tokens=3",
                        "workload.prefix_caching=[false]", "parity=false", "roofline=false", arg,
                        f"hydra.run.dir={out}"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (row,) = read_rows(out / "results.jsonl")
    assert row["lora_split_unit"] == "session" and sum(row["lora_sent"].values()) == 6 and row["lora_split_test"]["ok"]
    by = row["request_adapter"]
    assert all(by[f"s{i}t1"] == by[f"s{i}t2"] for i in range(6)) and len(set(by.values())) > 1
    assert not set(row) - documented_fields()


@pytest.mark.slow
def test_the_reference_engines_swap_cost_has_its_interval_and_its_loads(tmp_path, adapters):
    """Swap points on the reference engine: one adapter, then two in round robin through one slot, one
    request at a time; the second row has the swap cost with its interval and a load (and an eviction)
    for every request whose adapter the slot did not hold; the first row none."""
    code, rows, out = run(tmp_path, adapters, "engines=[reference]", "workload.concurrency=[]", "workload.num_requests=8",
                          "workload.lora.swap_cost=[2]")
    assert code == 0, out[-3000:]
    one, two = rows
    assert (one["lora_swap"], two["lora_swap"]) == (1, 2)
    # round robin through one slot: every request but the first (its adapter stays from the warm-up) loads
    assert one["lora_stats"]["loads"] == 0 and two["lora_stats"]["loads"] >= 7 and two["lora_stats"]["evictions"] >= 7
    assert two["swap_cost_s"] is not None and two["swap_cost_pairs"] == 8 and len(two["swap_cost_ci"]) == 2
    assert "swap cost at 2 adapters" in out

"""LoRA traffic (workloads/lora.py, harness/core/lora.py): adapters read and checked against the
base model, the split configured, drawn and tested, bad input named with exit 2, and the outputs
check's verdicts. The engines serving adapters: tests/test_lora_engines.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from harness.cli import check_jobs
from harness.core.lora import (
    BASE, assign, expected_round_robin, first_difference, parse_refs, read_adapter, shape_problems, shares, split_test,
)
from harness.core.presets import load_preset
from harness.lora_cli import main as lora_main
from workloads import lora as wl_lora
from workloads.base import Point
from workloads.serving import Serving, ServingConfig


@pytest.fixture(scope="session")
def adapters(tmp_path_factory):
    """Four rank-8 adapters on q_proj/v_proj of tiny-trained (the shipped checkpoint), one of rank
    16, and one made for the `tiny` preset (other sizes), by the project's own command."""
    out = tmp_path_factory.mktemp("adapters")
    assert lora_main(["make", "--model", "tiny-trained", "--out", str(out), "--count", "4"]) == 0
    assert lora_main(["make", "--model", "tiny-trained", "--out", str(out), "--rank", "16", "--prefix", "r16_"]) == 0
    assert lora_main(["make", "--model", "tiny", "--out", str(out), "--prefix", "tiny_"]) == 0
    return out


def test_make_writes_peft_directories_whose_b_is_not_zero(adapters):
    a, shapes, problems = read_adapter("lora1", str(adapters / "lora1"), "f")
    assert problems == [] and a.rank == 8 and set(a.target_modules) == {"q_proj", "v_proj"} and a.scaling == 2.0
    from safetensors.numpy import load_file
    t = load_file(str(adapters / "lora1" / "adapter_model.safetensors"))
    b = [v for k, v in t.items() if "lora_B" in k]
    assert b and all(np.abs(v).max() > 0 for v in b)  # PEFT's own init would leave B zero
    t0 = load_file(str(adapters / "lora0" / "adapter_model.safetensors"))
    assert not all(np.array_equal(t[k], t0[k]) for k in t)  # adapter i has its own seed
    assert shape_problems(a, shapes, load_preset("tiny-trained"), "f") == []


def test_make_refuses_bad_arguments(tmp_path, capsys):
    assert lora_main(["make", "--model", "tiny-trained", "--out", str(tmp_path), "--targets", "q_proj,lm_head"]) == 2
    assert "--targets q_proj,lm_head: lm_head" in capsys.readouterr().err
    assert lora_main(["make", "--model", "gpt-17", "--out", str(tmp_path)]) == 2


def test_an_adapter_for_another_model_is_named_with_its_sizes(adapters):
    a, shapes, problems = read_adapter("t", str(adapters / "tiny_0"), "workload.lora.adapters")
    assert problems == []
    (p,) = shape_problems(a, shapes, load_preset("tiny-trained"), "workload.lora.adapters")
    assert "adapter 't'" in p and "does not fit the base model tiny-trained" in p and "lora_A" in p


def test_read_adapter_refuses_what_is_not_a_plain_peft_lora(tmp_path, adapters):
    assert "no such directory" in read_adapter("x", str(tmp_path / "nope"), "f")[2][0]
    model = load_preset("tiny-trained")
    from harness.checkpoint import shipped_checkpoint
    (why,) = read_adapter("x", str(shipped_checkpoint(model)), "f")[2]
    assert "not a PEFT adapter directory" in why and "that is a model" in why
    dora = tmp_path / "dora"
    dora.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (dora / f).write_bytes((adapters / "lora0" / f).read_bytes())
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    assert any("use_dora=true" in p for p in read_adapter("x", str(dora), "f")[2])


def test_parse_refs_takes_a_mapping_or_a_list_and_names_the_duplicate():
    assert parse_refs({"a": "/x", "b": "org/name"}, "f") == ([("a", "/x"), ("b", "org/name")], [])
    assert parse_refs([{"name": "a", "path": "/x"}, "b=/y"], "f")[0] == [("a", "/x"), ("b", "/y")]
    refs, problems = parse_refs([{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}], "f")
    assert refs == [("a", "/x")] and "adapter name 'a' is used twice" in problems[0]
    assert "names the base model" in parse_refs({"base": "/x"}, "f")[1][0]


# ---- the split ------------------------------------------------------------------------------------------------

def test_shares_zipf_uniform_weighted_and_the_base_share():
    z = shares(["a", "b", "c", "d"], "zipf", None, None, 1.5)
    assert list(z) == [BASE, "a", "b", "c", "d"] and sum(z.values()) == pytest.approx(1)
    assert z[BASE] / z["a"] == pytest.approx(2 ** 1.5) and all(x > y for x, y in zip(list(z.values()), list(z.values())[1:]))
    u = shares(["a", "b"], "uniform", 0.5)
    assert u == pytest.approx({BASE: 0.5, "a": 0.25, "b": 0.25})
    assert shares(["a", "b"], "round_robin", 0.0) == pytest.approx({"a": 0.5, "b": 0.5})
    assert shares(["a", "b"], "weighted", None, {"a": 0.7, "b": 0.3}) == {"a": 0.7, "b": 0.3}


def test_round_robin_cycles_and_keeps_exact_counts():
    assert assign({"a": 0.5, "b": 0.5}, "round_robin", 5, np.random.default_rng(0)) == ["a", "b", "a", "b", "a"]
    sh = {BASE: 0.5, "a": 0.3, "b": 0.2}
    seq = assign(sh, "round_robin", 37, np.random.default_rng(0))
    for n in range(1, 38):  # after every prefix, each entry has floor or ceil of its share
        c = Counter(seq[:n])
        assert all(abs(c[e] - p * n) < 1 for e, p in sh.items()), (n, c)
    assert expected_round_robin(sh, 37) == dict(Counter(seq))


def test_the_assignment_is_the_same_for_every_engine_and_differs_by_point():
    point = {"adapters": {"a": "/a", "b": "/b"}, "split": "zipf", "zipf_alpha": 1.5}
    one = wl_lora.assignment(point, 64, 0, "serving:k1")
    assert one == wl_lora.assignment(point, 64, 0, "serving:k1")
    assert one != wl_lora.assignment(point, 64, 0, "serving:k2") and None in one  # None: the base model


def test_split_test_passes_the_drawn_split_and_rejects_a_biased_one():
    sh = shares([f"a{i}" for i in range(4)], "zipf", None, None, 1.5)
    fair = Counter(assign(sh, "zipf", 400, np.random.default_rng(1)))
    assert split_test(sh, dict(fair), "zipf")["ok"]
    # a biased assigner: the base model's share given to the rarest adapter
    biased = dict(sh)
    biased[BASE], biased["a3"] = sh["a3"], sh[BASE]
    drawn = Counter(assign(biased, "zipf", 400, np.random.default_rng(1)))
    t = split_test(sh, dict(drawn), "zipf")
    assert not t["ok"] and t["p_value"] < 1e-3 and "furthest from its share" in t["detail"]
    # round robin: exact counts, one request moved is a failure
    rr = {"a": 0.5, "b": 0.5}
    assert split_test(rr, {"a": 4, "b": 4}, "round_robin")["ok"]
    assert not split_test(rr, {"a": 5, "b": 3}, "round_robin")["ok"]
    assert not split_test(rr, {"a": 4, "b": 4, BASE: 1}, "round_robin")["ok"]  # an entry with no share


def test_a_row_whose_sent_split_is_biased_fails():
    sh = shares(["a", "b"], "uniform")
    row = {"status": "ok", "lora_shares": sh, "lora_split": "uniform", "lora_sent": {BASE: 90, "a": 5, "b": 5}}
    wl_lora.finalize(row, [])
    assert row["status"] == "failed" and "the split sent is not the configured one" in row["error"]
    row = {"status": "ok", "lora_shares": sh, "lora_split": "uniform", "lora_sent": {BASE: 33, "a": 34, "b": 33}}
    wl_lora.finalize(row, [])
    assert row["status"] == "ok" and row["lora_split_test"]["test"] == "chi2"


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_the_check_verdict_fails_the_row_naming_the_request():
    row = {"status": "ok", "lora_shares": {"a": 1.0}, "lora_split": "uniform", "lora_sent": {"a": 2},
           "lora_check": {"verdict": "fail", "detail": "request r1 (adapter a): token 3 is 7 in mixed traffic, 9 ..."}}
    wl_lora.finalize(row, [])
    assert row["status"] == "failed" and "request r1 (adapter a): token 3" in row["error"]


# ---- planning and bad input -----------------------------------------------------------------------------------

def _adapters_arg(adapters, names=("lora0", "lora1", "lora2", "lora3")) -> str:
    return "workload.lora.adapters={" + ",".join(f"{n}:{adapters / n}" for n in names) + "}"


def test_the_plan_puts_the_traffic_in_the_points_and_the_options_follow(adapters):
    raw = {"adapters": {n: str(adapters / n) for n in ("lora0", "lora1", "lora2")}, "split": "zipf",
           "zipf_alpha": 1.5, "swap_cost": [2]}
    cfg = ServingConfig(concurrency=[1, 8], request_rates=[], lora=raw)
    points = Serving().plan(cfg)
    main = [p for p in points if not p.params["lora"].get("swap")]
    swap = [p for p in points if p.params["lora"].get("swap")]
    assert [p.params["concurrency"] for p in main] == [1, 8] and [p.params["lora"]["swap"] for p in swap] == [1, 2]
    lo = main[0].params["lora"]
    assert list(lo["adapters"]) == ["lora0", "lora1", "lora2"] and lo["max_loras"] == 3 and lo["max_lora_rank"] == 8
    ov = Serving().engine_overrides(main[0], None)
    assert [a["name"] for a in ov["lora_adapters"]] == ["lora0", "lora1", "lora2"] and ov["max_loras"] == 3
    assert Serving().engine_overrides(swap[1], None)["max_loras"] == 1
    from adapters.base import Capabilities
    assert "no LoRA" in Serving().unsupported(main[0], Capabilities())
    assert "no swap to measure" in Serving().unsupported(swap[1], Capabilities(lora=True))
    assert Serving().unsupported(Point("serving", {"concurrency": 1}), Capabilities()) is None


def test_capacity_probes_carry_the_traffic_and_swap_cost_is_serving_only(adapters):
    from workloads.capacity import Capacity, CapacityConfig
    raw = {"adapters": {"lora0": str(adapters / "lora0")}, "split": "uniform"}
    probe = Capacity().plan(CapacityConfig(slo_ttft_p99_s=1.0, lora=raw))[0]
    assert list(probe.params["lora"]["adapters"]) == ["lora0"]
    nxt = Capacity()._probe(CapacityConfig(slo_ttft_p99_s=1.0, lora=raw), 2.0, 1)
    assert nxt.params["lora"] == probe.params["lora"]
    problems = check_jobs(["engines=[hf]", "model=tiny-trained", "workload=capacity", "workload.slo_ttft_p99_s=1",
                           f"workload.lora.adapters={{a:{adapters / 'lora0'},b:{adapters / 'lora1'}}}",
                           "workload.lora.swap_cost=[2]"])
    assert any("workload.lora.swap_cost: measured by workload=serving only" in p for p in problems), problems


def test_a_sweep_over_the_number_of_adapters_and_max_loras_checks_every_job(adapters):
    problems = check_jobs(["-m", "engines=[hf]", "model=tiny-trained", "workload=serving", _adapters_arg(adapters),
                           "workload.lora.num_adapters=1,2,4", "workload.lora.max_loras=1,2"])
    assert problems == []
    problems = check_jobs(["-m", "engines=[hf]", "model=tiny-trained", "workload=serving", _adapters_arg(adapters),
                           "workload.lora.num_adapters=2,5"])
    assert len(problems) == 1 and "workload.lora.num_adapters=5: only 4 adapters" in problems[0]


@pytest.mark.parametrize("case", ["not_peft", "shape", "rank", "split", "twice", "weights_unknown"])
def test_bad_adapters_are_named_before_anything_runs(adapters, case):
    from harness.checkpoint import shipped_checkpoint
    base = ["engines=[hf]", "model=tiny-trained", "workload=serving"]
    args, expected = {
        "not_peft": ([f"workload.lora.adapters={{m:{shipped_checkpoint(load_preset('tiny-trained'))}}}"],
                     "adapter 'm'"),
        "shape": ([f"workload.lora.adapters={{t:{adapters / 'tiny_0'}}}"], "does not fit the base model tiny-trained"),
        "rank": ([f"workload.lora.adapters={{big:{adapters / 'r16_0'}}}", "workload.lora.max_lora_rank=8"],
                 "workload.lora.max_lora_rank=8: adapter 'big' has rank 16"),
        "split": ([_adapters_arg(adapters, ("lora0", "lora1")), "workload.lora.split=weighted",
                   "workload.lora.weights={base:0.5,lora0:0.3,lora1:0.1}"], "the shares sum to 0.9, not 1"),
        "twice": ([f"workload.lora.adapters=[{{name:a,path:{adapters / 'lora0'}}},{{name:a,path:{adapters / 'lora1'}}}]"],
                  "adapter name 'a' is used twice"),
        "weights_unknown": ([_adapters_arg(adapters, ("lora0",)), "workload.lora.split=weighted",
                             "workload.lora.weights={base:0.5,lora9:0.5}"], "lora9 is not an adapter"),
    }[case]
    problems = check_jobs(base + args)
    assert any(expected in p for p in problems), problems
    assert all("workload.lora" in p for p in problems), problems


def test_bad_adapter_input_exits_2_without_a_traceback(tmp_path, adapters):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[hf]", "model=tiny-trained", "workload=serving",
                        f"workload.lora.adapters={{t:{adapters / 'tiny_0'}}}", f"hydra.run.dir={out}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "workload.lora.adapters: adapter 't'" in r.stderr and not (out / "results.jsonl").exists()


def test_vllm_lora_arguments_round_the_rank_up_and_default_the_slots_to_every_adapter():
    from adapters.base import ModelSpec
    from adapters.vllm.options import check_problems, lora_kwargs
    ads = [{"name": "a", "path": "/a", "rank": 4}, {"name": "b", "path": "/b", "rank": 12}]
    assert lora_kwargs({"lora_adapters": ads}) == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
                                                   "max_cpu_loras": 2}
    assert lora_kwargs({"lora_adapters": ads, "max_loras": 1, "max_cpu_loras": 1})["max_cpu_loras"] == 1
    assert lora_kwargs({"max_loras": 3}) == {}
    problems = check_problems({"lora_adapters": ads, "max_lora_rank": 8}, ModelSpec("/m", "m"), "vllm-cpu")
    assert any("max_lora_rank=8: adapter 'b' has rank 12" in p for p in problems), problems


def test_parity_scores_every_adapter_against_the_same_adapters_baseline(adapters):
    from workloads.parity import Parity, ParityConfig, _baseline
    cfg = ParityConfig(prompt_lens=[8], tokens=4, adapters={"lora0": str(adapters / "lora0")})
    base, a0 = Parity().plan(cfg)
    assert "adapter" not in base.params and a0.params["adapter"] == "lora0"
    from adapters.base import Capabilities
    assert Parity().unsupported(a0, Capabilities()) is not None and Parity().unsupported(base, Capabilities()) is None
    assert Parity().engine_overrides(a0, Capabilities(lora=True))["lora_adapters"][0]["name"] == "lora0"
    rows = [{"workload": "parity", "status": "ok", "engine": "hf", "parity_tokens": [[1]], "point": base.params},
            {"workload": "parity", "status": "ok", "engine": "hf", "parity_tokens": [[2]], "point": a0.params}]
    assert _baseline(rows, "vllm", "lora0")["parity_tokens"] == [[2]] and _baseline(rows, "vllm")["parity_tokens"] == [[1]]
    from harness.cli import check_jobs
    assert check_jobs(["engines=[hf]", "model=tiny-trained", "workload=serving",
                       f"workload.lora.adapters={{lora0:{adapters / 'lora0'}}}"]) == []

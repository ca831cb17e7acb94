"""Workload planning, length distributions, arrivals, datasets, parity and fits (no engine)."""

import json
import math

import numpy as np
import pytest

from harness.core.errors import UserError
from harness.core.parity import greedy_agreement as parity_agreement
from workloads import get_workload, workload_names
from workloads.datasets import read_dataset
from workloads.lengths import parse_length
from workloads.prompts import synthetic_prompts
from workloads.serving import arrival_times


def test_every_workload_has_a_config(tmp_path):
    from harness.cli import compose_job
    from harness.config import build_plan
    needs = {"capacity": ["workload.slo_ttft_p99_s=1"], "tune": ["workload.slo_ttft_p99_s=1"],  # what a workload cannot run without
             "quality": ["model=tiny-trained"]}
    for name in workload_names():
        plan = build_plan(compose_job(["engines=[hf]", f"workload={name}", *needs.get(name, [])]))
        assert plan.points and plan.max_model_len > 0
        assert len({p.key for p in plan.points}) == len(plan.points)


def test_sweep_plan_orders_points():
    from workloads.sweep import SweepConfig
    pts = get_workload("sweep").plan(SweepConfig(batch_sizes=[4, 1], prompt_lens=[64, 32], output_len=8))
    assert [(p.params["prompt_len"], p.params["batch_size"]) for p in pts] == [(32, 1), (32, 4), (64, 1), (64, 4)]


def test_prompts_deterministic_and_free_of_special_tokens():
    a = synthetic_prompts(3, 50, 0, 10, avoid=(0, 1, 2, 3), seed=1, key="k")
    assert a == synthetic_prompts(3, 50, 0, 10, avoid=(0, 1, 2, 3), seed=1, key="k")
    assert a != synthetic_prompts(3, 50, 0, 10, avoid=(0, 1, 2, 3), seed=1, key="other")
    assert all(4 <= t < 10 for p in a for t in p) and all(len(p) == 50 for p in a)


@pytest.mark.parametrize("spec,lo,hi", [
    (64, 64, 64),
    ({"dist": "uniform", "min": 10, "max": 20}, 10, 20),
    ({"dist": "normal", "mean": 100, "std": 30, "min": 50, "max": 150}, 50, 150),
    ({"dist": "lognormal", "mean": 100, "sigma": 0.8}, 1, 200),
])
def test_length_distributions_stay_in_stated_range(spec, lo, hi):
    d, problems = parse_length(spec, "workload.input_len")
    assert not problems and d.bounds() == (lo, hi)
    x = d.sample(5000, np.random.default_rng(0))
    assert min(x) >= lo and max(x) <= hi
    if isinstance(spec, dict) and spec["dist"] == "uniform":
        assert set(x) == set(range(10, 21))  # both ends included


def test_lognormal_mean():
    d, _ = parse_length({"dist": "lognormal", "mean": 100, "sigma": 0.5, "max": 10_000}, "f")
    assert np.mean(d.sample(50_000, np.random.default_rng(1))) == pytest.approx(100, rel=0.02)


@pytest.mark.parametrize("spec,msg", [
    ({"dist": "uniform", "min": 10}, "needs max"),
    ({"dist": "triangle", "mean": 3}, "not one of"),
    ({"dist": "uniform", "min": 30, "max": 20}, "larger than max"),
    ("long", "give a number of tokens"),
])
def test_bad_length_specs(spec, msg):
    d, problems = parse_length(spec, "workload.input_len")
    assert d is None and any(msg in p and "workload.input_len" in p for p in problems), problems


def test_arrivals():
    rng = np.random.default_rng(0)
    assert arrival_times(5, math.inf, "poisson", 1.0, rng) == [0.0] * 5
    t = arrival_times(20_000, 10.0, "poisson", 1.0, rng)
    assert t[0] == 0 and all(b >= a for a, b in zip(t, t[1:]))
    assert (len(t) - 1) / t[-1] == pytest.approx(10.0, rel=0.03)
    gaps_bursty = np.diff(arrival_times(20_000, 10.0, "gamma", 0.25, rng))
    gaps_regular = np.diff(arrival_times(20_000, 10.0, "gamma", 4.0, rng))
    assert np.mean(gaps_bursty) == pytest.approx(0.1, rel=0.05) == np.mean(gaps_regular)
    assert np.std(gaps_bursty) > 2 * np.std(gaps_regular)  # lower shape = burstier, same rate


def test_jsonl_dataset(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"task_id": 0, "input_ids": [5, 6, 7], "output_tokens": 4}\n\n'
                 '{"prompt": "w5 w6", "output_tokens": 2}\n')
    entries = read_dataset(p)
    assert entries[0].prompt_ids == [5, 6, 7] and entries[0].output_tokens == 4
    assert entries[1].prompt_text == "w5 w6"


def test_malformed_jsonl_names_the_lines(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input_ids": [1, 2], "output_tokens": 3}\n'
                 '{"input_ids": [1, 2], "output_tokens": 0}\n'
                 'not json\n'
                 '{"output_tokens": 3}\n'
                 '{"input_ids": ["a"], "output_tokens": 3}\n')
    with pytest.raises(UserError) as e:
        read_dataset(p)
    text = "\n".join(e.value.problems)
    for line in (2, 3, 4, 5):
        assert f"line {line}:" in text
    assert "line 1:" not in text


def test_sharegpt_dataset(tmp_path):
    p = tmp_path / "sg.json"
    p.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "w5 w6 w7"}, {"from": "gpt", "value": "w8 w9"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "hello"}]},
    ]))
    entries = read_dataset(p)
    assert len(entries) == 1 and entries[0].prompt_text == "w5 w6 w7" and entries[0].output_text == "w8 w9"
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(UserError):
        read_dataset(tmp_path / "broken.json")


def test_text_dataset_tokenised_with_checkpoint_tokenizer(tmp_path, tiny_ckpt):
    from workloads.datasets import tokenize_entries
    p = tmp_path / "sg.json"
    p.write_text(json.dumps([{"conversations": [{"from": "human", "value": "w5 w6 w7"},
                                                {"from": "gpt", "value": "w8 w9 w10 w11"}]}]))
    assert tokenize_entries(read_dataset(p), str(tiny_ckpt), 4096) == [([5, 6, 7], 4)]


def test_parity_agreement():
    base = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert parity_agreement(base, base) == {"agreement": 1.0, "first_divergence": None}
    r = parity_agreement(base, [[1, 2, 9, 9], [5, 6, 7, 0]])
    assert r["agreement"] == pytest.approx(5 / 8) and r["first_divergence"] == 2




def test_kv_ablation_kv_dtypes_axis_is_the_cached_modes_and_unsupported_where_the_engine_lacks_one():
    from adapters.base import Capabilities
    from harness.core.schema import check
    wl = get_workload("kv_ablation")
    cfg, problems = check(wl.config_cls, {"name": "kv_ablation", "context_lens": [64], "kv_dtypes": ["auto", "q8_0"]},
                          "workload")
    assert not problems
    points = wl.plan(cfg)
    assert sorted((p.params["mode"], p.params.get("kv_dtype", "auto")) for p in points) == [
        ("cache", "auto"), ("cache", "q8_0"), ("no_cache", "auto")]
    q8 = next(p for p in points if p.params.get("kv_dtype") == "q8_0")
    ref_like = Capabilities(kv_dtypes=("auto", "int8", "fp8"), no_cache_mode=True)
    llama_like = Capabilities(kv_dtypes=("auto", "fp32", "q8_0", "q4_0"))
    assert "cannot store the KV cache as q8_0" in wl.unsupported(q8, ref_like)
    assert wl.unsupported(q8, llama_like) is None
    assert wl.engine_overrides(q8, llama_like) == {"kv_dtype": "q8_0"}

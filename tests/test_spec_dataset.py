"""The speculative workload on a user's prompts (workloads/spec_dataset.py): categories read from a
categorized JSONL, ShareGPT or chat file, one content point per category, and the bad input that
stops a run before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.checkpoint import SHIPPED_DIR
from harness.core.errors import UserError
from harness.core.presets import load_preset
from workloads.base import RunContext
from workloads.spec_dataset import read_categories
from workloads.speculative import Speculative, SpeculativeConfig

DATA = Path(__file__).with_name("data")
CATEGORIZED, SHAREGPT = DATA / "spec_categories.jsonl", DATA / "sharegpt_small.json"
TARGET = SHIPPED_DIR / "tiny-trained-target"


def test_a_categorized_jsonl_gives_its_categories_in_file_order_with_their_first_turns():
    cats, fmt = read_categories(str(CATEGORIZED))
    assert fmt == "categorized" and list(cats) == ["coding", "writing", "math"]
    assert all(len(v) == 4 for v in cats.values())
    assert cats["math"][1].startswith("Solve for x") and "And then?" not in cats["math"][1]  # the first turn only


def test_sharegpt_is_one_category_of_its_first_user_messages():
    cats, fmt = read_categories(str(SHAREGPT))
    assert fmt == "sharegpt" and list(cats) == ["sharegpt"] and len(cats["sharegpt"]) == 8
    assert cats["sharegpt"][0].startswith("Write a Python function")


def test_points_are_per_category_and_name_the_dataset():
    cfg = SpeculativeConfig(methods=["ngram"], num_speculative_tokens=[4], batch_sizes=[1], dataset=str(CATEGORIZED),
                            categories=["math", "coding"])
    points = Speculative().plan(cfg)
    assert [(p.params["method"], p.params["content"]) for p in points] == [
        ("none", "coding"), ("none", "math"), ("ngram", "coding"), ("ngram", "math")]
    assert all(p.params["dataset"] == str(CATEGORIZED) for p in points)
    assert "dataset" not in Speculative().plan(SpeculativeConfig(methods=["ngram"]))[0].params  # unchanged without


def test_requests_are_the_categorys_prompts_cut_to_prompt_len_and_the_same_at_every_point():
    wl = Speculative()
    ctx = RunContext(shape=load_preset("tiny-trained-target"), dtype="float32", device="cpu", model_path=str(TARGET))
    params = {"content": "writing", "dataset": str(CATEGORIZED), "prompt_len": 8, "output_len": 4}
    reqs = wl.requests(params, ctx, 6)
    assert len(reqs) == 6 and all(1 <= len(r.prompt_ids) <= 8 for r in reqs)
    assert reqs[4].prompt_ids == reqs[0].prompt_ids  # four prompts, cycled
    assert [r.prompt_ids for r in wl.requests(params, ctx, 6)] == [r.prompt_ids for r in reqs]
    row_source = wl.content("writing", ctx, str(CATEGORIZED)).source
    assert "category writing: 4 prompts" in row_source


def _problems(cfg: SpeculativeConfig) -> list[str]:
    return Speculative().check(cfg, load_preset("tiny-trained-target"))


def test_a_category_that_names_nothing_and_a_dataset_without_prompts_are_bad_input(tmp_path):
    problems = _problems(SpeculativeConfig(methods=["ngram"], dataset=str(CATEGORIZED), categories=["math", "poetry"]))
    assert any("workload.categories: poetry names nothing" in p and "coding, writing, math" in p for p in problems)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"category": "x", "turns": [""]}) + "\n" + json.dumps({"category": "y"}) + "\n")
    problems = _problems(SpeculativeConfig(methods=["ngram"], dataset=str(empty)))
    assert any("no usable prompt" in p and "workload.dataset" in p for p in problems)
    problems = _problems(SpeculativeConfig(methods=["ngram"], categories=["math"]))
    assert any("workload.categories without workload.dataset" in p for p in problems)
    with pytest.raises(UserError, match="no such file"):
        read_categories(str(tmp_path / "missing.jsonl"))

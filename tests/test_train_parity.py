"""Parity on the trained preset (tiny-trained): its next-token distributions are peaked, so with
the thresholds for checkpoints trained here (harness.core.parity.THRESHOLDS_TRAINED) a realistic
bug fails parity and an honest engine passes it in bfloat16 and float16, which the random `tiny`
could not decide. The bugs are tests/test_parity_bugs.py's, each a real engine given a fault on
purpose and named as such:
- a RoPE theta off by 1 % (the checkpoint's config says 1.01 x rope_theta);
- a missing bias (tiny-trained with attention biases added - N(0, BIAS_STD), as the random
  presets draw them - loaded with the biases dropped);
- a KV block read from the wrong offset (the reference engine with its block table shifted,
  prefilling in chunks so later chunks read their context back from the pool).
The prompts are windows of the preset's held-out text, as the parity workload takes them on a
trained checkpoint; the baseline is the honest reference engine, transformers the honest second
engine. A 1 % RoPE error grows with the position: at prompts of up to 512 tokens (SHORT, the
random presets' default) it stays inside bf16's rounding, at lengths up to 2048 - the parity
workload's default on a trained checkpoint (TRAINED_PROMPT_LENS) - it is far outside.

The checkpoint is the one shipped with the project (harness/shipped/tiny-trained), so these tests
run on every machine; they never train it. Where the shipped checkpoint no longer matches the
preset (a changed preset or TRAIN_FORMAT) and no copy trained for it is cached, they fail, saying
how to retrain and replace it (docs/metrics.md, "Quality"). CI requires them to run
(`--must-run`, the Makefile's `test`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters.hf import HFEngine
from adapters.reference.engine import ReferenceEngine
from harness.checkpoint import BIAS_STD, cached_path, shipped_mismatch
from harness.core.paths import model_cache_dir
from harness.core.presets import load_preset
from harness.core.parity import compare_scores, verdict
from test_parity_bugs import (ShiftedBlockReads, biases_dropped, copy_with, parity, reference_baseline,  # noqa: F401
                              rope_theta_off_by_1_percent)
from workloads.parity import PROMPT_LENS, TRAINED_PROMPT_LENS, heldout_prompts, trained_here

pytestmark = pytest.mark.slow
DTYPES = ["bfloat16", "float16"]
CHUNKED = {"max_num_batched_tokens": 64}  # later chunks read their context back from the pool


@pytest.fixture(scope="module")
def trained() -> Path:
    """The tiny-trained preset where runs find it (shipped, else the model cache). The tests never
    train it, and never skip for want of it: the project ships it."""
    shape = load_preset("tiny-trained")
    path = cached_path(shape, model_cache_dir(None))
    if not (path / "config.json").is_file():
        pytest.fail(f"tiny-trained's shipped checkpoint is not this preset's ({shipped_mismatch(shape)}) and no copy "
                    f"trained for it is cached ({path}): retrain it and replace the shipped one (docs/metrics.md, "
                    "\"Quality\")")
    return path


@pytest.fixture(scope="module")
def trained_with_bias(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    def add_biases(cfg: dict) -> None:
        cfg["attention_bias"] = True

    def draw(t: dict) -> None:
        gen = torch.Generator().manual_seed(0)
        for k in [k for k in t if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))]:
            t[k.removesuffix("weight") + "bias"] = torch.randn(t[k].shape[0], generator=gen) * BIAS_STD
    return copy_with(trained, tmp_path_factory.mktemp("trained-bias") / "ckpt", config=add_biases, tensors=draw)


# the random presets' default lengths, given to a trained checkpoint (workload.prompt_lens=[...])
SHORT = PROMPT_LENS


def text_prompts(ckpt: Path, lens: list[int] | None = None) -> list[list[int]]:
    """The parity workload's prompts on a trained checkpoint: held-out text, by default of the
    lengths it takes there (TRAINED_PROMPT_LENS, up to 2048 tokens)."""
    return heldout_prompts(str(ckpt), lens or TRAINED_PROMPT_LENS)


def check(base: list[dict], scores: list[dict], dtype: str) -> tuple[dict, str | None]:
    """The comparison and verdict the parity workload makes on a checkpoint trained here."""
    fields = compare_scores(base, scores, dtype)
    return fields, verdict(fields, dtype, trained=True)[1]


def chunked(cls: type) -> type:
    return type(f"Chunked{cls.__name__}", (cls,), {"load": lambda self, m, o: cls.load(self, m, {**o, **CHUNKED})})


def report(name: str, dtype: str, fields: dict) -> None:
    keep = ("parity_max_abs_err", "parity_mean_kl", "parity_top1_agreement", "parity_confident_positions",
            "parity_margin_p50")
    print(f"PARITY-MEASURE {name} {dtype} " + json.dumps({k: fields.get(k) for k in keep}))


def test_the_workload_treats_the_preset_as_trained(trained: Path) -> None:
    assert trained_here(str(trained))


@pytest.mark.parametrize("dtype", DTYPES)
def test_honest_engines_pass(trained: Path, trained_with_bias: Path, dtype: str, reference_baseline) -> None:
    cases = ((trained, "tiny-trained", None), (trained_with_bias, "tiny-trained + biases", None),
             (trained, "tiny-trained, prompts of at most 512", SHORT))
    for ckpt, name, lens in cases:
        prompts = text_prompts(ckpt, lens)
        greedy, base = reference_baseline(ckpt, dtype, prompts)
        # transformers; the reference prefilling in chunks (equal to the whole prefill to the bit, so
        # measured once, at the default lengths)
        for engine in (HFEngine,) + (() if lens else (chunked(ReferenceEngine),)):
            _, honest = parity(engine, ckpt, dtype, prompts, teacher=greedy)
            fields, why = check(base, honest, dtype)
            report(f"{engine.__name__} honest on {name}", dtype, fields)
            assert why is None, (name, engine.__name__, dtype, fields)


# A 1 % RoPE error at prompts of at most 512 tokens in bf16: mean KL 1.5e-4 (0.15 nats) against the
# honest transformers' 1.0-1.2e-4 (0.09-0.11 nats), the rotary angles' error growing with the
# position and still small at 512 tokens: inside bf16 rounding, no threshold separates them. Strict,
# so a change that makes it decide shows here. At the trained default (up to 2048) it is far outside.
ROPE_SHORT_BF16 = ("RoPE +1 % at prompts of at most 512 tokens in bf16: mean KL 1.5e-4 against the honest "
                   "engines' 1.0-1.2e-4, inside bf16 rounding")


@pytest.mark.parametrize("dtype,lens", [
    ("bfloat16", None), ("float16", None),
    pytest.param("bfloat16", SHORT, marks=pytest.mark.xfail(reason=ROPE_SHORT_BF16, strict=True)),
    ("float16", SHORT)])
def test_a_1pct_rope_error_fails(trained: Path, tmp_path: Path, dtype: str, lens: list[int] | None,
                                 reference_baseline) -> None:
    prompts = text_prompts(trained, lens)
    greedy, base = reference_baseline(trained, dtype, prompts)
    broken = copy_with(trained, tmp_path / "rope", config=rope_theta_off_by_1_percent)
    _, bad = parity(ReferenceEngine, broken, dtype, prompts, teacher=greedy)
    fields, why = check(base, bad, dtype)
    report("rope+1%", dtype, fields)
    assert why is not None, (dtype, fields)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_missing_bias_fails(trained_with_bias: Path, tmp_path: Path, dtype: str, reference_baseline) -> None:
    prompts = text_prompts(trained_with_bias)
    broken = copy_with(trained_with_bias, tmp_path / "nobias", tensors=biases_dropped)
    greedy, base = reference_baseline(trained_with_bias, dtype, prompts)
    _, bad = parity(HFEngine, broken, dtype, prompts, teacher=greedy)
    fields, why = check(base, bad, dtype)
    report("bias-dropped", dtype, fields)
    assert why is not None, (dtype, fields)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_kv_block_read_from_the_wrong_offset_fails(trained: Path, dtype: str, reference_baseline) -> None:
    prompts = text_prompts(trained)
    greedy, base = reference_baseline(trained, dtype, prompts)
    _, bad = parity(chunked(ShiftedBlockReads), trained, dtype, prompts, teacher=greedy)
    fields, why = check(base, bad, dtype)
    report("kv-block-shifted", dtype, fields)
    assert why is not None, fields


def test_trained_preset_learned_the_text(trained: Path) -> None:
    """What the preset was trained for: held-out perplexity at most half the unigram perplexity of
    its tokenizer, far below its initial weights', and next-token distributions more peaked than
    at initialisation (docs/metrics.md, "Quality": the measured figures)."""
    record = json.loads((trained / "training.json").read_text())
    held, initial = record["heldout"], record["initial_model"]
    assert held["perplexity"] <= record["unigram_perplexity"] / 2, held
    assert held["perplexity"] <= initial["perplexity"] / 10, (held, initial)
    assert held["median_margin"] >= 5 * initial["median_margin"], (held, initial)

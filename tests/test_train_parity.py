"""Parity on the trained preset (tiny-trained): its next-token distributions are peaked, so a
realistic bug must fail parity and an honest engine pass it in bfloat16 and float16, which the
random `tiny` could not decide. The bugs are tests/test_parity_bugs.py's, each a real engine
given a fault on purpose and named as such:
- a RoPE theta off by 1 % (the checkpoint's config says 1.01 x rope_theta);
- a missing bias (tiny-trained with attention biases added - N(0, BIAS_STD), as the random
  presets draw them - loaded with the biases dropped);
- a KV block read from the wrong offset (the reference engine with its block table shifted,
  prefilling in chunks so later chunks read their context back from the pool).
The prompts are windows of the preset's held-out text, the baseline the honest reference
engine, transformers the honest second engine.

Needs the full tiny-trained checkpoint in the model cache: `infer-bench-model --train --preset
tiny-trained` trains it once (minutes); without it these tests are skipped, saying so."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from adapters.hf import HFEngine
from adapters.reference.engine import ReferenceEngine
from harness.checkpoint import BIAS_STD, cached_path
from harness.core.paths import model_cache_dir
from harness.core.presets import load_preset
from harness.core.train import HELDOUT_FILE
from test_parity_bugs import ShiftedBlockReads, biases_dropped, check, copy_with, parity, rope_theta_off_by_1_percent
from workloads.parity import ParityConfig

pytestmark = pytest.mark.slow
DTYPES = ["bfloat16", "float16"]
CHUNKED = {"max_num_batched_tokens": 64}  # later chunks read their context back from the pool


@pytest.fixture(scope="module")
def trained() -> Path:
    """The tiny-trained preset where runs find it (the model cache). The tests never train it."""
    path = cached_path(load_preset("tiny-trained"), model_cache_dir(None))
    if not (path / "config.json").is_file():
        pytest.skip(f"tiny-trained is not trained on this machine yet (no {path}): `infer-bench-model --train "
                    "--preset tiny-trained` trains it once (minutes); the tests never do")
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


def text_prompts(ckpt: Path) -> list[list[int]]:
    """One window of held-out text per parity prompt length, from evenly spread places."""
    held = np.load(ckpt / HELDOUT_FILE)
    lens = ParityConfig().prompt_lens
    starts = np.linspace(0, len(held) - max(lens) - 1, num=len(lens)).astype(int)
    return [list(map(int, held[s:s + n])) for s, n in zip(starts, lens)]


def chunked(cls: type) -> type:
    return type(f"Chunked{cls.__name__}", (cls,), {"load": lambda self, m, o: cls.load(self, m, {**o, **CHUNKED})})


def report(name: str, dtype: str, fields: dict) -> None:
    keep = ("parity_max_abs_err", "parity_mean_kl", "parity_top1_agreement", "parity_confident_positions",
            "parity_margin_p50")
    print(f"PARITY-MEASURE {name} {dtype} " + json.dumps({k: fields.get(k) for k in keep}))


# What the global thresholds (harness.core.parity.THRESHOLDS, set for the random presets) cannot
# decide on tiny-trained, measured (docs/metrics.md, "Parity on the trained preset"): these stay
# expected failures until thresholds for trained models exist; strict, so a change that makes them
# decide shows here.
NOT_SEPARABLE = {
    ("rope", "bfloat16"): "RoPE +1 %: mean KL 4.2e-5 against the honest transformers' 3.0e-5, inside bf16 "
                          "rounding (the 1.8 M model leans on the high-frequency rotary pairs, which a theta "
                          "error hardly moves): no threshold separates them",
    ("rope", "float16"): "RoPE +1 %: mean KL 6.7e-6 against the honest 6.4e-7, max |dlogp| 0.016 against 0.0055: "
                         "separable, but inside the fp16 thresholds set for the random presets (5e-4, 0.1)",
    ("bias", "bfloat16"): "bias dropped: mean KL 3.9e-4 against the honest 3.8e-5, max |dlogp| 0.14 against 0.05: "
                          "separable, but inside the bf16 thresholds set for the random presets (6e-3, 0.6)",
}


def expect(bug: str, dtype: str):
    why = NOT_SEPARABLE.get((bug, dtype))
    return pytest.param(dtype, marks=pytest.mark.xfail(reason=why, strict=True)) if why else dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_honest_engines_pass(trained: Path, trained_with_bias: Path, dtype: str) -> None:
    for ckpt, name in ((trained, "tiny-trained"), (trained_with_bias, "tiny-trained + biases")):
        prompts = text_prompts(ckpt)
        greedy, base = parity(ReferenceEngine, ckpt, dtype, prompts)
        for engine in (HFEngine, chunked(ReferenceEngine)):  # transformers; the reference prefilling in chunks
            _, honest = parity(engine, ckpt, dtype, prompts, teacher=greedy)
            fields, why = check(base, honest, dtype)
            report(f"{engine.__name__} honest on {name}", dtype, fields)
            assert why is None, (name, engine.__name__, dtype, fields)


@pytest.mark.parametrize("dtype", [expect("rope", d) for d in DTYPES])
def test_a_1pct_rope_error_fails(trained: Path, tmp_path: Path, dtype: str) -> None:
    prompts = text_prompts(trained)
    greedy, base = parity(ReferenceEngine, trained, dtype, prompts)
    broken = copy_with(trained, tmp_path / "rope", config=rope_theta_off_by_1_percent)
    _, bad = parity(ReferenceEngine, broken, dtype, prompts, teacher=greedy)
    fields, why = check(base, bad, dtype)
    report("rope+1%", dtype, fields)
    assert why is not None, (dtype, fields)


@pytest.mark.parametrize("dtype", [expect("bias", d) for d in DTYPES])
def test_a_missing_bias_fails(trained_with_bias: Path, tmp_path: Path, dtype: str) -> None:
    prompts = text_prompts(trained_with_bias)
    broken = copy_with(trained_with_bias, tmp_path / "nobias", tensors=biases_dropped)
    greedy, base = parity(ReferenceEngine, trained_with_bias, dtype, prompts)
    _, bad = parity(HFEngine, broken, dtype, prompts, teacher=greedy)
    fields, why = check(base, bad, dtype)
    report("bias-dropped", dtype, fields)
    assert why is not None, (dtype, fields)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_kv_block_read_from_the_wrong_offset_fails(trained: Path, dtype: str) -> None:
    prompts = text_prompts(trained)
    greedy, base = parity(ReferenceEngine, trained, dtype, prompts)
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

"""The reference engine on gpt-oss (GptOssForCausalLM): attention sinks, alternating windows, its
biased router and clamped-SwiGLU experts (adapters/reference/model.py, attention.py).

A tiny random-weight gpt-oss checkpoint made here with transformers' own config class, chosen so
that each of gpt-oss's differences shows in the outputs: a window of 16 on alternate layers (every
parity prompt, 24 to 150 tokens, is longer), YaRN RoPE past a trained context of 64 positions (as
gpt-oss's own config, truncate false), sinks drawn large enough to take a visible share of each
softmax, router and expert biases drawn at random (transformers initialises the expert biases to
zero), and a swiglu_limit of 1.5 (gpt-oss's is 7), so that the clamp bites on these small
weights. Parity is the project's float32 bar (harness.core.parity) through
tests/test_reference_families.py's helpers: greedy tokens equal to transformers' and
teacher-forced log-probabilities within THRESHOLDS["float32"]. Each of gpt-oss's pieces has an
injected bug that parity must catch."""

from __future__ import annotations

import shutil

import pytest
import torch

from adapters.reference import attention as ref_attention
from adapters.reference import model as ref_model
from adapters.reference.model import ModelConfig
from test_reference_families import (_common, check_online_api, hf_baseline, load, parity_problems, prompts,
                                     window_blocks_held, window_off_by_one_problems)

WINDOW = 16
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
LIMIT = 1.5


def gpt_oss_config(**kw):
    from transformers import GptOssConfig

    return GptOssConfig(**_common(
        num_hidden_layers=4, layer_types=LAYER_TYPES, sliding_window=WINDOW, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=32, attention_bias=True, swiglu_limit=LIMIT,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False}, **kw))


@pytest.fixture(scope="session")
def gpt_oss_ckpt(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("gpt_oss") / "gpt-oss"
    torch.manual_seed(1234)
    m = AutoModelForCausalLM.from_config(gpt_oss_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("sinks"):  # N(0, 0.2) from transformers: a sink worth little next to the scores
                p.normal_(1.0, 1.5)
            elif name.endswith(("_proj_bias", "router.bias")):  # expert biases: zeros from transformers
                p.normal_(0.0, 0.3)
    m.save_pretrained(path)
    return path


@pytest.mark.parametrize("options", [None, {"kernels": "plain", "max_num_batched_tokens": 40},
                                     {"kv_cache": "none"}],
                         ids=["default-kernels", "plain-chunked", "no-cache"])
def test_gpt_oss_matches_transformers_in_float32(gpt_oss_ckpt, options):
    problems, fields = parity_problems(gpt_oss_ckpt, options)
    assert not problems, (problems, fields)


def test_the_config_is_read(gpt_oss_ckpt):
    cfg = ModelConfig.from_dir(gpt_oss_ckpt)
    assert cfg.windows == tuple(WINDOW if k == "sliding_attention" else None for k in LAYER_TYPES)
    assert cfg.attention_sinks and cfg.moe.scoring == "topk_softmax" and cfg.moe.sparse_layers == (True,) * 4
    assert (cfg.moe.swiglu_limit, cfg.moe.swiglu_alpha) == (LIMIT, pytest.approx(1.702))
    assert cfg.rope_scaling["rope_type"] == "yarn"


def test_the_clamp_and_the_sinks_matter_here(gpt_oss_ckpt):
    """The fixture makes both pieces visible: some expert inputs pass the limit, and a sink takes
    a share of its row's probability (else the bugs below would pass for a reason of the data)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(gpt_oss_ckpt), dtype=torch.float32)
    seen: list[torch.Tensor] = []
    hook = m.model.layers[0].mlp.experts.register_forward_hook(
        lambda mod, args, out: seen.append(args[0] @ mod.gate_up_proj[0] + mod.gate_up_proj_bias[0]))
    with torch.no_grad():
        m(torch.tensor([prompts()[1]]))
    hook.remove()
    assert (seen[0].abs() > LIMIT).float().mean() > 0.05
    assert m.model.layers[0].self_attn.sinks.abs().max() > 1.0


# ---- injected bugs: each must fail parity ------------------------------------------------------

def _patched_init(change):
    real = ref_model.Model.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        change(self)
    return init


def _no_sinks(model):
    for layer in model.layers:
        layer.sinks = None


def test_sinks_left_out_fails(gpt_oss_ckpt, monkeypatch):
    hf_baseline(gpt_oss_ckpt)  # the honest baseline, before the bug goes in
    monkeypatch.setattr(ref_model.Model, "__init__", _patched_init(_no_sinks))
    problems, fields = parity_problems(gpt_oss_ckpt)
    assert problems, fields


def test_sink_outside_the_softmax_fails(gpt_oss_ckpt, monkeypatch):
    """The sink's exp added to the denominator without taking part in the max (overflow-safe form
    broken differently): p = exp(s - m) / (sum + exp(sink)) with m the scores' max only."""
    hf_baseline(gpt_oss_ckpt)

    def wrong(s, sink):
        m = s.amax(dim=-1, keepdim=True)
        e = (s - m).exp()
        return e / (e.sum(dim=-1, keepdim=True) + sink.exp())
    monkeypatch.setattr(ref_attention, "softmax_with_sink", wrong)
    problems, fields = parity_problems(gpt_oss_ckpt, {"kernels": "plain"})
    assert problems, fields


def test_softmax_over_every_expert_fails(gpt_oss_ckpt, monkeypatch):
    """A softmax over all experts, then the top k (not renormalised), in place of gpt-oss's top k
    of the logits, then a softmax over those k: the same experts chosen, but weights that no
    longer add up to 1."""
    hf_baseline(gpt_oss_ckpt)
    monkeypatch.setattr(ref_model, "route_topk_softmax", lambda logits, k: ref_model.route(logits, k, False))
    problems, fields = parity_problems(gpt_oss_ckpt)
    assert problems, fields


def test_gate_and_up_left_interleaved_fails(gpt_oss_ckpt, monkeypatch):
    """gate_up_proj's columns taken as [gate | up] halves, as the other families' fused tensors."""
    hf_baseline(gpt_oss_ckpt)

    def interleaved(model):
        for layer in model.layers:
            for lin in layer.moe.gate_up:
                i = lin.shape[0] // 2
                order = torch.stack([torch.arange(i), torch.arange(i) + i], dim=1).reshape(-1)  # back to interleaved
                lin.weight.copy_(lin.weight[order].clone())
                lin.bias.copy_(lin.bias[order].clone())
    monkeypatch.setattr(ref_model.Model, "__init__", _patched_init(interleaved))
    problems, fields = parity_problems(gpt_oss_ckpt, {"kernels": "plain"})
    assert problems, fields


def test_swiglu_without_the_clamp_fails(gpt_oss_ckpt, monkeypatch):
    hf_baseline(gpt_oss_ckpt)
    real = ref_model.clamped_swiglu
    monkeypatch.setattr(ref_model, "clamped_swiglu", lambda gu, alpha, limit: real(gu, alpha, float("inf")))
    problems, fields = parity_problems(gpt_oss_ckpt)
    assert problems, fields


def test_window_off_by_one_fails(gpt_oss_ckpt, monkeypatch):
    problems, fields = window_off_by_one_problems(gpt_oss_ckpt, monkeypatch)
    assert problems, fields


# ---- the paged cache, the online API, the experts ------------------------------------------------

def test_the_window_holds_its_blocks_flat(gpt_oss_ckpt):
    held, _ = window_blocks_held(gpt_oss_ckpt, WINDOW)
    assert held[1:] == [2, 2]  # ceil(16 / 16) + 1 at most; 2 once the window spans two blocks


def test_online_api_with_continuous_batching(gpt_oss_ckpt):
    check_online_api(gpt_oss_ckpt)


def test_the_engine_reports_the_experts_a_step_touched(gpt_oss_ckpt):
    e = load(gpt_oss_ckpt)
    try:
        e.prefill([[5]])  # one token: top-2 of 4 experts in each of the 4 layers
        assert e.kv_cache_info().extra["moe"]["experts_touched_last_step"] == [2, 2, 2, 2]
    finally:
        e.close()


def test_mxfp4_experts_are_refused_in_one_line(gpt_oss_ckpt, tmp_path):
    """gpt-oss's published checkpoints keep the experts in MXFP4 blocks and scales: refused at
    load, naming them, rather than read as something else."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "mxfp4"
    shutil.copytree(gpt_oss_ckpt, path)
    f = next(path.glob("*.safetensors"))
    tensors = load_file(str(f))
    w = tensors.pop("model.layers.0.mlp.experts.gate_up_proj")
    tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"] = w.to(torch.uint8)
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="MXFP4"):
        load(path)

"""The reference engine on Gemma 3 (Gemma3ForCausalLM, adapters/reference/gemma.py).

A tiny random-weight Gemma 3 checkpoint made here with transformers' own config class, chosen so
that each of Gemma's differences from LLaMA shows in the outputs: a window of 16 (every parity
prompt, 24 to 150 tokens, is longer), local and global layers with different RoPE (theta 1e4
plain vs 1e6 with linear scaling), query_pre_attn_scalar 64 != head_dim 16, and every norm's
weight drawn at random (transformers initialises them to zero, where (1 + w) is 1 and a norm
taken as plain w would give zeros). Parity is the project's float32 bar (harness.core.parity),
through tests/test_reference_families.py's helpers: greedy tokens equal to transformers' and
teacher-forced log-probabilities within THRESHOLDS["float32"]. Each of Gemma's pieces has an
injected bug that parity must catch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from adapters.reference import gemma as ref_gemma
from adapters.reference.model import ModelConfig
from test_reference_families import (_common, check_online_api, hf_baseline, load, parity_problems, window_blocks_held,
                                     window_off_by_one_problems)

WINDOW = 16
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def gemma_config(**kw):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**_common(
        num_hidden_layers=4, layer_types=LAYER_TYPES, sliding_window=WINDOW, query_pre_attn_scalar=64,
        tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **kw))


@pytest.fixture(scope="session")
def gemma_ckpt(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("gemma") / "gemma3"
    torch.manual_seed(1234)
    m = AutoModelForCausalLM.from_config(gemma_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):  # zeros from transformers: (1 + w) would be 1 everywhere
                p.normal_(0.0, 0.5)
    m.save_pretrained(path)
    return path


@pytest.mark.parametrize("options", [None, {"kernels": "plain", "max_num_batched_tokens": 40},
                                     {"kv_cache": "none"}],
                         ids=["default-kernels", "plain-chunked", "no-cache"])
def test_gemma_matches_transformers_in_float32(gemma_ckpt, options):
    problems, fields = parity_problems(gemma_ckpt, options)
    assert not problems, (problems, fields)


def test_the_config_is_read_per_layer_type(gemma_ckpt):
    """What the engine takes from config.json: windows and local RoPE on the sliding layers only,
    the global layers' theta and linear scaling as the model's RoPE."""
    cfg = ModelConfig.from_dir(gemma_ckpt)
    local = [k == "sliding_attention" for k in LAYER_TYPES]
    assert cfg.windows == tuple(WINDOW if s else None for s in local)
    assert cfg.gemma.local_layers == tuple(local)
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == (1e6, "linear", 4.0)
    assert (cfg.gemma.local_rope_theta, cfg.gemma.local_rope_scaling) == (1e4, None)
    assert cfg.qk_norm and cfg.gemma.query_pre_attn_scalar == 64


# ---- injected bugs: each must fail parity ------------------------------------------------------

def _without_post_norm(which: str):
    """Gemma's layer with the norm of the attention's ("attention") or the MLP's ("mlp") output left out."""
    def forward(self, x, o, layer):
        a = layer.o(o)
        h = x + (a if which == "attention" else self.rms_norm(a, layer.attn_out_norm))
        gate, up = layer.gate_up(self.rms_norm(h, layer.post_norm)).chunk(2, dim=-1)
        m = layer.down(torch.nn.functional.gelu(gate, approximate="tanh") * up)
        return h + (m if which == "mlp" else self.rms_norm(m, layer.mlp_out_norm))
    return forward


def _swapped_rope(real):
    def init(self, *a, **kw):
        real(self, *a, **kw)
        self.cos, self.local_cos = self.local_cos, self.cos
        self.sin, self.local_sin = self.local_sin, self.sin
    return init


def _unscaled_embeddings(real):
    def init(self, *a, **kw):
        real(self, *a, **kw)
        self.embed_scale = None
    return init


BUGS = {
    "norm as plain w": lambda mp: mp.setattr(ref_gemma, "norm_weight", lambda w: w.float()),
    "post-attention norm left out":
        lambda mp: mp.setattr(ref_gemma.GemmaModel, "attention_output_and_mlp", _without_post_norm("attention")),
    "post-feedforward norm left out":
        lambda mp: mp.setattr(ref_gemma.GemmaModel, "attention_output_and_mlp", _without_post_norm("mlp")),
    "scale 1/sqrt(head_dim)": lambda mp: mp.setattr(ref_gemma, "attention_scale", lambda cfg: cfg.head_dim ** -0.5),
    "global and local RoPE swapped":
        lambda mp: mp.setattr(ref_gemma.GemmaModel, "__init__", _swapped_rope(ref_gemma.GemmaModel.__init__)),
    "embeddings not scaled":
        lambda mp: mp.setattr(ref_gemma.GemmaModel, "__init__", _unscaled_embeddings(ref_gemma.GemmaModel.__init__)),
}


@pytest.mark.parametrize("bug", list(BUGS))
@pytest.mark.parametrize("kernels", ["default", "plain"])
def test_gemma_bugs_fail(bug, kernels, gemma_ckpt, monkeypatch):
    hf_baseline(gemma_ckpt)  # the honest baseline, before the bug goes in
    BUGS[bug](monkeypatch)
    problems, fields = parity_problems(gemma_ckpt, {"kernels": "plain"} if kernels == "plain" else None)
    assert problems, fields


def test_gemma_window_off_by_one_fails(gemma_ckpt, monkeypatch):
    problems, fields = window_off_by_one_problems(gemma_ckpt, monkeypatch)
    assert problems, fields


# ---- the paged cache and the online API ---------------------------------------------------------

def test_a_gemma_window_holds_its_blocks_flat_while_full_layers_grow(gemma_ckpt):
    held, bounds = window_blocks_held(gemma_ckpt, WINDOW)
    assert all(h <= b == 2 for h, b in zip(held, bounds))  # ceil(16 / 16) + 1
    assert held[1:] == [2, 2]


def test_the_kv_estimate_matches_the_blocks_each_gemma_group_holds(gemma_ckpt):
    from harness.core.presets import shape_from_hf_config
    from workloads.kv_memory import group_comparison
    shape = shape_from_hf_config(gemma_ckpt)
    e = load(gemma_ckpt)
    try:
        e.prefill([[3 + i % 200 for i in range(60)], [5 + i % 190 for i in range(97)]])
        e.decode(3)
        info = e.kv_cache_info()
    finally:
        e.close()
    rows = group_comparison(shape, info.kv_dtype, "float32", info, [63, 100])
    assert {r["kind"] for r in rows} == {"full", "sliding"}
    assert all(r["match"] is True for r in rows), rows
    assert sum(r["layers"] for r in rows) == shape.num_hidden_layers


def test_gemma_online_api_with_continuous_batching(gemma_ckpt):
    check_online_api(gemma_ckpt)


# ---- what the engine refuses ---------------------------------------------------------------------

@pytest.mark.parametrize("field", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_gemma_with_softcapping_is_refused_in_one_line(field, gemma_ckpt, tmp_path):
    """A Gemma config with Gemma 2's logit softcapping means a model the engine does not compute."""
    path = tmp_path / "softcapped"
    shutil.copytree(gemma_ckpt, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, field: 30.0}))
    with pytest.raises(ValueError, match=rf"^[^\n]*{field}=30.0: logit softcapping[^\n]*$"):
        ModelConfig.from_dir(path)


@pytest.mark.parametrize("change", [{"use_bidirectional_attention": True}, {"hidden_activation": "gelu"}])
def test_gemma_variants_the_engine_does_not_compute_are_refused(change, gemma_ckpt, tmp_path):
    path = tmp_path / "variant"
    shutil.copytree(gemma_ckpt, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    (name,) = change
    with pytest.raises(ValueError, match=rf"^[^\n]*{name}=[^\n]*not supported by the reference engine[^\n]*$"):
        ModelConfig.from_dir(path)


def test_an_image_text_checkpoint_is_refused_at_plan_time_as_at_load():
    """A Gemma3ForConditionalGeneration checkpoint's shape is its gemma3_text language model's, but
    its weights are not a Gemma3ForCausalLM's: the plan refuses it, as ModelConfig does at load."""
    from dataclasses import replace

    from adapters.reference.families import unsupported_reason
    from harness.core.presets import load_preset
    shape = load_preset("tiny-gemma3")
    assert unsupported_reason(replace(shape, hf_architecture="Gemma3ForCausalLM")) is None
    why = unsupported_reason(replace(shape, hf_architecture="Gemma3ForConditionalGeneration"))
    assert why is not None and "Gemma3ForConditionalGeneration" in why and "\n" not in why

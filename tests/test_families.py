"""Model families as deployed: each family's config.json read into per-layer kinds and MoE sizes, the
real-size presets against those configs, the KV estimator by layer group against hand formulas
(docs/metrics.md), and bad layer lists refused with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.core.errors import UserError
from harness.core.kvcalc import estimate
from harness.core.presets import load_preset, shape_from_hf_config, shape_from_mapping
from harness.kv_cli import run as kv_run

# ---- the published configs (the fields that matter, as named on the Hub) ---------------------
PUBLISHED = {
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1},
    "gpt-oss-120b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 36,
        "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
        "rope_theta": 150000, "experts_per_token": 4, "num_experts_per_tok": 4, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "attention_bias": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "layer_types": ["sliding_attention", "full_attention"] * 18,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False}},
    "gemma-3-27b": {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
                        "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                        "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6,
                        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "vocab_size": 262208,
                        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6},
        "vision_config": {"model_type": "siglip_vision_model"}, "torch_dtype": "bfloat16"},
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36, "tie_word_embeddings": False,
        "attention_bias": False, "torch_dtype": "bfloat16"},
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": False,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
        "intermediate_size": 5120, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "num_experts": 512, "num_experts_per_tok": 10, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "max_position_embeddings": 262144, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
        "rope_theta": 1e6, "rms_norm_eps": 1e-5, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"},
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "bos_token_id": 128000,
        "eos_token_id": 128001, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "llama-4-scout": {
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
        "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
                        "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
                        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048, "num_local_experts": 16,
                        "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "attention_chunk_size": 8192,
                        "no_rope_layers": [1, 1, 1, 0] * 12, "use_qk_norm": True, "rope_theta": 500000.0,
                        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                        "max_position_embeddings": 10485760, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
        "vision_config": {"model_type": "llama4_vision_model"}, "torch_dtype": "bfloat16"},
}
# what the reader and the presets must agree on
COMPARED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings",
            "attention_bias", "sliding_window", "attention_chunk_size", "kv_lora_rank", "q_lora_rank",
            "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "linear_attention", "num_experts",
            "num_experts_per_tok", "num_shared_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
            "dense_layers", "qk_norm", "attention_sinks")


def _ckpt(tmp_path, cfg, name="ckpt"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_reader_of_the_published_config_gives_the_preset(tmp_path, name):
    read = shape_from_hf_config(_ckpt(tmp_path, PUBLISHED[name]))
    preset = load_preset(name)
    assert read.layer_kinds() == preset.layer_kinds()
    assert read.mlp_kinds() == preset.mlp_kinds()
    for f in COMPARED:
        assert getattr(read, f) == getattr(preset, f), f
    if preset.rope_scaling:
        assert read.rope_scaling["rope_type"] == preset.rope_scaling["rope_type"]
        assert read.rope_scaling["factor"] == preset.rope_scaling["factor"]
    assert read.num_parameters() == preset.num_parameters()


def test_layer_kinds_of_the_families():
    assert load_preset("gemma-3-27b").layer_kinds().count("full") == 10  # layers 5, 11, .., 59
    assert load_preset("gpt-oss-120b").layer_kinds()[:4] == ("sliding", "full", "sliding", "full")
    assert load_preset("qwen3-next-80b-a3b").layer_kinds().count("linear") == 36
    assert set(load_preset("deepseek-v3").layer_kinds()) == {"latent"}
    assert load_preset("llama-4-scout").layer_kinds()[:4] == ("chunked", "chunked", "chunked", "full")
    assert load_preset("deepseek-v3").mlp_kinds()[:4] == ("dense", "dense", "dense", "moe")


def test_published_parameter_counts():
    """Totals and active counts within the published figures (embeddings included here)."""
    def b(name):
        s = load_preset(name)
        return s.num_parameters() / 1e9, s.active_parameters() / 1e9
    assert 670 < b("deepseek-v3")[0] < 672 and 37 < b("deepseek-v3")[1] < 38  # 671 B, 37 B active
    assert 46.6 < b("mixtral-8x7b")[0] < 46.8 and 12.8 < b("mixtral-8x7b")[1] < 13.0  # 46.7 B, 12.9 B
    assert 116 < b("gpt-oss-120b")[0] < 118  # 117 B
    assert 30.4 < b("qwen3-30b-a3b")[0] < 30.6 and 3.2 < b("qwen3-30b-a3b")[1] < 3.4  # 30.5 B, 3.3 B
    assert 79 < b("qwen3-next-80b-a3b")[0] < 81
    assert b("llama-3.1-8b")[0] == b("llama-3.1-8b")[1] and 8.0 < b("llama-3.1-8b")[0] < 8.1


# ---- the estimator by group, against hand formulas (docs/metrics.md) -------------------------
def _groups(argv):
    out = json.loads(kv_run(argv + ["format=json"]))
    return out, {(g["kind"], g["window"]): g for g in out["groups"]}


def test_deepseek_v3_latent_bytes_per_token():
    out, g = _groups(["model=deepseek-v3", "seq_len=8192", "kv_dtype=bf16"])
    assert g[("latent", None)]["bytes_per_token"] == 61 * (512 + 64) * 2 == 70_272
    assert out["total_bytes"] == 70_272 * 8192
    assert out["dense_bytes_per_token"] == 2 * 61 * 128 * 64 * 2 == 1_998_848  # what the dense formula said
    text = kv_run(["model=deepseek-v3", "seq_len=8192", "kv_dtype=bf16"])
    assert "70,272" in text and "61 x (512 + 64) x 2" in text and "28.44x the estimate" in text


def test_gemma3_27b_groups():
    out, g = _groups(["model=gemma-3-27b", "seq_len=8192", "kv_dtype=bf16"])
    per_layer = 2 * 16 * 128 * 2
    assert g[("full", None)]["total_bytes"] == 10 * per_layer * 8192
    assert g[("sliding", 1024)]["total_bytes"] == 52 * per_layer * 1023  # the last W - 1 tokens
    assert out["total_bytes"] == 1_106_870_272
    # paged, blocks of 16: the sliding layers hold the blocks that cover their 1023 tokens
    out, g = _groups(["model=gemma-3-27b", "seq_len=8192", "kv_dtype=bf16", "block_size=16"])
    assert g[("sliding", 1024)]["tokens_per_sequence"] == (64 + 1) * 16  # ceil(1023 / 16) + 1 edge block
    assert g[("full", None)]["tokens_per_sequence"] == 8192


def test_gpt_oss_and_qwen3_next_groups():
    _, g = _groups(["model=gpt-oss-120b", "seq_len=8192", "kv_dtype=bf16"])
    assert g[("full", None)]["total_bytes"] == 18 * 2 * 8 * 64 * 2 * 8192
    assert g[("sliding", 128)]["total_bytes"] == 18 * 2 * 8 * 64 * 2 * 127
    out, g = _groups(["model=qwen3-next-80b-a3b", "seq_len=8192", "batch_size=2", "kv_dtype=bf16"])
    conv = (4 - 1) * (2 * 16 * 128 + 32 * 128)  # (kernel - 1) x (q + k + v channels)
    rec = 32 * 128 * 128  # value heads x key dim x value dim
    assert g[("linear", None)]["state_bytes"] == 36 * (conv + rec) * 2
    assert g[("linear", None)]["total_bytes"] == 2 * 36 * (conv + rec) * 2
    assert g[("full", None)]["total_bytes"] == 2 * 12 * 2 * 2 * 256 * 2 * 8192
    # a state does not grow with the sequence
    _, g2 = _groups(["model=qwen3-next-80b-a3b", "seq_len=100", "batch_size=2", "kv_dtype=bf16"])
    assert g2[("linear", None)]["total_bytes"] == g[("linear", None)]["total_bytes"]


def test_llama4_chunked_at_most_the_chunk():
    _, g = _groups(["model=llama-4-scout", "seq_len=131072", "kv_dtype=bf16"])
    assert g[("chunked", 8192)]["tokens_per_sequence"] == 8191
    assert g[("chunked", 8192)]["total_bytes"] == 36 * 2 * 8 * 128 * 2 * 8191
    assert g[("full", None)]["total_bytes"] == 12 * 2 * 8 * 128 * 2 * 131072


def test_int8_and_fp8_per_group():
    _, g = _groups(["model=deepseek-v3", "seq_len=10", "kv_dtype=int8"])
    assert g[("latent", None)]["bytes_per_token"] == 61 * ((512 + 64) * 1 + 4)
    _, g = _groups(["model=gpt-oss-20b", "seq_len=10", "kv_dtype=fp8"])
    assert g[("sliding", 128)]["bytes_per_token"] == 12 * 2 * 8 * 64


def test_sliding_blocks_follow_vllms_freeing():
    """Blocks a sliding layer holds: from the block of the first still-needed token to the last,
    as vLLM's SlidingWindowManager frees them (tests/test_vllm_families.py checks it on vLLM)."""
    from harness.core.kvcalc import blocks_now, held_tokens
    # vLLM frees when it schedules the step that computes token L, from the L - 1 computed before
    assert blocks_now("sliding", 100, 16, 32) == 7 - (99 - 32 + 1) // 16  # ceil(100/16) - floor(68/16)
    assert blocks_now("sliding", 97, 16, 32) == 7 - (96 - 32 + 1) // 16 == 3  # 65 skipped: 4 blocks freed
    assert blocks_now("sliding", 96, 16, 32) == 6 - 64 // 16 == 2  # the last 32 tokens: blocks 4 and 5
    assert blocks_now("chunked", 100, 16, 64) == 7 - 64 // 16
    assert blocks_now("chunked", 64, 16, 64) == 4  # token 64 opens a new chunk; 63 still computed in the old
    assert blocks_now("full", 100, 16, None) == 7
    assert held_tokens("sliding", 20, 32, None) == 20 and held_tokens("sliding", 2000, 32, None) == 31
    assert held_tokens("sliding", 2000, 32, 16) == 3 * 16  # 31 tokens over at most 3 blocks


def test_all_covers_the_new_presets():
    text = kv_run(["all", "seq_len=8192", "kv_dtype=bf16"])
    for name in PUBLISHED:
        assert name in text
    assert "61M" in text and "52S1024 10F" in text and "36R 12F" in text


# ---- bad input -----------------------------------------------------------------------------
def _kv_cli(*args):
    return subprocess.run([sys.executable, "-m", "harness.kv_cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_unknown_family_with_a_latent_rank_exits_2(tmp_path):
    """A family transformers knows and infer-bench does not (GLM-4-MoE-Lite: latent attention) is
    refused, naming the field, rather than sized by the dense formula."""
    d = _ckpt(tmp_path, {"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite"})
    r = _kv_cli("model=local", f"model.path={d}", "seq_len=8192")
    assert r.returncode == 2, r.stderr
    assert "kv_lora_rank" in r.stderr and "glm4_moe_lite" in r.stderr and "Traceback" not in r.stderr


def test_unknown_layer_kind_exits_2(tmp_path):
    cfg = json.loads(json.dumps(PUBLISHED["gpt-oss-120b"]))
    cfg["layer_types"][3] = "indexed_attention"  # transformers allows it; infer-bench does not model it
    r = _kv_cli("model=local", f"model.path={_ckpt(tmp_path, cfg)}")
    assert r.returncode == 2 and "layer_types" in r.stderr and "indexed_attention" in r.stderr
    assert "full_attention" in r.stderr  # what it understands


def test_falcon_h1_parallel_hybrid_is_refused(tmp_path):
    cfg = {"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "hidden_size": 256,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
           "mamba_d_ssm": 512, "mamba_n_heads": 8}
    with pytest.raises(UserError, match="falcon_h1"):
        shape_from_hf_config(_ckpt(tmp_path, cfg))


def test_inconsistent_preset_layer_list_is_refused():
    good = load_preset("gpt-oss-20b").to_dict()
    with pytest.raises(UserError, match=r"model.layer_types: 25 entries for num_hidden_layers=24"):
        shape_from_mapping({**good, "layer_types": list(good["layer_types"]) + ["full"]})
    with pytest.raises(UserError, match=r"unknown kind\(s\) global"):
        shape_from_mapping({**good, "layer_types": ["global"] * 24})
    with pytest.raises(UserError, match="sliding_window"):
        shape_from_mapping({**good, "sliding_window": None})
    with pytest.raises(UserError, match="linear_attention"):
        shape_from_mapping({**good, "layer_types": ["linear"] * 24})


def test_inconsistent_preset_exits_2_from_the_cli():
    r = subprocess.run([sys.executable, "-m", "harness.cli", "model=gpt-oss-20b", "model.num_hidden_layers=23",
                        "engines=[hf]"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "layer_types" in (r.stdout + r.stderr) and "Traceback" not in r.stderr


# ---- the roofline: active parameters, experts touched, KV by group ---------------------------
def test_roofline_uses_active_parameters_and_the_experts_a_batch_touches():
    from harness.core.roofline import (Ceilings, annotate, decode_bytes_per_step, decode_weight_bytes,
                                       experts_touched, prefill_flops)
    mix = load_preset("mixtral-8x7b")
    total, active = mix.num_parameters(), mix.active_parameters()
    per_expert = 3 * 4096 * 14336
    assert total - active == 32 * (8 - 2) * per_expert
    assert experts_touched(mix, 1) == 2 and abs(experts_touched(mix, 1000) - 8) < 1e-9
    unread = lambda b: (32000 - b) * 4096  # noqa: E731  untied: the embedding rows the batch does not look up
    assert decode_weight_bytes(mix, "bfloat16", 1) == (active - unread(1)) * 2  # one token: its 2 experts per layer
    assert decode_weight_bytes(mix, "bfloat16", 1000) == pytest.approx((total - unread(1000)) * 2)  # a big batch: all experts
    two = 8 * (1 - (1 - 2 / 8) ** 2)  # two tokens: 3.5 experts expected per layer
    assert decode_weight_bytes(mix, "bfloat16", 2) == pytest.approx((active - unread(2) + 32 * (two - 2) * per_expert) * 2)
    # prefill: 2 x active non-embedding weights per token + the LM head once + causal attention
    embed = 32000 * 4096
    s = 512
    assert prefill_flops(mix, 1, s) == 2 * (active - 2 * embed) * s + 2 * embed + 32 * 2 * 32 * 256 * s * s / 2
    # decode: a window's layers read at most the window, a hybrid's linear layers their state
    oss = load_preset("gpt-oss-20b")
    kv = decode_bytes_per_step(oss, "bfloat16", "bf16", 1, 4096) - decode_weight_bytes(oss, "bfloat16", 1)
    assert kv == 12 * 2 * 8 * 64 * 2 * 4096 + 12 * 2 * 8 * 64 * 2 * 127
    nxt = load_preset("qwen3-next-80b-a3b")
    kv = decode_bytes_per_step(nxt, "bfloat16", "bf16", 1, 1000) - decode_weight_bytes(nxt, "bfloat16", 1)
    assert kv == 12 * 2 * 2 * 256 * 2 * 1000 + 36 * ((4 - 1) * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128) * 2
    ceil = Ceilings("cpu", "cpu", "bfloat16", 2, 1e10, 1e11, "now")
    row = {"batch_size": 1, "prompt_len": 64, "output_len": 8, "dtype": "bfloat16", "prefill_latency_s": 0.1,
           "decode_step_latency_s": 0.01}
    out = annotate(row, load_preset("tiny-mixtral"), ceil)
    assert out["model_params_active"] < out["model_params_total"] == load_preset("tiny-mixtral").num_parameters()
    assert out["decode_bytes_per_step"] == decode_bytes_per_step(load_preset("tiny-mixtral"), "bfloat16", "bf16", 1,
                                                                 64 + 8 / 2)


def test_decode_bytes_count_the_embedding_rows_a_step_looks_up():
    """Untied embeddings: a decode step of b tokens reads b rows of the input table (the LM head
    has its own matrix); tied: the LM head reads the whole table, counted once. (The whole table
    was counted untied too: 49 of the `small` preset's 256 MB a step.)"""
    from harness.core.roofline import decode_weight_bytes
    small = load_preset("small")
    assert not small.tie_word_embeddings
    table = small.vocab_size * small.hidden_size
    assert decode_weight_bytes(small, "bfloat16", 1) == (small.active_parameters() - table + small.hidden_size) * 2
    assert (decode_weight_bytes(small, "bfloat16", 16) - decode_weight_bytes(small, "bfloat16", 1)
            == 15 * small.hidden_size * 2)
    tied = shape_from_mapping({**small.to_dict(), "tie_word_embeddings": True})
    assert tied.active_parameters() == small.active_parameters() - table
    assert decode_weight_bytes(tied, "bfloat16", 1) == decode_weight_bytes(tied, "bfloat16", 16) == tied.active_parameters() * 2


def test_roofline_of_an_uncounted_family_says_why():
    from harness.core.roofline import Ceilings, annotate
    shape = shape_from_mapping({**load_preset("tiny").to_dict(), "architecture": "olmo"})
    out = annotate({"batch_size": 1, "prompt_len": 8, "output_len": 4, "dtype": "float32", "prefill_latency_s": 1},
                   shape, Ceilings("cpu", "cpu", "float32", 2, 1e10, 1e11, "now"))
    assert list(out) == ["roofline_note"] and "olmo" in out["roofline_note"]


def test_vllm_refusal_is_its_own_line_and_only_from_inside_vllm():
    from adapters.vllm.engine import model_refusal

    def raised(code, filename):
        try:
            exec(compile(code, filename, "exec"), {})
        except Exception as e:
            return e
    inside = raised("raise ValueError('Head dimension 80 is not supported by MLA.\\nmore')", "/x/vllm/mla.py")
    assert model_refusal(inside) == "ValueError: Head dimension 80 is not supported by MLA."
    assert model_refusal(raised("raise ValueError('Head dimension 80 is not supported')", "/x/adapters/ours.py")) is None
    assert model_refusal(raised("raise RuntimeError('out of memory')", "/x/vllm/worker.py")) is None

"""The model families the harness knows: one record per family, so that a family is added in one
place.

A `Family` is keyed by transformers' `model_type` (which is also `ModelShape.architecture`) and
holds both directions of its config mapping side by side:

  read   a checkpoint's transformers config -> the ModelShape fields beyond the dense sizes, as
         the family's configuration_<family>.py names them (harness.core.presets reads
         config.json with it);
  write  a ModelShape -> the config.json fields beyond the common ones, for a preset
         materialised as a random-weight checkpoint (ModelShape.hf_config_dict; None: the family
         is config-only - the estimator and the roofline read it, a run needs the real checkpoint);

plus its *ForCausalLM class, whether `ModelShape.num_parameters()` knows its parameter layout
(checked against transformers for every tiny preset by tests/test_families.py) and its norms per
layer. An engine's own support of a family is the engine's (adapters/reference/families.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.core.errors import UserError

# `ModelShape` (harness.core.shapes, which reads this table) is named in annotations as text only:
# importing it here would make the two modules a cycle
ModelShape = Any

# transformers' layer_types names -> ours
HF_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
            "linear_attention": "linear", "attention": "full", "mamba": "linear"}
# ours -> transformers' (what a materialised checkpoint's layer_types says)
HF_LAYER_TYPES = {"full": "full_attention", "latent": "full_attention", "sliding": "sliding_attention",
                  "chunked": "chunked_attention", "linear": "linear_attention"}


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type; ModelShape.architecture
    hf_class: str  # its causal LM's class in transformers
    read: Callable[[Any, str], dict[str, Any]]  # (transformers config, where for messages) -> ModelShape fields
    # (shape, config.json so far, its layer_types in transformers' names) -> None, completing the
    # config in place; None: config-only
    write: Callable[[ModelShape, dict[str, Any], list[str]], None] | None = None
    counted: bool = True  # num_parameters() knows its layout
    norms_per_layer: int = 2  # RMSNorms per decoder layer (Gemma: 4)


def layer_types(cfg: Any, where: str, attr: str = "layer_types") -> tuple[str, ...]:
    """A config's per-layer kinds in our names; UserError for a kind or a count that is wrong."""
    raw = list(getattr(cfg, attr, None) or [])
    unknown = sorted({str(k) for k in raw if k not in HF_KINDS})
    if unknown:
        raise UserError(f"{where}: {attr} has layer kind(s) {', '.join(unknown)} that infer-bench does not "
                        f"understand (it reads {', '.join(HF_KINDS)}); it gives no KV figure rather than a wrong one.")
    n = int(cfg.num_hidden_layers)
    if len(raw) != n:
        raise UserError(f"{where}: {attr} has {len(raw)} entries for num_hidden_layers={n}.")
    return tuple(HF_KINDS[k] for k in raw)


def _sparse_dense_layers(cfg: Any) -> tuple[int, ...]:
    """Qwen3-MoE / Qwen3-Next: a layer is MoE unless in mlp_only_layers or off decoder_sparse_step."""
    only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return tuple(i for i in range(int(cfg.num_hidden_layers)) if i in only or (i + 1) % step != 0)


def _g(cfg: Any) -> Callable[..., Any]:
    return lambda name, default=None: getattr(cfg, name, default)


def _leading(indices: tuple[int, ...]) -> int:
    """How many leading layers are dense, for a family that only has that (DeepSeek's
    first_k_dense_replace); UserError when the dense layers are not the first ones."""
    k = len(indices)
    if tuple(sorted(indices)) != tuple(range(k)):
        raise UserError(f"model.dense_layers: {list(indices)}; this family's dense layers are the first k "
                        "(first_k_dense_replace). Give 0, 1, .., k-1.")
    return k


# ---- LLaMA, Mistral, Mixtral ----------------------------------------------------------------------

def _read_llama(cfg: Any, where: str) -> dict[str, Any]:
    return {}


def _write_llama(s: ModelShape, cfg: dict[str, Any], kinds: list[str]) -> None:
    cfg["attention_bias"] = s.attention_bias
    cfg["mlp_bias"] = False


def _read_mistral(cfg: Any, where: str) -> dict[str, Any]:  # one window for every layer, when set
    return {"sliding_window": _g(cfg)("sliding_window")}


def _write_mistral(s: ModelShape, cfg: dict[str, Any], kinds: list[str]) -> None:
    cfg["sliding_window"] = s.sliding_window


def _read_mixtral(cfg: Any, where: str) -> dict[str, Any]:
    g = _g(cfg)
    return {"sliding_window": g("sliding_window"), "num_experts": int(g("num_local_experts")),
            "num_experts_per_tok": int(g("num_experts_per_tok")), "moe_intermediate_size": int(g("intermediate_size"))}


def _write_mixtral(s: ModelShape, cfg: dict[str, Any], kinds: list[str]) -> None:
    cfg.update(num_local_experts=s.num_experts, num_experts_per_tok=s.num_experts_per_tok,
               sliding_window=s.sliding_window)
    cfg["intermediate_size"] = s.moe_intermediate_size


# ---- Qwen ---------------------------------------------------------------------------------------------

def _read_qwen(cfg: Any, where: str) -> dict[str, Any]:  # qwen2, qwen3
    g = _g(cfg)
    window = g("sliding_window") if g("use_sliding_window", False) else None
    kinds = layer_types(cfg, where)
    if not window:  # transformers gives a sliding layer no window then: it attends to everything
        kinds = tuple("full" if k == "sliding" else k for k in kinds)
    return {"sliding_window": window if "sliding" in kinds else None,
            "layer_types": None if set(kinds) == {"full"} else kinds, "qk_norm": g("model_type") == "qwen3"}


def _write_qwen(s: ModelShape, cfg: dict[str, Any], kinds: list[str]) -> None:
    cfg["use_sliding_window"] = bool(s.sliding_window)
    cfg["sliding_window"] = s.sliding_window
    cfg["max_window_layers"] = s.num_hidden_layers
    cfg["layer_types"] = kinds
    if s.architecture == "qwen3":
        cfg["attention_bias"] = s.attention_bias


def _read_qwen3_moe(cfg: Any, where: str) -> dict[str, Any]:
    g = _g(cfg)
    window = g("sliding_window") if g("use_sliding_window", False) else None
    return {"sliding_window": window, "qk_norm": True, "num_experts": int(g("num_experts")),
            "num_experts_per_tok": int(g("num_experts_per_tok")),
            "moe_intermediate_size": int(g("moe_intermediate_size")), "dense_layers": _sparse_dense_layers(cfg)}


def _write_qwen3_moe(s: ModelShape, cfg: dict[str, Any], kinds: list[str]) -> None:
    cfg.update(num_experts=s.num_experts, num_experts_per_tok=s.num_experts_per_tok,
               moe_intermediate_size=s.moe_intermediate_size, decoder_sparse_step=1,
               mlp_only_layers=list(s.dense_layers), norm_topk_prob=True, attention_bias=s.attention_bias)


def _read_qwen3_next(cfg: Any, where: str) -> dict[str, Any]:
    g = _g(cfg)
    return {"layer_types": layer_types(cfg, where), "qk_norm": True,
            "linear_attention": {"kind": "gated_deltanet", "num_key_heads": int(g("linear_num_key_heads")),
                                 "num_value_heads": int(g("linear_num_value_heads")),
                                 "key_head_dim": int(g("linear_key_head_dim")),
                                 "value_head_dim": int(g("linear_value_head_dim")),
                                 "conv_kernel": int(g("linear_conv_kernel_dim"))},
            "num_experts": int(g("num_experts")), "num_experts_per_tok": int(g("num_experts_per_tok")),
            "moe_intermediate_size": int(g("moe_intermediate_size")),
            "shared_expert_intermediate_size": int(g("shared_expert_intermediate_size") or 0) or None,
            "dense_layers": _sparse_dense_layers(cfg)}


def _write_qwen3_next(s: ModelShape, cfg: dict[str, Any], kinds: list[str]) -> None:
    _write_qwen3_moe(s, cfg, kinds)
    la = s.linear_attention or {}
    cfg.update(layer_types=kinds, shared_expert_intermediate_size=s.shared_expert_intermediate_size,
               linear_num_key_heads=la.get("num_key_heads"), linear_num_value_heads=la.get("num_value_heads"),
               linear_key_head_dim=la.get("key_head_dim"), linear_value_head_dim=la.get("value_head_dim"),
               linear_conv_kernel_dim=la.get("conv_kernel"), partial_rotary_factor=0.25)


# ---- DeepSeek -----------------------------------------------------------------------------------------

def _read_deepseek(cfg: Any, where: str) -> dict[str, Any]:  # deepseek_v2, deepseek_v3
    g = _g(cfg)
    first = int(g("first_k_dense_replace", 0) or 0)
    return {"kv_lora_rank": int(g("kv_lora_rank")), "q_lora_rank": g("q_lora_rank"),
            "qk_rope_head_dim": int(g("qk_rope_head_dim")), "qk_nope_head_dim": int(g("qk_nope_head_dim")),
            "v_head_dim": int(g("v_head_dim")), "num_experts": int(g("n_routed_experts")),
            "num_experts_per_tok": int(g("num_experts_per_tok")),
            "num_shared_experts": int(g("n_shared_experts", 0) or 0),
            "moe_intermediate_size": int(g("moe_intermediate_size")), "dense_layers": tuple(range(first))}


def _write_deepseek_v3(s: ModelShape, cfg: dict[str, Any], kinds: list[str]) -> None:
    cfg.update(kv_lora_rank=s.kv_lora_rank, q_lora_rank=s.q_lora_rank,
               qk_rope_head_dim=s.qk_rope_head_dim, qk_nope_head_dim=s.qk_nope_head_dim,
               v_head_dim=s.v_head_dim, n_routed_experts=s.num_experts,
               num_experts_per_tok=s.num_experts_per_tok, n_shared_experts=s.num_shared_experts,
               moe_intermediate_size=s.moe_intermediate_size,
               first_k_dense_replace=_leading(s.dense_layers), n_group=1, topk_group=1,
               norm_topk_prob=True, routed_scaling_factor=1.0, attention_bias=s.attention_bias,
               rope_interleave=True, topk_method="noaux_tc",  # DeepSeek-V3's (vLLM loads the gate's bias then)
               scoring_func="sigmoid")  # DeepSeek-V3's router; transformers always uses it, vLLM's default is softmax
    cfg.pop("head_dim")


# ---- Gemma, gpt-oss -----------------------------------------------------------------------------------

def _read_gemma(cfg: Any, where: str) -> dict[str, Any]:  # gemma2, gemma3_text
    g = _g(cfg)
    return {"layer_types": layer_types(cfg, where), "sliding_window": g("sliding_window"),
            "qk_norm": g("model_type") == "gemma3_text"}


def _write_gemma3(s: ModelShape, cfg: dict[str, Any], kinds: list[str]) -> None:
    cfg.update(layer_types=kinds, sliding_window=s.sliding_window, hidden_activation="gelu_pytorch_tanh",
               query_pre_attn_scalar=s.head_dim, attention_bias=s.attention_bias, rope_local_base_freq=s.rope_theta)
    cfg.pop("hidden_act")


def _read_gpt_oss(cfg: Any, where: str) -> dict[str, Any]:
    g = _g(cfg)
    return {"layer_types": layer_types(cfg, where), "sliding_window": g("sliding_window"),
            "num_experts": int(g("num_local_experts")), "num_experts_per_tok": int(g("num_experts_per_tok")),
            "moe_intermediate_size": int(g("intermediate_size")), "attention_sinks": True}


def _write_gpt_oss(s: ModelShape, cfg: dict[str, Any], kinds: list[str]) -> None:
    cfg.update(layer_types=kinds, sliding_window=s.sliding_window, num_local_experts=s.num_experts,
               num_experts_per_tok=s.num_experts_per_tok, attention_bias=s.attention_bias)
    cfg["intermediate_size"] = s.moe_intermediate_size
    cfg.pop("rope_scaling", None)  # gpt-oss names it rope_parameters (vLLM's gpt_oss reads yarn's from it)
    cfg["rope_parameters"] = {**(s.rope_scaling or {"rope_type": "default"}), "rope_theta": s.rope_theta}


# ---- config-only: Llama 4, Granite 4, Jamba ------------------------------------------------------------

def _read_llama4(cfg: Any, where: str) -> dict[str, Any]:
    g = _g(cfg)
    moe = set(g("moe_layers") or [])
    return {"layer_types": layer_types(cfg, where), "attention_chunk_size": g("attention_chunk_size"),
            "num_experts": int(g("num_local_experts")), "num_experts_per_tok": int(g("num_experts_per_tok")),
            "num_shared_experts": 1, "moe_intermediate_size": int(g("intermediate_size")),
            "intermediate_size": int(g("intermediate_size_mlp")),
            "dense_layers": tuple(i for i in range(int(cfg.num_hidden_layers)) if i not in moe)}


def _read_granite_hybrid(cfg: Any, where: str) -> dict[str, Any]:
    g = _g(cfg)
    experts = int(g("num_local_experts", 0) or 0)
    out = {"layer_types": layer_types(cfg, where),
           "linear_attention": {"kind": "mamba2", "num_heads": int(g("mamba_n_heads")),
                                "head_dim": int(g("mamba_d_head")), "state_size": int(g("mamba_d_state")),
                                "n_groups": int(g("mamba_n_groups")), "conv_kernel": int(g("mamba_d_conv"))}}
    if experts > 1:
        out.update(num_experts=experts, num_experts_per_tok=int(g("num_experts_per_tok")),
                   moe_intermediate_size=int(g("intermediate_size")),
                   shared_expert_intermediate_size=int(g("shared_intermediate_size") or 0) or None)
    return out


def _read_jamba(cfg: Any, where: str) -> dict[str, Any]:
    g = _g(cfg)
    per_layer = list(g("layers_num_experts"))
    out = {"layer_types": layer_types(cfg, where),
           "linear_attention": {"kind": "mamba", "intermediate_size": int(g("mamba_expand")) * int(cfg.hidden_size),
                                "state_size": int(g("mamba_d_state")), "conv_kernel": int(g("mamba_d_conv"))}}
    if max(per_layer) > 1:
        out.update(num_experts=max(per_layer), num_experts_per_tok=int(g("num_experts_per_tok")),
                   moe_intermediate_size=int(cfg.intermediate_size),
                   dense_layers=tuple(i for i, e in enumerate(per_layer) if e <= 1))
    return out


# ---- the table ------------------------------------------------------------------------------------------

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", _read_llama, _write_llama),
    Family("mistral", "MistralForCausalLM", _read_mistral, _write_mistral),
    Family("qwen2", "Qwen2ForCausalLM", _read_qwen, _write_qwen),
    Family("qwen3", "Qwen3ForCausalLM", _read_qwen, _write_qwen),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", _read_qwen3_moe, _write_qwen3_moe),
    Family("mixtral", "MixtralForCausalLM", _read_mixtral, _write_mixtral),
    Family("deepseek_v2", "DeepseekV2ForCausalLM", _read_deepseek),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", _read_deepseek, _write_deepseek_v3),
    Family("gemma2", "Gemma2ForCausalLM", _read_gemma, norms_per_layer=4),
    Family("gemma3_text", "Gemma3ForCausalLM", _read_gemma, _write_gemma3, norms_per_layer=4),
    Family("gpt_oss", "GptOssForCausalLM", _read_gpt_oss, _write_gpt_oss),
    Family("qwen3_next", "Qwen3NextForCausalLM", _read_qwen3_next, _write_qwen3_next),
    Family("llama4_text", "Llama4ForCausalLM", _read_llama4),
    Family("granitemoehybrid", "GraniteMoeHybridForCausalLM", _read_granite_hybrid, counted=False),
    Family("jamba", "JambaForCausalLM", _read_jamba, counted=False),
)}

# what an unknown model_type may say that the dense formula cannot stand for
EXOTIC = ("kv_lora_rank", "q_lora_rank", "attention_chunk_size", "layer_types", "layers_block_type",
          "num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
          "linear_num_key_heads", "linear_conv_kernel_dim", "mamba_d_state", "mamba_n_heads", "ssm_state_size",
          "state_size", "time_step_rank", "use_sliding_window", "sliding_window", "sliding_window_pattern")


def family_fields(cfg: Any, model_type: str, where: str) -> dict[str, Any]:
    """The ModelShape fields of a config beyond the dense sizes: its family's `read`; for a
    model_type no record has, nothing (an unknown dense decoder: sizes only) unless the config says
    what the dense formula cannot stand for (UserError: no KV figure rather than a wrong one)."""
    fam = FAMILIES.get(model_type)
    if fam is not None:
        return fam.read(cfg, where)
    if model_type == "falcon_h1":
        raise UserError(f"{where}: model_type falcon_h1 runs attention and a Mamba-2 block side by side in every "
                        "layer (layers_block_type 'hybrid'); infer-bench does not model that yet and gives no KV "
                        "figure rather than a wrong one. It understands full, sliding, chunked, latent and linear "
                        "layers, one kind per layer.")
    said = [k for k in EXOTIC if getattr(cfg, k, None) not in (None, False, 0, [], ())]
    if said:
        raise UserError(f"{where}: model_type {model_type or 'missing'} sets {', '.join(said)}, which infer-bench "
                        f"cannot interpret for this family (it reads {', '.join(FAMILIES)} configs); it gives no KV "
                        "figure rather than one from the dense formula.")
    return {}

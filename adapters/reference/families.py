"""Which model families the reference engine runs: one function, so that it never runs one wrongly.

The reference engine (model.py) runs LLaMA, Mistral (with or without its window), Qwen2 and Qwen3
(qk-norm; per-layer full or sliding attention from `layer_types`), the MoE families Qwen3-MoE and
Mixtral, DeepSeek-V3 (latent attention; its routed experts with sigmoid scores, the gate's
correction bias, group-limited top-k and shared experts, after its leading dense layers),
Gemma 3 text (gemma.py: its (1 + w) norms, four per layer, qk-norm, query_pre_attn_scalar,
gelu-tanh MLP, scaled embeddings, a RoPE table per layer type) and gpt-oss (attention sinks,
alternating windows, its biased router and clamped-SwiGLU experts with biases; unquantised
weights: its MXFP4 checkpoints are refused at load); plain, linear, llama3 or YaRN RoPE.
Anything else a shape says (another family such as Gemma 2, chunked or linear-attention layers,
sinks outside gpt-oss, a multimodal wrapper's checkpoint) it refuses in one line naming what it lacks. The harness calls this at plan time
(adapters.unsupported_model), so the engine's row is `unavailable` with that line and parity takes
transformers as its base. Widen it together with model.py (its family_fields, which refuse the
same things at load; its SUPPORTED_ARCHITECTURES and QK_NORM are these lists by transformers class,
from the harness's one table of families, harness/core/families.py). model.py also refuses at load what a shape
does not carry: a DeepSeek-V3 config whose scoring_func is not sigmoid, or whose n_group does not
divide its experts; a Gemma 3 config with logit softcapping, bidirectional attention, another
hidden_activation or another local (sliding_attention) rope_type (gemma_config.gemma_config).
"""

from __future__ import annotations

from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gemma3_text", "gpt_oss")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")  # routed experts the engine computes
SINK_FAMILIES = ("gpt_oss",)
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text")
LATENT_FAMILIES = ("deepseek_v3",)
ROPE_TYPES = ("linear", "llama3", "yarn")
KINDS = ("full", "sliding", "latent")


def unsupported_reason(shape: Any) -> str | None:
    """Why the reference engine cannot run a model of this `harness.core.shapes.ModelShape`
    (None: it can)."""
    lacks: list[str] = []
    arch = shape.architecture
    if arch not in FAMILIES:
        lacks.append(f"the {arch} family")
    elif (shape.hf_architecture or "").endswith("ForConditionalGeneration"):  # e.g. Gemma 3's image-text model
        lacks.append(f"the {shape.hf_architecture} checkpoint (its language model's *ForCausalLM only)")
    kinds = sorted(set(shape.layer_kinds()) - set(KINDS))
    if kinds:
        lacks.append(f"{' and '.join(kinds)} attention layers")
    if "latent" in shape.layer_kinds() and arch not in LATENT_FAMILIES:
        lacks.append(f"latent attention in the {arch} family")
    if shape.num_experts and "moe" in shape.mlp_kinds() and arch not in MOE_FAMILIES:
        lacks.append(f"the {arch} family's routed experts ({shape.num_experts} experts)")
    if shape.qk_norm and arch not in QK_NORM_FAMILIES:
        lacks.append(f"qk-norm in the {arch} family")
    if shape.attention_sinks and arch not in SINK_FAMILIES:
        lacks.append(f"attention sinks in the {arch} family")
    rope = (shape.rope_scaling or {}).get("rope_type")
    if rope and rope not in ROPE_TYPES:
        lacks.append(f"rope_type {rope}")
    if not lacks:
        return None
    return (f"the reference engine runs {'/'.join(FAMILIES)} decoders (experts: "
            f"{'/'.join(MOE_FAMILIES)}); it lacks {', '.join(lacks)}")

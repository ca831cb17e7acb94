"""Gemma 3's config fields the reference engine reads (gemma.py computes with them). Kept apart
from gemma.py so that model.ModelConfig can read them without importing the model code that
builds on model.py (no import cycle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ACTIVATION = "gelu_pytorch_tanh"
SOFTCAPPING = ("attn_logit_softcapping", "final_logit_softcapping")


@dataclass(frozen=True)
class GemmaConfig:
    query_pre_attn_scalar: float  # the attention scale is its inverse square root
    local_rope_theta: float  # the sliding_attention layers' RoPE
    local_rope_scaling: dict | None = field(hash=False)  # as ModelConfig.rope_scaling; None: plain RoPE
    local_layers: tuple[bool, ...] = ()  # per layer: a sliding_attention (local) layer


def gemma_config(path: str | Path, hf) -> GemmaConfig:
    """Gemma 3's fields of a transformers Gemma3TextConfig; ValueError (one line, naming the
    field) for what the engine does not compute."""
    where = f"{path}: config.json"
    for name in SOFTCAPPING:
        value = getattr(hf, name, None)
        if value is not None:
            raise ValueError(f"{where} {name}={value}: logit softcapping (Gemma 2's) is not supported by the "
                             "reference engine (Gemma 3 sets it null). Use engine hf for this model.")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"{where} use_bidirectional_attention=true is not supported by the reference engine "
                         "(causal attention only). Use engine hf for this model.")
    act = getattr(hf, "hidden_activation", None) or ACTIVATION
    if act != ACTIVATION:
        raise ValueError(f"{where} hidden_activation={act} is not supported by the reference engine "
                         f"(Gemma 3's {ACTIVATION} only). Use engine hf for this model.")
    local = dict((getattr(hf, "rope_parameters", None) or {}).get("sliding_attention") or {})
    kind = local.get("rope_type", "default")
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"{where} rope_parameters.sliding_attention.rope_type={kind} is not supported by the "
                         "reference engine (default, linear and llama3 are).")
    kinds = list(hf.layer_types)
    if len(kinds) != int(hf.num_hidden_layers):
        raise ValueError(f"{where} layer_types has {len(kinds)} entries for {hf.num_hidden_layers} layers.")
    return GemmaConfig(float(hf.query_pre_attn_scalar), float(local.get("rope_theta", 10000.0)),
                       None if kind == "default" else {**local, "rope_type": kind},
                       tuple(k == "sliding_attention" for k in kinds))

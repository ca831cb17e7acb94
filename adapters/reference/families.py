"""Which model families the reference engine runs: one function, so that it never runs one wrongly.

The reference engine (model.py) is a dense LLaMA-family decoder with full attention: LLaMA,
Mistral without a sliding window, Qwen2; plain, linear or llama3 RoPE. Anything else a shape says
(another family, sliding or chunked windows, latent or linear attention, experts, qk-norm, sinks)
it refuses in one line naming what it lacks. The harness calls this at plan time
(adapters.unsupported_model), so the engine's row is `unavailable` with that line and parity takes
transformers as its base. Widen it together with model.py.
"""

from __future__ import annotations

from typing import Any

FAMILIES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("linear", "llama3")


def unsupported_reason(shape: Any) -> str | None:
    """Why the reference engine cannot run a model of this `harness.core.shapes.ModelShape`
    (None: it can)."""
    lacks: list[str] = []
    if shape.architecture not in FAMILIES:
        lacks.append(f"the {shape.architecture} family")
    kinds = sorted(set(shape.layer_kinds()) - {"full"})
    if kinds:
        lacks.append(f"{' and '.join(kinds)} attention layers")
    if shape.num_experts:
        lacks.append(f"mixture-of-experts MLPs ({shape.num_experts} experts)")
    if shape.qk_norm:
        lacks.append("qk-norm")
    if shape.attention_sinks:
        lacks.append("attention sinks")
    rope = (shape.rope_scaling or {}).get("rope_type")
    if rope and rope not in ROPE_TYPES:
        lacks.append(f"rope_type {rope}")
    if not lacks:
        return None
    return (f"the reference engine runs dense full-attention {'/'.join(FAMILIES)} decoders; it lacks "
            f"{', '.join(lacks)}")

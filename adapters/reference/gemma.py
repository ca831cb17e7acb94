"""Gemma 3 (Gemma3ForCausalLM, model_type gemma3_text) on model.py's decoder: what it adds, as
transformers' models/gemma3/modeling_gemma3.py computes it.

- RMSNorm x / rms(x) * (1 + w), in float32 and the result cast back to the model's dtype
  (transformers: x.float() normalised, times (1 + w.float()), then cast). Each norm's weight is
  stored once, at load, as the float32 (1 + w) (`norm_weight`).
- four norms per layer: input_layernorm (before attention), post_attention_layernorm (on the
  attention's output, before the residual add), pre_feedforward_layernorm (before the MLP) and
  post_feedforward_layernorm (on the MLP's output, before the residual add). LLaMA's
  post_attention_layernorm is the norm before the MLP; here that is pre_feedforward_layernorm
  (`LayerWeights.post_norm`), and post_attention_layernorm is `attn_out_norm`.
- qk-norm with that norm, per head, before RoPE.
- attention scale query_pre_attn_scalar ** -0.5, not head_dim ** -0.5. Every attention kernel
  (attention.py's plain path, the CPU's fused decode, CUDA's) scales the scores by
  head_dim ** -0.5; the ratio of the two is folded into the query norm's weight at load
  (`attention_scale`), so that each of them computes Gemma's scores unchanged and at no cost
  per step.
- MLP: down(gelu_tanh(gate(x)) * up(x)) (hidden_activation gelu_pytorch_tanh).
- embeddings times sqrt(hidden_size), that factor rounded to the model's dtype first (as
  transformers' scaled embedding does); the tied output matrix is the unscaled embedding.
- RoPE per layer type (rope_parameters keyed by layer type): the global (full_attention) layers
  use the config's theta and scaling (ModelConfig.rope_theta / rope_scaling, which the shape reader
  takes from rope_parameters["full_attention"]), the local (sliding_attention) layers a table of
  their own (`GemmaConfig.local_rope_theta` / `local_rope_scaling`).
- sliding windows per layer from `layer_types`, as Qwen3's (model.family_fields, layer_groups.py).

Refused at load, in one line naming the field: attn_logit_softcapping or final_logit_softcapping
set (Gemma 2's tanh softcapping, which this engine does not compute; Gemma 3 leaves both null),
use_bidirectional_attention, a hidden_activation other than gelu_pytorch_tanh, and a local
rope_type other than default, linear or llama3.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from adapters.reference.model import ROWS, LayerWeights, Linear, Model, ModelConfig, cat, rope_inv_freq, rope_tables

def norm_weight(w: torch.Tensor) -> torch.Tensor:
    """A Gemma norm's stored weight w as the float32 factor it multiplies by: 1 + w."""
    return 1.0 + w.float()


def attention_scale(cfg: ModelConfig) -> float:
    """What the attention scores are multiplied by: query_pre_attn_scalar ** -0.5."""
    return cfg.gemma.query_pre_attn_scalar ** -0.5


class GemmaModel(Model):
    """model.Model with Gemma 3's norms, MLP, embedding scale, attention scale and local RoPE
    table; the forward pass is Model's (model.model_class picks this class)."""

    def __init__(self, cfg: ModelConfig, path: str | Path, dtype: torch.dtype, device: torch.device,
                 max_len: int = 0, make_linear: Callable[..., Linear] = Linear, rows: int | None = ROWS):
        super().__init__(cfg, path, dtype, device, max_len, make_linear, rows)  # layers: _gemma_layer
        g = cfg.gemma
        self.norm = norm_weight(self.norm)
        local = replace(cfg, rope_theta=g.local_rope_theta, rope_scaling=g.local_rope_scaling)
        self.local_cos, self.local_sin = rope_tables(rope_inv_freq(local), self.rope_len, device, dtype)
        # transformers keeps sqrt(hidden_size) as a float32 tensor and casts it to the weights' dtype
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(device=device, dtype=dtype)

    def _gemma_layer(self, i: int, take, make_linear) -> LayerWeights:
        p = f"layers.{i}."
        a, mlp = p + "self_attn.", p + "mlp."

        def norm(name: str) -> torch.Tensor:
            return norm_weight(take(p + name + ".weight"))

        # the kernels scale scores by head_dim ** -0.5: the queries carry the rest of Gemma's scale
        q_factor = attention_scale(self.cfg) * self.cfg.head_dim ** 0.5
        return LayerWeights(
            input_norm=norm("input_layernorm"),
            qkv=make_linear(cat(take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")),
                            cat(take(a + "q_proj.bias", False), take(a + "k_proj.bias", False),
                                take(a + "v_proj.bias", False))),
            o=make_linear(take(a + "o_proj.weight"), take(a + "o_proj.bias", False)),
            attn_out_norm=norm("post_attention_layernorm"),
            post_norm=norm("pre_feedforward_layernorm"),
            gate_up=make_linear(cat(take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")), None),
            down=make_linear(take(mlp + "down_proj.weight"), None),
            mlp_out_norm=norm("post_feedforward_layernorm"),
            q_norm=norm("self_attn.q_norm") * q_factor,
            k_norm=norm("self_attn.k_norm"),
            local_rope=self.cfg.gemma.local_layers[i],
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma's norm: x / rms(x) * (1 + w) in float32 (`weight` holds 1 + w), cast back to x's dtype."""
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.cfg.rms_norm_eps).to(x.dtype)

    def attention_output_and_mlp(self, x: torch.Tensor, o: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """h = x + norm(o_proj(o)); then h + norm(down(gelu_tanh(gate(norm(h))) * up(norm(h))))."""
        h = x + self.rms_norm(layer.o(o), layer.attn_out_norm)
        gate, up = layer.gate_up(self.rms_norm(h, layer.post_norm)).chunk(2, dim=-1)
        return h + self.rms_norm(layer.down(F.gelu(gate, approximate="tanh").mul_(up)), layer.mlp_out_norm)

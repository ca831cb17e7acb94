"""A LLaMA-family decoder (LLaMA, Mistral without sliding window, Qwen2) in plain PyTorch.

The forward pass works on a *flat* batch: the new tokens of every scheduled sequence laid end to
end ([T] token ids with their positions), so the linear layers never see padding. Attention is
the one place where sequences must be told apart; the model hands it to a callable,
`attend(layer, q, k, v)`, which the runner builds for each step (see attention.py).

Weights are read straight from the checkpoint's safetensors files. Q, K and V are fused into
one matrix, and so are the MLP's gate and up projections: one matrix product instead of three
(or two), which matters most for small decode batches.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # rope_type linear | llama3 and their parameters; None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read config.json; a ValueError names what this engine cannot run."""
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path}: no config.json; give a Hugging Face checkpoint directory.")
        cfg = json.loads(cfg_file.read_text())
        arch = (cfg.get("architectures") or ["unknown"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported by the reference engine "
                             f"(it runs {', '.join(SUPPORTED_ARCHITECTURES)}). Use engine hf for this model.")
        window = cfg.get("sliding_window")
        if window and (arch == "MistralForCausalLM" or cfg.get("use_sliding_window")):
            raise ValueError(f"{arch} with sliding_window={window} is not supported by the reference "
                             "engine (full attention only).")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_type {rope_type} is not supported by the reference engine "
                             "(default, linear and llama3 are).")
        heads = int(cfg["num_attention_heads"])
        return cls(
            architecture=arch,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else rope | {"rope_type": rope_type},
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The rotary frequencies (float32), with linear or Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    factor = float(s["factor"])
    if s["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed down by `factor`, short ones kept, the band between blended
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, hidden]: Q, K and V fused
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate and up fused
    down: torch.Tensor


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files; the reference engine loads safetensors only.")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                tensors[name.removeprefix("model.")] = st.get_tensor(name)
    return tensors


class Model:
    def __init__(self, cfg: ModelConfig, path: str | Path, dtype: torch.dtype, device: torch.device,
                 max_len: int = 0):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        raw = _read_safetensors(Path(path))

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = raw.pop(name, None)
            if t is None and required:
                raise ValueError(f"{path}: the checkpoint lacks {name}.")
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        def cat(*parts: torch.Tensor | None) -> torch.Tensor | None:
            return None if parts[0] is None else torch.cat(parts).contiguous()

        self.embed = take("embed_tokens.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            self.layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=cat(take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight")),
                qkv_bias=cat(take(attn + "q_proj.bias", False), take(attn + "k_proj.bias", False),
                             take(attn + "v_proj.bias", False)),
                o=take(attn + "o_proj.weight"),
                o_bias=take(attn + "o_proj.bias", False),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=cat(take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")),
                down=take(mlp + "down_proj.weight"),
            ))
        self.norm = take("norm.weight")
        lm_head = raw.pop("lm_head.weight", None)
        if lm_head is None or cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = lm_head.to(device=device, dtype=dtype).contiguous()
        # cos/sin for every position, computed once in float32 and stored in the model's dtype
        self.rope_len = max(cfg.max_position_embeddings, max_len)
        freqs = torch.outer(torch.arange(self.rope_len, dtype=torch.float), rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def num_bytes(self) -> int:
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x / rms(x) * weight; torch's fused kernel accumulates in float32."""
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on [T, heads, head_dim] (halves rotated, not interleaved pairs)."""
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Run the flat batch through the decoder; return float32 logits [N, vocab] of the tokens
        at `logits_indices` only (the last token of each sequence that samples this step)."""
        c = self.cfg
        t = input_ids.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            qkv = F.linear(self.rms_norm(x, layer.input_norm), layer.qkv, layer.qkv_bias)
            # Q and K sit side by side in the fused output: one rotation for both
            qk = self.rotate(qkv[:, :q_size + kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size:].view(t, c.num_kv_heads, c.head_dim)
            o = attend(i, q, k, v)  # [T, heads * head_dim]
            if i == len(self.layers) - 1:  # past the last attention only the sampled rows matter
                o, x = o[logits_indices], x[logits_indices]
            x = x + F.linear(o, layer.o, layer.o_bias)
            gate, up = F.linear(self.rms_norm(x, layer.post_norm), layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return F.linear(self.rms_norm(x, self.norm), self.lm_head).float()

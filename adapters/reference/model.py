"""A LLaMA-family decoder (LLaMA, Mistral without sliding window, Qwen2) in plain PyTorch.

The forward pass works on a *flat* batch: the new tokens of every scheduled sequence laid end to
end ([T] token ids with their positions), so the linear layers never see padding. Attention is
the one place where sequences must be told apart; the model hands it to a callable,
`attend(layer, q, k, v)`, which the runner builds for each step (see attention.py).

Weights are read straight from the checkpoint's safetensors files. Q, K and V are fused into
one matrix, and so are the MLP's gate and up projections: one matrix product instead of three
(or two), which matters most for small decode batches. Only the rows that sample a token go
through the last layer's MLP and the output matrix.

This is the plain path. The device's kernels (kernels.py) may replace `Linear` (on a CPU:
weights packed once for oneDNN, residual adds fused; kernels_cpu.py) and the slicing of long
prefills (`rows`: CPU caches; none on a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.core.errors import UserError
from harness.core.presets import shape_from_hf_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROWS = 1024  # CPU: tokens per slice of the token-wise parts of a layer (see in_slices)


def in_slices(fn: Callable[..., torch.Tensor], *xs: torch.Tensor, rows: int | None = ROWS) -> torch.Tensor:
    """fn over slices of `rows` tokens of `xs` (the same rows of each), results concatenated.
    A long prefill's big intermediates (the MLP's [tokens, 2 x intermediate] activations, the
    float32 copies inside RMSNorm) then stay in the CPU's caches: measured ~25% faster for the
    MLP of 4,096 tokens of the `small` preset, and up to 2x for RMSNorm. rows=None: no slicing
    (a GPU wants one big kernel, not many)."""
    n = xs[0].shape[0]
    if rows is None or n <= rows:
        return fn(*xs)
    return torch.cat([fn(*(x[i:i + rows] for x in xs)) for i in range(0, n, rows)])


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
        """The checkpoint's config (read by harness.core.presets, the project's one config.json
        reader); a ValueError names what this engine cannot run."""
        try:
            shape = shape_from_hf_config(path)
        except UserError as e:
            raise ValueError(e.problems[0]) from None
        arch = shape.hf_architecture or "unknown"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported by the reference engine "
                             f"(it runs {', '.join(SUPPORTED_ARCHITECTURES)}). Use engine hf for this model.")
        if shape.sliding_window:
            raise ValueError(f"{arch} with sliding_window={shape.sliding_window} is not supported by the reference "
                             "engine (full attention only).")
        rope = shape.rope_scaling
        if rope and rope["rope_type"] not in ("linear", "llama3"):
            raise ValueError(f"rope_type {rope['rope_type']} is not supported by the reference engine "
                             "(default, linear and llama3 are).")
        return cls(
            architecture=arch,
            num_layers=shape.num_hidden_layers,
            hidden_size=shape.hidden_size,
            num_heads=shape.num_attention_heads,
            num_kv_heads=shape.num_key_value_heads,
            head_dim=shape.head_dim,
            intermediate_size=shape.intermediate_size,
            vocab_size=shape.vocab_size,
            rms_norm_eps=shape.rms_norm_eps,
            rope_theta=shape.rope_theta,
            rope_scaling=rope,
            max_position_embeddings=shape.max_position_embeddings,
            tie_word_embeddings=shape.tie_word_embeddings,
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


class Linear:
    """y = x @ W.T + b, optionally plus a residual (`x2 = linear.add(h, x)`: x + h @ W.T + b).
    The plain path; kernels_cpu.PackedLinear has the same interface on a oneDNN-packed weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.shape = tuple(weight.shape)
        self.nbytes = weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T + b."""
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out + self.bias


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # [(heads + 2 kv_heads) * head_dim, hidden]: Q, K and V fused (bias: Qwen2)
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]: gate and up fused
    down: Linear


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
                 max_len: int = 0, make_linear: Callable[..., Linear] = Linear, rows: int | None = ROWS):
        """`make_linear(weight, bias)` builds every matrix product (the device's kernels choose);
        `rows`: slice length of long prefills (None: no slicing)."""
        self.cfg, self.dtype, self.device, self.rows = cfg, dtype, device, rows
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
                qkv=make_linear(cat(take(attn + "q_proj.weight"), take(attn + "k_proj.weight"),
                                    take(attn + "v_proj.weight")),
                                cat(take(attn + "q_proj.bias", False), take(attn + "k_proj.bias", False),
                                    take(attn + "v_proj.bias", False))),
                o=make_linear(take(attn + "o_proj.weight"), take(attn + "o_proj.bias", False)),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=make_linear(cat(take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")), None),
                down=make_linear(take(mlp + "down_proj.weight"), None),
            ))
        self.norm = take("norm.weight")
        lm_head = raw.pop("lm_head.weight", None)
        self.tied = lm_head is None or cfg.tie_word_embeddings
        self.lm_head = make_linear(self.embed if self.tied else lm_head.to(device=device, dtype=dtype).contiguous(), None)
        unused = [k for k in raw if not k.endswith("rotary_emb.inv_freq")]
        if unused:  # e.g. MLP biases: refuse rather than silently compute another model
            raise ValueError(f"{path}: weights the reference engine does not use: {', '.join(unused[:5])}"
                             f"{' ...' if len(unused) > 5 else ''}. Use engine hf for this model.")
        # cos/sin for every position, computed once in float32 and stored in the model's dtype
        self.rope_len = max(cfg.max_position_embeddings, max_len)
        freqs = torch.outer(torch.arange(self.rope_len, dtype=torch.float), rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        half = cfg.head_dim // 2  # the first half of rotate_half(x) is -x2: store -sin there
        self.sin = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1).to(device=device, dtype=dtype)

    def num_bytes(self) -> int:
        """Bytes of the model's parameters (a tied output matrix counted once)."""
        linears = [self.lm_head] if not self.tied else []
        norms = [self.embed, self.norm]
        for layer in self.layers:
            linears += [layer.qkv, layer.o, layer.gate_up, layer.down]
            norms += [layer.input_norm, layer.post_norm]
        return sum(x.nbytes for x in linears) + sum(t.numel() * t.element_size() for t in norms)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x / rms(x) * weight; torch's fused kernel accumulates in float32."""
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on [T, heads, head_dim], halves rotated (not interleaved pairs):
        x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1) = roll(x) * (-1, +1);
        the sign is folded into `sin` (see __init__)."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)

    def attention_input(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """Q, K and V, fused: qkv(norm(x))."""
        return layer.qkv(self.rms_norm(x, layer.input_norm))

    def attention_output_and_mlp(self, x: torch.Tensor, o: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """h = x + o_proj(o); then h + down(silu(gate(norm(h))) * up(norm(h)))."""
        h = layer.o.add(o, x)
        gate, up = layer.gate_up(self.rms_norm(h, layer.post_norm)).chunk(2, dim=-1)
        return layer.down.add(F.silu(gate).mul_(up), h)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                logits_indices: torch.Tensor | None) -> torch.Tensor:
        """Run the flat batch through the decoder; return float32 logits [N, vocab] of the tokens
        at `logits_indices` only (the last token of each sequence that samples this step, and any
        scored positions); None: of every token (a decode step: each row samples)."""
        c = self.cfg
        t = input_ids.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            qkv = in_slices(lambda xs: self.attention_input(xs, layer), x, rows=self.rows)
            # Q and K sit side by side in the fused output: one rotation for both
            qk = self.rotate(qkv[:, :q_size + kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size:].view(t, c.num_kv_heads, c.head_dim)
            o = attend(i, q, k, v)  # [T, heads * head_dim]
            if i == len(self.layers) - 1 and logits_indices is not None:  # only the sampled rows matter now
                if logits_indices.numel() == 0:  # a step of unfinished prompt chunks only
                    return torch.empty(0, c.vocab_size, device=x.device)
                o, x = o[logits_indices], x[logits_indices]
            x = in_slices(lambda xs, os: self.attention_output_and_mlp(xs, os, layer), x, o, rows=self.rows)
        return self.lm_head(self.rms_norm(x, self.norm)).float()

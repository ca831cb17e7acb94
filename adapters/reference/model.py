"""A LLaMA-family decoder in plain PyTorch: LLaMA, Mistral (with its sliding window), Qwen2, Qwen3
(qk-norm), the mixture-of-experts families Qwen3-MoE and Mixtral, DeepSeek-V3 (latent
attention, mla.py; its routed and shared experts), Gemma 3 (gemma.py: its norms, MLP, scale
and two RoPE tables on this decoder) and gpt-oss (attention sinks, its experts).

The forward pass works on a *flat* batch: the new tokens of every scheduled sequence laid end to
end ([T] token ids with their positions), so the linear layers never see padding. Attention is
the one place where sequences must be told apart; the model hands it to a callable,
`attend(layer, q, k, v)`, which the runner builds for each step (see attention.py).

Weights are read straight from the checkpoint's safetensors files. Q, K and V are fused into
one matrix, and so are the MLP's gate and up projections: one matrix product instead of three
(or two), which matters most for small decode batches. Only the rows that sample a token go
through the last layer's MLP and the output matrix.

Families (read from the checkpoint's transformers config, see `family_fields`):
- qk-norm (Qwen3, Qwen3-MoE): an RMSNorm over each head's head_dim values of Q and of K, before
  RoPE (`q_norm`, `k_norm` weights of head_dim values per layer).
- sliding windows: `ModelConfig.windows` gives each layer's window W (None: full attention); a
  query at position p sees the keys at p - W < j <= p (transformers' convention). Mistral and
  Mixtral put `sliding_window` on every layer; Qwen2/Qwen3 (and -MoE) name each layer's kind in
  `layer_types` (sliding_attention / full_attention). The paged cache keeps one block table per
  group of layers with the same window and frees what leaves a window (kv_cache.GroupedPool).
- mixture of experts (`MoE`): router logits -> softmax (float32) -> top-k -> the top-k weights
  renormalised to sum 1 (Mixtral always; Qwen3-MoE when `norm_topk_prob`), see `route`. The
  tokens routed to each expert are gathered and run through it as one matrix product per expert
  (a loop over the experts a step touched, never over tokens), and scattered back weighted.
  Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step` layers keep a dense MLP.
  DeepSeek-V3's router is a variant of it (`route_sigmoid`): the router in float32, sigmoid
  scores, the experts chosen on the scores plus the gate's `e_score_correction_bias` (within the
  `topk_group` best of `n_group` groups), weighted by their un-biased scores (renormalised when
  `norm_topk_prob`, times `routed_scaling_factor`); a shared SwiGLU expert runs on every token
  beside them. Its first `first_k_dense_replace` layers keep a dense MLP.
- gpt-oss (GptOssForCausalLM): Q/K/V/O with biases; a learned attention sink per head and layer
  (`LayerWeights.sinks`, float32; attention.softmax_with_sink); sliding and full layers from
  `layer_types`; every layer sparse. Its router has a bias and takes the top k of the *logits*,
  then a softmax over those k (`route_topk_softmax`). Its experts have biases and a clamped
  SwiGLU (`clamped_swiglu`): gate clamped above at `swiglu_limit`, up to +-limit,
  (up + 1) * gate * sigmoid(alpha * gate). transformers stores them fused and transposed,
  gate_up_proj [E, hidden, 2I] with gate and up *interleaved* (columns 0, 2, 4, ... are the
  gate's): they are transposed and de-interleaved at load (`gpt_oss_experts`). Its published
  checkpoints keep the experts in MXFP4 (`*_blocks`, `*_scales`): refused at load.
- Gemma 3 (`gemma`, gemma.GemmaModel): its sliding layers (`layer_types`, as Qwen3's) rotate
  with their own RoPE table (`local_cos`/`local_sin`, `LayerWeights.local_rope`) and the
  embeddings are scaled (`embed_scale`); the rest (norms, MLP, attention scale) is gemma.py's.

This is the plain path. The device's kernels (kernels.py) may replace `Linear` (on a CPU:
weights packed once for oneDNN, residual adds fused; kernels_cpu.py) and the slicing of long
prefills (`rows`: CPU caches; none on a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from adapters.reference.families import FAMILIES, QK_NORM_FAMILIES, ROPE_TYPES  # ROPE_TYPES: besides the default
from adapters.reference.mla import MLAConfig, deinterleave, rms, split_latent
from harness.core.errors import UserError
from harness.core.families import FAMILIES as HF_FAMILIES
from harness.core.presets import shape_from_hf_config

if TYPE_CHECKING:
    from adapters.reference.gemma_config import GemmaConfig

# the families this engine runs (families.py), by their transformers class (harness.core.families)
SUPPORTED_ARCHITECTURES = tuple(HF_FAMILIES[f].hf_class for f in FAMILIES)
QK_NORM = tuple(HF_FAMILIES[f].hf_class for f in QK_NORM_FAMILIES)
# per-layer kinds in layer_types
LAYER_TYPES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM")
WINDOW_ON_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM")
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
class MoEConfig:
    """A sparse MLP: `num_experts` SwiGLU experts of `intermediate_size`, `top_k` per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalise: bool  # the top-k weights divided by their sum
    weights_in_model_dtype: bool  # Qwen3-MoE casts the routing weights to the model's dtype; Mixtral keeps float32
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP
    # "qwen3_moe" and "deepseek_v3" (mlp.gate, mlp.experts.N.{gate,up,down}_proj) | "mixtral" (block_sparse_moe, w1/w3/w2)
    # | "gpt_oss" (mlp.router with a bias, mlp.experts.{gate_up,down}_proj[_bias] fused; gpt_oss_experts)
    naming: str
    # "softmax": Qwen3-MoE and Mixtral (route); "sigmoid": DeepSeek-V3 (route_sigmoid), with the fields
    # below; "topk_softmax": gpt-oss (route_topk_softmax)
    scoring: str = "softmax"
    n_group: int = 1  # the experts in n_group equal groups, the choice limited to the topk_group best
    topk_group: int = 1
    scaling: float = 1.0  # routed_scaling_factor: the routing weights times this
    shared_intermediate_size: int = 0  # one shared SwiGLU expert of this size on every token (0: none)
    # the experts' activation: SwiGLU, or gpt-oss's clamped one (swiglu_limit set; clamped_swiglu)
    swiglu_alpha: float = 1.0
    swiglu_limit: float | None = None


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
    qk_norm: bool = False  # RMSNorm of each head of Q and K before RoPE (Qwen3)
    windows: tuple[int | None, ...] | None = None  # per layer: the sliding window, None for full; None: all full
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None  # latent attention (DeepSeek-V3): every layer; see mla.py
    gemma: GemmaConfig | None = None  # Gemma 3's extras (gemma.py)
    attention_sinks: bool = False  # a learned sink logit per head and layer (gpt-oss; attention.softmax_with_sink)

    def window(self, layer: int) -> int | None:
        return None if self.windows is None else self.windows[layer]

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
        rope = shape.rope_scaling
        if rope and rope["rope_type"] not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope['rope_type']} is not supported by the reference engine "
                             f"(default, {', '.join(ROPE_TYPES)} are).")
        if rope and float(rope.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(f"rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']} is not supported "
                             "by the reference engine (RoPE over the whole head only).")
        extra = family_fields(path, arch, shape)
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
            **extra,
        )


def family_fields(path: str | Path, arch: str, shape) -> dict:
    """What a family adds to the LLaMA shape (qk-norm, windows per layer, experts), read from the
    checkpoint's transformers config (its class supplies the family's defaults). LLaMA and a
    Qwen2/Mistral without a window need nothing more, and transformers is not imported."""
    if arch not in QK_NORM + ("MixtralForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM") and not shape.sliding_window:
        return {}
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
    n = int(hf.num_hidden_layers)
    out: dict = {"qk_norm": arch in QK_NORM}
    windows: list[int | None] = [None] * n
    w = getattr(hf, "sliding_window", None)
    if arch in WINDOW_ON_EVERY_LAYER and w:
        windows = [int(w)] * n
    elif arch in LAYER_TYPES and w:  # their config sets sliding_window to None unless use_sliding_window
        kinds = list(getattr(hf, "layer_types", None) or [])
        if len(kinds) != n:
            raise ValueError(f"{path}: config.json layer_types has {len(kinds)} entries for {n} layers.")
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{path}: config.json layer_types: {', '.join(unknown)} is not supported by the "
                             "reference engine (full_attention and sliding_attention are).")
        windows = [int(w) if k == "sliding_attention" else None for k in kinds]
    if any(windows):
        out["windows"] = tuple(windows)
    if arch == "Qwen3MoeForCausalLM" and int(hf.num_experts) > 0:
        dense = set(hf.mlp_only_layers or [])
        step = int(hf.decoder_sparse_step)
        out["moe"] = MoEConfig(int(hf.num_experts), int(hf.num_experts_per_tok), int(hf.moe_intermediate_size),
                               bool(hf.norm_topk_prob), True,
                               tuple(i not in dense and (i + 1) % step == 0 for i in range(n)), "qwen3_moe")
    elif arch == "DeepseekV3ForCausalLM":
        dense = int(hf.first_k_dense_replace or 0)
        experts = int(getattr(hf, "n_routed_experts", 0) or 0)
        if experts > 0 and dense < n:
            out["moe"] = deepseek_moe(path, hf, experts, dense, n)
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") not in ("default", "yarn"):
            raise ValueError(f"{path}: DeepSeek-V3 with rope_type {rope['rope_type']} is not supported by the "
                             "reference engine (default and yarn RoPE are).")
        out["mla"] = MLAConfig(int(hf.kv_lora_rank), int(hf.qk_rope_head_dim), int(hf.qk_nope_head_dim),
                               int(hf.v_head_dim), None if hf.q_lora_rank is None else int(hf.q_lora_rank),
                               bool(hf.rope_interleave), mla_score_factor(rope))
    elif arch == "MixtralForCausalLM":
        out["moe"] = MoEConfig(int(hf.num_local_experts), int(hf.num_experts_per_tok), int(hf.intermediate_size),
                               True, False, (True,) * n, "mixtral")
    elif arch == "GptOssForCausalLM":  # every layer sparse; the router's softmax in the model's dtype
        out["moe"] = MoEConfig(int(hf.num_local_experts), int(hf.num_experts_per_tok), int(hf.intermediate_size),
                               False, True, (True,) * n, "gpt_oss", scoring="topk_softmax",
                               swiglu_alpha=float(hf.swiglu_alpha), swiglu_limit=float(hf.swiglu_limit))
        out["attention_sinks"] = True
    elif arch == "Gemma3ForCausalLM":
        from adapters.reference.gemma_config import gemma_config

        out["gemma"] = gemma_config(path, hf)
    return out


def deepseek_moe(path: str | Path, hf, experts: int, dense: int, n: int) -> MoEConfig:
    """DeepSeek-V3's routed and shared experts (layers dense..n-1) from its transformers config.
    transformers' DeepseekV3 always scores with a sigmoid; a config naming another scoring
    function is refused, since the checkpoint then means something transformers does not compute."""
    scoring = getattr(hf, "scoring_func", None) or "sigmoid"
    if scoring != "sigmoid":
        raise ValueError(f"{path}: DeepSeek-V3 with scoring_func {scoring} is not supported by the reference engine "
                         "(sigmoid only, as transformers computes). Use engine hf for this model.")
    groups, keep = int(hf.n_group or 1), int(hf.topk_group or 1)
    if experts % groups or not 0 < keep <= groups:
        raise ValueError(f"{path}: config.json n_group {groups} / topk_group {keep} do not fit {experts} routed "
                         "experts (n_group must divide them, 1 <= topk_group <= n_group).")
    return MoEConfig(experts, int(hf.num_experts_per_tok), int(hf.moe_intermediate_size), bool(hf.norm_topk_prob),
                     False, tuple(i >= dense for i in range(n)), "deepseek_v3", scoring="sigmoid", n_group=groups,
                     topk_group=keep, scaling=float(hf.routed_scaling_factor),
                     shared_intermediate_size=int(hf.moe_intermediate_size) * int(hf.n_shared_experts or 0))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times the trained one: 0.1 m ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_factor(s: dict, max_position_embeddings: int) -> float:
    """YaRN's `factor`; a config without one (DeepSeek's may) means max / original positions."""
    if s.get("factor") is not None:
        return float(s["factor"])
    return max_position_embeddings / float(s["original_max_position_embeddings"])


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: 1, or under YaRN its attention factor (the config's
    `attention_factor`, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
    given, else mscale(factor)): transformers' choice, taken from the YaRN paper."""
    s = cfg.rope_scaling
    if s is None or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    f = yarn_factor(s, cfg.max_position_embeddings)
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(f, float(s["mscale"])) / yarn_mscale(f, float(s["mscale_all_dim"]))
    return yarn_mscale(f)


def mla_score_factor(rope: dict) -> float:
    """DeepSeek's latent attention under YaRN with `mscale_all_dim`: its softmax scale is
    qk_head_dim ** -0.5 times mscale(factor, mscale_all_dim) squared (every dim of q.k, not only
    the rotated ones; DeepSeek's reference code and transformers' yarn_apply_mscale); else 1."""
    if rope.get("rope_type", "default") == "default" or not rope.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The rotary frequencies (float32), with linear, Llama-3 or YaRN scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "yarn":
        return yarn_inv_freq(inv_freq, s, cfg.rope_theta, cfg.max_position_embeddings)
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


def yarn_inv_freq(inv_freq: torch.Tensor, s: dict, theta: float, max_positions: int) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): a frequency that turns more than `beta_fast` times over the trained
    context (`original_max_position_embeddings`) is kept, one that turns fewer than `beta_slow`
    times is divided by the factor, and the dims between are blended linearly (their bounds
    rounded outwards unless `truncate` is false)."""
    d = 2 * inv_freq.numel()
    f = yarn_factor(s, max_positions)
    trained = float(s["original_max_position_embeddings"])

    def dim_turning(turns: float) -> float:  # the dim whose frequency turns `turns` times over the trained context
        return d * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(float(s.get("beta_fast") or 32)), dim_turning(float(s.get("beta_slow") or 1))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    interpolated = ((torch.arange(d // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    return inv_freq * (1 - interpolated) + inv_freq / f * interpolated


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


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, experts] -> (weights [T, top_k] float32, expert ids [T, top_k]):
    softmax over every expert in float32, then the top k, then (renormalise) divided by their
    sum so that each token's weights add up to 1."""
    weights, ids = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router: logits [T, experts] -> (weights [T, top_k], expert ids [T, top_k]): the
    top k of the logits, then a softmax over those k only (in the logits' dtype, as transformers)."""
    top, ids = logits.topk(top_k, dim=-1)
    return top.softmax(dim=-1), ids


def silu_glu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [tokens, 2 x intermediate] gate-and-up output: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on [gate | up] (de-interleaved at load): the gate clamped
    above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1).mul_(gate * torch.sigmoid(gate * alpha))


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  renormalise: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router: logits [T, experts] -> (weights [T, top_k] float32, expert ids [T, top_k]).
    Scores are sigmoid(logits) in float32. The experts are *chosen* on scores + `bias` (the gate's
    e_score_correction_bias): the experts split into `n_group` equal groups, a group's score the sum
    of its two best, only the `topk_group` best groups' experts eligible, then the top k of those.
    The *weights* are the chosen experts' un-biased scores, (renormalise) divided by their sum,
    then times `scaling`."""
    scores = logits.float().sigmoid()
    choice = scores + bias
    if topk_group < n_group:  # with every group kept the mask changes nothing
        t = choice.shape[0]
        grouped = choice.view(t, n_group, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, n_group]
        dropped = torch.ones_like(group_score, dtype=torch.bool)
        dropped.scatter_(1, group_score.topk(topk_group, dim=-1).indices, False)
        choice = grouped.masked_fill(dropped[..., None], float("-inf")).view(t, -1)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def gpt_oss_experts(base: str, m: MoEConfig, raw: dict, take, make_linear, path) -> MoE:
    """gpt-oss's router (weight and bias) and experts from transformers' fused, transposed tensors:
    gate_up_proj [E, hidden, 2I] with gate and up interleaved column by column (and its bias
    [E, 2I]), down_proj [E, I, hidden] (bias [E, hidden]). Each expert becomes a gate_up Linear
    [2I, hidden] with the gate's rows first, and a down Linear [hidden, I]."""
    if base + "experts.gate_up_proj_blocks" in raw:
        raise ValueError(f"{path}: the experts are stored in MXFP4 (experts.gate_up_proj_blocks / _scales, as gpt-oss's "
                         "published checkpoints); the reference engine reads unquantised weights only. Use engine hf "
                         "or vllm for this checkpoint, or save it dequantised.")
    router = make_linear(take(base + "router.weight"), take(base + "router.bias"))
    gu, gu_bias = take(base + "experts.gate_up_proj"), take(base + "experts.gate_up_proj_bias")
    dn, dn_bias = take(base + "experts.down_proj"), take(base + "experts.down_proj_bias")
    gate_up, down = [], []
    for e in range(m.num_experts):
        w = gu[e].t()  # [2I, hidden], rows gate0, up0, gate1, up1, ...
        gate_up.append(make_linear(torch.cat([w[0::2], w[1::2]]).contiguous(),
                                   torch.cat([gu_bias[e][0::2], gu_bias[e][1::2]]).contiguous()))
        down.append(make_linear(dn[e].t().contiguous(), dn_bias[e].contiguous()))
    return MoE(m, router, gate_up, down)


class MoE:
    """A sparse MLP: a router and `num_experts` SwiGLU experts (gate and up fused per expert).
    DeepSeek-V3 (cfg.scoring "sigmoid") adds the router's correction `bias` (float32, as is its
    router) and a `shared` SwiGLU expert (gate_up, down) that every token goes through unweighted."""

    def __init__(self, cfg: MoEConfig, router: Linear, gate_up: list[Linear], down: list[Linear],
                 bias: torch.Tensor | None = None, shared: tuple[Linear, Linear] | None = None):
        self.cfg, self.router, self.gate_up, self.down = cfg, router, gate_up, down
        self.bias, self.shared = bias, shared
        if cfg.swiglu_limit is None:
            self.activation: Callable[[torch.Tensor], torch.Tensor] = silu_glu
        else:  # gpt-oss
            self.activation = lambda gu: clamped_swiglu(gu, cfg.swiglu_alpha, cfg.swiglu_limit)
        self.touched: set[int] = set()  # experts that received a token since Model.forward began

    def linears(self) -> list[Linear]:
        return [self.router, *self.gate_up, *self.down, *(self.shared or ())]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + sum over each token's top-k experts of weight * expert(x) (+ shared(x))."""
        c = self.cfg
        if c.scoring == "softmax":
            weights, ids = route(self.router(x), c.top_k, c.renormalise)
        elif c.scoring == "topk_softmax":  # gpt-oss
            weights, ids = route_topk_softmax(self.router(x), c.top_k)
        else:  # DeepSeek-V3: the router's product in float32 too (its weight is kept in float32)
            weights, ids = route_sigmoid(self.router(x.float()), self.bias, c.top_k, c.n_group, c.topk_group,
                                         c.renormalise, c.scaling)
        if c.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=c.num_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
        w = weights.reshape(-1)
        first = 0
        for e, n in enumerate(counts):  # one product per expert over all its tokens
            if n == 0:
                continue
            pairs = order[first:first + n]
            first += n
            self.touched.add(e)
            tokens = pairs // c.top_k
            y = self.down[e](self.activation(self.gate_up[e](x[tokens])))
            out.index_add_(0, tokens, y * w[pairs, None])
        if self.shared is not None:  # every token, weight 1
            gate, up = self.shared[0](x).chunk(2, dim=-1)
            residual = self.shared[1].add(F.silu(gate).mul_(up), residual)
        return residual + out.to(x.dtype)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # [(heads + 2 kv_heads) * head_dim, hidden]: Q, K and V fused (bias: Qwen2)
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear | None  # [2 * intermediate, hidden]: gate and up fused (None: a sparse layer)
    down: Linear | None
    q_norm: torch.Tensor | None = None  # [head_dim] (qk-norm)
    k_norm: torch.Tensor | None = None
    moe: MoE | None = None
    mla: dict | None = None  # latent attention's matrices and norms (mla.py); qkv is None then
    # Gemma 3 (gemma.py): norms of the attention's and of the MLP's output, before each residual add
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    local_rope: bool = False  # rotated with the model's local RoPE table (Gemma 3's sliding layers)
    sinks: torch.Tensor | None = None  # [heads] float32: the attention sink logits (gpt-oss)


def cat(*parts: torch.Tensor | None) -> torch.Tensor | None:
    """The parts concatenated along rows (fused weights); None when the first is (an absent bias)."""
    return None if parts[0] is None else torch.cat(parts).contiguous()


def rope_tables(inv_freq: torch.Tensor, length: int, device: torch.device,
                dtype: torch.dtype, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] for every position, computed in float32, times `factor`
    (YaRN's attention factor, rope_attention_factor) and stored in `dtype`; the first half of
    rotate_half(x) is -x2, so -sin is stored there (see Model.rotate)."""
    freqs = torch.outer(torch.arange(length, dtype=torch.float), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    half = emb.shape[-1] // 2
    sin = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)
    return (emb.cos() * factor).to(device=device, dtype=dtype), (sin * factor).to(device=device, dtype=dtype)


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


def read_experts(m: MoEConfig, p: str, raw: dict[str, torch.Tensor], take: Callable[..., Any],
                 make_linear: Callable[..., Linear], path: str | Path) -> MoE:
    """The router and experts of the layer at prefix p: per-expert matrices, or transformers' fused 3-D ones."""
    if m.naming == "gpt_oss":
        return gpt_oss_experts(p + "mlp.", m, raw, take, make_linear, path)
    if m.naming == "mixtral":
        base, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        base, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    bias = shared = None
    if m.scoring == "softmax":
        router = make_linear(take(base + "gate.weight"), None)
    else:  # DeepSeek-V3: router and correction bias in float32 (transformers keeps both so)
        router = Linear(take(base + "gate.weight", as_dtype=torch.float32))
        bias = take(base + "gate.e_score_correction_bias", as_dtype=torch.float32)
    if m.shared_intermediate_size:
        s = base + "shared_experts."
        shared = (make_linear(cat(take(s + "gate_proj.weight"), take(s + "up_proj.weight")), None),
                  make_linear(take(s + "down_proj.weight"), None))
    if base + "experts.gate_up_proj" in raw:  # [E, 2I, H] and [E, H, I]
        gu, dn = take(base + "experts.gate_up_proj"), take(base + "experts.down_proj")
        return MoE(m, router, [make_linear(gu[e].contiguous(), None) for e in range(m.num_experts)],
                   [make_linear(dn[e].contiguous(), None) for e in range(m.num_experts)], bias, shared)
    gate_up, down = [], []
    for e in range(m.num_experts):
        ep = f"{base}experts.{e}."
        gate_up.append(make_linear(cat(take(ep + names[0] + ".weight"), take(ep + names[1] + ".weight")), None))
        down.append(make_linear(take(ep + names[2] + ".weight"), None))
    return MoE(m, router, gate_up, down, bias, shared)


class Model:
    def __init__(self, cfg: ModelConfig, path: str | Path, dtype: torch.dtype, device: torch.device,
                 max_len: int = 0, make_linear: Callable[..., Linear] = Linear, rows: int | None = ROWS):
        """`make_linear(weight, bias)` builds every matrix product (the device's kernels choose);
        `rows`: slice length of long prefills (None: no slicing)."""
        self.cfg, self.dtype, self.device, self.rows = cfg, dtype, device, rows
        self.steps = None  # the device's RMS norm of bf16 rows (kernels.Kernels.steps), set by the engine
        raw = _read_safetensors(Path(path))

        def take(name: str, required: bool = True, as_dtype: torch.dtype = dtype) -> torch.Tensor | None:
            t = raw.pop(name, None)
            if t is None and required:
                raise ValueError(f"{path}: the checkpoint lacks {name}.")
            return None if t is None else t.to(device=device, dtype=as_dtype).contiguous()

        def experts(p: str, i: int) -> MoE:
            return read_experts(cfg.moe, p, raw, take, make_linear, path)

        self.embed = take("embed_tokens.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            sparse = cfg.moe is not None and cfg.moe.sparse_layers[i]
            if cfg.mla is not None:
                self.layers.append(self._mla_layer(p, take, make_linear, experts(p, i) if sparse else None))
                continue
            if cfg.gemma is not None:
                self.layers.append(self._gemma_layer(i, take, make_linear))
                continue
            self.layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=make_linear(cat(take(attn + "q_proj.weight"), take(attn + "k_proj.weight"),
                                    take(attn + "v_proj.weight")),
                                cat(take(attn + "q_proj.bias", False), take(attn + "k_proj.bias", False),
                                    take(attn + "v_proj.bias", False))),
                o=make_linear(take(attn + "o_proj.weight"), take(attn + "o_proj.bias", False)),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=None if sparse else make_linear(cat(take(mlp + "gate_proj.weight"),
                                                            take(mlp + "up_proj.weight")), None),
                down=None if sparse else make_linear(take(mlp + "down_proj.weight"), None),
                q_norm=take(attn + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=take(attn + "k_norm.weight") if cfg.qk_norm else None,
                moe=experts(p, i) if sparse else None,
                sinks=take(attn + "sinks", as_dtype=torch.float32) if cfg.attention_sinks else None,
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
        self.cos, self.sin = rope_tables(rope_inv_freq(cfg), self.rope_len, device, dtype, rope_attention_factor(cfg))
        # Gemma 3 (gemma.GemmaModel sets them): the local layers' table, the embeddings' scale
        self.local_cos: torch.Tensor | None = None
        self.local_sin: torch.Tensor | None = None
        self.embed_scale: torch.Tensor | None = None

    def _gemma_layer(self, i: int, take, make_linear) -> LayerWeights:
        raise NotImplementedError("a Gemma 3 config is loaded by gemma.GemmaModel (llm_engine.model_class)")

    def _mla_layer(self, p: str, take, make_linear, moe: MoE | None) -> LayerWeights:
        """A DeepSeek-V3 layer: latent attention's matrices (mla.py) and a dense SwiGLU MLP, or
        `moe` (routed and shared experts) on the layers after the first `first_k_dense_replace`."""
        a, mlp, m = p + "self_attn.", p + "mlp.", self.cfg.mla
        w = {"kv_a": make_linear(take(a + "kv_a_proj_with_mqa.weight"), take(a + "kv_a_proj_with_mqa.bias", False)),
             "kv_a_norm": take(a + "kv_a_layernorm.weight"), "kv_b": Linear(take(a + "kv_b_proj.weight"))}  # plain: the absorbed decode reads its weight (mla.py)
        if m.q_lora_rank is None:
            w["q"] = make_linear(take(a + "q_proj.weight"), None)
        else:
            w["q_a"] = make_linear(take(a + "q_a_proj.weight"), take(a + "q_a_proj.bias", False))
            w["q_a_norm"] = take(a + "q_a_layernorm.weight")
            w["q_b"] = make_linear(take(a + "q_b_proj.weight"), None)
        layer = LayerWeights(
            input_norm=take(p + "input_layernorm.weight"), qkv=None,
            o=make_linear(take(a + "o_proj.weight"), take(a + "o_proj.bias", False)),
            post_norm=take(p + "post_attention_layernorm.weight"), gate_up=None, down=None, mla=w, moe=moe)
        if moe is None:  # a dense layer
            layer.gate_up = make_linear(torch.cat([take(mlp + "gate_proj.weight"),
                                                   take(mlp + "up_proj.weight")]).contiguous(), None)
            layer.down = make_linear(take(mlp + "down_proj.weight"), None)
        return layer

    def _mla_inputs(self, x: torch.Tensor, layer: LayerWeights, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [T, heads, qk_head_dim] and the latents to cache [T, rank + rope] (mla.py)."""
        m, w, t = self.cfg.mla, layer.mla, x.shape[0]
        h = self.rms_norm(x, layer.input_norm)
        q = w["q"](h) if "q" in w else w["q_b"](rms(w["q_a"](h), w["q_a_norm"]))
        q_nope, q_rot = q.view(t, self.cfg.num_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c, k_rot = split_latent(w["kv_a"](h), m.kv_lora_rank, m.qk_rope_head_dim)
        if m.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q = torch.cat([q_nope, self.rotate(q_rot, cos, sin)], dim=-1)
        k_rot = self.rotate(k_rot[:, None], cos, sin)[:, 0]
        return q, torch.cat([rms(c, w["kv_a_norm"]), k_rot], dim=-1)

    def num_bytes(self) -> int:
        """Bytes of the model's parameters (a tied output matrix counted once)."""
        linears = [self.lm_head] if not self.tied else []
        norms = [self.embed, self.norm]
        for layer in self.layers:
            linears += [layer.qkv, layer.o] if layer.mla is None else [layer.o] + [
                v for v in layer.mla.values() if not isinstance(v, torch.Tensor)]
            norms += [v for v in (layer.mla or {}).values() if isinstance(v, torch.Tensor)]
            linears += layer.moe.linears() if layer.moe else [layer.gate_up, layer.down]
            norms += [t for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm,
                                  layer.attn_out_norm, layer.mlp_out_norm, layer.sinks) if t is not None]
            if layer.moe is not None and layer.moe.bias is not None:
                norms.append(layer.moe.bias)
        return sum(x.nbytes for x in linears) + sum(t.numel() * t.element_size() for t in norms)

    def experts_touched(self) -> list[int]:
        """Per sparse layer, the experts the last forward pass sent a token to (the expert
        weights a step read: what the roofline's bytes per step count)."""
        return [len(layer.moe.touched) for layer in self.layers if layer.moe is not None]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x / rms(x) * weight; torch's fused kernel accumulates in float32 (bf16 rows on a CPU: the
        device's kernel, `steps`, the same arithmetic)."""
        if self.steps is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1:
            return self.steps.rms_norm(x, weight, self.cfg.rms_norm_eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on [T, heads, head_dim], halves rotated (not interleaved pairs):
        x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1) = roll(x) * (-1, +1);
        the sign is folded into `sin` (see __init__)."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)

    def attention_input(self, x: torch.Tensor, layer: LayerWeights, lora: Any = None, i: int = 0,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
        """Q, K and V, fused: qkv(norm(x)); with LoRA slots (lora.Slots) and the step's row mask,
        plus each row's own adapter's product."""
        xn = self.rms_norm(x, layer.input_norm)
        y = layer.qkv(xn)
        return y if lora is None else lora.add(y, xn, mask, i, "qkv")

    def attention_output_and_mlp(self, x: torch.Tensor, o: torch.Tensor, layer: LayerWeights, lora: Any = None,
                                 i: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        """h = x + o_proj(o); then h + down(silu(gate(norm(h))) * up(norm(h))); with LoRA, each
        projection plus each row's own adapter's product (as in attention_input)."""
        h = layer.o.add(o, x)
        if lora is not None:
            lora.add(h, o, mask, i, "o")
        if layer.moe is not None:
            return layer.moe(self.rms_norm(h, layer.post_norm), h)
        hn = self.rms_norm(h, layer.post_norm)
        gate_up = layer.gate_up(hn)
        if lora is not None:
            lora.add(gate_up, hn, mask, i, "gate_up")
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate).mul_(up)
        out = layer.down.add(act, h)
        return out if lora is None else lora.add(out, act, mask, i, "down")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                logits_indices: torch.Tensor | None, lora: Any = None,
                lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the flat batch through the decoder; return float32 logits [N, vocab] of the tokens
        at `logits_indices` only (the last token of each sequence that samples this step, and any
        scored positions); None: of every token (a decode step: each row samples). `lora` (LoRA
        slots, lora.Slots) and `lora_mask` (the step's row mask, Slots.mask): each row's projections
        plus its own adapter's product; a whole layer in C (the fused decode layer) is not used then."""
        c = self.cfg
        t = input_ids.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        local = None  # Gemma 3: the local layers' cos/sin
        if self.local_cos is not None:
            local = self.local_cos[positions].unsqueeze(1), self.local_sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:  # Gemma 3: times sqrt(hidden_size), in the model's dtype
            x = x * self.embed_scale
        if c.moe is not None:
            for layer in self.layers:
                if layer.moe is not None:
                    layer.moe.touched.clear()
        fused = getattr(attend, "decode_layer", None)  # a whole layer in C (cpu_layer.py, cpu_amx.py)
        if lora_mask is None:
            lora = None
        else:
            fused = None  # the C layer has no adapters' products
        ls = () if lora is None else (lora_mask,)  # the mask's rows go through in_slices with the tokens'

        def lora_args(i: int, *masks: torch.Tensor) -> dict[str, Any]:
            # only with adapters: a family's own layer (Gemma's) takes no LoRA arguments
            return {} if lora is None else {"lora": lora, "i": i, "mask": masks[0]}
        for i, layer in enumerate(self.layers):
            if fused is not None:
                y = fused(self, i, x, positions)
                if y is not None:
                    x = y
                    if i == len(self.layers) - 1 and logits_indices is not None and logits_indices.numel() != t:
                        x = x[logits_indices]
                    continue
            if layer.mla is not None:
                q, latent = self._mla_inputs(x, layer, cos, sin)
                o = attend(i, q, latent, None)
                if i == len(self.layers) - 1 and logits_indices is not None:
                    if logits_indices.numel() == 0:
                        return torch.empty(0, c.vocab_size, device=x.device)
                    o, x = o[logits_indices], x[logits_indices]
                x = in_slices(lambda xs, os: self.attention_output_and_mlp(xs, os, layer), x, o, rows=self.rows)
                continue
            qkv = in_slices(lambda xs, *ms: self.attention_input(xs, layer, **lora_args(i, *ms)), x, *ls,
                            rows=self.rows)
            # Q and K sit side by side in the fused output: one rotation for both
            qk = qkv[:, :q_size + kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:  # qk-norm: each head's Q and K normalised before RoPE
                qn, kn = qk.split([c.num_heads, c.num_kv_heads], dim=1)
                qk = torch.cat([self.rms_norm(qn, layer.q_norm), self.rms_norm(kn, layer.k_norm)], dim=1)
            if local is not None and layer.local_rope:
                qk = self.rotate(qk, *local)
            else:
                qk = self.rotate(qk, cos, sin)
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size:].view(t, c.num_kv_heads, c.head_dim)
            o = attend(i, q, k, v)  # [T, heads * head_dim]
            if i == len(self.layers) - 1 and logits_indices is not None:  # only the sampled rows matter now
                if logits_indices.numel() == 0:  # a step of unfinished prompt chunks only
                    return torch.empty(0, c.vocab_size, device=x.device)
                o, x = o[logits_indices], x[logits_indices]
                ls = tuple(m[logits_indices] for m in ls)
            x = in_slices(lambda xs, os, *ms: self.attention_output_and_mlp(xs, os, layer, **lora_args(i, *ms)),
                          x, o, *ls, rows=self.rows)
        return self.lm_head(self.rms_norm(x, self.norm)).float()

"""What a decoder's layers are: `ModelShape`, its layer kinds and its parameter counts.

A `ModelShape` carries what the harness needs to know about a decoder: sizes for the KV-cache
estimator (`harness.core.kvcalc`) and the roofline, and enough to build a Hugging Face config
when a preset is materialised as a random-weight checkpoint (see `harness.checkpoint`).

Each layer has an attention kind (`layer_kinds()`):

  full      every token of the sequence is kept (K and V per KV head)
  sliding   only the last `sliding_window` tokens matter (Mistral, Gemma 2/3, gpt-oss)
  chunked   attention within chunks of `attention_chunk_size` tokens (Llama 4's local layers)
  latent    multi-head latent attention (DeepSeek V2/V3): one latent of `kv_lora_rank` plus the
            `qk_rope_head_dim` rope part per token, shared by all heads
  linear    linear attention or a state-space block (Qwen3-Next's Gated DeltaNet, Mamba-2 in
            Granite 4 / Jamba): a fixed state per sequence, whatever its length

and each layer's MLP is dense or a mixture of experts (`mlp_kinds()`). The readers of a
checkpoint's config.json are in `harness.core.presets`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from harness.core.errors import UserError
from harness.core.families import FAMILIES, HF_LAYER_TYPES

# Hugging Face architecture class and model_type for each family a preset may name (the table:
# harness.core.families).
ARCHITECTURES = {k: (f.hf_class, f.model_type) for k, f in FAMILIES.items()}
# Families whose random-weight checkpoint hf_config_dict can write (the others are config-only:
# the estimator and the roofline read them; a run needs the real checkpoint).
MATERIALISABLE = tuple(k for k, f in FAMILIES.items() if f.write is not None)
# Families whose exact parameter count num_parameters() knows (checked against transformers for
# every tiny preset by tests/test_families.py).
COUNTED = MATERIALISABLE + tuple(k for k, f in FAMILIES.items() if f.counted and f.write is None)

LAYER_KINDS = ("full", "sliding", "chunked", "latent", "linear")
# linear_attention kinds and the keys each needs
LINEAR_KEYS = {
    "gated_deltanet": ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"),
    "mamba2": ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel"),
    "mamba": ("intermediate_size", "state_size", "conv_kernel"),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    architecture: str  # a key of ARCHITECTURES (a checkpoint of another family: its model_type)
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's (a dense layer of an MoE model included)
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: str = "float32"  # dtype the checkpoint's weights are stored in
    # special tokens (a checkpoint's config.json; presets write 1, 2 and 0)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # what a checkpoint's config says beyond the sizes (None for presets: plain RoPE, full attention)
    hf_architecture: str | None = None  # e.g. LlamaForCausalLM
    rope_scaling: dict | None = field(default=None, hash=False)  # {"rope_type": linear | llama3 | ..., params}
    sliding_window: int | None = None  # the attention window; without layer_types: every layer's
    # a trained preset's `train:` settings (harness.core.train.TrainConfig); None: random weights
    train: dict | None = field(default=None, hash=False)
    # ---- per layer (None: every layer full attention, or sliding when sliding_window is set) ----
    layer_types: tuple[str, ...] | None = None  # one of LAYER_KINDS per layer ("latent" is implied by kv_lora_rank)
    attention_chunk_size: int | None = None  # chunked layers' chunk
    # ---- multi-head latent attention (DeepSeek V2/V3) ----
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None  # None: a plain q_proj
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    # ---- linear attention / state-space layers: {"kind": gated_deltanet | mamba2, sizes (LINEAR_KEYS)} ----
    linear_attention: dict | None = field(default=None, hash=False)
    state_dtype: str | None = None  # the per-sequence state's dtype (None: the model's)
    # ---- mixture of experts (num_experts 0: dense) ----
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0  # shared experts, each of moe_intermediate_size (DeepSeek; Llama 4: 1)
    moe_intermediate_size: int | None = None  # one routed expert's
    shared_expert_intermediate_size: int | None = None  # one shared MLP of this size (Qwen3-Next)
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model whose MLP is dense (DeepSeek's first k)
    # ---- attention details ----
    qk_norm: bool = False  # RMSNorm over each head's q and k (Qwen3, Gemma 3)
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss)

    def __post_init__(self) -> None:
        # presets come from YAML (lists): keep the frozen dataclass hashable
        for name in ("layer_types", "dense_layers"):
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))

    # ---- layers ----------------------------------------------------------------------------
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind (LAYER_KINDS)."""
        if self.layer_types is not None:
            kinds = tuple(self.layer_types)
        else:
            kinds = ("sliding" if self.sliding_window else "full",) * self.num_hidden_layers
        if self.kv_lora_rank:
            kinds = tuple("latent" if k == "full" else k for k in kinds)
        return kinds

    def mlp_kinds(self) -> tuple[str, ...]:
        """Each layer's MLP: "dense" or "moe"."""
        if not self.num_experts:
            return ("dense",) * self.num_hidden_layers
        dense = set(self.dense_layers)
        return tuple("dense" if i in dense else "moe" for i in range(self.num_hidden_layers))

    def problems(self, prefix: str = "model") -> list[str]:
        """What is inconsistent in this shape, each naming its field (empty: none)."""
        out: list[str] = []
        n = self.num_hidden_layers
        if self.layer_types is not None:
            if len(self.layer_types) != n:
                out.append(f"{prefix}.layer_types: {len(self.layer_types)} entries for num_hidden_layers={n}. "
                           "Give one kind per layer.")
            bad = sorted({str(k) for k in self.layer_types if k not in LAYER_KINDS})
            if bad:
                out.append(f"{prefix}.layer_types: unknown kind(s) {', '.join(bad)}. Each layer is one of "
                           f"{', '.join(LAYER_KINDS)}.")
        kinds = set(self.layer_types or ())
        if "sliding" in kinds and not self.sliding_window:
            out.append(f"{prefix}.sliding_window: layer_types has sliding layers but no window. Set the window in tokens.")
        if "chunked" in kinds and not self.attention_chunk_size:
            out.append(f"{prefix}.attention_chunk_size: layer_types has chunked layers but no chunk size.")
        if "latent" in kinds and not self.kv_lora_rank:
            out.append(f"{prefix}.kv_lora_rank: layer_types has latent layers but no latent rank.")
        if self.kv_lora_rank and not (self.qk_rope_head_dim and self.qk_nope_head_dim and self.v_head_dim):
            out.append(f"{prefix}.qk_rope_head_dim: latent attention (kv_lora_rank={self.kv_lora_rank}) needs "
                       "qk_rope_head_dim, qk_nope_head_dim and v_head_dim.")
        if "linear" in kinds:
            la = self.linear_attention or {}
            need = LINEAR_KEYS.get(str(la.get("kind")))
            if need is None:
                out.append(f"{prefix}.linear_attention: layer_types has linear layers; give linear_attention.kind "
                           f"({' or '.join(LINEAR_KEYS)}) and its sizes.")
            else:
                missing = [k for k in need if not isinstance(la.get(k), int) or la.get(k) <= 0]
                if missing:
                    out.append(f"{prefix}.linear_attention: {la.get('kind')} needs {', '.join(missing)} "
                               "(positive integers).")
        if self.num_experts and "moe" in self.mlp_kinds():  # all layers dense (DeepSeek's first_k_dense_replace >= n): moot
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                out.append(f"{prefix}.num_experts_per_tok: {self.num_experts_per_tok} for num_experts="
                           f"{self.num_experts}. Give 1 .. num_experts.")
            if not self.moe_intermediate_size:
                out.append(f"{prefix}.moe_intermediate_size: an MoE shape needs one expert's intermediate size.")
        bad_dense = [i for i in self.dense_layers if not 0 <= int(i) < n]
        if bad_dense:
            out.append(f"{prefix}.dense_layers: {bad_dense} outside 0..{n - 1}.")
        return out

    def check(self, prefix: str = "model") -> ModelShape:
        problems = self.problems(prefix)
        if problems:
            raise UserError("\n".join(problems))
        return self

    # ---- derived sizes -------------------------------------------------------------------
    def _mlp(self, inter: int) -> int:
        return 3 * self.hidden_size * inter  # gate, up, down

    def _attention_params(self, kind: str) -> int:
        h, d, heads, kvh = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        if kind == "linear":
            return self._linear_params()
        if kind == "latent":
            r, rope, nope, v = self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
            assert r and rope and nope and v
            qk = nope + rope
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk  # a, its norm, b
                if self.attention_bias:
                    q += self.q_lora_rank
            else:
                q = h * heads * qk
            kv = h * (r + rope) + r + r * heads * (nope + v)  # kv_a (with the rope part), its norm, kv_b
            o = heads * v * h
            if self.attention_bias:
                kv += r + rope
                o += h
            return q + kv + o
        q_out = heads * d * (2 if self.architecture == "qwen3_next" else 1)  # Qwen3-Next gates its output
        n = h * q_out + 2 * h * kvh * d + heads * d * h
        if self.attention_bias:  # q, k, v biases; and o_proj's, except in Qwen2
            n += q_out + 2 * kvh * d + (0 if self.architecture == "qwen2" else h)
        if self.qk_norm:
            n += 2 * d
        if self.attention_sinks:
            n += heads
        return n

    def _linear_params(self) -> int:
        la = self.linear_attention or {}
        h = self.hidden_size
        if la.get("kind") == "gated_deltanet":
            hk, hv, dk, dv, kern = (la[k] for k in LINEAR_KEYS["gated_deltanet"])
            key, value = hk * dk, hv * dv
            conv = 2 * key + value
            return (h * (2 * key + 2 * value) + h * 2 * hv  # in_proj_qkvz, in_proj_ba
                    + conv * kern + 2 * hv + dv + value * h)  # conv1d, dt_bias + A_log, gated norm, out_proj
        raise UserError(f"model.linear_attention: the parameter count of {la.get('kind')} layers "
                        f"({self.architecture}) is not known to infer-bench.")

    def _moe_params(self) -> tuple[int, int]:
        """(all parameters, those a token uses) of one MoE layer's MLP block."""
        h, e, k = self.hidden_size, self.num_experts, self.num_experts_per_tok
        inter = self.moe_intermediate_size or 0
        expert = 3 * h * inter
        if self.architecture == "gpt_oss":
            expert += 2 * inter + h  # gate_up and down biases
        router = h * e + (e if self.architecture == "gpt_oss" else 0)
        shared = 3 * h * inter * self.num_shared_experts  # DeepSeek: one MLP of n_shared x moe_intermediate
        if self.shared_expert_intermediate_size:
            shared += self._mlp(self.shared_expert_intermediate_size) + h  # + its sigmoid gate (Linear(h, 1))
        return router + e * expert + shared, router + k * expert + shared

    def _norms_per_layer(self) -> int:
        fam = FAMILIES.get(self.architecture)
        return (fam.norms_per_layer if fam else 2) * self.hidden_size

    def _count(self) -> tuple[int, int]:
        if self.architecture not in COUNTED:
            raise UserError(f"model: infer-bench does not know the parameter layout of {self.architecture} "
                            f"checkpoints (it counts {', '.join(COUNTED)}), so it gives no parameter count, "
                            "weight bytes or roofline for it.")
        total = active = 0
        for kind, mlp in zip(self.layer_kinds(), self.mlp_kinds()):
            a = self._attention_params(kind) + self._norms_per_layer()
            if mlp == "moe":
                t, act = self._moe_params()
            else:
                t = act = self._mlp(self.intermediate_size)
            total += a + t
            active += a + act
        h = self.hidden_size
        rest = self.vocab_size * h + (0 if self.tie_word_embeddings else self.vocab_size * h) + h  # + final norm
        return total + rest, active + rest

    def num_parameters(self) -> int:
        """Exact parameter count of this decoder (every expert of an MoE model)."""
        return self._count()[0]

    def active_parameters(self) -> int:
        """Parameters one token's forward pass uses: the routed experts it is sent to (top-k),
        shared experts, routers and everything outside the MLPs. Equal to num_parameters() for
        a dense model."""
        return self._count()[1]

    def expert_parameters(self) -> int:
        """Parameters of one routed expert (0 for a dense model)."""
        if not self.num_experts:
            return 0
        inter = self.moe_intermediate_size or 0
        return 3 * self.hidden_size * inter + (2 * inter + self.hidden_size if self.architecture == "gpt_oss" else 0)

    def moe_layer_count(self) -> int:
        return sum(1 for m in self.mlp_kinds() if m == "moe")

    # ---- a config.json for transformers ---------------------------------------------------
    def hf_config_dict(self) -> dict[str, Any]:
        """A config.json for transformers, for this shape."""
        if self.architecture not in MATERIALISABLE:
            raise UserError(f"model={self.name}: a {self.architecture} preset is config-only (the estimator and the "
                            f"roofline read it); infer-bench materialises {', '.join(MATERIALISABLE)} checkpoints. "
                            "Use the real checkpoint: model=local model.path=DIR.")
        cls, model_type = ARCHITECTURES[self.architecture]
        cfg: dict[str, Any] = {
            "architectures": [cls],
            "model_type": model_type,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "bos_token_id": 1 if self.bos_token_id is None else self.bos_token_id,
            "eos_token_id": 2 if self.eos_token_id is None else self.eos_token_id,
            "pad_token_id": 0 if self.pad_token_id is None else self.pad_token_id,
            "torch_dtype": self.dtype,
            "use_cache": True,
        }
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        FAMILIES[self.architecture].write(self, cfg, [HF_LAYER_TYPES[k] for k in self.layer_kinds()])  # type: ignore[misc]
        return cfg

    @property
    def trained(self) -> bool:
        """A preset whose weights are trained here (harness.core.train), not drawn at random."""
        return self.train is not None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["train"] is None:  # random presets: the dict (and their cache keys) as before
            del d["train"]
        for f in fields(self):  # the per-layer fields added since, at their defaults: as before too
            if f.name in _LATER_FIELDS and d.get(f.name) == f.default:
                del d[f.name]
        for k in ("layer_types", "dense_layers"):
            if isinstance(d.get(k), tuple):
                d[k] = list(d[k])
        return d


_LATER_FIELDS = {"layer_types", "attention_chunk_size", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                 "qk_nope_head_dim", "v_head_dim", "linear_attention", "state_dtype", "num_experts",
                 "num_experts_per_tok", "num_shared_experts", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "dense_layers", "qk_norm", "attention_sinks"}
SHAPE_FIELDS = {f.name for f in fields(ModelShape)}

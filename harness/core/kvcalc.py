"""The KV-cache estimator (docs/metrics.md, "The KV-cache estimator"), by layer group.

Each layer keeps, per sequence of L tokens (`ModelShape.layer_kinds()`):

  full      2 (K and V) x KV heads x head_dim x element bytes per token, for all L tokens
  sliding   the same per token, for the last W - 1 tokens only (window W)
  chunked   the same per token, for the tokens of the current chunk: at most C - 1 (chunk C)
  latent    (kv_lora_rank + qk_rope_head_dim) x element bytes per token: one latent shared by
            every head, no separate K and V (multi-head latent attention)
  linear    a fixed state per sequence (conv + recurrent), whatever L is

(+ per-token scale bytes for int8 caches: a float32 per token and KV head, for K and for V; one
per token for a latent). Grouped-query models keep `num_key_value_heads` K/V heads, not
`num_attention_heads`. A paged cache holds whole blocks: for full and latent layers
ceil(L / block) blocks; for sliding and chunked layers the blocks that cover the tokens they keep,
partial blocks at both edges included, as vLLM frees them (vllm/v1/core/
single_type_kv_cache_manager.py: get_num_skipped_tokens, applied when a step is scheduled);
see `blocks_now` and `held_tokens`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from harness.core.errors import UserError
from harness.core.presets import ModelShape

# Bytes per stored element, by the names users and engines use for KV dtypes.
_ELEMENT_BYTES = {
    "fp32": 4, "float32": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1,
    "int8": 1,
}
# Quantised caches that keep a scale per token and per KV head (for K and for V), as float32.
# fp8 caches use one scale per tensor (a few bytes per layer), which is not per-token memory.
INT8_SCALE_BYTES = 4
# llama.cpp's block types (ggml): (values per block, bytes per block), each block's scale inside it. A
# row of K (or V) of one token, all its KV heads together (KV heads x head_dim values), is a run of
# such blocks: q8_0 holds 32 int8 values and an fp16 scale in 34 bytes, q4_0 32 4-bit values and an
# fp16 scale in 18 (ggml/src/ggml-common.h: block_q8_0, block_q4_0).
BLOCK_FORMATS = {"q8_0": (32, 34), "q4_0": (32, 18)}
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "q8_0", "q4_0")


def kv_dtype_of(dtype: str, reported: str | None = None) -> str:
    """The KV-cache dtype an engine stores: what it reported (`reported`), or - when it did not
    say, or said "auto" (the model's own) - the model dtype's KV name (float32 -> fp32, bfloat16 ->
    bf16, float16 -> fp16)."""
    return canonical_kv_dtype(reported if reported not in (None, "", "auto") else dtype)


def canonical_kv_dtype(kv_dtype: str) -> str:
    name = str(kv_dtype).lower()
    if name in BLOCK_FORMATS:
        return name
    if name not in _ELEMENT_BYTES:
        raise UserError(f"kv_dtype={kv_dtype}: unknown KV-cache dtype. Use one of {', '.join(KV_DTYPES)}.")
    nbytes = _ELEMENT_BYTES[name]
    if name == "int8":
        return "int8"
    if nbytes == 1:
        return "fp8"
    return {4: "fp32", 2: "bf16" if name.startswith("b") else "fp16"}[nbytes]


def element_bytes(kv_dtype: str) -> int:
    kv = canonical_kv_dtype(kv_dtype)
    if kv in BLOCK_FORMATS:
        raise ValueError(f"{kv} is a block type: {BLOCK_FORMATS[kv][1]} bytes per {BLOCK_FORMATS[kv][0]} values, "
                         "no whole bytes per element (use row_bytes)")
    return _ELEMENT_BYTES[kv]


def row_bytes(values: int, kv_dtype: str) -> int:
    """Bytes of `values` consecutive values of one row in `kv_dtype` (block types: whole blocks)."""
    kv = canonical_kv_dtype(kv_dtype)
    if kv in BLOCK_FORMATS:
        n, b = BLOCK_FORMATS[kv]
        return math.ceil(values / n) * b
    return values * _ELEMENT_BYTES[kv]


def scale_bytes_per_head(kv_dtype: str) -> int:
    return INT8_SCALE_BYTES if canonical_kv_dtype(kv_dtype) == "int8" else 0


def _scale(kv_dtype: str) -> int:
    return scale_bytes_per_head(kv_dtype)


def layer_bytes_per_token(shape: ModelShape, kind: str, kv_dtype: str) -> int:
    """Bytes one layer of this kind keeps per cached token (0 for linear layers). A block type
    (llama.cpp's q8_0, q4_0) stores each of K and V as one row of KV heads x head_dim values."""
    if kind == "linear":
        return 0
    if canonical_kv_dtype(kv_dtype) in BLOCK_FORMATS:
        if kind == "latent":
            return row_bytes(int(shape.kv_lora_rank or 0) + int(shape.qk_rope_head_dim or 0), kv_dtype)
        return 2 * row_bytes(shape.num_key_value_heads * shape.head_dim, kv_dtype)
    e, s = element_bytes(kv_dtype), _scale(kv_dtype)
    if kind == "latent":
        return (int(shape.kv_lora_rank or 0) + int(shape.qk_rope_head_dim or 0)) * e + s
    return 2 * shape.num_key_value_heads * (shape.head_dim * e + s)


def state_elements(shape: ModelShape) -> tuple[int, int]:
    """(conv state, recurrent state) elements one linear-attention / state-space layer keeps per
    sequence, as vLLM sizes them (vllm/model_executor/layers/mamba/mamba_utils.py,
    MambaStateShapeCalculator; transformers' caches hold the same)."""
    la = shape.linear_attention or {}
    kind = la.get("kind")
    if kind == "gated_deltanet":
        hk, hv, dk, dv, k = (la[x] for x in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim",
                                             "conv_kernel"))
        return (k - 1) * (2 * hk * dk + hv * dv), hv * dk * dv
    if kind == "mamba2":
        n, d, state, g, k = (la[x] for x in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel"))
        return (k - 1) * (n * d + 2 * g * state), n * d * state
    if kind == "mamba":
        inter, state, k = (la[x] for x in ("intermediate_size", "state_size", "conv_kernel"))
        return (k - 1) * inter, inter * state
    raise UserError(f"model.linear_attention: kind {kind!r}: infer-bench sizes the state of gated_deltanet, "
                    "mamba2 and mamba layers only.")


def state_dtype_bytes(shape: ModelShape, state_dtype: str | None = None) -> int:
    name = state_dtype or shape.state_dtype or shape.dtype
    return element_bytes(name)


def state_bytes(shape: ModelShape, state_dtype: str | None = None, recurrent_dtype: str | None = None) -> int:
    """One linear layer's state per sequence: conv elements x the state dtype's bytes + recurrent
    elements x recurrent_dtype's (None: the state dtype; vLLM's CPU build keeps the recurrent
    state in float32 by default where the CPU has AVX-512-BF16, vllm/platforms/cpu.py)."""
    conv, rec = state_elements(shape)
    e = state_dtype_bytes(shape, state_dtype)
    return conv * e + rec * (element_bytes(recurrent_dtype) if recurrent_dtype else e)


def bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """KV-cache bytes one cached token takes in every attention layer that keeps it, K and V
    (a paged engine's page per token, all its attention layers; linear layers keep no tokens).
    For a dense model: 2 x layers x KV heads x head_dim x element bytes."""
    return sum(layer_bytes_per_token(shape, k, kv_dtype) for k in shape.layer_kinds())


def dense_bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """What the dense-attention formula says: 2 x every layer x KV heads x head_dim x element
    bytes, whatever the layers really keep (shown beside the estimate, never used as it)."""
    if canonical_kv_dtype(kv_dtype) in BLOCK_FORMATS:
        return 2 * shape.num_hidden_layers * row_bytes(shape.num_key_value_heads * shape.head_dim, kv_dtype)
    return 2 * shape.num_hidden_layers * shape.num_key_value_heads * (
        shape.head_dim * element_bytes(kv_dtype) + _scale(kv_dtype))


def padded_tokens(seq_len: int, block_size: int | None) -> int:
    if not block_size:
        return seq_len
    return math.ceil(seq_len / block_size) * block_size


def skipped_tokens(kind: str, seq_len: int, window: int | None) -> int:
    """Leading tokens a layer no longer needs once a sequence holds seq_len tokens (vLLM's
    get_num_skipped_tokens): sliding keeps the last W - 1, chunked the current chunk's."""
    if kind == "sliding" and window:
        return max(0, seq_len - window + 1)
    if kind == "chunked" and window:
        return (seq_len // window) * window
    return 0


def blocks_now(kind: str, seq_len: int, block_size: int, window: int | None, lag: int = 1) -> int:
    """Blocks a paged cache holds for one layer of a sequence of seq_len computed tokens, after
    the step that computed the last one: from the block of the first token still needed to the
    last block, edges included. `lag` is when the engine frees the blocks before the window:
    vLLM (lag 1, the default) frees them when it schedules a step, from the tokens computed
    before it (L - 1), so a sliding layer holds the blocks of the last W tokens (W - 1 for
    attention and the newest), a chunked one those of its chunk as of token L - 1. The reference
    engine (lag 0) frees them after the step, from L: the blocks of the last W - 1 tokens, the
    ones the next query sees. The two differ by one block where (L - W + 1) is a multiple of B."""
    if kind == "linear" or seq_len <= 0:
        return 0
    return math.ceil(seq_len / block_size) - skipped_tokens(kind, seq_len - lag, window) // block_size


def held_tokens(kind: str, seq_len: int, window: int | None, block_size: int | None) -> int:
    """Token slots one layer of a group holds for a sequence grown to seq_len tokens: the most it
    held on the way (what the sequence needs to get there), in whole blocks when paged.
    full, latent: L (ceil(L / B) x B). sliding: min(L, W - 1) (paged: the blocks covering them,
    at most ceil((W - 1) / B) + 1). chunked: min(L, C - 1), the most of a chunk ever held (vLLM
    holds L mod C now, transformers min(L, C - 1)). linear: 0 (its state is per sequence)."""
    if kind == "linear":
        return 0
    if kind in ("full", "latent") or not window:
        return padded_tokens(seq_len, block_size)
    keep = window - 1
    if not block_size:
        return min(seq_len, keep)
    # blocks_now grows with L up to the window, then repeats with period B (sliding) or C
    # (chunked): the most over 1..L lies in its first period past the window
    period = block_size if kind == "sliding" else window
    lo, hi = min(seq_len, keep), min(seq_len, keep + period + 1)
    if kind == "chunked" and window % block_size:
        lo, hi = 1, min(seq_len, 2 * window * block_size)
    return max(blocks_now(kind, n, block_size, window) for n in range(max(lo, 1), hi + 1)) * block_size


_FORMULA_NAMES = {"full": "full attention", "sliding": "sliding window", "chunked": "chunked local",
                  "latent": "latent (MLA)", "linear": "linear / state-space"}


@dataclass(frozen=True)
class KVGroup:
    kind: str  # full | sliding | chunked | latent | linear
    layers: int
    window: int | None  # sliding W or chunk C
    bytes_per_token: int  # per cached token, the group's layers together (0 for linear)
    state_bytes: int  # per sequence, the group's layers together (linear only)
    tokens_per_sequence: int  # token slots each layer holds per sequence (block-rounded)
    total_bytes: int  # for the whole batch
    formula: str  # how bytes_per_token (or state_bytes) is made, with the numbers
    tokens_formula: str

    def to_dict(self) -> dict:
        return asdict(self)


def _group_formula(shape: ModelShape, kind: str, layers: int, kv_dtype: str) -> str:
    kv = canonical_kv_dtype(kv_dtype)
    if kv in BLOCK_FORMATS and kind != "linear":
        n, b = BLOCK_FORMATS[kv]
        vals = (int(shape.kv_lora_rank or 0) + int(shape.qk_rope_head_dim or 0) if kind == "latent"
                else shape.num_key_value_heads * shape.head_dim)
        return f"{1 if kind == 'latent' else 2} x {layers} x ceil({vals} / {n}) x {b} ({kv}: {b} bytes per {n} values)"
    e, s = element_bytes(kv_dtype), _scale(kv_dtype)
    if kind == "latent":
        core = f"{layers} x ({shape.kv_lora_rank} + {shape.qk_rope_head_dim}) x {e}"
        return core + (f" + {layers} x {s} (int8 scale)" if s else "")
    if kind == "linear":
        conv, rec = state_elements(shape)
        return f"{layers} x ({conv} conv + {rec} recurrent) x {state_dtype_bytes(shape)} per sequence"
    kvh, d = shape.num_key_value_heads, shape.head_dim
    return f"2 x {layers} x {kvh} x ({d} x {e} + {s})" if s else f"2 x {layers} x {kvh} x {d} x {e}"


def _tokens_formula(kind: str, window: int | None, block: int | None) -> str:
    blocks = f", in blocks of {block}" if block else ""
    if kind in ("full", "latent"):
        return f"L{blocks}"
    if kind == "sliding":
        return f"min(L, {window} - 1){blocks}" + (" + edge blocks" if block else "")
    if kind == "chunked":
        return f"min(L, {window} - 1) (at most the chunk){blocks}"
    return "none: a fixed state per sequence"


def layer_groups(shape: ModelShape) -> list[tuple[str, int | None, int]]:
    """(kind, window, layers) for each kind of layer the model has, in first-seen order."""
    counts: dict[tuple[str, int | None], int] = {}
    for k in shape.layer_kinds():
        w = shape.sliding_window if k == "sliding" else shape.attention_chunk_size if k == "chunked" else None
        counts[(k, w)] = counts.get((k, w), 0) + 1
    return [(k, w, n) for (k, w), n in counts.items()]


@dataclass(frozen=True)
class KVEstimate:
    model: str
    kv_dtype: str
    seq_len: int
    batch_size: int
    block_size: int | None
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    bytes_per_token: int  # per cached token, every attention layer that keeps it
    tokens_per_sequence: int  # after rounding up to whole blocks (full-attention layers)
    total_bytes: int
    groups: tuple[KVGroup, ...] = ()
    dense_bytes_per_token: int = 0  # what the dense formula says per token
    dense_total_bytes: int = 0  # and for the whole batch

    @property
    def gb(self) -> float:
        return self.total_bytes / 1e9

    @property
    def gib(self) -> float:
        return self.total_bytes / 2**30

    @property
    def dense_factor(self) -> float:
        """How many times the dense formula's figure is the estimate (1.0: it fits)."""
        return self.dense_total_bytes / self.total_bytes if self.total_bytes else float("inf")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_gb"] = self.gb
        d["total_gib"] = self.gib
        d["dense_factor"] = self.dense_factor
        for g in d["groups"]:
            g["share"] = g["total_bytes"] / self.total_bytes if self.total_bytes else None
        return d


def estimate(shape: ModelShape, seq_len: int, batch_size: int = 1, kv_dtype: str = "fp16",
             block_size: int | None = None, state_dtype: str | None = None,
             recurrent_dtype: str | None = None) -> KVEstimate:
    """KV-cache size for `batch_size` sequences of `seq_len` tokens each, by layer group."""
    if seq_len <= 0:
        raise UserError(f"seq_len={seq_len}: must be a positive number of tokens.")
    if batch_size <= 0:
        raise UserError(f"batch_size={batch_size}: must be a positive number of sequences.")
    if block_size is not None and block_size <= 0:
        raise UserError(f"block_size={block_size}: must be a positive number of tokens (or omit it).")
    kv = canonical_kv_dtype(kv_dtype)
    groups = []
    for kind, window, n in layer_groups(shape):
        per_token = n * layer_bytes_per_token(shape, kind, kv)
        state = 0
        if kind == "linear":
            state = n * state_bytes(shape, state_dtype, recurrent_dtype)
        tokens = held_tokens(kind, seq_len, window, block_size)
        groups.append(KVGroup(kind=kind, layers=n, window=window, bytes_per_token=per_token, state_bytes=state,
                              tokens_per_sequence=tokens, total_bytes=(per_token * tokens + state) * batch_size,
                              formula=_group_formula(shape, kind, n, kv),
                              tokens_formula=_tokens_formula(kind, window, block_size)))
    tokens = padded_tokens(seq_len, block_size)
    dense = dense_bytes_per_token(shape, kv)
    return KVEstimate(
        model=shape.name, kv_dtype=kv, seq_len=seq_len,
        batch_size=batch_size, block_size=block_size, layers=shape.num_hidden_layers,
        attention_heads=shape.num_attention_heads, kv_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, bytes_per_token=bytes_per_token(shape, kv), tokens_per_sequence=tokens,
        total_bytes=sum(g.total_bytes for g in groups), groups=tuple(groups),
        dense_bytes_per_token=dense, dense_total_bytes=dense * tokens * batch_size,
    )


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units, for per-token sizes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}".replace(".00 ", " ")
        n /= 1024
    raise AssertionError("unreachable")

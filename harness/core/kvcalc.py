"""The KV-cache estimator (docs/metrics.md, "The KV-cache estimator").

bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element
                  (+ per-token scale bytes for quantised caches)

Grouped-query models keep `num_key_value_heads` K/V heads, not `num_attention_heads`.
A paged cache rounds each sequence up to whole blocks.
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
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")


def kv_dtype_of(dtype: str, reported: str | None = None) -> str:
    """The KV-cache dtype an engine stores: what it reported (`reported`), or - when it did not
    say, or said "auto" (the model's own) - the model dtype's KV name (float32 -> fp32, bfloat16 ->
    bf16, float16 -> fp16)."""
    return canonical_kv_dtype(reported if reported not in (None, "", "auto") else dtype)


def canonical_kv_dtype(kv_dtype: str) -> str:
    name = str(kv_dtype).lower()
    if name not in _ELEMENT_BYTES:
        raise UserError(f"kv_dtype={kv_dtype}: unknown KV-cache dtype. Use one of {', '.join(KV_DTYPES)}.")
    nbytes = _ELEMENT_BYTES[name]
    if name == "int8":
        return "int8"
    if nbytes == 1:
        return "fp8"
    return {4: "fp32", 2: "bf16" if name.startswith("b") else "fp16"}[nbytes]


def element_bytes(kv_dtype: str) -> int:
    return _ELEMENT_BYTES[canonical_kv_dtype(kv_dtype)]


def scale_bytes_per_head(kv_dtype: str) -> int:
    return INT8_SCALE_BYTES if canonical_kv_dtype(kv_dtype) == "int8" else 0


def bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """KV-cache bytes for one token of one sequence, all layers, K and V."""
    per_head = shape.head_dim * element_bytes(kv_dtype) + scale_bytes_per_head(kv_dtype)
    return 2 * shape.num_hidden_layers * shape.num_key_value_heads * per_head


def padded_tokens(seq_len: int, block_size: int | None) -> int:
    if not block_size:
        return seq_len
    return math.ceil(seq_len / block_size) * block_size


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
    bytes_per_token: int
    tokens_per_sequence: int  # after rounding up to whole blocks
    total_bytes: int

    @property
    def gb(self) -> float:
        return self.total_bytes / 1e9

    @property
    def gib(self) -> float:
        return self.total_bytes / 2**30

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_gb"] = self.gb
        d["total_gib"] = self.gib
        return d


def estimate(shape: ModelShape, seq_len: int, batch_size: int = 1, kv_dtype: str = "fp16",
             block_size: int | None = None) -> KVEstimate:
    """KV-cache size for `batch_size` sequences of `seq_len` tokens each."""
    if seq_len <= 0:
        raise UserError(f"seq_len={seq_len}: must be a positive number of tokens.")
    if batch_size <= 0:
        raise UserError(f"batch_size={batch_size}: must be a positive number of sequences.")
    if block_size is not None and block_size <= 0:
        raise UserError(f"block_size={block_size}: must be a positive number of tokens (or omit it).")
    bpt = bytes_per_token(shape, kv_dtype)
    tokens = padded_tokens(seq_len, block_size)
    return KVEstimate(
        model=shape.name, kv_dtype=canonical_kv_dtype(kv_dtype), seq_len=seq_len,
        batch_size=batch_size, block_size=block_size, layers=shape.num_hidden_layers,
        attention_heads=shape.num_attention_heads, kv_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, bytes_per_token=bpt, tokens_per_sequence=tokens,
        total_bytes=bpt * tokens * batch_size,
    )


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units, for per-token sizes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}".replace(".00 ", " ")
        n /= 1024
    raise AssertionError("unreachable")

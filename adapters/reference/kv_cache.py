"""The KV pool: one tensor for K and one for V, allocated once, holding every layer's cache.

    k[layer] : [num_blocks * block_size, kv_heads, head_dim]   one row per token slot

Slot `s` lives in block `s // block_size`. A sequence's block table lists its blocks; its
token at position p sits in slot `table[p // block_size] * block_size + p % block_size`.

Storage formats (`kv_dtype`):
  auto  the model's dtype
  int8  int8 values plus one float32 scale per token and KV head (for K and for V):
        x ~= q * scale, scale = max|x| / 127 over the head's head_dim values
  fp8   float8 e4m3 values (kept in uint8 storage, since CPU kernels cannot index float8),
        one scale of 1.0 for the whole tensor: values are clamped to +-448 and rounded
Reads dequantise to the model's dtype. The bytes per token are exactly what
harness.kvcalc.bytes_per_token predicts.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8 e4m3fn value


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                    model_dtype: torch.dtype) -> int:
    """KV bytes for one token, all layers, K and V (scales included)."""
    if kv_dtype == "int8":
        per_head = head_dim + 4  # int8 values + one float32 scale
    elif kv_dtype == "fp8":
        per_head = head_dim
    else:
        per_head = head_dim * torch.empty((), dtype=model_dtype).element_size()
    return 2 * num_layers * num_kv_heads * per_head


def check_kv_dtype(kv_dtype: str, device: torch.device) -> str | None:
    """Why `device` cannot store this KV dtype, or None. fp8 needs torch's float8 type and, on
    CUDA, a GPU with native fp8 (compute capability 8.9 or newer, as vLLM requires)."""
    if kv_dtype != "fp8":
        return None
    if not hasattr(torch, "float8_e4m3fn"):
        return f"this torch build ({torch.__version__}) has no float8_e4m3fn type"
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return f"the GPU (compute capability {major}.{minor}) has no fp8 support; 8.9+ is needed"
    try:  # a round trip on the device itself
        x = torch.ones(2, device=device).to(torch.float8_e4m3fn).view(torch.uint8)
        x.view(torch.float8_e4m3fn).float()
    except (RuntimeError, TypeError) as e:
        return f"{device} cannot store float8 e4m3 ({e})"
    return None


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, kv_dtype: str, model_dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size, self.kv_dtype = num_blocks, block_size, kv_dtype
        self.model_dtype = model_dtype
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        store = {"int8": torch.int8, "fp8": torch.uint8}.get(kv_dtype, model_dtype)
        # zeros, not empty: reads gather whole blocks, and the unused tail of a block must hold
        # finite values (the mask gives them zero weight, but NaN * 0 would still be NaN)
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.k_scale = self.v_scale = None
        if kv_dtype == "int8":
            self.k_scale = torch.zeros(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:3], dtype=torch.float32, device=device)
        self.bytes_per_token = bytes_per_token(num_layers, num_kv_heads, head_dim, kv_dtype, model_dtype)
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale)
                          if t is not None)
        assert self.nbytes == self.bytes_per_token * num_blocks * block_size

    # ---- quantisation -------------------------------------------------------------------
    def _quantise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kv_dtype == "int8":
            xf = x.float()
            scale = xf.abs().amax(dim=-1).clamp(min=1e-8) / 127.0  # per token, per head
            q = torch.round(xf / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
            return q, scale
        if self.kv_dtype == "fp8":
            return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8), None
        return x, None

    def _dequantise(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if self.kv_dtype == "int8":
            return (x.float() * scale.unsqueeze(-1)).to(self.model_dtype)
        if self.kv_dtype == "fp8":
            return x.view(torch.float8_e4m3fn).to(self.model_dtype)
        return x

    # ---- write and read -----------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of tokens [T, kv_heads, head_dim] in `slots` [T]."""
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = self._quantise(x)
            cache[layer].index_copy_(0, slots, q)
            if scales is not None:
                scales[layer].index_copy_(0, slots, s)

    def read(self, layer: int, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `length` slots of every block table: [B, n] tables -> [B, length,
        kv_heads, head_dim] each, in the model's dtype, gathered block by block. Slots past a
        sequence's own length hold stale values; the attention mask hides them."""
        b, n = block_tables.shape
        ids = block_tables.reshape(-1)
        out = []
        for cache, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            blocks = cache[layer].view(self.num_blocks, self.block_size, *cache.shape[2:])
            s = None if scales is None else scales[layer].view(self.num_blocks, self.block_size, -1)
            if n == 1:  # a single block (a contiguous region): copy only the slots in use
                blocks = blocks[:, :length]
                s = None if s is None else s[:, :length]
            x = blocks.index_select(0, ids)
            s = None if s is None else s.index_select(0, ids)
            out.append(self._dequantise(x, s).view(b, -1, *cache.shape[2:])[:, :length])
        return out[0], out[1]

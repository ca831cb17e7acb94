"""The KV pool: one tensor for K and one for V, allocated once, holding every layer's cache.

    k[layer] : [kv_heads, num_blocks, block_size, head_dim]

A sequence's block table lists its blocks: its token at position p sits in block
`table[p // block_size]`, at offset `p % block_size`, once per KV head. The layout is head-major:
one head's piece of a block (block_size x head_dim values) is contiguous, and gathering a batch's
blocks for one head gives each sequence's keys as one run of rows, [kv_heads, B, n * block_size,
head_dim]: decode attention is then one batched matrix product over (head, sequence) pairs, not
one tiny product per block (see attention.py), and a GPU kernel reads a block's rows for a head
in one coalesced sweep. `rows()` turns (block, offset) pairs into row numbers of the flattened
[kv_heads * num_blocks * block_size, head_dim] view, where writes go.

Storage formats (`kv_dtype`):
  auto  the model's dtype
  int8  int8 values plus one float32 scale per token and KV head (for K and for V):
        x ~= q * scale, scale = max|x| / 127 over the head's head_dim values
  fp8   float8 e4m3 values (kept in uint8 storage, since CPU kernels cannot index float8),
        one scale of 1.0 for the whole tensor: values are clamped to +-448 and rounded
Reads dequantise to the model's dtype. The bytes per token are exactly what
harness.core.kvcalc.bytes_per_token predicts.

`scratch_blocks` extra blocks (never handed to the block manager) are where padded rows of a
CUDA-graph decode step write and read (see cuda_graphs.py); they are not counted in
`num_blocks`.
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


def quantise(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., d] -> (the stored values [..., d], the float32 scales [...] or None), as `kv_dtype`
    stores them (module docstring): int8 with one scale over the last dimension, fp8 clamped and
    rounded with no scale, auto unchanged. The latent cache (mla.LatentPool) uses the same."""
    if kv_dtype == "int8":
        xf = x.float()
        scale = xf.abs().amax(dim=-1).clamp(min=1e-8) / 127.0  # per token, per head
        q = torch.round(xf / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return q, scale
    if kv_dtype == "fp8":
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8), None
    return x, None


def dequantise(x: torch.Tensor, scale: torch.Tensor | None, kv_dtype: str, model_dtype: torch.dtype) -> torch.Tensor:
    """The stored values [..., d] (and their scales [...]) back in the model's dtype."""
    if kv_dtype == "int8":
        return (x.float() * scale.unsqueeze(-1)).to(model_dtype)
    if kv_dtype == "fp8":
        return x.view(torch.float8_e4m3fn).to(model_dtype)
    return x


STORE_DTYPES = {"int8": torch.int8, "fp8": torch.uint8}  # storage of quantised values (else the model's dtype)


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, kv_dtype: str, model_dtype: torch.dtype, device: torch.device,
                 scratch_blocks: int = 0):
        self.num_blocks, self.block_size, self.kv_heads = num_blocks, block_size, num_kv_heads
        self.kv_dtype, self.model_dtype, self.device = kv_dtype, model_dtype, device
        self.total_blocks = num_blocks + scratch_blocks  # scratch blocks sit after the usable ones
        shape = (num_layers, num_kv_heads, self.total_blocks, block_size, head_dim)
        store = STORE_DTYPES.get(kv_dtype, model_dtype)
        # Allocated once, but not written: on a CPU the operating system commits the pages only
        # when a block is first used. A block is zeroed on its first use (`prepare`), because
        # reads gather whole blocks and the unused tail of a block must hold finite values (the
        # mask gives them zero weight, but NaN * 0 is still NaN). On a GPU the memory is reserved
        # anyway: zero it all now.
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.k = alloc(shape, dtype=store, device=device)
        self.v = alloc(shape, dtype=store, device=device)
        self.k_scale = self.v_scale = None
        if kv_dtype == "int8":
            self.k_scale = alloc(shape[:4], dtype=torch.float32, device=device)
            self.v_scale = alloc(shape[:4], dtype=torch.float32, device=device)
        self.used = bytearray([device.type == "cuda"]) * self.total_blocks  # 1 once a block is zeroed
        self.bytes_per_token = bytes_per_token(num_layers, num_kv_heads, head_dim, kv_dtype, model_dtype)
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale)
                          if t is not None)
        assert self.nbytes == self.bytes_per_token * self.total_blocks * block_size
        if scratch_blocks:
            self.prepare(set(range(num_blocks, self.total_blocks)))

    @property
    def scratch_block(self) -> int:
        """The first scratch block (padded graph rows use it)."""
        assert self.total_blocks > self.num_blocks, "this pool has no scratch block"
        return self.num_blocks

    def rows(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows of tokens (in `blocks` at `offsets`, [T] each) for every KV head, token-major:
        [T * kv_heads], row t * kv_heads + h for head h of token t."""
        heads = torch.arange(self.kv_heads, device=blocks.device)
        return ((heads * self.total_blocks + blocks[:, None]) * self.block_size + offsets[:, None]).reshape(-1)

    def prepare(self, block_ids: set[int]) -> None:
        """Zero the blocks among `block_ids` that were never used (see __init__)."""
        fresh = [b for b in block_ids if not self.used[b]]
        if not fresh:
            return
        ids = torch.tensor(fresh, dtype=torch.long, device=self.k.device)
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t.view(t.shape[0] * t.shape[1], self.total_blocks, -1).index_fill_(1, ids, 0)
        for b in fresh:
            self.used[b] = 1

    # ---- write and read -----------------------------------------------------------------
    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of tokens [T, kv_heads, head_dim] in `rows` (see `rows()`)."""
        d = k.shape[-1]
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantise(x, self.kv_dtype)
            cache[layer].view(-1, d).index_copy_(0, rows, q.reshape(-1, d))
            if scales is not None:
                scales[layer].view(-1).index_copy_(0, rows, s.reshape(-1))

    def block_rows(self, block_tables: torch.Tensor) -> torch.Tensor:
        """[B, n] block tables -> the rows of the [kv_heads * total_blocks, block_size * head_dim]
        view that hold them, head-major: [kv_heads * B * n] (compute once per step, gather per
        layer: a row gather is one memcpy per (head, block), much faster than indexing a
        middle dimension)."""
        heads = torch.arange(self.kv_heads, device=block_tables.device)
        return (heads[:, None] * self.total_blocks + block_tables.reshape(1, -1)).reshape(-1)

    def gather(self, layer: int, block_tables: torch.Tensor, length: int,
               rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of every block table, gathered head by head: [B, n] tables -> K and V
        [kv_heads, B, n * block_size, head_dim] in the model's dtype (each sequence's keys one
        run of rows). `rows`: block_rows(block_tables), when the caller has it. A single-block
        table (a contiguous region) gets only its first `length` slots. Slots past a sequence's
        own length hold stale (finite) values; the attention mask hides them."""
        b, n = block_tables.shape
        rows = self.block_rows(block_tables) if rows is None else rows
        out = []
        for cache, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x, s = cache[layer], None if scales is None else scales[layer]
            d = x.shape[-1]
            if n == 1 and length < self.block_size:  # a region: only its first `length` slots
                x, s = x[:, :, :length], None if s is None else s[:, :, :length]
                x = x.index_select(1, block_tables.reshape(-1))
                s = None if s is None else s.index_select(1, block_tables.reshape(-1))
            else:
                x = x.reshape(-1, self.block_size * d).index_select(0, rows)
                s = None if s is None else s.reshape(-1, self.block_size).index_select(0, rows)
            x = dequantise(x.view(-1, d), None if s is None else s.reshape(-1), self.kv_dtype, self.model_dtype)
            out.append(x.view(self.kv_heads, b, -1, d))
        return out[0], out[1]

    def read(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `length` tokens: [1, n] table -> K and V [1, kv_heads, length, head_dim]."""
        k, v = self.gather(layer, block_table, length)
        return k[:, :, :length].transpose(0, 1), v[:, :, :length].transpose(0, 1)

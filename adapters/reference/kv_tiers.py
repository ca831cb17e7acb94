"""A second KV tier behind the paged pool (`engine_options.reference.kv_offload`).

A block's path (docs/reference-engine.md, "KV tiers"):

  1. The prefix cache registers a full, computed block under its chained hash (block_manager.py).
     When no sequence holds it any more it is *evictable*: still in the pool, found by later hits.
  2. When the pool needs a block and none is free, the block manager evicts the least recently
     released evictable block (`_take`). With a second tier, that block is first copied there
     (`SecondTier.offload`) under the same identity: its chained hash and its token ids. A block
     the second tier already holds (it was reloaded from there earlier) is not written again.
  3. A later prompt looks its blocks up in order (`match_prefix`): a block the pool still holds is
     a first-tier hit; one the pool lost but the second tier holds is a second-tier hit, shown as
     None in the hit list; the first block in neither ends the match.
  4. When the sequence is admitted (`admit`), its second-tier hits are read back and checked
     (`SecondTier.fetch`), all of them before any pool block is taken (taking one may evict, and
     offload, another block); each then gets a pool block (`SecondTier.place`) and is registered
     in the prefix cache again: the sequence computes only what follows, as after a first-tier
     hit. A record that fails its check (corrupted, truncated) is dropped, counted (`corrupt`),
     and the hits end there: the sequence recomputes from that block on. Reloaded data is never
     used unchecked.
  5. The second tier is LRU too: when it is full, its least recently used block is dropped
     (`evictions`; a later hit on it is a miss). It never raises mid-run.

Media (`kv_offload_medium`):
  disk   (CPU's default) one slab file of fixed-size slots in `kv_offload_dir` (the system's temp
         directory by default), unlinked the moment it is created: the data lives while the engine
         holds the file open, and the operating system reclaims it when the engine closes or its
         process ends, however it ends (SIGTERM, SIGKILL). Each slot is a record: a header (magic,
         the chained hash, the payload's length and CRC-32) and the block's bytes. A reload reads
         the record back (a real read, checked before anything is copied into the pool).
  host   (CUDA's default) slots of one host-memory buffer, pinned on a CUDA device: offloads copy
         device -> host on a side stream (the next step waits for it on the device, not the host),
         reloads copy host -> device asynchronously on the step's own stream. On a CPU it is plain
         memory (the first tier is host memory already): the same bookkeeping, used by the tests.

What it reports (`info`, kv_cache_info().extra["kv_tiers"]): capacity and slots, blocks stored,
hits (blocks and tokens) per tier, blocks and bytes written and read, the seconds spent writing
and reading (serialising, checksums, the I/O and the copies into the pool), evictions and corrupt
records. Models with sliding-window layer groups (layer_groups.py) are not tiered yet: refused at
load.
"""

from __future__ import annotations

import os
import struct
import tempfile
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

MAGIC = b"IBKVTIER"
HEADER = struct.Struct("<8s16sQI")  # magic, chained hash (16 bytes), payload length, CRC-32 of the payload


def default_medium(device: torch.device) -> str:
    return "host" if device.type == "cuda" else "disk"


# ---- a block's bytes in the pool -----------------------------------------------------------------

def block_parts(pool: Any, block: int) -> list[torch.Tensor]:
    """Views of block `block` in every tensor of the pool: K and V [layers, kv_heads, block_size,
    head_dim] (and their int8 scales) of a kv_cache.KVPool; the latents [layers, block_size, latent]
    (and scales) of an mla.LatentPool."""
    if hasattr(pool, "latent"):
        return [t[:, block] for t in (pool.latent, pool.scale) if t is not None]
    return [t[:, :, block] for t in (pool.k, pool.v, pool.k_scale, pool.v_scale) if t is not None]


def block_bytes(pool: Any) -> int:
    return sum(p.numel() * p.element_size() for p in block_parts(pool, 0))


def pack(pool: Any, block: int) -> torch.Tensor:
    """Block `block` as one flat uint8 tensor on the pool's device (its parts end to end)."""
    return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in block_parts(pool, block)])


def unpack(pool: Any, block: int, flat: torch.Tensor) -> None:
    """Write `flat` (pack's layout) into block `block` of the pool."""
    at = 0
    for p in block_parts(pool, block):
        n = p.numel() * p.element_size()
        p.copy_(flat[at:at + n].view(p.dtype).view(p.shape))
        at += n
    used = getattr(pool, "used", None)
    if used is not None:  # KVPool zeroes a block on its first use: this one holds data now
        used[block] = 1


# ---- stores ------------------------------------------------------------------------------------------

class DiskStore:
    """Fixed-size slots of one slab file, unlinked as soon as it is created (module docstring)."""

    medium = "disk"

    def __init__(self, directory: str | None, slots: int, slot_bytes: int):
        self.slot_bytes, self.slots = slot_bytes, slots
        self.record = HEADER.size + slot_bytes
        fd, path = tempfile.mkstemp(prefix="infer-bench-kv-tier-", suffix=".slab", dir=directory)
        os.unlink(path)  # gone with the last descriptor: on close, or when the process ends in any way
        self.fd: int | None = fd
        self.path = path  # where it was (it has no name any more)

    def write(self, slot: int, key: bytes, data: torch.Tensor) -> None:
        payload = data.cpu().numpy().tobytes()
        header = HEADER.pack(MAGIC, key, len(payload), zlib.crc32(payload))
        os.pwrite(self.fd, header + payload, slot * self.record)

    def read(self, slot: int, key: bytes, device: torch.device) -> torch.Tensor | None:
        """The slot's payload as a flat uint8 tensor on `device`, or None when its record does not
        check out: short (truncated), another magic or key, another length, another CRC."""
        raw = os.pread(self.fd, self.record, slot * self.record)
        if len(raw) < HEADER.size:
            return None
        magic, got_key, length, crc = HEADER.unpack_from(raw)
        payload = raw[HEADER.size:HEADER.size + length]
        if magic != MAGIC or got_key != key or length != self.slot_bytes or len(payload) != length \
                or zlib.crc32(payload) != crc:
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def describe(self) -> str:
        return f"disk: one unlinked slab file in {os.path.dirname(self.path)}"


class HostStore:
    """Slots of one host-memory buffer; pinned, with side-stream copies, on a CUDA device (module
    docstring). Untested on a GPU so far: no session with one since it was written."""

    medium = "host"

    def __init__(self, slots: int, slot_bytes: int, device: torch.device):
        self.slot_bytes, self.slots, self.device = slot_bytes, slots, device
        self.cuda = device.type == "cuda"
        self.buf = torch.empty((slots, slot_bytes), dtype=torch.uint8, pin_memory=self.cuda)
        self.keys: list[bytes | None] = [None] * slots
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def write(self, slot: int, key: bytes, data: torch.Tensor) -> None:
        if self.stream is not None:  # device -> pinned host, on the side stream, after what wrote `data`
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.buf[slot].copy_(data, non_blocking=True)
                data.record_stream(self.stream)
            # the pool block is reused by the next step: the step's stream waits for the copy (on the device)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        else:
            self.buf[slot].copy_(data)
        self.keys[slot] = key

    def read(self, slot: int, key: bytes, device: torch.device) -> torch.Tensor | None:
        if self.keys[slot] != key:
            return None
        # pinned -> device without a host wait: the step that reads it runs after it on this stream
        return self.buf[slot].to(device, non_blocking=self.cuda)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self.buf = torch.empty(0, dtype=torch.uint8)

    def describe(self) -> str:
        return "pinned host memory (side-stream copies)" if self.cuda else "host memory"


# ---- the tier -------------------------------------------------------------------------------------

@dataclass
class TierStats:
    hit_blocks: int = 0  # second-tier hits (blocks reloaded into the pool)
    blocks_written: int = 0
    blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_time_s: float = 0.0
    read_time_s: float = 0.0
    evictions: int = 0  # blocks the second tier dropped, least recently used first
    corrupt: int = 0  # records that failed their check on reload (dropped, recomputed)


@dataclass
class _Entry:
    slot: int
    tokens: tuple[int, ...]


@dataclass
class SecondTier:
    """The second tier of one pool (module docstring): an LRU index of chained hash -> slot over a
    store of `slots` slots of one block each."""

    pool: Any
    store: Any
    block_size: int
    device: torch.device
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        self.index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.free = list(reversed(range(self.store.slots)))

    @property
    def capacity_bytes(self) -> int:
        return self.store.slots * self.store.slot_bytes

    def holds(self, key: bytes, tokens: tuple[int, ...]) -> bool:
        e = self.index.get(key)
        return e is not None and e.tokens == tokens

    def offload(self, key: bytes, tokens: tuple[int, ...], block: int) -> None:
        """Block `block` of the pool is being evicted: keep a copy under `key` (nothing to write when
        the tier holds it already: it was reloaded from here). A full tier drops its least
        recently used block first."""
        if key in self.index:
            self.index.move_to_end(key)
            return
        t0 = time.perf_counter()
        if not self.free:
            _, old = self.index.popitem(last=False)
            self.free.append(old.slot)
            self.stats.evictions += 1
        slot = self.free.pop()
        self.store.write(slot, key, pack(self.pool, block))
        self.index[key] = _Entry(slot, tokens)
        self.stats.blocks_written += 1
        self.stats.bytes_written += self.store.slot_bytes
        self.stats.write_time_s += time.perf_counter() - t0

    def fetch(self, key: bytes) -> torch.Tensor | None:
        """`key`'s block read back and checked (a flat uint8 tensor on the device), or None: not
        held, or its record does not check out (the entry is then dropped and counted as corrupt:
        the caller recomputes instead)."""
        e = self.index.get(key)
        if e is None:
            return None
        t0 = time.perf_counter()
        data = self.store.read(e.slot, key, self.device)
        self.stats.read_time_s += time.perf_counter() - t0
        if data is None:
            del self.index[key]
            self.free.append(e.slot)
            self.stats.corrupt += 1
            return None
        self.index.move_to_end(key)
        self.stats.blocks_read += 1
        self.stats.bytes_read += self.store.slot_bytes
        return data

    def place(self, block: int, data: torch.Tensor) -> None:
        """A fetched block's bytes into pool block `block` (a second-tier hit)."""
        t0 = time.perf_counter()
        unpack(self.pool, block, data)
        self.stats.hit_blocks += 1
        self.stats.read_time_s += time.perf_counter() - t0

    def clear(self) -> None:
        """Forget every block (the prefix cache was reset); the counters stay."""
        self.free.extend(e.slot for e in self.index.values())
        self.index.clear()

    def close(self) -> None:
        self.index.clear()
        self.store.close()

    def info(self, prefix_hit_blocks: int) -> dict[str, Any]:
        """What kv_cache_info reports (adapters/tiers.py lists the fields): counters since load."""
        s, bs = self.stats, self.block_size
        return {"source": "engine", "medium": self.store.describe(), "policy": "lru",
                "capacity_bytes": self.capacity_bytes, "slots": self.store.slots, "slot_bytes": self.store.slot_bytes,
                "blocks_stored": len(self.index),
                "hit_blocks": {"1": prefix_hit_blocks - s.hit_blocks, "2": s.hit_blocks},
                "hit_tokens": {"1": (prefix_hit_blocks - s.hit_blocks) * bs, "2": s.hit_blocks * bs},
                "blocks_written": s.blocks_written, "blocks_read": s.blocks_read,
                "bytes_written": s.bytes_written, "bytes_read": s.bytes_read,
                "tokens_written": s.blocks_written * bs, "tokens_read": s.blocks_read * bs,
                "write_time_s": s.write_time_s, "read_time_s": s.read_time_s,
                "evictions": s.evictions, "corrupt": s.corrupt}


def make_tier(pool: Any, block_size: int, device: torch.device, capacity_bytes: int | None, medium: str,
              directory: str | None) -> SecondTier:
    """The second tier of `pool`: `capacity_bytes` (None: twice the pool, SGLang's default ratio) in
    whole blocks, on `medium` (auto: disk on a CPU, pinned host memory on CUDA)."""
    slot = block_bytes(pool)
    capacity = capacity_bytes if capacity_bytes is not None else 2 * pool.nbytes
    slots = capacity // slot
    if slots < 1:
        raise ValueError(f"engine_options.reference.kv_offload_bytes={capacity_bytes}: less than one KV block "
                         f"({slot} bytes: block_size x {slot // block_size} bytes per token). Give at least {slot}.")
    medium = default_medium(device) if medium == "auto" else medium
    store = DiskStore(directory, slots, slot) if medium == "disk" else HostStore(slots, slot, device)
    return SecondTier(pool, store, block_size, device)

"""Deterministic synthetic prompts: seeded token ids, never special tokens."""

from __future__ import annotations

import hashlib

import numpy as np


def seed_for(seed: int, key: str) -> int:
    """A 64-bit seed for (run seed, key): every point and iteration gets its own stream."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{key}".encode()).digest()[:8], "little")


def synthetic_prompts(batch: int, length: int, low: int, high: int, avoid: tuple[int, ...] = (),
                      seed: int = 0, key: str = "") -> list[list[int]]:
    """`batch` prompts of `length` token ids drawn uniformly from [low, high) minus `avoid`.
    The same (seed, key) always gives the same prompts."""
    allowed = np.setdiff1d(np.arange(low, high), np.asarray(avoid, dtype=np.int64))
    if allowed.size == 0:
        raise ValueError(f"no token ids to draw prompts from in [{low}, {high})")
    rng = np.random.default_rng(seed_for(seed, key))
    ids = allowed[rng.integers(0, allowed.size, size=(batch, length))]
    return ids.tolist()

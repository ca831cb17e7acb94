"""Block allocator, prefix cache and scheduler of the reference engine, without a model."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.reference import block_manager as bm_module
from adapters.reference.block_manager import BlockManager
from adapters.reference.scheduler import PoolTooSmall, Scheduler, Sequence


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    owners = Counter(b for seq in live for b in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == owners[block.block_id], "ref count != number of block tables listing it"
    free, evictable = list(bm.free), list(bm.evictable)
    assert len(free) == len(set(free)) and not set(free) & set(evictable)
    assert not (set(free) | set(evictable)) & set(owners), "a block is both owned and free"
    assert len(free) + len(evictable) + len(owners) == bm.num_blocks, "pool over-committed or leaking"
    for seq in live:
        assert len(seq.block_table) == len(set(seq.block_table)), "a block twice in one table"
    for h, b in bm.cached.items():
        assert bm.blocks[b].hash == h


def run_steps(sched: Scheduler, live: list[Sequence], finished: list[Sequence]) -> None:
    """One scheduler step with a fake model: the next token is (position * 7) % 50."""
    chunks = sched.schedule()
    for c in chunks:
        c.seq.num_computed = c.end
    for c in chunks:
        if c.samples:
            c.seq.tokens.append((c.seq.num_tokens * 7) % 50)
    for c in chunks:
        sched.blocks.register_full_blocks(c.seq)
        if not c.seq.wants_step:
            sched.finish(c.seq)
            live.remove(c.seq)
            finished.append(c.seq)


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 64),
    prefix_caching=st.booleans(),
    requests=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 24), st.integers(1, 12), st.integers(0, 3)),
                      min_size=1, max_size=12),
)
def test_allocator_invariants_under_random_schedule(num_blocks, block_size, budget, prefix_caching, requests):
    """Random requests (some sharing prefixes) arriving at random steps, a small pool, a token
    budget: blocks are never owned twice, counts never go negative, the pool is never
    over-committed, and everything is free again at the end."""
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=budget)
    max_len = num_blocks * block_size
    prefixes = [[1 + (i * 13 + j) % 40 for j in range(16)] for i in range(4)]
    pending = []
    for i, (p, extra, out, when) in enumerate(requests):
        out = min(out, max_len - 1)  # every request fits the pool on its own
        prompt = (prefixes[p] + [40 + i] * extra)[: max(1, min(max_len - out, 16 + extra))]
        pending.append((when, Sequence(i, prompt, len(prompt) + out)))
    live, finished = [], []
    for step in range(400):
        for when, seq in [x for x in pending if x[0] <= step]:
            sched.add(seq)
            live.append(seq)
            pending.remove((when, seq))
        if not sched.has_work() and not pending:
            break
        if sched.has_work():
            run_steps(sched, live, finished)
        check_invariants(bm, live)
    assert not live and not pending, "every request finishes"
    assert all(s.num_outputs == s.stop_len - s.prompt_len for s in finished)
    assert bm.num_free == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_hits_share_blocks_and_count():
    bm = BlockManager(16, 4, prefix_caching=True)
    sched = Scheduler(bm, 8, 64)
    a = Sequence(1, list(range(10)), 12)
    sched.add(a)
    run_steps(sched, [a], [])  # a has its first output and keeps running
    b = Sequence(2, list(range(8)) + [99, 98, 97], 12)
    sched.add(b)
    sched.schedule()
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert (bm.stats.prefix_queries, bm.stats.prefix_hits) == (2 + 2, 2)


def test_whole_prompt_cached_still_computes_its_last_token():
    bm = BlockManager(16, 4, prefix_caching=True)
    sched = Scheduler(bm, 8, 64)
    a = Sequence(1, list(range(8)), 9)
    sched.add(a)
    run_steps(sched, [a], [])
    b = Sequence(2, list(range(8)), 9)
    sched.add(b)
    (chunk,) = sched.schedule()
    assert (chunk.start, chunk.end) == (4, 8)  # one block shared; the last block is recomputed


def test_hash_collision_guard(monkeypatch):
    """With every block hashing alike, only a block with the same tokens may be shared."""
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: b"same")
    bm = BlockManager(16, 4, prefix_caching=True)
    sched = Scheduler(bm, 8, 64)
    a = Sequence(1, [1, 2, 3, 4, 5], 6)
    sched.add(a)
    run_steps(sched, [a], [])
    b = Sequence(2, [9, 9, 9, 9, 5], 6)
    sched.add(b)
    (chunk,) = sched.schedule()
    assert chunk.start == 0 and bm.stats.prefix_hits == 0


def test_lru_eviction_only_when_free_blocks_run_out():
    bm = BlockManager(4, 2, prefix_caching=True)
    sched = Scheduler(bm, 8, 64)
    seqs = [Sequence(i, [10 * i, 10 * i + 1, 10 * i + 2], 4) for i in range(2)]
    for s in seqs:
        sched.add(s)
        live = [s]
        while live:
            run_steps(sched, live, [])
    # each left one full registered block (evictable); the tails went back to the free list
    assert len(bm.evictable) == 2 and len(bm.free) == 2
    first_cached = next(iter(bm.evictable))
    c = Sequence(9, [7, 7, 7, 7, 7], 6)  # needs 3 blocks: the 2 free ones, then one eviction
    sched.add(c)
    sched.schedule()
    assert bm.stats.evictions == 1
    assert first_cached not in bm.evictable  # the least recently released went first
    assert len(bm.evictable) == 1


def test_preemption_frees_blocks_and_requeues():
    bm = BlockManager(6, 2, prefix_caching=False)
    sched = Scheduler(bm, 8, 64)
    a, b = Sequence(1, [1, 2, 3, 4, 5], 12), Sequence(2, [6, 7, 8, 9, 10], 12)
    live = [a, b]
    for s in live:
        sched.add(s)
    finished = []
    while live:
        run_steps(sched, live, finished)
        check_invariants(bm, live)
    assert sched.preemptions > 0
    assert all(s.num_tokens == 12 for s in (a, b))


def test_pool_too_small_for_one_sequence_raises():
    bm = BlockManager(2, 2, prefix_caching=False)
    sched = Scheduler(bm, 8, 64)
    sched.add(Sequence(1, [1, 2, 3, 4, 5], 6))
    with pytest.raises(PoolTooSmall, match="kv_cache_bytes"):
        sched.schedule()


def test_sequence_longer_than_the_pool_raises_instead_of_looping():
    bm = BlockManager(4, 2, prefix_caching=False)
    sched = Scheduler(bm, 8, 1)  # one token per step: the prompt fits, the outputs do not
    seq = Sequence(1, [1, 2], 12)
    sched.add(seq)
    with pytest.raises(PoolTooSmall, match="12 tokens|9 tokens"):
        for _ in range(100):
            run_steps(sched, [seq], [])


def test_no_cache_scheduler_recomputes_whole_sequences():
    sched = Scheduler(None, 8, 10)
    a, b = Sequence(1, [1] * 6, 8), Sequence(2, [2] * 6, 8)
    sched.add(a), sched.add(b)
    chunks = sched.schedule()
    assert [(c.seq.seq_id, c.start, c.end) for c in chunks] == [(1, 0, 6)]  # b does not fit the budget
    big = Scheduler(None, 8, 4)
    big.add(Sequence(3, [3] * 6, 8))
    (chunk,) = big.schedule()  # alone, a sequence goes whole even past the budget
    assert (chunk.start, chunk.end) == (0, 6)

"""The reference engine's second KV tier (adapters/reference/kv_tiers.py): evicted prefix-cache
blocks written there and reloaded on a later hit. A reloaded block scores as the same block found
in the pool (bit for bit) and as a recomputed one (fp32, teacher-forced); a corrupted or truncated
record is detected and recomputed, never used; a full tier evicts (LRU) and the run goes on; the
tier's file is gone when the engine closes and when its process is killed; bad options are one
line naming the field. Both media: disk (an unlinked slab file) and host memory (the GPU path's
store, plain memory on a CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from adapters.base import ModelSpec, Request, TokenEvent, now_ns
from adapters.reference.engine import ReferenceEngine
from adapters.reference.kv_tiers import HEADER
from harness.core.kvcalc import bytes_per_token
from harness.core.presets import load_preset

BLOCK = 16
MAX_LEN = 256
BPT = bytes_per_token(load_preset("tiny"), "fp32")  # 4,096 bytes per token
POOL = 16 * BLOCK * BPT  # 16 blocks: one sequence of MAX_LEN tokens


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 4096, (n,), generator=g).tolist()


A = prompt(136, 1)  # scored from position 129: 8 full blocks before it (score_from 128) may be cached
B = prompt(250, 2)  # needs every block of the pool: evicts all of A's


def engine(path, tmp_path, **options) -> ReferenceEngine:
    e = ReferenceEngine()
    e.load(ModelSpec(str(path), "tiny", "float32", max_model_len=MAX_LEN),
           {"block_size": BLOCK, "kv_cache_bytes": POOL, "kv_offload": True, "kv_offload_dir": str(tmp_path),
            **options})
    return e


def tiers(e: ReferenceEngine) -> dict:
    return e.kv_cache_info().extra["kv_tiers"]


def evict_a(e: ReferenceEngine) -> None:
    """Score B: its 16 blocks take the whole pool, so A's cached blocks go to the second tier."""
    written = tiers(e)["blocks_written"]
    e.score([B], [len(B) - 1], 1)
    assert tiers(e)["blocks_written"] - written >= 8


def pooled_then_reloaded(e: ReferenceEngine) -> tuple:
    """A's scores from the pool (after a first scoring), then after B evicted A (the second tier's reload)."""
    e.score([A], [129], 5)
    pooled = e.score([A], [129], 5)
    e.score([B], [len(B) - 1], 1)
    return pooled, e.score([A], [129], 5)


def same(a, b) -> bool:
    return all(x.target_logprobs == y.target_logprobs and x.top_ids == y.top_ids and x.top_logprobs == y.top_logprobs
               for x, y in zip(a, b))


def close(a, b, tol=1e-4) -> bool:
    return all(x.top_ids == y.top_ids and max(abs(p - q) for p, q in zip(x.target_logprobs, y.target_logprobs)) < tol
               for x, y in zip(a, b))


@pytest.mark.parametrize("medium", ["disk", "host"])
def test_a_block_reloaded_from_the_second_tier_scores_as_a_pooled_and_a_recomputed_one(tiny_ckpt, tmp_path, medium):
    """A scored three times: computed (no hit), from the pool (8 first-tier hits), and after B
    evicted it, reloaded from the second tier (8 second-tier hits, nothing prefilled before
    position 128). The reloaded scores are the pooled ones bit for bit, and the recomputed ones
    within fp32 rounding (the same positions through a cached context instead of one prefill)."""
    e = engine(tiny_ckpt, tmp_path, kv_offload_medium=medium)
    try:
        start = [129]
        computed = e.score([A], start, 5)
        pooled = e.score([A], start, 5)
        assert tiers(e)["hit_blocks"] == {"1": 8, "2": 0}
        evict_a(e)
        reloaded = e.score([A], start, 5)
        t = tiers(e)
        assert t["hit_blocks"] == {"1": 8, "2": 8} and t["blocks_read"] == 8 and t["corrupt"] == 0
        assert t["bytes_read"] == 8 * BLOCK * BPT and t["read_time_s"] > 0 and t["write_time_s"] > 0
        assert same(reloaded, pooled) and close(reloaded, computed)
        assert medium in t["medium"]
    finally:
        e.close()


def test_a_reloaded_block_is_used_not_recomputed(tiny_ckpt, tmp_path):
    """The check that the reload matters: after the second tier's copy of A's first block is
    overwritten with another block's (valid record, wrong data, the CRC recomputed), A's scores
    change. So the scores above come from the reloaded bytes."""
    import zlib
    e = engine(tiny_ckpt, tmp_path)
    try:
        start = [129]
        pooled = e.score([A], start, 5)
        evict_a(e)
        tier = e.core.tier
        first = tier.index[next(iter(k for k in tier.index if tier.index[k].tokens == tuple(A[:BLOCK])))]
        store = tier.store
        other = next(v for v in tier.index.values() if v is not first)
        raw = os.pread(store.fd, store.record, other.slot * store.record)
        payload = raw[HEADER.size:]
        key = os.pread(store.fd, HEADER.size, first.slot * store.record)[8:24]
        os.pwrite(store.fd, HEADER.pack(b"IBKVTIER", key, len(payload), zlib.crc32(payload)) + payload,
                  first.slot * store.record)
        wrong = e.score([A], start, 5)
        assert tiers(e)["hit_blocks"]["2"] == 8 and not close(wrong, pooled)
    finally:
        e.close()


@pytest.mark.parametrize("damage, block, kept", [("flipped bytes", 2, 2), ("truncated file", 0, 0)])
def test_a_corrupted_or_truncated_record_is_detected_and_recomputed(tiny_ckpt, tmp_path, damage, block, kept):
    """One of A's records is damaged on disk: 64 bytes of its third block's payload flipped, or
    the file cut in the middle of its first block's record (the last one written: the pool
    evicted A's tail first). The reload checks it, drops it (corrupt 1), reuses the blocks before
    it and recomputes from there; the scores are the recomputed ones, never the damaged data's."""
    e = engine(tiny_ckpt, tmp_path)
    try:
        start = [129]
        computed = e.score([A], start, 5)
        evict_a(e)
        tier, store = e.core.tier, e.core.tier.store
        rec = next(v for v in tier.index.values() if v.tokens == tuple(A[block * BLOCK:(block + 1) * BLOCK]))
        at = rec.slot * store.record
        if damage == "flipped bytes":
            os.pwrite(store.fd, b"\xff" * 64, at + HEADER.size + 1000)
        else:
            assert rec.slot == max(v.slot for v in tier.index.values())  # the file's last record
            os.ftruncate(store.fd, at + HEADER.size + store.slot_bytes // 2)
        scores = e.score([A], start, 5)
        t = tiers(e)
        assert t["corrupt"] == 1 and t["hit_blocks"]["2"] == kept, t
        assert close(scores, computed)
    finally:
        e.close()


def test_a_full_second_tier_evicts_its_least_recently_used_blocks_and_the_run_goes_on(tiny_ckpt, tmp_path):
    """A second tier of 3 blocks under 8 evicted blocks of A: 5 evictions, no error; A comes back
    with the blocks it still holds, in order from A's head only if they were kept (else a miss),
    and its scores are the recomputed ones."""
    e = engine(tiny_ckpt, tmp_path, kv_offload_bytes=3 * BLOCK * BPT)
    try:
        start = [129]
        computed = e.score([A], start, 5)
        evict_a(e)
        t = tiers(e)
        assert t["blocks_stored"] == 3 and t["evictions"] >= 5 and t["capacity_bytes"] == 3 * BLOCK * BPT
        scores = e.score([A], start, 5)
        assert close(scores, computed)
        # the pool released A's tail first, so its head blocks were written last and are the ones kept
        assert tiers(e)["hit_blocks"]["2"] == 3
    finally:
        e.close()


def test_serve_says_per_request_what_the_second_tier_supplied(tiny_ckpt, tmp_path):
    """A served again after B evicted it: its first token's event says 128 cached tokens, all
    reloaded (TokenEvent.reloaded_tokens), and its output is the same as the first time."""
    e = engine(tiny_ckpt, tmp_path)
    try:
        first = [ev for ev in e.serve([Request("a", A, 4)], now_ns()) if isinstance(ev, TokenEvent)]
        list(e.serve([Request("b", B, 2)], now_ns()))
        again = [ev for ev in e.serve([Request("a2", A, 4)], now_ns()) if isinstance(ev, TokenEvent)]
        assert (first[0].cached_tokens, first[0].reloaded_tokens) == (0, 0)
        assert (again[0].cached_tokens, again[0].reloaded_tokens) == (8 * BLOCK, 8 * BLOCK)
        assert [ev.token_id for ev in again] == [ev.token_id for ev in first]
    finally:
        e.close()


def _tier_fds(pid: int, directory) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            out.append(target)
    return out


def test_the_tier_file_is_gone_when_the_engine_closes(tiny_ckpt, tmp_path):
    """While the engine runs, its slab file is open and already has no name in the directory
    (the directory stays empty); close() closes it, and the space goes with it."""
    e = engine(tiny_ckpt, tmp_path)
    try:
        e.score([A], [129], 1)
        evict_a(e)
        (target,) = _tier_fds(os.getpid(), tmp_path)
        assert target.endswith(" (deleted)") and os.listdir(tmp_path) == []
    finally:
        e.close()
    assert _tier_fds(os.getpid(), tmp_path) == [] and os.listdir(tmp_path) == []


def test_the_tier_file_is_gone_after_sigterm(tiny_ckpt, tmp_path):
    """An engine process with blocks in its second tier is killed with SIGTERM (as the harness
    stops a worker): nothing of the tier is left in the directory, and no process holds it."""
    script = textwrap.dedent(f"""
        import sys, time
        from adapters.base import ModelSpec
        from adapters.reference.engine import ReferenceEngine
        e = ReferenceEngine()
        e.load(ModelSpec({str(tiny_ckpt)!r}, "tiny", "float32", max_model_len={MAX_LEN}),
               {{"block_size": {BLOCK}, "kv_cache_bytes": {POOL}, "kv_offload": True, "kv_offload_dir": {str(tmp_path)!r}}})
        e.score([{A!r}], [129], 1)
        e.score([{B!r}], [{len(B) - 1}], 1)
        print("written", e.kv_cache_info().extra["kv_tiers"]["blocks_written"], flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("written") and int(line.split()[1]) >= 8, line
        (target,) = _tier_fds(proc.pid, tmp_path)
        assert target.endswith(" (deleted)") and os.listdir(tmp_path) == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert os.listdir(tmp_path) == [] and not os.path.exists(f"/proc/{proc.pid}")


@pytest.mark.parametrize("options, expect", [
    ({"kv_offload": True, "prefix_caching": False}, "kv_offload=true with prefix_caching=false"),
    ({"kv_offload": True, "kv_layout": "contiguous"}, "kv_offload=true with kv_layout=contiguous"),
    ({"kv_offload": True, "kv_offload_dir": "/proc"}, "kv_offload_dir=/proc: cannot write there"),
    ({"kv_offload": True, "kv_offload_dir": "/no/such/dir"}, "kv_offload_dir=/no/such/dir: not a directory"),
    ({"kv_offload": True, "kv_offload_bytes": "lots"}, "engine_options.reference.kv_offload_bytes"),
])
def test_bad_tier_options_name_the_field(tiny_ckpt, options, expect):
    problems = ReferenceEngine.check_options(options, ModelSpec(str(tiny_ckpt), "tiny", "float32"))
    assert any(expect in p for p in problems), problems


def test_a_capacity_with_its_unit_is_a_size(tiny_ckpt):
    from adapters.reference.config import EngineConfig
    cfg, problems = ReferenceEngine.typed_options({"kv_offload": True, "kv_offload_bytes": "1.5MiB"})
    assert problems == [] and isinstance(cfg, EngineConfig) and cfg.kv_offload_bytes == 3 << 19


def test_a_windowed_model_is_refused_in_one_line(family_ckpts):
    problems = ReferenceEngine.check_options({"kv_offload": True}, ModelSpec(str(family_ckpts["tiny-gemma3"]),
                                                                             "tiny-gemma3", "float32"))
    assert len(problems) == 1 and "sliding-window layer groups" in problems[0]


def test_the_latent_cache_is_tiered_too(family_ckpts, tmp_path):
    """DeepSeek-V3's latent pool: its blocks (one latent per token and layer) go to the second tier
    and come back; the reloaded scores are the pooled ones bit for bit."""
    path = family_ckpts["tiny-deepseek-v3"]
    bpt = bytes_per_token(load_preset("tiny-deepseek-v3"), "fp32")
    e = ReferenceEngine()
    e.load(ModelSpec(str(path), "tiny-deepseek-v3", "float32", max_model_len=MAX_LEN),
           {"block_size": BLOCK, "kv_cache_bytes": 16 * BLOCK * bpt, "kv_offload": True,
            "kv_offload_dir": str(tmp_path)})
    try:
        pooled, reloaded = pooled_then_reloaded(e)
        t = tiers(e)
        assert t["hit_blocks"]["2"] == 8 and t["slot_bytes"] == BLOCK * bpt
        assert same(reloaded, pooled)
    finally:
        e.close()


def test_reset_forgets_the_second_tier(tiny_ckpt, tmp_path):
    e = engine(tiny_ckpt, tmp_path)
    try:
        e.score([A], [129], 1)
        evict_a(e)
        e.reset_prefix_cache()
        assert tiers(e)["blocks_stored"] == 0 and tiers(e)["blocks_written"] == 0
        e.score([A], [129], 1)
        assert tiers(e)["hit_blocks"]["2"] == 0
    finally:
        e.close()


@pytest.mark.gpu
def test_the_pinned_host_tier_on_a_gpu(tiny_ckpt):
    """The host medium on CUDA (pinned buffer, side-stream offloads): a reloaded block scores as
    the pooled one. Needs a GPU (none in the sessions so far: this test has never run)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    e = ReferenceEngine()
    e.load(ModelSpec(str(tiny_ckpt), "tiny", "float32", device="cuda", max_model_len=MAX_LEN),
           {"block_size": BLOCK, "kv_cache_bytes": POOL, "kv_offload": True, "cuda_graphs": False})
    try:
        pooled, reloaded = pooled_then_reloaded(e)
        assert tiers(e)["hit_blocks"]["2"] == 8 and "pinned" in tiers(e)["medium"]
        assert same(reloaded, pooled)
    finally:
        e.close()

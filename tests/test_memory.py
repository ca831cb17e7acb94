"""The memory sampler on CPU: the process tree's resident memory, its timeline and its cost."""

from __future__ import annotations

import multiprocessing as mp
import time

from harness.core.memory import MemorySampler


def _hold(n_bytes: int, ready, done) -> None:
    block = bytearray(n_bytes)  # touched: resident
    for i in range(0, n_bytes, 4096):
        block[i] = 1
    ready.set()
    done.wait(30)


def test_sampler_sees_a_child_process_memory():
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    s = MemorySampler(100).start()
    p = ctx.Process(target=_hold, args=(300 << 20, ready, done))
    p.start()
    assert ready.wait(60)
    time.sleep(1.5)  # past the sampler's refresh of the child list
    done.set()
    p.join(30)
    r = s.stop()
    assert r.source == "psutil-rss" and r.note is None
    assert r.peak_bytes - r.baseline_bytes > 250 << 20  # the child's 300 MiB counted
    assert r.samples >= 50 and len(r.timeline) <= 200
    assert max(v for _, v in r.timeline) == r.peak_bytes  # thinning keeps the peak
    assert all(a[0] <= b[0] for a, b in zip(r.timeline, r.timeline[1:]))
    assert 0 <= r.overhead_frac < 0.05


def test_nvml_failure_falls_back_with_a_reason(monkeypatch):
    import harness.core.memory as m

    def broken(*a, **k):
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(m, "_NvmlReader", broken)
    s = MemorySampler(50, device="cuda").start()
    time.sleep(0.1)
    r = s.stop()
    assert r.source == "psutil-rss" and "NVML unavailable" in r.note and r.peak_bytes > 0

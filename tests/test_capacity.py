"""The capacity search, closed-loop load and saturation, with a fake engine of known service time
(FakeQueueEngine, named as such: a single FIFO server simulated on a virtual clock, so its capacity
is exact and nothing depends on this machine's speed). No test here runs a real engine's capacity
search: scripts/readme_figures.py runs one on every in-process engine for the README."""

from __future__ import annotations

from collections.abc import Iterator
import pytest

from adapters.base import (
    Capabilities, Engine, KVCacheInfo, LoadInfo, Request, RequestSource, TokenEvent, as_source,
)
from harness.core.presets import load_preset
from workloads.base import RunContext
from workloads.capacity import Capacity, CapacityConfig, slo_violations
from workloads.serving import ClosedLoopSource, Serving, ServingConfig, arrival_times

S = 0.020  # seconds of service per request: the fake serves exactly 1 / S = 50 requests/s


class FakeQueueEngine(Engine):
    """One server, first come first served, `S` seconds per request: a request's first token comes
    S/2 after its service starts, its last at S. Time is virtual: events carry the simulated
    times, and the source is asked what is due at the simulated now."""

    name = "fake-queue"

    @classmethod
    def capabilities(cls, options=None):
        return Capabilities(continuous_batching=True)

    def load(self, model, options):
        return LoadInfo(0.0)

    def prefill(self, prompts, return_logits=False, max_new_tokens=None):
        raise NotImplementedError

    def decode(self, steps, return_logits=False):
        raise NotImplementedError

    def release(self):
        pass

    def kv_cache_info(self):
        return KVCacheInfo()

    def serve(self, requests: list[Request] | RequestSource, start_ns: int) -> Iterator[TokenEvent]:
        source = as_source(requests, start_ns)
        now, queue = start_ns, []
        while True:
            queue += [(r, now) for r in source.due(now)]
            if not queue:
                nxt = source.next_due_ns()
                if source.exhausted() or nxt is None:
                    return
                now = max(now, nxt)
                continue
            r, _ = queue.pop(0)
            arrival = start_ns + round(r.arrival_s * 1e9)
            begin = max(now, arrival)
            first, last = begin + int(S / 2 * 1e9), begin + int(S * 1e9)
            n = r.max_new_tokens
            for i in range(n):
                t = first if i == 0 else first + (last - first) * i // (n - 1)
                yield TokenEvent(r.request_id, i, 7, t, finished=i == n - 1)
            now = last


@pytest.fixture
def ctx():
    shape = load_preset("tiny")
    return RunContext(shape=shape, dtype="float32", device="cpu", max_model_len=256, memory_sample_hz=0,
                      token_low=4, token_high=shape.vocab_size)


def search(cfg: CapacityConfig, ctx: RunContext) -> list[dict]:
    """What the runner does for one engine: the planned points, each probe's follow-up, and the
    conclusion computed in the harness."""
    wl, engine = Capacity(), FakeQueueEngine()
    queue, rows = wl.plan(cfg), []
    while queue:
        point = queue.pop(0)
        fields = wl.compute_in_harness(point, engine.name, rows, cfg)
        if fields is None:
            fields = wl.run_point(engine, point, ctx, cfg)
        row = {"engine": engine.name, "workload": wl.name, "point": point.params, "point_key": point.key,
               "status": "ok", **fields}
        rows.append(row)
        queue[:0] = wl.next_points(point, row, rows, cfg)
    return rows


def test_rate_search_finds_the_known_capacity_within_its_resolution(ctx):
    # the SLO allows no queueing (TTFT p99 <= 0.6 S while the first token comes S/2 after service
    # starts): exactly the rates up to 1 / S = 50 requests/s meet it
    cfg = CapacityConfig(search="rate", slo_ttft_p99_s=0.6 * S, start=4, num_requests=32, arrival="constant",
                         input_len=8, output_len=4, warmup_requests=1, resolution=0.05)
    rows = search(cfg, ctx)
    result = rows[-1]
    probes = [r for r in rows[:-1]]
    assert result["point"].get("result") and result["capacity_search"] == "rate"
    lo, hi = result["capacity_bracket"]
    assert result["capacity_rps"] == lo and lo <= 1 / S < hi
    assert (hi - lo) / hi <= cfg.resolution and lo >= (1 - cfg.resolution) * (1 / S)
    assert result["capacity_slo"]["ttft_p99_s"] == pytest.approx(0.6 * S)
    assert all(r["meets_slo"] == (r["value"] <= 1 / S) for r in probes)  # every probe kept as a row
    assert [p[0] for p in result["capacity_probes"]] == [r["value"] for r in probes]


def test_an_over_saturated_probe_stops_early_and_is_marked(ctx):
    cfg = ServingConfig(request_rates=[2 / S], num_requests=64, arrival="constant", input_len=8, output_len=4,
                        warmup_requests=1)
    row = Serving().measure(FakeQueueEngine(), cfg, ctx, {"request_rate": 2 / S, "num_requests": 64}, "k")
    assert row["saturated"] and row["stopped_early"]
    assert row["completed"] < row["offered_requests"] == 64
    below = Serving().measure(FakeQueueEngine(), cfg, ctx, {"request_rate": 0.5 / S, "num_requests": 64}, "k")
    assert not below["saturated"] and below["completed"] == 64
    assert below["ttft_s_p99"] == pytest.approx(S / 2, rel=0.01)


class FakeFirstTokensOnlyEngine(FakeQueueEngine):
    """Batches every request (first tokens only, each one S later than the last); the rest of
    every output would come after them all, so the queue grows and nothing completes before the
    harness sees it: an engine far beyond its capacity. Virtual clock, as FakeQueueEngine."""

    def serve(self, requests, start_ns):
        source = as_source(requests, start_ns)
        now, k = start_ns, 0
        while not source.exhausted():
            for r in source.due(now):
                k += 1
                yield TokenEvent(r.request_id, 0, 7, start_ns + round(r.arrival_s * 1e9) + k * int(S * 1e9))
            nxt = source.next_due_ns()
            if nxt is None:
                break
            now = max(now, nxt)


def test_a_point_saturated_before_any_request_completes_is_a_row(ctx):
    cfg = ServingConfig(request_rates=[4 / S], num_requests=64, arrival="constant", input_len=8, output_len=4,
                        warmup_requests=0)
    row = Serving().measure(FakeFirstTokensOnlyEngine(), cfg, ctx, {"request_rate": 4 / S, "num_requests": 64}, "k")
    assert row["saturated"] and row["completed"] == 0 and row["offered_requests"] == 64
    assert row["ttft_s"] is None and row["output_tok_s"] is None
    assert "saturated" in " ".join(slo_violations(row, {"ttft_p99_s": 1.0, "tpot_p99_s": None, "e2el_p99_s": None}))


def test_closed_loop_keeps_n_in_flight_and_the_concurrency_search(ctx):
    # c requests in flight on one server: each waits for the c - 1 ahead of it, so TTFT = (c - 1/2) S
    cfg = ServingConfig(request_rates=[], concurrency=[4], num_requests=40, input_len=8, output_len=4,
                        warmup_requests=1)
    row = Serving().measure(FakeQueueEngine(), cfg, ctx, {"concurrency": 4, "num_requests": 40}, "k")
    assert row["load_mode"] == "closed" and row["completed"] == 40
    assert row["output_tok_s"] == pytest.approx(4 / S, rel=0.05)  # the server is never idle
    assert row["ttft_s"] == pytest.approx(3.5 * S, rel=0.02)
    cap = CapacityConfig(search="concurrency", slo_ttft_p99_s=5 * S, start=1, num_requests=24, input_len=8,
                         output_len=4, warmup_requests=1)
    result = search(cap, ctx)[-1]
    assert result["capacity_concurrency"] == 5  # (5 - 1/2) S <= 5 S < (6 - 1/2) S


def test_closed_loop_source_and_ramps():
    reqs = [Request(f"r{i}", [1], 1) for i in range(5)]
    src = ClosedLoopSource(reqs, 0, concurrency=2, ramp_up_s=1.0)
    assert [r.request_id for r in src.due(0)] == ["r0"] and src.next_due_ns() == 500_000_000
    assert [r.request_id for r in src.due(500_000_000)] == ["r1"] and src.next_due_ns() is None
    src.finished("r0", 700_000_000)
    (r2,) = src.due(700_000_000)
    assert r2.request_id == "r2" and r2.arrival_s == pytest.approx(0.7)  # its clock starts when the slot frees
    import numpy as np
    t = arrival_times(200, 10.0, "constant", 1.0, np.random.default_rng(0), ramp_up_s=4.0)
    assert t[0] == 0 and all(b > a for a, b in zip(t, t[1:]))
    gaps = np.diff(t)
    assert gaps[1] > gaps[10] > gaps[30] and gaps[-1] == pytest.approx(0.1)  # ramping in, then steady


def test_capacity_needs_an_slo():
    problems = Capacity().check(CapacityConfig(), load_preset("tiny"))
    assert any("give at least one SLO" in p for p in problems)
    problems = Capacity().check(CapacityConfig(search="concurrency", start=2.5, slo_ttft_p99_s=1), load_preset("tiny"))
    assert any("whole number" in p for p in problems)

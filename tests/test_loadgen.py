"""The load generator against a server whose timing is known exactly (tests/fake_timed_server.py,
a protocol fake in its own process): TTFT, ITL and E2EL as the harness measures them, against the
truth the server was told to produce. Timing claims (the ceiling) live in
scripts/loadgen_ceiling.py; these tests check correctness with margins wide enough for a busy
2-core machine."""

from __future__ import annotations

import json
import threading

import pytest

from adapters.base import ModelSpec, Request, now_ns
from adapters.endpoint import check_endpoint, endpoint_engine_class
from fake_timed_server import running
from harness.core.metrics import SLO, serving_metrics
from harness.core.presets import load_preset
from workloads.base import RunContext, collect
from workloads.capacity import Capacity, CapacityConfig, slo_violations
from workloads.serving import Serving, ServingConfig, client_limited, dataset_picks

# under pytest-xdist nothing runs beside these (their margins are for a busy machine, not for a
# second test worker's whole load)
pytestmark = pytest.mark.alone

SPEC = ModelSpec(path="/nonexistent", name="fake", dtype="float32", device="cpu", max_model_len=4096)


def engine_at(url: str):
    cfg, problems = check_endpoint("timed", {"kind": "vllm", "url": url, "request_timeout_s": 30})
    assert not problems, problems
    eng = endpoint_engine_class("timed", cfg)()
    eng.load(SPEC, {})
    return eng


@pytest.fixture(scope="module")
def timed_20ms():
    """Truth: first token 50 ms after the request reaches the server, then one token every 20 ms."""
    with running(gap_ms=20, first_ms=50) as url:
        eng = engine_at(url)
        yield eng
        eng.close()


def test_serve_measures_ttft_itl_e2el_as_the_server_paced_them(timed_20ms):
    reqs = [Request(f"r{i}", [5] * 16, 20, arrival_s=0.05 * i) for i in range(4)]
    start = now_ns() + 5_000_000
    row = serving_metrics(collect(reqs, start, timed_20ms.serve(reqs, start)), None, {r.request_id: 20 for r in reqs})
    assert row["completed"] == 4
    # the server cannot answer sooner than it was told to; the client may add a little
    assert 0.050 <= row["ttft_s"] < 0.050 + 0.015, row["ttft_s"]
    assert abs(row["itl_s"] - 0.020) < 0.002, row["itl_s"]
    assert 0.050 + 19 * 0.020 <= row["e2el_s"] < 0.050 + 19 * 0.020 + 0.025, row["e2el_s"]
    assert abs(row["tpot_s"] - 0.020) < 0.002


def test_tokens_of_one_chunk_share_its_time_and_chunks_keep_the_gap():
    with running(gap_ms=10, first_ms=20, tokens_per_chunk=4) as url:
        eng = engine_at(url)
        try:
            eng.begin_point()
            reqs = [Request("r0", [5] * 8, 16)]
            start = now_ns()
            traces = collect(reqs, start, eng.serve(reqs, start))
            fields = eng.end_point()
        finally:
            eng.close()
    itls = traces[0].itls_s
    assert len(itls) == 15
    # within a chunk: 0 s apart; the last token cannot come before the server's 20 + 3 x 10 ms
    assert all(g == 0 for i, g in enumerate(itls) if i not in (3, 7, 11))
    assert traces[0].token_times_ns[-1] - start >= 50_000_000
    assert fields["tokens_per_chunk_max"] == 4 and fields["stream_chunks"] == 4
    assert abs(fields["itl_chunk_s"] - 0.010) < 0.003


def test_tokens_are_stamped_when_their_bytes_came_off_the_socket():
    """A loop busy HOG_S at a time (other streams' parsing, a slow callback) delays the task that
    reads a stream, not the socket read: a token's time is when the loop read its bytes, at most
    one busy spell after the server wrote them (median about half of one), never after the next
    (reading-task stamps were one to two spells late)."""
    import asyncio
    import statistics
    import time

    import httpx

    from adapters.endpoint.loadgen import ClientSpec
    from adapters.endpoint.stream import ReqState, stream_completion
    hog_s = 0.02

    async def read_while_busy(url: str) -> ReqState:
        spec = ClientSpec(url + "/completions")
        session = spec.session()
        loop = asyncio.get_running_loop()
        done = []

        def hog() -> None:  # due at once, so it runs in every loop pass, after that pass's socket reads
            end = time.perf_counter() + hog_s
            while time.perf_counter() < end:
                pass
            if not done:
                loop.call_later(0, hog)

        st = ReqState("r0", 1, 10)
        loop.call_later(0, hog)
        try:
            await stream_completion(session, spec.url, {"model": "m", "prompt": [5], "max_tokens": 10, "stream": True},
                                    st, None, 30)
        finally:
            done.append(True)
            await session.close()
        return st

    with running(gap_ms=50, first_ms=50) as url:
        stats = url[: -len("/v1")] + "/stats"
        httpx.get(stats, timeout=10)
        st = asyncio.run(read_while_busy(url))
        writes = httpx.get(stats, timeout=10).json()["writes_ns"]
    assert st.ok and len(st.token_times) == len(writes) == 10, (st.error, writes)
    late_s = [(t - w) / 1e9 for t, w in zip(st.token_times, writes)]
    assert min(late_s) >= 0, late_s  # one clock (CLOCK_MONOTONIC) on both sides
    assert statistics.median(late_s) < hog_s, late_s


# ---- the serving workload through the load generator --------------------------------------------

def context(model_path: str = "") -> RunContext:
    shape = load_preset("tiny")
    return RunContext(shape=shape, dtype="float32", device="cpu", model_path=model_path, max_model_len=4096,
                      memory_sample_hz=0, token_low=4, token_high=shape.vocab_size)


def test_rows_say_the_client_kept_up_and_measure_the_truth(timed_20ms):
    cfg = ServingConfig(num_requests=8, input_len=16, output_len=10, warmup_requests=1, arrival="constant")
    row = Serving().measure(timed_20ms, cfg, context(), {"request_rate": 20.0, "num_requests": 8}, "serving:t")
    assert row["completed"] == 8 and row["client_processes"] == 1
    assert 0.050 <= row["ttft_s"] < 0.065 and abs(row["itl_s"] - 0.020) < 0.002
    # the schedule: one request every 50 ms, each sent when due
    assert row["scheduled_rate"] == pytest.approx(20.0, rel=1e-6)
    assert row["achieved_rate"] == pytest.approx(20.0, rel=0.05)
    assert row["send_lag_s_max"] is not None and row["send_lag_s_max"] >= 0
    assert row["offered_rate"] == 20.0 and row["client_cpu_frac"] < 0.9
    assert row["client_limited"] is (bool(row["client_limited_reasons"]))


def test_verdict_names_each_reason_and_tightens_with_the_slo():
    ok = {"send_lag_s_p99": 0.001, "loop_lag_s_p99": 0.003, "loop_lag_s_max": 0.004, "client_cpu_frac": 0.3}
    assert client_limited(ok, SLO()) == []
    # 5 % of a 40 ms TPOT SLO is 2 ms: a 3 ms loop lag p99 is too much for it
    assert client_limited(ok, SLO(tpot_s=0.040)) == ["loop lag p99 3.0 ms > 2.0 ms"]
    bad = client_limited({"send_lag_s_p99": 0.009, "loop_lag_s_p99": 0.001, "client_cpu_frac": 0.97}, SLO())
    assert bad == ["send lag p99 9.0 ms > 5.0 ms", "a client process used 97% of a core"]


def test_one_short_loop_stall_does_not_void_a_point_but_a_long_one_does():
    # a 50 ms SLO: the limit is 2.5 ms; one 2.7 ms stall among ticks that were otherwise on time
    one_stall = {"send_lag_s_p99": 0.0004, "loop_lag_s_p99": 0.0006, "loop_lag_s_max": 0.0027, "client_cpu_frac": 0.4}
    assert client_limited(one_stall, SLO(ttft_s=0.050)) == []
    # ... but a stall of ten times the limit is the client's, whatever the other ticks did
    long_stall = {**one_stall, "loop_lag_s_max": 0.030}
    assert client_limited(long_stall, SLO(ttft_s=0.050)) == ["a loop stall of 30.0 ms > 25.0 ms"]


def _loop_fields(late_ms: list[float]) -> dict:
    """The row's loop-lag fields from the lateness of each 2 ms tick, as the client records them."""
    from adapters.endpoint.loadgen import lag_samples
    from harness.core.stats import summarize
    lags = summarize([x for ms in late_ms for x in lag_samples(round(ms * 1e6), 2_000_000)])
    return {"send_lag_s_p99": 0.0004, "loop_lag_s_p99": lags["p99"], "loop_lag_s_max": lags["max"],
            "client_cpu_frac": 0.4}


def test_loop_lag_is_judged_over_time_not_over_ticks():
    # 2,000 ticks (4 s) on time to 0.5 ms, and a 2.7 ms stall: 0.1 % of the time, not the client's fault
    assert client_limited(_loop_fields([0.5] * 1999 + [2.7]), SLO(ttft_s=0.050)) == []
    # a 20 ms stall every 200 ticks is under 1 % of the ticks but about 5 % of the time: limited
    every = _loop_fields(([0.5] * 199 + [20.0]) * 10)
    assert client_limited(every, SLO(ttft_s=0.050)) == [f"loop lag p99 {every['loop_lag_s_p99'] * 1e3:.1f} ms > 2.5 ms"]


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


@pytest.mark.slow
def test_a_starved_client_marks_its_rows_client_limited_and_capacity_refuses_them():
    cfg = ServingConfig(num_requests=16, input_len=8, output_len=40, warmup_requests=1)
    with running(gap_ms=5, first_ms=5) as url:
        eng = engine_at(url)
        try:
            calm = Serving().measure(eng, cfg, context(), {"concurrency": 8, "num_requests": 16}, "serving:c")
            stop = threading.Event()
            hogs = [threading.Thread(target=_busy, args=(stop,)) for _ in range(2)]
            for h in hogs:
                h.start()
            try:
                starved = Serving().measure(eng, cfg, context(), {"concurrency": 8, "num_requests": 16}, "serving:s")
            finally:
                stop.set()
                for h in hogs:
                    h.join()
        finally:
            eng.close()
    assert starved["client_limited"] is True, starved["client_limited_reasons"]
    assert any("loop lag" in w for w in starved["client_limited_reasons"])
    assert starved["loop_lag_s_p99"] > calm["loop_lag_s_p99"]
    # a capacity search never takes such a probe as the engine's capacity
    why = slo_violations(starved, {"ttft_p99_s": 10.0, "tpot_p99_s": None, "e2el_p99_s": None})
    assert why and "raise workload.client_processes" in why[-1]


def test_capacity_conclusion_skips_client_limited_probes_and_says_why():
    ccfg = CapacityConfig(slo_ttft_p99_s=1.0)
    slos = ccfg.slos()
    rows = []
    for v, limited in ((1.0, False), (2.0, False), (4.0, True)):
        r = {"workload": "capacity", "engine": "e", "status": "ok", "point": {"search": "rate", "value": v},
             "ttft_s_p99": 0.1, "client_limited": limited, "client_limited_reasons": ["loop lag 9.0 ms > 5.0 ms"]}
        r["meets_slo"] = not slo_violations(r, slos)
        rows.append(r)
    wl = Capacity()
    out = wl.compute_in_harness(wl.plan(ccfg)[1], "e", rows, ccfg)
    assert out["capacity_rps"] == 2.0 and out["capacity_bracket"] == [2.0, 4.0]
    assert out["capacity_client_limited"] == [4.0] and "client_processes" in out["capacity_note"]


# ---- datasets and traces -------------------------------------------------------------------------

def test_dataset_orders_use_each_entry_once_unless_asked_for_more():
    import numpy as np
    rng = np.random.default_rng(7)
    assert sorted(dataset_picks(41, 41, "shuffle", rng)) == list(range(41))
    assert dataset_picks(5, 7, "file", rng) == [0, 1, 2, 3, 4, 0, 1]
    twice = dataset_picks(5, 10, "shuffle", rng)
    assert sorted(twice) == sorted(list(range(5)) * 2)
    assert len(set(dataset_picks(41, 41, "random", np.random.default_rng(7)))) < 41  # with replacement


def test_a_41_entry_sharegpt_file_sends_each_entry_exactly_once(tmp_path, tiny_ckpt):
    data = [{"conversations": [{"from": "human", "value": " ".join(f"w{100 + i + k}" for k in range(1 + i % 5))},
                               {"from": "gpt", "value": "w8 w9 w10"}]} for i in range(41)]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    file_tokens = sum(1 + i % 5 for i in range(41))
    cfg = ServingConfig(num_requests=41, dataset=str(tmp_path / "sg.json"), warmup_requests=1)
    with running(gap_ms=1, first_ms=1) as url:
        eng = engine_at(url)
        try:
            row = Serving().measure(eng, cfg, context(str(tiny_ckpt)), {"request_rate": float("inf"),
                                                                         "num_requests": 41}, "serving:d")
        finally:
            eng.close()
    assert row["completed"] == 41 and row["dataset_entries"] == 41 and row["dataset_entries_sent"] == 41
    assert row["total_input_tokens"] == file_tokens
    assert row["dataset_order"] == "shuffle"


def _trace(tmp_path, lines):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines))
    return str(p)


def test_equal_hash_ids_give_equal_prompt_prefixes(tmp_path):
    path = _trace(tmp_path, [
        {"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [1, 2, 3]},
        {"timestamp": 1250, "input_length": 12, "output_length": 3, "hash_ids": [1, 2, 4]},
        {"timestamp": 1500, "input_length": 6, "output_length": 3, "hash_ids": [5, 2]},
        {"timestamp": 1100, "input_length": 3, "output_length": 2},
    ])
    cfg = ServingConfig(trace=path, trace_block_size=4, trace_time_scale=2.0)
    reqs = Serving().trace_requests(cfg, context(), "serving:trace")
    a, d, b, c = reqs  # sorted by timestamp
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.2, 0.5, 1.0])
    assert [len(r.prompt_ids) for r in reqs] == [10, 3, 12, 6]
    assert a.prompt_ids[:8] == b.prompt_ids[:8] and a.prompt_ids[8:10] != b.prompt_ids[8:10]
    assert c.prompt_ids[:4] != a.prompt_ids[:4] and c.prompt_ids[4:6] == a.prompt_ids[4:6]  # block 2 again


def test_bad_trace_lines_are_named(tmp_path):
    from harness.core.errors import UserError
    from workloads.datasets import read_trace
    path = _trace(tmp_path, [{"timestamp": 0, "input_length": 4, "output_length": 1},
                             {"timestamp": "x", "input_length": 4, "output_length": 1},
                             {"timestamp": 5, "input_length": 0, "output_length": 1}])
    with pytest.raises(UserError) as e:
        read_trace(path)
    text = "\n".join(e.value.problems)
    assert "line 2: \"timestamp\"" in text and "line 3: \"input_length\"" in text and "line 1" not in text


def test_a_trace_replays_at_its_recorded_offsets(tmp_path, timed_20ms):
    lines = [{"timestamp": 40 * i, "input_length": 8, "output_length": 4, "hash_ids": [i % 3]} for i in range(25)]
    cfg = ServingConfig(trace=_trace(tmp_path, lines), trace_block_size=4, warmup_requests=1)
    wl = Serving()
    point = wl.plan(cfg)[0]
    row = wl.measure(timed_20ms, cfg, context(), point.params, point.key)
    assert row["load_mode"] == "trace" and row["completed"] == 25 and row["trace_requests"] == 25
    assert row["scheduled_rate"] == pytest.approx(25.0, rel=1e-6) and row["offered_rate"] == pytest.approx(25.0)
    # sent when due (the 5 ms goal is checked by scripts/loadgen_ceiling.py, not by a timed test;
    # this bound only catches a replay that does not follow the recorded offsets)
    assert row["send_lag_s_p99"] <= 0.050, row["send_lag_s_p99"]
    assert row["achieved_rate"] == pytest.approx(25.0, rel=0.1)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_closed_loop_finds_its_connections_open_when_the_point_starts(processes):
    """The measured burst pays no TCP handshakes: the server counts the completion requests that
    opened their own connection, and there are none (before: every stream but the warm-up's)."""
    import httpx
    reqs = [Request(f"r{i}", [5] * 8, 4) for i in range(16)]
    with running(gap_ms=5) as url:
        stats = lambda: httpx.get(url[: -len("/v1")] + "/stats", timeout=10).json()  # noqa: E731
        eng = engine_at(url)
        try:
            stats()
            out = eng.serve_load(reqs, closed=True, concurrency=16, processes=processes)
            seen = stats()
        finally:
            eng.close()
    assert len(out["traces"]) == 16 and all(t.error is None for t in out["traces"])
    assert seen["cold_streams"] == 0, seen
    assert seen["connections"] >= 16


# ---- several client processes -----------------------------------------------------------------------

def test_split_deals_the_schedule_and_the_slots_deterministically():
    from adapters.endpoint.loadgen import ClientSpec, Item, Job, split_job
    items = [Item(f"r{i}", b"{}", 4, 2, arrival_s=0.1 * (9 - i)) for i in range(10)]
    open_jobs = split_job(Job(ClientSpec("u"), items, 0, max_concurrency=5), 2)
    assert [[it.request_id for it in j.items] for j in open_jobs] == [
        ["r9", "r7", "r5", "r3", "r1"], ["r8", "r6", "r4", "r2", "r0"]]  # arrival order, dealt round robin
    assert [j.max_concurrency for j in open_jobs] == [3, 2]
    closed = split_job(Job(ClientSpec("u"), items, 0, closed=True, slots=3), 2)
    assert [j.slots for j in closed] == [2, 1] and [len(j.items) for j in closed] == [7, 3]
    assert sorted(it.request_id for j in closed for it in j.items) == sorted(it.request_id for it in items)
    assert len(split_job(Job(ClientSpec("u"), items, 0, closed=True, slots=1), 4)) == 1  # no idle process


@pytest.mark.slow
def test_two_client_processes_pool_to_the_single_process_figures():
    from harness.core.stats import summarize
    reqs = lambda: [Request(f"r{i}", [5] * 8, 10, arrival_s=0.04 * i) for i in range(16)]  # noqa: E731
    with running(gap_ms=10, first_ms=30) as url:
        eng = engine_at(url)
        try:
            one = eng.serve_load(reqs(), closed=False, processes=1)
            two = eng.serve_load(reqs(), closed=False, processes=2)
        finally:
            eng.close()
    assert two["client"]["client_processes"] == 2 and one["client"]["client_processes"] == 1
    assert two["client"]["client_clock_offset_s_max"] < 0.001  # one CLOCK_MONOTONIC on one machine
    # the same schedule, every request once
    sched = [{t.request_id: t.arrival_ns - out["start_ns"] for t in out["traces"]} for out in (one, two)]
    assert sched[0] == sched[1] and len(sched[1]) == 16
    expected = {f"r{i}": 10 for i in range(16)}
    rows = [serving_metrics(out["traces"], None, expected) for out in (one, two)]
    assert rows[1]["completed"] == 16
    # percentiles come from the pooled requests of both processes ...
    pooled_ttft = summarize([t.ttft_s for t in two["traces"]])
    assert rows[1]["ttft_s_p99"] == pytest.approx(pooled_ttft["p99"]) and rows[1]["ttft_s"] == pytest.approx(pooled_ttft["p50"])
    # ... and agree with one process on the known timing
    for k, tol in (("ttft_s", 0.004), ("itl_s", 0.001), ("e2el_s", 0.005)):
        assert abs(rows[0][k] - rows[1][k]) < tol, (k, rows[0][k], rows[1][k])
    assert 0.030 <= rows[1]["ttft_s"] < 0.040


@pytest.mark.slow
def test_clients_as_ray_actors_on_a_local_ray_instance():
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install '.[ray]' "
                                            "(make test installs .[dev] only)")
    reqs = [Request(f"r{i}", [5] * 8, 10, arrival_s=0.03 * i) for i in range(12)]
    try:
        with running(gap_ms=10, first_ms=30) as url:
            eng = engine_at(url)
            try:
                out = eng.serve_load(reqs, closed=False, processes=2, backend="ray")
            finally:
                eng.close()
    finally:
        ray.shutdown()
    assert out["client"]["client_processes"] == 2
    assert sorted(t.request_id for t in out["traces"]) == sorted(r.request_id for r in reqs)
    # the actors run on this machine: the same clock, within the ping's bound
    assert out["client"]["client_clock_offset_s_max"] <= out["client"]["client_clock_error_s_max"] + 0.001
    row = serving_metrics(out["traces"], None, {r.request_id: 10 for r in reqs})
    assert row["completed"] == 12 and 0.030 <= row["ttft_s"] < 0.060


def test_a_client_clock_offset_beyond_its_bound_is_corrected_else_left_alone():
    from adapters.endpoint.clients import correction, shift_states
    from adapters.endpoint.stream import ReqState
    assert correction(40_000, 50_000) == 0 and correction(-3_000_000, 50_000) == -3_000_000
    st = ReqState("r", 4, 2, scheduled_ns=1_000, ready_ns=1_000, sent_ns=1_100, token_times=[2_000, 2_500],
                  chunk_times=[2_000, 2_500])
    shift_states([st], 1_000)
    assert (st.scheduled_ns, st.sent_ns, st.token_times, st.chunk_times) == (0, 100, [1_000, 1_500], [1_000, 1_500])

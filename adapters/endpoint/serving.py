"""Serving over HTTP: the two ways a serving point's requests reach the server.

  serve(requests)   the Engine interface's continuous batching (workloads that react to each
                    token: conversation, speculative): each request is sent when its source hands
                    it out (a list: at its scheduled arrival, where its clock starts, before it
                    is sent); one TokenEvent per token, stamped with its chunk's arrival (the last
                    one handed over when the stream ends, carrying usage's
                    prompt_tokens_details.cached_tokens where the server sends it); a request
                    that fails yields RequestFailed(reason) after whatever tokens it had sent.
                    The source is polled in the caller's thread, the streams run in the loop thread.
  serve_load(...)   the load generator (adapters/endpoint/loadgen.py): a whole point, open or
                    closed loop, on the engine's loop or in client processes / Ray actors
                    (clients.py); nothing per token crosses a thread. Returns the point's traces
                    and the client's row fields (`client_fields`: did the load generator keep up).

Every request's `ReqState` goes to the point's record (`record`), which the row fields read
(adapters/endpoint/rows.py).
"""

from __future__ import annotations

import asyncio
import gc
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from adapters.base import Request, RequestFailed, RequestSource, TokenEvent, as_source, now_ns
from adapters.endpoint.bodies import RequestBodies
from adapters.endpoint.clients import ClientProcesses, RayClients, correction
from adapters.endpoint.loadgen import ClientSpec, ClientStats, Item, Job, open_connections, run_job, split_job
from adapters.endpoint.server import Loop, Server
from adapters.endpoint.stream import ReqState, dumps
from harness.core.loop_thread import cancel_and_wait
from harness.core.metrics import RequestTrace
from harness.core.stats import summarize

ShouldStop = Callable[[list[tuple[int, int]], int], bool]


def serve(server: Server, bodies: RequestBodies, requests: list[Request] | RequestSource, start_ns: int,
          record: Callable[[list[ReqState]], None]) -> Iterator[TokenEvent | RequestFailed]:
    """Each request sent when the source hands it out; its tokens as TokenEvents (the module's
    docstring). A consumer that stops early closes the streams still running."""
    loop = server.loop
    assert loop is not None
    source = as_source(requests, start_ns)
    open_loop_start = getattr(source, "start_ns", None)  # a list's schedule: start_ns + arrival_s
    events: queue.SimpleQueue = queue.SimpleQueue()
    live: dict[str, ReqState] = {}
    held: set[str] = set()
    states: list[ReqState] = []
    futs: list[Future] = []
    cap = server.cfg.max_concurrency
    sem = asyncio.Semaphore(cap) if cap else None

    def on_tokens(st: ReqState, first: int, n: int) -> None:  # one hand-off per chunk, not per token
        events.put((st, first, n))

    async def request_task(st: ReqState, body: Any) -> None:
        try:
            if sem is None:
                await server.stream(st, body, on_tokens, bodies.path)
            else:
                async with sem:
                    await server.stream(st, body, on_tokens, bodies.path)
        finally:
            events.put(("end", st))

    try:
        while True:
            now = now_ns()
            for r in source.due(now):
                if r.max_new_tokens < 1:
                    raise ValueError(f"request {r.request_id}: max_new_tokens must be at least 1.")
                scheduled = open_loop_start + round(r.arrival_s * 1e9) if open_loop_start is not None else now
                body, ids = bodies.payload_ids(r.prompt_ids, r.max_new_tokens, r.messages, r.constraint, r.adapter,
                                               r.tools, r.tool_choice)
                st = ReqState(r.request_id, len(ids), r.max_new_tokens, scheduled_ns=scheduled,
                              may_stop=r.constraint is not None, prompt_ids_client=ids)
                live[r.request_id] = st
                states.append(st)
                futs.append(loop.submit(request_task(st, body)))
            nxt = source.next_due_ns()
            if not live:
                if source.exhausted() or nxt is None:
                    break  # nothing runs, and nothing can become due
                time.sleep(max(0.0, (nxt - now_ns()) / 1e9))
                continue
            try:
                item = events.get(timeout=None if nxt is None else max(0.0, (nxt - now_ns()) / 1e9))
            except queue.Empty:
                continue
            if len(item) == 2:  # ("end", state)
                st = live.pop(item[1].request_id)
                if st.request_id in held:  # the last token, held for the usage that follows it
                    held.discard(st.request_id)
                    k = min(st.expected, len(st.token_ids)) - 1
                    yield TokenEvent(st.request_id, k, st.token_ids[k], st.token_times[k], finished=True,
                                     cached_tokens=st.usage_cached, text=st.text if st.may_stop else None,
                                     prompt_ids=st.prompt_ids_server or st.prompt_ids_client)
                if st.error is not None:
                    yield RequestFailed(st.request_id, server.failure_detail(st),
                                        st.token_times[-1] if st.token_times else now_ns())
                continue
            st, first, n = item  # a chunk: its tokens, stamped in the loop that read them
            last = min(first + n, st.expected) - 1
            if st.may_stop and st.request_id in held and first <= st.expected - 1:  # not the last after all
                held.discard(st.request_id)
                yield TokenEvent(st.request_id, first - 1, st.token_ids[first - 1], st.token_times[first - 1])
            for k in range(first, last + 1):
                # the last token is yielded at the stream's end, with the usage's cached tokens; a
                # constrained reply's newest token is held too (it may be the last: finish_reason stop)
                if k == st.expected - 1 or (st.may_stop and k == last):
                    held.add(st.request_id)
                    continue
                yield TokenEvent(st.request_id, k, st.token_ids[k], st.token_times[k])
    finally:  # a consumer that stops early: the streams still running are closed
        cancel_and_wait(futs)
        record(states)


def serve_load(server: Server, bodies: RequestBodies, requests: list[Request], *, closed: bool,
               concurrency: int = 1, max_concurrency: int | None = None, ramp_up_s: float = 0.0,
               processes: int = 1, should_stop: ShouldStop | None = None, backend: str = "local",
               ray_address: str | None = None) -> tuple[dict[str, Any], list[ReqState]]:
    """One point's requests through the load generator (adapters.base.Engine.serve_load says
    what the arguments mean): ({"start_ns", "traces", "client"}, every request's state)."""
    assert server.loop is not None
    cap = [c for c in (max_concurrency, server.cfg.max_concurrency) if c]
    items = load_items(bodies, requests)
    spec = server.client_spec(bodies.path)
    slots = min([concurrency] + cap) if closed else 1
    job = Job(spec, items, 0, closed, slots, None if closed else (min(cap) if cap else None), ramp_up_s)
    states: list[ReqState] = []
    per_process: list[ClientStats] = []
    gc.collect()
    gc.freeze()  # the harness's own objects are not scanned by collections during the point
    try:
        if processes <= 1 and backend == "local":
            start = run_here(server.loop, job, spec, states, per_process, should_stop)
        else:
            start = run_in_clients(job, processes, backend, ray_address, server.cfg.request_timeout_s, states,
                                   per_process, should_stop)
    finally:
        gc.unfreeze()
    return ({"start_ns": start, "traces": traces(states, server.failure_detail, bodies.count_tokens),
             "client": client_fields(states, per_process)}, states)


def load_items(bodies: RequestBodies, requests: list[Request]) -> list[Item]:
    """The load generator's items: each request's body, serialised once, beside its lengths
    and arrival offset."""
    items = []
    for r in requests:
        if r.max_new_tokens < 1:
            raise ValueError(f"request {r.request_id}: max_new_tokens must be at least 1.")
        body, ids = bodies.payload_ids(r.prompt_ids, r.max_new_tokens, r.messages, r.constraint, r.adapter,
                                       r.tools, r.tool_choice)
        items.append(Item(r.request_id, dumps(body), len(ids), r.max_new_tokens, r.arrival_s,
                          may_stop=r.constraint is not None))
    return items


def run_here(loop: Loop, job: Job, spec: ClientSpec, states: list[ReqState], per_process: list[ClientStats],
             should_stop: ShouldStop | None) -> int:
    """The job on the engine's own loop (one client, this process); returns its start time.
    `states` fills as requests are sent; `per_process` gets the client's stats."""
    async def connect() -> None:  # in the loop: its session is made there
        await open_connections(loop.streams(spec), job)

    loop.submit(connect()).result()
    start = now_ns() + 5_000_000
    job.start_ns = start
    stats = ClientStats(pid=os.getpid())
    finished = threading.Event()

    async def go() -> None:
        try:
            await run_job(job, loop.streams(spec), states, stats)
        finally:
            finished.set()

    fut = loop.submit(go())
    while not finished.wait(0.1):
        if should_stop is not None and should_stop(
                [(s.scheduled_ns, s.token_times[0]) for s in list(states) if s.token_times], start):
            fut.cancel()
            finished.wait(30)
            break
    if not fut.cancelled() and fut.exception() is not None:
        raise fut.exception()  # type: ignore[misc]
    per_process.append(stats)
    return start


def run_in_clients(job: Job, processes: int, backend: str, ray_address: str | None, request_timeout_s: float,
                   states: list[ReqState], per_process: list[ClientStats], should_stop: ShouldStop | None) -> int:
    """The job split over `processes` client processes (or Ray actors), their clocks measured
    against this one; returns the start time. `states` and `per_process` get every client's."""
    jobs = split_job(job, processes)
    pool = RayClients(jobs, ray_address) if backend == "ray" else ClientProcesses(jobs)
    try:
        offsets = pool.measure_clocks()
        start = now_ns() + 20_000_000
        pool.start(start, [correction(off, err) for off, err in offsets])
        while pool.running():
            time.sleep(0.1)
            if should_stop is not None and should_stop(pool.first_tokens(), start):
                pool.stop()
                break
        results = pool.wait(request_timeout_s + 60)
    finally:
        pool.close()
    for (sts, st), (off, err) in zip(results, offsets):
        st.clock_offset_ns, st.clock_error_ns = off, err
        states += sts
        per_process.append(st)
    return start


def traces(states: list[ReqState], failure_detail: Callable[[ReqState], str],
           count_tokens: Callable[[str], int] | None = None) -> list[RequestTrace]:
    """One RequestTrace per request sent, its error said (a failure, or cancelled by an early stop),
    with its first answer token and its reasoning counts (`reasoning_counts`)."""
    out = []
    for st in states:
        error = None
        if st.error is not None:
            error = failure_detail(st)
        elif st.cancelled:
            error = "cancelled (the point stopped early)"
        tr = RequestTrace(st.request_id, st.scheduled_ns, st.prompt_len, st.token_times[:st.expected],
                          st.token_ids[:st.expected], error, first_answer_ns=st.first_answer_ns,
                          reasoning=bool(st.reasoning_text))
        tr.reasoning_tokens, tr.answer_tokens, tr.reasoning_source = reasoning_counts(st, count_tokens)
        out.append(tr)
    return out


def reasoning_counts(st: ReqState, count_tokens: Callable[[str], int] | None) -> tuple[int | None, int | None,
                                                                                           str | None]:
    """(reasoning tokens, answer tokens, where from) of one request: the server's usage where it
    gives reasoning_tokens, else the tokenizer's count of the reasoning text; (None, None, None)
    for a stream without reasoning whose usage says nothing of it."""
    total = st.usage_completion if st.usage_completion is not None else len(st.token_ids)
    if st.usage_reasoning is not None:
        return st.usage_reasoning, total - st.usage_reasoning, "usage"
    if not st.reasoning_text:
        return None, None, None
    if count_tokens is None:
        return None, None, None
    n = count_tokens(st.reasoning_text)  # the text re-tokenised: it may differ from what the server sampled
    return n, (max(0, total - n) if st.first_answer_ns is not None else 0), "tokenizer"


def client_fields(states: list[ReqState], per_process: list[ClientStats]) -> dict[str, Any]:
    """Row fields saying whether the load generator kept up (docs/metrics.md, "Client distortion"):
    send lag (actual send minus when the request was due: its scheduled time, or the moment a
    capped slot freed), the loop lag of every client process pooled, each process's CPU over wall
    time (the highest), the achieved send rate beside the scheduled one, and the clock offsets."""
    lags = [(s.sent_ns - (s.ready_ns or s.scheduled_ns)) / 1e9 for s in states if s.sent_ns is not None]
    sent = sorted(s.sent_ns for s in states if s.sent_ns is not None)
    due = sorted(s.ready_ns or s.scheduled_ns for s in states if s.sent_ns is not None)
    loop = summarize([x for p in per_process for x in p.loop_lags_s])
    lag = summarize(lags)

    def rate(ts: list[int]) -> float | None:
        span = (ts[-1] - ts[0]) / 1e9 if len(ts) > 1 else 0.0
        return (len(ts) - 1) / span if span > 0 else None

    return {
        "client_processes": len(per_process),
        "send_lag_s": lag["p50"], "send_lag_s_p99": lag["p99"], "send_lag_s_max": lag["max"],
        "loop_lag_s_max": loop["max"], "loop_lag_s_p99": loop["p99"],
        "client_cpu_frac": max((p.cpu_s / p.wall_s for p in per_process if p.wall_s > 0), default=None),
        "client_cpu_s": sum(p.cpu_s for p in per_process),
        "achieved_rate": rate(sent), "scheduled_rate": rate(due),
        "client_clock_offset_s_max": max(abs(p.clock_offset_ns) for p in per_process) / 1e9 if per_process else None,
        "client_clock_error_s_max": max(p.clock_error_ns for p in per_process) / 1e9 if per_process else None,
    }

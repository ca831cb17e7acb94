"""The load generator: the requests of one serving point sent to an OpenAI-compatible server, on
one asyncio loop per client, every stream read and stamped in that loop (adapters/endpoint/stream.py).

A point's requests are a `Job` per client:
- open loop: each request is sent at its scheduled time (start + arrival), in arrival order;
  with a concurrency cap the next waits for a free slot (first in, first out);
- closed loop: `slots` requests in flight; when one ends, the next is sent at once and its
  clock starts then (the end of the one before: its last token, or its failure).

With several client processes (`workload.client_processes=N`, adapters/endpoint/clients.py) the
open-loop schedule is dealt round robin (request i to process i mod N, in arrival order), the
concurrency cap and the closed-loop slots are split as evenly as they go (the first processes
take the remainder), and each process's requests follow the same rule (`split_job`).

What each client also measures about itself (`ClientStats`): its CPU time over the wall time
of the point, and loop lag - how late a 2 ms timer fires on its event loop while streams are
active (a loop that is busy, or stopped by garbage collection, fires late and reads late), a
late tick counting once per 2 ms of its stall (`lag_samples`) so the percentiles are over time.

Before a point starts, each client opens the connections its first requests will use
(`open_connections`: as many concurrent `GET /v1/models` as the job has requests in flight at once,
read to the end so the connection stays in the keep-alive pool). A load generator that kept its
connections from the point before would have them; one that opens them in the measured burst
makes its first requests late by the TCP handshakes (about 10 ms of send lag for 64 streams on
one core) and charges that to the server's TTFT. A server that answers the GET with an error
still leaves its connection open; one that cannot be reached fails the point's first request,
which says why, as before.

A request's body is built before the point (adapters/endpoint/bodies.py) and serialised once
(`Item.body`); what the client keeps of each request is its `ReqState` (stream.py), the row's
per-request fields are read from those (adapters/endpoint/rows.py, serving.py).
"""

from __future__ import annotations

import asyncio
import collections
import os
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from adapters.endpoint.stream import ReqState, stamp_reads, stream_completion

TICK_S = 0.002  # the loop-lag timer's period
OPEN_MAX = 64  # an open loop without a cap: connections opened before the point starts


def tls_context(verify_tls: bool, ca_bundle: str | None) -> bool | ssl.SSLContext:
    """How a client checks the server's certificate: False (not checked), True (the system's CAs),
    or a context trusting `ca_bundle` as well."""
    if not verify_tls:
        return False
    if not ca_bundle:
        return True
    ctx = ssl.create_default_context()
    ctx.load_verify_locations(cafile=str(Path(ca_bundle).expanduser()))
    return ctx


KEEPALIVE_S = 4.0  # seconds an idle connection is kept for the next request (ClientSpec.session)

@dataclass
class ClientSpec:
    """How to reach the server: what a client process needs (picklable)."""

    url: str  # the completions URL
    headers: dict[str, str] = field(default_factory=dict)
    verify_tls: bool = True
    ca_bundle: str | None = None
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 600.0
    models_url: str | None = None  # the server's model list, which open_connections GETs (None: none)
    # False: the server closes the connection after each streamed response although it answers
    # `Keep-Alive` (llama-server: ServerKind.keepalive), so a request sent on the kept connection is
    # lost ("Can not write request body", 0 tokens): one connection per request, none opened ahead
    keepalive: bool = True

    def session(self) -> aiohttp.ClientSession:
        """An aiohttp session (call inside the running loop): no connection limit, keep-alive,
        every socket read stamped (`StampedHandler`). An idle connection is closed after
        KEEPALIVE_S, before the server's own idle timeout (uvicorn's, vLLM's
        VLLM_HTTP_TIMEOUT_KEEP_ALIVE: 5 s) can close it under a request sent on it: aiohttp's 15 s
        default lost such a request ("server disconnected", 0 tokens) after a conversation's
        think time."""
        reuse = {"keepalive_timeout": KEEPALIVE_S} if self.keepalive else {"force_close": True}
        conn = aiohttp.TCPConnector(limit=0, ssl=tls_context(self.verify_tls, self.ca_bundle),
                                    enable_cleanup_closed=True, **reuse)
        stamp_reads(conn)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        return aiohttp.ClientSession(connector=conn, headers=self.headers, timeout=timeout, trust_env=False)


@dataclass
class Item:
    """One request as the client sends it."""

    request_id: str
    body: bytes  # the JSON body, encoded once before the point starts
    prompt_len: int
    expected: int  # max_tokens
    arrival_s: float = 0.0  # open loop: seconds after the start
    may_stop: bool = False  # a constrained request: it may end at a complete reply (ReqState.may_stop)


@dataclass
class Job:
    """One client process's share of a point."""

    spec: ClientSpec
    items: list[Item]
    start_ns: int
    closed: bool = False
    slots: int = 1  # closed loop: requests kept in flight
    max_concurrency: int | None = None  # open loop: the cap (None: none)
    ramp_up_s: float = 0.0  # closed loop: slots start one after another over this


def connections_needed(job: Job) -> int:
    """How many connections the job's first requests use at once: its slots (closed loop), its
    cap (open loop), else at most OPEN_MAX."""
    n = job.slots if job.closed else (job.max_concurrency or OPEN_MAX)
    return max(0, min(n, len(job.items)))


async def open_connections(session: aiohttp.ClientSession, job: Job, timeout_s: float = 10.0) -> int:
    """Open the keep-alive connections `job`'s first requests use (`connections_needed`) in
    `session` before the point starts (the module's docstring says why): that many concurrent
    GETs of the server's model list, each read to the end. Returns how many answered; a GET that
    fails is left to the point's own requests to report."""
    target = job.spec.models_url
    if target is None or not job.spec.keepalive:  # a connection per request: none kept to open ahead
        return 0
    limit = aiohttp.ClientTimeout(total=timeout_s)

    async def one() -> bool:
        try:
            async with session.get(target, timeout=limit) as resp:
                await resp.read()
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    return sum(await asyncio.gather(*(one() for _ in range(connections_needed(job)))))


@dataclass
class ClientStats:
    """What one client process measured about itself during a point."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    loop_lags_s: list[float] = field(default_factory=list)  # timer lateness with streams active (lag_samples)
    clock_offset_ns: int = 0  # its clock minus the harness's (0 in the harness's own process)
    clock_error_ns: int = 0  # the bound on that offset: half the ping's round trip
    pid: int = 0


def lag_samples(late_ns: int, period_ns: int) -> list[float]:
    """The loop-lag samples (s) of one timer tick that fired `late_ns` late: one per `period_ns`
    of the stall, as the ticks due during it would have read - late by L, L - period, ... - so a
    stall counts for the time it lasted, and a percentile of the samples is one over time (a
    20 ms stall is ten samples, a 2 ms one is one)."""
    out = [max(0, late_ns) / 1e9]
    late_ns -= period_ns
    while late_ns > 0:
        out.append(late_ns / 1e9)
        late_ns -= period_ns
    return out


async def sleep_until(t_ns: int) -> None:
    """Sleep until `t_ns` of time.perf_counter_ns() (at once if it has passed)."""
    delay = (t_ns - time.perf_counter_ns()) / 1e9
    if delay > 0:
        await asyncio.sleep(delay)


class JobRun:
    """One job running on the current loop: its sends (open or closed loop), the loop-lag ticker,
    and the records appended to `states` as requests are sent."""

    def __init__(self, job: Job, session: aiohttp.ClientSession, states: list[ReqState], stats: ClientStats):
        self.job, self.session, self.states, self.stats = job, session, states, stats
        self.active = 0  # streams in flight (the ticker records lag only while there are)

    async def send(self, it: Item, st: ReqState) -> None:
        self.active += 1
        try:
            await stream_completion(self.session, self.job.spec.url, it.body, st, None,
                                    self.job.spec.request_timeout_s)
        finally:
            self.active -= 1

    async def ticker(self) -> None:
        """Loop lag: how late each TICK_S timer fires while streams are active (`lag_samples`)."""
        period = int(TICK_S * 1e9)
        lags = self.stats.loop_lags_s
        while True:
            t0 = time.perf_counter_ns()
            await asyncio.sleep(TICK_S)
            if self.active:
                lags += lag_samples(time.perf_counter_ns() - t0 - period, period)

    def state(self, it: Item, scheduled: int) -> ReqState:
        st = ReqState(it.request_id, it.prompt_len, it.expected, scheduled_ns=scheduled, ready_ns=scheduled,
                      may_stop=it.may_stop)
        self.states.append(st)
        return st

    async def open_loop(self) -> None:
        """Each request at its arrival time; under a cap, when a slot frees (first in, first out)."""
        job = self.job
        sem = asyncio.Semaphore(job.max_concurrency) if job.max_concurrency else None
        tasks = []
        try:
            for it in sorted(job.items, key=lambda i: i.arrival_s):
                at = job.start_ns + round(it.arrival_s * 1e9)
                await sleep_until(at)
                st = self.state(it, at)
                if sem is not None:
                    await sem.acquire()
                    st.ready_ns = max(at, time.perf_counter_ns())
                    tasks.append(asyncio.ensure_future(self._capped(it, st, sem)))
                else:
                    tasks.append(asyncio.ensure_future(self.send(it, st)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _capped(self, it: Item, st: ReqState, sem: asyncio.Semaphore) -> None:
        try:
            await self.send(it, st)
        finally:
            sem.release()

    async def closed_loop(self) -> None:
        """`slots` requests in flight, each slot sending its next when its last one ends."""
        pending = collections.deque(self.job.items)
        await asyncio.gather(*(self._slot(i, pending) for i in range(min(self.job.slots, len(self.job.items)))))

    async def _slot(self, i: int, pending: collections.deque) -> None:
        job = self.job
        at = job.start_ns + int(job.ramp_up_s * 1e9 * i / max(job.slots, 1))
        await sleep_until(at)
        while pending:
            it = pending.popleft()
            st = self.state(it, at)
            await self.send(it, st)
            at = st.token_times[-1] if st.token_times and st.error is None else time.perf_counter_ns()


async def run_job(job: Job, session: aiohttp.ClientSession, states: list[ReqState],
                  stats: ClientStats) -> None:
    """Send the job's requests and read their streams; every request's record is appended to
    `states` as it is sent. Cancelling the task stops the point: streams close, records stay."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    run = JobRun(job, session, states, stats)
    tick = asyncio.ensure_future(run.ticker())
    try:
        await (run.closed_loop() if job.closed else run.open_loop())
    finally:
        tick.cancel()
        stats.wall_s = time.perf_counter() - wall0
        stats.cpu_s = time.thread_time() - cpu0
        stats.pid = os.getpid()


def split_job(job: Job, n: int) -> list[Job]:
    """The job dealt over n client processes (the module's docstring says how)."""
    if n <= 1:
        return [job]
    if job.closed:
        n = max(1, min(n, job.slots))
        slots = [job.slots // n + (1 if p < job.slots % n else 0) for p in range(n)]
        # requests in proportion to the slots, dealt in order so each process starts with its first
        shares: list[list[Item]] = [[] for _ in range(n)]
        weights = [s / job.slots for s in slots]
        for i, it in enumerate(job.items):
            p = min(range(n), key=lambda q: (len(shares[q]) + 1) / weights[q])
            shares[p].append(it)
        return [Job(job.spec, shares[p], job.start_ns, True, slots[p], None, job.ramp_up_s) for p in range(n)]
    ordered = sorted(job.items, key=lambda i: i.arrival_s)
    caps: list[int | None] = [None] * n
    if job.max_concurrency:
        n = max(1, min(n, job.max_concurrency))
        caps = [job.max_concurrency // n + (1 if p < job.max_concurrency % n else 0) for p in range(n)]
    return [Job(job.spec, ordered[p::n], job.start_ns, False, 1, caps[p], job.ramp_up_s) for p in range(n)]

"""The load generator: the requests of one serving point sent to an OpenAI-compatible server, on
one asyncio loop per client process, every stream read and stamped in that loop.

A point's requests are a `Job` per client process:
- open loop: each request is sent at its scheduled time (start + arrival), in arrival order;
  with a concurrency cap the next waits for a free slot (first in, first out);
- closed loop: `slots` requests in flight; when one ends, the next is sent at once and its
  clock starts then (the end of the one before: its last token, or its failure).

With several client processes (`workload.client_processes=N`) the open-loop schedule is dealt
round robin (request i to process i mod N, in arrival order), the concurrency cap and the
closed-loop slots are split as evenly as they go (the first processes take the remainder), and
each process's requests follow the same rule. Every process stamps with `time.perf_counter_ns()`,
which on Linux is CLOCK_MONOTONIC: one clock for every process of the machine, so the records
merge without conversion. Each process's offset from the harness's clock is still measured, by
a ping at start (offset = its reading minus the midpoint of the harness's send and receive;
error at most half the round trip); where it exceeds that bound (a clock that is not shared:
another machine), the process is told its start in its own clock and its records are shifted
back by the offset (`correction`, `shift_states`).

What each process also measures about itself (`ClientStats`): its CPU time over the wall time
of the point, and loop lag - how late a 2 ms timer fires on its event loop while streams are
active (a loop that is busy, or stopped by garbage collection, fires late and reads late), a
late tick counting once per 2 ms of its stall (`lag_samples`) so the percentiles are over time.

A client process (`CHILD`) reads a pickled Job on stdin, then "ping" / "start <ns>" / "stop"
lines, and writes pickled messages on stdout: pong, first tokens, its records and stats.

Before a point starts, each client opens the connections its first requests will use
(`open_connections`: as many concurrent `GET /v1/models` as the job has requests in flight at once,
read to the end so the connection stays in the keep-alive pool). A load generator that kept its
connections from the point before would have them; one that opens them in the measured burst
makes its first requests late by the TCP handshakes (about 10 ms of send lag for 64 streams on
one core) and charges that to the server's TTFT. A server that answers the GET with an error
still leaves its connection open; one that cannot be reached fails the point's first request,
which says why, as before.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import pickle
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp

from adapters.base import now_ns
from adapters.endpoint.stream import ReqState, stamp_reads, stream_completion

CHILD = "from adapters.endpoint.client import child_main; child_main()"  # a client process's command
TICK_S = 0.002  # the loop-lag timer's period
PROGRESS_S = 0.1  # how often a client process reports first tokens (for the saturation check)
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

    def session(self) -> aiohttp.ClientSession:
        """An aiohttp session (call inside the running loop): no connection limit, keep-alive,
        every socket read stamped (`StampedHandler`)."""
        conn = aiohttp.TCPConnector(limit=0, ssl=tls_context(self.verify_tls, self.ca_bundle),
                                    enable_cleanup_closed=True)
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
    if target is None:
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
        st = ReqState(it.request_id, it.prompt_len, it.expected, scheduled_ns=scheduled, ready_ns=scheduled)
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


# ---- several client processes ------------------------------------------------------------------

def correction(offset_ns: int, error_ns: int) -> int:
    """The shift applied to a client's clock: its measured offset where that exceeds the
    measurement's own bound (another machine's clock), else 0 (one clock: nothing to correct)."""
    return offset_ns if abs(offset_ns) > error_ns else 0


def shift_states(states: list[ReqState], d: int) -> None:
    """Move a client's records from its clock to the harness's (subtract its offset `d`)."""
    if not d:
        return
    for s in states:
        s.scheduled_ns -= d
        s.ready_ns -= d
        if s.sent_ns is not None:
            s.sent_ns -= d
        s.token_times = [t - d for t in s.token_times]
        s.chunk_times = [t - d for t in s.chunk_times]


class ClientProcesses:
    """N client processes (`python -m adapters.endpoint.client`) running one point's jobs.
    `first_tokens()` gives the (scheduled, first token) times they reported so far; `stop()`
    ends the point early; `wait()` returns every process's records and stats."""

    def __init__(self, jobs: list[Job], pin: set[int] | None = None):
        self.procs: list[subprocess.Popen] = []
        self.results: list[tuple[list[ReqState], ClientStats] | None] = [None] * len(jobs)
        self.errors: list[str] = []
        self._first: list[tuple[int, int]] = []
        self._pong: list[tuple[int, int] | None] = [None] * len(jobs)
        self._readers: list[threading.Thread] = []
        self._ready = [threading.Event() for _ in jobs]
        self.shifts = [0] * len(jobs)
        self._lock = threading.Lock()
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for i, job in enumerate(jobs):
            p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, env=env, cwd=root)
            self.procs.append(p)
            assert p.stdin is not None
            pickle.dump(job, p.stdin)
            p.stdin.flush()
            t = threading.Thread(target=self._read, args=(i, p), daemon=True, name=f"loadgen-client-{i}")
            t.start()
            self._readers.append(t)

    def _read(self, i: int, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        try:
            while True:
                message, payload = pickle.load(p.stdout)
                if message == "first":
                    d = self.shifts[i]
                    with self._lock:
                        self._first += [(a - d, f - d) for a, f in payload]
                elif message == "pong":
                    self._pong[i] = (payload, now_ns())
                elif message == "ready":
                    self._ready[i].set()
                elif message == "done":
                    self.results[i] = payload
                elif message == "error":
                    self.errors.append(f"client process {i}: {payload}")
        except (EOFError, pickle.UnpicklingError, OSError):
            return

    def _send(self, i: int, line: bytes) -> None:
        try:
            self.procs[i].stdin.write(line)  # type: ignore[union-attr]
            self.procs[i].stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError, ValueError):
            pass

    def measure_clocks(self, pings: int = 5) -> list[tuple[int, int]]:
        """(offset, error bound) in ns of each process's clock against this one, once every
        process is ready: the ping with the shortest round trip of `pings`."""
        out = []
        for i in range(len(self.procs)):
            if not self._ready[i].wait(60):
                raise RuntimeError(f"client process {i} did not start within 60 s (exit code "
                                   f"{self.procs[i].poll()}){': ' + '; '.join(self.errors) if self.errors else ''}")
            best: tuple[int, int] | None = None
            for _ in range(pings):
                self._pong[i] = None
                t0 = now_ns()
                self._send(i, b"ping\n")
                deadline = time.monotonic() + 10
                while self._pong[i] is None and time.monotonic() < deadline:
                    time.sleep(0.0002)
                pong = self._pong[i]
                if pong is None:
                    raise RuntimeError(f"client process {i} did not answer a ping (exit code {self.procs[i].poll()})")
                theirs, t1 = pong
                if best is None or (t1 - t0) // 2 < best[1]:
                    best = (theirs - (t0 + t1) // 2, (t1 - t0) // 2)
            out.append(best)  # type: ignore[arg-type]
        return out

    def start(self, start_ns: int, shifts: list[int]) -> None:
        """Start at `start_ns` of the harness's clock: each process's `start_ns + shift` (its clock
        minus the harness's, `correction()`)."""
        self.shifts = shifts
        for i in range(len(self.procs)):
            self._send(i, b"start %d\n" % (start_ns + shifts[i]))

    def first_tokens(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(self._first)

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self._send(i, b"stop\n")

    def running(self) -> bool:
        return any(r is None and p.poll() is None for r, p in zip(self.results, self.procs))

    def wait(self, timeout_s: float) -> list[tuple[list[ReqState], ClientStats]]:
        for t in self._readers:
            t.join(timeout_s)
        self.close()
        missing = [i for i, r in enumerate(self.results) if r is None]
        if missing:
            raise RuntimeError(f"client processes {missing} ended without their records"
                               + (f": {'; '.join(self.errors)}" if self.errors else ""))
        for (states, _), d in zip(self.results, self.shifts):  # type: ignore[misc]
            shift_states(states, d)
        return self.results  # type: ignore[return-value]

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ---- client processes as Ray actors (a local Ray instance, or a cluster) -----------------------------

class ClientActor:
    """One client as a Ray actor (async: its methods share the actor's event loop, so the harness
    can ask for first tokens and stop the point while `run` streams)."""

    def __init__(self) -> None:
        self.states: list[ReqState] = []
        self.stats = ClientStats()
        self.task: asyncio.Task | None = None
        self.session: aiohttp.ClientSession | None = None
        gc.freeze()

    async def ping(self) -> int:
        return now_ns()

    async def connect(self, job: Job) -> int:
        """The job's connections, opened before its start (`open_connections`)."""
        self.session = job.spec.session()
        return await open_connections(self.session, job)

    async def run(self, job: Job) -> tuple[list[ReqState], ClientStats]:
        session = self.session or job.spec.session()
        self.task = asyncio.current_task()
        try:
            await run_job(job, session, self.states, self.stats)
        except asyncio.CancelledError:
            pass
        finally:
            await session.close()
        return self.states, self.stats

    async def first_tokens(self) -> list[tuple[int, int]]:
        return [(s.scheduled_ns, s.token_times[0]) for s in self.states if s.token_times]

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()


class RayClients:
    """The client processes as Ray actors - the same calls as `ClientProcesses`. `address`: a Ray
    cluster to join (None: the running instance, or a local one started here). Each actor's clock
    offset is measured by ping like a local process's: on other machines it is a real offset, and
    its bound (half the round trip) is what every TTFT/E2EL may be off by."""

    def __init__(self, jobs: list[Job], address: str | None = None):
        try:
            import ray
        except ImportError:
            raise RuntimeError("workload.client_backend=ray needs Ray: pip install 'ray>=2.9'") from None
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                     configure_logging=False)
        actor = ray.remote(num_cpus=0)(ClientActor)
        self.jobs = jobs
        self.actors = [actor.remote() for _ in jobs]
        self.refs: list[Any] = []
        self.shifts = [0] * len(jobs)
        ray.get([a.ping.remote() for a in self.actors], timeout=120)
        ray.get([a.connect.remote(job) for a, job in zip(self.actors, jobs)], timeout=120)

    def measure_clocks(self, pings: int = 5) -> list[tuple[int, int]]:
        out = []
        for a in self.actors:
            best: tuple[int, int] | None = None
            for _ in range(pings):
                t0 = now_ns()
                theirs = self.ray.get(a.ping.remote(), timeout=30)
                t1 = now_ns()
                if best is None or (t1 - t0) // 2 < best[1]:
                    best = (theirs - (t0 + t1) // 2, (t1 - t0) // 2)
            out.append(best)  # type: ignore[arg-type]
        return out

    def start(self, start_ns: int, shifts: list[int]) -> None:
        self.shifts = shifts
        for job, d in zip(self.jobs, shifts):
            job.start_ns = start_ns + d
        self.refs = [a.run.remote(job) for a, job in zip(self.actors, self.jobs)]

    def first_tokens(self) -> list[tuple[int, int]]:
        parts = self.ray.get([a.first_tokens.remote() for a in self.actors])
        return [(a - d, f - d) for part, d in zip(parts, self.shifts) for a, f in part]

    def stop(self) -> None:
        self.ray.get([a.stop.remote() for a in self.actors])

    def running(self) -> bool:
        ready, _ = self.ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) < len(self.refs)

    def wait(self, timeout_s: float) -> list[tuple[list[ReqState], ClientStats]]:
        results = self.ray.get(self.refs, timeout=timeout_s)
        for (states, _), d in zip(results, self.shifts):
            shift_states(states, d)
        return results

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []


class ChildProcess:
    """A client process's side (`CHILD`): its Job from stdin, the harness's control lines read on
    a thread, its messages pickled to stdout, and the job run on its own loop."""

    def __init__(self) -> None:
        self.out = sys.stdout.buffer
        self.lock = threading.Lock()
        self.job: Job = pickle.load(sys.stdin.buffer)
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.started = threading.Event()
        self.task: asyncio.Task | None = None  # the running point (cancelled by "stop")
        self.stopped_before_start = False
        self.states: list[ReqState] = []
        self.stats = ClientStats()

    def send(self, message: str, payload: Any) -> None:
        with self.lock:
            pickle.dump((message, payload), self.out)
            self.out.flush()

    def control(self) -> None:
        """The harness's lines: ping, start <ns>, stop (or EOF)."""
        for line in sys.stdin.buffer:
            word = line.split()
            if not word:
                continue
            if word[0] == b"ping":
                self.send("pong", now_ns())
            elif word[0] == b"start":
                self.job.start_ns = int(word[1])
                self.loop.call_soon_threadsafe(self.started.set)
            elif word[0] == b"stop":
                break
        task = self.task
        self.loop.call_soon_threadsafe(lambda: task.cancel() if task is not None else self._stop_before_start())
        self.started.set()

    def _stop_before_start(self) -> None:
        self.stopped_before_start = True

    async def progress(self) -> None:
        """Every PROGRESS_S, the (scheduled, first token) times not reported yet."""
        states = self.states
        seen, reported = 0, set()
        while True:
            await asyncio.sleep(PROGRESS_S)
            new = [(i, s) for i, s in enumerate(states[seen:], seen) if s.token_times and i not in reported]
            if new:
                reported.update(i for i, _ in new)
                self.send("first", [(s.scheduled_ns, s.token_times[0]) for _, s in new])
            while seen < len(states) and seen in reported:
                seen += 1

    async def main(self) -> None:
        session = self.job.spec.session()
        await open_connections(session, self.job)
        self.send("ready", None)
        try:
            while not self.started.is_set():
                await asyncio.sleep(0.001)
            if self.stopped_before_start:
                return
            self.task = asyncio.current_task()
            prog = asyncio.ensure_future(self.progress())
            try:
                await run_job(self.job, session, self.states, self.stats)
            except asyncio.CancelledError:
                pass
            finally:
                prog.cancel()
        finally:
            await session.close()


def child_main() -> None:
    """A client process: run one Job, reporting first tokens as they come."""
    child = ChildProcess()
    threading.Thread(target=child.control, daemon=True).start()
    gc.freeze()
    try:
        child.loop.run_until_complete(child.main())
        child.send("done", (child.states, child.stats))
    except Exception as e:  # reported to the harness, which names the process
        child.send("error", f"{type(e).__name__}: {e}")
    os._exit(0)  # the control thread may still block on stdin

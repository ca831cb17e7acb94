"""The load generator's clients beyond the harness's own loop: client processes of this machine
(`ClientProcesses`, each a `python -c CHILD` that runs its `Job` on its own event loop) and Ray
actors (`RayClients`, on this machine or a cluster), both driven with the same calls (measure
the clocks, start, first tokens, stop, wait).

Every process stamps with `time.perf_counter_ns()`, which on Linux is CLOCK_MONOTONIC: one clock
for every process of the machine, so the records merge without conversion. Each client's offset
from the harness's clock is still measured, by pings before the start (`clock_offset`: offset =
its reading minus the midpoint of the harness's send and receive, from the ping with the shortest
round trip; error at most half that round trip); where it exceeds that bound (a clock that is not
shared: another machine), the client is told its start in its own clock and its records are
shifted back by the offset (`correction`, `shift_states`).

A client process (`CHILD`) reads a pickled Job on stdin, then "ping" / "start <ns>" / "stop"
lines, and writes pickled messages on stdout: pong, first tokens, its records and stats.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from adapters.base import now_ns
from adapters.endpoint.loadgen import ClientStats, Job, open_connections, run_job
from adapters.endpoint.stream import ReqState

CHILD = "from adapters.endpoint.clients import child_main; child_main()"  # a client process's command
PROGRESS_S = 0.1  # how often a client process reports first tokens (for the saturation check)


def clock_offset(ping: Callable[[], tuple[int, int]], pings: int = 5) -> tuple[int, int]:
    """(offset, error bound) in ns of a client's clock against this one: `ping()` asks the
    client for its clock and returns (its reading, when the answer arrived here, `now_ns()`);
    of `pings` pings, the one with the shortest round trip."""
    best: tuple[int, int] | None = None
    for _ in range(pings):
        t0 = now_ns()
        theirs, t1 = ping()
        if best is None or (t1 - t0) // 2 < best[1]:
            best = (theirs - (t0 + t1) // 2, (t1 - t0) // 2)
    assert best is not None
    return best


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
    """N client processes (`python -c CHILD`) running one point's jobs.
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
        process is ready (`clock_offset`; the answer stamped when this process read it)."""
        out = []
        for i in range(len(self.procs)):
            if not self._ready[i].wait(60):
                raise RuntimeError(f"client process {i} did not start within 60 s (exit code "
                                   f"{self.procs[i].poll()}){': ' + '; '.join(self.errors) if self.errors else ''}")
            out.append(clock_offset(lambda i=i: self._ping(i), pings))
        return out

    def _ping(self, i: int) -> tuple[int, int]:
        self._pong[i] = None
        self._send(i, b"ping\n")
        deadline = time.monotonic() + 10
        while self._pong[i] is None and time.monotonic() < deadline:
            time.sleep(0.0002)
        pong = self._pong[i]
        if pong is None:
            raise RuntimeError(f"client process {i} did not answer a ping (exit code {self.procs[i].poll()})")
        return pong

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
        return [clock_offset(lambda a=a: (self.ray.get(a.ping.remote(), timeout=30), now_ns()), pings)
                for a in self.actors]

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

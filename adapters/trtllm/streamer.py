"""The asyncio side of the TensorRT-LLM adapter: one event loop in a background thread that does
EVERY call into the LLM API that touches its executor (submit, abort, stats), and records token
arrivals.

Why one thread. TensorRT-LLM's proxy sends requests and cancellations to its executor worker over
one ZeroMQ socket, and ZeroMQ sockets are not thread-safe: `generate_async()` on this loop and
`abort()` from the harness thread would write to the socket from two threads. And the LLM API
creates its iteration-stats queue on the first `generate_async()`, inside the running loop, as an
asyncio queue: only that loop can read it (`LLM.get_stats_async()`); the synchronous `get_stats()`
from another thread times out with None. So submit, abort and the stats drain all run here, and
the harness thread waits on their results.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Coroutine
from typing import Any

from adapters.base import now_ns
from adapters.trtllm.timing import parse_iteration_stats
from harness.core.loop_thread import LoopThread

log = logging.getLogger(__name__)
WAIT_S = 600.0  # longest wait for one token before the adapter gives up
CALL_S = 60.0  # longest wait for one call on the loop (submit, abort, stats)


class Stream:
    """The tokens of one request, each stamped when it reached this process, and what TensorRT-LLM
    reported about it (perf metrics: first_iter, and last_iter after each response)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.tokens: list[int] = []
        self.times: list[int] = []
        self.done = False
        self.error: BaseException | None = None
        self.result: Any = None  # TensorRT-LLM's RequestOutput (for abort)
        self.perf: Any = None  # the newest RequestPerfMetrics
        self.first_iter: int | None = None
        self.iters: list[tuple[int, int | None]] = []  # (tokens so far, last_iter) per response


class Streamer:
    """An asyncio loop in a background thread that runs `generate_async(..., streaming=True)` for
    every request (the LLM API's documented streaming path), its aborts and its stats."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: queue.Queue = queue.Queue()  # (stream, first_index, count) for serve()
        self.loop_thread = LoopThread("trtllm-streams")
        self.loop = self.loop_thread.loop

    def call(self, coro: Coroutine, timeout: float = CALL_S) -> Any:
        """Run a coroutine on the loop and wait for its result (from the harness thread)."""
        return self.loop_thread.run(coro, timeout)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, llm: Any, ids: list[int], params: Any, key: str) -> Stream:
        return self.submit_batch(llm, [(ids, params, key)])[0]

    def submit_batch(self, llm: Any, requests: list[tuple[list[int], Any, str]]) -> list[Stream]:
        """Submit every request in ONE callback on the loop, back to back (the executor takes
        whatever has arrived when an iteration starts: a batch trickling in one request per loop
        turn is more likely to be split over iterations)."""
        streams = [Stream(key) for _, _, key in requests]
        self.call(self._submit_all(llm, requests, streams))
        return streams

    async def _submit_all(self, llm: Any, requests: list[tuple[list[int], Any, str]], streams: list[Stream]) -> None:
        for (ids, params, _), stream in zip(requests, streams):
            try:
                stream.result = llm.generate_async(ids, sampling_params=params, streaming=True)
            except BaseException as e:
                stream.error, stream.done = e, True
                self.events.put((stream, 0, 0))
        for stream in streams:
            if stream.result is not None:
                self.loop.create_task(self._run(stream))

    async def _run(self, stream: Stream) -> None:
        try:
            async for out in stream.result:
                t = now_ns()
                comp = out.outputs[0]
                new = list(comp.token_ids[len(stream.tokens):])
                perf = getattr(comp, "request_perf_metrics", None)
                with self.cond:
                    first = len(stream.tokens)
                    stream.tokens.extend(new)
                    stream.times.extend([t] * len(new))
                    if perf is not None:
                        stream.perf = perf
                        if stream.first_iter is None and getattr(perf, "first_iter", None) is not None:
                            stream.first_iter = int(perf.first_iter)
                        last = getattr(perf, "last_iter", None)
                        stream.iters.append((len(stream.tokens), None if last is None else int(last)))
                    if out.finished:
                        stream.done = True
                    self.cond.notify_all()
                self.events.put((stream, first, len(new)))
        except BaseException as e:  # surfaced to the waiting caller
            with self.cond:
                stream.error, stream.done = e, True
                self.cond.notify_all()
            self.events.put((stream, len(stream.tokens), 0))
        else:
            with self.cond:
                stream.done = True
                self.cond.notify_all()

    def abort(self, streams: list[Stream]) -> None:
        """Abort the unfinished streams, on the loop (the thread that submitted them)."""
        live = [s for s in streams if not s.done]
        if live:
            self.call(self._abort(live))

    async def _abort(self, streams: list[Stream]) -> None:
        for s in streams:  # submissions finished before submit_batch() returned
            if s.result is not None and not s.done:
                try:
                    s.result.abort()
                except Exception as e:
                    log.warning("TensorRT-LLM: abort of request %s failed: %s", s.key, e)

    async def _once(self, llm: Any, ids: list[int], params: Any) -> Any:
        return await llm.generate_async(ids, sampling_params=params, streaming=False)

    def generate(self, llm: Any, ids: list[int], params: Any, timeout: float = WAIT_S) -> Any:
        """One non-streaming request, submitted and awaited on the loop."""
        return self.call(self._once(llm, ids, params), timeout)

    # ---- iteration stats ---------------------------------------------------------------------
    def drain_stats(self, llm: Any, timeout: float = 0.05, budget_s: float = 0.25) -> list[dict[str, Any]]:
        """The iteration-stats items TensorRT-LLM has queued, read on the loop that owns the queue:
        until none arrives for `timeout` s, or for at most about `budget_s` s (a busy engine queues
        one per iteration without pause). Failures are logged, never swallowed silently."""
        try:
            return self.call(self._drain(llm, timeout, budget_s))
        except Exception as e:
            log.warning("TensorRT-LLM: reading iteration stats failed: %r", e)
            return []

    async def _drain(self, llm: Any, timeout: float, budget_s: float) -> list[dict[str, Any]]:
        it = llm.get_stats_async(timeout=timeout)
        # The LLM API's IterationResult stops iterating after one timeout until the next request is
        # submitted (mark_undone); mark it undone so a drain between submissions sees new items.
        if hasattr(it, "mark_undone"):
            it.mark_undone()
        out = []
        ait = it.__aiter__()
        end = self.loop.time() + budget_s
        while self.loop.time() < end:
            try:
                snap = await ait.__anext__()
            except StopAsyncIteration:
                break
            parsed = parse_iteration_stats(snap)
            if parsed is None:
                log.warning("TensorRT-LLM: an iteration-stats item was not a dict: %r", type(snap))
            else:
                out.append(parsed)
        return out

    # ---- waiting -----------------------------------------------------------------------------
    def wait_for(self, streams: list[Stream], count: int, wait_s: float = WAIT_S) -> None:
        """Block until every stream has `count` tokens (or fails)."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                for s in streams:
                    if s.error is not None:
                        raise RuntimeError(f"TensorRT-LLM request {s.key} failed: {s.error}") from s.error
                    if s.done and len(s.tokens) < count:
                        raise RuntimeError(f"TensorRT-LLM request {s.key} ended after {len(s.tokens)} tokens; "
                                           f"{count} were needed")
                if all(len(s.tokens) >= count for s in streams):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"TensorRT-LLM streamed no token for {wait_s:.0f} s")
                self.cond.wait(left)

    def stop(self) -> None:
        """Cancel what still waits on the loop (streams of a shut-down engine), then end the thread."""
        error = self.loop_thread.close()
        if error is not None:
            log.warning("TensorRT-LLM: streams still pending at close: %r", error)

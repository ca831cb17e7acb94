"""The step API over HTTP: one batch of B streamed requests, read token by token.

  prefill(prompts)  sends the B requests at once (max_tokens = max_new_tokens, or what still fits
                    in max_model_len); it lasts until every request has its first token.
  decode(n)         the server keeps generating on its own; step i ends when the last request got
                    its i-th token after the first, and starts where step i-1 ended (so a step is
                    the batch's inter-token latency as the client sees it).
  release()         closes the streams still running (the server aborts them); the streams that
                    got every token end normally (usage, [DONE]).

The streams run on the server's loop thread (adapters/endpoint/server.py); this thread waits on
a condition the streams notify per chunk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from adapters.base import DecodeResult, PrefillResult, StepTiming, now_ns
from adapters.endpoint.bodies import RequestBodies, max_tokens
from adapters.endpoint.server import Server
from adapters.endpoint.stream import ReqState
from harness.core.loop_thread import cancel_and_wait


class Steps:
    """Endpoint `name`'s batch: `prefill`, `decode`, `release`. The states of the requests
    released go to `record` (the point's record: adapters/endpoint/rows.py)."""

    def __init__(self, name: str, server: Server, bodies: RequestBodies, max_model_len: int,
                 record: Callable[[list[ReqState]], None]):
        self.name, self.server, self.bodies, self.max_model_len = name, server, bodies, max_model_len
        self.record = record
        self.batch: list[ReqState] = []
        self.futs: list[Future] = []
        self.cond = threading.Condition()
        self.decoded = 0
        self.last_end = 0

    def prefill(self, prompts: list[list[int]], max_new_tokens: int | None = None) -> PrefillResult:
        self.release()
        loop = self.server.loop
        assert loop is not None
        payloads, states = [], []
        for i, p in enumerate(prompts):
            n = max_tokens(p, max_new_tokens, self.max_model_len)
            body, plen = self.bodies.payload(p, n)
            payloads.append(body)
            states.append(ReqState(f"b{i}", plen, n))

        def on_tokens(st: ReqState, first: int, n: int) -> None:
            with self.cond:
                self.cond.notify_all()

        start = now_ns()
        for st in states:
            st.scheduled_ns = start
        self.batch = states
        self.futs = [loop.submit(self._notify_done(self.server.stream(st, pl, on_tokens, self.bodies.path)))
                     for st, pl in zip(states, payloads)]
        self._wait(lambda: all(len(s.token_ids) >= 1 or s.done for s in states))
        self._raise_failed(states, 1)
        end = max(s.token_times[0] for s in states)
        self.decoded, self.last_end = 1, end
        return PrefillResult([s.token_ids[0] for s in states], start, end)

    async def _notify_done(self, coro: Any) -> None:
        try:
            await coro
        finally:
            with self.cond:
                self.cond.notify_all()

    def _wait(self, pred: Any) -> None:
        timeout_s = self.server.cfg.request_timeout_s
        deadline = time.monotonic() + timeout_s + 5
        with self.cond:
            while not pred():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: no progress within request_timeout_s={timeout_s:g} s")
                self.cond.wait(0.5)

    def _raise_failed(self, states: list[ReqState], need: int) -> None:
        for st in states:
            if len(st.token_ids) < need and st.done:
                raise RuntimeError(f"request {st.request_id}: {self.server.failure_detail(st) or 'ended early'}")

    def decode(self, steps: int) -> DecodeResult:
        if not self.batch:
            raise RuntimeError("decode() before prefill()")
        states = self.batch
        tokens: list[list[int]] = []
        timings: list[StepTiming] = []
        for _ in range(steps):
            i = self.decoded
            over = [s for s in states if s.expected <= i]
            if over:
                raise RuntimeError(f"decode past the {over[0].expected} tokens each request asked for "
                                   "(prefill's max_new_tokens)")
            self._wait(lambda: all(len(s.token_ids) > i or s.done for s in states))
            self._raise_failed(states, i + 1)
            end = max(s.token_times[i] for s in states)
            tokens.append([s.token_ids[i] for s in states])
            timings.append(StepTiming(self.last_end, end, len(states)))
            self.decoded, self.last_end = i + 1, end
        return DecodeResult(tokens, timings)

    def release(self) -> None:
        futs, states = self.futs, self.batch
        self.batch, self.futs, self.decoded = [], [], 0
        # streams that got every token end normally (usage, [DONE]): not cancelled
        cancel_and_wait(futs, keep=lambda i: len(states[i].token_ids) >= states[i].expected)
        self.record(states)

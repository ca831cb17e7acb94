"""The TensorRT-LLM adapter against FAKE TensorRT-LLM modules, one fake per failure seen on a real GPU:
no TensorRT-LLM, no GPU. These test OUR logic; tests/test_trtllm_gpu.py runs the real engine.

`FakeLLM` stands in for `tensorrt_llm.LLM`. Like the real LLM API it
  - runs its own scheduling loop in its own thread (`FakeExecutor`): one iteration per step, every
    running request gains one token per iteration; with the overlap scheduler (the default) each
    iteration's tokens reach the client one iteration late, batched;
  - sends submissions and cancellations through one socket (`FakeSocket`, ZeroMQ-like: not
    thread-safe; it records every thread that used it);
  - creates its iteration-stats queue on the first generate_async(), inside the running asyncio
    loop, as an asyncio.Queue: get_stats_async() on that loop reads it, get_stats() from another
    thread gets None at its timeout and json.loads(None) raises, as TensorRT-LLM's does;
  - reports per-request perf metrics (first_iter, last_iter, first/last token times on its own
    steady clock, which the fake shifts by 1000 s from the harness clock) and per-iteration stats
    (iter, iterLatencyMS, kvCacheStats);
  - admits at most `admit_per_iteration` new requests per iteration (a fake scheduler that can
    admit a batch over two iterations).
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import json
import sys
import threading
import time
import types
from datetime import timedelta
from types import SimpleNamespace

import pytest

from adapters.base import ModelSpec

STEADY_SHIFT_S = 1000.0  # the fake steady clock = perf_counter + 1000 s
ITER_S = 0.004  # the fake forward pass


def steady_now() -> float:
    return time.perf_counter() + STEADY_SHIFT_S


class FakeSocket:
    """ZeroMQ-like socket of the FAKE executor: not thread-safe; records the threads that used it."""

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.messages: list[tuple] = []
        self.lock = threading.Lock()  # the fake's own bookkeeping, not a property of ZeroMQ

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.threads.add(threading.get_ident())
            self.messages.append(msg)

    def take(self) -> list[tuple]:
        with self.lock:
            out, self.messages = self.messages, []
            return out


class FakeResult:
    """A streaming request of the FAKE LLM API: an async iterator over its outputs, fed from the
    executor thread through an asyncio.Queue of the loop that submitted it."""

    def __init__(self, llm: FakeLLM, rid: int, prompt: list[int], params) -> None:
        self.llm, self.rid, self.prompt, self.params = llm, rid, prompt, params
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.context_logits = None

    def abort(self) -> None:
        self.llm.socket.send(("cancel", self.rid))

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        self.finished = out.finished
        return out

    def __await__(self):
        async def whole():
            while not self.finished:
                await self.__anext__()
            return self
        return whole().__await__()


class FakeIterationResult:
    """get_stats_async() of the FAKE LLM API: reads the asyncio stats queue; must run on its loop."""

    def __init__(self, queue: asyncio.Queue, loop, timeout: float) -> None:
        self.queue, self.loop, self.timeout, self.done = queue, loop, timeout, False

    def mark_undone(self) -> None:
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError("the stats queue is bound to a different event loop")
        try:
            return json.loads(await asyncio.wait_for(self.queue.get(), self.timeout))
        except asyncio.TimeoutError:
            self.done = True
            raise StopAsyncIteration from None


class FakeExecutor(threading.Thread):
    """The FAKE engine loop: iterations while there is work; tokens computed in iteration i reach
    the client at the end of iteration i + 1 (overlap scheduler)."""

    def __init__(self, llm: FakeLLM) -> None:
        super().__init__(daemon=True, name="fake-trtllm-executor")
        self.llm = llm
        self.waiting: list[FakeResult] = []
        self.running: dict[int, dict] = {}
        self.iter = 0
        self.latency_ms: dict[int, float] = {}
        self.pending: list[tuple[FakeResult, object]] = []  # computed, not yet delivered
        self.stop = threading.Event()

    def receive(self) -> None:
        for kind, payload in self.llm.socket.take():
            if kind == "submit":
                self.waiting.append(payload)
            elif kind == "cancel" and payload in self.running:
                st = self.running.pop(payload)
                self.deliver(st["result"], self.output(st, finished=True))

    def deliver(self, result: FakeResult, out) -> None:
        result.loop.call_soon_threadsafe(result.queue.put_nowait, out)

    def run(self) -> None:
        while not self.stop.is_set():
            self.receive()
            if not self.waiting and not self.running and not self.pending:
                time.sleep(0.001)
                continue
            if not self.running and not self.pending:  # woken from idle: take what arrives with it
                time.sleep(0.002)
                self.receive()
            t0 = time.perf_counter()
            admit = self.waiting[:self.llm.admit_per_iteration]
            self.waiting = self.waiting[len(admit):]
            for r in admit:
                self.running[r.rid] = {"result": r, "tokens": [], "first_iter": self.iter,
                                       "arrival": steady_now(), "first_token": None, "last_token": None}
            time.sleep(ITER_S)  # the forward pass
            end = steady_now()
            computed = []
            for st in self.running.values():
                st["tokens"].append(1000 * st["result"].rid + len(st["tokens"]))
                st["last_iter"] = self.iter
                st["first_token"] = st["first_token"] or end
                st["last_token"] = end
                done = len(st["tokens"]) >= st["result"].params.max_tokens
                computed.append((st["result"], self.output(st, finished=done)))
            for r, out in computed:
                if out.finished:
                    self.running.pop(r.rid, None)
            self.latency_ms[self.iter] = (time.perf_counter() - t0) * 1e3
            stats = {"iter": self.iter, "iterLatencyMS": self.latency_ms[self.iter],
                     "kvCacheStats": {"maxNumBlocks": 500, "usedNumBlocks": len(self.running), "tokensPerBlock": 32}}
            if self.llm.stats_queue is not None:
                self.llm.stats_loop.call_soon_threadsafe(self.llm.stats_queue.put_nowait, json.dumps(stats))
            for r, out in self.pending:  # the previous iteration's tokens arrive now
                self.deliver(r, out)
            self.pending = computed if self.llm.overlap else []
            if not self.llm.overlap:
                for r, out in computed:
                    self.deliver(r, out)
            self.iter += 1

    @staticmethod
    def output(st: dict, finished: bool):
        perf = SimpleNamespace(
            first_iter=st["first_iter"], last_iter=st.get("last_iter"),
            timing_metrics=SimpleNamespace(
                arrival_time=timedelta(seconds=st["arrival"]), first_scheduled_time=timedelta(seconds=st["arrival"]),
                first_token_time=timedelta(seconds=st["first_token"] or 0),
                last_token_time=timedelta(seconds=st["last_token"] or 0)),
            kv_cache_metrics=None)
        comp = SimpleNamespace(token_ids=list(st["tokens"]), request_perf_metrics=perf)
        return SimpleNamespace(outputs=[comp], finished=finished)


class FakeLLM:
    """FAKE tensorrt_llm.LLM (see the module docstring)."""

    instances: list[FakeLLM] = []
    admit_per_iteration = 64
    overlap = True

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.args = SimpleNamespace(max_batch_size=kwargs.get("max_batch_size", 2048),
                                    max_num_tokens=kwargs.get("max_num_tokens", 8192))
        self.socket = FakeSocket()
        self.stats_queue = None
        self.stats_loop = None
        self.next_id = 1
        self.submitted: list = []
        self.executor = FakeExecutor(self)
        self.executor.start()
        FakeLLM.instances.append(self)

    def generate_async(self, ids, sampling_params=None, streaming=False):
        if self.stats_queue is None:  # created on the first submission, inside the running loop
            self.stats_loop = asyncio.get_running_loop()
            self.stats_queue = asyncio.Queue()
        r = FakeResult(self, self.next_id, list(ids), sampling_params)
        self.next_id += 1
        self.submitted.append(sampling_params)
        if getattr(sampling_params, "return_context_logits", False):
            r.context_logits = fake_context_logits(ids)
            r.finished = True
            return r
        self.socket.send(("submit", r))
        return r

    def get_stats(self, timeout=2):
        data = None  # the sync side of an asyncio queue, read from another thread, times out with None
        return [json.loads(data)]

    def get_stats_async(self, timeout=2):
        if self.stats_queue is None:  # nothing submitted yet: an empty async iterable, as TensorRT-LLM's
            async def empty():
                return
                yield
            return empty()
        return FakeIterationResult(self.stats_queue, self.stats_loop, timeout)

    def shutdown(self) -> None:
        self.executor.stop.set()
        self.executor.join(5)


VOCAB = 50


def fake_context_logits(ids):
    """FAKE context logits: row t scores the token at t + 1 highest (so alignment can be checked)."""
    import torch
    logits = torch.zeros(len(ids), VOCAB)
    for t in range(len(ids) - 1):
        logits[t, ids[t + 1]] = 5.0
        logits[t, (ids[t + 1] + 1) % VOCAB] = 3.0
    return logits


class FakeSamplingParams:
    def __init__(self, **kwargs) -> None:
        self.__dict__.update(kwargs)


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def fake_trtllm(monkeypatch):
    """FAKE tensorrt_llm modules in sys.modules for one test; availability checks pass."""
    FakeLLM.instances, FakeLLM.admit_per_iteration, FakeLLM.overlap = [], 64, True
    monkeypatch.setitem(sys.modules, "tensorrt_llm", _module("tensorrt_llm", LLM=FakeLLM, SamplingParams=FakeSamplingParams))
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", _module(
        "tensorrt_llm.llmapi", KvCacheConfig=lambda **kw: kw, SchedulerConfig=lambda **kw: kw,
        CapacitySchedulerPolicy={"MAX_UTILIZATION": "MAX_UTILIZATION"}))
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings", _module(
        "tensorrt_llm.bindings", steady_clock_now=lambda: timedelta(seconds=steady_now())))
    import adapters.trtllm.engine as eng
    monkeypatch.setattr(eng.TRTLLMEngine, "unavailable_reason", classmethod(lambda cls: None))
    yield eng
    for llm in FakeLLM.instances:
        llm.shutdown()


SPEC = ModelSpec(path="/nonexistent", name="fake", dtype="bfloat16", device="cuda", max_model_len=256)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def _engine(eng, options=None):
    e = eng.TRTLLMEngine()
    e.load(SPEC, options or {})
    return e


def test_kv_statistics_arrive_through_the_adapters_own_loop(fake_trtllm):
    e = _engine(fake_trtllm)
    e.prefill(PROMPTS)  # no output bound: each request may run to max_seq_len
    e.decode(3)
    info = e.kv_cache_info()  # the requests still run: one (fake) block each
    assert info.num_blocks == 500 and info.blocks_in_use == len(PROMPTS)
    e.close()


def test_aborts_go_through_the_loop_that_submits(fake_trtllm):
    e = _engine(fake_trtllm)
    e.prefill(PROMPTS)
    e.release()
    llm = FakeLLM.instances[-1]
    deadline = time.monotonic() + 10
    while llm.executor.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm.executor.running  # the requests were cancelled...
    assert len(llm.socket.threads) == 1  # ...and the socket was only ever used from one thread
    e.close()


def test_prefill_declares_the_real_output_bound(fake_trtllm):
    e = _engine(fake_trtllm)
    e.prefill(PROMPTS, max_new_tokens=5)
    assert [p.max_tokens for p in FakeLLM.instances[-1].submitted] == [5, 5, 5]
    e.decode(4)
    e.close()


def test_a_batch_admitted_over_two_iterations_fails_the_point(fake_trtllm):
    FakeLLM.admit_per_iteration = 2
    e = _engine(fake_trtllm)
    with pytest.raises(RuntimeError, match="over engine iterations"):
        e.prefill(PROMPTS)
    e.close()


def test_step_and_token_times_come_from_tensorrt_llms_own_metrics(fake_trtllm):
    e = fake_trtllm.TRTLLMEngine()
    details = e.load(SPEC, {}).details
    pre = e.prefill(PROMPTS)
    dec = e.decode(4)
    llm = FakeLLM.instances[-1]
    # the batch started in the fresh executor's iteration 0; decode step i lasted the iteration that
    # produced token 1 + i, as TensorRT-LLM measured it
    assert [s.end_ns - s.start_ns for s in dec.steps] == [
        int(round(llm.executor.latency_ms[1 + i] * 1e6)) for i in range(4)]
    assert dec.steps[0].start_ns == pre.end_ns
    assert e.kv_cache_info().extra["clock"] == {"prefill": "tensorrt-llm", "decode": "tensorrt-llm"}
    assert details["clock"].startswith("tensorrt-llm") and details["clock_offset_ns"] is not None
    e.close()


def test_prefill_ends_at_the_engines_first_token_time_not_at_arrival(fake_trtllm):
    e = _engine(fake_trtllm)
    pre = e.prefill(PROMPTS)
    arrivals = max(s.times[0] for s in e._live)
    assert pre.end_ns < arrivals  # the first tokens reached this process an iteration later
    e.close()


def test_scores_come_from_context_logits_aligned_to_the_next_token(fake_trtllm):
    e = _engine(fake_trtllm)
    seq = [3, 14, 15, 9, 26, 5]
    [s] = e.score([seq], [2], 2)
    assert [ids[0] for ids in s.top_ids] == seq[2:]  # row p - 1 predicts the token at p
    assert [ids[1] for ids in s.top_ids] == [(t + 1) % VOCAB for t in seq[2:]]
    assert s.target_logprobs == [lp[0] for lp in s.top_logprobs] and all(v < 0 for v in s.target_logprobs)
    assert e.score([seq], [len(seq)], 2)[0].top_ids == []
    e.close()


# ---- the availability probe ---------------------------------------------------------------------
def test_an_engine_that_is_installed_but_does_not_import_is_reported(tmp_path, monkeypatch):
    """A FAKE tensorrt_llm package whose import fails (as a missing OpenMPI makes the real one fail)."""
    import adapters.trtllm.engine as eng
    pkg = tmp_path / "tensorrt_llm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('libmpi.so.40: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    for name in ("cuda_device_count", "_cuda_device_count"):  # pretend one GPU
        monkeypatch.setattr(eng, name, lambda: 1, raising=False)
    monkeypatch.setattr(eng, "this_python", lambda: (3, 12), raising=False)
    if hasattr(eng, "import_probe"):
        eng.import_probe.cache_clear()
    try:
        reason = eng.TRTLLMEngine.unavailable_reason()
    finally:
        if hasattr(eng, "import_probe"):
            eng.import_probe.cache_clear()
    assert reason is not None and "libmpi.so.40" in reason and "pypi.nvidia.com" in reason

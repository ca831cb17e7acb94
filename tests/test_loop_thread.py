"""harness.core.loop_thread.LoopThread: the one asyncio-loop-in-a-thread of the endpoint and
TensorRT-LLM adapters."""

from __future__ import annotations

import asyncio
import threading

import pytest

from harness.core.loop_thread import LoopThread


def test_runs_coroutines_on_its_own_thread() -> None:
    lt = LoopThread("test-loop")
    try:
        async def where() -> tuple[str, asyncio.AbstractEventLoop]:
            return threading.current_thread().name, asyncio.get_running_loop()
        name, loop = lt.run(where(), timeout=5)
        assert name == "test-loop" and loop is lt.loop
        with pytest.raises(ValueError, match="boom"):
            async def fail() -> None:
                raise ValueError("boom")
            lt.run(fail(), timeout=5)
    finally:
        lt.close()


def test_close_cancels_pending_tasks_then_cleans_up_and_ends_the_thread() -> None:
    lt = LoopThread("test-loop")
    order: list[str] = []

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            order.append("cancelled")
            raise

    async def cleanup() -> None:
        order.append("cleanup")

    fut = lt.submit(forever())
    assert lt.close(cleanup) is None
    assert order == ["cancelled", "cleanup"]
    assert fut.cancelled()
    assert not lt.thread.is_alive() and lt.loop.is_closed()
    assert lt.close() is None  # a second close does nothing


def test_close_returns_what_went_wrong() -> None:
    lt = LoopThread("test-loop")

    async def bad_cleanup() -> None:
        raise OSError("socket already gone")

    err = lt.close(bad_cleanup)
    assert isinstance(err, OSError) and "socket already gone" in str(err)
    assert lt.loop.is_closed()

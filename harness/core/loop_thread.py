"""An asyncio event loop running in a daemon thread, driven from the caller's (synchronous) thread.

The adapters whose engine speaks asyncio (the endpoint's HTTP streams, TensorRT-LLM's LLM API) keep
one such loop: every coroutine that touches the engine runs there, and the harness thread submits
coroutines and waits on their results.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any

CLOSE_S = 10.0  # longest wait for the pending tasks to end, then for the thread to end


class LoopThread:
    """A new event loop, run forever in a daemon thread named `name` (the loop is that thread's
    current loop). Close it with `close()`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine) -> Future:
        """Schedule a coroutine on the loop; its result is the returned future's."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run a coroutine on the loop and wait (at most `timeout` s) for its result."""
        return self.submit(coro).result(timeout)

    def close(self, cleanup: Callable[[], Awaitable[None]] | None = None) -> BaseException | None:
        """Cancel every task still pending on the loop and wait for them, then await `cleanup()` on
        the loop (if given), stop the loop and end the thread. The loop is closed once the thread
        has ended. Returns what went wrong while cancelling (or None), for the caller to report.
        A second call does nothing."""
        if self.loop.is_closed():
            return None

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if cleanup is not None:
                await cleanup()

        error: BaseException | None = None
        try:
            self.run(cancel_all(), timeout=CLOSE_S)
        except Exception as e:
            error = e
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=CLOSE_S)
        if not self.thread.is_alive():
            self.loop.close()
        return error


def cancel_and_wait(futures: list[Future], keep: Callable[[int], bool] | None = None,
                    timeout_s: float = 30.0) -> None:
    """Cancel the futures of coroutines running on a loop thread (all, or those whose index
    `keep(i)` is false: they end on their own) and wait (each at most `timeout_s`) until every
    one has ended, whatever it ended with: a stream cancelled mid-way closes its connection."""
    for i, f in enumerate(futures):
        if keep is None or not keep(i):
            f.cancel()
    for f in futures:
        try:
            f.result(timeout=timeout_s)
        except BaseException:
            pass

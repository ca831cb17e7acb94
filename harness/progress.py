"""Progress lines on the terminal: point i of n, engine, elapsed, ETA. Quiet mode for CI."""

from __future__ import annotations

import sys
import time
from typing import Any


def _fmt(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, quiet: bool = False, stream: Any = None):
        self.total = max(total, 1)
        self.done = 0
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.t0 = time.monotonic()

    def _eta(self) -> str:
        if not self.done:
            return "?"
        elapsed = time.monotonic() - self.t0
        return _fmt(elapsed / self.done * (self.total - self.done))

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def start(self, engine: str, point: Any) -> None:
        params = " ".join(f"{k}={v}" for k, v in point.params.items())
        self._say(f"[{self.done + 1}/{self.total}] {engine:<9} {params}  "
                  f"elapsed {_fmt(time.monotonic() - self.t0)}  eta {self._eta()}")

    def finish(self, engine: str, point: Any, status: str) -> None:
        self.done += 1
        if status == "failed":
            self._say(f"          {engine:<9} -> failed")

    def skip(self, n: int, engine: str, status: str, quiet_if_zero: bool = False) -> None:
        if quiet_if_zero and not n:
            return
        self.done += n
        self._say(f"[{self.done}/{self.total}] {engine:<9} {status} ({n} point{'s' if n != 1 else ''})")

    def close(self) -> None:
        self._say(f"finished {self.done} of {self.total} points in {_fmt(time.monotonic() - self.t0)}")

"""Starting and stopping a server from a command template.

The command runs in a new session under `supervise.py` (one process group for the server and
everything it starts; the group is stopped if the harness's process dies). Its output goes,
line by line and redacted, to the run's log (`<run_dir>/logs/<name>.log`, each line prefixed
`[server] `); the last lines are kept for error messages. Readiness: the kind's ready paths
(adapters/endpoint/kinds.py: `/health` for the known servers, where SGLang answers 503 until its
warm-up ends while `/v1/models` already answers 200; `/health` then `/v1/models` for a generic
one) until one answers 200, or the timeout passes, or the process exits.
Stop: SIGTERM to the group, SIGKILL after a grace period. Every server still running when the
process exits is stopped (atexit).
"""

from __future__ import annotations

import atexit
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import httpx

from harness.core.redact import Redactor

SUPERVISOR = str(Path(__file__).with_name("supervise.py"))
_ERROR_LINE = re.compile(r"(?i)\b\w*(error|exception)\b\s*[:,]")
_LIVE: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def render(template: list[str], values: dict[str, Any]) -> list[str]:
    """The command: every placeholder replaced (values already checked at validation)."""
    return [item.format_map(values) for item in template]


class ServerError(RuntimeError):
    """The server could not be started, or died; the message says why (redacted)."""


class ServerProcess:
    def __init__(self, name: str, command: list[str], env: dict[str, str | None], log_path: Path | None,
                 redactor: Redactor, grace_s: float = 15.0):
        self.name, self.command, self.grace_s = name, command, grace_s
        self.redactor = redactor
        self.log_path = log_path
        self.env = dict(os.environ)
        for k, v in env.items():
            if v is None:
                self.env.pop(k, None)
            else:
                self.env[k] = str(v)
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._pump: threading.Thread | None = None
        self._log: Any = None

    # ---- start ---------------------------------------------------------------------------
    def start(self) -> None:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "a", buffering=1, encoding="utf-8")
            self._log.write(f"[infer-bench] starting endpoint {self.name}: "
                            f"{self.redactor.text(' '.join(self.command))}\n")
        cmd = [sys.executable, SUPERVISOR, str(os.getpid()), str(self.grace_s), "--", *self.command]
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        except OSError as e:
            raise ServerError(f"cannot start {self.redactor.text(self.command[0])}: {e.strerror}") from None
        _LIVE.add(self)
        self._pump = threading.Thread(target=self._pump_output, name=f"server-log-{self.name}", daemon=True)
        self._pump.start()

    def _pump_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = self.redactor.text(raw.decode("utf-8", "replace").rstrip("\r\n"))
            self.tail.append(line)
            if self._log is not None:
                try:
                    self._log.write(f"[server] {line}\n")
                except ValueError:  # closed
                    pass
        self.proc.stdout.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_text(self) -> str:
        code = self.proc.poll() if self.proc else None
        if code is None:
            return "running"
        if code > 128:
            try:
                return f"killed by signal {signal.Signals(code - 128).name}"
            except ValueError:
                pass
        return f"exit code {code}"

    def last_lines(self, n: int = 12) -> str:
        if self._pump is not None:
            self._pump.join(timeout=1.0 if not self.alive() else 0)
        lines = list(self.tail)[-n:]
        return "\n".join(lines)

    def wait_ready(self, root_url: str, timeout_s: float, client_kwargs: dict[str, Any],
                   paths: tuple[str, ...] = ("/health", "/v1/models")) -> str:
        """Poll until the server answers; returns the path that answered. Raises ServerError when
        the process exits first or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        with httpx.Client(**client_kwargs) as client:
            while True:
                if not self.alive():
                    raise ServerError(self._died("during start-up"))
                for path in paths:
                    try:
                        r = client.get(root_url + path, timeout=2.0)
                        if r.status_code == 200:
                            return path
                        last = f"GET {path}: HTTP {r.status_code}"
                        if r.status_code in (401, 403):
                            return path  # it is up; authentication is checked next, with its own message
                    except httpx.HTTPError as e:
                        last = f"GET {path}: {type(e).__name__}"
                if time.monotonic() > deadline:
                    raise ServerError(f"the server did not become ready within {timeout_s:g} s "
                                      f"(endpoints.{self.name}.ready_timeout_s; last: {last})" + self._tail_text())
                time.sleep(0.25)

    def _tail_text(self) -> str:
        tail = self.last_lines()
        where = f" logs/{self.log_path.name}" if self.log_path else ""
        return f"; last lines of its output{where}:\n{tail}" if tail else ""

    def _died(self, when: str) -> str:
        self.proc.wait()  # type: ignore[union-attr]
        # its last words first (a server refusing its flags says why there), so that a one-line view
        # of the error has them: the last line that names an error (a traceback's last exception;
        # vLLM's pydantic "Value error, ..." before its "For further information" line), else its last
        lines = [x.strip() for x in self.last_lines().splitlines() if x.strip()]
        last = next((x for x in reversed(lines) if _ERROR_LINE.search(x)), lines[-1] if lines else "")
        return (f"the server exited {when} ({self.exit_text()})" + (f": {last[:300]}" if last else "")
                + self._tail_text())

    def died_text(self) -> str:
        return self._died("while running")

    # ---- stop ----------------------------------------------------------------------------
    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after the grace period. Safe to call twice."""
        proc = self.proc
        if proc is None:
            return
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = proc.pid  # the leader is gone; its group may not be
        _signal_group(pgid, signal.SIGTERM)
        end = time.monotonic() + self.grace_s
        while time.monotonic() < end and (proc.poll() is None or _group_alive(pgid)):
            time.sleep(0.05)
        if proc.poll() is None or _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._pump is not None:
            self._pump.join(timeout=5)
        if self._log is not None:
            self._log.write(f"[infer-bench] endpoint {self.name} stopped ({self.exit_text()})\n")
            self._log.close()
            self._log = None
        _LIVE.discard(self)
        self.proc = None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """True while any process of the group exists (signal 0 probes without signalling)."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception:
            pass

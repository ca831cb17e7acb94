"""The harness <-> worker protocol: typed messages, one JSON object per line, versioned.

A worker is a separate process running one engine, possibly under another Python environment,
in a container or through a cluster's launcher. The harness writes messages to the worker's
stdin; the worker answers on its stdout. Everything else the worker or the engine prints goes to
its stderr, which the harness keeps in `logs/<engine>.log`. Each protocol line starts with
`MAGIC`, so stray output that still reaches stdout (an interpreter start-up banner, a library
writing to fd 1 before the worker redirects it) is logged, never mistaken for a message.

    harness                                  worker
    Hello(protocol, job)            ->
                                    <-       Ready(protocol, python, versions, ...)   (or Incompatible)
                                    <-       Unavailable(reason)   the engine cannot run here (a probe:
                                                                  package absent, no device, wrong Python)
                                    <-       SetupFailed(error)    setting the engine up raised (a bug):
                                                                  every point of the engine fails with it
    RunPoint(point, inputs)         ->
                                    <-       PointStarted(key)     the point's timeout starts
                                    <-       PointDone(key, status, error, fields)
    ...
    Shutdown()                      ->
                                    <-       Bye()

Messages are dataclasses of plain data (JSON types); `encode`/`decode` add and check the
`type` field. A worker speaking another `PROTOCOL_VERSION` answers Hello with Incompatible, and
the harness fails the engine's points naming both versions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

PROTOCOL_VERSION = 2  # 2: SetupFailed
MAGIC = "@@infer-bench@@ "


@dataclass
class Hello:
    protocol: int
    job: dict[str, Any]


@dataclass
class RunPoint:
    point: dict[str, Any]  # {"workload": name, "params": {...}}
    inputs: dict[str, Any] | None = None  # data the harness computed for this point (parity's teacher)


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    protocol: int
    python: str  # the worker's interpreter (sys.executable, as the worker sees it)
    pid: int  # the worker's process id, as the worker sees it
    versions: dict[str, str | None] = field(default_factory=dict)  # python, torch, the engine
    cpu_affinity: list[int] | None = None


@dataclass
class Incompatible:
    protocol: int
    message: str


@dataclass
class Unavailable:
    reason: str


@dataclass
class SetupFailed:
    error: str  # the exception and the last lines of its traceback


@dataclass
class PointStarted:
    key: str


@dataclass
class PointDone:
    key: str
    status: str  # ok | failed | skipped
    error: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Bye:
    pass


MESSAGES = {cls.__name__: cls for cls in (Hello, RunPoint, Shutdown, Ready, Incompatible, Unavailable,
                                          SetupFailed, PointStarted, PointDone, Bye)}


class ProtocolError(Exception):
    """A line that claims to be a message but is not one."""


def encode(msg: Any) -> str:
    """One line (with its newline) carrying `msg`."""
    return MAGIC + json.dumps({"type": type(msg).__name__, **asdict(msg)}, default=str) + "\n"


def decode(line: str) -> Any | None:
    """The message on `line`, or None for a line that is not a protocol line (stray output)."""
    if not line.startswith(MAGIC):
        return None
    try:
        data = json.loads(line[len(MAGIC):])
        cls = MESSAGES[data.pop("type")]
    except (ValueError, KeyError, AttributeError) as e:
        raise ProtocolError(f"not a protocol message: {line[:200]!r} ({e})") from None
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})

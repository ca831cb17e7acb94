"""The engine's process: load one engine, measure the points the harness sends, answer each.

The harness (harness.runner) starts this as a separate program - under its own interpreter, or
under another environment's (`engine_options.<engine>.python=PATH`), in a container or through
a cluster's launcher (`engine_options.<engine>.launch=[...]`) - and talks to it with the
messages of harness.protocol over stdin/stdout. The harness ships its own source with the
command (harness.bundle), so the worker needs only the engine's packages plus numpy, psutil and
PyYAML: it imports `harness.core` (never scipy), `harness.protocol`, `adapters` and `workloads`.

The engine's own prints and logs (fd 1 and 2) go to stderr, which the harness keeps in
`logs/<engine>.log`; only protocol lines go to the real stdout.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version
from collections.abc import Callable
from typing import Any, TextIO

from harness.protocol import (
    PROTOCOL_VERSION, Bye, Hello, Incompatible, Ready, RunPoint, SetupFailed, Shutdown, Unavailable, decode,
    encode,
)

# The project's own packages, shipped with the worker: an ImportError naming one of them is a bug
# in the shipped code (a failure), not a package missing from the engine's environment.
OWN_PACKAGES = ("harness", "adapters", "workloads", "conf")


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _missing_package(e: BaseException) -> str | None:
    """The third-party package whose absence `e` reports, or None: an ImportError of one of our own
    modules, or any other exception, is a failure of the code, not of the environment."""
    if isinstance(e, ModuleNotFoundError) and e.name and e.name.split(".")[0] not in OWN_PACKAGES:
        return e.name
    return None


def _traceback_tail(e: BaseException, lines: int = 6) -> str:
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip().splitlines()
    return "\n".join(text[-lines:])


def _read(stdin: TextIO) -> Any | None:
    """The next protocol message on stdin (None at end of input)."""
    for line in stdin:
        msg = decode(line)
        if msg is not None:
            return msg
    return None


def _handshake(send: Callable[[Any], None]) -> Hello | None:
    """The harness's Hello, or None when it speaks another protocol version (answered with
    Incompatible). Anything else first on stdin ends the worker (exit 2)."""
    hello = _read(sys.stdin)
    if not isinstance(hello, Hello):
        print(f"[infer-bench worker] expected Hello, got {hello!r}", file=sys.stderr)
        sys.exit(2)
    if hello.protocol != PROTOCOL_VERSION:
        send(Incompatible(PROTOCOL_VERSION, f"the harness speaks protocol {hello.protocol}, this worker "
                          f"speaks {PROTOCOL_VERSION}"))
        return None
    return hello


def _pin(cpus: list[int] | None) -> None:
    """Pin this process to the cores the harness gave the engine (where the OS can)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:  # e.g. a container whose cores differ: the rows record the real affinity
            print(f"[infer-bench worker] could not pin to cores {cpus}: {e}", flush=True)


def _setup_failed(send: Callable[[Any], None], engine: str, versions: dict[str, Any], e: BaseException) -> None:
    """Ready, then why the engine could not be set up: Unavailable when a third-party package is
    missing from this environment, else SetupFailed with the traceback's tail."""
    traceback.print_exc()
    send(Ready(PROTOCOL_VERSION, sys.executable, os.getpid(), versions))
    missing = _missing_package(e)
    if missing:
        send(Unavailable(f"the worker could not set up engine {engine} under {sys.executable} (the "
                         f"package {missing!r} is missing there): {type(e).__name__}: {e}"))
    else:
        send(SetupFailed(f"the worker could not set up engine {engine} under {sys.executable}: "
                         f"{type(e).__name__}: {e}\n{_traceback_tail(e)}"))


def main() -> None:
    # protocol lines go to the real stdout; everything else printed to fd 1 goes to stderr (the log)
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness handles Ctrl-C and ends us
    _quiet_libraries()

    def send(msg: Any) -> None:
        proto.write(encode(msg))
        proto.flush()

    hello = _handshake(send)
    if hello is None:
        return
    job = hello.job
    _pin(job["model_spec"].get("cpus"))
    print(f"[infer-bench worker] engine={job['engine']} pid={os.getpid()} python={sys.executable}", flush=True)
    versions = {"python": sys.version.split()[0], "torch": _package_version("torch")}
    try:  # the engine side: adapters, workloads, numpy, psutil ... from the engine's environment
        from harness.worker_job import EngineUnavailable, Worker
        worker = Worker(job, send)
        versions["engine"] = worker.cls.version()
    except Exception as e:
        _setup_failed(send, job["engine"], versions, e)
        return
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    send(Ready(PROTOCOL_VERSION, sys.executable, os.getpid(), versions, affinity))
    reason = worker.why_not_here()
    if reason is not None:
        send(Unavailable(f"{reason} (under {sys.executable})"))
        return
    try:
        while True:
            msg = _read(sys.stdin)
            if msg is None or isinstance(msg, Shutdown):
                break
            if isinstance(msg, RunPoint):
                worker.run(msg)
    except EngineUnavailable as e:  # the engine found it cannot run here after all
        send(Unavailable(f"{e} (under {sys.executable})"))
    finally:
        try:
            worker.close()
        finally:
            send(Bye())


if __name__ == "__main__":
    main()

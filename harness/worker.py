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
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TextIO

from adapters import engine_class
from adapters.base import Engine, EngineUnavailable, ModelSpec
from harness.core.presets import ModelShape
from harness.core.schema import check
from harness.protocol import (
    PROTOCOL_VERSION, Bye, Hello, Incompatible, PointDone, PointStarted, Ready, RunPoint, Shutdown,
    Unavailable, decode, encode,
)
from workloads import get_workload
from workloads.base import Point, RunContext, is_oom


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def resolve_engine(job: dict[str, Any]) -> type[Engine]:
    """The engine class of a job: a registered engine, or an HTTP endpoint bound to its config."""
    if job.get("endpoint") is not None:
        from adapters.endpoint import endpoint_engine_class  # only endpoint jobs need the HTTP client
        from adapters.endpoint.config import check_endpoint
        cfg, problems = check_endpoint(job["engine"], job["endpoint"])
        if cfg is None:
            raise ValueError("; ".join(problems))
        return endpoint_engine_class(job["engine"], cfg)
    return engine_class(job["engine"])


class _Loaded:
    """The engine instance and the options it was loaded with (reloaded when they change)."""

    def __init__(self, cls: type[Engine], spec: ModelSpec):
        self.cls, self.spec = cls, spec
        self.engine: Engine | None = None
        self.options: dict[str, Any] | None = None
        self.load_info: dict[str, Any] | None = None
        self.failed: dict[str, str] = {}  # options (as text) -> why loading them failed

    def get(self, options: dict[str, Any]) -> tuple[Engine, bool]:
        """(engine loaded with `options`, whether it was loaded just now)."""
        key = repr(sorted(options.items()))
        if key in self.failed:
            raise RuntimeError(self.failed[key])
        if self.engine is not None and options == self.options:
            return self.engine, False
        self.close()
        engine = self.cls()
        try:
            info = engine.load(self.spec, options)
        except EngineUnavailable:
            raise
        except Exception as e:
            traceback.print_exc()
            self.failed[key] = f"load: {_error_text(e)}"
            try:
                engine.close()
            except Exception:
                traceback.print_exc()
            raise RuntimeError(self.failed[key]) from None
        self.engine, self.options, self.load_info = engine, dict(options), asdict(info)
        print(f"[infer-bench worker] loaded {self.cls.name} with {options} in {info.load_time_s:.2f} s", flush=True)
        return engine, True

    def close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            finally:
                self.engine, self.options = None, None


class Worker:
    def __init__(self, job: dict[str, Any], send):
        self.send = send
        self.cls = resolve_engine(job)
        self.options: dict[str, Any] = job["options"]
        self.spec = ModelSpec(**{**job["model_spec"], "cpus": tuple(job["model_spec"]["cpus"])
                                 if job["model_spec"].get("cpus") else None})
        ctx = dict(job["context"])
        ctx["shape"] = ModelShape(**ctx["shape"])
        ctx["avoid_ids"] = tuple(ctx.get("avoid_ids") or ())
        self.ctx = RunContext(**ctx)
        self.workloads = {}
        for name, raw in job["workloads"].items():
            wl = get_workload(name)
            cfg, problems = check(wl.config_cls, raw, "workload")
            if cfg is None:
                raise ValueError("; ".join(problems))
            self.workloads[name] = (wl, cfg)
        self.loaded = _Loaded(self.cls, self.spec)

    def run(self, msg: RunPoint) -> None:
        point = Point(msg.point["workload"], msg.point["params"])
        self.send(PointStarted(point.key))
        workload, cfg = self.workloads[point.workload]
        caps = self.cls.capabilities(self.options)
        why_not = workload.unsupported(point, caps)
        overrides = self.cls.options_for(workload.engine_overrides(point, caps)) if why_not is None else {}
        options = {**self.options, **overrides}
        if why_not is None and overrides:
            problems = self.cls.check_options(options, self.spec)
            why_not = "; ".join(problems) if problems else None
        if why_not:
            self.send(PointDone(point.key, "skipped", why_not, {}))
            return
        engine = None
        try:
            engine, just_loaded = self.loaded.get(options)
            if workload.reset_prefix_cache:
                engine.reset_prefix_cache()
            self.ctx.extra.update(workload_cfg=cfg, inputs=msg.inputs)
            engine.begin_point()
            row = workload.run_point(engine, point, self.ctx)
            row.update(engine.end_point())
            row.update(self._engine_fields(options, just_loaded))
            self.send(PointDone(point.key, "ok", None, row))
        except EngineUnavailable:
            raise
        except Exception as e:
            traceback.print_exc()
            extra: dict[str, Any] = {}
            if engine is not None:
                try:
                    engine.release()
                    extra = engine.end_point()
                except Exception:
                    traceback.print_exc()
            error = _error_text(e)
            self.send(PointDone(point.key, "failed", error, {**extra, "engine_options": options, "oom": is_oom(error)}))

    def _engine_fields(self, options: dict[str, Any], just_loaded: bool) -> dict[str, Any]:
        info = self.loaded.load_info or {}
        out: dict[str, Any] = {"engine_options": options, "compute_threads": info.get("compute_threads"),
                               "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                               else None}
        if just_loaded:
            out["load_time_s"] = info.get("load_time_s")
            out["weights_bytes"] = info.get("weights_bytes")
        return out

    def close(self) -> None:
        self.loaded.close()


def _read(stdin: TextIO) -> Any | None:
    """The next protocol message on stdin (None at end of input)."""
    for line in stdin:
        msg = decode(line)
        if msg is not None:
            return msg
    return None


def main() -> None:
    # protocol lines go to the real stdout; everything else printed to fd 1 goes to stderr (the log)
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness handles Ctrl-C and ends us
    _quiet_libraries()

    def send(msg: Any) -> None:
        proto.write(encode(msg))
        proto.flush()

    hello = _read(sys.stdin)
    if not isinstance(hello, Hello):
        print(f"[infer-bench worker] expected Hello, got {hello!r}", file=sys.stderr)
        sys.exit(2)
    if hello.protocol != PROTOCOL_VERSION:
        send(Incompatible(PROTOCOL_VERSION, f"the harness speaks protocol {hello.protocol}, this worker "
                          f"speaks {PROTOCOL_VERSION}"))
        return
    job = hello.job
    cpus = job["model_spec"].get("cpus")
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    print(f"[infer-bench worker] engine={job['engine']} pid={os.getpid()} python={sys.executable}", flush=True)
    versions = {"python": sys.version.split()[0], "torch": _package_version("torch")}
    try:
        worker = Worker(job, send)
        versions["engine"] = worker.cls.version()
    except Exception as e:
        traceback.print_exc()
        send(Ready(PROTOCOL_VERSION, sys.executable, os.getpid(), versions))
        send(Unavailable(f"the worker could not set up engine {job['engine']} under {sys.executable}: "
                         f"{_error_text(e)}"))
        return
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    send(Ready(PROTOCOL_VERSION, sys.executable, os.getpid(), versions, affinity))
    reason = worker.cls.unavailable_reason()
    if reason is None:
        problems = worker.cls.check_options(worker.options, worker.spec)
        reason = "; ".join(problems) if problems else None
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
    except EngineUnavailable as e:
        send(Unavailable(f"{e} (under {sys.executable})"))
    finally:
        try:
            worker.close()
        finally:
            send(Bye())


if __name__ == "__main__":
    main()

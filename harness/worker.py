"""The engine's process: load one engine, measure points, send each result to the parent.

The parent (harness.runner) starts this with multiprocessing's `spawn`, so the engine gets a
fresh interpreter: no state shared with other engines or the parent. Messages on the pipe:

    ("loaded", load_info)        the engine is ready
    ("start", point_key)         a point began (the parent's timeout clock starts)
    ("point", key, status, error, fields)
    ("done",)
    ("load_failed", status, error)
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from dataclasses import asdict
from typing import Any


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _redirect_output(log_path: str) -> None:
    """Send the engine's own prints and logs (fd 1 and 2) to its log file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def worker_main(conn: Any, job: dict[str, Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    _redirect_output(job["log_path"])
    _quiet_libraries()
    if job.get("num_threads"):
        import torch
        torch.set_num_threads(int(job["num_threads"]))

    from adapters import engine_class
    from adapters.base import EngineUnavailable, ModelSpec
    from workloads import get_workload
    from workloads.base import Point, RunContext

    print(f"[infer-bench worker] engine={job['engine']} pid={os.getpid()}", flush=True)
    try:
        engine = engine_class(job["engine"])()
        info = engine.load(ModelSpec(**job["model_spec"]), job["options"])
        conn.send(("loaded", asdict(info)))
    except EngineUnavailable as e:
        conn.send(("load_failed", "unavailable", str(e)))
        return
    except BaseException as e:
        traceback.print_exc()
        conn.send(("load_failed", "failed", f"load: {_error_text(e)}"))
        return

    workload = get_workload(job["workload"])
    ctx = RunContext(**job["context"])
    ctx.extra["workload_cfg"] = job["workload_cfg"]
    caps = engine.capabilities(job["options"])
    for pd in job["points"]:
        point = Point(pd["workload"], pd["params"])
        conn.send(("start", point.key))
        why_not = workload.unsupported(point, caps)
        if why_not:
            conn.send(("point", point.key, "skipped", why_not, {}))
            continue
        if workload.reset_prefix_cache:
            engine.reset_prefix_cache()
        try:
            fields = workload.run_point(engine, point, ctx)
            conn.send(("point", point.key, "ok", None, fields))
        except Exception as e:
            traceback.print_exc()
            try:
                engine.release()
            except Exception:
                pass
            conn.send(("point", point.key, "failed", _error_text(e), {}))
    try:
        engine.close()
    finally:
        conn.send(("done",))

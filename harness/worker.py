"""The engine's process: load one engine, measure points, send each result to the parent.

The parent (harness.runner) starts this with multiprocessing's `spawn`, so the engine gets a
fresh interpreter: no state shared with other engines or the parent. Messages on the pipe:

    ("ready", engine_version)    imports done; points follow
    ("start", point_key)         a point began (the parent's timeout clock starts; a point
                                 includes loading the engine when its options change)
    ("point", key, status, error, fields)
    ("unavailable", reason)      the engine cannot run here after all (e.g. no GPU)
    ("done",)
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


class _Loaded:
    """The engine instance and the options it was loaded with (reloaded when they change)."""

    def __init__(self, cls: Any, spec: Any):
        self.cls, self.spec = cls, spec
        self.engine: Any = None
        self.options: dict[str, Any] | None = None
        self.load_info: dict[str, Any] | None = None
        self.failed: dict[str, str] = {}  # options (as text) -> why loading them failed

    def get(self, options: dict[str, Any]) -> tuple[Any, bool]:
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
        except Exception as e:
            from adapters.base import EngineUnavailable
            if isinstance(e, EngineUnavailable):
                raise
            traceback.print_exc()
            self.failed[key] = f"load: {_error_text(e)}"
            try:
                engine.close()
            except Exception:
                pass
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


def worker_main(conn: Any, job: dict[str, Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    _redirect_output(job["log_path"])
    _quiet_libraries()

    from adapters import engine_class
    from adapters.base import EngineUnavailable, ModelSpec
    from workloads import get_workload
    from workloads.base import Point, RunContext, is_oom

    print(f"[infer-bench worker] engine={job['engine']} pid={os.getpid()}", flush=True)
    cls = engine_class(job["engine"])
    spec = ModelSpec(**job["model_spec"])
    conn.send(("ready", cls.version()))
    workload = get_workload(job["workload"])
    ctx = RunContext(**job["context"])
    ctx.extra["workload_cfg"] = job["workload_cfg"]
    loaded = _Loaded(cls, spec)
    ooms: list[Point] = []
    for pd in job["points"]:
        point = Point(pd["workload"], pd["params"])
        conn.send(("start", point.key))
        caps = cls.capabilities(job["options"])
        why_not = workload.unsupported(point, caps)
        oom = next((o for o in ooms if point.bigger_batch_of(o)), None)
        if oom is not None:
            why_not = f"batch_size={oom.params['batch_size']} of this point ran out of memory"
        overrides = cls.options_for(workload.engine_overrides(point, caps)) if why_not is None else {}
        options = {**job["options"], **overrides}
        if why_not is None and overrides:
            problems = cls.check_options(options, spec)
            why_not = "; ".join(problems) if problems else None
        if why_not:
            conn.send(("point", point.key, "skipped", why_not, {}))
            continue
        try:
            engine, just_loaded = loaded.get(options)
            if workload.reset_prefix_cache:
                engine.reset_prefix_cache()
            fields = workload.run_point(engine, point, ctx)
            fields["engine_options"] = options
            if just_loaded:
                fields["load_time_s"] = loaded.load_info["load_time_s"]
                fields["weights_bytes"] = loaded.load_info["weights_bytes"]
            conn.send(("point", point.key, "ok", None, fields))
        except EngineUnavailable as e:
            conn.send(("unavailable", str(e)))
            return
        except Exception as e:
            traceback.print_exc()
            try:
                if loaded.engine is not None:
                    loaded.engine.release()
            except Exception:
                pass
            error = _error_text(e)
            if is_oom(error):
                ooms.append(point)
            conn.send(("point", point.key, "failed", error, {"engine_options": options, "oom": is_oom(error)}))
    if job.get("parity_prompts"):
        conn.send(("start", job["parity_key"]))
        try:
            engine, _ = loaded.get(job["options"])
            engine.reset_prefix_cache()
            conn.send(("parity", greedy_tokens(engine, job["parity_prompts"], job["parity_tokens"]), None))
        except EngineUnavailable as e:
            conn.send(("unavailable", str(e)))
            return
        except Exception as e:
            traceback.print_exc()
            conn.send(("parity", None, _error_text(e)))
    try:
        loaded.close()
    finally:
        conn.send(("done",))


def greedy_tokens(engine: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The first n greedy output tokens of every prompt, run as one batch."""
    pre = engine.prefill(prompts)
    dec = engine.decode(n - 1) if n > 1 else None
    engine.release()
    steps = dec.tokens if dec else []
    return [[pre.first_tokens[b]] + [step[b] for step in steps] for b in range(len(prompts))]

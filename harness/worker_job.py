"""What a worker does with its job: build the engine and the workloads, then measure the points
the harness sends (harness.worker runs the protocol around it). Imported by the worker only after
its handshake, so that a package missing from the engine's environment becomes an
`unavailable` row naming it, not a crash."""

from __future__ import annotations

import os
import traceback
from dataclasses import asdict
from typing import Any

from adapters.base import Engine, EngineUnavailable, ModelSpec, PointUnsupported
from harness.core.presets import ModelShape
from harness.engines import capability_problems, resolve_engine
from harness.protocol import PointDone, PointStarted, RunPoint
from workloads import get_workload
from workloads.base import Point, RunContext, is_oom


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


class _Loaded:
    """The engine instance and the options it was loaded with (reloaded when they change)."""

    def __init__(self, cls: type[Engine], spec: ModelSpec):
        self.cls, self.spec = cls, spec
        self.engine: Engine | None = None
        self.options: dict[str, Any] | None = None
        self.load_info: dict[str, Any] | None = None
        self.failed: dict[str, str] = {}  # options (as text) -> why loading them failed
        self.unsupported: dict[str, str] = {}  # options (as text) -> why the engine refused them (PointUnsupported)

    def get(self, options: dict[str, Any]) -> tuple[Engine, bool]:
        """(engine loaded with `options`, whether it was loaded just now)."""
        key = repr(sorted(options.items()))
        if key in self.failed:
            raise RuntimeError(self.failed[key])
        if key in self.unsupported:
            raise PointUnsupported(self.unsupported[key])
        if self.engine is not None and options == self.options:
            return self.engine, False
        self.close()
        engine = self.cls()
        try:
            info = engine.load(self.spec, options)
        except EngineUnavailable:
            raise
        except PointUnsupported as e:
            self.unsupported[key] = str(e)
            try:
                engine.close()
            except Exception:
                traceback.print_exc()
            raise
        except Exception as e:
            traceback.print_exc()
            self.failed[key] = f"load: {error_text(e)}"
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
        cls, problems = resolve_engine(job["engine"], job.get("endpoint"))
        if cls is None:
            raise ValueError("; ".join(problems))
        self.cls = cls
        self.options: dict[str, Any] = job["options"]
        self.spec = ModelSpec(**{**job["model_spec"], "cpus": tuple(job["model_spec"]["cpus"])
                                 if job["model_spec"].get("cpus") else None})
        ctx = dict(job["context"])
        ctx["shape"] = ModelShape(**ctx["shape"])
        ctx["avoid_ids"] = tuple(ctx.get("avoid_ids") or ())
        self.ctx = RunContext(**ctx)
        self.workloads = {}
        for name, raw in job["workloads"].items():  # checked by the harness (harness.config): trusted here
            wl = get_workload(name)
            self.workloads[name] = (wl, wl.config_cls(**raw))
        self.loaded = _Loaded(self.cls, self.spec)

    def why_not_here(self) -> str | None:
        """Why the engine cannot run in this environment (checked here because an engine in an
        environment of its own was not importable where the run was planned), or None."""
        reason = self.cls.unavailable_reason()
        if reason is not None:
            return reason
        # the options were checked against their schema by the harness; what the engine can do with
        # this dtype and device needs its packages, which an environment of its own has and the
        # harness's may not
        problems = capability_problems(self.cls, self.options, self.cls.name, self.spec.dtype, self.spec.device)
        return "; ".join(problems) or None

    def run(self, msg: RunPoint) -> None:
        point = Point(msg.point["workload"], msg.point["params"])
        self.send(PointStarted(point.key))
        workload, cfg = self.workloads[point.workload]
        caps = self.cls.capabilities(self.options)
        why_not = workload.unsupported(point, caps)
        standard = workload.engine_overrides(point, caps) if why_not is None else {}
        if isinstance(standard.get("draft_model"), str):  # a preset the harness materialised: its directory
            standard["draft_model"] = self.ctx.models.get(standard["draft_model"], standard["draft_model"])
        overrides = self.cls.options_for(standard)
        options = {**self.options, **overrides}
        for k, v in overrides.items():  # a mapping-valued option (an endpoint's server_flags) merges
            if isinstance(v, dict) and isinstance(self.options.get(k), dict):
                options[k] = {**self.options[k], **v}
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
            engine.begin_point()
            row = workload.run_point(engine, point, self.ctx, cfg, msg.inputs)
            for k, v in engine.end_point().items():  # the workload's own fields (measured requests) win
                row.setdefault(k, v)
            row.update(self._engine_fields(options, just_loaded))
            self.send(PointDone(point.key, "ok", None, row))
        except EngineUnavailable:
            raise
        except PointUnsupported as e:  # the engine refused these options on this hardware: nothing ran
            self.send(PointDone(point.key, "skipped", str(e), {"engine_options": options}))
        except Exception as e:
            traceback.print_exc()
            extra: dict[str, Any] = {}
            if engine is not None:
                try:
                    engine.release()
                    extra = engine.end_point()
                except Exception:
                    traceback.print_exc()
            error = error_text(e)
            self.send(PointDone(point.key, "failed", error, {**extra, "engine_options": options, "oom": is_oom(error)}))

    def _engine_fields(self, options: dict[str, Any], just_loaded: bool) -> dict[str, Any]:
        info = self.loaded.load_info or {}
        out: dict[str, Any] = {"engine_options": options, "engine_info": info.get("details") or None}
        if info.get("compute_threads"):  # what the engine says it uses (else the run's share stands)
            out["compute_threads"] = info["compute_threads"]
        if hasattr(os, "sched_getaffinity"):
            out["cpu_affinity"] = sorted(os.sched_getaffinity(0))
        if just_loaded:
            out["load_time_s"] = info.get("load_time_s")
            out["weights_bytes"] = info.get("weights_bytes")
        return out

    def close(self) -> None:
        self.loaded.close()



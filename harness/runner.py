"""Run a plan: one isolated process per engine, rows written as each point finishes.

vLLM and TensorRT-LLM take over device memory and process-global state, so two engines in one
process would measure each other. Each engine runs in its own child process (spawn); the
child streams results back and this process writes them. A child that crashes, is killed or
runs past the point timeout becomes a `failed` row with its reason (the last lines of its log);
it is restarted for the points that remain, and the run goes on.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.config import PARITY_PROMPT_LENS, Plan
from harness.core.bootstrap import add_intervals
from harness.core.roofline import annotate
from workloads import get_workload, workload_names
from harness.progress import Progress
from harness.core.results import RESULTS_FILE, ResultsWriter, make_row
from workloads.base import Point, RunContext
from workloads.prompts import synthetic_prompts


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def token_range(plan: Plan, model_path: str) -> tuple[int, int, tuple[int, ...]]:
    """Prompt token ids: the whole vocabulary minus special tokens (from config.json and the
    tokenizer's special tokens when there is one)."""
    import json
    avoid: set[int] = set()
    p = Path(model_path)
    try:
        cfg = json.loads((p / "config.json").read_text())
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = cfg.get(k)
            avoid |= set(v) if isinstance(v, list) else ({v} if isinstance(v, int) else set())
    except (OSError, ValueError):
        pass
    try:
        tok = json.loads((p / "tokenizer_config.json").read_text())
        avoid |= {int(i) for i in (tok.get("added_tokens_decoder") or {})}
    except (OSError, ValueError):
        pass
    return 0, plan.shape.vocab_size, tuple(sorted(i for i in avoid if i < plan.shape.vocab_size))


class Runner:
    def __init__(self, plan: Plan, model_path: str, out_dir: Path, env: dict[str, Any],
                 done: set[tuple[str, str | None]] | None = None):
        """`done`: (engine, point_key) pairs that already have a row (resume); they are not run
        again. An engine's `unavailable` row has point_key None."""
        self.done = done or set()
        self.plan = plan
        self.model_path = model_path
        self.out_dir = out_dir
        self.env = env
        self.run_id = uuid.uuid4().hex[:12]
        self.rows: list[dict[str, Any]] = []
        self.writer = ResultsWriter(out_dir / RESULTS_FILE)
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.parity_point = Point("parity", {"prompt_lens": PARITY_PROMPT_LENS, "tokens": plan.settings.parity_tokens}) \
            if plan.settings.parity else None
        self.parity_baseline: tuple[str, list[list[int]]] | None = None  # (engine, tokens)
        self.ceilings = None
        total = (len(plan.points) + (1 if self.parity_point else 0)) * len(plan.engines)
        self.progress = Progress(total, quiet=plan.settings.quiet)
        self._proc: mp.process.BaseProcess | None = None

    # ---- rows --------------------------------------------------------------------------
    def _row(self, engine: str, point: Point | None, status: str, error: str | None,
             fields: dict[str, Any], engine_version: str | None = None) -> dict[str, Any]:
        params = point.params if point else {}
        row = make_row(
            run_id=self.run_id, timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            engine=engine, engine_version=engine_version, model=self.plan.shape.name, model_path=self.model_path,
            workload=point.workload if point else self.plan.workload.name, point=params, point_key=point.key if point else None,
            batch_size=params.get("batch_size"), prompt_len=params.get("prompt_len"),
            output_len=params.get("output_len"), dtype=self.plan.dtype, device=self.plan.device,
            status=status, error=error,
        )
        row.update(fields)
        row.setdefault("engine_options", self.plan.engine_options.get(engine, {}))
        add_intervals(row)
        if point is not None and point.workload in workload_names():
            get_workload(point.workload).finalize_row(row)
        if self.ceilings is not None and status == "ok" and row["workload"] == "sweep":
            row.update(annotate(row, self.plan.shape, self.ceilings))
        self.writer.write(row)
        self.rows.append(row)
        return row

    # ---- one engine --------------------------------------------------------------------
    def _job(self, engine: str, points: list[Point], log_path: Path) -> dict[str, Any]:
        low, high, avoid = token_range(self.plan, self.model_path)
        parity = self.parity_point is not None and any(p.key == self.parity_point.key for p in points)
        points = [p for p in points if p.workload != "parity"]
        parity_prompts = None
        if parity:
            lens = [min(n, max(1, self.plan.max_model_len - self.plan.settings.parity_tokens))
                    for n in PARITY_PROMPT_LENS]
            parity_prompts = [synthetic_prompts(1, n, low, high, avoid, self.plan.settings.seed, f"parity/{i}")[0]
                              for i, n in enumerate(lens)]
        ctx = RunContext(shape=self.plan.shape, dtype=self.plan.dtype, device=self.plan.device,
                         model_path=self.model_path, max_model_len=self.plan.max_model_len, seed=self.plan.settings.seed, memory_sample_hz=self.plan.settings.memory_sample_hz,
                         token_low=low, token_high=high, avoid_ids=avoid)
        ctx_dict = {k: v for k, v in asdict(ctx).items() if k != "extra"}
        ctx_dict["shape"] = self.plan.shape
        return {
            "engine": engine, "options": self.plan.engine_options.get(engine, {}),
            "model_spec": asdict(self.plan.model_spec(self.model_path)),
            "workload": self.plan.workload.name, "workload_cfg": self.plan.workload_cfg,
            "points": [p.to_dict() for p in points], "context": ctx_dict, "log_path": str(log_path),
            "parity_prompts": parity_prompts, "parity_tokens": self.plan.settings.parity_tokens,
            "parity_key": self.parity_point.key if self.parity_point else None,
        }

    def run_engine(self, engine: str) -> None:
        from harness.worker import worker_main

        all_points = list(self.plan.points) + ([self.parity_point] if self.parity_point else [])
        remaining = [p for p in all_points if (engine, p.key) not in self.done]
        self.progress.skip(len(all_points) - len(remaining), engine, "done before (resume)", quiet_if_zero=True)
        if engine in self.plan.unavailable:
            if (engine, None) not in self.done:
                self._row(engine, None, "unavailable", self.plan.unavailable[engine], {})
            self.progress.skip(len(remaining), engine, "unavailable")
            return
        log_path = self.out_dir / "logs" / f"{engine}.log"
        ctx = mp.get_context("spawn")
        while remaining:
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(child, self._job(engine, remaining, log_path)),
                               name=f"infer-bench-{engine}", daemon=False)
            self._proc = proc
            proc.start()
            child.close()
            done_keys = self._follow(engine, proc, parent, remaining, log_path)
            parent.close()
            self._end(proc)
            if not done_keys:  # died without finishing anything: do not restart forever
                self._fail_all(engine, remaining, "failed", "engine process ended without results; see "
                               f"{log_path}:\n{_tail(log_path)}")
                break
            remaining = [p for p in remaining if p.key not in done_keys]
            remaining = self._skip_after_oom(engine, remaining)

    def _skip_after_oom(self, engine: str, points: list[Point]) -> list[Point]:
        """Points with a larger batch size than one that ran out of memory are recorded as
        skipped, not run (the worker does the same within one process)."""
        ooms = [Point(r["workload"], r["point"]) for r in self.rows
                if r["engine"] == engine and r["status"] == "failed" and r.get("oom")]
        keep = []
        for p in points:
            o = next((o for o in ooms if p.bigger_batch_of(o)), None)
            if o is None:
                keep.append(p)
            else:
                self._row(engine, p, "skipped", f"batch_size={o.params['batch_size']} of this point ran out "
                          "of memory", {})
                self.progress.finish(engine, p, "skipped")
        return keep

    def _follow(self, engine: str, proc: Any, conn: Any, points: list[Point], log_path: Path) -> set[str]:
        """Read the child's messages until it is done or dies. Returns the keys of the points
        that got a row."""
        by_key = {p.key: p for p in points}
        done: set[str] = set()
        version = None
        current: Point | None = None
        started = time.monotonic()
        limit = self.plan.settings.point_timeout_s
        min_avail = 1.0  # lowest share of the machine's memory available during the current point
        while True:
            min_avail = min(min_avail, _available_share())
            msg = None
            if conn.poll(0.1):
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = ("dead", None)
            elif not proc.is_alive():
                msg = ("dead", None)
            elif time.monotonic() - started > limit:
                proc.kill()
                proc.join(10)
                msg = ("dead", f"timed out after {limit:g} s (point_timeout_s); the engine process was killed")
            if msg is None:
                continue
            kind = msg[0]
            if kind == "ready":
                version = msg[1]
            elif kind == "start":
                current = by_key[msg[1]]
                started = time.monotonic()
                min_avail = 1.0
                self.progress.start(engine, current)
            elif kind == "point":
                _, key, status, error, fields = msg
                self._row(engine, by_key[key], status, error, fields, version)
                done.add(key)
                self.progress.finish(engine, by_key[key], status)
                current = None
                started = time.monotonic()
            elif kind == "parity":
                _, tokens, error = msg
                assert current is not None
                self._parity_row(engine, current, tokens, error, version)
                done.add(current.key)
                self.progress.finish(engine, current, "ok" if tokens else "failed")
                current = None
                started = time.monotonic()
            elif kind == "unavailable":
                self._row(engine, None, "unavailable", msg[1], {}, version)
                self.progress.skip(len(points) - len(done), engine, "unavailable")
                return {p.key for p in points}
            elif kind == "done":
                return done
            elif kind == "dead":
                proc.join(5)
                what = msg[1] or f"engine process died ({_exit_text(proc.exitcode)})"
                oom = proc.exitcode == -9 and min_avail < LOW_MEMORY_SHARE
                if oom:
                    what += (f" while only {min_avail:.1%} of the machine's memory was available: likely the "
                             "kernel's out-of-memory killer")
                tail = _tail(log_path)
                reason = what + (f"; last lines of logs/{log_path.name}:\n{tail}" if tail else "")
                if current is None:  # died outside a point: nothing to blame it on
                    self._fail_all(engine, [p for p in points if p.key not in done], "failed", reason)
                    return {p.key for p in points}
                self._row(engine, current, "failed", reason, {"oom": oom}, version)
                done.add(current.key)
                self.progress.finish(engine, current, "failed")
                return done

    def _parity_row(self, engine: str, point: Point, tokens: list[list[int]] | None, error: str | None,
                    version: str | None) -> None:
        """Greedy tokens of this engine beside the baseline's (the reference engine's when it ran).
        In float32 engines must agree exactly; otherwise agreement is reported, not enforced."""
        if tokens is None:
            self._row(engine, point, "failed", error, {}, version)
            return
        if self.parity_baseline is None:
            self.parity_baseline = (engine, tokens)
        base_engine, base = self.parity_baseline
        fields = {"parity_tokens": tokens, "parity_baseline": base_engine, **parity_agreement(base, tokens)}
        status, err = "ok", None
        if self.plan.dtype == "float32" and fields["agreement"] < 1.0:
            status = "failed"
            err = (f"greedy tokens differ from {base_engine}'s in float32 (first divergence at step "
                   f"{fields['first_divergence']}, agreement {fields['agreement']:.3f})")
        self._row(engine, point, status, err, fields, version)

    def _fail_all(self, engine: str, points: list[Point], status: str, error: str) -> None:
        for p in points:
            self._row(engine, p, status, error, {})
        self.progress.skip(len(points), engine, status)

    def _end(self, proc: Any) -> None:
        if proc.is_alive():
            proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        self._proc = None

    def stop_children(self) -> None:
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(10)

    def run(self) -> list[dict[str, Any]]:
        if self.plan.settings.roofline:
            self.ceilings = _ceilings(self.plan)
        # the reference engine runs first: it is the baseline of the parity check
        order = sorted(self.plan.engines, key=lambda e: e != "reference")
        try:
            for engine in order:
                self.run_engine(engine)
        finally:
            self.stop_children()
            self.writer.close()
            self.progress.close()
        return self.rows


# A child killed by SIGKILL while less than this share of memory was available is taken for a
# victim of the kernel's out-of-memory killer.
LOW_MEMORY_SHARE = 0.03


def _available_share() -> float:
    import psutil
    vm = psutil.virtual_memory()
    return vm.available / vm.total


def parity_agreement(base: list[list[int]], tokens: list[list[int]]) -> dict[str, Any]:
    """Share of positions where the tokens equal the baseline's, and the first step (over all
    prompts) where they differ (None when they agree everywhere)."""
    total = same = 0
    first: int | None = None
    for b, t in zip(base, tokens):
        for i, (x, y) in enumerate(zip(b, t)):
            total += 1
            if x == y:
                same += 1
            elif first is None or i < first:
                first = i
    return {"agreement": same / total if total else None, "first_divergence": first}


def _ceilings(plan: Plan) -> Any:
    """The machine's roofline ceilings (cached); None if they cannot be measured."""
    from harness.core.paths import model_cache_dir
    from harness.core.roofline import cached_ceilings
    try:
        return cached_ceilings(plan.device, plan.dtype, model_cache_dir(plan.settings.model_cache_dir).parent
                               / "roofline.json")
    except Exception as e:  # never fail a run for it
        print(f"roofline: ceilings not measured ({type(e).__name__}: {e})")
        return None


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        import signal
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"

"""Run a plan: one worker process per engine, rows written as each point finishes.

vLLM and TensorRT-LLM take over device memory and process-global state, and each pins its own
torch build, so every engine runs in a worker process of its own (harness.worker), started
under the harness's interpreter, another environment's (`engine_options.<engine>.python`) or a
launch prefix (`engine_options.<engine>.launch`: a container, a cluster launcher). The harness
ships its worker code with the command (harness.bundle) and speaks harness.protocol with it.

For each point the harness sends the point, the worker measures it and answers with the row's
fields; the harness completes the row (intervals, workload-specific fields, the worker's
identity) and appends it to results.jsonl at once. A worker that crashes, is killed, dies in
its handshake or runs past the point timeout becomes a `failed` row with its reason and the
last lines of its log; it is restarted for the points that remain, and the run goes on. After a
point runs out of memory, the larger batch sizes of the same point are `skipped` (the one rule:
workloads.base.oom_skip_reason).
"""

from __future__ import annotations

import os
import queue
from collections import deque
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

from harness.bundle import ship
from harness.config import Plan
from harness.core.bootstrap import add_intervals
from harness.core.cost import cost_fields
from harness.core.energy import per_token_fields
from harness.core.roofline import annotate, cached_ceilings
from harness.core.paths import model_cache_dir
from harness.core.redact import Redactor
from harness.core.results import RESULTS_FILE, ResultsWriter, make_row
from harness.progress import Progress
from harness.protocol import (
    PROTOCOL_VERSION, Bye, Hello, Incompatible, PointDone, PointStarted, Ready, RunPoint, Shutdown,
    SetupFailed, Unavailable, decode, encode,
)
from workloads.base import Point, oom_skip_reason

# A worker killed by SIGKILL while less than this share of memory was available is taken for a
# victim of the kernel's out-of-memory killer.
LOW_MEMORY_SHARE = 0.03
# How long a worker may take to start and answer the handshake (imports of a large engine, a
# container start) before it counts as failed.
HANDSHAKE_TIMEOUT_S = 600.0
_EOF = object()


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _available_share() -> float:
    vm = psutil.virtual_memory()
    return vm.available / vm.total


class WorkerProcess:
    """One engine's worker: its process (a session of its own, so its whole group can be
    stopped) and the protocol channel. Protocol lines from its stdout go to a queue; everything
    else it prints goes to the engine's log."""

    def __init__(self, cmd: list[str], log_path: Path, redact: Redactor):
        self.cmd = cmd
        self.log_path = log_path
        self.redact = redact
        self.messages: queue.Queue = queue.Queue()
        self._log_lock = threading.Lock()
        self.log = open(log_path, "a", encoding="utf-8")
        self._write_log(f"[infer-bench] starting worker: {' '.join(cmd)}\n")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, encoding="utf-8", errors="replace", bufsize=1,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, name="worker-reader", daemon=True)
        self._reader.start()
        self._logger = threading.Thread(target=self._pump_stderr, name="worker-log", daemon=True)
        self._logger.start()

    def _write_log(self, text: str) -> None:
        """Everything the worker prints reaches the log through the run's redaction step."""
        with self._log_lock:
            self.log.write(self.redact.text(text))
            self.log.flush()

    def _pump_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._write_log(line)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = decode(line)
            except Exception as e:
                msg = None
                self._write_log(f"[infer-bench] {e}\n")
            if msg is None:
                self._write_log(line)
            else:
                self.messages.put(msg)
        self.messages.put(_EOF)

    def send(self, msg: Any) -> bool:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(encode(msg))
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def recv(self, timeout: float) -> Any:
        """The next message, None when `timeout` passed, _EOF when the worker's stdout closed."""
        try:
            return self.messages.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def pids(self) -> set[int]:
        try:
            p = psutil.Process(self.proc.pid)
            return {p.pid} | {c.pid for c in p.children(recursive=True)}
        except psutil.NoSuchProcess:
            return set()

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (the engine's own children included)."""
        for sig in (signal.SIGKILL,):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask the worker to shut down; after `grace_s`, SIGTERM then SIGKILL its process group."""
        if self.proc.poll() is None:
            self.send(Shutdown())
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                    self.proc.wait(10)
                except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                    pass
        if self.proc.poll() is None:
            self.kill()
        try:  # the group may hold children that outlived the worker
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._reader.join(5)
        self._logger.join(5)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        with self._log_lock:
            self.log.close()


class _EngineSetupFailed(Exception):
    """The worker could not set its engine up although the engine's packages are there."""


@dataclass
class WorkerInfo:
    """Who measured a row: the worker's interpreter, versions and launch prefix."""

    python: str | None = None
    versions: dict[str, Any] | None = None
    launch: list[str] | None = None
    sees_processes: bool = True

    def fields(self) -> dict[str, Any]:
        out = {"worker_python": self.python, "worker_versions": self.versions, "worker_launch": self.launch}
        if not self.sees_processes:
            out["memory_scope"] = ("the worker's own view: the harness cannot see the worker's processes "
                                   "(a container or another host), so memory is what the worker measured itself")
        return out


@dataclass
class WorkerStart:
    """What starting an engine's worker gave: the worker after a good handshake, or None and
    why it failed; its identity either way (what is known of it)."""

    worker: WorkerProcess | None
    info: WorkerInfo
    failure: str | None = None


class Runner:
    def __init__(self, plan: Plan, model_path: str, out_dir: Path, env: dict[str, Any],
                 previous: list[dict[str, Any]] | None = None):
        """`previous`: the rows already in the run directory (resume). Their points are not run
        again (an engine's `unavailable` row has point_key None), and they count as rows of this
        run for what later rows are compared with (parity's baseline)."""
        self.rows: list[dict[str, Any]] = list(previous or [])
        self.done = {(r.get("engine"), r.get("point_key")) for r in self.rows}
        self.plan = plan
        self.model_path = model_path
        self.out_dir = out_dir
        self.env = env
        self.run_id = uuid.uuid4().hex[:12]
        self.writer = ResultsWriter(out_dir / RESULTS_FILE)
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.ceilings = None
        self.progress = Progress(len(plan.points) * len(plan.engines), quiet=plan.settings.quiet)
        self._worker: WorkerProcess | None = None
        self._script: Path | None = None
        self.redact = plan.redactor()
        for planned in plan.workloads:
            planned.workload.bind_run_dir(out_dir)

    # ---- rows --------------------------------------------------------------------------
    def _row(self, engine: str, point: Point | None, status: str, error: str | None,
             fields: dict[str, Any], info: WorkerInfo | None = None) -> dict[str, Any]:
        params = point.params if point else {}
        workload = point.workload if point else self.plan.workload.name
        row = make_row(
            run_id=self.run_id, timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            engine=engine, engine_version=(info.versions or {}).get("engine") if info else None,
            model=self.plan.shape.name, model_path=self.model_path, workload=workload, point=params,
            point_key=point.key if point else None, batch_size=params.get("batch_size"),
            prompt_len=params.get("prompt_len"), output_len=params.get("output_len"), dtype=self.plan.dtype,
            device=self.plan.device, status=status, error=error,
        )
        row.update(self.plan.resources_fields(engine))
        row.update(self.plan.source_fields(workload))  # a Hub model's / dataset's id, revision and commit
        if info is not None:
            row.update(info.fields())
        row.update(fields)
        row.setdefault("engine_options", self.plan.engine_options.get(engine, {}))
        row = self.redact.obj(row)
        add_intervals(row)
        if "energy_j" in row:
            row.update(per_token_fields(row["energy_j"], row.get("measured_output_tokens")))
        if point is not None:
            wl = self.plan.workload_named(point.workload)
            wl.finalize_row(row, self.rows)
            if self.ceilings is not None and status == "ok" and wl.roofline:
                row.update(annotate(row, self.plan.shape, self.ceilings))
        row.update(cost_fields(row, self.plan.prices.get(engine)))  # after finalize_row: its verdicts count
        self.writer.write(row)
        self.rows.append(row)
        return row

    # ---- one engine --------------------------------------------------------------------
    def _job(self, engine: str) -> dict[str, Any]:
        spec = asdict(self.plan.model_spec(self.model_path, engine, str(self.out_dir)))
        return {"engine": engine, "endpoint": self.plan.endpoints.get(engine),
                "options": self.plan.engine_options.get(engine, {}), "model_spec": spec,
                "context": self.plan.context(self.model_path),
                "workloads": {p.workload.name: asdict(p.cfg) for p in self.plan.workloads}}

    def _command(self, engine: str) -> list[str]:
        if self._script is None:
            self._script = ship(self.out_dir)
        prefix = self.plan.launch_prefix(engine, run_dir=str(self.out_dir), src=str(self._script.parent),
                                         model=self.model_path)
        return [*prefix, str(self._script)]

    def _start_worker(self, engine: str, log_path: Path) -> WorkerStart:
        """The worker and its identity after a good handshake, else no worker and why it failed."""
        cmd = self._command(engine)
        launch = self.plan.launch_prefix(engine) if self.plan.engine_envs.get(engine) else None
        info = WorkerInfo(launch=launch)
        try:
            worker = WorkerProcess(cmd, log_path, self.redact)
        except OSError as e:
            return WorkerStart(None, info, f"the worker command could not start ({e}): {' '.join(cmd)}")
        self._worker = worker
        worker.send(Hello(PROTOCOL_VERSION, self._job(engine)))
        deadline = time.monotonic() + min(HANDSHAKE_TIMEOUT_S, self.plan.settings.point_timeout_s)
        while True:
            msg = worker.recv(min(0.5, deadline - time.monotonic()))
            if isinstance(msg, Ready) and msg.protocol != PROTOCOL_VERSION:
                self._end_worker()
                return WorkerStart(None, info, f"worker protocol mismatch: the harness speaks version "
                                   f"{PROTOCOL_VERSION}, the worker ({' '.join(cmd)}) version {msg.protocol}")
            if isinstance(msg, Ready):
                info.python, info.versions = msg.python, msg.versions
                info.sees_processes = msg.pid in worker.pids()
                return WorkerStart(worker, info)
            if isinstance(msg, Incompatible):
                self._end_worker()
                return WorkerStart(None, info, f"worker protocol mismatch: the harness speaks version "
                                   f"{PROTOCOL_VERSION}, the worker ({' '.join(cmd)}) version "
                                   f"{msg.protocol}: {msg.message}")
            if msg is _EOF or (msg is None and worker.proc.poll() is not None) or time.monotonic() > deadline:
                why = ("did not answer the handshake within "
                       f"{min(HANDSHAKE_TIMEOUT_S, self.plan.settings.point_timeout_s):g} s"
                       if msg is None and worker.proc.poll() is None else
                       f"died during the handshake ({_exit_text(worker.proc.wait(10))})")
                self._end_worker()
                tail = _tail(log_path)
                return WorkerStart(None, info, f"the engine's worker {why}. Command: {' '.join(cmd)}"
                                   + (f"\nlast lines of logs/{log_path.name}:\n{tail}" if tail else ""))

    def _end_worker(self, grace_s: float = 30.0) -> None:
        if self._worker is not None:
            self._worker.stop(grace_s)
            self._worker = None

    def _existing_row(self, engine: str, point: Point) -> dict[str, Any] | None:
        """The row this engine already has for the point (resume), if any."""
        if (engine, point.key) not in self.done:
            return None
        return next((r for r in reversed(self.rows) if r.get("engine") == engine and r.get("point_key") == point.key),
                    None)

    def run_engine(self, engine: str) -> None:
        """The engine's points in order. A workload may add points as rows come in (capacity's
        search: the next probe depends on the last one), and compute some in the harness itself
        (capacity's conclusion); the engine's worker is started when a point first needs it, and
        restarted after it dies."""
        queue = deque(self.plan.points)
        if engine in self.plan.unavailable:
            if (engine, None) not in self.done:
                self._row(engine, None, "unavailable", self.plan.unavailable[engine], {})
            self.progress.skip(len(queue), engine, "unavailable")
            return
        log_path = self.out_dir / "logs" / f"{engine}.log"
        worker: WorkerProcess | None = None
        info = WorkerInfo()
        try:
            while queue:
                point = queue.popleft()
                wl, cfg = self.plan.workload_and_cfg(point.workload)
                row = self._existing_row(engine, point)
                if row is not None:
                    self.progress.skip(1, engine, "done before (resume)")
                else:
                    ooms = [Point(r["workload"], r["point"]) for r in self.rows
                            if r["engine"] == engine and r["status"] == "failed" and r.get("oom")]
                    skip = oom_skip_reason(point, ooms)
                    fields = None if skip else wl.compute_in_harness(point, engine, self.rows, cfg)
                    if skip or fields is not None:
                        fields = dict(fields or {})
                        status = "skipped" if skip else fields.pop("status", "ok")
                        row = self._row(engine, point, status, skip or fields.pop("error", None), fields, info)
                        self.progress.finish(engine, point, row["status"])
                    else:
                        if worker is None:
                            start = self._start_worker(engine, log_path)
                            worker, info = start.worker, start.info
                            if worker is None:  # could not start: this point and the rest fail with the reason
                                self._fail_all(engine, [point, *queue], start.failure or "the worker failed", info)
                                return
                        try:
                            row, alive = self._run_point(engine, worker, info, point, log_path)
                        except _EngineSetupFailed as e:  # a bug, not the environment: every point fails
                            self._end_worker()
                            self._fail_all(engine, [point, *queue], str(e), info)
                            return
                        if row is None:  # the engine is unavailable after all
                            self.progress.skip(len(queue), engine, "unavailable")
                            return
                        if not alive:
                            self._end_worker()
                            worker = None
                new = wl.next_points(point, row, [r for r in self.rows if r.get("engine") == engine], cfg)
                self.progress.total += len(new)
                queue.extendleft(reversed(new))
        except KeyboardInterrupt:
            self._end_worker(grace_s=2.0)
            raise
        finally:
            self._end_worker()

    def _run_point(self, engine: str, worker: WorkerProcess, info: WorkerInfo, point: Point,
                   log_path: Path) -> tuple[dict[str, Any] | None, bool]:
        """Send one point and wait for its row. Returns (the row, whether the worker is still
        usable); (None, False) when the worker says the engine cannot run here."""
        limit = self.plan.settings.point_timeout_s
        inputs = self.plan.workload_named(point.workload).point_inputs(point, self.rows)
        worker.send(RunPoint(point.to_dict(), inputs))  # a worker that is gone shows as end of output below
        started = time.monotonic()
        min_avail = 1.0
        while True:
            min_avail = min(min_avail, _available_share())
            msg = worker.recv(0.1)
            if isinstance(msg, PointStarted):
                started = time.monotonic()
                min_avail = 1.0
                self.progress.start(engine, point)
            elif isinstance(msg, PointDone):
                row = self._row(engine, point, msg.status, msg.error, msg.fields, info)
                self.progress.finish(engine, point, msg.status)
                return row, True
            elif isinstance(msg, SetupFailed):
                raise _EngineSetupFailed(msg.error)
            elif isinstance(msg, Unavailable):
                self._row(engine, None, "unavailable", msg.reason, {}, info)
                self.progress.skip(1, engine, "unavailable")
                return None, False
            elif msg is _EOF or (msg is None and worker.proc.poll() is not None):
                code = worker.proc.wait(10)
                what = f"engine process died ({_exit_text(code)})"
                oom = code == -signal.SIGKILL and min_avail < LOW_MEMORY_SHARE
                if oom:
                    what += (f" while only {min_avail:.1%} of the machine's memory was available: likely the "
                             "kernel's out-of-memory killer")
                return self._fail_point(engine, point, what, log_path, info, oom=oom), False
            elif msg is None and time.monotonic() - started > limit:
                worker.kill()
                return self._fail_point(engine, point, f"timed out after {limit:g} s (point_timeout_s); the engine "
                                        "process was killed", log_path, info), False

    def _fail_point(self, engine: str, point: Point, what: str, log_path: Path, info: WorkerInfo,
                    oom: bool = False) -> dict[str, Any]:
        tail = _tail(log_path)
        reason = what + (f"; last lines of logs/{log_path.name}:\n{tail}" if tail else "")
        row = self._row(engine, point, "failed", reason, {"oom": oom}, info)
        self.progress.finish(engine, point, "failed")
        return row

    def _fail_all(self, engine: str, points: list[Point], error: str, info: WorkerInfo) -> None:
        for p in points:
            self._row(engine, p, "failed", error, {}, info)
        self.progress.skip(len(points), engine, "failed")

    def stop_children(self, grace_s: float = 30.0) -> None:
        self._end_worker(grace_s)

    def run(self) -> list[dict[str, Any]]:
        if self.plan.settings.roofline:
            self.ceilings = _ceilings(self.plan)
        try:
            for engine in self.plan.engine_order():
                self.run_engine(engine)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop the worker at once (it may be mid-point)
            self.stop_children(grace_s=2.0)
            raise
        finally:
            self.stop_children()
            self.writer.close()
            self.progress.close()
        return self.rows


def _ceilings(plan: Plan) -> Any:
    """The machine's roofline ceilings (cached); None if they cannot be measured."""
    try:
        c = cached_ceilings(plan.device, plan.dtype, model_cache_dir(plan.settings.model_cache_dir).parent
                            / "roofline.json")
    except Exception as e:  # never fail a run for it
        print(f"roofline: ceilings not measured ({type(e).__name__}: {e})")
        return None
    if not plan.settings.quiet:
        print(f"roofline: {c.mem_bw_bytes_s / 1e9:.1f} GB/s, {c.matmul_flops / 1e9:.1f} GFLOP/s "
              f"({c.method}; measured {c.measured_at})")
    return c

"""infer-bench-ab's fine-grained method (`--method blocks`, the CI gate's): both sides' engines alive
at once, each in a worker process of its own tree, pinned to the same core, taking turns at short
blocks of decode steps.

A whole `infer-bench` run per side (`--method runs`) compares runs seconds apart, each with its
own start-up and warm-up: on a shared 2-core machine whose speed changes from second to second
its rounds scatter 15-20 %. Here a block is one measured iteration of a sweep point (a prefill
and `output_len - 1` decode steps, a few tens of milliseconds); the two workers alternate block
by block (A B B A ...: the order flips every pair, so a steady drift cancels), so the noisy
second that slows one side's block slows the other side's next block alike. Each pair gives a
log-ratio candidate / baseline of the worker's CPU time for the block (cpu_ns: preemption by
other work is not in it), of the block's median decode step and of its prefill; a (point,
metric)'s estimate is a trimmed mean of its pairs' log-ratios with a Yuen interval
(harness.ab_blocks.trimmed_ci), robust to the pairs a burst of contention splits. DECISIVE says
which metrics decide and at what threshold.

The workers are the harness's own (harness.worker, harness.protocol): each side's worker runs
`harness.worker` from that side's tree (checked: it imports its `harness` from there), and gets
the job the candidate's harness plans (harness.config.build_plan), with the sweep's warm-up and
repeats set to one measured iteration per RunPoint. Warm-up is whole blocks, run and discarded
before the first pair.

Fails closed, as the runs method: an engine that could not start (no Ready, Unavailable,
SetupFailed, a worker that died), a block that is not ok or lacks a value, or a (point, metric)
with fewer than two pairs is FAILED; nothing compared is FAILED.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.core.errors import UserError
from harness.protocol import (
    PROTOCOL_VERSION, Bye, Hello, Incompatible, PointDone, PointStarted, Ready, RunPoint, SetupFailed, Unavailable,
)

# The metrics a block yields (the row fields of one sweep iteration, and the worker's CPU time for
# the block) and which way is better.
BLOCK_METRICS = {"block_cpu_s": "lower", "decode_step_latency_s": "lower", "prefill_latency_s": "lower"}
# Decisive metrics, each with the threshold it is held to as a multiple of --threshold: the verdict
# REGRESSED needs one of them beyond its threshold. The block's CPU time (the prefill and the
# decode steps, 15 of 16 steps at the gate's points) decides at the threshold: time the worker
# spent preempted by other work is not in it, so it resolves a few per cent on a loaded 2-core
# machine where the wall-clock step scatters 5-20 % (README, "How far to trust it"). The wall-clock
# decode step decides too, at 4x the threshold: a regression that waits rather than computes
# (a sleep, a lock, I/O) costs no CPU time. Prefill (one sample per block, a few milliseconds)
# is shown and fails closed when missing, but does not decide alone.
DECISIVE = {"block_cpu_s": 1.0, "decode_step_latency_s": 4.0}
TRIM = 0.2  # the share trimmed from each end of the pairs' log-ratios


# ---- statistics ---------------------------------------------------------------------------------

def trimmed_ci(logs: np.ndarray, confidence: float, trim: float = TRIM) -> tuple[float, float, float] | None:
    """(trimmed mean, low, high) of `logs` with Yuen's interval: the `trim` share cut from each
    end, the standard error from the winsorized variance, Student t with n - 2g - 1 degrees of
    freedom (g = floor(trim * n)). None for fewer than 3 values."""
    x = np.sort(np.asarray(logs, dtype=float))
    n = x.size
    if n < 3:
        return None
    g = int(math.floor(trim * n))
    h = n - 2 * g
    if h < 2:
        return None
    tm = float(x[g:n - g].mean())
    w = x.copy()
    w[:g] = x[g]
    w[n - g:] = x[n - g - 1]
    se = math.sqrt(float(w.var(ddof=1)) * (n - 1) / (h * (h - 1)))
    from scipy import stats
    half = float(stats.t.ppf(0.5 + confidence / 2, h - 1)) * se
    return tm, tm - half, tm + half


# ---- the workers --------------------------------------------------------------------------------

def worker_command(python: str, tree: Path) -> list[str]:
    """`harness.worker` of `tree`: that tree first on sys.path, and checked to be what was imported
    (another installation of infer-bench would otherwise shadow it)."""
    t = str(Path(tree).resolve())
    code = ("import sys; sys.path.insert(0, {t!r}); import harness, os; "
            "p = os.path.realpath(harness.__file__); "
            "sys.exit('infer-bench-ab: the worker imported harness from ' + p + ', not from {t}') "
            "if not p.startswith(os.path.join({t!r}, '')) else None; "
            "from harness.worker import main; main()").format(t=t)
    return [python, "-c", code]


@dataclass
class BlockWorker:
    """One side's worker process (harness.runner.WorkerProcess) and the point rows it answers."""

    name: str
    cmd: list[str]
    job: dict[str, Any]
    log_path: Path
    proc: Any = None
    failure: str | None = None
    versions: dict[str, Any] = field(default_factory=dict)

    def start(self, timeout_s: float) -> None:
        from harness.core.redact import Redactor
        from harness.runner import WorkerProcess
        try:
            self.proc = WorkerProcess(self.cmd, self.log_path, Redactor())
        except OSError as e:
            self.failure = f"the {self.name}'s worker could not start: {e}"
            return
        self.proc.send(Hello(PROTOCOL_VERSION, self.job))
        msg = self._next(timeout_s)
        if isinstance(msg, Ready) and msg.protocol == PROTOCOL_VERSION:
            self.versions = msg.versions or {}
            return
        self.failure = self._why(msg, "answering the handshake")

    def _next(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.proc.recv(min(0.5, max(deadline - time.monotonic(), 0)))
            if msg is not None or self.proc.proc.poll() is not None or time.monotonic() > deadline:
                if msg is None and self.proc.proc.poll() is not None:  # the reader may still hold its last lines
                    msg = self.proc.recv(1.0)
                return msg

    def _why(self, msg: Any, doing: str) -> str:
        if isinstance(msg, Unavailable):
            return f"the {self.name}'s engine is unavailable: {msg.reason}"
        if isinstance(msg, SetupFailed):
            return f"the {self.name}'s engine could not be set up: {msg.error}"
        if isinstance(msg, (Incompatible, Ready)):
            return (f"the {self.name}'s worker speaks protocol {msg.protocol}, this harness {PROTOCOL_VERSION}"
                    + (f": {msg.message}" if isinstance(msg, Incompatible) else ""))
        if msg is None and self.proc.proc.poll() is None:
            return f"the {self.name}'s worker did not answer in time while {doing}"
        try:  # its output ended: the exit status follows
            code = self.proc.proc.wait(5)
        except Exception:
            code = None
        tail = _tail(self.log_path)
        return (f"the {self.name}'s worker ended while {doing} (exit {code})"
                + (f"; last lines of {self.log_path}:\n{tail}" if tail else ""))

    def block(self, point: dict[str, Any], timeout_s: float) -> dict[str, Any] | str:
        """One block: the point's row fields, or why there are none."""
        if self.failure:
            return self.failure
        cpu0 = cpu_ns(self.proc.proc.pid)
        if not self.proc.send(RunPoint(point)):
            self.failure = self._why(None, "taking a block")
            return self.failure
        while True:
            msg = self._next(timeout_s)
            if isinstance(msg, PointStarted):
                continue
            if isinstance(msg, PointDone):
                if msg.status != "ok":
                    return f"{msg.status}: {(msg.error or '').strip().splitlines()[-1:] or ''}"
                cpu1 = cpu_ns(self.proc.proc.pid)
                fields = dict(msg.fields)
                if cpu0 is not None and cpu1 is not None:
                    fields["block_cpu_s"] = (cpu1 - cpu0) / 1e9
                return fields
            self.failure = self._why(msg, "taking a block")
            return self.failure

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(grace_s=10)


def cpu_ns(pid: int) -> int | None:
    """The CPU time (ns) the worker's threads have run so far: the sum over /proc/PID/task/*/schedstat
    (the engine's compute thread, the main one at num_threads=1, and any other it hands work to),
    or None where the OS does not say. Time a thread spent preempted by other work is not in it,
    unlike the wall-clock step times. A thread that ends within a block takes its time out of the
    sum; the engine's threads live as long as the worker."""
    total, seen = 0, False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
                seen = True
        except (OSError, ValueError, IndexError):
            continue  # the thread ended between the listing and the read
    return total if seen else None


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


# ---- the measurement ----------------------------------------------------------------------------

@dataclass
class Blocks:
    """What an interleaved block job measured: per point key and metric, the (baseline, candidate)
    value of every pair, or None where a side had no value (with the reason in `missing`)."""

    pairs: dict[str, dict[str, list[tuple[float | None, float | None]]]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    failure: str | None = None  # an engine that could not start, a worker that died
    seconds: float = 0.0


def _value(fields: dict[str, Any] | str, metric: str) -> float | None:
    if isinstance(fields, str):
        return None
    v = fields.get(metric)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v)
    return None


def interleave(bases: list[BlockWorker], cands: list[BlockWorker], points: list[dict[str, Any]], keys: list[str],
               pairs: int, warmup: int, timeout_s: float, say: Any = print) -> Blocks:
    """Start every worker (`bases[k]` and `cands[k]` are worker pair k: one process per side), run
    `warmup` discarded blocks per worker and point, then `pairs` pairs per point: pair i on worker
    pair i mod K, the points in turn, the order of the two sides flipping (A B, then B A, on each
    worker pair). Several worker pairs average out the few per cent by which one process of the
    same code can run faster than another (its memory layout)."""
    K = len(bases)
    out = Blocks({k: {m: [] for m in BLOCK_METRICS} for k in keys})
    t0 = time.perf_counter()
    everyone = [w for pair in zip(bases, cands) for w in pair]
    for w in everyone:
        w.start(timeout_s)
    bad = [w.failure for w in everyone if w.failure]
    if bad:
        out.failure = "; ".join(dict.fromkeys(bad))
        out.seconds = time.perf_counter() - t0
        return out
    for _ in range(warmup):
        for point in points:
            for w in everyone:
                w.block(point, timeout_s)
                if w.failure:
                    out.failure = w.failure
                    out.seconds = time.perf_counter() - t0
                    return out
    for i in range(pairs):
        k = i % K
        base, cand = bases[k], cands[k]
        for j, (point, key) in enumerate(zip(points, keys)):
            order = (base, cand) if (i // K + j) % 2 == 0 else (cand, base)
            got = {w.name: w.block(point, timeout_s) for w in order}
            for m in BLOCK_METRICS:
                a, b = _value(got[base.name], m), _value(got[cand.name], m)
                out.pairs[key][m].append((a, b))
                for side, v in ((base.name, a), (cand.name, b)):
                    if v is None:
                        why = got[side] if isinstance(got[side], str) else f"no value of {m}"
                        out.missing.append(f"{side} {key.split(':', 1)[-1]} {m} pair {i + 1}: {why}")
            dead = [w.failure for w in (base, cand) if w.failure]
            if dead:
                out.failure = "; ".join(dead)
                out.seconds = time.perf_counter() - t0
                return out
        if say and (i + 1) % max(pairs // 4, 1) == 0:
            say(f"  {i + 1}/{pairs} pairs ({time.perf_counter() - t0:.0f} s)")
    out.seconds = time.perf_counter() - t0
    return out


def job_for(plan: Any, model_path: str, engine: str, out_dir: Path) -> dict[str, Any]:
    """The worker's Hello job for `engine` (as harness.runner.Runner._job), with every workload set
    to one measured iteration per point and no warm-up: a RunPoint is one block."""
    spec = asdict(plan.model_spec(model_path, engine, str(out_dir)))
    wls = {}
    for p in plan.workloads:
        raw = asdict(p.cfg)
        raw.update(warmup=0, min_repeats=1, min_duration_s=0.0, max_repeats=1)
        wls[p.workload.name] = raw
    return {"engine": engine, "endpoint": plan.endpoints.get(engine), "options": set_options(plan.engine_options.get(engine, {})),
            "model_spec": spec, "context": plan.context(model_path), "workloads": wls}


def set_options(options: dict[str, Any]) -> dict[str, Any]:
    """The engine options a block job sends both sides: those the run sets (null is the engine's own
    default in every conf/engine/*.yaml, and each engine fills what is not sent). The baseline is an
    older tree: an option added since (the LoRA options, issue 68) at its default is no reason for the
    baseline to refuse the job ('unknown option'); one the run sets still is."""
    return {k: v for k, v in options.items() if v is not None}


def plan_side(overrides: list[str]) -> tuple[Any, str]:
    """The candidate harness's plan of `overrides` and the model directory (a local checkpoint:
    harness.ab.pin_model made it one)."""
    from harness.config import build_plan, compose_job
    from harness.core.presets import prompt_token_range, shape_from_hf_config
    plan = build_plan(compose_job(overrides))
    if plan.workload.name != "sweep" or len(plan.workloads) != 1:
        raise UserError(f"--method blocks measures the sweep workload alone (got "
                        f"{', '.join(w.workload.name for w in plan.workloads)}): use --method runs for others.")
    if len(plan.engines) != 1:
        raise UserError(f"--method blocks compares one engine (got engines={plan.engines}): name one, e.g. "
                        "engines=[reference], or use --method runs.")
    if plan.engine_envs or plan.endpoints:
        raise UserError("--method blocks runs both workers under this interpreter (--python), on this machine: "
                        "engine_options.<engine>.python / launch and endpoints need --method runs.")
    model_path = str(Path(plan.model_cfg["path"]).expanduser().resolve())
    plan.token_range = prompt_token_range(shape_from_hf_config(model_path), model_path)
    return plan, model_path


# Settings every block plan gets (beside harness.ab.FIXED): no memory sampling thread beside the
# blocks (its start and end readings only).
FIXED = ["memory_sample_hz=0"]

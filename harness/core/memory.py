"""Memory sampling: a background thread that samples at a fixed rate.

- CPU: resident memory (RSS) of this process and all its children (psutil). RSS of processes
  that share pages is summed, so shared pages count once per process.
- NVIDIA GPU: device used memory and the memory of this process tree on the device
  (`nvmlDeviceGetComputeRunningProcesses`) through pynvml; plus the torch allocator's peak
  where the engine runs in this process. If NVML is missing or fails, the sampler falls back
  to the CPU reading and records why — it never fails a run.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from harness.core.energy import EnergyMeter, EnergyReading

log = logging.getLogger(__name__)


def process_tree_rss(proc: psutil.Process, children: list[psutil.Process] | None = None) -> int:
    """RSS of `proc` plus its children (looked up now unless a list is given)."""
    total = 0
    try:
        total += proc.memory_info().rss
        for child in proc.children(recursive=True) if children is None else children:
            try:
                total += child.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    return total


class _Tree:
    """The process's children, looked up again at most every `refresh_s` (walking /proc for
    them costs far more than reading memory). On Linux, RSS is read with one pread() of an
    already open /proc/<pid>/statm per process — about 20 µs a sample instead of ~130 µs
    through psutil, which opens the file each time."""

    def __init__(self, proc: psutil.Process, refresh_s: float = 1.0):
        self.proc, self.refresh_s = proc, refresh_s
        self._children: list[psutil.Process] = []
        self._at = -1e9
        self._fds: dict[int, int] = {}
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._proc_fs = os.path.exists(f"/proc/{proc.pid}/statm")

    def children(self) -> list[psutil.Process]:
        now = time.perf_counter()
        if now - self._at > self.refresh_s:
            try:
                self._children = self.proc.children(recursive=True)
            except psutil.NoSuchProcess:
                self._children = []
            self._at = now
            if self._proc_fs:
                self._reopen()
        return self._children

    def _reopen(self) -> None:
        want = {self.proc.pid} | {c.pid for c in self._children}
        for pid in set(self._fds) - want:
            os.close(self._fds.pop(pid))
        for pid in want - set(self._fds):
            try:
                self._fds[pid] = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
            except OSError:
                pass

    def rss(self) -> int:
        children = self.children()
        if not self._proc_fs:
            return process_tree_rss(self.proc, children)
        total = 0
        for pid, fd in list(self._fds.items()):
            try:
                total += int(os.pread(fd, 128, 0).split()[1]) * self._page
            except (OSError, IndexError, ValueError):  # the process ended
                os.close(self._fds.pop(pid))
        return total

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._at = -1e9  # reopen on the next read


class _NvmlReader:
    """Device-used memory and this process tree's memory on one NVIDIA GPU.

    The device's used memory (`nvmlDeviceGetMemoryInfo`) is read at every sample. The process list
    (`nvmlDeviceGetComputeRunningProcesses`, the costly query: on an H200 it made the sampler cost
    2.6-4.1 % of a core at 100 Hz) is read every `process_every`-th sample; in between, the process
    tree's memory follows the device's changes since the last list. The device reading bounds it."""

    def __init__(self, device_index: int, tree: _Tree, nvml: Any = None, process_every: int = 10):
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py: only where a GPU is sampled
            nvml.nvmlInit()
        self.nvml = nvml
        self.handle = nvml.nvmlDeviceGetHandleByIndex(device_index)
        self.tree = tree
        self.name = nvml.nvmlDeviceGetName(self.handle)
        self.process_every = max(1, process_every)
        self._n = 0
        self._mine = 0
        self._used_then = 0

    def read(self) -> tuple[int, int]:
        nv = self.nvml
        used = nv.nvmlDeviceGetMemoryInfo(self.handle).used
        if self._n % self.process_every == 0:
            pids = {self.tree.proc.pid} | {c.pid for c in self.tree.children()}
            self._mine = sum(p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(self.handle)
                             if p.pid in pids and p.usedGpuMemory is not None)
            self._used_then = used
        self._n += 1
        return used, max(0, self._mine + used - self._used_then)


@dataclass
class MemoryReport:
    source: str  # "psutil-rss" | "nvml"
    peak_bytes: int
    baseline_bytes: int
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)
    device_peak_used_bytes: int | None = None  # nvml: whole-device used memory
    torch_peak_allocated_bytes: int | None = None
    samples: int = 0
    sampler_cpu_s: float = 0.0  # CPU time spent by the sampler thread
    duration_s: float = 0.0
    note: str | None = None
    energy: EnergyReading | None = None

    @property
    def overhead_frac(self) -> float | None:
        """Sampler CPU time as a share of the measured wall time (of one core)."""
        return self.sampler_cpu_s / self.duration_s if self.duration_s else None

    def row_fields(self) -> dict[str, Any]:
        """The memory (and energy) fields of a row (docs/results-schema.md, "Memory")."""
        out = {"peak_memory_bytes": self.peak_bytes, "memory_source": self.source,
               "memory_baseline_bytes": self.baseline_bytes, "memory_timeline": self.timeline,
               "device_peak_memory_bytes": self.device_peak_used_bytes,
               "torch_peak_allocated_bytes": self.torch_peak_allocated_bytes, "memory_note": self.note,
               "memory_samples": self.samples, "memory_sampler_overhead_frac": self.overhead_frac}
        if self.energy is not None:
            out.update(self.energy.fields())
        return out


class MemorySampler:
    """start() ... stop() -> MemoryReport. Samples at `hz` in a daemon thread."""

    def __init__(self, hz: float = 100.0, device: str = "cpu", pid: int | None = None, energy: bool = True):
        self.energy = EnergyMeter(device) if energy else None
        self.interval = 1.0 / hz if hz > 0 else None
        self.proc = psutil.Process(pid or os.getpid())
        self.tree = _Tree(self.proc)
        self.device = device
        self.note: str | None = None
        self._nvml: _NvmlReader | None = None
        if device.startswith("cuda"):
            try:
                index = int(device.split(":")[1]) if ":" in device else 0
                self._nvml = _NvmlReader(index, self.tree)
            except Exception as e:  # NVML missing, no driver, ...
                self.note = f"NVML unavailable ({type(e).__name__}: {e}); sampled process RSS instead"
                log.warning(self.note)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _read(self) -> tuple[int, int | None]:
        if self._nvml is not None:
            try:
                used, mine = self._nvml.read()
                return mine, used
            except Exception as e:
                self.note = f"NVML read failed ({type(e).__name__}: {e}); sampled process RSS instead"
                self._nvml = None
        return self.tree.rss(), None

    def _loop(self) -> None:
        t0 = time.thread_time()
        next_at = time.perf_counter()
        while not self._stop.is_set():  # time.sleep costs far less CPU than Event.wait
            self._sample()
            next_at = max(next_at + self.interval, time.perf_counter())  # type: ignore[operator]
            time.sleep(max(0.0, next_at - time.perf_counter()))
        self._cpu_s = time.thread_time() - t0  # CPU time the sampling itself used

    def _sample(self) -> None:
        if self.energy is not None:
            self.energy.sample()  # the device's power, where its energy counter cannot be read
        value, device_used = self._read()
        self._timeline.append((time.perf_counter() - self._t0, value))
        self._peak = max(self._peak, value)
        if device_used is not None:
            self._device_peak = max(self._device_peak or 0, device_used)

    def start(self) -> "MemorySampler":
        self._timeline: list[tuple[float, int]] = []
        self._peak = 0
        self._device_peak: int | None = None
        self._cpu_s = 0.0
        self._t0 = time.perf_counter()
        self._torch_cuda = False
        if self._nvml is not None:
            try:
                import torch
                torch.cuda.reset_peak_memory_stats()
                self._torch_cuda = True
            except Exception:
                pass
        self._sample()
        self._baseline = self._peak
        if self.energy is not None:
            self.energy.start()
        self._stop.clear()
        if self.interval:
            self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self, max_points: int = 200) -> MemoryReport:
        energy = self.energy.stop() if self.energy is not None else None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        self.tree.close()
        torch_peak = None
        if self._torch_cuda:
            import torch
            torch_peak = int(torch.cuda.max_memory_allocated())
        tl = self._timeline
        if len(tl) > max_points:  # keep the peak sample when thinning the timeline
            step = len(tl) / max_points
            keep = {int(i * step) for i in range(max_points)} | {max(range(len(tl)), key=lambda i: tl[i][1])}
            tl = [tl[i] for i in sorted(keep)]
        return MemoryReport(
            source="nvml" if self._nvml is not None else "psutil-rss",
            peak_bytes=self._peak, baseline_bytes=self._baseline,
            timeline=[(round(t, 4), int(v)) for t, v in tl],
            device_peak_used_bytes=self._device_peak, torch_peak_allocated_bytes=torch_peak,
            samples=len(self._timeline), sampler_cpu_s=self._cpu_s,
            duration_s=time.perf_counter() - self._t0, note=self.note, energy=energy,
        )

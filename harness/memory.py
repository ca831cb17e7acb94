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

import psutil

log = logging.getLogger(__name__)


def process_tree_rss(proc: psutil.Process) -> int:
    total = 0
    try:
        total += proc.memory_info().rss
        for child in proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    return total


class _NvmlReader:
    """Device-used memory and this process tree's memory on one NVIDIA GPU."""

    def __init__(self, device_index: int, proc: psutil.Process):
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self.proc = proc
        self.name = pynvml.nvmlDeviceGetName(self.handle)

    def read(self) -> tuple[int, int]:
        nv = self.nvml
        used = nv.nvmlDeviceGetMemoryInfo(self.handle).used
        pids = {self.proc.pid}
        try:
            pids |= {c.pid for c in self.proc.children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        mine = 0
        for p in nv.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if p.pid in pids and p.usedGpuMemory is not None:
                mine += p.usedGpuMemory
        return used, mine


@dataclass
class MemoryReport:
    source: str  # "psutil-rss" | "nvml"
    peak_bytes: int
    baseline_bytes: int
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)
    device_peak_used_bytes: int | None = None  # nvml: whole-device used memory
    torch_peak_allocated_bytes: int | None = None
    samples: int = 0
    note: str | None = None


class MemorySampler:
    """start() ... stop() -> MemoryReport. Samples at `hz` in a daemon thread."""

    def __init__(self, hz: float = 100.0, device: str = "cpu", pid: int | None = None):
        self.interval = 1.0 / hz if hz > 0 else None
        self.proc = psutil.Process(pid or os.getpid())
        self.device = device
        self.note: str | None = None
        self._nvml: _NvmlReader | None = None
        if device.startswith("cuda"):
            try:
                index = int(device.split(":")[1]) if ":" in device else 0
                self._nvml = _NvmlReader(index, self.proc)
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
        return process_tree_rss(self.proc), None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def _sample(self) -> None:
        value, device_used = self._read()
        self._timeline.append((time.perf_counter() - self._t0, value))
        self._peak = max(self._peak, value)
        if device_used is not None:
            self._device_peak = max(self._device_peak or 0, device_used)

    def start(self) -> "MemorySampler":
        self._timeline: list[tuple[float, int]] = []
        self._peak = 0
        self._device_peak: int | None = None
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
        self._stop.clear()
        if self.interval:
            self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self, max_points: int = 200) -> MemoryReport:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
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
            samples=len(self._timeline), note=self.note,
        )

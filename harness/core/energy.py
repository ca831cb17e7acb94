"""Energy over a measured interval: the hardware's own cumulative counters, or a power trace.

- NVIDIA GPU: NVML's total energy counter of the device (`nvmlDeviceGetTotalEnergyConsumption`,
  millijoules since the driver loaded), read at the start and the end of the interval. It counts
  the whole device (other processes on the GPU too), like the device memory reading. A device
  without the counter (older than Volta, some virtual GPUs) is read as a power trace instead: the
  sampler thread reads `nvmlDeviceGetPowerUsage` (mW) as it samples memory (at most every
  `POWER_SAMPLE_S`), and the trace is integrated by the trapezoid rule (`integrate_power`). A trace
  with a gap between samples (or at either end of the interval) over `MAX_GAP_S` is refused: no
  figure, `energy_valid` false, and `energy_note` says where the gap was.
- CPU: RAPL through the kernel's powercap interface, where it is readable:
  `/sys/class/powercap/<zone>/energy_uj` of every top-level package zone (`intel-rapl:N`, also
  used for AMD packages), microjoules, wrapping at `max_energy_range_uj`. It counts the whole
  package (every process on it).
- Otherwise: no reading, and the reason (no driver, no powercap zone, not readable).

Rows get `energy_j`, `energy_source`, `energy_method` (`counter` | `power-trace`), `energy_valid`
and `energy_note`; the harness divides by the point's output tokens for `joules_per_output_token`
and `output_tokens_per_joule`. This is measured energy; energy modelled from a rated power is
harness.core.cost's, and labelled as such.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POWERCAP = Path("/sys/class/powercap")
_PACKAGE_ZONE = re.compile(r"^(intel-rapl|amd-rapl):\d+$")
MAX_GAP_S = 3.0  # a power trace with a longer gap between samples is refused (as InferenceX's)
POWER_SAMPLE_S = 0.05  # the shortest interval between two power samples (NVML updates it about every 20-100 ms)


def integrate_power(samples: list[tuple[float, float]], start_s: float | None = None, end_s: float | None = None,
                    max_gap_s: float = MAX_GAP_S) -> tuple[float | None, str | None, float | None]:
    """Joules of a power trace [(seconds, watts), ...] by the trapezoid rule: (joules, None, the
    largest gap), or (None, why it is refused, the largest gap). Refused: fewer than two samples,
    or a gap between consecutive samples - or between the interval's start (`start_s`) or end
    (`end_s`) and the nearest sample - longer than `max_gap_s` (the power in a gap is unknown)."""
    pts = sorted((float(t), float(w)) for t, w in samples)
    if len(pts) < 2:
        return None, f"{len(pts)} power sample(s): a trace needs at least 2", None
    bad = [(t, w) for t, w in pts if w < 0]
    if bad:
        return None, f"a negative power reading ({bad[0][1]:g} W at {bad[0][0]:.3f} s)", None
    edges = [(b[0] - a[0], a[0]) for a, b in zip(pts, pts[1:])]
    if start_s is not None:
        edges.append((pts[0][0] - start_s, start_s))
    if end_s is not None:
        edges.append((end_s - pts[-1][0], pts[-1][0]))
    gap, at = max(edges)
    if gap > max_gap_s:
        return None, (f"a gap of {gap:.2f} s without a power sample (from {at:.2f} s) is over the {max_gap_s:g} s "
                      "limit: the power in it is unknown, so the trace is refused"), gap
    joules = sum((w0 + w1) / 2 * (t1 - t0) for (t0, w0), (t1, w1) in zip(pts, pts[1:]))
    return joules, None, gap


@dataclass
class EnergyReading:
    joules: float | None
    source: str | None  # "nvml" | "rapl" | None
    note: str | None = None  # why there is no reading
    seconds: float = 0.0
    method: str | None = None  # "counter" | "power-trace" | None
    valid: bool | None = None  # True: a figure; False: measured but refused (a gap); None: nothing measured
    max_gap_s: float | None = None  # a power trace's largest gap between samples
    power_samples: int | None = None

    def fields(self) -> dict[str, Any]:
        out = {"energy_j": self.joules, "energy_source": self.source, "energy_note": self.note,
               "energy_method": self.method, "energy_valid": self.valid}
        if self.method == "power-trace":
            out.update(energy_max_gap_s=self.max_gap_s, energy_power_samples=self.power_samples)
        return out


class _NvmlCounter:
    def __init__(self, device_index: int, nvml: Any = None):
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py: present wherever a GPU is used
            nvml.nvmlInit()
        self.nvml = nvml
        self.handle = nvml.nvmlDeviceGetHandleByIndex(device_index)

    def read_j(self) -> float:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3

    def power_w(self) -> float:
        return self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3


class _RaplCounter:
    def __init__(self, root: Path):
        zones = sorted(p for p in root.iterdir() if _PACKAGE_ZONE.match(p.name)) if root.is_dir() else []
        if not zones:
            raise OSError(f"no RAPL package zone under {root}")
        self.zones = [(z / "energy_uj", int((z / "max_energy_range_uj").read_text())) for z in zones]
        self.read_uj()  # readable? (often root-only)

    def read_uj(self) -> list[int]:
        return [int(f.read_text()) for f, _ in self.zones]

    def joules_between(self, a: list[int], b: list[int]) -> float:
        total = 0
        for (_, wrap), x, y in zip(self.zones, a, b):
            total += y - x if y >= x else y + wrap - x  # the counter wrapped once
        return total / 1e6


class EnergyMeter:
    """start() ... [sample() ...] stop() -> EnergyReading. Never raises: a counter that cannot be
    read gives a reading of None with the reason. `sample()` (the sampler thread calls it) records
    the device's power where the energy counter cannot be read."""

    def __init__(self, device: str = "cpu", nvml: Any = None, powercap: Path = POWERCAP,
                 max_gap_s: float = MAX_GAP_S):
        self.device = device
        self.max_gap_s = max_gap_s
        self._nvml: _NvmlCounter | None = None
        self._rapl: _RaplCounter | None = None
        self.note: str | None = None
        try:
            if device.startswith("cuda"):
                self._nvml = _NvmlCounter(int(device.split(":")[1]) if ":" in device else 0, nvml)
            else:
                self._rapl = _RaplCounter(powercap)
        except Exception as e:  # no driver, no zone, permission denied ...
            what = "NVML's energy counter" if device.startswith("cuda") else "RAPL (powercap)"
            self.note = f"{what} not readable: {type(e).__name__}: {e}"
        self._start: Any = None
        self._t0 = 0.0
        self._trace: list[tuple[float, float]] | None = None  # (s since start, W): NVML without its counter
        self._last_sample = -1e9
        self._power_error: str | None = None

    @property
    def source(self) -> str | None:
        return "nvml" if self._nvml else "rapl" if self._rapl else None

    def start(self) -> "EnergyMeter":
        self._t0 = time.perf_counter()
        self._trace = None
        try:
            self._start = self._nvml.read_j() if self._nvml else self._rapl.read_uj() if self._rapl else None
        except Exception as e:
            if self._nvml is not None:  # no energy counter on this GPU: its power, sampled, instead
                self._trace, self._power_error = [], None
                self.note = f"NVML's energy counter not readable ({type(e).__name__}: {e}); power sampled instead"
                self.sample(force=True)
            else:
                self.note, self._rapl = f"energy counter read failed: {type(e).__name__}: {e}", None
        return self

    def sample(self, force: bool = False) -> None:
        """One power sample (NVML without its energy counter; nothing otherwise), at most every
        POWER_SAMPLE_S unless forced (the interval's start and end)."""
        if self._trace is None or self._nvml is None:
            return
        now = time.perf_counter()
        if not force and now - self._last_sample < POWER_SAMPLE_S:
            return
        self._last_sample = now
        try:
            self._trace.append((now - self._t0, self._nvml.power_w()))
        except Exception as e:  # a missed sample is a gap; the integration judges it
            self._power_error = f"{type(e).__name__}: {e}"

    def stop(self) -> EnergyReading:
        seconds = time.perf_counter() - self._t0
        if self._trace is not None:
            self.sample(force=True)
            return self.trace_reading(self._trace, seconds)
        try:
            if self._nvml is not None:
                return EnergyReading(self._nvml.read_j() - self._start, "nvml", None, seconds, "counter", True)
            if self._rapl is not None:
                return EnergyReading(self._rapl.joules_between(self._start, self._rapl.read_uj()), "rapl", None,
                                     seconds, "counter", True)
        except Exception as e:
            return EnergyReading(None, None, f"energy counter read failed: {type(e).__name__}: {e}", seconds)
        return EnergyReading(None, None, self.note, seconds)

    def trace_reading(self, trace: list[tuple[float, float]], seconds: float) -> EnergyReading:
        """The reading of a power trace over [0, seconds]: its integral, or refused and why."""
        joules, why, gap = integrate_power(trace, 0.0, seconds, self.max_gap_s)
        if why is not None and self._power_error:
            why += f" (a power read failed: {self._power_error})"
        note = f"{self.note + '; ' if self.note else ''}power trace refused: {why}" if why else None
        return EnergyReading(joules, "nvml", note, seconds, "power-trace", joules is not None, gap, len(trace))


def per_token_fields(energy_j: float | None, output_tokens: int | None) -> dict[str, Any]:
    """joules_per_output_token and output_tokens_per_joule (None when either is unknown)."""
    if not energy_j or not output_tokens:
        return {"joules_per_output_token": None, "output_tokens_per_joule": None}
    return {"joules_per_output_token": energy_j / output_tokens, "output_tokens_per_joule": output_tokens / energy_j}

"""Energy over a measured interval, from the hardware's own cumulative counters.

- NVIDIA GPU: NVML's total energy counter of the device (`nvmlDeviceGetTotalEnergyConsumption`,
  millijoules since the driver loaded), read at the start and the end of the interval. It counts
  the whole device (other processes on the GPU too), like the device memory reading.
- CPU: RAPL through the kernel's powercap interface, where it is readable:
  `/sys/class/powercap/<zone>/energy_uj` of every top-level package zone (`intel-rapl:N`, also
  used for AMD packages), microjoules, wrapping at `max_energy_range_uj`. It counts the whole
  package (every process on it).
- Otherwise: no reading, and the reason (no driver, no powercap zone, not readable).

Rows get `energy_j`, `energy_source` and `energy_note`; the harness divides by the point's output
tokens for `joules_per_output_token` and `output_tokens_per_joule`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POWERCAP = Path("/sys/class/powercap")
_PACKAGE_ZONE = re.compile(r"^(intel-rapl|amd-rapl):\d+$")


@dataclass
class EnergyReading:
    joules: float | None
    source: str | None  # "nvml" | "rapl" | None
    note: str | None = None  # why there is no reading
    seconds: float = 0.0

    def fields(self) -> dict[str, Any]:
        return {"energy_j": self.joules, "energy_source": self.source, "energy_note": self.note}


class _NvmlCounter:
    def __init__(self, device_index: int, nvml: Any = None):
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py: present wherever a GPU is used
            nvml.nvmlInit()
        self.nvml = nvml
        self.handle = nvml.nvmlDeviceGetHandleByIndex(device_index)

    def read_j(self) -> float:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3


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
    """start() ... stop() -> EnergyReading. Never raises: a counter that cannot be read gives a
    reading of None with the reason."""

    def __init__(self, device: str = "cpu", nvml: Any = None, powercap: Path = POWERCAP):
        self.device = device
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

    @property
    def source(self) -> str | None:
        return "nvml" if self._nvml else "rapl" if self._rapl else None

    def start(self) -> "EnergyMeter":
        self._t0 = time.perf_counter()
        try:
            self._start = self._nvml.read_j() if self._nvml else self._rapl.read_uj() if self._rapl else None
        except Exception as e:
            self.note, self._nvml, self._rapl = f"energy counter read failed: {type(e).__name__}: {e}", None, None
        return self

    def stop(self) -> EnergyReading:
        seconds = time.perf_counter() - self._t0
        try:
            if self._nvml is not None:
                return EnergyReading(self._nvml.read_j() - self._start, "nvml", None, seconds)
            if self._rapl is not None:
                return EnergyReading(self._rapl.joules_between(self._start, self._rapl.read_uj()), "rapl", None, seconds)
        except Exception as e:
            return EnergyReading(None, None, f"energy counter read failed: {type(e).__name__}: {e}", seconds)
        return EnergyReading(None, None, self.note, seconds)


def per_token_fields(energy_j: float | None, output_tokens: int | None) -> dict[str, Any]:
    """joules_per_output_token and output_tokens_per_joule (None when either is unknown)."""
    if not energy_j or not output_tokens:
        return {"joules_per_output_token": None, "output_tokens_per_joule": None}
    return {"joules_per_output_token": energy_j / output_tokens, "output_tokens_per_joule": output_tokens / energy_j}

"""Energy counters: NVML's device counter (a fake NVML, named as such: there is no GPU here) and
RAPL through powercap (a fake sysfs tree), including a counter that wraps, and the reasons given
when nothing can be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.core.energy import EnergyMeter, per_token_fields


class FakeNVML:
    """Stands in for pynvml: a device whose total-energy counter (mJ) advances by `step` per read."""

    def __init__(self, start_mj: int = 1_000_000, step_mj: int = 2_500):
        self.mj, self.step = start_mj, step_mj

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802 - pynvml's names
        return f"gpu{i}"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):  # noqa: N802
        self.mj += self.step
        return self.mj


def powercap(tmp_path: Path, zones: dict[str, tuple[int, int]]) -> Path:
    for name, (uj, wrap) in zones.items():
        z = tmp_path / name
        z.mkdir()
        (z / "energy_uj").write_text(str(uj))
        (z / "max_energy_range_uj").write_text(str(wrap))
    (tmp_path / "intel-rapl:0:0").mkdir()  # a sub-zone (core): not counted on top of its package
    return tmp_path


def test_nvml_counter_difference_in_joules():
    m = EnergyMeter("cuda:0", nvml=FakeNVML(step_mj=2_500)).start()
    r = m.stop()
    assert r.source == "nvml" and r.joules == pytest.approx(2.5) and r.note is None


def test_rapl_sums_packages_and_handles_a_wrap(tmp_path):
    root = powercap(tmp_path, {"intel-rapl:0": (999_000_000, 1_000_000_000), "intel-rapl:1": (5_000_000, 1_000_000_000)})
    m = EnergyMeter("cpu", powercap=root).start()
    (root / "intel-rapl:0" / "energy_uj").write_text("1000000")   # wrapped: +2,000,000 uJ
    (root / "intel-rapl:1" / "energy_uj").write_text("8000000")   # +3,000,000 uJ
    r = m.stop()
    assert r.source == "rapl" and r.joules == pytest.approx(5.0)


def test_no_counter_gives_null_with_the_reason(tmp_path):
    r = EnergyMeter("cpu", powercap=tmp_path / "nothing").start().stop()
    assert r.joules is None and r.source is None and "RAPL" in r.note and "no RAPL package zone" in r.note
    assert per_token_fields(None, 100) == {"joules_per_output_token": None, "output_tokens_per_joule": None}
    assert per_token_fields(2.0, 100) == {"joules_per_output_token": 0.02, "output_tokens_per_joule": 50.0}


def test_nvml_that_fails_to_read_gives_the_reason():
    class BrokenNVML(FakeNVML):
        def nvmlDeviceGetTotalEnergyConsumption(self, handle):  # noqa: N802
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
    r = EnergyMeter("cuda:0", nvml=BrokenNVML()).start().stop()
    assert r.joules is None and "NVML_ERROR_NOT_SUPPORTED" in r.note

"""harness.core.roofline.measure: a measurement that does not answer in time is ended, not left running
beside the benchmark (it once kept a core busy for the rest of a run on an AVX2 CPU, where torch's bf16
product is a slow generic loop)."""
import time

import psutil
import pytest

from harness.core import roofline


def _spawned_children() -> list[psutil.Process]:
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(c.cmdline()):
                out.append(c)
        except psutil.Error:
            pass
    return out


def test_a_measurement_past_its_time_raises_and_leaves_no_process():
    before = {c.pid for c in _spawned_children()}
    with pytest.raises(TimeoutError, match="float32 ceilings took more than"):
        roofline.measure("cpu", "float32", timeout_s=0.05)
    time.sleep(0.2)
    left = [c for c in _spawned_children() if c.pid not in before and c.is_running()
            and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"measurement process left running: {[c.pid for c in left]}"

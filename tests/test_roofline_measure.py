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


def test_the_cpu_product_is_sized_to_its_speed():
    """_cpu_matmul_size halves n until one product should take at most the budget (n^3 from the
    first size): a slow dtype is measured on a smaller product instead of past the time limit."""
    fast = lambda n: 1e-4 * (n / 256) ** 3  # noqa: E731  float32-like: 2048 takes 0.05 s
    slow = lambda n: 0.025 * (n / 256) ** 3  # noqa: E731  torch's bf16 product on an AVX2-only CPU
    assert roofline._cpu_matmul_size(fast, 2048) == 2048
    assert roofline._cpu_matmul_size(slow, 2048) == 512  # 0.2 s; 1024 would take 1.6 s
    assert roofline._cpu_matmul_size(lambda n: 10.0, 2048) == 256  # never below the first size


def test_half_precision_ceilings_on_this_cpu_finish_and_are_at_least_float32s_rate():
    """bf16 ceilings on a CPU: measured within a minute (on an AVX2-only CPU torch's bf16 product
    is a ~1 GFLOP/s loop and the n=2048 product ran past the 300 s limit: no roofline at all), and
    where float32's product is faster (an engine can widen bf16 to it), the ceiling is float32's
    and the method says so, with both rates. (One measurement: two would differ with the load.)"""
    import re

    bf16 = roofline.measure("cpu", "bfloat16", timeout_s=60)
    assert bf16.mem_bw_bytes_s > 0 and bf16.matmul_flops > 0 and "bfloat16 matmul n=" in bf16.method
    m = re.search(r"\(([\d.]+) GFLOP/s\), below float32's n=2048 \(([\d.]+) GFLOP/s\)", bf16.method)
    if m:  # a CPU without fast bf16 arithmetic
        half, single = float(m.group(1)), float(m.group(2))
        assert half < single and bf16.matmul_flops == pytest.approx(single * 1e9, abs=0.051e9)  # printed to 0.1

"""The decode roofline: the binding bound of a step is the larger of its bytes over the bandwidth and
its FLOPs over the matrix peak (harness.core.roofline.annotate), checked against values computed by
hand from the architectures (not from the functions under test) for a dense model with as many KV
heads as query heads (llama-2-7b) and a grouped-query one (the `small` preset, 12 heads on 4)."""

from __future__ import annotations

import pytest

from harness.core.presets import load_preset
from harness.core.roofline import Ceilings, annotate

BW, PEAK = 26.3e9, 2.078e12  # an Intel Xeon with AMX, 2 cores, bf16 (the run)


def row(batch: int, step_s: float) -> dict:
    return {"batch_size": batch, "prompt_len": 512, "output_len": 64, "dtype": "bfloat16",
            "decode_step_latency_s": step_s}


def by_hand(layers, hidden, heads, kv_heads, head_dim, inter, vocab, batch, context=512 + 64 / 2):
    """(bytes, FLOPs) of a decode step of an untied LLaMA, bf16, written out from its matrices."""
    per_layer = (hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
                 + 3 * hidden * inter + 2 * hidden)
    table = vocab * hidden
    body = layers * per_layer + hidden  # the layers and the final norm
    weights = (body + table + batch * hidden) * 2  # the LM head whole, the input table's looked-up rows
    kv = 2 * layers * kv_heads * head_dim * 2 * context * batch
    flops = 2 * (body + table) * batch + layers * 2 * heads * (2 * head_dim) * context * batch
    return weights + kv, flops


@pytest.mark.parametrize("preset,shape", [
    ("llama-2-7b", (32, 4096, 32, 32, 128, 11008, 32000)),  # dense: 32 KV heads for 32 query heads
    ("small", (12, 768, 12, 4, 64, 2048, 32000)),  # grouped queries: 4 KV heads for 12
])
@pytest.mark.parametrize("batch", [1, 16])
def test_decode_roofline_binds_on_memory_at_small_batches(preset, shape, batch):
    by, flops = by_hand(*shape, batch)
    step = 2 * by / BW  # a step at half the bandwidth bound
    out = annotate(row(batch, step), load_preset(preset), Ceilings("cpu", "cpu", "bfloat16", 2, BW, PEAK, "now"))
    assert out["decode_bytes_per_step"] == pytest.approx(by, rel=1e-12)
    assert out["decode_flops_per_step"] == pytest.approx(flops, rel=1e-12)
    assert out["decode_roofline_bound"] == "memory"
    assert out["decode_roofline_s"] == pytest.approx(by / BW)
    assert out["decode_roofline_fraction"] == pytest.approx(0.5) == pytest.approx(out["decode_bw_fraction"])


@pytest.mark.parametrize("preset,shape", [
    ("llama-2-7b", (32, 4096, 32, 32, 128, 11008, 32000)),
    ("small", (12, 768, 12, 4, 64, 2048, 32000)),
])
def test_decode_roofline_binds_on_arithmetic_without_a_fast_matrix_unit(preset, shape):
    """At batch 32 on a CPU multiplying bf16 at float32's ~173 GFLOP/s (an AVX2-only AMD EPYC, 2 cores)
    the step's arithmetic takes longer than its bytes: the roofline is the compute time, and the
    fraction of it exceeds the bandwidth fraction (which understates how close the step is)."""
    peak = 173e9
    by, flops = by_hand(*shape, 32)
    assert flops / peak > by / BW  # by hand: arithmetic binds here
    step = 1.25 * flops / peak
    out = annotate(row(32, step), load_preset(preset), Ceilings("cpu", "cpu", "bfloat16", 2, BW, peak, "now"))
    assert out["decode_roofline_bound"] == "compute"
    assert out["decode_roofline_s"] == pytest.approx(flops / peak)
    assert out["decode_roofline_fraction"] == pytest.approx(0.8)
    assert out["decode_bw_fraction"] == pytest.approx(by / BW / step)
    assert out["decode_bw_fraction"] < 0.8


def test_no_decode_roofline_without_decode_steps():
    out = annotate({**row(1, 0.01), "output_len": 1}, load_preset("small"),
                   Ceilings("cpu", "cpu", "bfloat16", 2, BW, PEAK, "now"))
    assert not any(k.startswith("decode_") for k in out)


def test_cached_ceilings_are_measured_again_once_older_than_the_limit(tmp_path, monkeypatch):
    """A machine's bandwidth moves (a shared host): the cache keeps a measurement for MAX_AGE_S only."""
    import json
    import time

    from harness.core import roofline

    measured = []

    def measure(device, dtype):
        measured.append(time.time())
        return Ceilings(device, "x", dtype, 2, 20e9 + len(measured), PEAK, time.strftime("%Y-%m-%dT%H:%M:%S"))

    monkeypatch.setattr(roofline, "measure", measure)
    cache = tmp_path / "roofline.json"
    first = roofline.cached_ceilings("cpu", "bfloat16", cache)
    again = roofline.cached_ceilings("cpu", "bfloat16", cache)
    assert len(measured) == 1 and again == first  # fresh: from the cache
    data = json.loads(cache.read_text())
    (key,) = data
    data[key]["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - roofline.MAX_AGE_S - 60))
    cache.write_text(json.dumps(data))
    later = roofline.cached_ceilings("cpu", "bfloat16", cache)
    assert len(measured) == 2 and later.mem_bw_bytes_s != first.mem_bw_bytes_s
    assert json.loads(cache.read_text())[key]["mem_bw_bytes_s"] == later.mem_bw_bytes_s  # the new one is kept
    data[key]["measured_at"] = "yesterday"  # unreadable: measured again
    cache.write_text(json.dumps(data))
    roofline.cached_ceilings("cpu", "bfloat16", cache)
    assert len(measured) == 3

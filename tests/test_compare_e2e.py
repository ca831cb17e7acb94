"""The regression check end to end on this machine: the same config run twice is unchanged; the
reference engine with a real handicap (its KV cache switched off) is regressed on the right
metrics. Normalised by the transformers adapter measured in the same runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CONFIG = ["engines=[reference,hf]", "model=local", "dtype=float32", "workload.batch_sizes=[8]",
          "workload.prompt_lens=[128]", "workload.output_len=32", "workload.min_repeats=12",
          "workload.min_duration_s=2", "engine_options.reference.num_threads=1", "engine_options.hf.num_threads=1",
          "parity=false", "roofline=false", "quiet=true"]


def bench(out, ckpt, *extra):
    r = subprocess.run([sys.executable, "-m", "harness.cli", *CONFIG, f"model.path={ckpt}", *extra,
                        f"hydra.run.dir={out}"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def compare(base, cur, verdict_file):
    r = subprocess.run([sys.executable, "-m", "harness.compare_cli", "--baseline", str(base), "--current", str(cur),
                        "--normalize-by", "hf", "--threshold", "30%", "--json", str(verdict_file)],
                       capture_output=True, text=True, timeout=120)
    return r.returncode, json.loads(verdict_file.read_text()), r.stdout


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_ckpt):
    return bench(tmp_path_factory.mktemp("a"), tiny_ckpt)


def test_same_config_twice_is_unchanged(baseline, tmp_path, tiny_ckpt):
    again = bench(tmp_path / "b", tiny_ckpt)
    code, doc, out = compare(baseline, again, tmp_path / "v.json")
    assert code == 0, out
    assert doc["verdict"] == "unchanged" and doc["counts"]["regressed"] == 0
    assert {c["engine"] for c in doc["comparisons"]} == {"reference"}  # hf is the yardstick


def test_reference_without_kv_cache_is_regressed(baseline, tmp_path, tiny_ckpt):
    handicapped = bench(tmp_path / "c", tiny_ckpt, "engine_options.reference.kv_cache=none")
    code, doc, out = compare(baseline, handicapped, tmp_path / "v.json")
    assert code == 1, out
    verdicts = {c["metric"]: c["verdict"] for c in doc["comparisons"]}
    assert verdicts["decode_step_latency_s"] == "regressed"
    assert verdicts["output_tok_s"] == "regressed"
    assert "REGRESSED" in out

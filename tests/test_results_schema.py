"""The results file: every row field documented, required fields present, durable writes."""

import json
import subprocess
import sys

import pytest

from harness.core.results import BASE_FIELDS, SCHEMA_VERSION, ResultsWriter, make_row, read_rows
from tests_support import documented_fields


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory, tiny_ckpt):
    out = tmp_path_factory.mktemp("run")
    cmd = [sys.executable, "-m", "harness.cli", "engines=[hf]", "model=local", f"model.path={tiny_ckpt}",
           "workload.batch_sizes=[1,2]", "workload.prompt_lens=[16]", "workload.output_len=4",
           "workload.min_repeats=2", "workload.min_duration_s=0", "quiet=true", f"hydra.run.dir={out}",
           "cost.price_per_core_hour=0.05", "cost.source=fake price of the schema test"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return out, r.stdout


def test_rows_written_and_documented(sweep_run):
    out, stdout = sweep_run
    all_rows = read_rows(out / "results.jsonl")
    rows = [r for r in all_rows if r["workload"] == "sweep"]
    assert [(r["batch_size"], r["prompt_len"]) for r in rows] == [(1, 16), (2, 16)]
    assert [r["workload"] for r in all_rows].count("parity") == 1
    doc = documented_fields()
    for r in all_rows:
        undocumented = set(r) - doc
        assert not undocumented, f"fields missing from docs/results-schema.md: {sorted(undocumented)}"
    for r in rows:
        assert set(BASE_FIELDS) <= set(r)
        assert r["schema_version"] == SCHEMA_VERSION and r["status"] == "ok" and r["error"] is None
        assert r["engine"] == "hf" and r["dtype"] == "float32" and r["device"] == "cpu"
        for f in ("prefill_latency_s", "prefill_tok_s", "decode_step_latency_s", "output_tok_s",
                  "peak_memory_bytes", "kv_cache_bytes", "e2e_latency_s"):
            assert r[f] > 0, f
        assert r["repeats"] >= 2 and len(r["prefill_latency_s_samples"]) == r["repeats"]
        assert len(r["decode_step_latency_s_samples"]) == r["repeats"] * 3
        assert r["prefill_tok_s"] == pytest.approx(r["batch_size"] * 16 / r["prefill_latency_s"])
        assert r["output_tok_s"] == pytest.approx(r["batch_size"] * 4 / r["e2e_latency_s"])
        assert r["kv_est_bytes"] == r["batch_size"] * (16 + 4 - 1) * 2 * 4 * 4 * 32 * 4
        # priced (cost.*): the cores the engine held × the price, over one iteration's tokens
        assert r["cost_units"] == len(r["cpu_affinity"]) and r["cost_price_per_hour"] == pytest.approx(0.05 * r["cost_units"])
        assert r["cost_per_mtok_output"] == pytest.approx(r["cost_price_per_hour"] / (r["output_tok_s"] * 3600 / 1e6))
        assert r["cost_price_source"] == "user: cost.price_per_core_hour (fake price of the schema test)"
        assert r["energy_cost_basis"] == "unavailable" or r["energy_cost_basis"].startswith("measured")
    env = json.loads((out / "environment.json").read_text())
    assert env["packages"]["torch"] and env["cpu"]["logical_cores"] >= 1 and "commit" in env["git"]
    assert (out / "config.resolved.yaml").exists()
    assert "hf" in stdout and "results:" in stdout  # the summary table


def test_every_base_field_documented():
    assert set(BASE_FIELDS) <= documented_fields()


def test_writer_appends_and_reader_tolerates_torn_last_line(tmp_path):
    p = tmp_path / "results.jsonl"
    with ResultsWriter(p) as w:
        w.write(make_row(engine="hf", status="ok", prefill_latency_s=float("nan")))
        w.write(make_row(engine="hf", status="failed", error="boom"))
    with open(p, "a") as f:
        f.write('{"engine": "hf", "sta')  # a run killed mid-write
    rows = read_rows(p)
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert rows[0]["prefill_latency_s"] is None  # NaN is not JSON


def test_make_row_rejects_unknown_status():
    with pytest.raises(ValueError):
        make_row(status="great")

"""FAKE results for the report's unit and browser tests: hand-made rows with the fields the
workloads write (sweep as measured today; the other workloads' planned fields). These numbers
were never measured; they exist only to exercise the report. Real-run tests use a real run.
Other report test modules import the helpers from here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from harness.core.results import BASE_FIELDS, make_row
from harness.core.bootstrap import median_ci as bootstrap_ci
from harness.core.stats import summarize

FAKE_ENV = {
    "timestamp": "2026-01-01T00:00:00+00:00", "hostname": "fake-host", "platform": "Linux-fake",
    "python": "3.11.7", "packages": {"torch": "2.13.0+cpu"}, "cuda": None,
    "cpu": {"model": "Fake CPU", "logical_cores": 2, "isa": ["avx2"]}, "memory_total_bytes": 2**34,
    "gpus": [], "git": {"commit": "0" * 40, "dirty": False}, "argv": ["infer-bench", "fake"],
}


def _samples(rng: np.random.Generator, median: float, n: int, spread: float = 0.05) -> list[float]:
    return [float(median * (1 + spread * x)) for x in rng.standard_normal(n)]


def sweep_row(engine: str, batch: int, prompt: int, output: int = 8, speed: float = 1.0,
              model: str = "tiny", seed: int = 0, **extra: Any) -> dict[str, Any]:
    """One FAKE ok sweep row, internally consistent (medians, CIs, throughputs from samples)."""
    rng = np.random.default_rng(seed + 7919 * batch + prompt)
    prefill = _samples(rng, 1e-4 * batch * prompt / speed + 2e-3, 5)
    steps = _samples(rng, (2e-3 + 1e-4 * batch) / speed, 20)
    e2e = [p + sum(steps[:output - 1]) * (1 + 0.01 * i) for i, p in enumerate(prefill)]
    p, d, e = summarize(prefill), summarize(steps), summarize(e2e)
    e_ci = bootstrap_ci(e2e)
    point = {"batch_size": batch, "prompt_len": prompt, "output_len": output}
    kv_per_tok = 4096
    tokens = batch * (prompt + output - 1)
    row = make_row(
        run_id="fake", timestamp="2026-01-01T00:00:00+00:00", engine=engine, engine_version="0.0-fake",
        model=model, model_path="/nonexistent/fake", workload="sweep", point=point,
        point_key="sweep:" + json.dumps(point, sort_keys=True, separators=(",", ":")),
        batch_size=batch, prompt_len=prompt, output_len=output, dtype="float32", device="cpu", status="ok",
        prefill_latency_s=p["p50"], prefill_latency_s_p90=p["p90"], prefill_latency_s_p99=p["p99"],
        prefill_latency_s_ci=list(bootstrap_ci(prefill)), prefill_latency_s_samples=prefill,
        prefill_tok_s=batch * prompt / p["p50"],
        decode_step_latency_s=d["p50"], decode_step_latency_s_p90=d["p90"], decode_step_latency_s_p99=d["p99"],
        decode_step_latency_s_ci=list(bootstrap_ci(steps)), decode_step_latency_s_samples=steps,
        decode_steps=len(steps), decode_tok_s=batch / d["p50"],
        e2e_latency_s=e["p50"], e2e_latency_s_ci=list(e_ci), e2e_latency_s_samples=e2e,
        output_tok_s=batch * output / e["p50"], output_tok_s_ci=[batch * output / e_ci[1], batch * output / e_ci[0]],
        peak_memory_bytes=500 * 2**20 + tokens * kv_per_tok, memory_source="psutil-rss",
        memory_timeline=[[i * 0.01, 500 * 2**20 + min(i, 50) * tokens * kv_per_tok / 50] for i in range(120)],
        kv_cache_bytes=tokens * kv_per_tok if engine != "reference" else 64 * 2**20,
        kv_used_bytes=tokens * kv_per_tok, kv_est_bytes=tokens * kv_per_tok, kv_est_bytes_per_token=kv_per_tok,
        kv_info={"kv_dtype": "fp32"}, engine_options={}, repeats=5, warmup=2,
    )
    row.update(extra)
    return row


def sweep_rows(engines: dict[str, float], batches=(1, 4), prompts=(32, 128), output: int = 8,
               **extra: Any) -> list[dict[str, Any]]:
    """FAKE sweep rows: every engine (name -> speed factor) at every batch × prompt."""
    return [sweep_row(e, b, s, output, speed, seed=i, **extra)
            for i, (e, speed) in enumerate(engines.items()) for s in prompts for b in batches]


def status_row(engine: str, status: str, error: str, **extra: Any) -> dict[str, Any]:
    row = make_row(engine=engine, status=status, error=error, workload=extra.pop("workload", "sweep"))
    row.update(extra)
    return row


def other_workload_rows(engines=("hf", "reference")) -> list[dict[str, Any]]:
    """FAKE rows with the planned fields of kv_ablation, prefix_sharing, serving, kv_memory,
    roofline and parity."""
    rows = []
    rng = np.random.default_rng(1)
    for i, e in enumerate(engines):
        for ctx in (64, 256, 1024):
            for mode in ("cache", "no_cache"):
                lat = 2e-3 * (1 if mode == "cache" else ctx / 64) * (1 + 0.2 * i)
                rows.append(make_row(engine=e, workload="kv_ablation", status="ok", model="tiny",
                                     point={"context_len": ctx, "mode": mode}, point_key=f"kv:{ctx}:{mode}",
                                     batch_size=1) | {"mode": mode, "context_len": ctx,
                                                      "decode_step_latency_s": lat,
                                                      "decode_step_latency_s_ci": [lat * 0.95, lat * 1.05]})
        for caching in (True, False):
            for plen in (0, 128, 512):
                ttft = 0.05 * (1 - (0.8 * plen / 512 if caching else 0)) + 0.01 * i
                rows.append(make_row(engine=e, workload="prefix_sharing", status="ok", model="tiny",
                                     point={"prefix_len": plen, "prefix_caching": caching},
                                     point_key=f"px:{plen}:{caching}")
                            | {"prefix_len": plen, "num_requests": 16, "prefix_caching": caching, "ttft_s": ttft,
                               "prefix_hit_rate": (plen / (plen + 64)) if caching else 0.0})
        for rate in (1.0, 4.0, 16.0):
            ttft = sorted(float(x) for x in rng.gamma(2, 0.01 * rate ** 0.5 * (1 + i), 50))
            rows.append(make_row(engine=e, workload="serving", status="ok", model="tiny",
                                 point={"request_rate": rate}, point_key=f"sv:{rate}")
                        | {"request_rate": rate, "ttft_s_samples": ttft,
                           **{f"ttft_s_{p}": float(np.percentile(ttft, q)) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
                           **{f"tpot_s_{p}": 0.002 * rate ** 0.3 * q / 50 for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
                           **{f"itl_s_{p}": 0.002 * rate ** 0.3 * q / 45 for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
                           "goodput_req_s": rate * (1 - 0.1 * i) * (0.9 if rate > 4 else 1)})
        for layout, alloc in (("paged", 320), ("contiguous", 1024)):
            rows.append(make_row(engine=e, workload="kv_memory", status="ok", model="tiny",
                                 point={"batch_size": 4, "prompt_len": 64}, point_key=f"km:{layout}")
                        | {"kv_layout": layout, "slots_allocated": alloc, "tokens_stored": 300})
        rows.append(make_row(engine=e, workload="parity", status="ok", model="tiny",
                             point={"prompts": 8}, point_key="parity:8")
                    | {"agreement": 1.0 - 0.1 * i, "first_divergence": None if i == 0 else 17})
    return rows


def write_results(directory: Path, rows: list[dict[str, Any]], env: dict[str, Any] | None = FAKE_ENV,
                  config: str | None = "fake: true\n") -> Path:
    """A FAKE run directory: results.jsonl (+ environment.json, config.resolved.yaml)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "results.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if env is not None:
        (directory / "environment.json").write_text(json.dumps(env), encoding="utf-8")
    if config is not None:
        (directory / "config.resolved.yaml").write_text(config, encoding="utf-8")
    return directory / "results.jsonl"


def test_fake_rows_have_the_base_fields() -> None:
    rows = sweep_rows({"hf": 1.0}) + other_workload_rows()
    for r in rows:
        assert set(BASE_FIELDS) <= set(r)
    r = sweep_rows({"hf": 1.0}, batches=(2,), prompts=(16,))[0]
    assert r["prefill_tok_s"] == 2 * 16 / r["prefill_latency_s"]
    assert r["prefill_latency_s_ci"][0] <= r["prefill_latency_s"] <= r["prefill_latency_s_ci"][1]

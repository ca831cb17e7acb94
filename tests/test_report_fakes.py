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


FAKE_POOL = 64 * 2**20   # the FAKE reference engine's KV pool, reserved up front


def fake_resources(engine: str, threads: int = 2, cores: tuple[int, ...] = (0, 1), device: str = "cpu") -> dict[str, Any]:
    """FAKE where-it-ran fields of a row (cpu_affinity, compute_threads, worker_*)."""
    return {"cpu_affinity": list(cores), "compute_threads": threads, "device": device,
            "worker_python": "/fake/venv/bin/python", "worker_launch": None,
            "worker_versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "engine": f"{engine}-0.0-fake"}}


def sweep_row(engine: str, batch: int, prompt: int, output: int = 8, speed: float = 1.0,
              model: str = "tiny", seed: int = 0, legacy: bool = False, **extra: Any) -> dict[str, Any]:
    """One FAKE ok sweep row, internally consistent (medians, CIs, throughputs from samples).
    The FAKE reference engine reserves a KV pool up front (kv_reserved_bytes); `legacy`: a row
    as older versions wrote it (no kv_reserved_bytes, no resource fields; the pool only in
    kv_cache_bytes and kv_info.num_blocks)."""
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
    if legacy:
        if engine == "reference":
            row["kv_info"] = {"kv_dtype": "fp32", "block_size": 16, "num_blocks": FAKE_POOL // (16 * kv_per_tok)}
    else:
        row.update(fake_resources(engine), kv_reserved_bytes=FAKE_POOL if engine == "reference" else None)
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


def structured_rows(engines=("reference", "vllm")) -> list[dict[str, Any]]:
    """FAKE rows of workload `structured`: json and choice at share 0 and 1 per engine, the second
    engine's choice row failed ("constraint not applied"), and a compile point each."""
    rows = []
    for i, e in enumerate(engines):
        for kind in ("json", "choice"):
            for share in (0.0, 1.0):
                failed = i == 1 and kind == "choice" and share == 1.0
                n = 8
                verdicts = ({"structured_conforming": 0, "structured_truncated": 0, "structured_non_conforming": n,
                             "structured_unparseable": 0} if failed else
                            {"structured_conforming": n - 2, "structured_truncated": 2 if kind == "json" else 0,
                             "structured_non_conforming": 0, "structured_unparseable": 0 if kind == "json" else 2})
                fields = ({k: 0 for k in verdicts} | {"free_conforming": 1, "free_truncated": 0,
                                                      "free_non_conforming": 3, "free_unparseable": 4}
                          if share == 0 else verdicts | {"free_conforming": 0, "free_truncated": 0,
                                                         "free_non_conforming": 0, "free_unparseable": 0})
                row = make_row(engine=e, workload="structured", status="failed" if failed else "ok", model="tiny",
                               error="constraint not applied: ..." if failed else None,
                               point={"kind": kind, "share": share}, point_key=f"st:{kind}:{share}")
                row.update(fields, kind=kind, share=share, tpot_s=0.01 * (1 + share * (0.3 + i)),
                           output_tok_s=100 / (1 + share), constrained_requests=int(share * n))
                if share:
                    row.update(tpot_ratio=1 + 0.3 + i, output_tok_s_ratio=0.5,
                               constraint_applied="no" if failed else "yes")
                rows.append(row)
        rows.append(make_row(engine=e, workload="structured", status="ok", model="tiny",
                             point={"kind": "json", "compile": True}, point_key="st:compile")
                    | {"compile": True, "compile_ttft_new_s": 0.12 + i, "compile_ttft_cached_s": 0.02,
                       "compile_cost_s": 0.1 + i})
    return rows


def reasoning_rows(engine: str = "vllm-serve") -> list[dict[str, Any]]:
    """FAKE served rows of an HTTP engine with reasoning fields: one point that answered (TTFO after
    TTFT), one where every stream was reasoning only (TTFO null)."""
    rows = []
    for rate, answered in ((1.0, True), (4.0, False)):
        row = make_row(engine=engine, workload="serving", status="ok", model="tiny", point={"request_rate": rate},
                       point_key=f"rs:{rate}")
        row.update(request_rate=rate, ttft_s=0.05, tpot_s=0.02, ttfo_s=0.13 if answered else None,
                   ttfo_s_count=8 if answered else 0, reasoning_time_s=0.08 if answered else None,
                   tpot_answer_s=0.021 if answered else None, reasoning_tokens=32 if answered else 96,
                   answer_tokens=64 if answered else 0, reasoning_token_source="usage",
                   requests_without_answer=0 if answered else 8, requests_with_reasoning=8, transport="http")
        rows.append(row)
    return rows


def conversation_rows(engines=("hf", "reference"), pools=((5461, 16), (40, 16))) -> list[dict[str, Any]]:
    """FAKE rows of workload=conversation: 4 turns, caching on/off, per pool size (blocks, block
    size); with the small pool the hit rate falls below the reusable share from turn 3 on; turns of
    two kinds (user, tool result), as an agent's trace has them."""
    rows = []
    for i, e in enumerate(engines):
        for blocks, bs in pools:
            for caching in (True, False):
                turns = []
                for k in range(1, 5):
                    reusable = 0.0 if k == 1 else 1 - 1 / k
                    hit = (reusable if blocks > 1000 or k < 3 else reusable * 0.4) if caching else 0.0
                    ttft = 0.05 * k * (1 - hit) * (1 + 0.2 * i)
                    turns.append({"turn": k, "requests": 16, "completed": 16, "prompt_tokens_mean": 72.0 * k,
                                  "reusable_share": reusable, "hit_rate": hit, "hit_minus_reusable": hit - reusable,
                                  "ttft_s": ttft})
                # an agent's turns: those answering a tool's result reuse more (a longer history, a short result)
                kinds = [{"kind": kind, "requests": n, "completed": n, "prompt_tokens_mean": prompt,
                          "growth_tokens_mean": growth, "output_tokens_mean": 30.0, "reusable_share": share,
                          "hit_rate": share if caching else 0.0, "hit_minus_reusable": 0.0 if caching else -share,
                          "ttft_s": 0.05 * (1 - (share if caching else 0.0)) * (1 + 0.2 * i), "ttft_s_p90": 0.08}
                         for kind, n, prompt, growth, share in (("user", 16, 400.0, 120.0, 0.5),
                                                                 ("tool", 48, 900.0, 180.0, 0.8))]
                rows.append(make_row(engine=e, workload="conversation", status="ok", model="tiny",
                                     point={"prefix_caching": caching, "sessions": 16},
                                     point_key=f"conv:{caching}:{blocks}")
                            | {"prefix_caching": caching, "turns": turns, "kv_blocks_total": blocks, "block_size": bs,
                               "ttft_s": 0.1, "turn_kinds": kinds})
    return rows


def conversation_tier_rows(engine: str = "reference", capacity: int = 64 << 20) -> list[dict[str, Any]]:
    """FAKE rows of workload=conversation with kv_tiers off, full and one capacity (caching on, a
    pool smaller than the histories): the pool alone falls below the reusable share from turn 3;
    the second tier supplies what the pool lost; TTFT between the full pool's and recompute's."""
    rows = []
    for mode in ("off", "full", capacity):
        turns = []
        for k in range(1, 5):
            reusable = 0.0 if k == 1 else 1 - 1 / k
            tier1 = reusable if mode == "full" or k < 3 else reusable * 0.4
            tier2 = reusable - tier1 if isinstance(mode, int) else 0.0
            hit = tier1 + tier2
            ttft = {"off": 0.05 * k * (1 - hit), "full": 0.05 * k * (1 - reusable) + 0.01}.get(
                mode, 0.05 * k * (1 - reusable) + 0.01 + 0.02 * tier2)
            turn = {"turn": k, "requests": 4, "completed": 4, "prompt_tokens_mean": 72.0 * k,
                    "reusable_share": reusable, "hit_rate": hit, "hit_minus_reusable": hit - reusable, "ttft_s": ttft}
            if isinstance(mode, int):
                full = 0.05 * k * (1 - reusable) + 0.01
                turn.update(hit_rate_tier1=tier1, hit_rate_tier2=tier2, ttft_over_full=ttft / full,
                            ttft_over_full_ci=[ttft / full * 0.97, ttft / full * 1.03])
            turns.append(turn)
        rows.append(make_row(engine=engine, workload="conversation", status="ok", model="tiny",
                             point={"prefix_caching": True, "sessions": 4, "kv_tiers": mode},
                             point_key=f"conv:tiers:{mode}")
                    | {"prefix_caching": True, "kv_tiers": mode, "turns": turns, "kv_blocks_total": 40,
                       "block_size": 16, "ttft_s": 0.1})
    return rows


def fake_load_point(load: float, speed: float = 1.0, saturate_above: float = 8.0) -> tuple[float, float, float]:
    """FAKE (median TPOT, per-user tok/s, device tok/s) at a load: per-user speed falls with the
    load, device throughput rises with it until `saturate_above`, then stays."""
    tpot = 0.002 * (1 + load / 8) / speed
    return tpot, 1 / tpot, min(load, saturate_above) / tpot * 0.9


def fake_client_fields(load: float, limited: bool, open_loop: bool = True) -> dict[str, Any]:
    """FAKE fields of the load generator at a load (an engine reached through a client): send lag,
    loop lag, client CPU, achieved rate; `limited`: it did not keep up (loop lag 13.5 ms > 5 ms,
    95 % of a core)."""
    lag = 0.009 if limited else 0.0004
    return {"send_lag_s": lag / 4, "send_lag_s_p99": lag, "send_lag_s_max": lag * 2, "loop_lag_s_p99": lag,
            "loop_lag_s_max": lag * 1.5, "client_cpu_frac": 0.95 if limited else 0.3, "client_cpu_s": 1.0,
            "client_processes": 1, "offered_rate": load if open_loop else None, "scheduled_rate": load,
            "achieved_rate": load * (0.8 if limited else 1.0), "client_limited": limited,
            "client_limited_reasons": [f"loop lag {lag * 1.5e3:.1f} ms > 5.0 ms", "a client process used 95% of a core"]
            if limited else None}


def serving_load_rows(engines: dict[str, float], mode: str = "open", loads=(1.0, 4.0, 16.0),
                      saturate_above: float = 8.0, model: str = "tiny", client_limited_at: tuple | None = None,
                      **extra: Any) -> list[dict[str, Any]]:
    """FAKE serving rows with the load fields: an open loop over request rates or a
    closed loop over concurrencies; every engine (name -> speed) at every load. Per-user speed
    falls and device throughput rises with the load; loads above `saturate_above` are saturated.
    mode "trace": a replayed trace, each load its mean rate (offered_rate) after a time scale.
    `client_limited_at`: None, an in-process engine (no client fields); else the rows carry the
    load generator's fields, client-limited at those loads."""
    rows = []
    for engine, speed in engines.items():
        for load in loads:
            tpot, per_user, device = fake_load_point(load, speed, saturate_above)
            if client_limited_at is not None:
                extra_client = fake_client_fields(load, load in client_limited_at, mode != "closed")
            else:
                extra_client = {}
            point = ({"request_rate": load} if mode == "open" else {"concurrency": load} if mode == "closed"
                     else {"trace": "fake-trace.jsonl", "trace_time_scale": 1 / load})
            if mode == "trace":
                extra_client |= {"offered_rate": load, "trace": "fake-trace.jsonl", "trace_time_scale": 1 / load,
                                 "trace_requests": 100}
            fields = {"load_mode": mode, "request_rate": load if mode == "open" else None,
                      "concurrency": int(load) if mode == "closed" else None,
                      "max_concurrency": None, "ramp_up_s": 0.0, "per_user_tok_s": per_user, "output_tok_s": device,
                      "saturated": load > saturate_above, "stopped_early": False,
                      "tpot_s": tpot, "tpot_s_p50": tpot, "tpot_s_p90": tpot * 1.2, "tpot_s_p99": tpot * 1.5,
                      "ttft_s_p50": 0.01 * load, "ttft_s_p90": 0.02 * load, "ttft_s_p99": 0.03 * load}
            rows.append(make_row(engine=engine, workload="serving", status="ok", model=model, dtype="float32",
                                 device="cpu", point=point,
                                 point_key="serving:" + json.dumps(point, sort_keys=True, separators=(",", ":")))
                        | fake_resources(engine) | fields | extra_client | extra)
    return rows


def capacity_rows(engine: str, search: str = "concurrency",
                  probes=((4, True, False), (16, False, True), (8, True, False), (12, False, False)),
                  capacity: float | None = 8, slo: dict[str, Any] | None = None, model: str = "tiny", speed: float = 1.0,
                  saturate_above: float = 8.0,
                  status: str = "ok", error: str | None = None, **extra: Any) -> list[dict[str, Any]]:
    """FAKE workload `capacity` rows of one engine: a probe row per (value, meets_slo, saturated)
    with serving fields, then the conclusion row. A probe (value, meets_slo, saturated,
    client_limited) gives every probe the load generator's fields (an engine reached through a
    client), and the conclusion the client-limited loads."""
    slo = slo if slo is not None else {"ttft_p99_s": 0.5, "tpot_p99_s": 0.05, "e2el_p99_s": None}
    with_client = any(len(p) > 3 for p in probes)
    limited = sorted(float(p[0]) for p in probes if len(p) > 3 and p[3])
    probes = [tuple(p[:3]) for p in probes]
    rows = []
    for i, (value, meets, saturated) in enumerate(probes):
        tpot, per_user, device = fake_load_point(value, speed, saturate_above)
        client = fake_client_fields(value, value in limited, search == "rate") if with_client else {}
        point = {"search": search, "value": value, "probe": i}
        rows.append(make_row(engine=engine, workload="capacity", status="ok", model=model, dtype="float32",
                             device="cpu", point=point,
                             point_key="capacity:" + json.dumps(point, sort_keys=True, separators=(",", ":")))
                    | fake_resources(engine)
                    | {"load_mode": "closed" if search == "concurrency" else "open",
                       "concurrency": value if search == "concurrency" else None,
                       "request_rate": value if search == "rate" else None,
                       "per_user_tok_s": per_user, "output_tok_s": device, "saturated": saturated,
                       "meets_slo": meets, "slo_violations": [] if meets else ["ttft_p99_s 0.71 > 0.5"]}
                    | client | extra)
    point = {"search": search, "result": True}
    value_field = "capacity_concurrency" if search == "concurrency" else "capacity_rps"
    lo = max([v for v, m, _ in probes if m], default=None)
    hi = min([v for v, m, _ in probes if not m], default=None)
    rows.append(make_row(engine=engine, workload="capacity", status=status, error=error, model=model, dtype="float32",
                         device="cpu", point=point,
                         point_key="capacity:" + json.dumps(point, sort_keys=True, separators=(",", ":")))
                | fake_resources(engine)
                | {value_field: capacity, "capacity_slo": slo, "capacity_resolution": 1,
                   "capacity_bracket": [lo, hi], "capacity_probes": [list(p) for p in probes]}
                | ({"capacity_client_limited": limited or None,
                    "capacity_note": f"the load generator did not keep up at {limited}" if limited else None}
                   if with_client else {}))
    return rows


def priced(rows: list[dict[str, Any]], price: Any, duration_s: float = 10.0,
           good_when_missed: float = 0.5) -> list[dict[str, Any]]:
    """FAKE served-token fields on `capacity_rows`' probes (the duration, prompt and output tokens
    from their fake throughput; every token good on a probe that met its SLOs, `good_when_missed`
    of them on one that missed), then costed at `price` by harness.core.cost itself, and each
    conclusion given the cost at its capacity by workloads.capacity.capacity_cost."""
    from harness.core.cost import cost_fields
    from workloads.capacity import capacity_cost
    out = []
    for r in rows:
        if "value" in r["point"]:
            tokens = int(r["output_tok_s"] * duration_s)
            good = tokens if r["meets_slo"] else int(tokens * good_when_missed)
            r = {**r, "duration_s": duration_s, "total_output_tokens": tokens, "total_input_tokens": 4 * tokens,
                 "good_output_tokens": good, "good_input_tokens": 4 * good, "measured_output_tokens": tokens,
                 "slo": {"ttft_s": 0.5, "tpot_s": 0.05, "e2el_s": None}}
            r.update(cost_fields(r, price))
        out.append(r)
    for r in out:
        if r["point"].get("result"):
            probes = [q for q in out if q["engine"] == r["engine"] and q["workload"] == r["workload"]
                      and "value" in q["point"]]
            r.update(capacity_cost(probes, r.get("capacity_concurrency", r.get("capacity_rps"))))
    return out


def http_serving_rows(engine: str = "vllm-http", server_tokens=(400, 400), client_tokens=(400, 400),
                      failed=(0, 0), tls_verify: bool = True, auth: Any = "none",
                      launch_command: str | None = "vllm serve /models/tiny --port 8000",
                      with_metrics: bool = True, **extra: Any) -> list[dict[str, Any]]:
    """FAKE serving rows of an engine reached over HTTP, one per request rate, with the
    server's identity, token counts, failures and its /metrics time series."""
    rows = []
    for i, rate in enumerate((2.0, 8.0)):
        point = {"request_rate": rate}
        metrics = {
            "vllm:kv_cache_usage_perc": [[t * 0.5, min(1.0, 0.05 * t * rate / 2)] for t in range(8)],
            "vllm:num_requests_running": [[t * 0.5, float(min(t, 4))] for t in range(8)],
            "vllm:num_requests_waiting": [[t * 0.5, float(max(0, t - 4) * (i + 1))] for t in range(8)],
            "vllm:prefix_cache_hits_total": [[t * 0.5, 0.0] for t in range(8)],
        } if with_metrics else None
        rows.append(make_row(engine=engine, workload="serving", status="ok", model="tiny", dtype="float32",
                             device="cpu", point=point,
                             point_key="serving:" + json.dumps(point, sort_keys=True, separators=(",", ":")))
                    | {"request_rate": rate, "load_mode": "open", "transport": "http", "endpoint_kind": "vllm",
                       "endpoint_url": "http://127.0.0.1:8000/v1", "server_version": "0.11.0-fake",
                       "server_model": "/models/tiny", "launch_command": launch_command, "tls_verify": tls_verify,
                       "auth": auth, "itl_chunking": "per token; the tokens of one SSE chunk share its arrival time",
                       "output_tokens_server": server_tokens[i], "output_tokens_client": client_tokens[i],
                       "token_count_mismatch": server_tokens[i] != client_tokens[i],
                       "failed_requests": failed[i],
                       "failed_request_reasons": {"HTTP 503 Service Unavailable": failed[i]} if failed[i] else {},
                       "server_metrics": metrics, "per_user_tok_s": 300.0 / (1 + i), "output_tok_s": 250.0 * (1 + i),
                       "ttft_s_p50": 0.02, "ttft_s_p90": 0.03, "ttft_s_p99": 0.05}
                    | extra)
    return rows


def parity_rows_teacher_forced(dtype: str = "float32") -> list[dict[str, Any]]:
    """FAKE parity rows: the baseline, an engine within its dtype's thresholds, one
    failed past them, one that cannot score (greedy only). Thresholds as the row states them."""
    point = {"prompt_lens": [7, 16, 33, 64], "tokens": 32, "top_k": 8}
    key = "parity:" + json.dumps(point, sort_keys=True, separators=(",", ":"))
    thresholds = ({"max_abs_err": 1e-3, "mean_kl": 1e-6, "top1_agreement": 1.0} if dtype == "float32"
                  else {"max_abs_err": 0.5, "mean_kl": 5e-3, "top1_agreement": 0.98})
    within = {k: v / 5 if k != "top1_agreement" else 1.0 for k, v in thresholds.items()}
    past = {k: v * 20 if k != "top1_agreement" else 0.8 for k, v in thresholds.items()}
    common = dict(workload="parity", model="tiny", dtype=dtype, device="cpu", point=point, point_key=key)
    tf = {"parity_baseline": "reference", "parity_thresholds": thresholds, "parity_margin_bound": 0.5,
          "parity_margin_p50": 0.06, "positions_compared": 128, "positions_expected": 128, "parity_confident_positions": 40}
    return [
        make_row(engine="reference", status="ok", **common) | {"parity_baseline": "reference", "agreement": 1.0,
                                                              "first_divergence": None,
                                                              "parity_teacher": "own greedy tokens"},
        make_row(engine="hf", status="ok", **common) | tf | {
            "agreement": 0.42, "first_divergence": 3, "parity_max_abs_err": within["max_abs_err"],
            "parity_mean_kl": within["mean_kl"], "parity_top1_agreement": within["top1_agreement"]},
        make_row(engine="vllm", status="failed", error=f"parity: mean KL {past['mean_kl']:g} > {thresholds['mean_kl']:g}",
                 **common) | tf | {
            "agreement": 0.1, "first_divergence": 0, "parity_max_abs_err": past["max_abs_err"],
            "parity_mean_kl": past["mean_kl"], "parity_top1_agreement": past["top1_agreement"]},
        make_row(engine="trtllm", status="ok", **common) | {
            "parity_baseline": "reference", "agreement": 0.9, "first_divergence": 12,
            "parity_note": "trtllm cannot score sequences (no prompt log-probabilities)"},
    ]


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

"""Cost per million tokens and per good million tokens (harness/core/cost.py), energy from a power
trace (harness/core/energy.py): known answers, the price's resolution and the bad input that exits 2.

The serving rows here come from harness.core.metrics.serving_metrics over request traces built by
hand (our own computation, no engine); the NVML object is a fake, named as such (no GPU here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.cli import check_jobs, open_mappings
from harness.core.cost import PRICE_TABLE, CostConfig, Price, check_config, cost_fields, load_table, resolve_prices
from harness.core.energy import EnergyMeter, integrate_power
from harness.core.metrics import SLO, RequestTrace, serving_metrics
from harness.core.specdecode import FAIL, PASS, UNVERIFIED, lossless_passed

S = 1_000_000_000  # ns


def trace(rid: str, arrival_s: float, ttft_s: float, n_out: int, gap_s: float = 0.01, prompt: int = 100) -> RequestTrace:
    t0 = int(arrival_s * S)
    first = t0 + int(ttft_s * S)
    return RequestTrace(rid, t0, prompt, [first + int(i * gap_s * S) for i in range(n_out)])


def served_row(traces: list[RequestTrace], slo: SLO | None = None, cpus: int = 2) -> dict:
    row = serving_metrics(traces, slo)
    row.update(cpu_affinity=list(range(cpus)), compute_threads=cpus, engine_options={},
               slo={"ttft_s": slo.ttft_s if slo else None, "tpot_s": None, "e2el_s": None},
               measured_output_tokens=row["total_output_tokens"])
    return row


def deployment(rate: float, **kw) -> Price:
    return Price(rate, "deployment", "USD", "user: cost.price_per_hour", **kw)


# ---- known answers -------------------------------------------------------------------------------
def test_1000_output_tok_s_at_2_per_hour_is_0_5556_per_million_output_tokens():
    # 10 requests of 1,000 tokens, the last token of the last at 10.0 s: 10,000 tokens over 10 s
    traces = [trace(f"r{i}", 0.0, 0.0, 1000, gap_s=10.0 / 999) for i in range(10)]
    row = served_row(traces)
    assert row["output_tok_s"] == pytest.approx(1000, rel=1e-6)
    out = cost_fields(row, deployment(2.00))
    assert round(out["cost_per_mtok_output"], 4) == 0.5556
    assert out["cost_per_good_mtok_output"] == pytest.approx(out["cost_per_mtok_output"])  # no SLO: all good
    # the same price as 2 cores at 1.00 per core-hour
    per_core = cost_fields(row, Price(1.00, "core", "USD", "user: cost.price_per_core_hour"))
    assert per_core["cost_units"] == 2 and round(per_core["cost_per_mtok_output"], 4) == 0.5556
    assert per_core["cost_price_basis"] == "2 cores × 1 USD/core-hour = 2 USD/h"
    assert out["cost_per_mtok_input"] == pytest.approx(2.0 * 10 / 3600 / 1000 * 1e6)  # 10 x 100 prompt tokens
    assert out["cost_per_mtok_total"] == pytest.approx(2.0 * 10 / 3600 / 11_000 * 1e6)


def test_half_the_requests_missing_the_slo_costs_twice_per_good_mtok():
    slo = SLO(ttft_s=0.5)
    traces = [trace("r0", 0.0, 0.1, 50), trace("r1", 0.2, 0.2, 50),   # met the SLO
              trace("r2", 0.4, 0.9, 50), trace("r3", 0.6, 1.2, 50)]   # missed it
    row = served_row(traces, slo)
    assert row["good_requests"] == 2 and row["good_output_tokens"] == 100
    out = cost_fields(row, deployment(3.0))
    assert out["cost_per_good_mtok_output"] == pytest.approx(2 * out["cost_per_mtok_output"])
    assert out["cost_per_good_mtok_total"] == pytest.approx(2 * out["cost_per_mtok_total"])
    assert out["cost_good_output_share"] == 0.5
    assert "TTFT ≤ 0.5 s" in out["cost_good_basis"]


def test_no_good_token_is_null_with_the_reason_never_zero():
    row = served_row([trace("r0", 0.0, 2.0, 10)], SLO(ttft_s=0.5))
    out = cost_fields(row, deployment(1.0))
    assert out["cost_per_good_mtok_output"] is None and "no good token" in out["cost_note"]
    assert out["cost_per_mtok_output"] > 0


def test_a_power_trace_with_a_known_integral_gives_its_joules():
    # a ramp from 100 W to 200 W over 10 s, sampled every 0.5 s: 1,500 J (exact for the trapezoid rule)
    ramp = [(t / 2, 100 + 10 * t / 2) for t in range(21)]
    joules, why, gap = integrate_power(ramp, 0.0, 10.0)
    assert joules == pytest.approx(1500.0) and why is None and gap == pytest.approx(0.5)
    # 300 W constant, uneven samples
    assert integrate_power([(0, 300), (0.3, 300), (2.9, 300), (3.0, 300)], 0, 3.0)[0] == pytest.approx(900.0)


def test_a_power_trace_with_a_gap_over_the_limit_is_refused_and_the_row_says_why():
    joules, why, gap = integrate_power([(0, 100), (1, 100), (4.5, 100), (5, 100)], 0.0, 5.0)
    assert joules is None and gap == pytest.approx(3.5) and "gap of 3.50 s" in why and "3 s limit" in why
    # a gap at an end of the interval counts too
    assert integrate_power([(0, 100), (1, 100)], 0.0, 4.5)[0] is None

    class FakeNVMLNoCounter:
        """Stands in for pynvml (no GPU here): a device without the energy counter, at 250 W."""

        def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802 - pynvml's names
            return i

        def nvmlDeviceGetTotalEnergyConsumption(self, h):  # noqa: N802
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

        def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802
            return 250_000

    meter = EnergyMeter("cuda:0", nvml=FakeNVMLNoCounter()).start()
    fine = meter.trace_reading([(t * 0.5, 250.0) for t in range(9)], 4.0)
    assert fine.joules == pytest.approx(1000.0) and fine.valid and fine.method == "power-trace"
    refused = meter.trace_reading([(0.0, 250.0), (0.5, 250.0), (4.0, 250.0)], 4.0).fields()
    assert refused["energy_j"] is None and refused["energy_valid"] is False
    assert "NVML_ERROR_NOT_SUPPORTED" in refused["energy_note"] and "gap of 3.50 s" in refused["energy_note"]
    # the row that carries it: no energy cost, and why
    row = {**served_row([trace("r0", 0.0, 0.1, 20)]), **refused}
    out = cost_fields(row, deployment(1.0, price_per_kwh=0.2))
    assert out["energy_cost"] is None and out["energy_cost_basis"] == "unavailable"
    assert "gap of 3.50 s" in out["energy_cost_note"]


def test_measured_energy_is_priced_and_modelled_energy_is_labelled_as_such():
    row = served_row([trace(f"r{i}", 0.0, 0.1, 1000, gap_s=0.0099) for i in range(4)])
    row.update(energy_j=7200.0, energy_source="rapl", energy_method="counter", energy_valid=True)
    out = cost_fields(row, deployment(1.0, price_per_kwh=0.5))
    assert out["energy_cost"] == pytest.approx(7200 / 3.6e6 * 0.5)
    assert out["energy_cost_per_mtok_output"] == pytest.approx(0.001 / 4000 * 1e6)
    assert out["energy_cost_basis"].startswith("measured (rapl")
    row.update(energy_j=None, energy_valid=None, energy_note="RAPL (powercap) not readable")
    modelled = cost_fields(row, Price(2.0, "device", "USD", "table", rated_power_w=700, rated_power_per="device",
                                      rated_power_source="datasheet", price_per_kwh=0.5))
    assert modelled["energy_cost_basis"].startswith("modelled, not measured: rated 700 W × 1 GPU")
    assert modelled["energy_modelled_j"] == pytest.approx(700 * row["duration_s"])
    unavailable = cost_fields(row, deployment(1.0))
    assert unavailable["energy_cost_basis"] == "unavailable" and unavailable["energy_modelled_j"] is None
    assert "RAPL (powercap) not readable" in unavailable["energy_cost_note"]


def test_a_sweep_row_is_costed_per_iteration():
    row = {"batch_size": 4, "prompt_len": 100, "output_len": 50, "e2e_latency_s": 0.5, "cpu_affinity": [0],
           "engine_options": {}, "output_tok_s": 400.0}
    out = cost_fields(row, deployment(3.6))
    assert out["cost_per_mtok_output"] == pytest.approx(3.6 / (400 * 3600 / 1e6))
    assert out["cost_per_good_mtok_output"] == out["cost_per_mtok_output"]


def test_rows_without_a_price_say_so_and_rows_without_tokens_get_nothing():
    out = cost_fields(served_row([trace("r0", 0, 0.1, 5)]), None)
    assert list(out) == ["cost_note"] and "cost.price_per_core_hour" in out["cost_note"]
    assert cost_fields({"workload": "parity", "agreement": 1.0}, deployment(1.0)) == {}


def test_lossless_counts_each_request_on_its_own():
    base = {"r0": [1, 2, 3], "r1": [4, 5, 6], "r2": [7, 8, 9]}
    got = {"r0": [1, 2, 3], "r1": [4, 0, 6], "r2": [7, 8, 9]}
    assert lossless_passed(base, got, FAIL) == ["r0", "r2"]
    assert lossless_passed(base, base, PASS) == ["r0", "r1", "r2"]
    assert lossless_passed(base, got, UNVERIFIED) == []  # fail closed
    assert lossless_passed(base, {"r0": [-1, -1, -1]}, FAIL) == []  # no token ids: not comparable


# ---- the price table and the run's prices --------------------------------------------------------
def test_the_shipped_table_is_complete_and_cites_every_price():
    table, problems = load_table(PRICE_TABLE)
    assert problems == [] and table["currency"] == "USD"
    for name, entry in table["devices"].items():
        for offer in entry["offers"]:
            assert offer["vendor_page"].startswith("https://"), (name, offer)
            assert offer.get("checked"), (name, offer)
            # a date and the transcription read, or said plainly that it is not verified
            assert (offer.get("read_on") and offer.get("via")) or "NOT VERIFIED" in offer["checked"], (name, offer)


def _prices(raw: dict, engines=("reference",), device="cpu", gpus=(), attached=()) -> tuple[dict, list[str]]:
    cfg, problems = check_config(raw)
    if cfg is None:
        return {}, problems
    return resolve_prices(cfg, list(engines), device, list(gpus), set(attached))


def test_prices_resolve_user_first_then_the_table():
    prices, problems = _prices({"price_per_core_hour": 0.05, "source": "our contract"})
    assert not problems and prices["reference"].rate == 0.05 and prices["reference"].unit == "core"
    assert prices["reference"].source == "user: cost.price_per_core_hour (our contract)"
    gpu, problems = _prices({"device": "auto"}, device="cuda:0", gpus=["NVIDIA H100 80GB HBM3"])
    assert not problems and gpu["reference"].rate == 3.99 and "lambda.ai" in gpu["reference"].source
    assert gpu["reference"].rated_power_w == 700
    aws, _ = _prices({"device": "h100-sxm", "offer": "aws-p5"}, device="cuda")
    assert aws["reference"].rate == 6.88 and "2026-11-09" in aws["reference"].source
    cpu, _ = _prices({"device": "aws-c7i-xlarge"})
    assert cpu["reference"].rate == pytest.approx(0.1785 / 4) and "NOT VERIFIED" in cpu["reference"].source
    per_engine, problems = _prices({"price_per_core_hour": 0.05, "engines": {"srv": {"price_per_hour": 1.2}}},
                                   engines=("reference", "srv"), attached={"srv"})
    assert not problems and per_engine["srv"].unit == "deployment" and per_engine["reference"].unit == "core"
    assert _prices({}) == ({}, [])  # no price given: no cost, no problem
    assert not CostConfig().given()


@pytest.mark.parametrize("raw,kw,expected", [
    ({"price_per_core_hour": -0.05}, {}, ["cost.price_per_core_hour=-0.05: a price must be greater than 0",
                                          "e.g. cost.price_per_core_hour=0.05"]),
    ({"price_per_device_hour": 0}, {"device": "cuda"}, ["cost.price_per_device_hour=0: a price must be greater"]),
    ({"engines": {"vllm": {"price_per_hour": -1}}}, {}, ["cost.engines.vllm.price_per_hour=-1"]),
    ({"device": "h300"}, {"device": "cuda"}, ["cost.device=h300: not in the price table", "cost.price_per_device_hour=",
                                              "cost.table=FILE"]),
    ({"device": "auto"}, {"device": "cuda", "gpus": ["NVIDIA Z9"]}, ["NVIDIA Z9) is not in the price table"]),
    ({"device": "auto"}, {}, ["cost.device=auto: a CPU run's instance cannot be told"]),
    ({"device": "h100-sxm"}, {}, ["cost.device=h100-sxm is a GPU in the price table, but this run is on cpu"]),
    ({"device": "h100-sxm", "currency": "EUR"}, {"device": "cuda"},
     ["a currency mix: cost.currency=EUR but the price table's h100-sxm", "is in USD", "cost.currency=USD"]),
    ({"price_per_core_hour": 0.05, "engines": {"hf": {"price_per_core_hour": 0.04, "currency": "EUR"}}},
     {"engines": ("reference", "hf")}, ["a currency mix (reference: USD, hf: EUR)"]),
    ({"price_per_core_hour": 0.05}, {"engines": ("reference", "srv"), "attached": {"srv"}},
     ["srv is an attached server", "cost.engines.srv.price_per_hour="]),
    ({"price_per_device_hour": 2.0}, {}, ["prices GPUs, but this run is on cpu", "cost.price_per_core_hour"]),
    ({"currency": "dollars", "price_per_core_hour": 1}, {}, ["cost.currency=dollars: give an ISO 4217"]),
    ({"device": "h100-sxm", "offer": "ebay"}, {"device": "cuda"}, ["cost.offer=ebay: h100-sxm has no such offer"]),
])
def test_bad_prices_name_the_field_and_the_fix(raw, kw, expected):
    _, problems = _prices(raw, **kw)
    text = "\n".join(problems)
    assert all(e in text for e in expected), problems


@pytest.mark.parametrize("args,expected", [
    (["cost.price_per_core_hour=-0.05"], "cost.price_per_core_hour=-0.05: a price must be greater than 0"),
    (["cost.device=h300"], "cost.device=h300: not in the price table"),
    (["engines=[reference,hf]", "cost.price_per_core_hour=0.05", "cost.engines.hf.currency=EUR",
      "cost.engines.hf.price_per_core_hour=0.04"], "a currency mix (reference: USD, hf: EUR)"),
    (["workload=tune", "workload.objective=cost", "workload.slo_ttft_p99_s=1"],
     "workload.objective=cost needs a price"),
])
def test_bad_prices_on_the_command_line(args, expected):
    full = args if args[0].startswith("engines") else ["engines=[hf]", *args]
    problems = check_jobs(open_mappings(full))  # as main() gives them
    assert any(expected in p for p in problems), problems


def test_bad_price_exits_2_naming_the_field_with_no_results(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[hf]", "cost.price_per_core_hour=0",
                        f"hydra.run.dir={out}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "cost.price_per_core_hour=0: a price must be greater than 0" in r.stderr, r.stderr
    assert not (out / "results.jsonl").exists()

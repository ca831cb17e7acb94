"""The regression check: statistics on synthetic samples with known effects, and the CLI contract.

Rows here are synthetic (hand-made results rows with drawn samples), used to test our own
comparison logic; the end-to-end check, real runs through infer-bench-ab, is in test_ab_e2e.py."""

import json

import numpy as np
import pytest

from harness.compare_cli import main, run
from harness.core.compare import compare, compare_metric, verdict
from harness.core.results import SCHEMA_VERSION

N_PAIRS = 200


def samples(rng, mean, n=10, cv=0.05):
    return list(rng.normal(mean, mean * cv, n))


def test_no_false_alarms_on_identical_distributions():
    flagged = 0
    for seed in range(N_PAIRS):
        rng = np.random.default_rng(seed)
        b = {"decode_step_latency_s_samples": samples(rng, 1.0)}
        c = {"decode_step_latency_s_samples": samples(rng, 1.0)}
        _, lo, hi, _ = compare_metric(b, c, "decode_step_latency_s", 0.95, seed=seed)
        flagged += verdict(lo, hi, "lower", 0.05) != "unchanged"
    assert flagged == 0


def test_false_positive_rate_at_stated_confidence_without_threshold():
    # with no threshold, a 95% two-sided interval excludes 1 on the bad side ~2.5% of the time
    regressed = 0
    for seed in range(N_PAIRS):
        rng = np.random.default_rng(1000 + seed)
        b = {"prefill_latency_s_samples": samples(rng, 1.0, n=30)}
        c = {"prefill_latency_s_samples": samples(rng, 1.0, n=30)}
        _, lo, hi, _ = compare_metric(b, c, "prefill_latency_s", 0.95, seed=seed)
        regressed += verdict(lo, hi, "lower", 0.0) == "regressed"
    assert regressed / N_PAIRS <= 0.06


@pytest.mark.parametrize("metric,factor,better", [
    ("decode_step_latency_s", 1.2, "lower"),  # 20% slower
    ("output_tok_s", 1.25, "higher"),  # e2e 25% longer = 20% less throughput
])
def test_twenty_percent_shift_always_flagged(metric, factor, better):
    field = "e2e_latency_s_samples" if metric == "output_tok_s" else f"{metric}_samples"
    for seed in range(N_PAIRS):
        rng = np.random.default_rng(seed)
        b = {field: samples(rng, 1.0)}
        c = {field: samples(rng, factor)}
        ratio, lo, hi, _ = compare_metric(b, c, metric, 0.95, seed=seed)
        assert verdict(lo, hi, better, 0.05) == "regressed", (seed, ratio, lo, hi)


def test_improvement_flagged_as_improved():
    rng = np.random.default_rng(3)
    b = {"ttft_s_samples": samples(rng, 1.0)}
    c = {"ttft_s_samples": samples(rng, 0.7)}
    _, lo, hi, _ = compare_metric(b, c, "ttft_s", 0.95)
    assert verdict(lo, hi, "lower", 0.05) == "improved"


def row(engine, prompt_len, mean, rng, status="ok", version=SCHEMA_VERSION, n=12):
    lat = samples(rng, mean, n)
    return {"schema_version": version, "engine": engine, "model": "tiny", "workload": "sweep",
            "point_key": f'sweep:{{"prompt_len":{prompt_len}}}', "dtype": "float32", "status": status,
            "error": None if status == "ok" else "boom",
            "prefill_latency_s": float(np.median(lat)), "prefill_latency_s_samples": lat,
            "decode_step_latency_s": float(np.median(lat)), "decode_step_latency_s_samples": lat,
            "e2e_latency_s_samples": lat, "output_tok_s": 1 / float(np.median(lat)),
            "peak_memory_bytes": 1000}


def test_normalize_by_cancels_a_machine_wide_slowdown():
    rng = np.random.default_rng(7)
    # the current machine is 2x slower for every engine: raw says regressed, normalised says unchanged
    base = [row("reference", 64, 1.0, rng), row("hf", 64, 2.0, rng)]
    cur = [row("reference", 64, 2.0, rng), row("hf", 64, 4.0, rng)]
    raw, _ = compare(base, cur, ["prefill_latency_s"], 0.05)
    assert {c.verdict for c in raw} == {"regressed"}
    norm, _ = compare(base, cur, ["prefill_latency_s"], 0.05, normalize_by="hf")
    assert [(c.engine, c.verdict) for c in norm] == [("reference", "unchanged")]
    # a real 30% slowdown of one engine still shows through the normalisation
    cur2 = [row("reference", 64, 2.6, rng), row("hf", 64, 4.0, rng)]
    norm2, _ = compare(base, cur2, ["prefill_latency_s"], 0.05, normalize_by="hf")
    assert norm2[0].verdict == "regressed" and norm2[0].ratio == pytest.approx(1.3, rel=0.08)


MACHINE = {"cpu": {"model": "Test CPU", "isa": ["avx2"], "logical_cores": 2, "affinity": 2},
           "gpus": [], "packages": {"torch": "2.13.0"}}


def write(path, rows, environment=MACHINE):
    """A results file in a run directory of its own, with the run's environment.json beside it."""
    run_dir = path.parent / path.stem
    run_dir.mkdir(exist_ok=True)
    (run_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if environment is not None:
        (run_dir / "environment.json").write_text(json.dumps(environment))
    return str(run_dir / "results.jsonl")


def test_cli_exit_codes_and_outputs(tmp_path, capsys):
    rng = np.random.default_rng(0)
    b = write(tmp_path / "b.jsonl", [row("reference", 64, 1.0, rng), row("reference", 128, 1.0, rng)])
    same = write(tmp_path / "same.jsonl", [row("reference", 64, 1.0, rng), row("reference", 256, 1.0, rng)])
    slow = write(tmp_path / "slow.jsonl", [row("reference", 64, 1.3, rng)])
    out = tmp_path / "v.json"
    assert run(["--baseline", b, "--current", same, "--json", str(out), "--allow-missing"]) == 0
    text = capsys.readouterr().out
    assert "unmatched (baseline only)" in text and "unmatched (current only)" in text and "128" in text
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "unchanged" and "bootstrap" in doc["method"] and doc["unmatched"]["baseline_only"]
    assert run(["--baseline", b, "--current", slow, "--json", str(out), "--threshold", "5%", "--allow-missing"]) == 1
    assert json.loads(out.read_text())["verdict"] == "regressed"
    assert "REGRESSED" in capsys.readouterr().out


def test_an_improvement_alone_is_improved_and_exits_0(tmp_path, capsys):
    """Every compared metric improved or unchanged, one improved: the overall verdict says
    IMPROVED (it said UNCHANGED), exit 0; a regression beside the improvement still wins."""
    rng = np.random.default_rng(1)
    b = write(tmp_path / "b.jsonl", [row("reference", 64, 1.0, rng), row("reference", 128, 1.0, rng)])
    fast = write(tmp_path / "fast.jsonl", [row("reference", 64, 0.7, rng), row("reference", 128, 1.0, rng)])
    mixed = write(tmp_path / "mixed.jsonl", [row("reference", 64, 0.7, rng), row("reference", 128, 1.3, rng)])
    out = tmp_path / "v.json"
    assert run(["--baseline", b, "--current", fast, "--json", str(out), "--threshold", "5%"]) == 0
    assert json.loads(out.read_text())["verdict"] == "improved" and "verdict: IMPROVED" in capsys.readouterr().out
    assert run(["--baseline", b, "--current", mixed, "--json", str(out), "--threshold", "5%"]) == 1
    assert json.loads(out.read_text())["verdict"] == "regressed"


def test_failed_point_is_a_regression(tmp_path):
    rng = np.random.default_rng(0)
    b = write(tmp_path / "b.jsonl", [row("reference", 64, 1.0, rng)])
    c = write(tmp_path / "c.jsonl", [row("reference", 64, 1.0, rng, status="failed")])
    assert run(["--baseline", b, "--current", c, "--json", str(tmp_path / "v.json")]) == 1


@pytest.mark.parametrize("case", ["missing", "version", "nomatch", "threshold", "normalize"])
def test_cli_unusable_input_exit_2(tmp_path, case, capsys):
    rng = np.random.default_rng(0)
    b = write(tmp_path / "b.jsonl", [row("reference", 64, 1.0, rng)])
    args = {
        "missing": ["--baseline", b, "--current", str(tmp_path / "nope.jsonl")],
        "version": ["--baseline", b, "--current",
                    write(tmp_path / "old.jsonl", [row("reference", 64, 1.0, rng, version=0)])],
        "nomatch": ["--baseline", b, "--current", write(tmp_path / "o.jsonl", [row("hf", 32, 1.0, rng)])],
        "threshold": ["--baseline", b, "--current", b, "--threshold", "lots"],
        "normalize": ["--baseline", b, "--current", b, "--normalize-by", "vllm"],
    }[case]
    with pytest.raises(SystemExit) as e:
        main(args + ["--json", str(tmp_path / "v.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("infer-bench-compare: error:") and "Traceback" not in err


def test_refuses_a_baseline_from_another_machine(tmp_path, capsys):
    rng = np.random.default_rng(0)
    other = {**MACHINE, "cpu": {**MACHINE["cpu"], "model": "Other CPU", "isa": ["amx_bf16", "avx2"]}}
    b = write(tmp_path / "b.jsonl", [row("reference", 64, 1.0, rng)], environment=other)
    c = write(tmp_path / "c.jsonl", [row("reference", 64, 1.0, rng)])
    with pytest.raises(SystemExit) as e:
        main(["--baseline", b, "--current", c, "--json", str(tmp_path / "v.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "different machines" in err and "cpu model: baseline Other CPU, current Test CPU" in err
    assert "amx_bf16" in err and "--allow-other-machine" in err and "Traceback" not in err
    # asked for: compared, and said so
    assert run(["--baseline", b, "--current", c, "--allow-other-machine", "--json", str(tmp_path / "v.json")]) == 0
    out = capsys.readouterr().out
    assert "different machines" in out
    assert json.loads((tmp_path / "v.json").read_text())["machines"] == "different machines"


def test_engine_versions_are_part_of_the_machine(tmp_path, capsys):
    rng = np.random.default_rng(0)
    b = write(tmp_path / "b.jsonl", [{**row("reference", 64, 1.0, rng), "engine_version": "0.1.0 (torch 2.13.0)"}])
    c = write(tmp_path / "c.jsonl", [{**row("reference", 64, 1.0, rng), "engine_version": "0.2.0 (torch 2.13.0)"}])
    with pytest.raises(SystemExit) as e:
        main(["--baseline", b, "--current", c, "--json", str(tmp_path / "v.json")])
    assert e.value.code == 2
    assert "engine reference: baseline 0.1.0 (torch 2.13.0), current 0.2.0 (torch 2.13.0)" in capsys.readouterr().err


def test_results_without_environment_cannot_be_checked(tmp_path, capsys):
    rng = np.random.default_rng(0)
    b = write(tmp_path / "b.jsonl", [row("reference", 64, 1.0, rng)], environment=None)
    c = write(tmp_path / "c.jsonl", [row("reference", 64, 1.0, rng)])
    with pytest.raises(SystemExit) as e:
        main(["--baseline", b, "--current", c, "--json", str(tmp_path / "v.json")])
    assert e.value.code == 2 and "no environment.json beside" in capsys.readouterr().err


def test_a_point_missing_from_the_current_run_fails_unless_allowed(tmp_path, capsys):
    # infer-bench-compare used to print the dropped point as "unmatched" and exit 0
    rng = np.random.default_rng(0)
    b = write(tmp_path / "b.jsonl", [row("reference", 64, 1.0, rng), row("reference", 128, 1.0, rng)])
    dropped = write(tmp_path / "c.jsonl", [row("reference", 64, 1.0, rng)])
    out = tmp_path / "v.json"
    assert run(["--baseline", b, "--current", dropped, "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "failed" and any("only in the baseline run" in w for w in doc["failed_because"])
    assert "FAILED" in capsys.readouterr().out
    assert run(["--baseline", b, "--current", dropped, "--json", str(out), "--allow-missing"]) == 0


def test_a_renamed_metric_fails_the_comparison(tmp_path):
    # the current rows lost decode_step_latency_s_samples (a renamed field): no-data used to pass
    rng = np.random.default_rng(0)
    b = write(tmp_path / "b.jsonl", [row("reference", 64, 1.0, rng)])
    r = row("reference", 64, 1.0, rng)
    r["decode_step_ms_samples"] = r.pop("decode_step_latency_s_samples")
    c = write(tmp_path / "c.jsonl", [r])
    out = tmp_path / "v.json"
    assert run(["--baseline", b, "--current", c, "--json", str(out)]) == 1
    (failed,) = [x for x in json.loads(out.read_text())["comparisons"] if x["verdict"] == "failed"]
    assert failed["metric"] == "decode_step_latency_s"


def test_nothing_compared_fails(tmp_path):
    # both sides matched, but neither has samples of the asked metric: nothing was compared
    rng = np.random.default_rng(0)
    b = write(tmp_path / "b.jsonl", [row("reference", 64, 1.0, rng)])
    c = write(tmp_path / "c.jsonl", [row("reference", 64, 1.0, rng)])
    out = tmp_path / "v.json"
    assert run(["--baseline", b, "--current", c, "--metric", "ttft_s", "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["counts"]["no-data"] == 1 and any("no metric was compared" in w for w in doc["failed_because"])


# ---- what each workload is compared on: its own declaration ----------------------------------

def capacity_rows(engine, lo, hi, probes=(1.0, 2.0)):
    """A capacity search's rows: probes (ok, with serving metrics) and the result row."""
    rows = [{"schema_version": SCHEMA_VERSION, "engine": engine, "model": "tiny", "workload": "capacity",
             "point_key": f'capacity:{{"probe":{i},"value":{v}}}', "dtype": "float32", "status": "ok",
             "meets_slo": v <= lo} for i, v in enumerate(probes)]
    rows.append({"schema_version": SCHEMA_VERSION, "engine": engine, "model": "tiny", "workload": "capacity",
                 "point_key": 'capacity:{"result":true,"search":"rate"}', "dtype": "float32", "status": "ok",
                 "capacity_rps": lo, "capacity_bracket": [lo, hi], "capacity_search": "rate"})
    return rows


def kv_rows(engine, bytes_per_token, waste):
    return [{"schema_version": SCHEMA_VERSION, "engine": engine, "model": "tiny", "workload": "kv_memory",
             "point_key": 'kv_memory:{"block_size":16}', "dtype": "float32", "status": "ok",
             "kv_bytes_per_token": bytes_per_token, "kv_waste_frac": waste}]


def test_workloads_declare_what_they_are_compared_on():
    import workloads
    from harness.core.compared import COMPARED_ON, METRICS
    workloads.load_all()
    assert COMPARED_ON["capacity"] and COMPARED_ON["kv_memory"] and COMPARED_ON["sweep"]
    assert all(m in METRICS for ms in COMPARED_ON.values() for m in ms)
    assert "parity" not in COMPARED_ON or not COMPARED_ON["parity"]  # a check, never compared


def test_two_capacity_runs_compare_capacity_with_its_bracket(tmp_path):
    base = write(tmp_path / "b.jsonl", capacity_rows("reference", 8.0, 9.0, probes=(4.0, 8.0, 9.0)))
    same = write(tmp_path / "s.jsonl", capacity_rows("reference", 8.0, 9.0, probes=(4.0, 8.0, 9.0)))
    # half the capacity, probed at other loads: the probes are not compared, the capacity is
    half = write(tmp_path / "h.jsonl", capacity_rows("reference", 4.0, 4.5, probes=(4.0, 4.5)))
    out = tmp_path / "v.json"
    assert run(["--baseline", base, "--current", same, "--json", str(out)]) == 0
    (cap,) = [c for c in json.loads(out.read_text())["comparisons"] if c["verdict"] != "no-data"]
    # the interval runs from current low / baseline high to current high / baseline low
    assert cap["metric"] == "capacity_rps" and cap["verdict"] == "unchanged"
    assert (cap["ci_low"], cap["ci_high"]) == pytest.approx((8 / 9, 9 / 8))
    assert run(["--baseline", base, "--current", half, "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "regressed" and doc["unmatched"] == {"baseline_only": [], "current_only": []}
    (cap,) = [c for c in doc["comparisons"] if c["verdict"] == "regressed"]
    assert cap["ratio"] == pytest.approx(0.5)


def test_overlapping_capacity_brackets_are_not_a_regression():
    # 8 of [8, 12) against 7 of [7, 9): the capacities may be equal, whatever the point values say
    comps, _ = compare(capacity_rows("reference", 8.0, 12.0)[-1:], capacity_rows("reference", 7.0, 9.0)[-1:],
                       None, 0.05)
    (cap,) = [c for c in comps if c.metric == "capacity_rps"]
    assert cap.ratio == pytest.approx(7 / 8) and cap.verdict == "unchanged"


def test_two_kv_memory_runs_compare_bytes_per_token_and_waste(tmp_path):
    base = write(tmp_path / "b.jsonl", kv_rows("reference", 4096, 0.0))
    same = write(tmp_path / "s.jsonl", kv_rows("reference", 4096, 0.0))
    bigger = write(tmp_path / "c.jsonl", kv_rows("reference", 8192, 0.25))
    out = tmp_path / "v.json"
    assert run(["--baseline", base, "--current", same, "--json", str(out)]) == 0
    verdicts = {c["metric"]: c["verdict"] for c in json.loads(out.read_text())["comparisons"]}
    assert verdicts == {"kv_bytes_per_token": "unchanged", "kv_waste_frac": "unchanged"}  # 0 waste -> 0: same
    assert run(["--baseline", base, "--current", bigger, "--json", str(out)]) == 1
    comps = {c["metric"]: c for c in json.loads(out.read_text())["comparisons"]}
    assert comps["kv_bytes_per_token"]["ratio"] == pytest.approx(2.0)
    assert comps["kv_bytes_per_token"]["verdict"] == comps["kv_waste_frac"]["verdict"] == "regressed"


def priced(rows, per_good, currency="USD", per_hour=0.1):
    """FAKE cost fields (harness.core.cost's) on a capacity search's conclusion row."""
    rows[-1].update(cost_currency=currency, cost_price_per_hour=per_hour, cost_price_source="user: fake",
                    cost_per_mtok_output=per_good / 2, cost_per_good_mtok_output=per_good)
    return rows


def test_cost_ratios_are_shown_beside_the_verdict_and_a_currency_mix_exits_2(tmp_path, capsys):
    base = write(tmp_path / "b.jsonl", priced(capacity_rows("reference", 8.0, 9.0), 2.0))
    cheaper = write(tmp_path / "c.jsonl", priced(capacity_rows("reference", 8.0, 9.0), 1.5))
    out = tmp_path / "v.json"
    assert run(["--baseline", base, "--current", cheaper, "--json", str(out)]) == 0   # informational, not gated
    text = capsys.readouterr().out
    assert "cost ratios (current / baseline" in text and "0.750" in text
    ratios = {c["metric"]: c for c in json.loads(out.read_text())["cost_ratios"]}
    assert ratios["cost_per_good_mtok_output"]["ratio"] == pytest.approx(0.75)
    assert ratios["cost_per_good_mtok_output"]["note"] is None
    repriced = write(tmp_path / "r.jsonl", priced(capacity_rows("reference", 8.0, 9.0), 3.0, per_hour=0.15))
    assert run(["--baseline", base, "--current", repriced, "--json", str(out)]) == 0
    assert "priced differently (price per hour: 0.1 -> 0.15" in capsys.readouterr().out
    euros = write(tmp_path / "e.jsonl", priced(capacity_rows("reference", 8.0, 9.0), 1.5, currency="EUR"))
    with pytest.raises(SystemExit) as e:
        main(["--baseline", base, "--current", euros, "--json", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--baseline is priced in USD and --current in EUR" in err and "--no-cost" in err
    assert run(["--baseline", base, "--current", euros, "--json", str(out), "--no-cost"]) == 0
    assert json.loads(out.read_text())["cost_ratios"] == []

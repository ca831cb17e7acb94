"""infer-bench-ab's paired statistics, on synthetic rounds with known effects (our own logic; the
real interleaved runs are in test_ab_e2e.py)."""

import json
import math

import numpy as np
import pytest

from harness.ab import overall, paired, parser, report, run_medians

KEY = ("reference", 'sweep:{"batch_size":8}', "decode_step_latency_s")
TPUT = ("reference", 'sweep:{"batch_size":8}', "output_tok_s")


def rounds_of(base: list[float], cand: list[float], key=KEY):
    return [({key: (b, 1 / b)}, {key: (c, 1 / c)}) for b, c in zip(base, cand)]


def test_a_machine_drifting_between_rounds_cancels_out():
    # the machine gets 3x slower over the job; within each round both sides see the same speed
    speed = np.linspace(1.0, 3.0, 6)
    noise = np.random.default_rng(0).normal(1.0, 0.02, (6, 2))
    res = paired(rounds_of(list(speed * noise[:, 0]), list(speed * noise[:, 1])), [KEY[2]], 0.10)
    assert res[0].verdict == "unchanged" and res[0].ratio == pytest.approx(1.0, abs=0.05)


def test_a_25_percent_slowdown_is_regressed_under_noise():
    rng = np.random.default_rng(1)
    base = rng.normal(1.0, 0.05, 6)
    cand = 1.25 * rng.normal(1.0, 0.05, 6)
    (r,) = paired(rounds_of(list(base), list(cand)), [KEY[2]], 0.10)
    assert r.verdict == "regressed" and r.ci_low > 1.10 and 1.1 < r.ratio < 1.4
    assert len(r.round_ratios) == 6


def test_throughput_ratio_is_the_inverse_of_latency():
    # latency 25% higher -> throughput ratio 0.8: regressed on a higher-is-better metric
    rounds = rounds_of([1.0, 1.0, 1.0], [1.25, 1.25, 1.25], key=TPUT)
    (r,) = paired(rounds, [TPUT[2]], 0.10)
    assert r.ratio == pytest.approx(0.8) and r.verdict == "regressed"
    assert r.baseline_median == pytest.approx(1.0) and r.candidate_median == pytest.approx(0.8)


def test_no_false_alarms_over_many_noisy_a_a_jobs():
    rng = np.random.default_rng(2)
    flagged = 0
    for _ in range(200):
        base, cand = rng.lognormal(0, 0.08, 6), rng.lognormal(0, 0.08, 6)
        flagged += paired(rounds_of(list(base), list(cand)), [KEY[2]], 0.10)[0].verdict != "unchanged"
    assert flagged == 0


def test_a_few_noisy_rounds_are_not_a_regression():
    # an A/A job on a busy 2-core machine (same commit both sides): per-round ratios 1.50, 1.20,
    # 1.04, 1.35. A bootstrap of four values gave [1.11, 1.42] and a false REGRESSED; four rounds
    # this spread cannot exclude 10 %
    ratios = [1.498, 1.204, 1.043, 1.345]
    (r,) = paired(rounds_of([1.0] * 4, ratios), [KEY[2]], 0.10)
    assert r.verdict == "unchanged" and r.ci_low < 1.10 < r.ratio < r.ci_high


def test_a_candidate_failure_is_failed_and_too_few_complete_rounds_fail_closed():
    rounds = [({KEY: (1.0, 1.0)}, {KEY: "failed"}), ({KEY: (1.0, 1.0)}, {KEY: (1.0, 1.0)})]
    assert paired(rounds, [KEY[2]], 0.1)[0].verdict == "failed"
    one = [({KEY: (1.0, 1.0)}, {KEY: (1.0, 1.0)}), ({KEY: "failed"}, {KEY: (1.0, 1.0)})]
    r = paired(one, [KEY[2]], 0.1)[0]
    assert r.verdict == "failed" and "1 complete rounds" in r.note
    assert paired(one, [KEY[2]], 0.1, allow_missing=True)[0].verdict == "no-data"


def test_a_candidate_failing_every_round_while_the_baseline_failed_once_is_failed():
    # used to be no-data (a pass): the baseline's one failure hid the candidate's failures
    rounds = [({KEY: "failed"}, {KEY: "failed"})] + [({KEY: (1.0, 1.0)}, {KEY: "failed"})] * 3
    (r,) = paired(rounds, [KEY[2]], 0.1)
    assert r.verdict == "failed" and "rounds 1, 2, 3, 4" in r.note
    assert overall([r], [])[0] == "failed"


def test_a_renamed_metric_or_a_changed_point_key_is_failed():
    # the candidate's rows lost the field (renamed) or carry another point_key: no-data used to pass
    other = (KEY[0], 'sweep:{"batch_size":8,"x":1}', KEY[2])
    rounds = [({KEY: (1.0, 1.0)}, {other: (1.0, 1.0)})] * 4
    res = paired(rounds, [KEY[2]], 0.1)
    assert {r.point: r.verdict for r in res} == {KEY[1]: "failed", other[1]: "new"}
    verdict, why = overall(res, [])
    assert verdict == "failed" and any("absent, None or <= 0" in w for w in why)


def test_an_engine_unavailable_in_the_candidate_is_failed_and_named():
    base = {KEY: (1.0, 1.0)}
    cand = {(KEY[0], None, None): "unavailable: the worker could not set up engine reference"}
    (r,) = paired([(base, cand)] * 3, [KEY[2]], 0.1)
    assert r.verdict == "failed" and "engine unavailable: the worker could not set up" in r.note


def test_nothing_compared_or_a_failing_candidate_exit_fails():
    assert overall([], [])[0] == "failed"
    ok = paired(rounds_of([1.0] * 4, [1.0] * 4), [KEY[2]], 0.1)
    assert overall(ok, []) == ("unchanged", [])
    verdict, why = overall(ok, [(2, 1, ["1 point failed (reference)"])])
    assert verdict == "failed" and "exited 1 in round 2: 1 point failed" in why[0]


def test_a_decisive_improvement_is_improved_and_exits_0(tmp_path, capsys):
    # every compared row improved: the job used to print "verdict: UNCHANGED (3 improved)"
    fast = paired(rounds_of([1.0, 1.02, 0.98, 1.01], [0.70, 0.72, 0.69, 0.71]), [KEY[2]], 0.1)
    assert [r.verdict for r in fast] == ["improved"]
    assert overall(fast, []) == ("improved", [])
    args = parser().parse_args(["--baseline-ref", "HEAD", "--rounds", "4"])
    assert report(args, fast, [], 0.1, "0" * 40, None, [], tmp_path) == 0
    assert "verdict: IMPROVED" in capsys.readouterr().out
    assert json.loads((tmp_path / "ab.json").read_text())["verdict"] == "improved"
    # an improvement never hides a regression or a failure, and an unchanged row beside it is no loss
    slow = paired(rounds_of([1.0] * 4, [1.3, 1.31, 1.29, 1.3], key=TPUT), [TPUT[2]], 0.1)
    assert overall(fast + slow, []) == ("regressed", [])
    assert report(args, fast + slow, [], 0.1, "0" * 40, None, [], tmp_path) == 1
    same = paired(rounds_of([1.0] * 4, [1.0] * 4, key=TPUT), [TPUT[2]], 0.1)
    assert overall(fast + same, []) == ("improved", [])
    assert overall(fast, [(1, 1, [])])[0] == "failed"
    assert report(args, fast, [(1, 1, [])], 0.1, "0" * 40, None, [], tmp_path) == 1
    missing = paired([({KEY: (1.0, 1.0)}, {KEY: "failed"})] * 3, [KEY[2]], 0.1)
    assert overall(fast + missing, [])[0] == "failed"


def test_run_medians_reads_the_rows(tmp_path):
    import json
    f = tmp_path / "results.jsonl"
    f.write_text(json.dumps({"engine": "reference", "point_key": "k", "status": "ok",
                             "decode_step_latency_s": 0.002, "e2e_latency_s": 0.5, "output_tok_s": 512.0}) + "\n"
                 + json.dumps({"engine": "hf", "point_key": "k", "status": "failed"}) + "\n")
    m = run_medians(f, ["decode_step_latency_s", "output_tok_s"])
    assert m[("reference", "k", "decode_step_latency_s")] == (0.002, 0.002)
    assert m[("reference", "k", "output_tok_s")] == (0.5, 512.0)
    assert m[("hf", "k", "output_tok_s")] == "failed"
    assert not math.isnan(m[("reference", "k", "output_tok_s")][0])


def test_run_medians_keeps_an_unavailable_engine_and_drops_values_that_are_not_positive(tmp_path):
    import json
    f = tmp_path / "results.jsonl"
    f.write_text(json.dumps({"engine": "reference", "point_key": None, "status": "unavailable",
                             "error": "no torch here"}) + "\n"
                 + json.dumps({"engine": "hf", "point_key": "k", "status": "ok", "decode_step_latency_s": 0.0}) + "\n")
    m = run_medians(f, ["decode_step_latency_s"])
    assert m[("reference", None, None)] == "unavailable: no torch here"
    assert ("hf", "k", "decode_step_latency_s") not in m


HF = ("hf", KEY[1], KEY[2])
REL = ("reference/hf", KEY[1], KEY[2])


def two_engine_rounds(ref_effect: float, seed: int, n: int = 8):
    """Rounds in which each whole run is slowed by its own factor (a noisy machine: 20 % spread),
    both engines alike, plus 1 % noise per value; the candidate's reference is `ref_effect` times
    slower."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        sides = []
        for effect in (1.0, ref_effect):
            run = rng.lognormal(0, 0.2)
            sides.append({KEY: (run * effect * rng.lognormal(0, 0.01),) * 2, HF: (run * rng.lognormal(0, 0.01),) * 2})
        out.append(tuple(sides))
    return out


def test_relative_to_a_control_engine_cancels_a_run_wide_slowdown():
    from harness.ab import compare
    rounds = two_engine_rounds(1.10, seed=3)
    res = {r.engine: r for r in compare(rounds, [KEY[2]], 0.05, relative_to="hf")}
    # each engine alone cannot resolve a 10 % change under 20 % run-to-run noise ...
    assert res["reference"].verdict == "unchanged" and res["reference"].ci_high / res["reference"].ci_low > 1.2
    # ... their ratio in the same run can
    rel = res["reference/hf"]
    assert rel.verdict == "regressed" and 1.05 < rel.ci_low and rel.ratio == pytest.approx(1.10, rel=0.03)
    assert "hf/hf" not in res and overall(list(res.values()), [])[0] == "regressed"
    same = {r.engine: r for r in compare(two_engine_rounds(1.0, seed=4), [KEY[2]], 0.05, relative_to="hf")}
    assert same["reference/hf"].verdict == "unchanged"
    assert 0.95 < same["reference/hf"].ci_low < same["reference/hf"].ci_high < 1.05


def test_relative_to_fails_closed_without_the_control():
    from harness.ab import compare
    rounds = two_engine_rounds(1.0, seed=5, n=4)
    rounds[2][1].pop(HF)  # the candidate's control value is missing in round 3
    rounds[2][1][("hf", None, None)] = "unavailable: no transformers here"
    res = {r.engine: r for r in compare(rounds, [KEY[2]], 0.05, relative_to="hf")}
    assert res["reference/hf"].verdict == "failed"
    assert "round 3" in res["reference/hf"].note and "the control engine hf: unavailable" in res["reference/hf"].note
    # a control that no run measured: a failed row, not a silently missing comparison
    res = compare(rounds_of([1.0] * 3, [1.0] * 3), [KEY[2]], 0.05, relative_to="vllm")
    assert res[0].verdict == "unchanged" and res[-1].verdict == "failed" and "no run measured" in res[-1].note
    assert overall(res, [])[0] == "failed"

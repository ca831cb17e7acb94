"""workload=tune: the search over an engine's options, driven the way the runner drives it, on
the fake queueing server of test_capacity (virtual time) given options that change its service
time; the space checks; the study's resume; and the command line's bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from adapters.base import Engine
from harness.core.presets import load_preset
from harness.core.schema import spec
from test_capacity import S, FakeQueueEngine
from workloads.base import Point, RunContext
from harness.core.cost import Price, cost_fields
from workloads.tune import Tune, TuneConfig, confirm_ratio, engine_space

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class FakeOptions:
    speed: int = spec(1, ge=1, le=16, tune=[1, 2, 3, 4, 6, 8], help="service time S / speed")
    color: str = spec("red", choices=("red", "blue", "green"), tune=["red", "blue", "green"],
                      help="changes nothing, except that green cannot load")


class FakeTunableEngine(FakeQueueEngine):
    """The fake queueing server with options: `speed` divides its service time (so the known best
    setting is the highest speed), `color` changes nothing, and `green` fails to load (an invalid
    combination, as a server refuses one)."""

    name = "fake-tunable"
    options_cls = FakeOptions

    def load(self, model, options):
        if options.get("color") == "green":
            raise ValueError("green is not a colour this engine can load")
        self.speed = options.get("speed", 1)
        return super().load(model, options)

    def serve(self, requests, start_ns):
        for ev in super().serve(requests, start_ns):  # S per request, rescaled to S / speed
            yield type(ev)(ev.request_id, ev.index, ev.token_id, start_ns + (ev.time_ns - start_ns) // self.speed,
                           finished=ev.finished)


@pytest.fixture
def ctx():
    shape = load_preset("tiny")
    return RunContext(shape=shape, dtype="float32", device="cpu", max_model_len=256, memory_sample_hz=0,
                      token_low=4, token_high=shape.vocab_size)


def config(**kw) -> TuneConfig:
    # the SLO allows the default (speed 1) no queueing: it serves up to 1 / S requests/s; a faster
    # setting serves at least speed / S
    base = dict(search="rate", slo_ttft_p99_s=0.6 * S, start=4, num_requests=24, arrival="constant",
                input_len=8, output_len=4, warmup_requests=1, resolution=0.1, max_probes=10, trials=12,
                confirm_rounds=2, space={"fake-tunable": {"speed": [1, 2, 3, 4, 6, 8],
                                                          "color": ["red", "blue", "green"]}})
    base.update(kw)
    return TuneConfig(**base)


def tune_run(cfg: TuneConfig, ctx: RunContext, run_dir: Path, previous: list[dict] | None = None,
             stop_after: int | None = None, engine_cls: type = None, price: Price | None = None) -> list[dict]:
    """What the runner does for one engine: planned points, follow-ups, points computed in the
    harness (their `status`/`error` fields set the row's), an engine reloaded per options, rows
    of a previous run reused (resume), each row costed at `price` (harness.core.cost); `stop_after`
    rows: the run is killed there."""
    engine_cls = engine_cls or FakeTunableEngine
    wl = Tune()
    wl.bind_run_dir(run_dir)
    assert wl.check_engines(cfg, {"fake-tunable": engine_cls}) == []
    rows = list(previous or [])
    done = {r["point_key"] for r in rows}
    queue = wl.plan(cfg)
    new = 0
    while queue:
        point = queue.pop(0)
        row = next((r for r in rows if r["point_key"] == point.key), None) if point.key in done else None
        if row is None:
            if stop_after is not None and new >= stop_after:
                return rows
            fields = wl.compute_in_harness(point, "fake-tunable", rows, cfg)
            status, error = "ok", None
            if fields is None:
                engine = engine_cls()
                try:
                    engine.load(None, {**wl.engine_overrides(point, None)})
                    fields = wl.run_point(engine, point, ctx, cfg)
                except ValueError as e:
                    fields, status, error = {}, "failed", f"load: {e}"
            else:
                status, error = fields.pop("status", "ok"), fields.pop("error", None)
            row = {"engine": "fake-tunable", "workload": wl.name, "point": point.params, "point_key": point.key,
                   "status": status, "error": error, **fields}
            if price is not None:
                row.update(cost_fields(row, price))
            rows.append(row)
            new += 1
        queue[:0] = wl.next_points(point, row, rows, cfg)
    return rows


def results(rows, role=None):
    return [r for r in rows if r["point"].get("result") and (role is None or r["point"]["role"] == role)]


def test_the_search_finds_the_known_best_setting_and_confirms_it(ctx, tmp_path):
    rows = tune_run(config(), ctx, tmp_path)
    trials = results(rows, "trial")
    assert [r["tune_trial"] for r in trials] == list(range(1, 13))  # every trial is a row, once
    conclusion = rows[-1]
    assert conclusion["point"] == {"tune": "conclusion"} and conclusion["status"] == "ok"
    assert conclusion["tune_best_options"]["speed"] == 8
    # the capacity found is at least the fastest configuration's service rate, 8 / S
    assert conclusion["tune_best_value"] >= 0.9 * 8 / S
    # the default (speed 1) serves exactly 1 / S within the SLO: the gain is 8 or more
    assert 0.9 * 1 / S <= conclusion["tune_default_value"] <= 1 / S
    assert conclusion["tune_gain"] > 6.5
    confirm = conclusion["tune_confirm"]
    assert confirm["rounds"] == 2 and confirm["verdict"] == "gain confirmed" and confirm["interval"][0] > 1
    # interleaved: default, best, default, best
    order = [(r["point"]["role"], r["point"]["round"]) for r in results(rows) if "round" in r["point"]]
    assert order == [("confirm-default", 0), ("confirm-best", 0), ("confirm-default", 1), ("confirm-best", 1)]
    # speed decides; colour only decides whether it loads
    assert max(conclusion["tune_importance"], key=conclusion["tune_importance"].get) == "speed"


def test_a_trial_that_cannot_load_is_a_failed_row_and_the_tuning_goes_on(ctx, tmp_path):
    rows = tune_run(config(), ctx, tmp_path)
    failed = [r for r in results(rows, "trial") if r["status"] == "failed"]
    assert failed and all(r["tune_options"]["color"] == "green" for r in failed)
    assert all("green is not a colour" in r["error"] for r in failed)
    assert Tune().expected_failure(failed[0])  # a pruned trial does not fail the run
    assert rows[-1]["status"] == "ok" and rows[-1]["tune_trials_failed"] == len(failed)


def test_a_space_that_admits_nothing_fails_the_conclusion(ctx, tmp_path):
    cfg = config(space={"fake-tunable": {"color": ["green"]}}, trials=3)
    rows = tune_run(cfg, ctx, tmp_path)
    conclusion = rows[-1]
    assert conclusion["status"] == "failed" and "admitted nothing" in conclusion["error"]
    assert not Tune().expected_failure(conclusion)


def test_resume_after_a_kill_finishes_with_the_same_trials_and_no_duplicates(ctx, tmp_path):
    first = tune_run(config(), ctx, tmp_path, stop_after=40)  # killed in the middle of the trials
    asked = len(results(first, "trial"))
    assert 0 < asked < 12
    rows = tune_run(config(), ctx, tmp_path, previous=first)
    keys = [r["point_key"] for r in rows]
    assert len(keys) == len(set(keys))
    assert [r["tune_trial"] for r in results(rows, "trial")] == list(range(1, 13))
    assert rows[:len(first)] == first  # nothing measured before is measured again or lost
    assert rows[-1]["tune_best_options"]["speed"] == 8


def test_a_configuration_proposed_again_is_not_measured_twice(ctx, tmp_path):
    cfg = config(space={"fake-tunable": {"speed": [1, 2]}}, trials=5, confirm_rounds=0)
    rows = tune_run(cfg, ctx, tmp_path)
    trials = results(rows, "trial")
    assert len(trials) == 5
    repeats = [r for r in trials if r.get("tune_repeat_of")]
    assert repeats  # two settings, five trials
    for r in repeats:
        earlier = next(t for t in trials if t["tune_trial"] == r["tune_repeat_of"])
        assert r["tune_options"] == earlier["tune_options"] and r["tune_value"] == earlier["tune_value"]
        assert r["tune_probes"] == 0
    assert rows[-1]["tune_confirm"]["verdict"] == "not measured"


def test_space_problems_name_the_field():
    def problems(given):
        return " | ".join(engine_space("fake-tunable", FakeTunableEngine, given)[1])
    assert "workload.space.fake-tunable.size: fake-tunable has no option 'size'" in problems({"size": [1]})
    assert "workload.space.fake-tunable.speed=0: must be at least 1" in problems({"speed": [0, 1]})
    assert "workload.space.fake-tunable.speed=32: must be at most 16" in problems({"speed": {"low": 1, "high": 32}})
    assert "workload.space.fake-tunable.color=purple: not one of" in problems({"color": ["purple"]})
    assert "workload.space.fake-tunable.speed=[]: the list of choices is empty" in problems({"speed": []})
    assert "low=4 is above high=2" in problems({"speed": {"low": 4, "high": 2}})
    assert "workload.space.fake-tunable: the space is empty" in problems({})
    assert problems(None) == ""  # the default space, from the schema's tune= marks

    class NoSpace(Engine):
        name = "plain"
        options_cls = None
    assert "takes no options the harness can set per trial" in " ".join(engine_space("plain", NoSpace, None)[1])


@dataclass
class FakeGpuOptions:
    speed: int = spec(2, choices=(2, 4), tune=[2, 4], help="service time S / speed")
    tensor_parallel_size: int = spec(1, choices=(1, 4), tune=[1, 4], help="GPUs held: 4 of them serve 1.5x faster")


class FakeTensorParallelEngine(FakeTunableEngine):
    """The fake queueing server with a GPU count: 4 GPUs (tensor_parallel_size) make it 1.5x as fast
    and cost 4x as much, so the largest capacity is not the cheapest configuration."""

    options_cls = FakeGpuOptions

    def load(self, model, options):
        out = super().load(model, options)
        if options.get("tensor_parallel_size", 1) == 4:
            self.speed = self.speed * 3 // 2  # 2 -> 3, 4 -> 6
        return out


def test_the_cost_objective_picks_the_cheapest_configuration_meeting_the_slo(ctx, tmp_path):
    space = {"fake-tunable": {"speed": [2, 4], "tensor_parallel_size": [1, 4]}}
    (tmp_path / "cost").mkdir()
    (tmp_path / "cap").mkdir()
    price = Price(2.0, "device", "USD", "user: cost.price_per_device_hour")
    rows = tune_run(config(objective="cost", trials=8, confirm_rounds=2, space=space), ctx, tmp_path / "cost",
                    engine_cls=FakeTensorParallelEngine, price=price)
    conclusion = rows[-1]
    assert conclusion["status"] == "ok" and conclusion["tune_metric"] == "cost_min_per_good_mtok_output"
    # 1 GPU at speed 4 (capacity 4 / S for 2 per hour) is cheaper than 4 GPUs at speed 6 (6 / S for 8 per hour)
    assert conclusion["tune_best_options"] == {"speed": 4, "tensor_parallel_size": 1}
    met = [r for r in results(rows) if r["status"] == "ok" and r.get("tune_value") and "round" not in r["point"]]
    assert conclusion["tune_best_value"] == min(r["tune_value"] for r in met)
    best = next(r for r in met if r["tune_trial"] == conclusion["tune_best_trial"])
    assert best["cost_currency"] == "USD" and best["tune_value"] == best["cost_min_per_good_mtok_output"]
    # each trial a capacity search, as objective=capacity's (a repeat measures nothing)
    assert all(r["tune_probes"] > 1 for r in met if r["point"].get("repeat_of") is None)
    # every probe the trial's value came from met the SLOs, and its price counted the GPUs it held
    probes = [r for r in rows if r["point"].get("trial") == best["tune_trial"] and "value" in r["point"]
              and r["point"].get("role") == "trial" and r.get("meets_slo")]
    assert min(p["cost_per_good_mtok_output"] for p in probes) == best["tune_value"]
    assert {p["cost_units"] for p in probes} == {1}
    assert conclusion["tune_gain"] > 1  # default / best: how many times cheaper
    assert conclusion["tune_confirm"]["verdict"] in ("gain confirmed", "no significant difference")
    # the capacity objective, on the same engine and space, picks the largest capacity: the 4 GPUs
    cap = tune_run(config(trials=8, confirm_rounds=0, space=space), ctx, tmp_path / "cap",
                   engine_cls=FakeTensorParallelEngine, price=price)[-1]
    assert cap["tune_best_options"] == {"speed": 4, "tensor_parallel_size": 4}


def test_confirm_ratio_verdicts():
    assert confirm_ratio([(10, 20), (10, 21), (10, 19)])["verdict"] == "gain confirmed"
    assert confirm_ratio([(10, 9), (10, 9.1), (10, 8.95)])["verdict"] == "best < default"
    assert confirm_ratio([(10, 12), (10, 8), (10, 10)])["verdict"] == "no significant difference"
    one = confirm_ratio([(10, 20)])
    assert one["verdict"] == "not measured" and one["ratio"] == pytest.approx(2.0)
    cheaper = confirm_ratio([(10, 5), (10, 5.2), (10, 4.9)], lower_better=True)  # a cost: default / best
    assert cheaper["verdict"] == "gain confirmed" and cheaper["ratio"] == pytest.approx(2.0, rel=0.05)
    assert cheaper["default"] == [10, 10, 10] and cheaper["best"] == [5, 5.2, 4.9]
    missing = confirm_ratio([(None, 20), (10, 20), (10, 22)])
    assert "1 of 3 rounds" in missing["note"] and missing["ratio"] == pytest.approx((2.0 * 2.2) ** 0.5)


@pytest.mark.parametrize("override, named", [
    ("+workload.space.reference.block_size=[0,16]", "workload.space.reference.block_size=0: must be at least 1"),
    ("+workload.space.reference.colour=[1]", "workload.space.reference.colour: reference has no option"),
    ("+workload.space.reference.max_num_seqs=[]", "workload.space.reference.max_num_seqs=[]"),
    ("workload.trials=0", "workload.trials=0: must be at least 1"),
    ("+workload.space.hf.max_batch_size=[4]", "workload.space.hf: hf is not one of this run's engines"),
])
def test_bad_input_exits_2_before_anything_runs(tmp_path, override, named):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[reference]", "model=tiny", "workload=tune",
                        "workload.slo_ttft_p99_s=1", override, f"hydra.run.dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert named in p.stderr and "Traceback" not in p.stderr
    assert not (out / "results.jsonl").exists()

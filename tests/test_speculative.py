"""The speculative workload's own logic (workloads/speculative.py, harness/core/specdecode.py,
workloads/spec_content.py) with a FAKE engine: FakeSpecEngine is not an inference engine but a
deterministic stand-in whose "target" picks each next token by a hash of the last two tokens and
whose "draft" agrees with it most of the time. It speculates like an engine does (propose k,
verify, emit the accepted prefix plus the target's own token), keeps the counters of
`SpecDecodeStats`, and can carry an injected verifier bug (accepting a draft token the target
does not pick). The real engines' runs are in tests/test_speculative_engines.py."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from adapters.base import (Capabilities, Engine, KVCacheInfo, LoadInfo, RequestFailed, SpecDecodeStats, TokenEvent,
                           as_source, now_ns)
from harness.core.cost import Price, cost_fields
from harness.core.presets import load_preset
from harness.core.specdecode import accepted_agreement, counters_check, counters_delta, lossless, spec_fields
from workloads.base import Point, RunContext
from workloads.spec_content import encoding_problems, load_content, prompts
from workloads.speculative import Speculative, SpeculativeConfig, baseline_params

V = 64  # the fake target's token ids: 4 .. 4 + V - 1


def target_next(seq: list[int]) -> int:
    """The FAKE target's greedy choice: a hash of the last two tokens (so text repeats itself)."""
    a, b = seq[-2] if len(seq) > 1 else 0, seq[-1]
    return 4 + (a * 31 + b * 17) % V


def draft_next(seq: list[int]) -> int:
    """The FAKE draft: the target's choice, except where a second hash says otherwise (~1 in 4)."""
    t = target_next(seq)
    return t if (seq[-1] * 7 + len(seq)) % 4 else 4 + (t + 1) % V


class FakeSpecEngine(Engine):
    """FAKE, for unit tests of the workload: continuous batching over due requests, one step for
    every live sequence at a time; with method draft each step proposes k tokens with
    `draft_next`, verifies them against `target_next`, and emits the accepted prefix plus the
    target's token. `bug=True` injects a verifier bug: a draft token at position 0 is accepted
    even when the target picks another."""

    name = "fake-spec"

    def __init__(self, method: str = "none", k: int = 2, bug: bool = False, step_s: float = 0.0):
        self.method, self.k, self.bug, self.step_s = method, k, bug, step_s
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * k)

    @classmethod
    def capabilities(cls, options=None):
        return Capabilities(continuous_batching=True, speculative_methods=("draft",), speculative_max_batch=4,
                            options=("speculative_method", "num_speculative_tokens", "draft_model"))

    def load(self, model, options):
        self.loaded_with = dict(options)
        self.method, self.k = options.get("speculative_method", "none"), options.get("num_speculative_tokens", 2)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        return LoadInfo(0.0)

    def prefill(self, prompts, return_logits=False, max_new_tokens=None):
        raise NotImplementedError

    def decode(self, steps, return_logits=False):
        raise NotImplementedError

    def release(self):
        pass

    def kv_cache_info(self):
        return KVCacheInfo()

    def spec_decode_stats(self):
        return None if self.method == "none" else SpecDecodeStats(**{**self.stats.to_dict(), "accepted_per_pos":
                                                                       list(self.stats.accepted_per_pos)})

    def _step(self, seq: list[int]) -> list[int]:
        if self.method == "none":
            return [target_next(seq)]
        proposal, ctx = [], list(seq)
        for _ in range(self.k):
            proposal.append(draft_next(ctx))
            ctx.append(proposal[-1])
        self.stats.drafts += 1
        self.stats.draft_tokens += self.k
        out, ctx = [], list(seq)
        for i, d in enumerate(proposal):
            if d == target_next(ctx) or (self.bug and i == 0):
                self.stats.accepted_tokens += 1
                self.stats.accepted_per_pos[i] += 1
                out.append(d)
                ctx.append(d)
            else:
                break
        return out + [target_next(ctx)]

    def serve(self, requests, start_ns):
        source = as_source(requests, start_ns)
        live: dict[str, tuple[list[int], int, int]] = {}  # id -> (sequence, tokens so far, wanted)
        while not source.exhausted() or live:
            for r in source.due(now_ns()):
                seq = list(r.prompt_ids) + [target_next(list(r.prompt_ids))]  # prefill: the first token
                live[r.request_id] = (seq, 1, r.max_new_tokens)
                yield TokenEvent(r.request_id, 0, seq[-1], now_ns(), finished=r.max_new_tokens == 1)
                if r.max_new_tokens == 1:
                    del live[r.request_id]
            if not live:
                if source.next_due_ns() is None:
                    return
                continue
            t_end = now_ns() + int(self.step_s * 1e9)
            while now_ns() < t_end:
                pass
            t = now_ns()
            for rid in list(live):
                seq, n, want = live[rid]
                for tok in self._step(seq)[:want - n]:
                    seq.append(tok)
                    n += 1
                    yield TokenEvent(rid, n - 1, tok, t, finished=n == want)
                live[rid] = (seq, n, want)
                if n == want:
                    del live[rid]


@pytest.fixture
def ctx():
    shape = load_preset("tiny")
    return RunContext(shape=shape, dtype="float32", device="cpu", max_model_len=512, memory_sample_hz=0,
                      token_low=4, token_high=4 + V)


def measure(engine: Engine, method: str, b: int, cfg: SpeculativeConfig, ctx: RunContext) -> dict:
    """The row of one point as the harness writes it (without the harness's completion)."""
    wl = Speculative()
    p = {k: v for k, v in next(pt for pt in wl.plan(cfg) if pt.params["method"] == method
                              and pt.params["batch_size"] == b).params.items()}
    point = Point("speculative", p)
    fields = wl.run_point(engine, point, ctx, cfg)
    return {"engine": "fake-spec", "workload": "speculative", "status": "ok", "error": None, "point": p,
            "point_key": point.key, **fields}


CFG = SpeculativeConfig(methods=["draft"], num_speculative_tokens=[3], batch_sizes=[1, 4], contents=["random"],
                        prompt_len=12, output_len=24, min_requests=4, rounds=1)


def test_lossless_passes_when_speculation_changes_nothing(ctx):
    base = measure(FakeSpecEngine("none"), "none", 4, CFG, ctx)
    row = measure(FakeSpecEngine("draft", k=3), "draft", 4, CFG, ctx)
    wl = Speculative()
    wl.finalize_row(base, [])
    wl.finalize_row(row, [base])
    assert base["lossless"] == "baseline"
    assert row["status"] == "ok" and row["lossless"] == "pass", row.get("lossless_detail")
    assert row["lossless_requests"] == 4 and row["lossless_tokens"] == 4 * 24
    # the draft agrees ~3 times in 4: drafts accepted in part, more than one token per step
    assert 0 < row["acceptance_rate"] < 1 and 1 < row["mean_acceptance_length"] <= 4
    assert row["spec_drafts"] > 0 and len(row["acceptance_per_pos"]) == 3
    assert row["acceptance_per_pos"][0] >= row["acceptance_per_pos"][1] >= row["acceptance_per_pos"][2]
    given = sum(row["accepted_per_request"].values())  # accepted tokens the requests were given
    assert row["tokens_per_step_source"] == "token times"
    assert row["tokens_per_step"] == pytest.approx(4 * 23 / (4 * 23 - given))
    assert 1 < row["tokens_per_step"] <= 4
    # the FAKE counts tokens accepted past a request's last one (as vLLM does); never more than k each
    assert 0 <= row["spec_accepted_tokens"] - given <= 3 * 4


def test_an_injected_verifier_bug_fails_the_lossless_check(ctx):
    base = measure(FakeSpecEngine("none"), "none", 1, CFG, ctx)
    row = measure(FakeSpecEngine("draft", k=3, bug=True), "draft", 1, CFG, ctx)
    Speculative().finalize_row(row, [base])
    assert row["status"] == "failed" and row["lossless"] == "fail"
    m = row["lossless_mismatch"]
    exp, got = base["request_output_ids"][m["request"]], row["request_output_ids"][m["request"]]
    assert exp[:m["position"]] == got[:m["position"]] and exp[m["position"]] != got[m["position"]]
    assert (m["expected"], m["got"]) == (exp[m["position"]], got[m["position"]])
    assert f"request {m['request']}" in row["error"] and f"token {m['position']}" in row["error"]
    assert str(m["expected"]) in row["error"] and str(m["got"]) in row["error"]


def test_only_requests_that_passed_the_lossless_check_are_good_tokens(ctx):
    # the cost per good million tokens counts what the verdict passed (harness.core.cost)
    price = Price(1.0, "deployment", "USD", "user: cost.price_per_hour")
    base = measure(FakeSpecEngine("none"), "none", 1, CFG, ctx)
    wl = Speculative()
    wl.finalize_row(base, [])
    assert "good_verdict" not in base and base["good_requests"] == base["completed"]  # nothing to check it against
    good = measure(FakeSpecEngine("draft", k=3), "draft", 1, CFG, ctx)
    wl.finalize_row(good, [base])
    assert good["good_verdict"] == "lossless check" and good["good_requests"] == good["completed"]
    bad = measure(FakeSpecEngine("draft", k=3, bug=True), "draft", 1, CFG, ctx)
    wl.finalize_row(bad, [base])
    passed = [r for r, ids in bad["request_output_ids"].items() if ids == base["request_output_ids"][r]]
    assert bad["status"] == "failed" and bad["good_requests"] == len(passed) < bad["completed"]
    assert bad["good_output_tokens"] == sum(len(bad["request_output_ids"][r]) for r in passed)
    cost = cost_fields(bad, price)
    assert "passed the lossless check" in cost["cost_good_basis"]
    if passed:
        assert cost["cost_per_good_mtok_output"] == pytest.approx(
            cost["cost_per_mtok_output"] * bad["total_output_tokens"] / bad["good_output_tokens"])
    else:
        assert cost["cost_per_good_mtok_output"] is None and "no good token" in cost["cost_note"]
    unverified = dict(good)
    wl.finalize_row(unverified, [])  # no baseline: fail closed, nothing is good
    assert unverified["good_requests"] == 0 and unverified["good_output_tokens"] == 0


def test_fail_closed_when_the_baseline_is_missing_failed_or_without_outputs(ctx):
    base = measure(FakeSpecEngine("none"), "none", 1, CFG, ctx)
    row = measure(FakeSpecEngine("draft", k=3), "draft", 1, CFG, ctx)
    wl = Speculative()
    cases = {
        "missing": [],
        "failed": [{**base, "status": "failed", "error": "RuntimeError: boom"}],
        "no outputs": [{**base, "request_output_ids": None}],
        "other prompts": [{**base, "prompts_sha256": "0" * 16}],
        "no token ids": [{**base, "request_output_ids": {k: [-1] * len(v) for k, v in base["request_output_ids"].items()}}],
        "fewer requests": [{**base, "request_output_ids": dict(list(base["request_output_ids"].items())[:2])}],
    }
    for what, rows in cases.items():
        r = dict(row)
        wl.finalize_row(r, rows)
        assert r["status"] == "unverified" and r["lossless"] == "unverified", (what, r.get("lossless_detail"))
        assert r["error"].startswith("lossless check could not compare"), what
    r = {**row, "request_output_ids": {}}
    wl.finalize_row(r, [base])
    assert r["status"] == "unverified"


def test_a_request_that_failed_is_not_compared_but_leaves_the_row_unverified(ctx):
    """A request that failed mid-stream (a server's error) is not a lossless failure: its partial
    output is not compared, and the row cannot pass either."""
    base = measure(FakeSpecEngine("none"), "none", 1, CFG, ctx)

    class Failing(FakeSpecEngine):
        def serve(self, requests, start_ns):
            for ev in super().serve(requests, start_ns):
                if ev.request_id == "r1" and ev.index == 5:
                    yield RequestFailed("r1", "HTTP 500", ev.time_ns)
                    continue
                if ev.request_id == "r1" and ev.index > 5:
                    continue
                yield ev
    row = measure(Failing("draft", k=3), "draft", 1, CFG, ctx)
    assert row["failed_requests"] == 1 and "r1" not in row["request_output_ids"]
    Speculative().finalize_row(row, [base])
    assert row["status"] == "unverified" and "request r1" in row["lossless_detail"]


def test_unverified_rows_set_the_exit_code():
    from harness.cli import exit_reasons

    class P:
        class settings:
            engines = ["reference"]
        engines = ["reference"]
        workloads = []
    rows = [{"engine": "reference", "workload": "speculative", "status": "unverified",
             "error": "lossless check could not compare: no row of this engine without speculation"}]
    assert exit_reasons(rows, P()) == ["reference: speculative unverified: lossless check could not compare: no row "
                                       "of this engine without speculation"]


def test_a_run_whose_lossless_check_verified_nothing_fails(ctx):
    """Every speculative point skipped (no engine of the run speculates) or unverified: the run's exit
    code says the check compared nothing; one verified point is enough to pass."""
    wl = Speculative()
    skipped = [{"engine": "hf", "workload": "speculative", "status": "skipped", "point": {"method": "ngram", "k": 2},
                "error": "the engine cannot speculate with method ngram (its methods: none)"}]
    base = [{"engine": "hf", "workload": "speculative", "status": "ok", "point": {"method": "none"},
             "lossless": "baseline"}]
    (why,) = wl.run_problems(base + skipped)
    assert "verified no speculative point" in why and "cannot speculate with method ngram" in why
    assert wl.run_problems(base) == []  # nothing speculative planned: nothing to verify
    passed = [{**skipped[0], "status": "ok", "lossless": "pass", "engine": "reference"}]
    assert wl.run_problems(base + skipped + passed) == []


def test_per_request_accepted_counts(ctx):
    """From the token times: decode tokens - steps, for every request at every batch size; from the
    engine's counters read as each request ends: at batch 1 only, adding up to the point's count."""
    row = measure(FakeSpecEngine("draft", k=3), "draft", 1, CFG, ctx)
    assert set(row["accepted_per_request"]) == set(row["request_output_ids"]) == set(row["accepted_per_request_counters"])
    assert sum(row["accepted_per_request_counters"].values()) == row["spec_accepted_tokens"]
    for rid, n in row["accepted_per_request"].items():
        assert 0 <= row["accepted_per_request_counters"][rid] - n <= 3
    b4 = measure(FakeSpecEngine("draft", k=3), "draft", 4, CFG, ctx)
    assert b4["accepted_per_request_counters"] is None  # requests overlap: the counters cannot be split by request
    assert len(b4["accepted_per_request"]) == 4


def test_token_times_that_do_not_group_by_step_fall_back_to_the_counters(ctx):
    class StampsEachToken(FakeSpecEngine):
        def serve(self, requests, start_ns):
            for i, ev in enumerate(super().serve(requests, start_ns)):
                ev.time_ns += i  # every token a time of its own: the times say nothing about steps
                yield ev
    row = measure(StampsEachToken("draft", k=3), "draft", 1, CFG, ctx)
    assert row["accepted_per_request"] is None and row["tokens_per_step_source"] == "counters"
    assert row["tokens_per_step"] == pytest.approx(4 * 23 / (4 * 23 - row["spec_accepted_tokens"]))
    assert "token times" in row["spec_note"]


def test_speedup_is_paired_by_request():
    wl = Speculative()
    off = {f"r{i}": 0.010 * (1 + i) for i in range(8)}  # requests differ a lot among themselves
    on = {r: v / 2 * (1 + 0.01 * (i % 3)) for i, (r, v) in enumerate(off.items())}  # each one ~2x faster
    base = {"engine": "e", "workload": "speculative", "status": "ok", "tpot_s": 0.045, "request_tpot_s": off}
    row = {"request_tpot_s": on}
    wl._speedup(row, base)
    assert row["speedup_pairing"] == "paired by request" and row["speedup_pairs"] == 8
    assert row["speedup"] == pytest.approx(np.median(list(off.values())) / np.median(list(on.values())))
    lo, hi = row["speedup_ci"]
    assert lo <= row["speedup"] <= hi and 1.9 < lo and hi < 2.1  # pairing removes the spread between requests
    unpaired = {"request_tpot_s": {f"x{i}": v for i, v in enumerate(on.values())}}
    wl._speedup(unpaired, base)
    assert unpaired["speedup_pairing"] == "unpaired" and unpaired["speedup_ci"][1] - unpaired["speedup_ci"][0] > hi - lo


def test_plan_measures_none_first_and_orders_by_method():
    wl = Speculative()
    cfg = SpeculativeConfig(methods=["ngram", "draft"], num_speculative_tokens=[4, 2], batch_sizes=[4, 1],
                            contents=["code", "random"])
    pts = [p.params for p in wl.plan(cfg)]
    assert len(pts) == 2 * 2 * (1 + 2 * 2)
    assert [p["method"] for p in pts[:4]] == ["none"] * 4
    groups = [(p["method"], p.get("k")) for p in pts]
    assert groups == sorted(groups, key=lambda g: ["none", "ngram", "draft"].index(g[0]))  # one reload per (method, k)
    for p in pts[4:]:
        base = baseline_params(p)
        assert base in pts[:4]  # every speculative point has its baseline, planned before it
    assert {p["num_requests"] for p in pts if p["batch_size"] == 4} == {8}


def test_unsupported_method_and_batch_are_reasons_not_crashes():
    wl = Speculative()
    caps = FakeSpecEngine.capabilities()
    mk = lambda m, b: Point("speculative", {"method": m, "batch_size": b, "k": 2})  # noqa: E731
    assert wl.unsupported(mk("none", 16), caps) is None
    assert "cannot speculate with method ngram" in wl.unsupported(mk("ngram", 1), caps)
    assert "up to 4" in wl.unsupported(mk("draft", 16), caps)
    assert wl.unsupported(mk("draft", 4), caps) is None
    assert wl.engine_overrides(mk("none", 1), Capabilities()) == {}  # an engine that cannot speculate: as it is
    ov = wl.engine_overrides(Point("speculative", {"method": "draft", "batch_size": 1, "k": 2, "draft": "tiny-trained"}),
                             caps)
    assert ov == {"speculative_method": "draft", "num_speculative_tokens": 2, "draft_model": "tiny-trained"}


def test_counters_and_derived_figures():
    before = {"drafts": 10, "draft_tokens": 40, "accepted_tokens": 20, "accepted_per_pos": [8, 6], "draft_time_s": 1.0}
    after = {"drafts": 30, "draft_tokens": 120, "accepted_tokens": 70, "accepted_per_pos": [26, 20, 14, 10],
             "draft_time_s": 1.5, "verify_time_s": None, "source": "metrics", "aggregate_only": []}
    d = counters_delta(before, after)
    assert d["accepted_per_pos"] == [18, 14, 14, 10] and d["drafts"] == 20 and d["draft_time_s"] == pytest.approx(0.5)
    f = spec_fields(d, duration_s=2.0)
    assert f["acceptance_rate"] == pytest.approx(50 / 80) and f["mean_acceptance_length"] == pytest.approx(1 + 50 / 20)
    assert f["acceptance_per_pos"] == pytest.approx([0.9, 0.7, 0.7, 0.5]) and f["draft_time_share"] == pytest.approx(0.25)
    agg = spec_fields({**d, "aggregate_only": ["accepted_per_pos", "drafts"]})
    assert agg["acceptance_per_pos"] is None and agg["mean_acceptance_length"] is None and agg["spec_drafts"] is None
    assert agg["acceptance_rate"] == pytest.approx(50 / 80) and agg["spec_aggregate_only"] == ["accepted_per_pos", "drafts"]
    assert spec_fields(None)["acceptance_rate"] is None and counters_delta({}, None) is None


def test_counters_check_against_the_responses_own_timings():
    d = counters_delta({"drafts": 1, "draft_tokens": 10, "accepted_tokens": 4},
                       {"drafts": 13, "draft_tokens": 43, "accepted_tokens": 19, "source": "metrics"})
    assert counters_check(d, {"requests": 4, "draft_n": 33, "draft_n_accepted": 15}) == {"spec_counters_check": "agree"}
    off = counters_check(d, {"requests": 5, "draft_n": 43, "draft_n_accepted": 19})["spec_counters_check"]
    assert off.startswith("differ: counters 33 proposed / 15 accepted") and "43 / 19 over 5 requests" in off
    assert counters_check(d, None) == counters_check(None, {"draft_n": 1}) == {"spec_counters_check": None}
    assert counters_check(d, {"requests": 2, "prompt_n": 8}) == {"spec_counters_check": None}  # no draft counts


def test_lossless_names_the_first_difference_in_request_order():
    base = {"r0": [5, 6, 7], "r1": [8, 9, 10], "r2": [1, 2, 3]}
    res = lossless(base, {"r0": [5, 6, 7], "r1": [8, 4, 10], "r2": [0, 2, 3]})
    assert res.verdict == "fail" and res.mismatch == {"request": "r1", "position": 1, "expected": 9, "got": 4}
    short = lossless(base, {**base, "r2": [1, 2]})
    assert short.verdict == "fail" and short.mismatch["position"] == 2 and "lengths differ" in short.detail
    assert lossless(base, dict(base)).verdict == "pass"
    assert lossless({}, base).verdict == "unverified" and lossless(base, None).verdict == "unverified"
    assert lossless({"r0": []}, {"r0": []}).verdict == "unverified"  # nothing compared is not a pass


def test_accepted_agreement_across_engines():
    def row(engine, counts, sha="s", method="draft"):
        return {"engine": engine, "workload": "speculative", "status": "ok", "model": "m", "prompts_sha256": sha,
                "point": {"method": method, "k": 2, "draft": "d", "batch_size": 1, "content": "code",
                          "prompt_len": 8, "output_len": 8}, "accepted_per_request": counts}
    rows = [row("reference", {"r0": 3, "r1": 5, "r2": 1}), row("vllm", {"r0": 3, "r1": 4, "r2": 1}),
            row("hf", {"r0": 3, "r1": 5, "r2": 1}), row("other", {"r0": 0}, sha="t"),
            {**row("x", {"r0": 1}), "point": {**row("x", {})["point"], "batch_size": 4}}]
    (g,) = accepted_agreement(rows)
    assert g["engines"] == ["hf", "reference", "vllm"] and g["requests"] == 3 and g["identical"] == 2
    assert g["first_difference"] == {"request": "r1", "hf": 5, "reference": 5, "vllm": 4}


def test_a_draft_preset_reaches_the_engine_as_its_directory(monkeypatch, tmp_path):
    """The harness materialises the draft preset (harness.cli.extra_models) and the worker maps
    the point's draft_model override to that directory: the engine loads a directory."""
    from dataclasses import asdict

    import harness.worker_job as worker_job
    from harness.checkpoint import SHIPPED_DIR
    from harness.cli import compose_job, extra_models
    from harness.config import build_plan
    from harness.core.presets import TokenRange
    from harness.protocol import RunPoint

    plan = build_plan(compose_job(["engines=[reference]", "model=tiny-trained", "workload=speculative",
                                   "workload.methods=[draft]", "workload.contents=[random]", "parity=false"]))
    models = extra_models(plan, str(SHIPPED_DIR / "tiny-trained"), say=lambda *a: None)
    assert models == {"tiny-trained": str(SHIPPED_DIR / "tiny-trained")}
    plan.models = models
    plan.token_range = TokenRange(4, 4 + V, ())
    monkeypatch.setattr(worker_job, "resolve_engine", lambda name, endpoint: (FakeSpecEngine, []))
    sent = []
    job = {"engine": "fake-spec", "options": {}, "model_spec": asdict(plan.model_spec(str(tmp_path))),
           "context": {**plan.context(str(SHIPPED_DIR / "tiny-trained")), "memory_sample_hz": 0},
           "workloads": {"speculative": {**asdict(plan.workloads[0].cfg), "output_len": 4, "prompt_len": 8,
                                         "min_requests": 2}}}
    w = worker_job.Worker(job, sent.append)
    point = next(p for p in plan.points if p.params["method"] == "draft" and p.params["batch_size"] == 1)
    w.run(RunPoint({"workload": "speculative", "params": {**point.params, "output_len": 4, "prompt_len": 8,
                                                           "num_requests": 2}}, None))
    assert sent[-1].status == "ok", sent[-1].error
    assert w.loaded.engine.loaded_with["draft_model"] == str(SHIPPED_DIR / "tiny-trained")
    assert sent[-1].fields["draft"] == "tiny-trained"  # the row names the draft as given


# ---- content ------------------------------------------------------------------------------

def test_content_categories_are_real_text_and_deterministic():
    from harness.checkpoint import SHIPPED_DIR
    path = str(SHIPPED_DIR / "tiny-trained")
    code, prose, rnd = (load_content(c, path) for c in ("code", "prose", "random"))
    assert code.ids is not None and len(code.ids) > 100_000 and "heldout.npy" in code.source
    assert prose.ids is not None and len(prose.ids) > 5_000 and ("common-licenses" in prose.source or
                                                                 "LICENSE" in prose.source)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.decode(prompts(prose, 1, 200, 0, (4, 4096, ()))[0])
    assert sum(w in text.lower() for w in (" the ", " of ", " or ", " to ")) >= 2, text  # English
    assert "def " in tok.decode(code.ids[:20000].tolist())
    a = prompts(code, 3, 50, seed=0, token_range=(4, 4096, ()))
    assert a == prompts(code, 3, 50, seed=0, token_range=(4, 4096, ())) and a != prompts(code, 3, 50, 1, (4, 4096, ()))
    assert a[1:] == prompts(code, 2, 50, 0, (4, 4096, ()), first=1)  # request i is the same in every point
    r = prompts(rnd, 2, 30, 0, (4, 40, (7,)))
    assert all(4 <= t < 40 and t != 7 for p in r for t in p)
    with pytest.raises(ValueError, match="shorten workload.prompt_len"):
        prompts(prose, 1, len(prose.ids) + 1, 0, (4, 4096, ()))


def test_code_on_a_model_not_trained_here_is_the_same_heldout_files(tmp_path):
    """A model without heldout.npy gets the held-out stdlib files tokenised with its own tokenizer:
    with tiny-trained's tokenizer, the very stream tiny-trained's heldout.npy holds."""
    import shutil

    from harness.checkpoint import SHIPPED_DIR
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(SHIPPED_DIR / "tiny-trained" / f, tmp_path / f)
    mine = load_content("code", str(tmp_path))
    shipped = load_content("code", str(SHIPPED_DIR / "tiny-trained"))
    assert "held-out stdlib files" in mine.source
    assert np.array_equal(mine.ids, shipped.ids)


def test_text_content_on_a_word_level_tokenizer_is_bad_input(tiny_ckpt):
    problems = encoding_problems(str(tiny_ckpt), ["code", "prose", "random"])
    assert len(problems) == 2 and all("workload.contents" in p and "unknown token" in p for p in problems)
    assert encoding_problems(str(tiny_ckpt), ["random"]) == []


# ---- bad input: exit 2, nothing run -------------------------------------------------------

def _cli(tmp_path, *args):
    r = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[reference]", "workload=speculative",
                        "parity=false", "quiet=true", f"hydra.run.dir={tmp_path / 'run'}", *args],
                       capture_output=True, text=True, timeout=600)
    return r.returncode, r.stderr


@pytest.mark.parametrize("args,field,fix", [
    (["model=tiny-trained", "workload.num_speculative_tokens=[2,0]"], "workload.num_speculative_tokens=0",
     "at least 1"),
    (["model=tiny-trained", "workload.draft_model=/no/such/draft"], "workload.draft_model=/no/such/draft",
     "Give a preset"),
    (["model=tiny-trained", "workload.draft_model=no-such-preset"], "workload.draft_model=no-such-preset",
     "Give a preset"),
    (["model=tiny-trained", "workload.draft_model=small"], "workload.draft_model=small", "share the target's tokenizer"),
    (["model=tiny-trained", "workload.prompt_lookup_min=5"], "workload.prompt_lookup_min=5", "Lower"),
])
def test_bad_input_exits_2_naming_the_field(tmp_path, args, field, fix):
    code, err = _cli(tmp_path, *args)
    assert code == 2, err
    assert field in err and fix in err and "Traceback" not in err
    assert not (tmp_path / "run" / "results.jsonl").exists()


def test_a_draft_with_another_tokenizer_exits_2_before_anything_runs(tmp_path, tiny_ckpt):
    """tiny (word-level tokenizer) and tiny-trained (byte-level BPE) have the same vocabulary size:
    the tokenizers themselves are compared once both are on disk."""
    code, err = _cli(tmp_path, "model=tiny-trained", f"workload.draft_model={tiny_ckpt}", "workload.contents=[random]")
    assert code == 2, err
    assert f"workload.draft_model={tiny_ckpt}" in err and "tokenizer" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "results.jsonl").exists()
    assert not (tmp_path / "run" / "logs").exists()  # no engine's worker started

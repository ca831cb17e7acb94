"""The kv_tiers dimension of the conversation and prefix_sharing workloads (workloads/kv_tiers.py):
the points it plans and what each asks of an engine, the row's tier fields, the tiered turn beside
recompute and the full-pool bound (computed in the harness's process), bad input (exit 2 naming
the field), vLLM's unsupported row on CPU, and one run of the reference engine end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adapters.base import Capabilities
from adapters.tiers import VLLM_CPU_OFFLOAD_REFUSAL
from harness.cli import check_jobs
from workloads.base import Point
from workloads.conversation import Conversation, ConversationConfig
from workloads.kv_tiers import compare_tiers, tier_fields, tier_split
from workloads.prefix_sharing import PrefixSharing, PrefixSharingConfig

GIB = 1 << 30


def test_the_points_off_full_then_capacities_and_caching_off_alone():
    c = Conversation()
    params = [p.params for p in c.plan(ConversationConfig(kv_tiers=["1GiB", "full", "off", "256MiB"]))]
    assert [(p["prefix_caching"], p["kv_tiers"]) for p in params] == [
        (True, "off"), (True, "full"), (True, 256 << 20), (True, GIB), (False, "off")]
    # the default asks nothing of tiers: the points (and their keys) are what they were
    assert [p.params for p in c.plan(ConversationConfig())] == [{"prefix_caching": True, "sessions": 16},
                                                               {"prefix_caching": False, "sessions": 16}]
    ps = PrefixSharing().plan(PrefixSharingConfig(prefix_lens=[64], kv_tiers=["off", "2e9"]))
    assert [(p.params["prefix_caching"], p.params["kv_tiers"]) for p in ps] == [(True, "off"), (True, 2 * 10**9),
                                                                              (False, "off")]


def test_the_full_point_gets_the_pool_asked_for():
    """kv_tiers_full_bytes: the full point asks for that pool (kv_cache_bytes) instead of the
    engine's default, which need not hold every history; its key says so; the other points are
    unchanged. Unset: kv_cache_bytes null, as before."""
    c = Conversation()
    caps = Capabilities(prefix_caching=True, kv_offload=True)
    points = c.plan(ConversationConfig(kv_tiers=["off", "full", "128MiB"], prefix_caching=[True],
                                       kv_tiers_full_bytes="512MiB"))
    assert [p.params.get("kv_full_bytes") for p in points] == [None, 512 << 20, None]
    assert c.engine_overrides(points[1], caps) == {"prefix_caching": True, "kv_offload": False,
                                                   "kv_cache_bytes": 512 << 20}
    assert c.engine_overrides(points[0], caps) == {"prefix_caching": True, "kv_offload": False}
    row = tier_fields(points[1], [], None, None, None, None)  # the row says which pool the bound had
    assert row["kv_tiers"] == "full" and row["kv_full_bytes"] == 512 << 20
    assert "kv_full_bytes" not in tier_fields(points[0], [], None, None, None, None)
    ps = PrefixSharing().plan(PrefixSharingConfig(prefix_lens=[64], kv_tiers=["full"], prefix_caching=[True],
                                                  kv_tiers_full_bytes=2**30))
    assert ps[0].params["kv_full_bytes"] == GIB


def test_what_each_mode_asks_of_an_engine():
    c = Conversation()
    tiered = Capabilities(prefix_caching=True, kv_offload=True)
    plain = Capabilities(prefix_caching=True)
    point = {m: Point("conversation", {"prefix_caching": True, "sessions": 4, "kv_tiers": m}) for m in ("off", "full", GIB)}
    assert c.engine_overrides(point["off"], tiered) == {"prefix_caching": True, "kv_offload": False}
    assert c.engine_overrides(point["full"], tiered) == {"prefix_caching": True, "kv_offload": False,
                                                         "kv_cache_bytes": None}
    assert c.engine_overrides(point[GIB], tiered) == {"prefix_caching": True, "kv_offload": True,
                                                      "kv_offload_bytes": GIB}
    assert c.engine_overrides(point["full"], plain) == {"prefix_caching": True, "kv_cache_bytes": None}
    assert c.unsupported(point[GIB], plain) == "the engine has no second KV tier (kv_offload)"
    assert c.unsupported(point["off"], plain) is None and c.unsupported(point["full"], plain) is None


def test_vllm_in_process_on_a_cpu_is_an_unsupported_point_with_vllms_own_reason():
    """vLLM has tiers (kv_offloading_size), but its CPU build refuses them: a tiered point of a
    vLLM-CPU engine is skipped with vLLM's message; its other points run."""
    from adapters.vllm.engine import VLLMEngine, installed_distribution
    if installed_distribution() == "vllm":
        pytest.skip("vLLM's GPU build is installed here: it runs kv_offload")
    caps = VLLMEngine.capabilities({})
    c = Conversation()
    tiered = Point("conversation", {"prefix_caching": True, "sessions": 4, "kv_tiers": GIB})
    why = c.unsupported(tiered, caps)
    assert VLLM_CPU_OFFLOAD_REFUSAL in why and "vLLM-CPU" in why
    assert c.unsupported(Point("conversation", {"prefix_caching": True, "sessions": 4, "kv_tiers": "off"}), caps) is None
    # the GPU path: the standard options become vLLM's own keywords (vllm/config/cache.py)
    from adapters.base import ModelSpec
    from adapters.vllm.options import engine_kwargs
    kw = engine_kwargs(ModelSpec("/m", "m", device="cuda"), VLLMEngine.options_for(
        c.engine_overrides(tiered, caps)))
    assert kw["kv_offloading_size"] * GIB == GIB and kw["kv_offloading_backend"] == "native"
    assert VLLMEngine.options_for({"kv_cache_bytes": 5}) == {"kv_cache_memory_bytes": 5}


def test_tier_split_per_turn():
    reqs = [{"ok": True, "prompt_tokens": 100, "cached_tokens": 64, "reloaded_tokens": 48},
            {"ok": True, "prompt_tokens": 100, "cached_tokens": 32, "reloaded_tokens": 0}]
    got = tier_split(reqs)
    assert got == {"tier1_hit_tokens": 48, "tier2_hit_tokens": 48, "miss_tokens": 104,
                   "hit_rate_tier1": 0.24, "hit_rate_tier2": 0.24}
    assert tier_split([{**reqs[0], "reloaded_tokens": None}]) == {}  # not said per request: nothing


def _row(mode, ttfts, prefilled, evictions=0):
    return {"workload": "conversation", "status": "ok", "engine": "reference", "model": "small", "sessions": 4,
            "prefix_caching": True, "kv_tiers": mode, "prefix_cache_evictions": evictions,
            "reload_s_per_token_measured": 1e-5,
            "turns": [{"turn": k + 1, "completed": 4, "ttft_s": t, "prefilled_tokens": p, "hit_rate": 0.5}
                      for k, (t, p) in enumerate(zip(ttfts, prefilled))]}


def test_a_tiered_turn_beside_recompute_and_the_bound():
    off = _row("off", [0.1, 0.9, 1.5], [256, 576, 896])
    full = _row("full", [0.1, 0.3, 0.4], [256, 320, 384])
    tiered = _row(GIB, [0.1, 0.35, 1.6], [256, 320, 400])
    compare_tiers(tiered, [off, full], "conversation")
    t2, t3 = tiered["turns"][1], tiered["turns"][2]
    assert (t2["ttft_recompute_s"], t2["ttft_full_s"], t2["ttft_between"]) == (0.9, 0.3, True)
    assert t3["ttft_between"] is False  # slower than recomputing: said, not hidden
    assert t2["prefill_s_per_token"] == pytest.approx(0.6 / 64) and t2["reload_over_prefill"] == pytest.approx(
        1e-5 / (0.6 / 64))
    assert tiered["tier_turns_between"] == 2 and tiered["tier_turns_compared"] == 3
    lonely = _row(GIB, [0.1], [256])
    compare_tiers(lonely, [off], "conversation")
    assert "no kv_tiers=full point" in lonely["tier_comparison"] and "ttft_full_s" not in lonely["turns"][0]


def test_the_runs_own_noise_from_the_turns_where_the_three_points_did_the_same_work():
    """Turn 1 (no history) and turn 2 (every pool held it) do the same work in all three points:
    their TTFTs spread by at most 10 % (the noise). At turn 3 the tiered turn reloaded what the
    recompute point prefilled, and is 5 % under the bound: not between strictly, between within
    the noise. At turn 4 it is 30 % under: not between either way. Where no turn did the same
    work, there is no noise figure and no such verdict."""
    off = _row("off", [0.50, 0.60, 1.50, 2.00], [64, 72, 208, 280])
    full = _row("full", [0.55, 0.63, 0.70, 0.70], [64, 72, 80, 72])
    tiered = _row(GIB, [0.52, 0.65, 0.665, 0.49], [64, 72, 80, 72])
    tiered["turns"][2]["tier2_hit_tokens"] = 128 * 4
    tiered["turns"][3]["tier2_hit_tokens"] = 208 * 4
    compare_tiers(tiered, [off, full], "conversation")
    assert tiered["tier_ttft_noise"] == pytest.approx(0.10) and tiered["tier_ttft_noise_turns"] == [1, 2]
    t3, t4 = tiered["turns"][2], tiered["turns"][3]
    assert t3["ttft_between"] is False and t3["ttft_between_within_noise"] is True
    assert t4["ttft_between"] is False and t4["ttft_between_within_noise"] is False
    assert tiered["tier_turns_between_within_noise"] == 3 and "3 of 4 within the run's noise (10.0%" in \
        tiered["tier_comparison"]
    lonely = _row(GIB, [0.52, 0.66, 0.665, 0.49], [60, 70, 80, 72])  # never the same work as the others
    compare_tiers(lonely, [off, full], "conversation")
    assert lonely["tier_ttft_noise"] is None and "ttft_between_within_noise" not in lonely["turns"][2]
    assert "noise" not in lonely["tier_comparison"]


def _with_requests(row, per_turn):
    """`row` with one request per TTFT of each turn (turn_requests) and its turns' p50 from them."""
    row["turn_requests"] = [{"turn": k, "ok": True, "ttft_s": v} for k, vs in per_turn.items() for v in vs]
    for t in row["turns"]:
        vs = sorted(per_turn[t["turn"]])
        t["ttft_s"] = vs[len(vs) // 2]
    return row


def test_the_order_is_resolved_only_where_the_intervals_of_the_ratios_clear_1():
    """Per turn, tiered / full and tiered / recompute with 95 % bootstrap intervals from the
    points' requests. Turn 1 (nothing reloaded, the same TTFTs): the strict verdict reads
    "between" by the medians' chance order, the interval spans 1: unresolved. Turn 2: tiered
    20 % above the bound and far below recompute, 11 requests each with 1 % jitter: resolved.
    Turn 3: medians in order, but the bound's requests spread 0.08-0.16 s: between strictly,
    not resolved. Turn 4: tiered 20 % under the bound, tightly: resolved the wrong way (false).
    Only turns with reloads are counted."""
    same = [0.100 + 0.001 * i for i in range(11)]
    full = _with_requests(_row("full", [0] * 4, [64, 72, 80, 72]), {
        1: same, 2: [0.100 + 0.001 * i for i in range(11)],
        3: [0.08, 0.16, 0.09, 0.15, 0.10, 0.14, 0.11, 0.13, 0.115, 0.125, 0.12], 4: [0.2 + 0.001 * i for i in range(11)]})
    off = _with_requests(_row("off", [0] * 4, [64, 144, 224, 304]), {
        1: [v + 0.0001 for v in same], 2: [0.3 + 0.001 * i for i in range(11)],
        3: [0.4 + 0.001 * i for i in range(11)], 4: [0.5 + 0.001 * i for i in range(11)]})
    tiered = _with_requests(_row(GIB, [0] * 4, [64, 72, 80, 72]), {
        1: [v + 0.00005 for v in same], 2: [0.120 + 0.001 * i for i in range(11)],
        3: [0.121 + 0.0005 * i for i in range(11)], 4: [0.16 + 0.001 * i for i in range(11)]})
    for t in tiered["turns"][1:]:
        t["tier2_hit_tokens"] = 64 * 11
    compare_tiers(tiered, [off, full], "conversation")
    t1, t2, t3, t4 = tiered["turns"]
    assert t1["ttft_between"] is True and t1["ttft_between_resolved"] is None
    assert t1["ttft_over_full_ci"][0] < 1 < t1["ttft_over_full_ci"][1]
    assert t2["ttft_over_full"] == pytest.approx(0.125 / 0.105) and t2["ttft_over_full_ci"][0] > 1.1
    assert t2["ttft_over_recompute_ci"][1] < 0.5 and t2["ttft_between_resolved"] is True
    assert t3["ttft_between"] is True and t3["ttft_between_resolved"] is None
    assert t4["ttft_between"] is False and t4["ttft_between_resolved"] is False
    assert (tiered["tier_turns_reloaded"], tiered["tier_turns_between_resolved"]) == (3, 1)
    assert "1 of the 3 turns with reloads resolved between" in tiered["tier_comparison"]
    # a point without per-request TTFTs (fewer than 2 of a turn) gives no interval and no verdict
    bare = _row(GIB, [0.1, 0.12, 0.13, 0.15], [64, 72, 80, 72])
    compare_tiers(bare, [off, full], "conversation")
    assert all(t["ttft_between_resolved"] is None and t["ttft_over_full_ci"] is None for t in bare["turns"])


def test_a_run_in_which_no_turn_reloaded_says_so_and_counts_no_resolved_turn():
    """Every pool held the history (no turn's tokens came from the second tier): turn 2's
    intervals clear 1 in order, but nothing was reloaded, so nothing is counted as resolved and
    tier_comparison says that no turn was (it used to add nothing: a silent row read as a pass)."""
    full = _with_requests(_row("full", [0] * 2, [64, 72]), {
        1: [0.100 + 0.001 * i for i in range(11)], 2: [0.100 + 0.001 * i for i in range(11)]})
    off = _with_requests(_row("off", [0] * 2, [64, 144]), {
        1: [0.1001 + 0.001 * i for i in range(11)], 2: [0.3 + 0.001 * i for i in range(11)]})
    tiered = _with_requests(_row(GIB, [0] * 2, [64, 72]), {
        1: [0.10005 + 0.001 * i for i in range(11)], 2: [0.120 + 0.001 * i for i in range(11)]})
    compare_tiers(tiered, [off, full], "conversation")
    assert tiered["turns"][1]["ttft_between_resolved"] is True  # in order, but no reload made it so
    assert (tiered["tier_turns_reloaded"], tiered["tier_turns_between_resolved"]) == (0, 0)
    assert tiered["tier_comparison"].endswith(
        "; no turn reloaded from the second tier: the order was not resolved at any turn")
    assert "turns with reloads resolved between" not in tiered["tier_comparison"]


def test_a_full_point_that_lost_cached_blocks_is_no_bound_and_no_turn_gets_a_verdict():
    """The `full` point is the engine's default pool, which need not hold every history (the
    reference engine's CPU default shrinks with max_num_seqs: with max_num_seqs=2 a run's full
    point evicted 295 blocks and hit 0.02 of a 0.58 reusable share). Against it a tiered turn
    would read "between" where the bound itself recomputed: no verdict, and the row says why.
    Where the engine counts no evictions (a server), the full point's hit rate must be the
    reusable share at every turn."""
    off = _row("off", [0.1, 0.9, 1.5], [256, 576, 896])
    leaky = _row("full", [0.1, 1.0, 1.6], [256, 576, 896], evictions=295)
    tiered = _row(GIB, [0.1, 0.95, 1.0], [256, 320, 400])
    compare_tiers(tiered, [off, leaky], "conversation")
    assert tiered["tier_comparison"].startswith("no bound: the kv_tiers=full point evicted 295 cached blocks")
    assert tiered["tier_full_pool_evictions"] == 295 and "tier_turns_between" not in tiered
    assert all("ttft_between" not in t and "ttft_full_s" not in t for t in tiered["turns"])
    # no eviction count: judged by the hit rate against the reusable share
    uncounted = _row("full", [0.1, 0.3, 0.4], [256, 320, 384], evictions=None)
    for t, (hit, share) in zip(uncounted["turns"], [(0.0, 0.0), (0.47, 0.47), (0.2, 0.61)]):
        t.update(hit_rate=hit, reusable_share=share)
    again = _row(GIB, [0.1, 0.35, 1.0], [256, 320, 400])
    compare_tiers(again, [off, uncounted], "conversation")
    assert "hit rate is not the reusable share at turn(s) 3" in again["tier_comparison"]
    uncounted["turns"][2]["hit_rate"] = 0.61
    compare_tiers(again, [off, uncounted], "conversation")
    assert again["tier_turns_compared"] == 3 and again["turns"][1]["ttft_between"] is True


@pytest.mark.parametrize("overrides, field", [
    (["workload=conversation", "workload.kv_tiers=[lots]"], "workload.kv_tiers: 'lots'"),
    (["workload=conversation", "workload.kv_tiers=[1GiB]", "workload.prefix_caching=[false]"],
     "workload.kv_tiers=['1GiB']: KV tiers need prefix caching"),
    (["workload=prefix_sharing", "workload.kv_tiers=[-5]"], "workload.kv_tiers: -5"),
    (["workload=conversation", "workload.kv_tiers=[off,full,1GiB]", "workload.kv_tiers_full_bytes=lots"],
     "workload.kv_tiers_full_bytes: 'lots' is not a size"),
    (["engine_options.reference.kv_offload=true", "engine_options.reference.kv_offload_bytes=lots"],
     "engine_options.reference.kv_offload_bytes"),
    (["engine_options.reference.kv_offload=true", "engine_options.reference.prefix_caching=false"],
     "engine_options.reference.kv_offload=true with prefix_caching=false"),
    (["engine_options.reference.kv_offload=true", "engine_options.reference.kv_offload_dir=/proc"],
     "engine_options.reference.kv_offload_dir=/proc: cannot write there"),
])
def test_bad_tier_input_is_named(overrides, field):
    problems = check_jobs(["engines=[reference]", *overrides])
    assert any(field in p for p in problems), problems


def test_bad_tier_input_exits_2_naming_the_field_and_runs_nothing(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[reference]", "workload=conversation",
                        "workload.kv_tiers=[off,lots]", f"hydra.run.dir={out}"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "workload.kv_tiers" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (out / "results.jsonl").exists()


@pytest.mark.slow
def test_the_reference_engine_end_to_end_with_a_small_first_tier(tmp_path, tiny_ckpt):
    """tiny, 4 sessions of 3 turns, a pool of 20 blocks (less than the histories), kv_tiers off,
    full and 4 MiB: every point ok; with the second tier the hit rate (both tiers) is the reusable
    share to the token at every turn while the pool alone falls below it; the second tier
    supplied hits and says what it moved; the tiered row is compared with the other two."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[reference]", "model=local",
                        f"model.path={tiny_ckpt}",
                        "workload=conversation", "workload.sessions=4", "workload.turns=3", "workload.output_tokens=4",
                        "workload.kv_tiers=[off,full,4MiB]", "workload.prefix_caching=[true]",
                        "engine_options.reference.kv_cache_bytes=1310720", "parity=false", "quiet=true",
                        f"hydra.run.dir={out}"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {str(x["kv_tiers"]): x for x in map(json.loads, (out / "results.jsonl").read_text().splitlines())
            if x["workload"] == "conversation"}
    assert set(rows) == {"off", "full", str(4 << 20)} and all(x["status"] == "ok" for x in rows.values())
    tiered, off = rows[str(4 << 20)], rows["off"]
    assert off["prefix_cache_evictions"] > 0 and off["hit_rate"] < off["reusable_share"] - 0.05
    for t in tiered["turns"]:
        assert t["hit_rate"] == pytest.approx(t["reusable_share"]), t
    assert tiered["tier2"]["hit_tokens"]["2"] > 0 and tiered["tier2"]["bytes_read"] > 0
    assert tiered["hit_rate_tier2"] > 0 and tiered["tier_turns_compared"] == 3
    assert rows["full"]["prefix_cache_evictions"] == 0

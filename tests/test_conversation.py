"""The conversation workload's own logic, with a FAKE engine (FakeReplyEngine: not an inference
engine, a deterministic stand-in that replies with tokens computed from the prompt it got), the
ShareGPT replay, the turn tables and the bad input. The real engines' runs are in
tests/test_conversation_engines.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adapters.base import Capabilities, Engine, KVCacheInfo, TokenEvent, as_source, now_ns, wait_until
from harness.core.presets import load_preset
from workloads.base import Point, RunContext
from workloads.conversation import BlockIndex, Conversation, ConversationConfig, turn_rows
from workloads.datasets import read_chats


def fake_reply(prompt: list[int], n: int) -> list[int]:
    """The FAKE engine's reply: n tokens that depend on every token of the prompt."""
    h = 0
    for t in prompt:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return [4 + (h + 7919 * j) % 997 for j in range(n)]


class FakeReplyEngine(Engine):
    """FAKE, for unit tests of the workload: serves each request as it becomes due, one at a time,
    replying with fake_reply(prompt); reports `cached_tokens` as the longest prefix it has seen
    before (in blocks of 4), so the hit-rate bookkeeping has numbers to carry."""

    name = "fake-reply"
    BLOCK = 4

    def __init__(self, caching: bool = True):
        self.prompts: dict[str, list[int]] = {}
        self.requests: dict[str, Any] = {}  # the requests as handed over (messages, tools)
        self.seen: list[list[int]] = []
        self.caching = caching

    @classmethod
    def capabilities(cls, options=None):
        return Capabilities(prefix_caching=True, continuous_batching=True, paged=True)

    def load(self, model, options):
        raise NotImplementedError

    def prefill(self, prompts, return_logits=False, max_new_tokens=None):
        raise NotImplementedError

    def decode(self, steps, return_logits=False):
        raise NotImplementedError

    def release(self):
        pass

    def kv_cache_info(self):  # "blocks in use": one per prompt served so far (a number to carry)
        return KVCacheInfo(block_size=self.BLOCK, num_blocks=100, blocks_in_use=len(self.seen))

    def reset_prefix_cache(self):
        self.seen = []

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for s in self.seen:
            n = 0
            while n < min(len(s), len(prompt) - 1) and s[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return best // self.BLOCK * self.BLOCK if self.caching else 0

    def serve(self, requests, start_ns):
        source = as_source(requests, start_ns)
        while not source.exhausted():
            due = source.due(now_ns())
            if not due:
                nxt = source.next_due_ns()
                if nxt is None:
                    return
                wait_until(nxt)
                continue
            for r in due:
                self.prompts[r.request_id] = list(r.prompt_ids)
                self.requests[r.request_id] = r
                cached = self._cached(r.prompt_ids)
                reply = fake_reply(r.prompt_ids, r.max_new_tokens)
                self.seen.append(list(r.prompt_ids) + reply[:-1])
                for i, tok in enumerate(reply):
                    yield TokenEvent(r.request_id, i, tok, now_ns(), finished=i == len(reply) - 1,
                                     cached_tokens=cached if i == 0 else None)


@pytest.fixture
def ctx():
    shape = load_preset("tiny")
    return RunContext(shape=shape, dtype="float32", device="cpu", max_model_len=512, memory_sample_hz=0,
                      token_low=4, token_high=shape.vocab_size)


def run(cfg: ConversationConfig, ctx: RunContext, engine: FakeReplyEngine, caching: bool = True) -> dict:
    wl = Conversation()
    return wl.run_point(engine, Point("conversation", {"prefix_caching": caching, "sessions": cfg.sessions}), ctx, cfg)


def test_turn_3_prompt_is_the_history_with_the_engines_own_replies(ctx):
    cfg = ConversationConfig(sessions=3, turns=4, user_tokens=5, output_tokens=3, warmup_sessions=0)
    eng = FakeReplyEngine()
    row = run(cfg, ctx, eng)
    users = Conversation().sessions(cfg, ctx, "conversation/3")
    for s in range(3):
        u = users[s].users
        p1 = u[0]
        r1 = fake_reply(p1, 3)
        p2 = p1 + r1 + u[1]
        r2 = fake_reply(p2, 3)
        p3 = p2 + r2 + u[2]
        assert eng.prompts[f"s{s}t1"] == p1
        assert eng.prompts[f"s{s}t2"] == p2
        assert eng.prompts[f"s{s}t3"] == p3  # token for token: user 1, reply 1, user 2, reply 2, user 3
        assert len(p3) == 5 * 3 + 3 * 2
    assert row["turns_sent"] == 12 and row["completed"] == 12
    t = {r["turn"]: r for r in row["turns"]}
    assert t[3]["prompt_tokens_mean"] == 21 and t[3]["history_tokens_mean"] == 16 and t[3]["new_tokens_mean"] == 5
    # reusable: the history's computed tokens (16 - 1 = 15) in whole blocks of 4 = 12 of 21
    assert t[3]["reusable_share"] == pytest.approx(12 / 21)
    assert t[3]["hit_rate"] == pytest.approx(12 / 21)  # the fake cache supplies exactly that
    assert t[1]["reusable_share"] == 0 and t[1]["hit_rate"] == 0
    # occupancy sampled at each turn's first token: the fake's blocks in use / its 100 blocks
    assert t[1]["kv_occupancy"] == pytest.approx((1 + 2 + 3) / 3 / 100)


def test_system_tokens_head_every_prompt_of_its_session_and_are_reused_from_turn_2(ctx):
    """system_tokens=8: each session's own 8 tokens start each of its prompts; turn 1 can reuse
    none of them (no earlier turn computed them), turn 2 all but whole blocks allow; the model's
    length counts them."""
    cfg = ConversationConfig(sessions=2, turns=2, user_tokens=5, output_tokens=3, system_tokens=8,
                             warmup_sessions=0)
    eng = FakeReplyEngine()
    row = run(cfg, ctx, eng)
    sessions = Conversation().sessions(cfg, ctx, "conversation/2")
    assert [len(s.system) for s in sessions] == [8, 8] and sessions[0].system != sessions[1].system
    for i, s in enumerate(sessions):
        p1 = s.system + s.users[0]
        assert eng.prompts[f"s{i}t1"] == p1
        assert eng.prompts[f"s{i}t2"] == p1 + fake_reply(p1, 3) + s.users[1]
    t = {r["turn"]: r for r in row["turns"]}
    assert t[1]["reusable_share"] == 0 and t[2]["reusable_share"] == pytest.approx(12 / 21)  # 15 computed: 3 blocks
    assert Conversation().max_model_len(cfg) == 8 + 2 * (5 + 3)
    assert Conversation().sessions(ConversationConfig(sessions=1), ctx, "k")[0].system is None


def test_separator_ids_between_messages(ctx):
    cfg = ConversationConfig(sessions=1, turns=2, user_tokens=3, output_tokens=2, separator_ids=[9, 9],
                             warmup_sessions=0)
    eng = FakeReplyEngine()
    row = run(cfg, ctx, eng)
    u = Conversation().sessions(cfg, ctx, "conversation/1")[0].users
    p1 = u[0]
    assert eng.prompts["s0t2"] == p1 + [9, 9] + fake_reply(p1, 2) + [9, 9] + u[1]
    assert "separator ids [9, 9]" in row["prompt_template"]


def test_think_time_delays_the_next_turn_and_ttft_starts_after_it(ctx):
    cfg = ConversationConfig(sessions=2, turns=2, user_tokens=3, output_tokens=2, think_time="fixed",
                             think_time_s=0.05, warmup_sessions=0)
    row = run(cfg, ctx, FakeReplyEngine())
    later = [r for r in row["turn_requests"] if r["turn"] == 2]
    assert later and all(r["ttft_s"] < 0.04 for r in later)  # counted from reply end + think time
    assert row["duration_s"] >= 0.05


def test_closed_loop_runs_every_session(ctx):
    cfg = ConversationConfig(sessions=5, turns=2, user_tokens=3, output_tokens=2, concurrency=2, warmup_sessions=0)
    row = run(cfg, ctx, FakeReplyEngine())
    assert row["turns_sent"] == 10 and row["completed"] == 10 and row["load_mode"] == "closed"


def test_constant_arrival_starts_a_session_every_1_over_rate_and_the_turns_one_at_a_time(ctx):
    """arrival=constant: session i starts at i / session_rate (Poisson's gaps vary), and the row
    says which process it ran (the KV tiers' TTFT measurement spaces sessions so, docs/metrics.md)."""
    cfg = ConversationConfig(sessions=4, turns=2, user_tokens=3, output_tokens=2, session_rate=20.0,
                             arrival="constant", think_time="fixed", think_time_s=0.2, warmup_sessions=0)
    assert [s.start_s for s in Conversation().sessions(cfg, ctx, "k")] == pytest.approx([0.0, 0.05, 0.1, 0.15])
    poisson = Conversation().sessions(ConversationConfig(sessions=4, session_rate=20.0), ctx, "k")
    assert len({round(b.start_s - a.start_s, 6) for a, b in zip(poisson, poisson[1:])}) == 3
    row = run(cfg, ctx, FakeReplyEngine())
    assert row["arrival"] == "constant" and row["completed"] == 8 and row["load_mode"] == "open"


def test_block_index_matches_whole_blocks_of_what_was_computed():
    history = list(range(100, 180))  # 80 tokens computed before (a prompt and its reply but the last token)
    idx = BlockIndex(16)
    idx.add(history[:79])
    prompt = history + list(range(500, 564))  # 144 tokens: the history, then new ones
    assert idx.match(prompt) == 64  # 79 computed tokens: 4 whole blocks
    idx.add(history)
    assert idx.match(prompt) == 80
    assert idx.match(history) == 64  # never the prompt's last token (its logits are needed)
    assert idx.match([1] + prompt[1:]) == 0  # a cache matches from the first token on
    one = BlockIndex(None)
    one.add(history)
    assert one.match(prompt) == 80 and one.match(history[:50] + [7, 7]) == 50
    assert BlockIndex(16).match(prompt) == 0


def test_turn_rows_hit_rate_and_prefilled():
    reqs = [{"turn": 2, "ok": True, "prompt_tokens": 100, "history_tokens": 60, "new_tokens": 40,
             "reusable_tokens": 48, "cached_tokens": 32, "ttft_s": 0.1, "tpot_s": 0.01, "e2el_s": 0.2}] * 2
    (t,) = turn_rows(reqs)
    assert t["hit_rate"] == pytest.approx(0.32) and t["reusable_share"] == pytest.approx(0.48)
    assert t["prefilled_tokens"] == 136 and t["reused_tokens"] == 64
    assert t["hit_minus_reusable"] == pytest.approx(-0.16)


def test_sharegpt_replays_every_human_turn_once_in_order(tmp_path, tiny_ckpt):
    conv = [{"from": "system", "value": "w4"},
            {"from": "human", "value": "w10 w11"}, {"from": "gpt", "value": "w50 w51 w52"},
            {"from": "human", "value": "w12 w13 w14"}, {"from": "gpt", "value": "w53"},
            {"from": "human", "value": "w15"}, {"from": "gpt", "value": "w54 w55"}]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps([{"id": "a", "conversations": conv},
                             {"id": "b", "conversations": [{"from": "human", "value": "w20"},
                                                           {"from": "gpt", "value": "w60 w61"}]}]))
    first = read_chats(p).chats[0]
    assert first.system == "w4" and first.turns == [("w10 w11", "w50 w51 w52"), ("w12 w13 w14", "w53"),
                                                    ("w15", "w54 w55")]
    shape = load_preset("tiny")
    c = RunContext(shape=shape, dtype="float32", device="cpu", model_path=str(tiny_ckpt), max_model_len=256,
                   memory_sample_hz=0, token_low=4, token_high=shape.vocab_size)
    cfg = ConversationConfig(sessions=8, dataset=str(p), warmup_sessions=0)
    eng = FakeReplyEngine()
    row = run(cfg, c, eng)
    # every human turn sent once, in order, each after the engine's reply to the one before; the
    # system turn heads the history
    r1 = fake_reply([4, 10, 11], 3)
    r2 = fake_reply([4, 10, 11] + r1 + [12, 13, 14], 1)
    assert eng.prompts["s0t1"] == [4, 10, 11]
    assert eng.prompts["s0t2"] == [4, 10, 11] + r1 + [12, 13, 14]
    assert eng.prompts["s0t3"] == [4, 10, 11] + r1 + [12, 13, 14] + r2 + [15]
    assert eng.prompts["s1t1"] == [20]
    assert sorted(eng.prompts) == ["s0t1", "s0t2", "s0t3", "s1t1"]
    assert row["sessions"] == 2 and row["turns_sent"] == 4
    caps = {r["request_id"]: r["output_tokens"] for r in row["turn_requests"]}
    assert caps == {"s0t1": 3, "s0t2": 1, "s0t3": 2, "s1t1": 2}  # the recorded replies' lengths


def test_plan_and_bad_input_name_the_field():
    from harness.cli import compose_job
    from harness.config import build_plan
    from harness.core.errors import UserError
    plan = build_plan(compose_job(["engines=[reference]", "workload=conversation"]))
    assert [p.params["prefix_caching"] for p in plan.points if p.workload == "conversation"] == [True, False]
    for override, field in (("workload.turns=0", "workload.turns"),
                            ("workload.think_time=gaussian", "workload.think_time"),
                            ("workload.user_tokens=0", "workload.user_tokens"),
                            ("workload.arrival=constant", "workload.arrival=constant"),
                            ("workload.arrival=steady", "workload.arrival"),
                            ("workload.system_tokens=-1", "workload.system_tokens")):
        with pytest.raises(UserError) as e:
            build_plan(compose_job(["engines=[reference]", "workload=conversation", override]))
        assert any(p.startswith(field) for p in e.value.problems), e.value.problems


def test_report_frame_per_turn_and_pool():
    import pandas as pd

    from reports.data import frame
    from reports.sections.conversation import conversation_frame, hit_frame
    from test_report_fakes import conversation_rows
    df = conversation_frame(frame(conversation_rows()))
    assert len(df) == 2 * 2 * 2 * 4 and set(df["pool"]) == {"KV pool 87,376 tokens", "KV pool 640 tokens"}
    small = df[(df["pool"] == "KV pool 640 tokens") & (df["caching"] == "caching on") & (df["turn"] == 4)]
    assert (small["hit_rate"] < small["reusable_share"]).all()  # the eviction curve
    hf = hit_frame(df)
    assert {s.split(" · ")[-1] for s in hf["series"]} == {"hit rate", "reusable share"}
    assert isinstance(hf, pd.DataFrame)


def test_report_tier_panel_frames():
    """The KV-tier panel's data: one line per tier mode (the eviction curve with and without the
    second tier) beside one reusable-share line; per turn the shares of tier-1 hits, tier-2 hits
    and misses add up to one; a run without tiers has no panel."""
    from reports.data import frame
    from reports.sections.conversation import conversation_frame, hit_frame, tier_frame
    from test_report_fakes import conversation_rows, conversation_tier_rows
    df = conversation_frame(frame(conversation_tier_rows()))
    t = tier_frame(df)
    assert set(t["tiers"]) == {"pool alone (recompute)", "full pool (bound)", "+ tier 2 of 64 MiB"}
    curve = hit_frame(t)
    assert sorted(set(curve["series"])) == [
        "reference · + tier 2 of 64 MiB · hit rate", "reference · full pool (bound) · hit rate",
        "reference · pool alone (recompute) · hit rate", "reference · reusable share"]
    shares = t["hit_rate_tier1"] + t["hit_rate_tier2"] + t["miss_share"]
    assert (abs(shares - 1) < 1e-12).all()
    tiered = t[(t["tiers"] == "+ tier 2 of 64 MiB") & (t["turn"] == 4)].iloc[0]
    assert tiered["hit_rate_tier2"] > 0 and abs(tiered["hit_rate"] - tiered["reusable_share"]) < 1e-12
    # the values table's tiered / full ratio and its interval (compare_tiers) reach the frame
    assert tiered["ttft_over_full"] > 1 and tiered["ttft_over_full_ci"][0] < tiered["ttft_over_full"]
    assert tier_frame(conversation_frame(frame(conversation_rows()))).empty

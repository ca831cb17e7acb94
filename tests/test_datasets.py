"""Datasets as users have them (workloads/datasets.py): ShareGPT as real logs hold it (role names,
system turns, two messages of one role in a row, empty replies, unanswered questions) and the chat
format (JSONL of {"messages": [...]}), replayed by `conversation` (every answered turn, once, in
order) and by `serving` (ShareGPT: the first answered turn; chat: the last answered user message
with its history), every skip counted by reason in the row. The engine here is the FAKE reply
engine of tests/test_conversation.py (a deterministic stand-in, not an inference engine)."""

from __future__ import annotations

import json

import pytest

from harness.core.errors import UserError
from harness.core.presets import load_preset
from test_conversation import FakeReplyEngine, fake_reply, run
from workloads.base import RunContext
from workloads.conversation import ConversationConfig

# Four conversations as ShareGPT logs hold them (the 4-conversation file of issue 54: 2 sessions replayed
# before, nothing said why): a system turn; two human messages in a row; an empty reply and an unanswered
# last question; a conversation that starts with a reply and has no question at all.
EDGE = [
    {"id": "a", "conversations": [{"from": "system", "value": "w4 w5"},
                                  {"from": "human", "value": "w10"}, {"from": "gpt", "value": "w50 w51"},
                                  {"from": "user", "value": "w12"}, {"from": "chatgpt", "value": "w52"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "w20"}, {"from": "human", "value": "w21 w22"},
                                  {"from": "gpt", "value": "w60 w61 w62"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "w30"}, {"from": "gpt", "value": ""},
                                  {"from": "human", "value": "w31"}, {"from": "assistant", "value": "w70"},
                                  {"from": "human", "value": "w32"}]},
    {"id": "d", "conversations": [{"from": "gpt", "value": "w80"}]},
]
EDGE_SKIPS = {"message: empty reply": 1, "message: unanswered last question": 1,
              "message: reply before any question": 1, "conversation: no answered turn": 1}


@pytest.fixture
def tctx(tiny_ckpt):
    shape = load_preset("tiny")
    return RunContext(shape=shape, dtype="float32", device="cpu", model_path=str(tiny_ckpt), max_model_len=512,
                      memory_sample_hz=0, token_low=4, token_high=shape.vocab_size)


def test_sharegpt_as_logs_hold_it_replays_every_answered_turn_once_in_order(tmp_path, tctx):
    p = tmp_path / "edge.json"
    p.write_text(json.dumps(EDGE))
    eng = FakeReplyEngine()
    row = run(ConversationConfig(sessions=8, dataset=str(p), warmup_sessions=0), tctx, eng)
    # a, b and c have answered turns: three sessions (before: only a, and nothing said why)
    assert row["sessions"] == 3 and sorted(eng.prompts) == ["s0t1", "s0t2", "s1t1", "s2t1"]
    # the system turn heads the history of every turn; the engine's own reply takes the recorded one's place
    assert eng.prompts["s0t1"] == [4, 5, 10]
    assert eng.prompts["s0t2"] == [4, 5, 10] + fake_reply([4, 5, 10], 2) + [12]
    assert eng.prompts["s1t1"] == [20, 21, 22]  # two human messages in a row: one turn, both messages as logged
    assert eng.prompts["s2t1"] == [30, 31]  # the question whose reply was empty (no request), and the one after it
    caps = {r["request_id"]: r["output_tokens"] for r in row["turn_requests"]}
    assert caps == {"s0t1": 2, "s0t2": 1, "s1t1": 3, "s2t1": 1}
    assert row["dataset_conversations"] == 4 and row["dataset_format"] == "sharegpt"
    assert row["dataset_skipped"] == EDGE_SKIPS and row["dataset_merged"] == 0  # sent as logged, not merged
    # the turn before the first reply is not reusable: nothing of this session was computed before it
    first = next(r for r in row["turn_requests"] if r["request_id"] == "s0t1")
    assert first["history_tokens"] == 0 and first["reusable_tokens"] == 0 and first["new_tokens"] == 3


def serve(cfg, tctx, eng: FakeReplyEngine) -> dict:
    from workloads.serving import Serving
    return Serving().measure(eng, cfg, tctx, {"request_rate": float("inf"), "num_requests": cfg.num_requests},
                             "serving:ds")


def test_sharegpt_in_serving_takes_each_conversations_first_answered_turn(tmp_path, tctx):
    from workloads.serving import ServingConfig
    p = tmp_path / "edge.json"
    p.write_text(json.dumps(EDGE))
    eng = FakeReplyEngine()
    row = serve(ServingConfig(num_requests=3, dataset=str(p), dataset_order="file", warmup_requests=1), tctx, eng)
    # the system turn at the head; two human messages in a row, and a question, an empty reply and the next
    # question, one prompt each (the warm-up request r0 is the measured r0's entry: the file's order)
    assert sorted(map(tuple, eng.prompts.values())) == sorted([(4, 5, 10), (20, 21, 22), (30, 31)])
    assert row["completed"] == 3 and row["total_output_tokens"] == 2 + 3 + 1
    assert row["dataset_entries"] == 3 and row["dataset_skipped"] == EDGE_SKIPS and row["dataset_merged"] == 2
    assert row["dataset_format"] == "sharegpt" and row["dataset_conversations"] == 4


CHAT = [
    {"messages": [{"role": "system", "content": "w4"}, {"role": "user", "content": "w10 w11"},
                  {"role": "assistant", "content": "w50"}, {"role": "user", "content": [{"type": "text", "text": "w12"}]},
                  {"role": "assistant", "content": "w51 w52 w53"}]},
    {"messages": [{"role": "user", "content": "w20"}, {"role": "assistant", "content": "w60 w61"},
                  {"role": "user", "content": "w21"}]},  # the last question unanswered: its turn before is the prompt
    {"messages": [{"role": "function", "content": "w90"}, {"role": "user", "content": "w30"},
                  {"role": "assistant", "content": "w70"}]},  # the legacy function role: unknown, counted
    {"text": "not a conversation"},
]


def _chat_file(tmp_path):
    p = tmp_path / "chat.jsonl"
    p.write_text("\n".join(json.dumps(c) for c in CHAT) + "\n")
    return p


def test_chat_format_in_serving_is_the_last_answered_user_message_with_its_history(tmp_path, tctx):
    from workloads.datasets import read_dataset, tokenize_requests
    from workloads.serving import ServingConfig
    p = _chat_file(tmp_path)
    entries = read_dataset(p)
    assert entries.format == "chat" and len(entries) == 3
    reqs = tokenize_requests(entries, tctx.model_path, 4096)
    # the history (system turn, earlier message, its recorded reply) then the last answered question
    assert reqs[0].prompt_ids == [4, 10, 11, 50, 12] and reqs[0].output_tokens == 3
    assert [m["role"] for m in reqs[0].messages] == ["system", "user", "assistant", "user"]
    assert reqs[1].prompt_ids == [20] and reqs[1].output_tokens == 2 and reqs[1].messages is None
    assert reqs[2].prompt_ids == [30] and reqs[2].output_tokens == 1
    eng = FakeReplyEngine()
    row = serve(ServingConfig(num_requests=3, dataset=str(p), dataset_order="file", warmup_requests=1), tctx, eng)
    assert row["completed"] == 3 and row["total_input_tokens"] == 5 + 1 + 1 and row["total_output_tokens"] == 6
    assert row["dataset_skipped"] == {"conversation: not a conversation": 1, "message: unanswered last question": 1,
                                      "message: unknown role": 1}


def test_chat_format_in_conversation_replays_every_user_turn_in_order(tmp_path, tctx):
    p = _chat_file(tmp_path)
    eng = FakeReplyEngine()
    row = run(ConversationConfig(sessions=8, dataset=str(p), warmup_sessions=0), tctx, eng)
    assert row["sessions"] == 3 and row["dataset_format"] == "chat" and row["dataset_conversations"] == 4
    r1 = fake_reply([4, 10, 11], 1)
    assert eng.prompts["s0t1"] == [4, 10, 11] and eng.prompts["s0t2"] == [4, 10, 11] + r1 + [12]
    assert eng.prompts["s1t1"] == [20] and eng.prompts["s2t1"] == [30] and "s1t2" not in eng.prompts
    caps = {r["request_id"]: r["output_tokens"] for r in row["turn_requests"]}
    assert caps == {"s0t1": 1, "s0t2": 3, "s1t1": 2, "s2t1": 1}


def test_a_history_longer_than_max_len_is_cut_and_counted(tmp_path, tctx):
    p = tmp_path / "long.json"
    p.write_text(json.dumps([{"conversations": [{"from": "human", "value": "w10 w11 w12"},
                                                {"from": "gpt", "value": "w50 w51"},
                                                {"from": "human", "value": "w13 w14 w15"},
                                                {"from": "gpt", "value": "w52 w53"}]}]))
    row = run(ConversationConfig(sessions=8, dataset=str(p), warmup_sessions=0, max_len=8), tctx, FakeReplyEngine())
    assert row["turns_sent"] == 1 and row["dataset_skipped"] == {"turn: beyond workload.max_len": 1}


@pytest.mark.parametrize("lines,fmt", [
    ([{"messages": [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}]}], "chat"),
    ([{"conversations": [{"from": "human", "value": "w5"}, {"from": "gpt", "value": "w6"}]}], "sharegpt"),
    ([{"prompt": "w5", "output_tokens": 2}], "jsonl"),
])
def test_a_jsonl_files_format_is_told_by_its_first_line(tmp_path, lines, fmt):
    from workloads.datasets import detect_format, read_dataset
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines))
    assert detect_format(p) == fmt and read_dataset(p).format == fmt


def test_a_file_with_nothing_to_replay_says_why(tmp_path):
    from workloads.datasets import read_chats
    p = tmp_path / "none.json"
    p.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "w1"}]},
                             {"conversations": [{"from": "human", "value": "w2"}, {"from": "gpt", "value": ""}]}]))
    with pytest.raises(UserError) as e:
        read_chats(p)
    (msg,) = e.value.problems
    assert msg.startswith(f"workload.dataset={p}: no conversation") and "1 empty reply" in msg
    assert "2 no answered turn" in msg


def test_the_end_of_run_line_counts_the_skips():
    from workloads.datasets import skips_line
    line = skips_line({"dataset": "x.json", "dataset_conversations": 4, "dataset_skipped": EDGE_SKIPS,
                       "dataset_merged": 2})
    assert line.startswith("dataset x.json (4 conversations): skipped 1 no answered turn, 1 empty reply")
    assert "2 messages merged" in line
    assert skips_line({"dataset": "x.json", "dataset_skipped": {}, "dataset_merged": 0}) == ""

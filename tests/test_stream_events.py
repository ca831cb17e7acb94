"""The stream reader's plain-chunk path (adapters/endpoint/stream._plain_chunk: the load generator's
ceiling is its cost per event) gives the same request state as reading every event whole."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from adapters.endpoint import stream


def completion(ids: list[int] | None, finish: str | None = None, text: str = "x", **extra) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return orjson.dumps({"id": "c", "object": "text_completion", "choices": [choice], "usage": None, **extra})


def usage(completion_tokens: int, prompt_tokens: int) -> bytes:
    return orjson.dumps({"id": "c", "choices": [], "usage": {"completion_tokens": completion_tokens,
                                                           "prompt_tokens": prompt_tokens}})


# one stream as vLLM or infer-bench-serve send it, with the events that must leave the plain path
# mixed in: two ids in one chunk, server timings, a chunk without ids, the finish, usage, [DONE]
EVENTS = [completion([11]), completion([12]), completion([13, 14]), completion([15]),
          completion([16], timings={"predicted_n": 6}), completion([17]), completion(None, text="y"),
          completion([18]), completion([19], finish="length"), usage(9, 5), b"[DONE]"]


def read(events: list[bytes], may_stop: bool, plain: bool, monkeypatch) -> tuple[list[dict], list, int]:
    """The request's state after each event, the on_tokens calls, how many events the plain path took."""
    taken = []
    real = stream._plain_chunk

    def plain_chunk(*a):
        done = plain and real(*a)
        taken.append(done)
        return done

    monkeypatch.setattr(stream, "_plain_chunk", plain_chunk)
    state = stream.ReqState("r", 5, 9, may_stop=may_stop)
    calls, states, ends = [], [], []
    for i, e in enumerate(events):
        ends.append(stream._event(state, e, 1000 + i, lambda s, first, n: calls.append((first, n))))
        states.append(dataclasses.asdict(state))
    assert ends == [False] * (len(events) - 1) + [True]
    return states, calls, sum(taken)


@pytest.mark.parametrize("may_stop", [False, True])
def test_the_plain_path_gives_the_state_reading_every_event_whole_gives(may_stop, monkeypatch):
    fast, fast_calls, taken = read(EVENTS, may_stop, True, monkeypatch)
    whole, whole_calls, _ = read(EVENTS, may_stop, False, monkeypatch)
    assert fast == whole and fast_calls == whole_calls
    assert whole[-1]["token_ids"][:2] == [11, 12] and whole[-1]["finish_reason"] == "length"
    # the plain path took the single-id chunks after the first token (not where the text is kept)
    assert taken == (0 if may_stop else 5)

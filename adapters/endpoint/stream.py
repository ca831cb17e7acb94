"""One streamed completion over HTTP: the request body, the Server-Sent Events it answers
with, and what the client saw (tokens with their arrival times, chunks, the server's usage).

Token counting (docs/metrics.md, "Over HTTP"): tokens, not chunks. Per chunk, in this order:
  1. `choices[0].token_ids` (vLLM and infer-bench-serve with `return_token_ids: true`);
  2. the entries of `choices[0].logprobs.tokens` (servers that return logprobs), or the ids of
     `choices[0].logprobs.content` (a server with llama.cpp's `n_probs`: ids, not only a count);
     or the `tokens` of the chunk's `__verbose` (llama-server with `verbose: true`);
  3. the growth of `usage.completion_tokens` (servers that send usage on every chunk:
     `stream_options.continuous_usage_stats`);
  4. otherwise one token per chunk that carries text (then the final usage decides: a
     difference is flagged as a token-count mismatch, never averaged away).
Timing: every token of a chunk is stamped in the reading loop with the time
(`adapters.base.now_ns()`) at which the loop read the bytes that completed its event off the
socket: aiohttp's connection protocol is subclassed to stamp each socket read
(`StampedHandler.data_received`) before the bytes are parsed or the stream's task runs, so time the
loop spends on other streams' events in the same pass is not charged to this one. Tokens that
arrive together are 0 s apart. Nothing is handed to another thread per token.

Transport: aiohttp (as `vllm bench serve`), the body read in whatever pieces the socket gives
(`iter_any`), split into events on blank lines, each event's data parsed with orjson. Measured
against httpx's line iterator and aiohttp's own line iterator on a known-timing server
(scripts/loadgen_ceiling.py --profile, docs/metrics.md "Client distortion").
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler

from adapters.base import now_ns

try:
    import orjson

    loads: Callable[[bytes], Any] = orjson.loads
    dumps: Callable[[Any], bytes] = orjson.dumps
except ImportError:  # pragma: no cover - orjson is a dependency; the standard library is the fallback
    loads = json.loads

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

class StampedHandler(ResponseHandler):
    """aiohttp's connection protocol, stamping every socket read with the time the loop read it
    (`read_ns`), before the bytes are parsed or any reading task runs."""

    read_ns = 0

    def data_received(self, data: bytes) -> None:
        if data:
            self.read_ns = now_ns()
        super().data_received(data)


def stamp_reads(connector: aiohttp.BaseConnector) -> None:
    """Make `connector`'s connections StampedHandler (aiohttp builds them with its `_factory`)."""
    factory = getattr(connector, "_factory", None)
    if isinstance(factory, functools.partial) and factory.func is ResponseHandler:
        connector._factory = functools.partial(StampedHandler, *factory.args, **factory.keywords)


def read_clock(resp: aiohttp.ClientResponse) -> Callable[[], int]:
    """When the bytes a read just returned came off the socket: the connection's last socket
    read (StampedHandler), else now."""
    proto = resp.connection.protocol if resp.connection is not None else None
    if isinstance(proto, StampedHandler):
        return lambda: proto.read_ns or now_ns()
    return now_ns


ITL_CHUNKING = ("per token; the tokens of one SSE chunk all get that chunk's arrival time (ITL 0 between "
                "them); itl_chunk_s gives the gaps between chunks instead")


@dataclass
class ReqState:
    """What the client saw of one request."""

    request_id: str
    prompt_len: int
    expected: int  # tokens asked for (max_tokens)
    scheduled_ns: int = 0
    ready_ns: int = 0  # when it could be sent: its scheduled time, or later when a concurrency cap held it
    sent_ns: int | None = None
    token_ids: list[int] = field(default_factory=list)
    token_times: list[int] = field(default_factory=list)
    chunk_times: list[int] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    usage_completion: int | None = None
    usage_prompt: int | None = None
    usage_cached: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server sends it
    server_timings: dict[str, Any] | None = None  # the server's own per-response `timings` (llama-server: prompt_ms ...)
    prompt_ids_server: list[int] | None = None  # the prompt's ids as the server says it prefilled them
    prompt_ids_client: list[int] | None = None  # ... as the client made them (api=chat: the templated prompt)
    finish_reason: str | None = None
    count_source: str | None = None
    error: str | None = None  # the full reason
    error_class: str | None = None  # a short reason (for counting)
    done: bool = False
    cancelled: bool = False
    # structured output: the reply may end before `expected` tokens (finish_reason stop), and its
    # text is kept (`text`: the chunks' text or delta content, as the server sent it)
    may_stop: bool = False
    text: str = ""
    # reasoning (a chat stream; docs/metrics.md, "Reasoning"): when the first answer text or tool
    # call arrived (None: none did), the reasoning deltas' text and field, and the server's count
    first_answer_ns: int | None = None
    reasoning_field: str | None = None  # reasoning_content | reasoning: the delta field it came in
    reasoning_text: str = ""
    usage_reasoning: int | None = None  # usage.completion_tokens_details.reasoning_tokens (SGLang: usage.reasoning_tokens)
    _usage_seen: int = 0

    @property
    def ok(self) -> bool:
        return self.done and self.error is None and not self.cancelled

    def fail(self, cls: str, detail: str) -> None:
        if self.error is None:
            self.error_class, self.error = cls, detail


def error_message(resp_text: str) -> str:
    """The server's own words from an error body (OpenAI `{"error": {"message"}}`, FastAPI
    `{"detail"}`, or the text)."""
    try:
        body = json.loads(resp_text)
    except ValueError:
        return resp_text.strip()[:300]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
        for k in ("message", "detail", "error"):
            if body.get(k):
                return str(body[k])[:300]
    return resp_text.strip()[:300]


def http_reason(status: int, phrase: str, text: str) -> tuple[str, str]:
    cls = f"HTTP {status} {phrase}".strip()
    msg = error_message(text)
    return cls, f"{cls}: {msg}" if msg else cls


def chunk_tokens(choice: dict[str, Any], usage: dict[str, Any] | None, usage_seen: int,
                 verbose: Any = None) -> tuple[list[int] | None, int, str]:
    """(token ids or None, number of tokens, how they were counted) of one chunk's choice;
    `verbose`: the chunk's `__verbose` (llama-server with `verbose: true`: its native chunk)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return [int(t) for t in ids], len(ids), "token_ids"
    ids = verbose.get("tokens") if isinstance(verbose, dict) else None
    if isinstance(ids, list):  # llama-server: every streamed token's id, speculative ones included
        return [int(t) for t in ids], len(ids), "verbose_tokens"
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        return None, len(lp["tokens"]), "logprobs"
    if isinstance(lp, dict) and isinstance(lp.get("content"), list) and all(
            isinstance(c, dict) and isinstance(c.get("id"), int) for c in lp["content"]):
        # llama-server (n_probs: each generated token's entry carries its id)
        return [int(c["id"]) for c in lp["content"]], len(lp["content"]), "logprobs_ids"
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return None, max(0, usage["completion_tokens"] - usage_seen), "usage"
    delta = choice.get("delta")
    text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
    return None, 1 if text else 0, "chunks"


# the chat delta fields a server streams reasoning in: vLLM 0.32 `reasoning`
# (entrypoints/generate/base/protocol.py DeltaMessage), SGLang `reasoning_content`
REASONING_FIELDS = ("reasoning_content", "reasoning")


class SSEError(Exception):
    """The stream broke the Server-Sent Events / OpenAI streaming format."""


OnTokens = Callable[[ReqState, int, int], None] | None


def _plain_chunk(state: ReqState, obj: dict[str, Any], t: int, on_tokens: OnTokens) -> bool:
    """The common event, handled with few lookups: a completion chunk of one choice with its one
    token's id (`token_ids`), no usage, no delta, no prompt ids, no server timings, once the first token came
    and where the text is not kept. False (nothing done) for any other event: `_event` then reads
    it whole. The load generator's ceiling is this path's cost per event (docs/metrics.md)."""
    choices = obj.get("choices")
    if (state.first_answer_ns is None or state.may_stop or type(choices) is not list or len(choices) != 1
            or obj.get("usage") is not None or "timings" in obj or "prompt_token_ids" in obj or "error" in obj):
        return False
    choice = choices[0]
    if type(choice) is not dict or "delta" in choice or "prompt_token_ids" in choice:
        return False
    ids = choice.get("token_ids")
    if type(ids) is not list or len(ids) != 1 or type(ids[0]) is not int:
        return False
    if (finish := choice.get("finish_reason")):
        state.finish_reason = finish
    first = len(state.token_ids)
    state.count_source = "token_ids"
    state.token_ids.append(ids[0])
    state.token_times.append(t)
    if first >= state._usage_seen:
        state._usage_seen = first + 1
    state.chunk_times.append(t)
    state.chunk_sizes.append(1)
    if on_tokens is not None:
        on_tokens(state, first, 1)
    return True


def _event(state: ReqState, payload: bytes, t: int, on_tokens: OnTokens) -> bool:
    """Handle one event's data; True at `[DONE]`."""
    if payload[:1] != b"{" and payload.strip() == b"[DONE]":
        return True
    try:
        obj = loads(payload)
    except ValueError:
        raise SSEError(f"a data line is not JSON: {payload[:80]!r}") from None
    if not isinstance(obj, dict):
        raise SSEError(f"a data line is not a JSON object: {payload[:80]!r}")
    if _plain_chunk(state, obj, t, on_tokens):
        return False
    if "error" in obj and not obj.get("choices"):
        err = obj["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        raise SSEError(f"the server sent an error in the stream: {str(msg)[:300]}")
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        usage = None
    if isinstance(obj.get("timings"), dict):
        state.server_timings = obj["timings"]
    choices = obj.get("choices")
    if choices is not None and not isinstance(choices, list):
        raise SSEError("`choices` is not a list")
    new = first = 0
    if state.prompt_ids_server is None and isinstance(obj.get("prompt_token_ids"), list):
        state.prompt_ids_server = obj["prompt_token_ids"]  # a chat stream's first chunk (vLLM: return_token_ids)
    for choice in choices or ():
        if not isinstance(choice, dict):
            raise SSEError("a choice is not an object")
        if state.prompt_ids_server is None and isinstance(choice.get("prompt_token_ids"), list):
            state.prompt_ids_server = choice["prompt_token_ids"]
        ids, n, source = chunk_tokens(choice, usage, state._usage_seen, obj.get("__verbose"))
        delta = choice.get("delta")
        if isinstance(delta, dict):  # a chat chunk: reasoning apart from the answer
            for key in REASONING_FIELDS:
                piece = delta.get(key)
                if isinstance(piece, str) and piece:
                    state.reasoning_text += piece
                    state.reasoning_field = key
            if state.first_answer_ns is None and (delta.get("content") or delta.get("tool_calls")):
                state.first_answer_ns = t
        elif n and state.first_answer_ns is None:  # a completion has no reasoning: its first token answers
            state.first_answer_ns = t
        if n:
            state.count_source = source
            first = len(state.token_ids)
            state.token_ids += ids if ids is not None else [-1] * n
            state.token_times += [t] * n
            new += n
            if source != "usage":  # tokens counted from this chunk: usage beside them (llama-server's last
                state._usage_seen = max(state._usage_seen, len(state.token_ids))  # chunk) grows past them only
        if state.may_stop:
            delta = choice.get("delta")
            piece = choice.get("text") if "text" in choice else (delta.get("content") if isinstance(delta, dict)
                                                                 else None)
            if isinstance(piece, str):
                state.text += piece
        if choice.get("finish_reason"):
            state.finish_reason = choice["finish_reason"]
    if usage is not None:
        if isinstance(usage.get("completion_tokens"), int):
            state.usage_completion = usage["completion_tokens"]
            state._usage_seen = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            state.usage_prompt = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            state.usage_cached = details["cached_tokens"]
        out_details = usage.get("completion_tokens_details")
        if isinstance(out_details, dict) and isinstance(out_details.get("reasoning_tokens"), int):
            state.usage_reasoning = out_details["reasoning_tokens"]
        elif isinstance(usage.get("reasoning_tokens"), int):  # SGLang's UsageInfo
            state.usage_reasoning = usage["reasoning_tokens"]
    if new:
        state.chunk_times.append(t)
        state.chunk_sizes.append(new)
        if on_tokens is not None:
            on_tokens(state, first, new)
    return False


_FIELDS = (b":", b"event:", b"id:", b"retry:")


def _data(block: bytes) -> bytes | None:
    """The data of one event (its `data:` lines joined), or None for an event without data."""
    if block.startswith(b"data:") and b"\n" not in block:  # the common case: one data line
        return block[6:] if block[5:6] == b" " else block[5:]
    data = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            data.append(line[6:] if line[5:6] == b" " else line[5:])
        elif line and not line.startswith(_FIELDS):
            raise SSEError(f"not a Server-Sent Events line: {line[:80]!r}")
    return b"\n".join(data) if data else None


async def read_events(content: aiohttp.StreamReader, state: ReqState, on_tokens: OnTokens,
                      clock: Callable[[], int] = now_ns) -> bool:
    """Read the events of a response body into `state` as the socket gives them; True once
    `[DONE]` came. Every event completed by one read is stamped with `clock()` after it: when
    the bytes came off the socket (`read_clock`), else the read's time."""
    buf = b""
    while True:
        piece = await content.readany()
        if not piece:
            break
        t = clock()
        more = content.read_nowait()  # everything else already buffered (aiohttp hands out one HTTP chunk a time)
        if more:
            piece += more
        buf = buf + piece if buf else piece
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        if b"\n\n" not in buf:
            continue
        *blocks, buf = buf.split(b"\n\n")
        for block in blocks:
            payload = _data(block)
            if payload is not None and _event(state, payload, t, on_tokens):
                return True
    payload = _data(buf.strip(b"\n")) if buf.strip() else None  # a last event without its blank line
    return payload is not None and _event(state, payload, now_ns(), on_tokens)


async def _drain(content: aiohttp.StreamReader) -> None:
    """Read what follows `[DONE]` (the body's end), so the connection is kept for the next request."""
    try:
        async with asyncio.timeout(2):
            async for _ in content.iter_any():
                pass
    except (TimeoutError, aiohttp.ClientError):
        pass


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict[str, Any] | bytes,
                            state: ReqState, on_tokens: OnTokens, timeout_s: float) -> None:
    """POST `body` (stream: true; a dict, or JSON already encoded) and read the events into
    `state`; `on_tokens(state, first, n)` after every chunk that added tokens (None: no call).
    Never raises for the server's or the network's faults: they end up in state.error.
    Cancellation (release) closes the connection."""
    data = body if isinstance(body, bytes) else dumps(body)
    n_of = lambda: f"{len(state.token_ids)} of {state.expected} tokens"  # noqa: E731
    state.sent_ns = now_ns()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, data=data, headers=_JSON_HEADERS) as resp:
                if resp.status >= 400:
                    text = (await resp.read()).decode("utf-8", "replace")
                    state.fail(*http_reason(resp.status, resp.reason or "", text))
                    return
                if not await read_events(resp.content, state, on_tokens, read_clock(resp)):
                    state.fail("stream ended early (no [DONE])",
                               f"the stream ended after {n_of()} without [DONE]")
                else:
                    await _drain(resp.content)
    except SSEError as e:
        state.fail("malformed SSE", f"malformed SSE after {n_of()}: {e}")
    except aiohttp.ClientConnectorError as e:
        state.fail("connection failed", f"cannot connect to {url}: {e.os_error or e}")
    except aiohttp.ServerTimeoutError as e:
        state.fail("timeout", f"{type(e).__name__} after {n_of()}")
    except TimeoutError:
        state.fail("timeout", f"no complete answer within {timeout_s:g} s (request_timeout_s) after {n_of()}")
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as e:
        state.fail("connection closed by the server",
                   f"the server closed the connection after {n_of()} ({type(e).__name__}: {e})")
    except aiohttp.ClientError as e:
        state.fail(type(e).__name__, f"{type(e).__name__}: {e}")
    except asyncio.CancelledError:
        state.cancelled = True
        raise
    finally:
        state.done = True
        if state.error is None and not state.cancelled:
            n = len(state.token_ids)
            if n < state.expected and state.may_stop and state.finish_reason == "stop" and n:
                pass  # a constrained reply that was complete before its token limit
            elif n < state.expected:
                state.fail("fewer tokens than asked",
                           f"the server sent {n} of the {state.expected} tokens asked for "
                           f"(finish_reason={state.finish_reason})")
            elif n > state.expected:
                state.fail("more tokens than asked",
                           f"the server sent {n} tokens, more than the {state.expected} asked for "
                           "(max_tokens ignored?)")


_JSON_HEADERS = {"Content-Type": "application/json"}

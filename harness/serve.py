"""`infer-bench-serve`: the reference engine behind an OpenAI-compatible HTTP server.

    infer-bench-serve model=tiny port=18123 [dtype=...] [device=...] [engine_options.<opt>=...]

Serves on http://HOST:PORT until SIGINT/SIGTERM (FastAPI on uvicorn):
  POST /v1/completions   streamed (SSE) or not; prompt as token ids or text; `max_tokens`,
                         `ignore_eos`, `min_tokens`, `return_token_ids`, `stream_options.include_usage`
                         (and `continuous_usage_stats`), `prompt_logprobs` (teacher-forced scores)
  POST /v1/chat/completions  the same fields with `messages` (text content; assistant tool_calls,
                         tool messages) and `tools` instead of `prompt`: the prompt is the
                         tokenizer's chat template applied to them with the tools
                         (adapters.chat.template_ids, add_generation_prompt; chat_template=FILE
                         replaces the checkpoint's own); chunks carry `delta.content`. Usage carries
                         `prompt_tokens_details.cached_tokens` (the prefix cache's share).
  GET  /v1/models, /health, /version, /metrics (Prometheus)
  POST /reset_prefix_cache
Decoding is greedy (the reference engine's only mode; `temperature` is accepted and ignored).

One thread owns the engine core (adapters/reference/llm_engine.py's LLMEngine, not the harness's
adapter) and drives it with its online API (add_request / step / has_work / abort; score and
reset_prefix_cache when it is idle); the HTTP handlers talk to it through a command queue, and
it hands every token to the request's asyncio queue (loop.call_soon_threadsafe). Configuration
is composed by Hydra from conf/serve.yaml (with the `model` group of conf/model/); bad input
exits 2 with one message per problem, a port in use too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from adapters.base import Request as EngineRequest
from adapters.chat import template_ids
from harness.core.version import __version__
from harness.core.constraints import KINDS, Constraint, constraint_problems
from harness.core.errors import EXIT_BAD_INPUT, UserError
from harness.core.hub import is_hub_model, register_hub_shorthands, resolve_model
from harness.core.paths import CONF_DIR
from harness.core.schema import check, spec

USAGE = """usage: infer-bench-serve [key=value ...]   (Hydra overrides of conf/serve.yaml)

  model=tiny | small | ... | local model.path=DIR   the model (a preset is materialised locally)
  model=ORG/NAME [model.revision=REV]             a model on the Hugging Face Hub, by its id (its
                                                  snapshot in your HF cache; served under the id)
  host=127.0.0.1 port=18123 (port=0: any free port)  where to listen
  dtype=auto|float32|bfloat16|float16 device=auto|cpu|cuda|cuda:N
  served_model_name=NAME  max_model_len=N  api_key_env=VAR  engine_options.<option>=VALUE
Serves until SIGINT/SIGTERM. See docs/endpoints.md."""


@dataclass
class ServeSettings:
    host: str = spec("127.0.0.1", help="address to listen on")
    port: int = spec(18123, ge=0, le=65535, help="TCP port (0: any free port, printed at start)")
    dtype: str = spec("auto", choices=("auto", "float32", "bfloat16", "float16"), help="weights dtype")
    device: str = spec("auto", help="auto | cpu | cuda | cuda:N")
    served_model_name: str | None = spec(None, help="the model's name in the API (null: the model's name)")
    max_model_len: int | None = spec(None, ge=2, help="longest sequence (null: the model's positions)")
    api_key_env: str | None = spec(None, help="demand `Authorization: Bearer <$VAR>` on /v1/*")
    model_cache_dir: str | None = spec(None, help="where presets are materialised")
    seed: int = spec(0, ge=0, help="checkpoint seed of a preset")
    chat_template: str | None = spec(None, help="a Jinja chat template file for /v1/chat/completions "
                                     "(null: the checkpoint's own)")
    log_level: str = spec("warning", choices=("critical", "error", "warning", "info", "debug"),
                          help="uvicorn's log level")


# ---- the engine's thread ------------------------------------------------------------------------

class Sink:
    """A request's asyncio queue, fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


@dataclass
class AddRequest:
    """Admit `request`; its tokens (or its error) go to `sink`."""

    request: Any
    sink: Sink


@dataclass
class AbortRequest:
    """Drop a request (its client left)."""

    request_id: str


@dataclass
class CallEngine:
    """Run `fn(engine)` when the engine is idle; its result (or error) goes to `future`."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


@dataclass
class Wake:
    """Nothing to do: wakes the loop (to see that it is stopping)."""


Command = AddRequest | AbortRequest | CallEngine | Wake


class EngineThread(threading.Thread):
    """Owns the engine: admits requests, steps while there is work, runs calls (scores, prefix
    resets) when the engine is idle, and keeps a snapshot of its state for /metrics."""

    def __init__(self, engine: Any):
        super().__init__(name="engine", daemon=True)
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[str, Sink] = {}
        self.first_token: set[str] = set()
        self.calls: list[CallEngine] = []
        self.waiting_adds: list[AddRequest] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.stats: dict[str, Any] = {"running": 0, "waiting": 0, "kv_usage": 0.0, "hits": 0, "queries": 0,
                                      "preemptions": 0, "config": {}, "steps": 0}
        self._snap_t = 0.0

    # called from the HTTP side
    def add(self, request: Any, sink: Sink) -> None:
        self.inbox.put(AddRequest(request, sink))

    def abort(self, request_id: str) -> None:
        self.inbox.put(AbortRequest(request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(CallEngine(fn, fut))
        return fut

    def stop(self) -> None:
        self.stopping.set()
        self.inbox.put(Wake())

    # the loop
    def _handle(self, cmd: Command) -> None:
        if isinstance(cmd, AddRequest):
            if self.calls:  # a pending call runs first, on an idle engine
                self.waiting_adds.append(cmd)
                return
            try:
                self.engine.add_request(cmd.request)
            except Exception as e:
                cmd.sink.put(e)
                return
            self.live[cmd.request.request_id] = cmd.sink
        elif isinstance(cmd, AbortRequest):
            if self.live.pop(cmd.request_id, None) is not None:
                self.engine.abort(cmd.request_id)
            self.first_token.discard(cmd.request_id)
        elif isinstance(cmd, CallEngine):
            self.calls.append(cmd)

    def run(self) -> None:
        while not self.stopping.is_set():
            busy = self.engine.has_work()
            try:
                cmd = self.inbox.get_nowait() if busy or self.calls else self.inbox.get(timeout=0.5)
                self._handle(cmd)
                while True:
                    self._handle(self.inbox.get_nowait())
            except queue.Empty:
                pass
            if self.engine.has_work():
                self._step()
            elif self.calls:
                for call in self.calls:
                    try:
                        call.future.set_result(call.fn(self.engine))
                    except Exception as e:
                        call.future.set_exception(e)
                self.calls = []
                self._snapshot(force=True)
                adds, self.waiting_adds = self.waiting_adds, []
                for add in adds:
                    self._handle(add)
            else:
                self._snapshot(force=True)
        for sink in self.live.values():
            sink.put(RuntimeError("the server is shutting down"))

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:  # the step failed: every live request fails with it
            for rid, sink in self.live.items():
                sink.put(e)
                self.engine.abort(rid)
            self.live.clear()
            self.first_token.clear()
            return
        self.stats["steps"] += 1
        for ev in events:
            sink = self.live.get(ev.request_id)
            if sink is None:
                continue
            sink.put(ev)
            self.first_token.add(ev.request_id)
            if ev.finished:
                del self.live[ev.request_id]
                self.first_token.discard(ev.request_id)
        self._snapshot(force=not self.engine.has_work())  # idle: /metrics is exact at once

    def _snapshot(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._snap_t < 0.05:
            return
        self._snap_t = now
        try:
            info = self.engine.kv_cache_info()
        except Exception:
            return
        running = sum(1 for r in self.live if r in self.first_token)
        with self.lock:
            self.stats.update(
                running=running, waiting=len(self.live) - running,
                kv_usage=(info.blocks_in_use / info.num_blocks) if info.num_blocks and info.blocks_in_use is not None
                else 0.0,
                hits=info.prefix_cache_hits or 0, queries=info.prefix_cache_queries or 0,
                preemptions=info.preemptions or 0,
                config={"block_size": str(info.block_size), "num_blocks": str(info.num_blocks),
                        "kv_dtype": str(info.kv_dtype), "pool_bytes": str(info.pool_bytes),
                        "prefix_caching": str(info.prefix_cache_queries is not None)})


# ---- the HTTP side --------------------------------------------------------------------------------

class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Runtime:
    engine_thread: EngineThread
    served_model_name: str
    max_model_len: int
    tokenizer: Any  # None: token ids only
    eos_id: int | None
    api_key: str | None
    version: str
    counters: dict[str, float]
    compute_threads: int | None = None
    chat_template: str | None = None  # the text of chat_template=FILE (None: the tokenizer's own)


def _error(message: str, status: int, kind: str = "invalid_request_error") -> Any:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _prompt_ids(prompt: Any, rt: Runtime) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if rt.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as a list of token ids")
        return list(rt.tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, (list, str)) for t in prompt):
        raise BadRequest("one prompt per request: this server takes a single prompt (a string or a token-id list)")
    raise BadRequest("`prompt` must be a non-empty string or a non-empty list of token ids")


def _detok(rt: Runtime, ids: list[int], n_new: int) -> str:
    """The text the last `n_new` tokens add (decoding a few tokens of context, so word
    boundaries come out right)."""
    if rt.tokenizer is None or n_new == 0:
        return ""
    n = len(ids)
    ctx = max(0, n - n_new - 4)
    before = rt.tokenizer.decode(ids[ctx:n - n_new]) if n - n_new > ctx else ""
    return rt.tokenizer.decode(ids[ctx:n])[len(before):]


def _prompt_logprobs(rt: Runtime, ids: list[int], k: int) -> list[Any]:
    """vLLM's format: None for position 0, then {token id: {logprob, rank, decoded_token}} with
    the top k and the prompt's own token."""
    if len(ids) < 2:
        return [None] * len(ids)
    fut = rt.engine_thread.call(lambda eng: eng.score([ids], [1], k))
    scores = fut.result()[0]
    out: list[Any] = [None]
    for j, p in enumerate(range(1, len(ids))):
        entry: dict[str, Any] = {}
        for rank, (tid, lp) in enumerate(zip(scores.top_ids[j], scores.top_logprobs[j]), start=1):
            entry[str(tid)] = {"logprob": lp, "rank": rank, "decoded_token": _tok_text(rt, tid)}
        if str(ids[p]) not in entry:
            entry[str(ids[p])] = {"logprob": scores.target_logprobs[j], "rank": None,
                                  "decoded_token": _tok_text(rt, ids[p])}
        out.append(entry)
    return out


def _tok_text(rt: Runtime, tid: int) -> str | None:
    return rt.tokenizer.decode([tid]) if rt.tokenizer is not None else None


def build_app(rt: Runtime) -> Any:
    app = FastAPI(title="infer-bench-serve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    registry = _metrics_registry(rt)

    @app.middleware("http")
    async def auth(request: HTTPRequest, call_next: Any) -> Any:
        if rt.api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {rt.api_key}".encode()):
                return _error("Unauthorized: this server needs `Authorization: Bearer <key>`", 401,
                              "authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health() -> Any:
        if not rt.engine_thread.is_alive():
            return _error("the engine thread is not running", 503, "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Any:
        return {"version": rt.version, "compute_threads": rt.compute_threads}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": rt.served_model_name, "object": "model", "owned_by": "infer-bench",
                                            "max_model_len": rt.max_model_len, "created": 0}]}

    @app.get("/metrics")
    async def metrics() -> Any:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Any:
        fut = rt.engine_thread.call(lambda eng: eng.reset_prefix_cache())
        await asyncio.wrap_future(fut)
        return JSONResponse({"status": "ok"})

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return _error("the request body is not JSON", 400)
        try:
            return await _completion(rt, body)
        except BadRequest as e:
            return _error(str(e), e.status)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return _error("the request body is not JSON", 400)
        try:
            return await _completion(rt, _chat_as_completion(rt, body), chat=True)
        except BadRequest as e:
            return _error(str(e), e.status)

    return app


CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "stream", "stream_options",
               "ignore_eos", "min_tokens", "return_token_ids", "n", "add_generation_prompt", "structured_outputs",
               "tools", "tool_choice", "parallel_tool_calls"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message_problem(m: Any) -> str | None:
    """Why a chat message is not one this server takes (None: it is)."""
    if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
        return f"a message's role must be one of {', '.join(CHAT_ROLES)}"
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "content parts must be text parts ({\"type\": \"text\", \"text\": ...}): this server takes text alone"
    elif not (isinstance(content, str) or (content is None and m["role"] == "assistant" and m.get("tool_calls"))):
        return "a message's content must be text (null only beside an assistant's tool_calls)"
    calls = m.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", ""), str) for c in calls)):
        return "tool_calls must be a list of {id, type: function, function: {name, arguments: a JSON string}}"
    return None


def _chat_as_completion(rt: Runtime, body: Any) -> dict[str, Any]:
    """A chat body as the completion body it amounts to: `messages` templated into `prompt` ids."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - CHAT_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}: this server takes {', '.join(sorted(CHAT_FIELDS))}")
    msgs = body.get("messages")
    if not (isinstance(msgs, list) and msgs):
        raise BadRequest("`messages` must be a non-empty list of {role, content} with text content")
    for i, m in enumerate(msgs):
        why = _message_problem(m)
        if why:
            raise BadRequest(f"messages[{i}]: {why}")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and tools and all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)):
        raise BadRequest("`tools` must be a non-empty list of {type: function, function: {name, ...}}")
    if rt.tokenizer is None:
        raise BadRequest("this model has no tokenizer: chat needs one (and a chat template)")
    if rt.chat_template is None and not getattr(rt.tokenizer, "chat_template", None):
        raise BadRequest("this model's tokenizer has no chat template: start the server with chat_template=FILE, "
                         "or use /v1/completions")
    try:
        ids = template_ids(rt.tokenizer, msgs, rt.chat_template, tools)
    except Exception as e:
        raise BadRequest(f"the chat template failed on these messages: {e}") from None
    out = {k: v for k, v in body.items() if k not in ("messages", "max_completion_tokens", "add_generation_prompt",
                                                       "tools", "tool_choice", "parallel_tool_calls")}
    if body.get("max_completion_tokens") is not None:
        out["max_tokens"] = body["max_completion_tokens"]
    out["prompt"] = ids
    return out


@dataclass
class Completion:
    """A checked `POST /v1/completions` body."""

    ids: list[int]  # the prompt's token ids
    max_tokens: int
    min_tokens: int  # EOS does not stop the request before this many tokens
    ignore_eos: bool
    return_ids: bool  # token ids beside the text (vLLM's return_token_ids)
    stream: bool
    include_usage: bool  # stream: a usage chunk before [DONE]
    continuous: bool  # stream: usage in every chunk
    prompt_logprobs: int | None  # top-k of the prompt's teacher-forced scores (None: not asked)
    constraint: dict[str, Any] | None = None  # structured output (vLLM's structured_outputs field)


def _constraint(value: Any) -> dict[str, Any] | None:
    """vLLM's `structured_outputs` field (json, regex, choice or grammar; disable_any_whitespace) as
    a Request.constraint, checked as the harness checks a constraint (BadRequest naming what is wrong)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest("structured_outputs must be an object with one of json, regex, choice, grammar")
    kinds = [k for k in KINDS if value.get(k) is not None]
    if len(kinds) != 1:
        raise BadRequest(f"structured_outputs must give exactly one of {', '.join(KINDS)} (got {', '.join(kinds) or 'none'})")
    c = Constraint(kinds[0], value[kinds[0]], kinds[0])
    problems = constraint_problems(c)
    if problems:
        raise BadRequest(f"structured_outputs.{c.kind}: {problems[0]}")
    return c.to_request(bool(value.get("disable_any_whitespace")))


def _parse_completion(rt: Runtime, body: Any) -> Completion:
    """The request's fields, checked (BadRequest names the first one wrong)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model not in (None, rt.served_model_name):
        raise BadRequest(f"The model `{model}` does not exist (this server serves `{rt.served_model_name}`).", 404)
    if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1):
        raise BadRequest("n and best_of must be 1")
    if body.get("logprobs") not in (None, 0) or body.get("echo"):
        raise BadRequest("logprobs of sampled tokens and echo are not supported; use prompt_logprobs")
    ids = _prompt_ids(body.get("prompt"), rt)
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = rt.max_model_len - len(ids)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest("max_tokens must be a positive integer")
    if len(ids) + max_tokens > rt.max_model_len:
        raise BadRequest(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds this server's "
                         f"max_model_len ({rt.max_model_len})")
    min_tokens = body.get("min_tokens") or 0
    if not isinstance(min_tokens, int) or min_tokens < 0 or min_tokens > max_tokens:
        raise BadRequest("min_tokens must be an integer in [0, max_tokens]")
    opts = body.get("stream_options") or {}
    plp = body.get("prompt_logprobs")
    if plp is not None and (not isinstance(plp, int) or isinstance(plp, bool) or plp < 0):
        raise BadRequest("prompt_logprobs must be a non-negative integer")
    return Completion(ids, max_tokens, min_tokens, ignore_eos=bool(body.get("ignore_eos", False)),
                      return_ids=bool(body.get("return_token_ids", False)), stream=bool(body.get("stream", False)),
                      include_usage=bool(opts.get("include_usage")) if isinstance(opts, dict) else False,
                      continuous=bool(opts.get("continuous_usage_stats")) if isinstance(opts, dict) else False,
                      prompt_logprobs=plp, constraint=_constraint(body.get("structured_outputs")))


async def _completion(rt: Runtime, body: Any, chat: bool = False) -> Any:
    req = _parse_completion(rt, body)
    prompt_logprobs = None
    if req.prompt_logprobs is not None:
        try:
            prompt_logprobs = await asyncio.get_running_loop().run_in_executor(
                None, _prompt_logprobs, rt, req.ids, max(req.prompt_logprobs, 1))
        except (ValueError, NotImplementedError, AttributeError) as e:
            raise BadRequest(f"prompt_logprobs: {e}") from None

    rid = f"cmpl-{uuid.uuid4().hex}"
    sink = Sink(asyncio.get_running_loop())
    rt.engine_thread.add(EngineRequest(rid, req.ids, req.max_tokens, constraint=req.constraint), sink)
    first = await sink.queue.get()
    if isinstance(first, BaseException):
        raise BadRequest(str(first), 400 if isinstance(first, ValueError) else 500)
    rt.counters["requests"] += 1
    rt.counters["prompt_tokens"] += len(req.ids)
    out = _Output(rt, req, rid, int(time.time()), prompt_logprobs, chat)
    out.cached = getattr(first, "cached_tokens", None)
    tokens = _tokens(rt, req, rid, sink, first)
    if not req.stream:
        return await out.whole(tokens)
    return StreamingResponse(out.sse(tokens), media_type="text/event-stream")


async def _tokens(rt: Runtime, req: Completion, rid: str, sink: Sink,
                  first: Any) -> AsyncIterator[tuple[int, str | None]]:
    """(token id, finish reason or None) from the request's first event on, until the request
    ends; aborts it if left early (or at an EOS before its last token)."""
    stop_at_eos = not req.ignore_eos and rt.eos_id is not None
    ev, n, finished = first, 0, False
    try:
        while True:
            if isinstance(ev, BaseException):
                raise ev
            n += 1
            reason = None
            if stop_at_eos and ev.token_id == rt.eos_id and n >= req.min_tokens:
                reason = "stop"
            elif ev.finished:
                reason = "length"
            rt.counters["generation_tokens"] += 1
            yield ev.token_id, reason
            if reason:
                finished = ev.finished
                if reason == "stop" and not ev.finished:
                    rt.engine_thread.abort(rid)
                    finished = True
                return
            ev = await sink.queue.get()
    finally:
        if not finished:
            rt.engine_thread.abort(rid)


class _Output:
    """One request's response: whole (a JSON object) or streamed (SSE chunks), in vLLM's format."""

    def __init__(self, rt: Runtime, req: Completion, rid: str, created: int, prompt_logprobs: list[Any] | None,
                 chat: bool = False):
        self.rt, self.req, self.rid, self.created, self.prompt_logprobs = rt, req, rid, created, prompt_logprobs
        self.out_ids: list[int] = []
        self.chat = chat
        self.cached: int | None = None  # prompt tokens the prefix cache supplied (the first event says)

    def usage(self) -> dict[str, Any]:
        n_in, n_out = len(self.req.ids), len(self.out_ids)
        out: dict[str, Any] = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        if self.cached is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return out

    def body(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if self.req.stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created,
                "model": self.rt.served_model_name, "choices": choices, "usage": usage}

    def _choice(self, text: str, reason: str | None, first: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
        if not self.req.stream:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": reason}
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

    async def whole(self, tokens: AsyncIterator[tuple[int, str | None]]) -> dict[str, Any]:
        reason = None
        try:
            async for tid, reason in tokens:
                self.out_ids.append(tid)
        except Exception as e:
            raise BadRequest(f"generation failed: {e}", 500) from None
        choice = self._choice(_detok(self.rt, self.out_ids, len(self.out_ids)), reason, True)
        if self.req.return_ids:
            choice["token_ids"] = self.out_ids
            choice["prompt_token_ids"] = self.req.ids
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs
        self.rt.counters["success"] += 1
        return self.body([choice], self.usage())

    async def sse(self, tokens: AsyncIterator[tuple[int, str | None]]) -> AsyncIterator[str]:
        first_chunk = True
        try:
            async for tid, reason in tokens:
                self.out_ids.append(tid)
                choice = self._choice(_detok(self.rt, self.out_ids, 1), reason, first_chunk)
                if self.req.return_ids:
                    choice["token_ids"] = [tid]
                    if first_chunk:
                        choice["prompt_token_ids"] = self.req.ids
                if first_chunk and self.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.prompt_logprobs
                first_chunk = False
                yield _event(self.body([choice], self.usage() if self.req.continuous else None))
        except Exception as e:
            yield _event({"error": {"message": f"generation failed: {e}", "type": "server_error", "code": 500}})
            return
        self.rt.counters["success"] += 1
        if self.req.include_usage:
            yield _event(self.body([], self.usage()))
        yield "data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _metrics_registry(rt: Runtime) -> Any:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

    class Collector:
        def collect(self) -> Any:
            et = rt.engine_thread
            with et.lock:
                s = dict(et.stats)
            labels = {"model_name": rt.served_model_name}
            for name, doc, value in (("num_requests_running", "requests with at least one output token", s["running"]),
                                     ("num_requests_waiting", "requests accepted, no output token yet", s["waiting"]),
                                     ("kv_cache_usage_perc", "fraction of KV blocks in use (0-1)", s["kv_usage"])):
                g = GaugeMetricFamily(f"infer_bench_{name}", doc, labels=list(labels))
                g.add_metric(list(labels.values()), float(value))
                yield g
            for name, doc, value in (
                    ("prefix_cache_hits", "prefix-cache blocks found (since the last reset)", s["hits"]),
                    ("prefix_cache_queries", "prefix-cache blocks looked up (since the last reset)", s["queries"]),
                    ("num_preemptions", "preemptions (since the last prefix-cache reset)", s["preemptions"]),
                    ("engine_steps", "engine steps", s["steps"]),
                    ("request_success", "completed requests", rt.counters["success"]),
                    ("prompt_tokens", "prompt tokens admitted", rt.counters["prompt_tokens"]),
                    ("generation_tokens", "output tokens sent", rt.counters["generation_tokens"])):
                c = CounterMetricFamily(f"infer_bench_{name}", doc, labels=list(labels))
                c.add_metric(list(labels.values()), float(value))
                yield c
            info = InfoMetricFamily("infer_bench_cache_config", "the KV cache's configuration")
            info.add_metric([], {k: str(v) for k, v in s["config"].items()})
            yield info

    registry = CollectorRegistry()
    registry.register(Collector())
    return registry


# ---- configuration and start-up -----------------------------------------------------------------

def compose(overrides: list[str]) -> dict[str, Any]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf
    register_hub_shorthands(overrides)  # model=ORG/NAME: a model by its Hugging Face Hub id
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="serve", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[return-value]


@dataclass
class ServePlan:
    settings: ServeSettings
    shape: Any
    model_cfg: dict[str, Any]
    dtype: str
    device: str
    engine_options: dict[str, Any]
    max_model_len: int
    api_key: str | None
    hub: Any = None  # model=ORG/NAME: the model as resolved on the Hub (harness/core/hub.py)


def build_plan(cfg: dict[str, Any]) -> ServePlan:
    """Every problem of the composed config at once (UserError), or the plan."""
    from adapters.base import ModelSpec
    from adapters.reference.engine import ReferenceEngine
    from harness.config import check_checkpoint, resolve_device, resolve_dtype
    from harness.core.presets import resolve_shape

    problems: list[str] = []
    top = {k: v for k, v in cfg.items() if k not in ("model", "engine_options", "hydra")}
    settings, probs = check(ServeSettings, top, "serve")
    problems += [p.removeprefix("serve.") for p in probs]
    settings = settings or ServeSettings()
    model_cfg = dict(cfg.get("model") or {})
    shape = hub = None
    if is_hub_model(model_cfg):  # the snapshot in the Hugging Face cache; its weights come at start
        hub = resolve_model(model_cfg, problems)
        shape, model_cfg["path"] = (hub.shape, hub.path) if hub else (None, None)
    else:
        try:
            shape = resolve_shape(model_cfg)
            if model_cfg.get("path") not in (None, "???"):
                check_checkpoint(model_cfg["path"], problems)
        except UserError as e:
            problems += e.problems
    device = resolve_device(settings.device, problems)
    dtype = resolve_dtype(settings.dtype, shape, device, problems) if shape is not None else settings.dtype
    max_len = settings.max_model_len or (shape.max_position_embeddings if shape else 2048)
    if shape is not None and max_len > shape.max_position_embeddings:
        problems.append(f"max_model_len={max_len}: more than the model's {shape.max_position_embeddings} positions.")
    options = dict(cfg.get("engine_options") or {})
    if shape is not None and not problems:
        spec_ = ModelSpec(path=str(model_cfg.get("path") or ""), name=shape.name, dtype=dtype, device=device,
                          max_model_len=max_len)
        problems += [p.replace("engine_options.reference.", "engine_options.")
                     for p in ReferenceEngine.check_options(options, spec_)]
    api_key = None
    if settings.api_key_env:
        api_key = os.environ.get(settings.api_key_env, "").strip() or None
        if api_key is None:
            problems.append(f"api_key_env={settings.api_key_env}: the variable is not set (or empty). "
                            f"export {settings.api_key_env}=... first.")
    if settings.chat_template and not Path(settings.chat_template).expanduser().is_file():
        problems.append(f"chat_template={settings.chat_template}: no such file. Give a Jinja chat template file "
                        "(or leave it null for the checkpoint's own).")
    if problems:
        raise UserError(list(dict.fromkeys(problems)))
    return ServePlan(settings, shape, model_cfg, dtype, device, options, max_len, api_key, hub)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (a port in use is bad input, before the model loads)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
            raise UserError(f"port={port}: {host}:{port} is already in use (another server?). Pick another "
                            "port, or port=0 for any free one.") from None
        raise UserError(f"host={host} port={port}: cannot listen there ({e.strerror}).") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(plan: ServePlan, sock: socket.socket) -> int:
    import uvicorn

    from adapters.base import ModelSpec, engine_options_or_raise
    from adapters.reference.config import EngineConfig
    from adapters.reference.llm_engine import LLMEngine
    from adapters.reference.llm_engine import version as engine_version
    from harness.checkpoint import ensure_checkpoint
    from harness.core.paths import model_cache_dir

    s = plan.settings
    if plan.hub is not None:
        print(plan.hub.describe(), flush=True)
        try:
            path = plan.hub.download()
        except UserError as e:
            print(e.render("infer-bench-serve"), file=sys.stderr)
            return EXIT_BAD_INPUT
    elif plan.model_cfg.get("path"):
        path = str(Path(plan.model_cfg["path"]).expanduser().resolve())
    else:
        path = str(ensure_checkpoint(plan.shape, model_cache_dir(s.model_cache_dir), s.seed))
    model = ModelSpec(path=path, name=plan.shape.name, dtype=plan.dtype, device=plan.device,
                      max_model_len=plan.max_model_len, seed=s.seed)
    engine = LLMEngine(model, engine_options_or_raise(EngineConfig, "reference", plan.engine_options))
    tokenizer, eos = _tokenizer(path)
    et = EngineThread(engine)
    et.start()
    rt = Runtime(et, s.served_model_name or plan.shape.name, plan.max_model_len, tokenizer, eos, plan.api_key,
                 f"infer-bench-serve {__version__} (reference engine {engine_version()})",
                 {"requests": 0, "success": 0, "prompt_tokens": 0, "generation_tokens": 0}, engine.compute_threads,
                 Path(s.chat_template).expanduser().read_text() if s.chat_template else None)
    app = build_app(rt)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"infer-bench-serve: {rt.served_model_name} (reference engine, {plan.dtype}, {plan.device}, "
          f"max_model_len {plan.max_model_len}, {engine.compute_threads} threads, "
          f"loaded in {engine.load_time_s:.1f} s) at "
          f"http://{shown}:{port}/v1{' (Bearer key required)' if plan.api_key else ''}", flush=True)
    config = uvicorn.Config(app, log_level=s.log_level, access_log=False, timeout_graceful_shutdown=5,
                            lifespan="off")
    server = uvicorn.Server(config)

    def _stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler
    # it found: ours ends the process cleanly (exit 0) after the engine is closed
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        et.stop()
        et.join(timeout=10)
        engine.close()
    print("infer-bench-serve: stopped", flush=True)
    return 0


def _tokenizer(path: str) -> tuple[Any, int | None]:
    if not (Path(path) / "tokenizer.json").exists() and not (Path(path) / "tokenizer_config.json").exists():
        return None, None
    from transformers import AutoTokenizer  # heavy: only when the checkpoint has a tokenizer
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception:
        return None, None
    return tok, tok.eos_token_id


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        sys.exit(0)
    bad = [a for a in argv if a.startswith("-") or "=" not in a]
    try:
        if bad:
            raise UserError(f"{bad[0]}: not an override. Give key=value pairs (infer-bench-serve --help).")
        try:
            cfg = compose(argv)
        except Exception as e:
            from harness.core.redact import redact_text
            first = redact_text(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            if "'model/" in str(e):
                from harness.core.presets import preset_names
                first = (f"unknown model preset. Choose one of {', '.join(preset_names())} "
                         "(or model=ORG/NAME for a model on the Hugging Face Hub, or model=local model.path=DIR).")
            raise UserError(f"overrides: {first}") from None
        plan = build_plan(cfg)
        sock = bind(plan.settings.host, plan.settings.port)
    except UserError as e:
        print(e.render("infer-bench-serve"), file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    sys.exit(serve(plan, sock))


if __name__ == "__main__":
    main()

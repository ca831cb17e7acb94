"""Small fake OpenAI-compatible servers for the endpoint engine's fault tests (loopback only).

They are fakes, named as such: they test OUR client logic (counting, timing, failures), never
stand in for an engine. Tokens are deterministic: request token k is `1000 + k`.

In a test:   with serving(fake_app(FakeBehaviour(...))) as url: ...   (uvicorn in a thread)
Launched:    python tests/fake_servers.py MODE --port P   (MODE: ok | never-ready | die-mid-stream)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


@dataclass
class FakeBehaviour:
    """What the fake does with /v1/completions."""

    status: int = 200  # >= 400: answer with this error
    error_message: str = "fake error"
    tokens_per_chunk: int = 1
    stop_after: int | None = None  # send this many tokens, then...
    end: str = "done"  # "done" ([DONE] after finish_reason=length), "close" (just close), "stop" (finish_reason stop + [DONE])
    malformed_after: int | None = None  # after this many tokens, a data line that is not JSON
    usage_delta: int = 0  # usage.completion_tokens = tokens sent + this
    return_token_ids: bool = True  # honour return_token_ids
    text_only: bool = False  # never send token ids (a server that does not know them)
    exit_after: int | None = None  # os._exit(1) after this many tokens (launched mode only)
    api_key: str | None = None  # demand Authorization: Bearer <key>
    metrics: bool = True
    delay_s: float = 0.002  # between chunks
    # structured output: False, the fake ignores the constraint field (vLLM's structured_outputs) and
    # answers free text, as a server that does not know the field; True, a choice constraint is
    # answered with its first choice (one chunk of text, no token ids, finish_reason stop), as a
    # server that applies it
    honour_choice: bool = False
    seen: list[dict[str, Any]] = field(default_factory=list)  # request bodies received


def _chunk(tokens: list[int], finish: str | None, ids: bool, usage: dict | None = None) -> str:
    choice: dict[str, Any] = {"index": 0, "text": " ".join(f"w{t}" for t in tokens), "finish_reason": finish,
                              "logprobs": None}
    if ids:
        choice["token_ids"] = tokens
    return "data: " + json.dumps({"id": "fake", "object": "text_completion", "choices": [choice], "usage": usage}) + "\n\n"


def fake_app(b: FakeBehaviour) -> FastAPI:
    app = FastAPI()

    def authorised(request: Request) -> bool:
        return b.api_key is None or request.headers.get("authorization") == f"Bearer {b.api_key}"

    @app.get("/health")
    async def health() -> Any:
        return {"ok": True}

    @app.get("/version")
    async def version() -> Any:
        return {"version": "fake-1.0"}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if not authorised(request):
            return JSONResponse({"error": {"message": "Unauthorized: bad key"}}, status_code=401)
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> Any:
        if not b.metrics:
            return PlainTextResponse("not here", status_code=404)
        return PlainTextResponse("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n"
                                 "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.25\n")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        if not authorised(request):
            return JSONResponse({"error": {"message": "Unauthorized: bad key"}}, status_code=401)
        body = await request.json()
        b.seen.append(body)
        if b.status >= 400:
            return JSONResponse({"error": {"message": b.error_message, "code": b.status}}, status_code=b.status)
        n = int(body["max_tokens"])
        send = n if b.stop_after is None else min(n, b.stop_after)
        ids = bool(body.get("return_token_ids")) and b.return_token_ids and not b.text_only
        choices = (body.get("structured_outputs") or {}).get("choice")
        if b.honour_choice and choices:
            async def answer() -> Any:
                choice = {"index": 0, "text": choices[0], "finish_reason": "stop", "logprobs": None}
                yield "data: " + json.dumps({"id": "fake", "choices": [choice]}) + "\n\n"
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}
                yield "data: " + json.dumps({"id": "fake", "choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(answer(), media_type="text/event-stream")

        async def gen() -> Any:
            k = 0
            while k < send:
                if b.malformed_after is not None and k >= b.malformed_after:
                    yield "data: {this is not json\n\n"
                    return
                if b.exit_after is not None and k >= b.exit_after:
                    os._exit(1)
                group = list(range(1000 + k, 1000 + min(send, k + b.tokens_per_chunk)))
                k += len(group)
                last = k == send
                finish = None
                if last and b.end in ("done", "stop"):
                    finish = "length" if (b.end == "done" and send == n) else "stop"
                yield _chunk(group, finish, ids)
                await asyncio.sleep(b.delay_s)
            if b.end == "close":
                return
            usage = {"prompt_tokens": len(body["prompt"]) if isinstance(body["prompt"], list) else
                     len(str(body["prompt"]).split()), "completion_tokens": send + b.usage_delta}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            if (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + json.dumps({"id": "fake", "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def _bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serving(app: Any, **uvicorn_kwargs: Any) -> Iterator[str]:
    """Run `app` on a loopback port in a thread; yields its base URL (http(s)://127.0.0.1:P)."""
    sock = _bound_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="error", access_log=False, lifespan="off", **uvicorn_kwargs)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # (not the main thread)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    scheme = "https" if uvicorn_kwargs.get("ssl_certfile") else "http"
    try:
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextlib.contextmanager
def blackhole() -> Iterator[str]:
    """A port that accepts TCP connections (the kernel completes the handshake) and never
    answers: requests to it time out."""
    sock = _bound_socket()
    sock.listen(16)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _never_ready_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Any:
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/v1/models")
    async def models() -> Any:
        return JSONResponse({"status": "loading"}, status_code=503)

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description="a fake OpenAI-compatible server (tests only)")
    ap.add_argument("mode", choices=("ok", "never-ready", "die-mid-stream"))
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key", default=None, help="demand Authorization: Bearer <key>")
    args = ap.parse_args()
    print(f"fake server ({args.mode}) starting on {args.port}", flush=True)
    if args.mode == "never-ready":
        app = _never_ready_app()
    else:
        app = fake_app(FakeBehaviour(exit_after=3 if args.mode == "die-mid-stream" else None, delay_s=0.05,
                                     api_key=args.api_key))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()


def children() -> set[int]:
    import psutil
    return {p.pid for p in psutil.Process().children(recursive=True)}


def wait_children_gone(before: set[int], timeout_s: float = 20.0) -> list[str]:
    """The processes started since `before` that are still alive after `timeout_s` (empty: all gone)."""
    import psutil
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for pid in children() - before:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)

"""A fake OpenAI-compatible server whose timing is known exactly: the truth for the load
generator's tests and for scripts/loadgen_ceiling.py.

It is a protocol fake, named as such: raw asyncio (no web framework), HTTP/1.1 with keep-alive,
answering `POST /v1/completions` (stream: true) with one SSE chunk every `--gap-ms` after a
first-token delay of `--first-ms`, `--tokens-per-chunk` tokens per chunk (token k of a request
is `1000 + k`, sent as `token_ids`), then a usage chunk and `data: [DONE]`. Chunk j of a request
received at t0 is written at t0 + first + j * gap on an absolute schedule (no drift); gap 0 writes
as fast as the socket takes them.

**Pacing to a fraction of a millisecond.** asyncio's timers wake up to 1 ms late on Linux (epoll
waits in whole milliseconds, rounded up): likely the main part of the server's own gaps at 20 ms
reading p99 21.0-21.8 ms in a quiet run. So a chunk's wait is done in two parts (`wait_until`):
`asyncio.sleep` until `COARSE_S` before its due time (the loop is free for the other streams), then, holding the loop,
`time.sleep` until `SPIN_S` before it and a busy-wait for the rest (the thread's timer slack is
set to 1 us where Linux allows, so `time.sleep` ends within tens of microseconds). Streams due
within `COARSE_S` of each other are served in due order, each when due; the cost is that the
loop accepts a new request up to `COARSE_S` late while it holds a wait (what the client sees as
TTFT then carries that much of the server's delay, still never less than `--first-ms`), and
at most `SPIN_S` of busy CPU per paced chunk (64 streams at 20 ms: about 10 % of the server's
core, measured beside other work).
Gap 0 never waits, so the ceiling experiment (gap 0, first token at once) runs exactly as it did:
no busy-wait, the server writing as fast as the socket takes it. `--coarse` turns the fine part
off (asyncio.sleep only), to compare. `GET /v1/models`, `/version` and `/health` answer; `/metrics`
is 404 (no telemetry). `GET /stats` answers what the server actually did since the last
`/stats` (and starts over): how late its chunk writes were against their schedule, and the gaps
between the writes of one stream (min / p50 / p99 / max, ms) - the truth the client's ITL is read
against, so a late server is told apart from a slow client - when it wrote each chunk (`writes_ns`,
time.perf_counter_ns(): CLOCK_MONOTONIC, the clock the client stamps with; paced runs only), the
connections it accepted, and how many completion requests were the first request of their
connection (`cold_streams`).

`POST /v1/chat/completions` streams chat chunks the same way; with `--reasoning-tokens R` the first R
tokens of each stream are reasoning (`delta.reasoning`, or `delta.reasoning_content` with
`--reasoning-field`), the rest the answer (`delta.content`), a chunk never holding both, and the usage
carries `completion_tokens_details.reasoning_tokens` (not with `--no-reasoning-usage`): the truth for
TTFO and the reasoning counts. R at least max_tokens: a reasoning-only stream, no answer.

    python tests/fake_timed_server.py --port 0 --gap-ms 20 --first-ms 50 [--cpu 0] [--coarse]

prints `READY <port>` on stdout once it listens. `--cpu N` pins it to core N.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

BATCH = 64  # gap 0: chunks per write (the server's own cost per token stays far below a client's)
COARSE_S = 0.0015  # a wait ends holding the loop from this long before its due time (asyncio: up to 1 ms late)
SPIN_S = 0.0001  # ... and busy-waits the last this long (time.sleep's own lateness stays below it)
PR_SET_TIMERSLACK = 29  # prctl(2): how late the kernel may end this thread's sleeps, in ns (default 50 us)
_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
         b"transfer-encoding: chunked\r\n\r\n")


def _json_response(status: str, obj: object) -> bytes:
    body = json.dumps(obj).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            .encode() + body)


def _frame(data: bytes) -> bytes:
    """One HTTP chunk (transfer-encoding: chunked) holding `data`."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(tokens: range, finish: str | None) -> bytes:
    ids = ",".join(str(1000 + k) for k in tokens)
    text = " ".join(f"w{1000 + k}" for k in tokens)
    fin = "null" if finish is None else f'"{finish}"'
    return (b'data: {"id":"fake","object":"text_completion","model":"fake-model","choices":[{"index":0,'
            b'"text":"%s","token_ids":[%s],"logprobs":null,"finish_reason":%s}],"usage":null}\n\n'
            % (text.encode(), ids.encode(), fin.encode()))


def _chat_event(tokens: range, finish: str | None, field: str) -> bytes:
    """A chat chunk: the tokens' text in delta.<field> (`content`, or a reasoning field)."""
    ids = ",".join(str(1000 + k) for k in tokens)
    text = "".join(f" {'r' if field != 'content' else 'w'}{1000 + k}" for k in tokens)
    fin = "null" if finish is None else f'"{finish}"'
    return (b'data: {"id":"fake","object":"chat.completion.chunk","model":"fake-model","choices":[{"index":0,'
            b'"delta":{"%s":"%s"},"token_ids":[%s],"logprobs":null,"finish_reason":%s}]}\n\n'
            % (field.encode(), text.encode(), ids.encode(), fin.encode()))


def fine_timer_slack() -> bool:
    """Ask Linux to end this thread's sleeps within 1 us of their time (False: not available)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


async def wait_until(due: float, fine: bool = True) -> None:
    """Return at `due` (time.perf_counter() seconds). Fine: asyncio.sleep while it is more than
    COARSE_S away, then, holding the loop, time.sleep to SPIN_S before it and a busy-wait - never
    before it, and within tens of microseconds after on an idle core. Not fine: asyncio.sleep
    alone (up to 1 ms late)."""
    wait = due - time.perf_counter()
    if not fine:
        if wait > 0:
            await asyncio.sleep(wait)
        return
    if wait > COARSE_S:
        await asyncio.sleep(wait - COARSE_S)
    wait = due - time.perf_counter()
    if wait > SPIN_S:
        time.sleep(wait - SPIN_S)
    while time.perf_counter() < due:
        pass


class TimedServer:
    def __init__(self, gap_s: float, first_s: float, tokens_per_chunk: int, fine: bool = True,
                 reasoning_tokens: int = 0, reasoning_field: str = "reasoning", reasoning_usage: bool = True):
        self.gap_s, self.first_s, self.per_chunk = gap_s, first_s, max(1, tokens_per_chunk)
        # /v1/chat/completions: the first `reasoning_tokens` tokens of a stream are reasoning
        # (delta.<reasoning_field>), the rest answer (delta.content); with `reasoning_usage` the
        # usage says how many (completion_tokens_details.reasoning_tokens)
        self.reasoning_tokens, self.reasoning_field = reasoning_tokens, reasoning_field
        self.reasoning_usage = reasoning_usage
        self.fine = fine  # pace with wait_until's busy-wait (False: asyncio.sleep alone, up to 1 ms late)
        self.late_ns: list[int] = []  # each chunk write minus its scheduled time
        self.gaps_ns: list[int] = []  # between consecutive chunk writes of one stream
        self.writes_ns: list[int] = []  # when each chunk was written (time.perf_counter_ns: CLOCK_MONOTONIC)
        self.connections = 0  # connections accepted
        self.cold_streams = 0  # completion requests that were the first request of their connection

    def stats(self) -> dict:
        def pct(xs: list[int]) -> dict:
            xs = sorted(xs)
            if not xs:
                return {"min": None, "p50": None, "p99": None, "max": None}
            at = lambda q: xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] / 1e6  # noqa: E731
            return {"min": xs[0] / 1e6, "p50": at(0.5), "p99": at(0.99), "max": xs[-1] / 1e6}
        out = {"chunks": len(self.late_ns), "late_ms": pct(self.late_ns), "gap_ms": pct(self.gaps_ns),
               "connections": self.connections, "cold_streams": self.cold_streams, "writes_ns": self.writes_ns}
        self.late_ns, self.gaps_ns, self.writes_ns = [], [], []
        self.connections = self.cold_streams = 0
        return out

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        first = True
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = 0
                for h in lines[1:]:
                    if h.lower().startswith("content-length:"):
                        length = int(h.split(":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                if method == "POST" and path.endswith("/completions"):
                    self.cold_streams += first
                    first = False
                    await self.stream(json.loads(body), writer)
                elif path.endswith("/models"):
                    writer.write(_json_response("200 OK", {"object": "list", "data": [{"id": "fake-model"}]}))
                elif path == "/stats":
                    writer.write(_json_response("200 OK", self.stats()))
                elif path in ("/version", "/health"):
                    writer.write(_json_response("200 OK", {"version": "fake-timed-1.0"}))
                else:
                    writer.write(_json_response("404 Not Found", {"error": {"message": "not here"}}))
                first = False
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def stream(self, req: dict, writer: asyncio.StreamWriter) -> None:
        t0 = time.perf_counter()
        n = int(req.get("max_tokens") or 16)
        chat = "messages" in req
        prompt = req.get("prompt") if not chat else " ".join(str(m.get("content")) for m in req["messages"])
        prompt_len = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        writer.write(_HEAD)
        sent, j, last = 0, 0, 0
        late, gaps = self.late_ns, self.gaps_ns
        batch: list[bytes] = []  # gap 0: chunks go out BATCH to a write (one send() each, not one per chunk)
        while sent < n:
            k = min(self.per_chunk, n - sent)
            due = t0 + self.first_s + j * self.gap_s
            if due > time.perf_counter():
                await wait_until(due, self.fine)
            if chat:  # a chunk is all reasoning or all answer: the boundary falls between chunks
                k = min(k, self.reasoning_tokens - sent) if sent < self.reasoning_tokens else k
            finish = "length" if sent + k == n else None
            if chat:
                field = self.reasoning_field if sent < self.reasoning_tokens else "content"
                frame = _frame(_chat_event(range(sent, sent + k), finish, field))
            else:
                frame = _frame(_event(range(sent, sent + k), finish))
            now = time.perf_counter_ns()
            if self.gap_s > 0:
                self.writes_ns.append(now)
            late.append(now - int(due * 1e9))
            if last:
                gaps.append(now - last)
            last = now
            sent += k
            j += 1
            if self.gap_s > 0:
                writer.write(frame)
                continue
            batch.append(frame)
            if j % BATCH == 0:
                writer.write(b"".join(batch))
                batch = []
                await writer.drain()
                await asyncio.sleep(0)  # let the other streams write too
        if batch:
            writer.write(b"".join(batch))
        usage: dict = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
        if chat and self.reasoning_usage and self.reasoning_tokens:
            usage["completion_tokens_details"] = {"reasoning_tokens": min(n, self.reasoning_tokens)}
        tail = b'data: {"id":"fake","object":"text_completion","choices":[],"usage":%s}\n\ndata: [DONE]\n\n' \
            % json.dumps(usage).encode()
        writer.write(_frame(tail) + b"0\r\n\r\n")
        await writer.drain()


@contextlib.contextmanager
def running(gap_ms: float = 20.0, first_ms: float = 0.0, tokens_per_chunk: int = 1,
            cpu: int | None = None, coarse: bool = False, reasoning_tokens: int = 0,
            reasoning_field: str = "reasoning", reasoning_usage: bool = True) -> Iterator[str]:
    """Start the server in its own process; yields its API base URL (`http://127.0.0.1:P/v1`)."""
    cmd = [sys.executable, __file__, "--gap-ms", str(gap_ms), "--first-ms", str(first_ms),
           "--tokens-per-chunk", str(tokens_per_chunk)] + ([] if cpu is None else ["--cpu", str(cpu)])
    cmd += ["--coarse"] if coarse else []
    cmd += ["--reasoning-tokens", str(reasoning_tokens), "--reasoning-field", reasoning_field]
    cmd += [] if reasoning_usage else ["--no-reasoning-usage"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("READY "):
            raise RuntimeError(f"the timed fake server did not start: {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _main(args: argparse.Namespace) -> None:
    srv = TimedServer(args.gap_ms / 1000, args.first_ms / 1000, args.tokens_per_chunk, fine=not args.coarse,
                      reasoning_tokens=args.reasoning_tokens, reasoning_field=args.reasoning_field,
                      reasoning_usage=not args.no_reasoning_usage)
    if srv.fine:
        fine_timer_slack()
    server = await asyncio.start_server(srv.handle, args.host, args.port, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    print(f"READY {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--first-ms", type=float, default=0.0)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--cpu", type=int, default=None, help="pin the server to this core")
    ap.add_argument("--coarse", action="store_true",
                    help="pace with asyncio.sleep alone (up to 1 ms late), not the busy-wait: to compare")
    ap.add_argument("--reasoning-tokens", type=int, default=0,
                    help="chat: the first N tokens of a stream are reasoning (delta.<--reasoning-field>)")
    ap.add_argument("--reasoning-field", default="reasoning", choices=("reasoning", "reasoning_content"))
    ap.add_argument("--no-reasoning-usage", action="store_true",
                    help="chat: the usage does not say how many tokens were reasoning")
    args = ap.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    try:
        asyncio.run(_main(args))
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()

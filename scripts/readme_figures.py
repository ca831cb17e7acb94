"""The README's performance figures, from one script anyone can re-run.

    .venv/bin/python scripts/readme_figures.py [--out runs/readme-figures] [--only engines,http,capacity,...] [--reuse]

Every figure records where it came from: the commit (and whether the tree was dirty), the CPU,
the date and the exact command, in its Markdown heading line and in OUT/figures.json. `--reuse`
reads a figure's earlier run only when that run was made at this commit with a clean tree.

Each figure is one `infer-bench` run (engines compared in ONE run, on equal resources: every
engine gets the same cores and compute threads, the run's default), or the sampler script. The
script prints a Markdown section per figure, names the CPU, and writes them to OUT/figures.md.
Ratios differ between CPUs: quote them with the CPU and commit they came from. Run it on an
otherwise idle machine.

vLLM runs from its own environment (.venv-vllm, or $INFER_BENCH_VLLM_PYTHON); without one the
figures leave it out and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.config import vllm_environment  # noqa: E402
from harness.core.env import cpu_model  # noqa: E402
from harness.core.results import read_rows  # noqa: E402


REUSE = False  # --reuse: a figure whose run finished before at this commit (clean tree) is read, not re-run
PROVENANCE: list[dict] = []  # one entry per figure: title, commit, dirty, cpu, date, commands


def head() -> tuple[str, bool]:
    """(HEAD's commit, whether the tracked tree differs from it)."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return commit, bool(dirty)


def run_commit(out: Path) -> tuple[str | None, bool | None]:
    """The commit an earlier run recorded in its environment.json, and whether its tree was dirty."""
    try:
        git = json.loads((out / "environment.json").read_text()).get("git") or {}
    except (OSError, ValueError):
        return None, None
    return git.get("commit"), git.get("dirty")


def reusable(out: Path) -> bool:
    if not (REUSE and (out / "results.jsonl").exists() and (out / "report.html").exists()):
        return False
    commit, dirty = run_commit(out)
    now, now_dirty = head()
    if commit != now or dirty or now_dirty:
        print(f"(not reusing {out}: it was run at {str(commit)[:10]}{' (dirty)' if dirty else ''}, HEAD is "
              f"{now[:10]}{' (dirty)' if now_dirty else ''})", flush=True)
        return False
    return True


def infer_bench(out: Path, *args: str) -> list[dict]:
    if reusable(out):
        print(f"$ infer-bench {' '.join(args)}   (reused: {out})", flush=True)
        return read_rows(out / "results.jsonl")
    cmd = [sys.executable, "-m", "harness.cli", *args, "quiet=true", f"hydra.run.dir={out}"]
    print("$ infer-bench " + " ".join(args), flush=True)
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    print(r.stdout[-4000:], flush=True)
    if r.returncode not in (0, 1):
        raise SystemExit(f"infer-bench failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return read_rows(out / "results.jsonl")


def ok(rows: list[dict], workload: str) -> list[dict]:
    return [r for r in rows if r.get("workload") == workload and r.get("status") == "ok"]


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def engines_figure(out: Path, vllm: str | None) -> str:
    """Throughput and decode steps on the small preset, 16 x 256 -> 64, bf16, every engine in one run."""
    engines = ["reference", "hf"] + (["vllm"] if vllm else [])
    args = [f"engines=[{','.join(engines)}]", "model=small", "dtype=bfloat16", "workload.batch_sizes=[1,16]",
            "workload.prompt_lens=[256]", "workload.output_len=64", "workload.min_repeats=3"]
    if vllm:
        args.append(f"engine_options.vllm.python={vllm}")
    rows = infer_bench(out / "engines", *args)
    sweep = ok(rows, "sweep")
    by = {(r["engine"], r["batch_size"]): r for r in sweep}
    lines = ["| engine | threads | out tok/s, batch 16 | decode step, batch 16 | decode step, batch 1 | prefill 16 x 256 |"
             " KV reserved | KV used (b16) | process peak |", "|---|---|---|---|---|---|---|---|---|"]
    for e in engines:
        b16, b1 = by.get((e, 16)), by.get((e, 1))
        if not b16:
            lines.append(f"| {e} | - | not measured | | | | | | |")
            continue
        mib = (lambda v: "-" if v is None else f"{v / 2**20:,.0f} MiB")
        lines.append(f"| {e} | {b16.get('compute_threads')} | {fmt(b16['output_tok_s'])} | "
                     f"{b16['decode_step_latency_s'] * 1e3:.1f} ms | "
                     f"{(b1['decode_step_latency_s'] * 1e3) if b1 else float('nan'):.1f} ms | "
                     f"{b16['prefill_latency_s'] * 1e3:.0f} ms | {mib(b16.get('kv_reserved_bytes'))} | "
                     f"{mib(b16.get('kv_used_bytes'))} | {mib(b16.get('peak_memory_bytes'))} |")
    ref = by.get(("reference", 16))
    ratios = []
    for e in engines[1:]:
        if ref and by.get((e, 16)):
            ratios.append(f"reference / {e}: {ref['output_tok_s'] / by[(e, 16)]['output_tok_s']:.2f}x output tok/s, "
                          f"{ref['decode_step_latency_s'] / by[(e, 16)]['decode_step_latency_s']:.2f}x decode-step time")
    parity = [r for r in rows if r.get("workload") == "parity"]
    plines = [f"| {r['engine']} | {r['status']} | {fmt(r.get('agreement'), '.2f')} | {fmt(r.get('parity_max_abs_err'), '.3g')} | "
              f"{fmt(r.get('parity_mean_kl'), '.2g')} | {fmt(r.get('parity_top1_agreement'), '.3f')} "
              f"({r.get('parity_confident_positions')}) |" for r in parity if r.get("parity_baseline") != r.get("engine")]
    text = ("\n".join(lines) + "\n\n" + ("; ".join(ratios) + "." if ratios else "") +
            "\n\nParity of the same run (bf16, teacher-forced against the reference engine):\n\n"
            "| engine | status | greedy agreement | max abs dlogp | mean KL | top-1 on confident positions |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(plines))
    return section("Engines side by side: small preset, bf16, 16 x 256 -> 64", args, text)


def http_figure(out: Path) -> str:
    """The same engine in-process and over HTTP (infer-bench-serve through the endpoint engine)."""
    args = ["engines=[reference,infer-bench-serve]", "model=tiny", "dtype=float32", "workload=serving",
            "workload.request_rates=[8]", "workload.num_requests=64", "workload.input_len=128",
            "workload.output_len=32", "parity=false"]
    rows = ok(infer_bench(out / "http", *args), "serving")
    by = {r["engine"]: r for r in rows}
    lines = ["| | TTFT p50 | TPOT p50 | E2EL p50 | output tok/s |", "|---|---|---|---|---|"]
    ms = (lambda v, spec: "-" if v is None else f"{v * 1e3:{spec}} ms")
    for e in ("reference", "infer-bench-serve"):
        r = by.get(e)
        if r:
            lines.append(f"| {e} | {ms(r.get('ttft_s'), '.1f')} | {ms(r.get('tpot_s'), '.2f')} | "
                         f"{ms(r.get('e2el_s'), '.0f')} | {fmt(r.get('output_tok_s'))} |"
                         + (" saturated |" if r.get("saturated") else "")
                         + (" client-limited |" if r.get("client_limited") else ""))
    if len(by) == 2 and all(by[e].get("ttft_s") for e in by):
        a, b = by["reference"], by["infer-bench-serve"]
        lines.append(f"\nHTTP / in-process: TTFT {b['ttft_s'] / a['ttft_s']:.2f}x, TPOT {b['tpot_s'] / a['tpot_s']:.2f}x, "
                     f"output tok/s {b['output_tok_s'] / a['output_tok_s']:.2f}x.")
    return section("What HTTP and serialisation cost: the reference engine in-process and as infer-bench-serve", args,
                   "\n".join(lines))


def capacity_figure(out: Path, vllm: str | None) -> str:
    """Capacity within SLOs for every in-process engine and one HTTP endpoint, one run."""
    engines = ["reference", "hf"] + (["vllm"] if vllm else []) + ["infer-bench-serve"]
    args = [f"engines=[{','.join(engines)}]", "model=tiny", "dtype=float32", "workload=capacity",
            "workload.search=concurrency", "workload.start=1", "workload.max_value=64",
            "workload.slo_ttft_p99_s=0.25", "workload.slo_tpot_p99_s=0.05", "workload.num_requests=32",
            "workload.input_len=128", "workload.output_len=32", "parity=false"]
    if vllm:
        args.append(f"engine_options.vllm.python={vllm}")
    rows = infer_bench(out / "capacity", *args)
    lines = ["| engine | capacity (requests in flight) | bracket | probes |", "|---|---|---|---|"]
    for r in rows:
        if r.get("workload") == "capacity" and (r.get("point") or {}).get("result"):
            lines.append(f"| {r['engine']} | {r.get('capacity_concurrency')} | {r.get('capacity_bracket')} | "
                         f"{len(r.get('capacity_probes') or [])} |")
    return section("Capacity: how many requests in flight each engine serves within p99 TTFT <= 250 ms and p99 TPOT "
                   "<= 50 ms (tiny preset, 128 -> 32 tokens)", args, "\n".join(lines) +
                   f"\n\nReport with the Pareto figure: `{out / 'capacity' / 'report.html'}`")


def ablation_figure(out: Path) -> str:
    """Per-step decode latency with and without a KV cache, over growing context."""
    args = ["engines=[reference,hf]", "model=small", "dtype=bfloat16", "workload=kv_ablation", "parity=false"]
    rows = ok(infer_bench(out / "kv_ablation", *args), "kv_ablation")
    by = {(r["engine"], r["mode"], r["context_len"]): r["decode_step_latency_s"] for r in rows}
    ctx = sorted({r["context_len"] for r in rows})
    cols = [(e, m) for e in ("reference", "hf") for m in ("cache", "no_cache")]
    lines = ["| context | " + " | ".join(f"{e}, {m.replace('_', ' ')}" for e, m in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for n in ctx:
        lines.append(f"| {n} | " + " | ".join(fmt(by.get((e, m, n), float('nan')) * 1e3, '.2f') + " ms"
                                            for e, m in cols) + " |")
    lines.append("| step at the longest / step at the shortest | " + " | ".join(
        f"{by[(e, m, ctx[-1])] / by[(e, m, ctx[0])]:.1f}x" if (e, m, ctx[0]) in by and (e, m, ctx[-1]) in by else "-"
        for e, m in cols) + " |")
    return section("With and without a KV cache: small, bf16, batch 1, per-step decode latency", args, "\n".join(lines))


def kv_memory_figure(out: Path, vllm: str | None) -> str:
    """Bytes per token beside the estimator, and the share of allocated KV slots left unused."""
    engines = ["reference", "hf"] + (["vllm"] if vllm else [])
    args = [f"engines=[{','.join(engines)}]", "model=small", "dtype=bfloat16", "workload=kv_memory", "parity=false"]
    if vllm:
        args.append(f"engine_options.vllm.python={vllm}")
    rows = ok(infer_bench(out / "kv_memory", *args), "kv_memory")
    lines = ["| engine | layout | KV dtype | block | bytes/token (engine) | bytes/token (estimator) | slots unused |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("point") or {}
        lines.append(f"| {r['engine']} | {r.get('kv_layout')} | {r.get('kv_dtype')} | {p.get('block_size', '-')} | "
                     f"{r.get('kv_bytes_per_token', '-')} | {r.get('kv_est_bytes_per_token', '-')} | "
                     f"{fmt(r['kv_waste_frac'] * 100 if r.get('kv_waste_frac') is not None else None, '.1f')} % |")
    return section("KV memory and waste: small, bf16, 16 sequences of uniform 64-2048 tokens", args, "\n".join(lines))


def prefix_figure(out: Path, vllm: str | None) -> str:
    engines = ["reference", "hf"] + (["vllm"] if vllm else [])
    args = [f"engines=[{','.join(engines)}]", "model=small", "dtype=bfloat16", "workload=prefix_sharing",
            "workload.prefix_lens=[1024]", "workload.num_requests=[16]", "parity=false"]
    if vllm:
        args.append(f"engine_options.vllm.python={vllm}")
    rows = ok(infer_bench(out / "prefix", *args), "prefix_sharing")
    by = {(r["engine"], r["prefix_caching"]): r for r in rows}
    lines = ["| engine | TTFT p50, caching on | caching off | speed-up | hit rate |", "|---|---|---|---|---|"]
    for e in engines:
        on, off = by.get((e, True)), by.get((e, False))
        lines.append(f"| {e} | {fmt(on and on['ttft_s'] * 1e3, '.0f')} ms | {fmt(off and off['ttft_s'] * 1e3, '.0f')} ms | "
                     f"{fmt(on and off and off['ttft_s'] / on['ttft_s'], '.1f')}x | "
                     f"{fmt(on and (on.get('prefix_hit_rate') or 0) * 100, '.1f')} % |")
    return section("Prefix caching: small, bf16, 16 requests sharing a 1,024-token prefix", args, "\n".join(lines))


def sampler_figure() -> str:
    r = subprocess.run([sys.executable, "scripts/sampler_overhead.py"], cwd=REPO, capture_output=True, text=True)
    return section("What the memory sampler costs (100 Hz, CPU)", ["scripts/sampler_overhead.py"],
                   "```\n" + (r.stdout.strip() or r.stderr[-2000:]) + "\n```")


def label() -> str:
    """Where a figure comes from, as the README quotes it: commit, CPU, date."""
    commit, dirty = head()
    return f"commit {commit[:7]}{' + uncommitted changes' if dirty else ''}, {cpu_model()}, {os.cpu_count()} cores, " \
           f"{datetime.now(timezone.utc):%Y-%m-%d}"


def section(title: str, args: list[str], body: str) -> str:
    cmd = "infer-bench " + " ".join(args) if args and "=" in args[0] else " ".join(args)
    commit, dirty = head()
    PROVENANCE.append({"title": title, "commit": commit, "dirty": dirty, "cpu": cpu_model(), "cores": os.cpu_count(),
                       "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": cmd})
    return f"### {title}\n\n[{label()}]\n\n```\n{cmd}\n```\n\n{body}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "runs" / "readme-figures"))
    ap.add_argument("--only", default="engines,http,capacity,kv_ablation,kv_memory,prefix,sampler")
    ap.add_argument("--reuse", action="store_true",
                    help="read a figure's earlier complete run under OUT instead of running it again")
    args = ap.parse_args()
    global REUSE
    REUSE = args.reuse
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vllm = vllm_environment()
    if vllm is None:
        print("no vLLM environment (.venv-vllm or $INFER_BENCH_VLLM_PYTHON): vLLM is left out", flush=True)
    parts = []
    for name in args.only.split(","):
        part = {"engines": lambda: engines_figure(out, vllm), "http": lambda: http_figure(out),
                "capacity": lambda: capacity_figure(out, vllm), "sampler": sampler_figure,
                "kv_ablation": lambda: ablation_figure(out), "kv_memory": lambda: kv_memory_figure(out, vllm),
                "prefix": lambda: prefix_figure(out, vllm)}[name]()
        print(part, flush=True)
        parts.append(part)
    (out / "figures.md").write_text("\n".join(parts))
    (out / "figures.json").write_text(json.dumps({"cpu": cpu_model(), "cores": os.cpu_count(), "figures": PROVENANCE},
                                                 indent=2))
    print(f"written: {out / 'figures.md'}")


if __name__ == "__main__":
    main()

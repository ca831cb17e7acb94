"""What serving LoRA adapters costs the reference engine per output token: a batch of requests each
served by its own adapter against the same batch on the engine without adapters, interleaved in one
process (both engines loaded, rounds alternated, the order flipped each round), then the profile of a
decode step of each.

    python scripts/lora_overhead.py [--preset tiny-trained] [--dtype float32] [--batch 8] [--adapters 4]
                                    [--prompt 64] [--output 32] [--rounds 8] [--threads 2] [--rank 8]
                                    [--targets q_proj,v_proj] [--top 12]

Per round and engine: the batch's requests all at once through serve(), TPOT per request (the time
between its first and last tokens over the tokens between), the round's median. The figure is the
median over rounds of the per-round ratio TPOT(adapters) / TPOT(none), with a Student-t 95 % interval
of the mean of the per-round log-ratios (harness.core.bootstrap.mean_t_ci, as infer-bench-ab's paired
rounds). The adapters: `infer-bench-lora make` for the preset (random, B not zero), request i with
adapter i mod --adapters, max_loras = --adapters. Also: the engine with adapters loaded serving
base-model requests only (no adapter row: nothing added). Name the CPU beside any figure quoted.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.base import ModelSpec, Request, now_ns  # noqa: E402
from adapters.reference.engine import ReferenceEngine  # noqa: E402
from harness.checkpoint import ensure_checkpoint  # noqa: E402
from harness.core.bootstrap import mean_t_ci  # noqa: E402
from harness.core.paths import model_cache_dir  # noqa: E402
from harness.core.presets import load_preset  # noqa: E402
from harness.lora_cli import make_adapters  # noqa: E402


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-trained")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--top", type=int, default=12)
    return ap


def tpot(engine: ReferenceEngine, reqs: list[Request]) -> float:
    """The median TPOT (seconds) of the batch's requests, served all at once."""
    times: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for ev in engine.serve(reqs, now_ns()):
        times[ev.request_id].append(ev.time_ns)
    return statistics.median((t[-1] - t[0]) / (len(t) - 1) / 1e9 for t in times.values())


def profile(engine: ReferenceEngine, reqs: list[Request], top: int, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        tpot(engine, reqs)
    print(f"\n-- {label}: top operators by self CPU time over the batch ({len(reqs)} requests)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = load_preset(args.preset)
    ckpt = ensure_checkpoint(shape, model_cache_dir(None))
    tmp = Path(tempfile.mkdtemp(prefix="lora-overhead-"))
    names = [f"a{i}" for i in range(args.adapters)]
    written = make_adapters(ckpt, shape, args.preset, tmp, names, args.rank, 2.0 * args.rank,
                            args.targets.split(","), 0, 2.0)
    spec = ModelSpec(str(ckpt), args.preset, args.dtype, "cpu", args.prompt + args.output + 8, threads=args.threads,
                     max_batch_size=args.batch)
    base, lora = ReferenceEngine(), ReferenceEngine()
    base.load(spec, {})
    info = lora.load(spec, {"lora_adapters": [{"name": n, "path": p, "rank": args.rank} for n, p in written],
                            "max_loras": args.adapters})
    print(f"{args.preset} {args.dtype}, batch {args.batch}, {args.adapters} adapters of rank {args.rank} on "
          f"{args.targets}, {args.prompt} -> {args.output} tokens, {args.threads} threads; kernels: "
          f"{info.details['kernels']}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, shape.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]

    def batch(with_adapters: bool, tag: str) -> list[Request]:
        return [Request(f"{tag}{i}", p, args.output, adapter=names[i % args.adapters] if with_adapters else None)
                for i, p in enumerate(prompts)]

    for e, a in ((base, False), (lora, True), (lora, False)):  # warm-up
        tpot(e, batch(a, "w"))
    rows = []
    for r in range(args.rounds):
        sides = [("none", base, False), ("adapters", lora, True), ("loaded, base rows", lora, False)]
        if r % 2:
            sides.reverse()
        got = {name: tpot(e, batch(a, f"r{r}")) for name, e, a in sides}
        rows.append(got)
        print(f"round {r}: TPOT none {got['none'] * 1e3:.3f} ms, adapters {got['adapters'] * 1e3:.3f} ms, "
              f"adapters loaded but base rows {got['loaded, base rows'] * 1e3:.3f} ms")
    for other in ("adapters", "loaded, base rows"):
        ratios = [x[other] / x["none"] for x in rows]
        logs = [math.log(v) for v in ratios]
        ci = mean_t_ci(logs)
        lo, hi = (math.exp(ci[0]), math.exp(ci[1])) if ci else (float("nan"), float("nan"))
        print(f"TPOT {other} / none: median of {len(ratios)} rounds {statistics.median(ratios):.3f} "
              f"(geometric mean {math.exp(statistics.mean(logs)):.3f}, 95% CI {lo:.3f} .. {hi:.3f})")
    profile(base, batch(False, "p"), args.top, "no adapters")
    profile(lora, batch(True, "q"), args.top, f"{args.adapters} adapters")
    print(f"slots: {lora.lora_stats()}")
    base.close()
    lora.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

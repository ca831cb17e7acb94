"""Where the reference engine's time goes: one prefill and a few decode steps under torch.profiler.

    python scripts/profile_reference.py [--preset small] [--batch 16] [--prompt 256] [--steps 16]
                                        [--device cpu] [--dtype bfloat16] [--threads 2]
                                        [--options key=value ...] [--top 25] [--no-profile]

Prints the engine's kernels (LoadInfo.details["kernels"]), the median prefill and decode-step
times without the profiler, then the top operators by self time for the prefill and for the decode
steps (per step). Name the CPU (lscpu) beside any figure you quote. Run it with
INFER_BENCH_CACHE=/tmp/<you> so that the checkpoint is cached where you want it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.base import ModelSpec  # noqa: E402
from adapters.reference.engine import ReferenceEngine  # noqa: E402


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(text.lower(), text)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--options", nargs="*", default=[], help="engine options, key=value")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-profile", action="store_true")
    return ap


def time_steps(engine: ReferenceEngine, prompts: list[list[int]], args: argparse.Namespace
               ) -> tuple[list[float], list[float]]:
    """(prefill times, decode step times) over --repeats rounds after one warm-up round."""
    prefill, steps = [], []
    for _ in range(args.repeats + 1):  # the first round warms up
        engine.reset_prefix_cache()
        t = time.perf_counter()
        engine.prefill(prompts)
        prefill.append(time.perf_counter() - t)
        steps += engine.decode(args.steps).step_latencies_s
        engine.release()
    return prefill[1:], steps[args.steps:]


def print_profiles(engine: ReferenceEngine, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """One prefill and --steps decode steps under torch.profiler: the top operators of each."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    engine.reset_prefix_cache()
    with profile(activities=acts) as p_prefill:
        engine.prefill(prompts)
    with profile(activities=acts) as p_decode:
        engine.decode(args.steps)
    engine.release()
    sort = "self_device_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    for label, p, n in (("prefill", p_prefill, 1), (f"decode ({args.steps} steps)", p_decode, args.steps)):
        events = p.key_averages()
        print(f"\n== {label}: {sum(e.count for e in events) / n:.0f} operator calls per step")
        print(events.table(sort_by=sort, row_limit=args.top))


def main() -> int:
    args = parser().parse_args()

    from harness.checkpoint import ensure_checkpoint
    from harness.core.paths import model_cache_dir
    from harness.core.presets import load_preset

    shape = load_preset(args.preset)
    ckpt = ensure_checkpoint(shape, model_cache_dir())
    options = dict(kv.split("=", 1) for kv in args.options)
    options = {k: _value(v) for k, v in options.items()}
    engine = ReferenceEngine()
    info = engine.load(ModelSpec(path=str(ckpt), name=args.preset, dtype=args.dtype, device=args.device,
                                 max_model_len=args.prompt + args.steps + 8, max_batch_size=args.batch,
                                 threads=args.threads), options)
    print(f"kernels: {info.details.get('kernels')}  threads: {info.compute_threads}  torch {torch.__version__}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, min(shape.vocab_size, 30000), (args.prompt,), generator=g).tolist()
               for _ in range(args.batch)]
    prefill, steps = time_steps(engine, prompts, args)
    print(f"{args.preset} {args.dtype} {args.device}: prefill {args.batch}x{args.prompt} "
          f"{statistics.median(prefill) * 1e3:.1f} ms; decode step (batch {args.batch}) "
          f"{statistics.median(steps) * 1e3:.2f} ms median; output tok/s (prefill + {args.steps} steps) "
          f"{args.batch * (args.steps + 1) / (statistics.median(prefill) + args.steps * statistics.median(steps)):.1f}")
    if args.no_profile:
        return 0
    print_profiles(engine, prompts, args)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

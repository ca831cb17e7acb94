"""Where a speculative decode step of the reference engine spends its time, and what it gains.

    python scripts/profile_speculative.py [--model harness/shipped/tiny-trained] [--method ngram]
                                          [--k 4] [--draft DIR] [--batch 1] [--prompts 8]
                                          [--prompt-len 128] [--output-len 64] [--rounds 3]
                                          [--dtype float32] [--threads 2] [--options key=value ...]
                                          [--profile] [--top 30]

Two engines on the same model, one without speculation and one with it, decode the same
held-out windows (the model directory's heldout.npy, as the speculative workload's `code`
content) one batch at a time, interleaved (off, on, off, on ...) for --rounds rounds. It prints
TPOT (decode time / tokens after the first, per batch) of each, the ratio of the medians and the
geometric mean of the paired per-batch ratios with a bootstrap 95 % interval, the acceptance
counters, the median latency of an engine step by kind (without speculation; a speculative step
that gave a sequence several tokens; one that gave one token each), and checks that the tokens
are the same. --profile then runs the speculative decodes
under cProfile and prints the top functions by own time and by cumulative time, with the
counters' split of the step into proposing and verifying. Wrap it in `/work/tools/cpu bench` (or
run it alone) before quoting a figure, and name the commit and the CPU (lscpu) beside it. The
harness's own figure is workload=speculative's `speedup` (same definition, over serve()).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.base import ModelSpec  # noqa: E402
from adapters.reference.engine import ReferenceEngine  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(text.lower(), text)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "harness" / "shipped" / "tiny-trained"),
                    help="a checkpoint directory with heldout.npy (a trained preset)")
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft"))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft", default=None, help="method draft: the draft's checkpoint directory")
    ap.add_argument("--lookup", default="2,4", help="ngram: prompt_lookup_min,prompt_lookup_max")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8, help="held-out windows (a multiple of --batch)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--options", nargs="*", default=[], help="engine options of both engines, key=value")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    return ap


def windows(model: str, n: int, length: int, seed: int) -> list[list[int]]:
    ids = np.load(Path(model) / "heldout.npy")
    rng = random.Random(seed)
    return [ids[(s := rng.randrange(0, len(ids) - length)):s + length].tolist() for _ in range(n)]


def decode_batch(engine: ReferenceEngine, prompts: list[list[int]], steps: int,
                 step_times: dict[str, list[float]] | None = None) -> tuple[float, list[list[int]]]:
    """(TPOT of the batch: decode time / steps, the tokens). With `step_times`, each engine step's
    latency is added to its kind's list: `plain` (no speculation), `several` (a speculative step
    that gave some sequence more than one token: a draft accepted in part at least) or `one`
    (a speculative step that gave one token each: no draft, or every draft token rejected)."""
    pre = engine.prefill(prompts)
    t = time.perf_counter()
    dec = engine.decode(steps)
    dt = time.perf_counter() - t
    engine.release()
    if step_times is not None:
        for j, s in enumerate(dec.steps):
            kind = "plain" if dec.emitted is None else "several" if max(dec.emitted[j]) > 1 else "one"
            step_times.setdefault(kind, []).append(s.latency_s)
    return dt / steps, [[f] + [dec.tokens[i][b] for i in range(steps)] for b, f in enumerate(pre.first_tokens)]


def bootstrap_geomean(ratios: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    logs = np.log(np.asarray(ratios))
    rng = np.random.default_rng(seed)
    means = rng.choice(logs, size=(n, len(logs))).mean(axis=1)
    return float(np.exp(logs.mean())), float(np.exp(np.percentile(means, 2.5))), float(np.exp(np.percentile(means, 97.5)))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    options = dict(kv.split("=", 1) for kv in args.options)
    options = {k: _value(v) for k, v in options.items()}
    lo, hi = (int(x) for x in args.lookup.split(","))
    spec_opts = {**options, "speculative_method": args.method, "num_speculative_tokens": args.k,
                 "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    if args.method == "draft":
        spec_opts["draft_model"] = args.draft or args.model
    spec = ModelSpec(path=args.model, name=Path(args.model).name, dtype=args.dtype,
                     max_model_len=args.prompt_len + args.output_len + 8, max_batch_size=args.batch,
                     threads=args.threads)
    off, on = ReferenceEngine(), ReferenceEngine()
    off.load(spec, options)
    info = on.load(spec, spec_opts)
    print(f"kernels: {info.details['kernels']}")
    prompts = windows(args.model, args.prompts, args.prompt_len, args.seed)
    batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    steps = args.output_len - 1
    for engine in (off, on):  # warm up (oneDNN's first calls, the fused kernel)
        decode_batch(engine, batches[0], min(steps, 8))
    s0 = on.spec_decode_stats()
    tpot_off: dict[int, list[float]] = {i: [] for i in range(len(batches))}
    tpot_on: dict[int, list[float]] = {i: [] for i in range(len(batches))}
    step_times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for i, b in enumerate(batches):
            order = (off, on) if (r + i) % 2 == 0 else (on, off)
            outs = {}
            for engine in order:
                tpot, toks = decode_batch(engine, b, steps, step_times)
                (tpot_off if engine is off else tpot_on)[i].append(tpot)
                outs[engine is on] = toks
            if outs[True] != outs[False]:
                print(f"tokens differ for batch {i} (round {r}): not lossless", file=sys.stderr)
                return 1
    s1 = on.spec_decode_stats()
    med_off = [statistics.median(v) for v in tpot_off.values()]
    med_on = [statistics.median(v) for v in tpot_on.values()]
    ratios = [a / b for a, b in zip(med_off, med_on)]
    g, lo95, hi95 = bootstrap_geomean(ratios)
    drafts, acc = s1.drafts - s0.drafts, s1.accepted_tokens - s0.accepted_tokens
    prop = s1.draft_tokens - s0.draft_tokens
    print(f"{args.method} k={args.k} batch {args.batch}, {len(batches)} batches x {args.rounds} rounds, "
          f"{args.prompt_len} -> {args.output_len} tokens, {args.dtype}; tokens identical without speculation")
    print(f"TPOT without {statistics.median(med_off) * 1e3:.3f} ms, with {statistics.median(med_on) * 1e3:.3f} ms; "
          f"speed-up (median / median) {statistics.median(med_off) / statistics.median(med_on):.3f}; "
          f"geometric mean of paired ratios {g:.3f} (95 % {lo95:.3f}-{hi95:.3f})")
    print(f"drafts {drafts}, proposed {prop}, accepted {acc}: rate {acc / max(prop, 1):.3f}, mean acceptance length "
          f"{1 + acc / max(drafts, 1):.2f}; per position "
          f"{[a - b for a, b in zip(s1.accepted_per_pos, s0.accepted_per_pos)]}; draft time "
          f"{s1.draft_time_s - s0.draft_time_s:.3f} s, verify time {s1.verify_time_s - s0.verify_time_s:.3f} s")
    what = {"plain": "decode step without speculation", "several": "speculative step that gave a sequence 2+ tokens",
            "one": "speculative step that gave 1 token each"}
    print("step latency, median: " + "; ".join(f"{what[k]} {statistics.median(v) * 1e3:.3f} ms ({len(v)} steps)"
                                               for k, v in step_times.items() if v))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        n_steps = 0
        for b in batches:
            on.prefill(b)
            n_steps += len(on.decode(steps).steps)
            on.release()
        prof.disable()
        print(f"\ncProfile of the speculative decodes ({n_steps} engine steps, prefills included):")
        st = pstats.Stats(prof).strip_dirs()
        st.sort_stats("tottime").print_stats(args.top)
        st.sort_stats("cumulative").print_stats(args.top)
    off.close()
    on.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

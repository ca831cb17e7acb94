"""Where the reference engine's time goes: one prefill and a few decode steps under torch.profiler.

    python scripts/profile_reference.py [--preset small] [--batch 16] [--prompt 256] [--steps 16]
                                        [--device cpu] [--dtype bfloat16] [--threads 2]
                                        [--options key=value ...] [--top 25] [--no-profile] [--parts]

Prints the engine's kernels (LoadInfo.details["kernels"]), the median prefill and decode-step
times without the profiler, then the top operators by self time for the prefill and for the decode
steps (per step); the C kernels the engine calls through ctypes appear as "C module.Class.method".
--parts also times a decode step's matrix products and its decode attention each alone (CPU). Name the CPU (lscpu) beside any figure you quote. Run it with
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
    ap.add_argument("--parts", action="store_true", help="also time a decode step's products and attention alone")
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


# The C kernels the engine calls through ctypes are no torch operators: under the profiler each
# call is labelled by wrapping its entry point (here only, never in the engine).
C_KERNELS = (("cpu_decode", "PagedDecode", "__call__"), ("cpu_decode", "Greedy", "__call__"),
             ("cpu_gemv", "HalfGemv", "__call__"), ("cpu_layer", "DecodeLayer", "__call__"),
             ("cpu_amx", "AmxKernels", "linear"), ("cpu_amx", "AmxKernels", "decode"),
             ("cpu_amx", "AmxDecodeLayer", "__call__"))


def label_c_kernels() -> None:
    """Wrap each C kernel's entry point in torch.profiler.record_function("C <module>.<class>.<name>")."""
    import importlib

    from torch.profiler import record_function

    for module, cls, name in C_KERNELS:
        owner = getattr(importlib.import_module(f"adapters.reference.{module}"), cls)
        real = getattr(owner, name)

        def labelled(*a, _real=real, _label=f"C {module}.{cls}.{name}", **k):
            with record_function(_label):
                return _real(*a, **k)
        setattr(owner, name, labelled)


def print_parts(engine: ReferenceEngine, args: argparse.Namespace) -> None:
    """Where a decode step at --batch rows goes, each part alone (best of 5, torch's threads): every
    matrix product of a step through the engine's own linears (M rows; the LM head included), and
    the decode attention of every layer over --batch sequences at the step's context through the
    engine's decode kernel; the rest of the step is the step's median less the two."""
    import statistics as st

    from adapters.reference.kv_cache import KVPool

    model, b = engine.model, args.batch
    linears = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
               if m is not None] + [model.lm_head]
    xs = {m.shape[1]: torch.randn(b, m.shape[1]).to(model.dtype) for m in linears}

    def best(fn) -> float:
        fn()
        out = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return min(out)

    with torch.inference_mode():
        products = best(lambda: [m(xs[m.shape[1]]) for m in linears])
        c, bs = model.cfg, engine.block_size
        ctx = args.prompt + args.steps // 2
        per_seq = -(-ctx // bs)
        pool = KVPool(c.num_layers, b * per_seq, bs, c.num_kv_heads, c.head_dim, "auto", model.dtype, model.device)
        pool.prepare(set(range(b * per_seq)))
        pool.k.normal_()
        pool.v.normal_()
        tables, lens = torch.arange(b * per_seq).view(b, per_seq), torch.full((b,), ctx)
        q = torch.randn(b, c.num_heads, c.head_dim).to(model.dtype)
        attention = engine.kernels.attention(pool, [], c.num_heads, model.device)
        decode = attention.decode_fn if getattr(attention, "decode_fn", None) else None
        if decode is not None:
            attn = best(lambda: [decode(q, pool, i, tables, lens) for i in range(c.num_layers)])
        else:
            attn = float("nan")
    step = st.median(engine.decode(args.steps).step_latencies_s)
    engine.release()
    print(f"\n== decode step parts at batch {b}, context {ctx} (each alone, best of 5)")
    print(f"products {products * 1e3:.2f} ms ({sum(m.nbytes for m in linears) / products / 1e9:.1f} GB/s of weights); "
          f"attention {attn * 1e3:.2f} ms ({2 * c.num_layers * b * ctx * c.num_kv_heads * c.head_dim * model.dtype.itemsize / attn / 1e9:.1f} GB/s of KV); "
          f"step {step * 1e3:.2f} ms; the rest {(step - products - attn) * 1e3:.2f} ms")


def print_profiles(engine: ReferenceEngine, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """One prefill and --steps decode steps under torch.profiler: the top operators of each (the C
    kernels labelled "C module.Class.method")."""
    from torch.profiler import ProfilerActivity, profile

    label_c_kernels()
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
    if args.parts:
        engine.reset_prefix_cache()
        engine.prefill(prompts)
        print_parts(engine, args)
    if args.no_profile:
        return 0
    print_profiles(engine, prompts, args)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every GPU check of the reference engine in one call (for a session that is lent a GPU).

    python scripts/gpu_check.py [OUT_DIR] [--model llama-3-8b] [--skip-big] [--sweep]

Needs torch with CUDA, transformers and (for the fast decode path) Triton; not hydra, omegaconf
or plotly (the engines are built directly; `--sweep` adds a harness sweep when hydra is there).
Budget: about 4-5 minutes on an H200 with an 8B-shaped model, machine start not included.

1. correctness, tiny preset, fp32: the reference engine (CUDA kernels: SDPA prefill, Triton
   paged decode, CUDA graphs) and transformers give identical greedy tokens for a batch of
   unequal prompts, and logits within 1e-4 (prefill and every decode step); the same for
   kernels=plain, int8 KV (against the plain path, same quantisation) and a cached prefix;
2. the Triton decode kernel against the PyTorch paged decode on the GPU: bf16 / fp16 / fp32,
   int8 and fp8 KV, block sizes 16 and 4, several context splits;
3. the NVML memory sampler (as before);
4. the device's ceilings (copy bandwidth, bf16 matmul), as harness.core.roofline measures them;
5. the reference engine's GPU goals on a real shape (default llama-3-8b, bf16, random weights written on
   the GPU): decode step at batch 1 against HBM bandwidth (>= 65 %), prefill 16 x 512 against
   the matmul peak (>= 60 %), output tok/s at batch 16 (16 x 512 -> 64) against transformers
   (>= 1.5x); also the eager decode step (graphs off) for comparison.

Prints every figure and a summary; writes OUT_DIR/gpu_check.json. Exits 1 if a correctness
check fails (a missed speed goal is reported, not failed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS: dict = {"checks": {}, "goals": {}}


def _prompts(lengths, vocab, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, min(vocab, 30000), (n,), generator=g).tolist() for n in lengths]


def _rel(a, b) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().cpu().abs().max())


def _run(engine, prompts, steps):
    pre = engine.prefill(prompts, return_logits=True)
    dec = engine.decode(steps, return_logits=True)
    engine.release()
    return pre, dec


def _compare(name, a, b, tol=1e-4):
    (pa, da), (pb, db) = a, b
    errs = [_rel(pa.logits, pb.logits)] + [_rel(x, y) for x, y in zip(da.logits, db.logits)]
    same = pa.first_tokens == pb.first_tokens and da.tokens == db.tokens
    ok = same and max(errs) < tol
    print(f"  {name}: tokens identical={same}, max relative logit error {max(errs):.2e} (< {tol}) -> {'ok' if ok else 'FAIL'}")
    return ok, max(errs)


def check_correctness(ckpt: Path) -> None:
    import torch

    from adapters.base import ModelSpec
    from adapters.hf import HFEngine
    from adapters.reference.engine import ReferenceEngine

    spec = ModelSpec(path=str(ckpt), name="tiny", dtype="float32", device="cuda", max_model_len=256,
                     max_batch_size=4, max_batch_tokens=256)
    prompts = _prompts((7, 16, 33, 64), 4096)
    hf = HFEngine()
    hf.load(spec, {})
    oracle = _run(hf, prompts, 31)
    base = prompts[3]
    shared = [base[:40] + [7, 8, 9], base[:33] + [5], base + [11]]
    oracle_shared = _run(hf, shared, 8)
    hf.close()
    out, ok = {}, True
    for label, options in (("auto (SDPA, Triton, CUDA graphs)", {"max_num_seqs": 8}), ("plain", {"kernels": "plain"}),
                           ("auto, block_size 4, chunked prefill", {"max_num_seqs": 8, "block_size": 4,
                                                                     "max_num_batched_tokens": 40})):
        e = ReferenceEngine()
        info = e.load(spec, options)
        res = _run(e, prompts, 31)
        good, err = _compare(label, res, oracle)
        e.prefill([base]), e.release()  # then prompts sharing its prefix
        good2, err2 = _compare(label + ", cached prefix", _run(e, shared, 8), oracle_shared)
        kv = e.kv_cache_info().extra
        out[label] = {"max_rel_err": max(err, err2), "kernels": info.details["kernels"],
                      "graph_replays": kv.get("cuda_graphs", {}).get("replays"), "ok": good and good2}
        print(f"    kernels: {info.details['kernels']}; graphs: {kv.get('cuda_graphs')}")
        if label.startswith("auto") and not kv.get("cuda_graphs", {}).get("replays"):
            print("  FAIL: no decode step was replayed from a CUDA graph")
            good = False
        ok = ok and good and good2
        e.close()
    # int8 KV: the fast path against the plain path (the same quantisation)
    res = {}
    for label, options in (("auto", {"kv_dtype": "int8", "max_num_seqs": 8}), ("plain", {"kv_dtype": "int8", "kernels": "plain"})):
        e = ReferenceEngine()
        e.load(spec, options)
        res[label] = _run(e, prompts, 31)
        e.close()
    good, err = _compare("int8 KV, auto vs plain", res["auto"], res["plain"], tol=1e-3)
    out["int8 auto vs plain"] = {"max_rel_err": err, "ok": good}
    ok = ok and good
    torch.cuda.empty_cache()
    RESULTS["checks"]["correctness_fp32_tiny"] = out
    assert ok, "the reference engine disagrees with transformers on CUDA"


def check_triton_kernel() -> None:
    import torch

    from adapters.reference.kernels_cuda import paged_decode_torch, paged_decode_triton
    from adapters.reference.kv_cache import KVPool

    dev = torch.device("cuda")
    fp8 = torch.cuda.get_device_capability(dev) >= (8, 9)
    cases = [("auto", torch.bfloat16, 16), ("auto", torch.float16, 16), ("auto", torch.float32, 16),
             ("auto", torch.bfloat16, 4), ("int8", torch.bfloat16, 16)] + ([("fp8", torch.bfloat16, 16)] if fp8 else [])
    g = torch.Generator(device=dev).manual_seed(0)
    worst, ok = {}, True
    for kv_dtype, dtype, bs in cases:
        nb = 64
        pool = KVPool(1, nb, bs, 8, 128, kv_dtype, dtype, dev, scratch_blocks=1)
        rows = pool.rows(torch.arange(nb, device=dev).repeat_interleave(bs), torch.arange(bs, device=dev).repeat(nb))
        pool.write(0, rows, torch.randn(nb * bs, 8, 128, generator=g, device=dev, dtype=dtype),
                   torch.randn(nb * bs, 8, 128, generator=g, device=dev, dtype=dtype))
        tables = torch.stack([torch.randperm(nb, device=dev)[:40] for _ in range(5)]).to(torch.int32)
        lens = torch.tensor([40 * bs, 1, 17, 3 * bs, 40 * bs - 5], device=dev, dtype=torch.int32)
        q = torch.randn(5, 32, 128, generator=g, device=dev, dtype=dtype)
        want = paged_decode_torch(q, pool, 0, tables, lens).float()
        for splits in (1, 4, 16):
            got = paged_decode_triton(q, pool, 0, tables, lens, splits=splits).float()
            err = float((got - want).abs().max() / want.abs().max())
            key = f"{kv_dtype}/{str(dtype).replace('torch.', '')}/bs{bs}"
            worst[key] = max(worst.get(key, 0.0), err)
    for key, err in worst.items():
        tol = 1e-5 if "float32" in key else 2e-2
        good = err < tol
        ok = ok and good
        print(f"  triton vs torch paged decode {key}: max relative error {err:.2e} (< {tol}) -> {'ok' if good else 'FAIL'}")
    if not fp8:
        print("  fp8 KV: skipped (compute capability < 8.9)")
    RESULTS["checks"]["triton_kernel"] = worst
    assert ok, "the Triton decode kernel disagrees with the PyTorch one"


def check_sampler() -> None:
    import torch

    from harness.core.memory import MemorySampler
    s = MemorySampler(100, "cuda").start()
    x = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    time.sleep(1.0)
    r = s.stop()
    del x
    print(f"  sampler: source={r.source} samples={r.samples} peak={r.peak_bytes / 2**20:.0f} MiB "
          f"device_peak={None if r.device_peak_used_bytes is None else r.device_peak_used_bytes / 2**20:.0f} MiB "
          f"torch_peak={r.torch_peak_allocated_bytes} overhead={r.overhead_frac:.4f} note={r.note}")
    RESULTS["checks"]["sampler"] = {"source": r.source, "peak_bytes": r.peak_bytes}
    assert r.source == "nvml" and r.peak_bytes >= 512 << 20


def _timed(fn, sync):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t, out


def measure_engine(cls, spec, options, shape, label, sync, batch=16, prompt=512, output=64, repeats=3):
    """prefill 16 x 512 (median), decode step at batch 1 (median of 64), output tok/s at batch 16."""
    import torch

    e = cls()
    t = time.perf_counter()
    info = e.load(spec, options)
    load_s = time.perf_counter() - t
    p16 = _prompts([prompt] * batch, shape.vocab_size, seed=1)
    p1 = p16[:1]
    e.prefill(p16), e.decode(4), e.release()  # warm-up
    e.prefill(p1), e.decode(4), e.release()
    prefill, e2e = [], []
    for _ in range(repeats):
        if hasattr(e, "reset_prefix_cache"):
            e.reset_prefix_cache()
        pre = e.prefill(p16)
        dec = e.decode(output - 1)
        e.release()
        prefill.append(pre.latency_s)
        e2e.append(pre.latency_s + sum(dec.step_latencies_s))
    e.prefill(p1)
    steps1 = e.decode(64).step_latencies_s
    e.release()
    r = {"load_s": round(load_s, 2), "prefill_16x512_s": statistics.median(prefill),
         "decode_step_b1_s": statistics.median(steps1), "output_tok_s_b16": batch * output / statistics.median(e2e),
         "details": {k: v for k, v in info.details.items() if k in ("kernels", "gpu_memory")}}
    if getattr(e, "graphs", None) is not None:  # the same decode step without graphs, for comparison
        graphs, e.runner.graphs = e.runner.graphs, None
        e.prefill(p1)
        r["decode_step_b1_eager_s"] = statistics.median(e.decode(32).step_latencies_s)
        e.release()
        e.runner.graphs = graphs
        r["graph_stats"] = e.graphs.stats()
    print(f"  {label}: load {r['load_s']} s; prefill 16x512 {r['prefill_16x512_s'] * 1e3:.1f} ms; decode step b1 "
          f"{r['decode_step_b1_s'] * 1e3:.2f} ms" + (f" (eager {r['decode_step_b1_eager_s'] * 1e3:.2f} ms)"
                                                     if "decode_step_b1_eager_s" in r else "")
          + f"; output tok/s b16 {r['output_tok_s_b16']:.0f}", flush=True)
    e.close()
    del e
    torch.cuda.empty_cache()
    return r


def check_goals(model: str, cache: Path) -> None:
    import torch

    from adapters.base import ModelSpec
    from adapters.hf import HFEngine
    from adapters.reference.engine import ReferenceEngine
    from harness.checkpoint import cached_path, write_checkpoint
    from harness.core.presets import load_preset
    from harness.core.roofline import decode_bytes_per_step, measure, prefill_flops

    shape = load_preset(model)
    t = time.perf_counter()
    ceil = measure("cuda", "bfloat16")
    print(f"  ceilings: {ceil.device_name}: copy {ceil.mem_bw_bytes_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil.matmul_flops / 1e12:.0f} TFLOP/s ({time.perf_counter() - t:.0f} s)", flush=True)
    ck = cached_path(shape, cache, 0)
    if not (ck / "config.json").exists():
        t = time.perf_counter()
        write_checkpoint(shape, ck, 0, device="cuda")
        print(f"  wrote {model} (random weights) in {time.perf_counter() - t:.0f} s", flush=True)
    torch.cuda.empty_cache()
    sync = torch.cuda.synchronize
    spec = ModelSpec(path=str(ck), name=model, dtype="bfloat16", device="cuda", max_model_len=1024,
                     max_batch_size=16, max_batch_tokens=8192)
    ref = measure_engine(ReferenceEngine, spec, {"max_num_seqs": 16}, shape, "reference", sync)
    hf = measure_engine(HFEngine, spec, {}, shape, "transformers", sync)
    bw_frac = decode_bytes_per_step(shape, "bfloat16", "bf16", 1, 512 + 32) / ref["decode_step_b1_s"] / ceil.mem_bw_bytes_s
    mm_frac = prefill_flops(shape, 16, 512) / ref["prefill_16x512_s"] / ceil.matmul_flops
    ratio = ref["output_tok_s_b16"] / hf["output_tok_s_b16"]
    goals = {
        "decode step b1 >= 65% of HBM bandwidth": (bw_frac, bw_frac >= 0.65),
        "prefill 16x512 >= 60% of matmul peak": (mm_frac, mm_frac >= 0.60),
        "output tok/s b16 >= 1.5x transformers": (ratio, ratio >= 1.5),
    }
    for name, (value, met) in goals.items():
        print(f"  GOAL {name}: {value:.2f} -> {'met' if met else 'MISSED'}")
    RESULTS["goals"] = {"model": model, "ceilings": {"copy_bytes_s": ceil.mem_bw_bytes_s, "matmul_flops": ceil.matmul_flops,
                                                     "device": ceil.device_name},
                        "reference": ref, "transformers": hf,
                        "results": {k: {"value": v, "met": m} for k, (v, m) in goals.items()}}


def check_sweep(out: Path, model: str) -> None:
    cmd = [sys.executable, "-m", "harness.cli", "engines=[reference,hf]", f"model={model}", "dtype=bfloat16",
           "device=cuda", "workload.batch_sizes=[1,16]", "workload.prompt_lens=[512]", "workload.output_len=32",
           f"hydra.run.dir={out / 'sweep'}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--skip-big", action="store_true", help="no real-shape goals (the correctness checks only)")
    ap.add_argument("--sweep", action="store_true", help="also a harness sweep (needs hydra-core)")
    args = ap.parse_args()
    import torch

    from harness.checkpoint import ensure_checkpoint
    from harness.core.presets import load_preset

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.gettempdir()) / "gpu-check-models"  # never under OUT: that comes back
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
    RESULTS["device"] = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    ckpt = ensure_checkpoint(load_preset("tiny"), cache)
    checks = [("correctness", lambda: check_correctness(ckpt)), ("triton", check_triton_kernel),
              ("sampler", check_sampler)]
    if not args.skip_big:
        checks.append(("goals", lambda: check_goals(args.model, cache)))
    if args.sweep:
        checks.append(("sweep", lambda: check_sweep(out, args.model)))
    failed = []
    for name, fn in checks:
        print(f"== {name} ({time.perf_counter() - t0:.0f} s)", flush=True)
        try:
            fn()
        except Exception as e:  # report every check, then fail
            print(f"{name}: FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
            failed.append(name)
    RESULTS["failed"] = failed
    RESULTS["elapsed_s"] = round(time.perf_counter() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    print(f"done in {RESULTS['elapsed_s']} s; failed: {failed or 'none'}; {out / 'gpu_check.json'}")
    return 1 if [f for f in failed if f != "goals"] else 0


if __name__ == "__main__":
    sys.exit(main())

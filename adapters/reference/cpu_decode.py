"""Fused paged decode attention for CPUs: a small C kernel, compiled for this machine at load.

The plain decode path gathers each sequence's blocks into a contiguous copy and then multiplies:
the context's K/V cross memory three times (read the pool, write the copy, read the copy). At
batch 16 on the `small` preset that traffic is of the order of the weights' own. This kernel
reads K/V once, straight from the pool through the block table, like vLLM's CPU attention does,
and vectorises the softmax's exponentials (libmvec) across a block's tokens.

What it computes is attention.decode_attention (the reference semantics): for sequence b and
KV head h, the G query heads that share h against tokens 0 .. lens[b]-1, each token's key and
value at row (h * total_blocks + table[b][t / block_size]) * block_size + t % block_size of the
layer's [kv_heads * total_blocks * block_size, head_dim] pool. Per (b, h) it converts each key
and value row to float32 once, keeps an online softmax (running max, running sum, weighted sum
of values) over chunks of at most 64 tokens of a block, and writes acc / sum in the model's
dtype. Scores and probabilities stay in float32 (the plain path rounds them to the model's
dtype), so bf16 results differ from it by bf16 rounding only. (sequence, head) pairs run in
parallel on torch's own OpenMP threads: the library links the libgomp torch already loaded.

No torch headers: the C file compiles in about a second with `cc -O3 -march=native -ffast-math -fopenmp`
and is called through ctypes with raw pointers. The build is cached per source, compiler and
CPU (its flags), so a binary is never run on a CPU it was not built for. Anything that fails
(no compiler, a build error, a probe that disagrees with the plain path) leaves the plain
path in place; kernels.py records why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

C_SOURCE = r"""
#include <math.h>
#include <stdint.h>

#define MAXG 16     /* query heads per KV head */
#define MAXD 256    /* head_dim */
#define CHUNK 64    /* tokens scored at once */

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    union { uint32_t u; float f; } c;
    c.f = f;
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

static inline void load_row(int bf16, const void *base, int64_t row, int d, float *dst) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + row * d;
        for (int i = 0; i < d; i++) dst[i] = bf16_to_f32(p[i]);
    } else {
        const float *p = (const float *)base + row * d;
        for (int i = 0; i < d; i++) dst[i] = p[i];
    }
}

static inline float dot(const float *a, const float *b, int d) {
    float s = 0.f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];  /* vectorised: -ffast-math lets it reassociate */
    return s;
}

/* Attention of sequence b's G query heads that share KV head h (see the module's docstring),
   written to out's rows of those heads. q: [B, H, D] with strides (q_sb, q_sh, 1); k, v: one
   layer, [KV, NB, BS, D] contiguous; tables: int64 [B, W]; lens: int64 [B]; out: [B, H, D]
   contiguous. bf16: 1 for bfloat16, 0 for float32 (q, k, v and out alike). G <= MAXG, D <= MAXD. */
static void attend_head(int bf16, const void *q, int64_t q_sb, int64_t q_sh, const void *k, const void *v,
                        const int64_t *tables, const int64_t *lens, void *out, int b, int h, int H, int KV,
                        int D, int64_t NB, int BS, int W, float scale) {
    int G = H / KV;
    float qf[MAXG][MAXD], acc[MAXG][MAXD], m[MAXG], l[MAXG];
    float kf[CHUNK][MAXD], vf[MAXD], s[MAXG][CHUNK];
    for (int g = 0; g < G; g++) {
        int64_t off = (int64_t)b * q_sb + (int64_t)(h * G + g) * q_sh;
        for (int i = 0; i < D; i++)
            qf[g][i] = bf16 ? bf16_to_f32(((const uint16_t *)q)[off + i]) : ((const float *)q)[off + i];
        for (int i = 0; i < D; i++) acc[g][i] = 0.f;
        m[g] = -1e30f;  /* no infinities: built with -ffast-math */
        l[g] = 0.f;
    }
    int64_t len = lens[b];
    for (int64_t t0 = 0; t0 < len;) {
        int64_t block = tables[(int64_t)b * W + t0 / BS];
        int off = (int)(t0 % BS);
        int n = BS - off;
        if (n > CHUNK) n = CHUNK;
        if (n > len - t0) n = (int)(len - t0);
        int64_t row0 = ((int64_t)h * NB + block) * BS + off;
        for (int j = 0; j < n; j++) load_row(bf16, k, row0 + j, D, kf[j]);
        for (int g = 0; g < G; g++) {
            float mx = m[g];
            for (int j = 0; j < n; j++) {
                float x = dot(qf[g], kf[j], D) * scale;
                s[g][j] = x;
                mx = x > mx ? x : mx;
            }
            float alpha = expf(m[g] - mx);  /* 0 on the first chunk: m starts at -1e30 */
            float sum = 0.f;
            for (int j = 0; j < n; j++) {  /* vectorised exp (libmvec) */
                float p = expf(s[g][j] - mx);
                s[g][j] = p;
                sum += p;
            }
            l[g] = l[g] * alpha + sum;
            for (int i = 0; i < D; i++) acc[g][i] *= alpha;
            m[g] = mx;
        }
        for (int j = 0; j < n; j++) {
            load_row(bf16, v, row0 + j, D, vf);
            for (int g = 0; g < G; g++) {
                float p = s[g][j];
                for (int i = 0; i < D; i++) acc[g][i] += p * vf[i];
            }
        }
        t0 += n;
    }
    for (int g = 0; g < G; g++) {
        int64_t o = ((int64_t)b * H + h * G + g) * D;
        float inv = 1.f / l[g];
        for (int i = 0; i < D; i++) {
            float x = acc[g][i] * inv;
            if (bf16) ((uint16_t *)out)[o + i] = f32_to_bf16(x);
            else ((float *)out)[o + i] = x;
        }
    }
}

/* Every (sequence, KV head) pair of the batch, in parallel; arguments as attend_head's.
   Returns 0, or -1 for shapes it cannot take. */
int paged_decode(int bf16, const void *q, int64_t q_sb, int64_t q_sh, const void *k, const void *v,
                 const int64_t *tables, const int64_t *lens, void *out, int B, int H, int KV, int D,
                 int64_t NB, int BS, int W, float scale, int threads) {
    int G = H / KV;
    if (G > MAXG || D > MAXD || G * KV != H) return -1;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < KV; h++)
            attend_head(bf16, q, q_sb, q_sh, k, v, tables, lens, out, b, h, H, KV, D, NB, BS, W, scale);
    return 0;
}
"""

# -ffast-math lets the compiler vectorise the dot products and call the vector expf of libmvec;
# the kernel never produces an infinity or a NaN from finite inputs (the running max starts at
# -1e30, not -inf), which is what -ffinite-math-only assumes.
# It is compiled and linked in two steps: linking a shared library with -ffast-math makes gcc (12
# and older) add crtfastmath.o, whose constructor sets flush-to-zero and denormals-are-zero for
# the whole process at load: every float op of torch and numpy afterwards would differ.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c99"]
LINK_FLAGS = ["-shared", "-fopenmp"]
DTYPES = {torch.bfloat16: 1, torch.float32: 0}


def _cpu_signature() -> str:
    """What a build depends on besides its source: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _cache_dir() -> Path:
    root = os.environ.get("INFER_BENCH_CACHE") or str(Path.home() / ".cache" / "infer-bench")
    return Path(root) / "kernels"


def compile_library(name: str, source: str, argtypes: list | None = None) -> ctypes.CDLL:
    """`source` (C, no headers beyond libc's) compiled for this machine with FLAGS, linked with
    LINK_FLAGS and loaded; built on first use into the kernel cache as `<name>-<key>.so`, the key
    a hash of the source, the flags, the compiler's version and the CPU's signature. Raises
    RuntimeError with the reason when it cannot be built. With `argtypes`, the library's function
    `name` gets them and an int return. (cpu_gemv.py builds through it too.)"""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{cc} does not run ({e})") from e
    key = hashlib.sha256("\0".join([source, " ".join(FLAGS + LINK_FLAGS), version, _cpu_signature()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, obj, lib = (Path(tmp) / f"{name}.{ext}" for ext in ("c", "o", "so"))
            src.write_text(source)
            for cmd in ([cc, *FLAGS, "-c", str(src), "-o", str(obj)], [cc, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"]):
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                if r.returncode != 0:
                    raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip()[:300]}")
            os.replace(lib, target)  # atomic: a concurrent build just wins or loses the race
    lib = ctypes.CDLL(str(target))
    if argtypes is not None:  # the function `name`, returning an int status
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def built(make, what: str) -> tuple[object | None, str | None]:
    """(make(), None), or (None, why) when the kernel `make` builds cannot be built here (no
    compiler, a build error): what every kernel's probe does first."""
    try:
        return make(), None
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return None, f"the {what} could not be built ({e})"


def build() -> ctypes.CDLL:
    """The compiled kernel for this machine (built on first use, then cached). Raises
    RuntimeError with the reason when it cannot be built."""
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    return compile_library("paged_decode", C_SOURCE, [i, p, i64, i64, p, p, p, p, p, i, i, i, i, i64, i, i, ctypes.c_float, i])


GREEDY_SOURCE = r"""
#include <stdint.h>
#include <string.h>

static inline int is_nan(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return (u & 0x7fffffffu) > 0x7f800000u; }

/* The first index of the largest value of row x[0 .. n-1] (the first NaN if there is one), as
   torch.argmax: the largest value (and whether there is a NaN, tested on the bits: built with
   -ffast-math) in one vectorised pass, then the first place it occurs, 64 values at a time. */
static int64_t row_argmax(const float *x, int64_t n) {
    int nan = 0;
    float mx = -3.0e38f;
    for (int64_t i = 0; i < n; i++) { nan |= is_nan(x[i]); mx = x[i] > mx ? x[i] : mx; }
    if (nan) { for (int64_t i = 0; i < n; i++) if (is_nan(x[i])) return i; }
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        int hit = 0;
        for (int j = 0; j < 64; j++) hit += x[i + j] == mx;
        if (hit) break;
    }
    for (; i < n; i++) if (x[i] == mx) return i;
    return 0;  /* every value -inf (below -3e38): torch gives 0 too */
}

/* out[r] = argmax of row r of x [rows][n] (row stride ld), rows in parallel. */
int greedy(const float *x, int64_t ld, int64_t rows, int64_t n, int64_t *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * ld, n);
    return 0;
}
"""


class Greedy:
    """greedy(logits [rows, vocab] float32) -> the argmax of each row as a list, torch.argmax's (the
    first largest, or the first NaN) in a vectorised C loop: torch's argmax over a vocabulary row
    runs one element at a time (1.1 ms for 16 x 32,000 on one core of an Intel Xeon with AMX, against
    0.06 ms for its amax), a cost in every decode step."""

    def __init__(self, lib: ctypes.CDLL):
        self.fn = lib.greedy

    def __call__(self, logits: torch.Tensor) -> list[int]:
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
            return logits.argmax(dim=-1).tolist()
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        self.fn(logits.data_ptr(), logits.stride(0), rows, n, out.data_ptr(), torch.get_num_threads())
        return out.tolist()


def greedy_probe() -> tuple[Greedy | None, str | None]:
    """(the kernel, None) when it builds and gives torch.argmax's indices (ties, a NaN, -inf rows, a
    tail after the last 16); else (None, why)."""
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    kernel, why = built(lambda: Greedy(compile_library("greedy", GREEDY_SOURCE, [p, i64, i64, i64, p, i])),
                        "greedy sampling kernel")
    if kernel is None:
        return None, why
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-50, 50, (6, 1003), generator=g).float()  # integers: many ties
    x[1, 700] = float("nan")
    x[1, 900] = float("nan")
    x[2] = float("-inf")
    x[3, 1001] = 1e4  # in the tail
    x[4, :] = 7.0
    got, want = kernel(x[:, :1002]), x[:, :1002].argmax(dim=-1).tolist()
    if got != want:
        return None, f"the greedy sampling kernel disagrees with torch.argmax ({got} vs {want})"
    return kernel, None


class PagedDecode:
    """Callable like kernels_cuda.paged_decode_torch: (q, pool, layer, tables, lens) -> [B, heads * d]."""

    def __init__(self, lib: ctypes.CDLL):
        self.fn = lib.paged_decode

    def supports(self, pool, dtype: torch.dtype) -> bool:
        return pool.kv_dtype == "auto" and dtype in DTYPES

    def __call__(self, q: torch.Tensor, pool, layer: int, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        b, heads, d = q.shape
        if q.stride(2) != 1:
            q = q.contiguous()
        k, v = pool.k[layer], pool.v[layer]
        tables = tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        out = torch.empty(b, heads * d, dtype=q.dtype)
        rc = self.fn(DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
                     tables.data_ptr(), lens.data_ptr(), out.data_ptr(), b, heads, pool.kv_heads, d,
                     pool.total_blocks, pool.block_size, tables.shape[1], d ** -0.5, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"cpu_decode: shapes it cannot take (heads {heads}, kv_heads {pool.kv_heads}, head_dim {d})")
        return out


def probe(dtype: torch.dtype) -> tuple[PagedDecode | None, str | None]:
    """(the kernel, None) when it builds here and agrees with the plain decode; else (None, why)."""
    if dtype not in DTYPES:
        return None, f"no fused CPU decode kernel for {dtype}"
    kernel, why = built(lambda: PagedDecode(build()), "fused CPU decode kernel")
    if kernel is None:
        return None, why
    from adapters.reference.attention import decode_attention, length_mask
    from adapters.reference.kv_cache import KVPool

    g = torch.Generator().manual_seed(0)
    pool = KVPool(1, 10, 16, 2, 64, "auto", dtype, torch.device("cpu"))
    pool.prepare(set(range(10)))
    pool.k.copy_(torch.randn(pool.k.shape, generator=g).to(dtype))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g).to(dtype))
    tables = torch.tensor([[3, 7, 1, 0, 9], [2, 2, 2, 2, 2], [8, 5, 6, 4, 0]])
    lens = torch.tensor([70, 1, 80])
    q = torch.randn(3, 6, 64, generator=g).to(dtype)
    kc, vc = pool.gather(0, tables, 80)
    want = decode_attention(q, kc, vc, length_mask(lens, kc.shape[2])).float()
    got = kernel(q, pool, 0, tables, lens).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    if not err < (1e-5 if dtype == torch.float32 else 2e-2):
        return None, f"the fused CPU decode kernel disagrees with the plain path (relative error {err:.2e})"
    return kernel, None

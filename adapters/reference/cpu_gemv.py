"""bf16 matrix-vector products for CPUs without bf16 arithmetic: a small C kernel, compiled at load.

What it computes: out = x @ W.T (+ bias) (+ residual) for a few rows of x (a decode step at
batch 1 has one) and a bf16 weight W [N, K], accumulated in float32 and rounded once to bf16
(round to nearest even, as torch rounds). kernels_cpu.WidenedLinear calls it for the products of
fewer than `min_rows` rows.

Why: such a product is bound by memory. It reads each weight once and does two FLOPs per
weight, so its time is the weight's bytes over the memory bandwidth, and a bf16 weight is half
the bytes of a float32 copy. On an AVX2-only CPU (no AVX-512, no avx512_bf16) there is no bf16
arithmetic and oneDNN has no bf16 kernels, so torch's bf16 product is a generic loop that
reached about half of the copy bandwidth for the `small` preset's step (AMD EPYC, 2 cores:
docs/reference-engine.md, "Prefill at the matrix limit (issue 56)"). This kernel widens the
weight in registers instead: a bf16 number is the top half of a float32, so the uint16 shifted
left by 16 is the float32, exactly (one zero-extend and one shift per eight weights under AVX2).
x is widened to float32 once per call, the sums stay in float32.

Loop: output rows in blocks of ROWS (four sums, each its own vector accumulator, that share
each load of x, which keeps the FMA units busy while the weight streams in), blocks split
statically over torch's OpenMP threads (contiguous halves of W on two cores). gcc vectorises the
inner loop (`-fopt-info-vec` says "loop vectorized using 32 byte vectors"); -ffast-math lets it
reorder the sums. Each 64-byte line of a row asks for the line 8 KiB further on
(`__builtin_prefetch`): the hardware prefetchers alone left the stream at torch's rate (the
`small` preset's 49 products of a step, 200 MB, AMD EPYC, AVX2 only, 2 cores, one exclusive
hold: 14-15 GB/s without, 19-23 GB/s with 8 KiB ahead; 2 and 32 KiB did worse).

Built and cached like the fused decode kernel (cpu_decode.compile_library: same flags, cache
and linking), called through ctypes with raw pointers. `probe()` builds it and compares it with
the float32 product rounded to bf16 on shapes that exercise every path (odd K, N not a
multiple of ROWS, bias, residual, strided rows); if anything fails, the plain path stays and
kernels.py records why. fp16 is refused: gcc does not vectorise _Float16 conversions on AVX2
(it converts one number at a time), and the bit trick that widens bf16 does not apply.
"""

from __future__ import annotations

import ctypes

import torch

from adapters.reference.cpu_decode import built, compile_library

# bf16 <-> float32 in C (after <stdint.h> and <string.h>); cpu_amx.py's source uses them too
BF16_SOURCE = r"""
static inline float widen(uint16_t h) {  /* bf16 -> float32: exact */
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t round_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
"""

C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 4  /* output rows per iteration: four sums sharing each load of x */
#define AHEAD 4096  /* prefetch distance in weights (8 KiB): see the module's docstring */
""" + BF16_SOURCE + r"""

/* s[r] = sum_k w[r * K + k] * x[k] for r < ROWS; 32 weights of a row (a 64-byte line) at a time,
   asking for the line AHEAD weights further on in each row (past the block: the rows are adjacent,
   so the four prefetches cover the stream 8 KiB ahead) */
static inline void dot_rows(const uint16_t *restrict w, const float *restrict x, int K, float *restrict s) {
    float a[ROWS] = {0.f};
    int k0 = 0;
    for (; k0 + 32 <= K; k0 += 32) {
        for (int r = 0; r < ROWS; r++) __builtin_prefetch(w + (int64_t)r * K + k0 + AHEAD, 0, 0);
        for (int k = k0; k < k0 + 32; k++) {
            float xk = x[k];
            for (int r = 0; r < ROWS; r++) a[r] += widen(w[(int64_t)r * K + k]) * xk;
        }
    }
    for (int k = k0; k < K; k++) {
        float xk = x[k];
        for (int r = 0; r < ROWS; r++) a[r] += widen(w[(int64_t)r * K + k]) * xk;
    }
    for (int r = 0; r < ROWS; r++) s[r] = a[r];
}

static inline float dot_row(const uint16_t *restrict w, const float *restrict x, int K) {
    float a = 0.f;
    for (int k = 0; k < K; k++) a += widen(w[k]) * x[k];
    return a;
}

/* out[m, n] = bf16(sum_k xf[m, k] * w[n, k] + bias[n] + res[m, n]) for m < M, n < N, xf in float32
   ([M, K] contiguous), the rest as in bf16_gemv. An orphaned `omp for`: inside a parallel region
   its threads share the output rows (the fused decode layer, cpu_layer.py, calls it so); outside
   one, the calling thread does them all. */
static void gemv_rows(const uint16_t *w, const float *xf, const uint16_t *bias, const uint16_t *res, int64_t ldr,
                      uint16_t *out, int M, int K, int N) {
    int blocks = (N + ROWS - 1) / ROWS;
    #pragma omp for schedule(static)
    for (int b = 0; b < blocks; b++) {
        int n0 = b * ROWS, n1 = n0 + ROWS < N ? n0 + ROWS : N;
        const uint16_t *wb = w + (int64_t)n0 * K;
        for (int m = 0; m < M; m++) {
            const float *xm = xf + (int64_t)m * K;
            float s[ROWS];
            if (n1 - n0 == ROWS) dot_rows(wb, xm, K, s);
            else for (int n = n0; n < n1; n++) s[n - n0] = dot_row(w + (int64_t)n * K, xm, K);
            for (int n = n0; n < n1; n++) {
                float v = s[n - n0];
                if (bias) v += widen(bias[n]);
                if (res) v += widen(res[m * ldr + n]);
                out[(int64_t)m * N + n] = round_bf16(v);
            }
        }
    }
}

/* out[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n] + res[m, n]) for m < M, n < N.
   w: [N, K] contiguous; x: M rows of K at stride ldx; bias: [N] or NULL; res: M rows of N at
   stride ldr, or NULL; out: [M, N] contiguous; all bf16. Returns 0, or -1 without memory. */
int bf16_gemv(const uint16_t *w, const uint16_t *x, int64_t ldx, const uint16_t *bias, const uint16_t *res,
              int64_t ldr, uint16_t *out, int M, int K, int N, int threads) {
    float *xf = malloc(sizeof(float) * (size_t)M * (size_t)K);
    if (xf == NULL) return -1;
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) xf[(int64_t)m * K + k] = widen(x[m * ldx + k]);
    #pragma omp parallel num_threads(threads)
    gemv_rows(w, xf, bias, res, ldr, out, M, K, N);
    free(xf);
    return 0;
}
"""


def build() -> ctypes.CDLL:
    """The compiled kernel for this machine (built on first use, then cached). Raises
    RuntimeError with the reason when it cannot be built."""
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    return compile_library("bf16_gemv", C_SOURCE, [p, p, i64, p, p, i64, p, i, i, i, i])


class HalfGemv:
    """kernel(x, weight, bias=None, residual=None) -> x @ weight.T (+ bias) (+ residual), in bf16.
    x: [M, K] bf16 with unit stride along K; weight: [N, K] bf16, contiguous; bias: [N];
    residual: [M, N] with unit stride along N. `supports(weight)` says whether a weight qualifies."""

    dtype = torch.bfloat16

    def __init__(self, lib: ctypes.CDLL):
        self.fn = lib.bf16_gemv

    def supports(self, weight: torch.Tensor) -> bool:
        return weight.dtype == self.dtype and weight.dim() == 2 and weight.is_contiguous() and weight.device.type == "cpu"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        if x.stride(1) != 1:
            x = x.contiguous()
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        if residual is not None and residual.stride(1) != 1:
            residual = residual.contiguous()
        out = torch.empty(m, n, dtype=self.dtype)
        rc = self.fn(weight.data_ptr(), x.data_ptr(), x.stride(0), None if bias is None else bias.data_ptr(),
                     None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
                     out.data_ptr(), m, k, n, torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"cpu_gemv: no memory for {m} x {k} float32 inputs")
        return out


# (N, K, rows, bias, residual): odd K (a tail after the vector loop), N not a multiple of ROWS
# (the one-row tail) or below it, several rows; x and the residual are strided views
PROBE_SHAPES = ((37, 75, 1, True, True), (64, 128, 1, False, False), (3, 9, 1, True, False), (13, 200, 3, True, True))


def probe(dtype: torch.dtype) -> tuple[HalfGemv | None, str | None]:
    """(the kernel, None) when it builds here and gives torch's numbers; else (None, why).

    The inputs are small integers: every float32 sum is then exact whatever its order, so the
    kernel must give torch's float32 product rounded to bf16 bit for bit (round to nearest even
    included: many sums fall halfway between two bf16 numbers)."""
    if dtype != torch.bfloat16:
        return None, f"no C matrix-vector kernel for {dtype} (bf16 only: gcc does not vectorise fp16 widening on AVX2)"
    kernel, why = built(lambda: HalfGemv(build()), "bf16 matrix-vector kernel")
    if kernel is None:
        return None, why
    g = torch.Generator().manual_seed(0)

    def ints(*shape):
        return torch.randint(-8, 9, shape, generator=g).bfloat16()

    for n, k, rows, with_bias, with_residual in PROBE_SHAPES:
        w, x = ints(n, k), ints(rows, k + 3)[:, 3:]  # x's rows at a stride of k + 3
        b = ints(n) * 16 if with_bias else None
        r = ints(rows, 2 * n)[:, :n] * 16 if with_residual else None
        want = (x.float() @ w.float().T + (0 if b is None else b.float()) + (0 if r is None else r.float())).bfloat16()
        got = kernel(x, w, b, r)
        if got.shape != want.shape or not torch.equal(got, want):
            wrong = (got != want).sum().item() if got.shape == want.shape else "all"
            return None, (f"the bf16 matrix-vector kernel disagrees with torch's float32 product rounded to bf16 "
                          f"({wrong} of {want.numel()} outputs, shape N={n} K={k} rows={rows})")
    return kernel, None

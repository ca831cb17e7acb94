"""Decode steps of bf16 models on CPUs with AMX (Intel Xeon, Sapphire Rapids and later): matrix
products on AMX tiles for a few rows, a paged decode attention on tiles, and a whole decoder layer
of a decode step of up to MAX_ROWS sequences in one C call. Compiled for this machine at load.

Why: a decode step at batch 1-32 reads every weight once and multiplies it by only a few rows, so
its products are bound by memory, and everything else in the step is overhead to cut. On the
`small` preset at batch 16 (Intel Xeon with AMX, 2 cores, docs/reference-engine.md) the step spent
about as long in the fused C decode attention (cpu_decode.py: one dot product and one horizontal
sum per query head and token) as in its 49 oneDNN products, and some 1,800 torch operators a step
(norms, RoPE, SiLU, casts, K/V writes, ~150 per layer) on top.

What is computed, with the roundings of Model.forward (the reference semantics):

- `product`: out = x @ W.T (+ bias) (+ residual), float32 sums rounded once to bf16, for x of up to
  MAX_ROWS rows. W is repacked once at load into AMX's pair-interleaved layout (`pack`): block
  (nb, kb) holds W[16 nb + n][32 kb + 2 r + j] at [r][n][j], 1 KiB, the blocks of 16 output rows
  contiguous along K, so a product streams its weight linearly. x's rows are the tiles' A operand
  as they lie in memory (16 rows x 32 values), the weight blocks the B operand; one m-block (16
  rows) runs against four n-blocks at a time (four accumulator tiles), two m-blocks against two.
- `attend`: decode attention of one sequence's G query heads that share a KV head, through its
  block table: scores S[t][g] = K[t] . q[g] on tiles (16 tokens of the pool's block as A, the
  queries pair-interleaved as B), the softmax in float32 (max, exp, sum; no horizontal sum per
  token), P rounded to bf16 (as the plain path rounds it) times V on tiles (V's rows interleaved
  in pairs of tokens for the B operand), divided by the sum once at the end.
- `decode_layer`: Model.forward's layer for M tokens of M sequences (norm, QKV product, RoPE at
  each row's position, the new K/V into each row's slot, attention, output product + residual,
  norm, gate-up product, SiLU x up, down product + residual) in one parallel region: products
  split by output blocks, attention by (row, KV head) over torch's OpenMP threads, the rest on one.

Requires K and the head dim to be multiples of 32, N of 16, blocks of a multiple of 16 tokens,
G <= 16 query heads per KV head, head_dim <= 256; `supports` / `layer_supports` say, and anything
else runs op by op on oneDNN.

Linux gives a process AMX's tile registers only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM);
`amx_request` asks (oneDNN asks the same for its own AMX kernels). `probe` runs each kernel at load
against torch (products, attention and a random layer at three rows with different positions and
lengths) and the engine keeps oneDNN and the per-operator path if anything disagrees; kernels.py
records why. The source is built like the other CPU kernels (cpu_decode.compile_library: -march=native,
cached per CPU), and only where the CPU has AMX (`cpu_has_amx`): it would not compile elsewhere.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from adapters.reference.cpu_decode import built, compile_library
from adapters.reference.cpu_gemv import BF16_SOURCE
from adapters.reference.cpu_layer import STEPS_SOURCE, plain_decoder_layer

MAX_ROWS = 64  # products and fused layers of at most this many rows (a decode batch); more: oneDNN
NEEDS = ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")  # /proc/cpuinfo flags

C_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAXG 16    /* query heads per KV head */
#define MAXD 256  /* head_dim */

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

/* Ask Linux for the tile data state (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18): 0 when granted. */
int amx_request(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

/* every tile 16 rows of 64 bytes: A (16 x 32 bf16), B (16 pairs x 16 x 2 bf16), C (16 x 16 float32) */
static void tiles_on(void) {
    tilecfg c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

""" + BF16_SOURCE + STEPS_SOURCE + r"""

/* ---- products ------------------------------------------------------------------------------ */

/* out[m][n0 + n] = bf16(acc[m][n] + bias[n0 + n] + res[m][n0 + n]) for m < rows, n < 16 */
static void epilogue(const float acc[16][16], int rows, int n0, const uint16_t *bias, const uint16_t *res,
                     int64_t ldr, uint16_t *out, int64_t ldo) {
    for (int m = 0; m < rows; m++) {
        uint16_t *o = out + m * ldo + n0;
        const uint16_t *r = res ? res + m * ldr + n0 : NULL;
        for (int n = 0; n < 16; n++) {
            float v = acc[m][n];
            if (bias) v += widen(bias[n0 + n]);
            if (r) v += widen(r[n]);
            o[n] = round_bf16(v);
        }
    }
}

#define WB(nb, kb) (wp + ((int64_t)(nb) * KB + (kb)) * 512)

/* Ask for n-block nb's weight block WPF k-blocks ahead of kb (its 16 cache lines). A tile load of a
   weight block from memory otherwise stalls the tile unit (the hardware prefetcher does not run far
   enough ahead of 1 KiB tile loads): on a Xeon with AMX, 2 cores, small's products at 16 rows went
   from 18 to 22 GB/s of weights with it (scripts/amx_kernels.py). */
#ifndef WPF
#define WPF 1
#endif
#define PF(nb, kb) do { if (WPF && (kb) + WPF < KB) { const char *p_ = (const char *)WB(nb, (kb) + WPF); \
    for (int i_ = 0; i_ < 1024; i_ += 64) _mm_prefetch(p_ + i_, _MM_HINT_T0); } } while (0)

/* 16 rows of x (from xa, at stride ldx; `rows` kept) by n-blocks nb .. nb + 3 */
static void mm_1x4(const uint16_t *xa, int64_t ldx, int rows, const uint16_t *wp, int KB, int nb, const uint16_t *bias,
                   const uint16_t *res, int64_t ldr, uint16_t *out, int64_t ldo) {
    float acc[16][16] __attribute__((aligned(64)));
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int kb = 0; kb < KB; kb++) {
        PF(nb, kb); PF(nb + 1, kb); PF(nb + 2, kb); PF(nb + 3, kb);
        _tile_loadd(4, xa + kb * 32, ldx * 2);
        _tile_loadd(5, WB(nb, kb), 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, WB(nb + 1, kb), 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, WB(nb + 2, kb), 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, WB(nb + 3, kb), 64);
        _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, acc, 64); epilogue(acc, rows, nb * 16, bias, res, ldr, out, ldo);
    _tile_stored(1, acc, 64); epilogue(acc, rows, nb * 16 + 16, bias, res, ldr, out, ldo);
    _tile_stored(2, acc, 64); epilogue(acc, rows, nb * 16 + 32, bias, res, ldr, out, ldo);
    _tile_stored(3, acc, 64); epilogue(acc, rows, nb * 16 + 48, bias, res, ldr, out, ldo);
}

/* 16 rows of x by n-block nb */
static void mm_1x1(const uint16_t *xa, int64_t ldx, int rows, const uint16_t *wp, int KB, int nb, const uint16_t *bias,
                   const uint16_t *res, int64_t ldr, uint16_t *out, int64_t ldo) {
    float acc[16][16] __attribute__((aligned(64)));
    _tile_zero(0);
    for (int kb = 0; kb < KB; kb++) {
        PF(nb, kb);
        _tile_loadd(4, xa + kb * 32, ldx * 2);
        _tile_loadd(5, WB(nb, kb), 64);
        _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, acc, 64); epilogue(acc, rows, nb * 16, bias, res, ldr, out, ldo);
}

/* 32 rows of x (two m-blocks: rows0 and rows1 kept) by n-blocks nb, nb + 1 */
static void mm_2x2(const uint16_t *xa, int64_t ldx, int rows0, int rows1, const uint16_t *wp, int KB, int nb,
                   const uint16_t *bias, const uint16_t *res, int64_t ldr, uint16_t *out, int64_t ldo) {
    float acc[16][16] __attribute__((aligned(64)));
    const uint16_t *xb = xa + 16 * ldx;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int kb = 0; kb < KB; kb++) {
        PF(nb, kb); PF(nb + 1, kb);
        _tile_loadd(4, xa + kb * 32, ldx * 2);
        _tile_loadd(5, xb + kb * 32, ldx * 2);
        _tile_loadd(6, WB(nb, kb), 64);
        _tile_loadd(7, WB(nb + 1, kb), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    const uint16_t *rb = res ? res + 16 * ldr : NULL;
    _tile_stored(0, acc, 64); epilogue(acc, rows0, nb * 16, bias, res, ldr, out, ldo);
    _tile_stored(1, acc, 64); epilogue(acc, rows0, nb * 16 + 16, bias, res, ldr, out, ldo);
    _tile_stored(2, acc, 64); epilogue(acc, rows1, nb * 16, bias, rb, ldr, out + 16 * ldo, ldo);
    _tile_stored(3, acc, 64); epilogue(acc, rows1, nb * 16 + 16, bias, rb, ldr, out + 16 * ldo, ldo);
}

/* out = x @ W.T (+ bias) (+ res) for M rows: x at stride ldx, readable for 16 * ceil(M / 16) rows; wp:
   W packed (module docstring), K % 32 == 0, N % 16 == 0; res (stride ldr) may be out itself. An
   orphaned omp for over groups of four n-blocks (64 output columns): inside a parallel region its
   threads share them, each group's weights read once from memory and then from cache for the other
   m-blocks. */
static void product(const uint16_t *x, int64_t ldx, int M, const uint16_t *wp, int K, int N, const uint16_t *bias,
                    const uint16_t *res, int64_t ldr, uint16_t *out, int64_t ldo) {
    int KB = K / 32, NB = N / 16, MB = (M + 15) / 16;
    #pragma omp for schedule(static)
    for (int g = 0; g < (NB + 3) / 4; g++) {
        int nb = 4 * g, nn = NB - nb < 4 ? NB - nb : 4;
        for (int mb = 0; mb + 1 < MB; mb += 2) {
            const uint16_t *xa = x + (int64_t)mb * 16 * ldx;
            const uint16_t *ra = res ? res + (int64_t)mb * 16 * ldr : NULL;
            uint16_t *oa = out + (int64_t)mb * 16 * ldo;
            int rows1 = M - 16 * (mb + 1) < 16 ? M - 16 * (mb + 1) : 16;
            int j = 0;
            for (; j + 1 < nn; j += 2) mm_2x2(xa, ldx, 16, rows1, wp, KB, nb + j, bias, ra, ldr, oa, ldo);
            for (; j < nn; j++) {
                mm_1x1(xa, ldx, 16, wp, KB, nb + j, bias, ra, ldr, oa, ldo);
                mm_1x1(xa + 16 * ldx, ldx, rows1, wp, KB, nb + j, bias, ra ? ra + 16 * ldr : NULL, ldr, oa + 16 * ldo, ldo);
            }
        }
        if (MB % 2) {
            int mb = MB - 1, rows = M - 16 * mb;
            const uint16_t *xa = x + (int64_t)mb * 16 * ldx;
            const uint16_t *ra = res ? res + (int64_t)mb * 16 * ldr : NULL;
            uint16_t *oa = out + (int64_t)mb * 16 * ldo;
            if (nn == 4) mm_1x4(xa, ldx, rows, wp, KB, nb, bias, ra, ldr, oa, ldo);
            else for (int j = 0; j < nn; j++) mm_1x1(xa, ldx, rows, wp, KB, nb + j, bias, ra, ldr, oa, ldo);
        }
    }
}

/* The product on its own (kernels' AmxLinear): out [M, N] (contiguous), x readable for 16 * ceil(M / 16) rows. */
int amx_linear(const uint16_t *x, int64_t ldx, int M, const uint16_t *wp, int K, int N, const uint16_t *bias,
               const uint16_t *res, int64_t ldr, uint16_t *out, int threads) {
    if (K % 32 || N % 16 || M < 1) return -1;
    #pragma omp parallel num_threads(threads)
    {
        tiles_on();
        product(x, ldx, M, wp, K, N, bias, res, ldr, out, N);
        _tile_release();
    }
    return 0;
}

/* ---- decode attention ------------------------------------------------------------------------ */

static const uint16_t PAIR_LO[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t PAIR_HI[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

/* scratch bytes attend() needs for `len` tokens (a multiple of 64 bytes) */
static int64_t attend_scratch(int64_t len, int hd) {
    int64_t L = (len + 31) / 32 * 32;
    return L * 16 * 4 + L * 16 * 4 + L * 16 * 2 + 2 * 4 * 512 * 2 + (int64_t)hd / 2 * 16 * 4 + 16 * 16 * 4;
}

/* the first of 16 rows from token t0 (a multiple of 16) of KV head h of a layer's pool, through the block table */
static inline const uint16_t *rows_at(const uint16_t *pool, int h, int64_t NB, int BS, int hd, const int64_t *table,
                                      int64_t t0) {
    return pool + (((int64_t)h * NB + table[t0 / BS]) * BS + t0 % BS) * hd;
}

/* K is asked for KPFD tokens ahead of the scores' tile. Into L2 (APF_HINT): the attention's prefetches
   to L1 (T0) filled its miss buffers and stalled the loop on them; with T1 the decode attention of
   small at batch 16 took 3-20 % less (scripts/amx_kernels.py, Xeon with AMX, 2 cores) */
#ifndef KPFD
#define KPFD 32
#endif
#ifndef APF_HINT
#define APF_HINT _MM_HINT_T1
#endif
/* ask for `rows` rows of `width` values at stride hd into the caches */
static inline void prefetch(const uint16_t *p, int rows, int hd, int width) {
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < width; i += 32) _mm_prefetch((const char *)(p + (int64_t)r * hd + i), APF_HINT);
}

/* The G query heads q (G rows of hd, contiguous) that share KV head h, over tokens 0 .. len - 1 of a
   sequence through its block table, into o (G rows of hd). k, v: one layer of the pool, [KV][NB][BS][hd].
   scratch: attend_scratch(len, hd) bytes, 64-aligned. (Rows g >= G of P and columns g >= G of the queries'
   tile hold whatever is there: they reach only rows and columns of the results that are not read.) */
static void attend(const uint16_t *q, int G, int hd, const uint16_t *k, const uint16_t *v, int64_t NB, int BS, int h,
                   const int64_t *table, int64_t len, float scale, uint16_t *o, char *scratch) {
    int64_t L = (len + 31) / 32 * 32;
    float *sc = (float *)scratch;                 /* [L][16] scores, a tile row per token */
    float *pg = sc + L * 16;                      /* [G][L] softmax numerators */
    uint16_t *pb = (uint16_t *)(pg + L * 16);     /* [L / 32][16][32] bf16 numerators: A tiles of P x V */
    uint16_t *vb = pb + L * 16;                   /* [2][4][16][32] V rows paired: B tiles, two chunks */
    uint32_t *bq = (uint32_t *)(vb + 2 * 4 * 512); /* [hd / 2][16] queries paired: B tiles of K x Q */
    float *acc = (float *)(bq + hd / 2 * 16);     /* [16][16] */
    const uint32_t *q32 = (const uint32_t *)q;
    for (int d2 = 0; d2 < hd / 2; d2++)
        for (int g = 0; g < 16; g++) bq[d2 * 16 + g] = g < G ? q32[g * (hd / 2) + d2] : 0;
    /* S = K Q^T, 16 tokens (one tile of the block's rows) at a time, K prefetched KPFD tokens ahead */
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const uint16_t *kr = rows_at(k, h, NB, BS, hd, table, t0);
        if (t0 + KPFD < len) prefetch(rows_at(k, h, NB, BS, hd, table, t0 + KPFD), 16, hd, hd);
        _tile_zero(0);
        for (int db = 0; db < hd / 32; db++) {
            _tile_loadd(1, kr + db * 32, hd * 2);
            _tile_loadd(2, bq + db * 256, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sc + t0 * 16, 64);
    }
    for (int64_t t0 = 0; t0 < 64 && t0 < len; t0 += 16) prefetch(rows_at(v, h, NB, BS, hd, table, t0), 16, hd, hd);
    /* softmax numerators exp((s - max) * scale), their sums; P as bf16 tiles */
    float sum[MAXG];
    for (int g = 0; g < G; g++) {
        float *p = pg + (int64_t)g * L, mx = -1e30f, tot = 0.f;
        for (int64_t t = 0; t < len; t++) { p[t] = sc[t * 16 + g]; mx = p[t] > mx ? p[t] : mx; }
        for (int64_t t = 0; t < len; t++) { p[t] = expf((p[t] - mx) * scale); tot += p[t]; }
        for (int64_t t = len; t < L; t++) p[t] = 0.f;
        sum[g] = tot;
        for (int64_t c = 0; c < L / 32; c++)
            for (int j = 0; j < 32; j++) pb[(c * 16 + g) * 32 + j] = round_bf16(p[c * 32 + j]);
    }
    /* O = P V over 32 tokens at a time, 64 values of head_dim per pass (four accumulator tiles). The V
       rows of chunk c are paired into vb[c % 2] while the tiles multiply chunk c - 1 (a tile load right
       after the vector stores that wrote its data waits for them), V prefetched two chunks ahead. */
    const __m512i lo = _mm512_loadu_si512(PAIR_LO), hi = _mm512_loadu_si512(PAIR_HI);
    int64_t C = L / 32;
    for (int d0 = 0; d0 < hd; d0 += 64) {
        int nd = hd - d0 >= 64 ? 4 : 2;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t c = 0; c <= C; c++) {
            if (c + 2 < C) {
                for (int64_t t0 = (c + 2) * 32; t0 < (c + 3) * 32 && t0 < len; t0 += 16)
                    prefetch(rows_at(v, h, NB, BS, hd, table, t0) + d0, 16, hd, nd * 32);
            }
            if (c < C) {
                uint16_t *vbc = vb + (c % 2) * 2048;
                for (int s16 = 0; s16 < 2; s16++) {  /* 16 tokens of one block at a time: 8 pairs, B rows 8 s16 + r */
                    int64_t t0 = c * 32 + 16 * s16;
                    const uint16_t *vr = t0 < len ? rows_at(v, h, NB, BS, hd, table, t0) + d0 : v;
                    for (int r = 0; r < 8; r++) {  /* tokens t, t + 1 interleaved */
                        int64_t t = t0 + 2 * r;
                        uint16_t *row = vbc + (8 * s16 + r) * 32;
                        for (int half = 0; half < nd / 2; half++) {
                            __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
                            if (t < len) a = _mm512_loadu_si512(vr + (2 * r) * hd + 32 * half);
                            if (t + 1 < len) b = _mm512_loadu_si512(vr + (2 * r + 1) * hd + 32 * half);
                            _mm512_storeu_si512(row + (2 * half) * 512, _mm512_permutex2var_epi16(a, lo, b));
                            _mm512_storeu_si512(row + (2 * half + 1) * 512, _mm512_permutex2var_epi16(a, hi, b));
                        }
                    }
                }
            }
            if (c > 0) {
                const uint16_t *vbp = vb + ((c - 1) % 2) * 2048;
                _tile_loadd(4, pb + (c - 1) * 512, 64);
                _tile_loadd(5, vbp, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, vbp + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
                if (nd == 4) {
                    _tile_loadd(5, vbp + 1024, 64);
                    _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(6, vbp + 1536, 64);
                    _tile_dpbf16ps(3, 4, 6);
                }
            }
        }
        for (int b = 0; b < nd; b++) {
            switch (b) {
                case 0: _tile_stored(0, acc, 64); break;
                case 1: _tile_stored(1, acc, 64); break;
                case 2: _tile_stored(2, acc, 64); break;
                default: _tile_stored(3, acc, 64);
            }
            for (int g = 0; g < G; g++) {
                float inv = 1.f / sum[g];
                for (int n = 0; n < 16; n++) o[(int64_t)g * hd + d0 + 16 * b + n] = round_bf16(acc[g * 16 + n] * inv);
            }
        }
    }
}

/* Decode attention on its own: q [B][H][hd] (rows at stride q_sb), out [B][H][hd]; every (sequence, KV
   head) pair in parallel. scratch: threads x amx_attend_scratch(max len) bytes. */
int64_t amx_attend_scratch(int64_t len, int hd) { return attend_scratch(len, hd); }

int amx_decode(const uint16_t *q, int64_t q_sb, const uint16_t *k, const uint16_t *v, const int64_t *tables,
               const int64_t *lens, uint16_t *out, int B, int H, int KV, int hd, int64_t NB, int BS, int W, float scale,
               char *scratch, int64_t per_thread, int threads) {
    int G = H / KV;
    if (G * KV != H || G > MAXG || hd % 32 || hd > MAXD || BS % 16) return -1;
    #pragma omp parallel num_threads(threads)
    {
        tiles_on();
        char *mine = scratch + per_thread * omp_get_thread_num();
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < KV; h++)
                attend(q + b * q_sb + (int64_t)h * G * hd, G, hd, k, v, NB, BS, h, tables + (int64_t)b * W, lens[b],
                       scale, out + ((int64_t)b * H + (int64_t)h * G) * hd, mine);
        _tile_release();
    }
    return 0;
}

/* ---- a decoder layer of a decode step ------------------------------------------------------------ */

/* h = bf16(x / rms(x) * w) over n values (as cpu_layer.py's norm: float32 inside, one rounding) */
static void rms_norm(const uint16_t *x, const uint16_t *w, int n, float eps, uint16_t *h) {
    float r = rms_scale(x, n, eps);
    for (int i = 0; i < n; i++) h[i] = round_bf16(widen(x[i]) * r * widen(w[i]));
}

static int64_t up64(int64_t n) { return (n + 63) / 64 * 64; }

/* bytes of workspace amx_layer needs */
int64_t amx_layer_workspace(int M, int D, int H, int KV, int hd, int I, int64_t maxlen, int threads) {
    int64_t MP = (M + 15) / 16 * 16, E = D > H * hd ? D : H * hd;
    E = E > I ? E : I;
    return up64(MP * E * 2) + up64(MP * (int64_t)(H + 2 * KV) * hd * 2) + up64(MP * 2 * (int64_t)I * 2)
           + threads * attend_scratch(maxlen, hd);
}

/* One decoder layer (cpu_layer.py's, see there) for M tokens of M sequences, row m at position pos[m],
   attending to tokens 0 .. lens[m] - 1 through its block table tables[m] (W entries). x: [M][D] bf16,
   updated in place. wqkv, wo, wgu, wd: packed (amx_pack), [(H + 2 KV) hd, D], [D, H hd], [2 I, D], [D, I];
   bqkv, bo: biases or NULL. cos, sin: the whole [positions][hd] tables. k, v: this layer's pool,
   [KV][NB][BS][hd]. ws: amx_layer_workspace(M, ..., max(lens), threads) bytes, 64-aligned. All K/V of the
   step are written before any row attends. Returns 0, or -1 for shapes it cannot take. */
int amx_layer(uint16_t *x, int M, int D, const uint16_t *in_norm, const uint16_t *post_norm, float eps,
              const uint16_t *wqkv, const uint16_t *bqkv, int H, int KV, int hd, const uint16_t *cos,
              const uint16_t *sin, const int64_t *pos, uint16_t *k, uint16_t *v, int64_t NB, int BS,
              const int64_t *tables, int W, const int64_t *lens, const uint16_t *wo, const uint16_t *bo,
              const uint16_t *wgu, const uint16_t *wd, int I, float scale, char *ws, int64_t maxlen, int threads) {
    int G = H / KV, nqkv = (H + 2 * KV) * hd;
    if (G * KV != H || G > MAXG || hd % 32 || hd > MAXD || BS % 16 || D % 32 || I % 32 || M < 1) return -1;
    int64_t MP = (M + 15) / 16 * 16, E = D > H * hd ? D : H * hd;
    E = E > I ? E : I;
    uint16_t *h = (uint16_t *)ws;                        /* [MP][E]: norm outputs, attention outputs, SiLU x up */
    uint16_t *qkv = (uint16_t *)(ws + up64(MP * E * 2)); /* [MP][nqkv] */
    uint16_t *gu = qkv + up64(MP * (int64_t)nqkv * 2) / 2; /* [MP][2 I] */
    char *scratch = (char *)(gu + up64(MP * 2 * (int64_t)I * 2) / 2);
    int64_t per_thread = attend_scratch(maxlen, hd);
    #pragma omp parallel num_threads(threads)
    {
        tiles_on();
        char *mine = scratch + per_thread * omp_get_thread_num();
        #pragma omp for schedule(static)
        for (int m = 0; m < M; m++) rms_norm(x + (int64_t)m * D, in_norm, D, eps, h + m * E);
        product(h, E, M, wqkv, D, nqkv, bqkv, NULL, 0, qkv, nqkv);
        #pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            uint16_t *row = qkv + (int64_t)m * nqkv;
            for (int j = 0; j < H + KV; j++) rotate(row + j * hd, cos + pos[m] * hd, sin + pos[m] * hd, hd);
            int64_t block = tables[(int64_t)m * W + pos[m] / BS];
            for (int j = 0; j < KV; j++) {  /* the new token's K and V at row (j, block, pos % BS) */
                int64_t slot = (((int64_t)j * NB + block) * BS + pos[m] % BS) * hd;
                memcpy(k + slot, row + (int64_t)(H + j) * hd, sizeof(uint16_t) * hd);
                memcpy(v + slot, row + (int64_t)(H + KV + j) * hd, sizeof(uint16_t) * hd);
            }
        }
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int m = 0; m < M; m++)
            for (int j = 0; j < KV; j++)
                attend(qkv + (int64_t)m * nqkv + (int64_t)j * G * hd, G, hd, k, v, NB, BS, j, tables + (int64_t)m * W,
                       lens[m], scale, h + m * E + (int64_t)j * G * hd, mine);
        product(h, E, M, wo, H * hd, D, bo, x, D, x, D);
        #pragma omp for schedule(static)
        for (int m = 0; m < M; m++) rms_norm(x + (int64_t)m * D, post_norm, D, eps, h + m * E);
        product(h, E, M, wgu, D, 2 * I, NULL, NULL, 0, gu, 2 * I);
        #pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            const uint16_t *g = gu + (int64_t)m * 2 * I;
            for (int i = 0; i < I; i++) h[m * E + i] = round_bf16(widen(round_bf16(silu(widen(g[i])))) * widen(g[I + i]));
        }
        product(h, E, M, wd, I, D, NULL, x, D, x, D);
        _tile_release();
    }
    return 0;
}
"""


def cpu_has_amx() -> str | None:
    """None when the CPU reports what these kernels need (NEEDS), else which flags it lacks."""
    from harness.core.env import cpu_flags

    missing = [f for f in NEEDS if f not in set(cpu_flags())]
    return f"this CPU has no {', '.join(missing)}" if missing else None


def build() -> ctypes.CDLL:
    """The compiled kernels for this machine (built on first use, then cached). Raises RuntimeError
    with the reason when they cannot be built."""
    lib = compile_library("amx", C_SOURCE)
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    for name, args, ret in (
            ("amx_request", [], i),
            ("amx_linear", [p, i64, i, p, i, i, p, p, i64, p, i], i),
            ("amx_attend_scratch", [i64, i], i64),
            ("amx_decode", [p, i64, p, p, p, p, p, i, i, i, i, i64, i, i, f, p, i64, i], i),
            ("amx_layer_workspace", [i, i, i, i, i, i, i64, i], i64),
            ("amx_layer", [p, i, i, p, p, f, p, p, i, i, i, p, p, p, p, p, i64, i, p, i, p, p, p, p, p, i, f, p, i64, i], i)):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ret, args
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class AmxKernels:
    """The compiled kernels: `pack` a weight, `linear` (a product of a few rows), `decode` (paged decode
    attention, cpu_decode.PagedDecode's interface) and `layer` (AmxDecodeLayer)."""

    dtype = torch.bfloat16

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self._scratch = torch.zeros(0, dtype=torch.uint8)

    def workspace(self, nbytes: int) -> torch.Tensor:
        """A scratch buffer of at least `nbytes` bytes, kept and grown (64 bytes aligned)."""
        if self._scratch.numel() < nbytes + 64:
            self._scratch = torch.zeros(nbytes + 64 + (nbytes >> 2), dtype=torch.uint8)
        return self._scratch[(-self._scratch.data_ptr()) % 64:]

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        n, k = weight.shape if weight.dim() == 2 else (0, 0)
        return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n > 0 and n % 16 == 0 and k % 32 == 0

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """W [N, K] -> [N / 16, K / 32, 16, 16, 2]: block (nb, kb) holds W[16 nb + n][32 kb + 2 r + j] at [r][n][j]."""
        n, k = weight.shape
        return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()

    def linear(self, x: torch.Tensor, tiles: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) (+ residual) in bf16 (float32 sums, one rounding); x: [M, K], M <= MAX_ROWS."""
        m = x.shape[0]
        n, k = shape
        if x.stride(1) != 1 or m % 16:  # the tiles read whole blocks of 16 rows
            x = F.pad(x, (0, 0, 0, -m % 16))
        if residual is not None and residual.stride(1) != 1:
            residual = residual.contiguous()
        out = torch.empty(m, n, dtype=torch.bfloat16)
        rc = self.lib.amx_linear(x.data_ptr(), x.stride(0), m, tiles.data_ptr(), k, n, _ptr(bias), _ptr(residual),
                                 0 if residual is None else residual.stride(0), out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"cpu_amx: a product it cannot take ({m} x {k} by {n} x {k})")
        return out

    def decode(self, q: torch.Tensor, pool, layer: int, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Paged decode attention: q [B, heads, d] -> [B, heads * d] (cpu_decode.PagedDecode's interface)."""
        b, heads, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        tables = tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        threads = torch.get_num_threads()
        per = self.lib.amx_attend_scratch(int(lens.max()), d)
        scratch = self.workspace(per * threads)
        out = torch.empty(b, heads * d, dtype=q.dtype)
        rc = self.lib.amx_decode(q.data_ptr(), q.stride(0), pool.k[layer].data_ptr(), pool.v[layer].data_ptr(),
                                 tables.data_ptr(), lens.data_ptr(), out.data_ptr(), b, heads, pool.kv_heads, d,
                                 pool.total_blocks, pool.block_size, tables.shape[1], d ** -0.5, scratch.data_ptr(), per,
                                 threads)
        if rc != 0:
            raise ValueError(f"cpu_amx: shapes it cannot take (heads {heads}, kv_heads {pool.kv_heads}, head_dim {d}, "
                             f"block_size {pool.block_size})")
        return out

    def supports_pool(self, pool, dtype: torch.dtype) -> bool:
        return (pool.kv_dtype == "auto" and dtype == torch.bfloat16 and pool.block_size % 16 == 0
                and pool.k.shape[-1] % 32 == 0 and pool.k.shape[-1] <= 256)


class AmxLinear:
    """model.Linear's interface (`__call__`, `add`, `shape`, `nbytes`) on an AMX CPU: products of at
    most `max_rows` rows (decode steps) on the AMX tiles, on a copy of the weight packed for them;
    more rows (prefill) by oneDNN on its own packed copy (kernels_cpu.PackedLinear). The price is
    memory: two packed copies of every weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel: AmxKernels | None = None,
                 max_rows: int = MAX_ROWS):
        from adapters.reference.kernels_cpu import PackedLinear

        self.bias, self.shape, self.max_rows = bias, tuple(weight.shape), max_rows
        self.kernel = kernel if kernel is not None and kernel.supports(weight) else None
        self.tiles = self.kernel.pack(weight) if self.kernel is not None else None
        self.onednn = PackedLinear(weight, bias)
        self.nbytes = self.onednn.nbytes
        self.weight = None

    def _takes(self, x: torch.Tensor) -> bool:
        return self.kernel is not None and x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes(x):
            return self.kernel.linear(x, self.tiles, self.shape, self.bias)
        return self.onednn(x)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T + b, the add fused into the product."""
        if self._takes(x) and residual.dtype == torch.bfloat16 and residual.shape == (x.shape[0], self.shape[0]):
            return self.kernel.linear(x, self.tiles, self.shape, self.bias, residual)
        return self.onednn.add(x, residual)


class AmxDecodeLayer:
    """kernel(x, layer, cos, sin, positions, k, v, tables, lens, eps) -> the layer on x [M, D] bf16 (a new
    tensor), M <= MAX_ROWS tokens of M sequences: `layer` a model.LayerWeights that `layer_takes`
    accepted (or the probe's stand-in); cos, sin: the model's whole [positions, hd] tables; positions,
    lens: int64 [M] (each row's position, and its tokens with the new one); k, v: the layer's pool
    tensors; tables: int64 [M, W] block tables."""

    max_rows = MAX_ROWS

    def __init__(self, kernels: AmxKernels):
        self.kernels, self.fn = kernels, kernels.lib.amx_layer

    @staticmethod
    def takes(model, i: int) -> bool:
        """Layer i of `model` is a plain pre-norm layer (cpu_layer.plain_decoder_layer) with its four
        products on the tiles."""
        if not plain_decoder_layer(model, i) or not model.cos.is_contiguous():
            return False
        layer = model.layers[i]
        return all(isinstance(m, AmxLinear) and m.tiles is not None for m in (layer.qkv, layer.o, layer.gate_up, layer.down))

    def __call__(self, x: torch.Tensor, layer, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, max_len: int,
                 eps: float) -> torch.Tensor:
        kv_heads, nb, bs, hd = k.shape
        m, d = x.shape
        heads, inter = layer.o.shape[1] // hd, layer.down.shape[1]
        threads = torch.get_num_threads()
        ws = self.kernels.workspace(self.kernels.lib.amx_layer_workspace(m, d, heads, kv_heads, hd, inter, max_len, threads))
        x = x.contiguous().clone()
        rc = self.fn(x.data_ptr(), m, d, layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), eps,
                     layer.qkv.tiles.data_ptr(), _ptr(layer.qkv.bias), heads, kv_heads, hd, cos.data_ptr(), sin.data_ptr(),
                     positions.data_ptr(), k.data_ptr(), v.data_ptr(), nb, bs, tables.data_ptr(), tables.shape[1],
                     lens.data_ptr(), layer.o.tiles.data_ptr(), _ptr(layer.o.bias), layer.gate_up.tiles.data_ptr(),
                     layer.down.tiles.data_ptr(), inter, hd ** -0.5, ws.data_ptr(), max_len, threads)
        if rc != 0:
            raise ValueError(f"cpu_amx: a layer it cannot take (heads {heads}, kv_heads {kv_heads}, head_dim {hd}, "
                             f"block_size {bs}, hidden {d}, intermediate {inter})")
        return x


def probe() -> tuple[AmxKernels | None, str | None]:
    """(the kernels, None) when this CPU has AMX, they build, Linux grants the tile state and each
    computes what torch computes: the product bit for bit on integer inputs (every float32 sum exact)
    over every path (one m-block, pairs of them, a last odd one, four n-blocks, a tail, bias,
    residual), the attention and a random layer of three rows at different positions and lengths
    within bf16 rounding; else (None, why)."""
    why = cpu_has_amx()
    if why:
        return None, why
    kernels, why = built(lambda: AmxKernels(build()), "AMX kernels")
    if kernels is None:
        return None, why
    if kernels.lib.amx_request() != 0:
        return None, "Linux did not grant this process AMX's tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    g = torch.Generator().manual_seed(0)

    def ints(*shape):
        return torch.randint(-8, 9, shape, generator=g).bfloat16()

    for n, k, m, with_bias, with_residual in PROBE_SHAPES:
        w, x = ints(n, k), ints(m, k + 32)[:, 32:]
        b = ints(n) * 16 if with_bias else None
        r = ints(m, n) * 16 if with_residual else None
        want = (x.float() @ w.float().T + (0 if b is None else b.float()) + (0 if r is None else r.float())).bfloat16()
        got = kernels.linear(x, kernels.pack(w), (n, k), b, r)
        if got.shape != want.shape or not torch.equal(got, want):
            wrong = (got != want).sum().item() if got.shape == want.shape else "all"
            return None, (f"the AMX product disagrees with torch's float32 product rounded to bf16 ({wrong} of "
                          f"{want.numel()} outputs, N={n} K={k} rows={m})")
    why = _probe_attention(kernels, g)
    if why is None:
        why = _probe_layer(kernels, g)
    return (None, why) if why else (kernels, None)


# (N, K, rows, bias, residual): one m-block and four n-blocks; a tail of n-blocks; two m-blocks
# (pairs of n-blocks) and an odd one; rows not a multiple of 16
PROBE_SHAPES = ((64, 64, 1, True, True), (48, 96, 5, False, True), (80, 32, 37, True, False), (112, 64, 20, True, True))


def _pool(g, blocks: int, bs: int, kv_heads: int, hd: int):
    from adapters.reference.kv_cache import KVPool

    pool = KVPool(1, blocks, bs, kv_heads, hd, "auto", torch.bfloat16, torch.device("cpu"))
    pool.prepare(set(range(blocks)))
    pool.k.copy_(torch.randn(pool.k.shape, generator=g).bfloat16())
    pool.v.copy_(torch.randn(pool.v.shape, generator=g).bfloat16())
    return pool


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _probe_attention(kernels: AmxKernels, g) -> str | None:
    from adapters.reference.attention import decode_attention, length_mask

    pool = _pool(g, 12, 16, 2, 64)
    tables = torch.tensor([[3, 7, 1, 0, 9], [2, 2, 2, 2, 2], [8, 5, 6, 4, 11]])
    lens = torch.tensor([70, 1, 80])
    q = (torch.randn(3, 6, 64, generator=g) * 2).bfloat16()
    kc, vc = pool.gather(0, tables, 80)
    want = decode_attention(q, kc, vc, length_mask(lens, kc.shape[2]))
    err = _rel(kernels.decode(q, pool, 0, tables, lens), want)
    return None if err < 2e-2 else f"the AMX decode attention disagrees with the plain path (relative error {err:.2e})"


def _probe_layer(kernels: AmxKernels, g) -> str | None:
    """A random layer (Q/K/V and output biases; 6 heads on 2 KV heads of 32) on three rows at positions
    14, 3 and 40 of their own block tables, against Model.forward's torch operations."""
    from types import SimpleNamespace

    from adapters.reference.attention import decode_attention, length_mask

    d, heads, kv_heads, hd, inter, eps = 64, 6, 2, 32, 96, 1e-5

    def rand(*shape, s=0.2):
        return (torch.randn(*shape, generator=g) * s).bfloat16()

    def linear(n, k, bias=True):
        w, b = rand(n, k), rand(n) if bias else None
        return SimpleNamespace(weight=w, bias=b, shape=(n, k), tiles=kernels.pack(w))

    layer = SimpleNamespace(input_norm=1 + rand(d), post_norm=1 + rand(d), qkv=linear((heads + 2 * kv_heads) * hd, d),
                            o=linear(d, heads * hd), gate_up=linear(2 * inter, d, False), down=linear(d, inter, False))
    pool = _pool(g, 8, 16, kv_heads, hd)
    tables = torch.tensor([[4, 1, 7], [2, 0, 0], [5, 6, 3]])
    positions = torch.tensor([14, 3, 40])
    lens = positions + 1
    cos, sin = rand(64, hd, s=1.0), rand(64, hd, s=1.0)
    x = rand(3, d, s=1.0)
    kp, vp = pool.k.clone(), pool.v.clone()
    got = AmxDecodeLayer(kernels)(x, layer, cos, sin, positions, kp[0], vp[0], tables, lens, int(lens.max()), eps)
    # Model.forward's torch operations on the same inputs
    qkv = F.linear(F.rms_norm(x, (d,), layer.input_norm, eps), layer.qkv.weight, layer.qkv.bias)
    qk = qkv[:, :(heads + kv_heads) * hd].view(3, heads + kv_heads, hd)
    qk = torch.addcmul(qk * cos[positions][:, None], qk.roll(hd // 2, dims=-1), sin[positions][:, None])
    q, k = qk.split([heads, kv_heads], dim=1)
    v = qkv[:, (heads + kv_heads) * hd:].view(3, kv_heads, hd)
    blocks = tables.gather(1, (positions // 16)[:, None])[:, 0]
    pool.write(0, pool.rows(blocks, positions % 16), k, v)
    kc, vc = pool.gather(0, tables, int(lens.max()))
    o = decode_attention(q, kc, vc, length_mask(lens, kc.shape[2]))
    h = x + F.linear(o, layer.o.weight, layer.o.bias)
    gate, up = F.linear(F.rms_norm(h, (d,), layer.post_norm, eps), layer.gate_up.weight).chunk(2, dim=-1)
    want = h + F.linear(F.silu(gate).mul_(up), layer.down.weight)
    if not (kp - pool.k).float().abs().max() <= 0.02 or not (vp - pool.v).float().abs().max() <= 0.02:
        return "the AMX decode layer wrote other keys or values than the plain path"
    err = _rel(got, want)
    return None if err < 2e-2 else f"the AMX decode layer disagrees with the plain path (relative error {err:.2e})"

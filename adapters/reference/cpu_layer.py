"""One decoder layer of a 1-token decode step in one C call: bf16 weights on a CPU without bf16
arithmetic (AVX2 only), where the products go to cpu_gemv's kernel.

Why: at batch 1 a decode step is its weights' bytes over the memory bandwidth, plus whatever
else the step does. On the `small` preset (12 layers, AMD EPYC, AVX2 only, 2 cores) the 49
products took about 9.5 ms of a 13.5 ms step; the other 4 ms were some 1,600 small torch
operations (two RMS norms, the rotary embedding, the K/V writes, SiLU and their copies and
casts, about 130 per layer at 1.5 to 25 us each) and 49 OpenMP regions opened and closed. This
kernel does a layer's work in one parallel region: the products share their rows among the
threads (cpu_gemv's `gemv_rows`), the KV heads share the attention (cpu_decode's `attend_head`),
and the small steps between them run on one thread.

What it computes is Model.forward's layer for one token (the reference semantics), with the same
roundings to bf16 at the same places:

    h   = bf16(x / rms(x) * input_norm)                        F.rms_norm (float32 inside)
    qkv = bf16(h @ Wqkv.T + b)                                 the fused Q, K, V product
    q,k = bf16(bf16(x * cos) + roll(x, d/2) * sin) per head    Model.rotate (sign folded into sin)
    the new token's K and V -> the pool, at its slot of the block table
    o   = attention of q over the sequence's K/V               cpu_decode (the paged kernel)
    x   = bf16(x + o @ Wo.T + b)
    h   = bf16(x / rms(x) * post_norm)
    a   = bf16(bf16(silu(gate)) * up), [gate, up] = bf16(h @ Wgu.T)
    x   = bf16(x + a @ Wd.T)

The RMS norm's sum runs in another order than torch's, so a bf16 result can differ from the
plain path by one unit in the last place where a sum falls near a rounding boundary;
`probe` bounds the difference on a random layer and tests/test_reference_kernels.py compares
whole decode steps.

Which layers: a plain pre-norm layer (LLaMA, Mistral, Qwen 2 with its Q/K/V bias) whose four
products are kernels_cpu.WidenedLinear on the C kernel, without qk-norm, MoE, latent attention,
a window, attention sinks or a family's own layer code (Gemma 3); `layer_takes` says. Others run
the plain Python layer in the same step.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from adapters.reference import cpu_decode, cpu_gemv
from adapters.reference.cpu_decode import built, compile_library

# the steps between a layer's products, as Model.forward rounds them (after cpu_gemv.BF16_SOURCE and a
# MAXD, the largest head_dim); cpu_amx.py's layer uses them too
STEPS_SOURCE = r"""
static float rms_scale(const uint16_t *x, int n, float eps) {
    float s = 0.f;
    for (int i = 0; i < n; i++) { float v = widen(x[i]); s += v * v; }
    return 1.f / sqrtf(s / (float)n + eps);
}

/* Rotary embedding of one head (d numbers) in place: bf16(bf16(x * cos) + roll(x, d/2) * sin). */
static void rotate(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int d) {
    float t[MAXD];
    int h = d / 2;
    for (int i = 0; i < d; i++) t[i] = widen(x[i]);
    for (int i = 0; i < h; i++) x[i] = round_bf16(widen(round_bf16(t[i] * widen(cos[i]))) + t[i + h] * widen(sin[i]));
    for (int i = h; i < d; i++) x[i] = round_bf16(widen(round_bf16(t[i] * widen(cos[i]))) + t[i - h] * widen(sin[i]));
}

static float silu(float g) { return g / (1.f + expf(-g)); }
"""

LAYER_SOURCE = STEPS_SOURCE + r"""
/* hf[i] = float(bf16(x[i] * r * w[i])): the norm's output, rounded as torch rounds it, widened for a product */
static void rms_norm(const uint16_t *x, const uint16_t *w, int n, float eps, float *hf) {
    float r = rms_scale(x, n, eps);
    for (int i = 0; i < n; i++) hf[i] = widen(round_bf16(widen(x[i]) * r * widen(w[i])));
}

/* One decoder layer for one token (see cpu_layer.py). x: [D] bf16, updated in place. wqkv:
   [(H + 2 KV) * hd, D], bqkv: its bias or NULL; wo: [D, H * hd], bo: bias or NULL; wgu: [2 I, D];
   wd: [D, I]. cos, sin: [hd], the token's row of the tables. k, v: this layer's pool, [KV, NB,
   BS, hd]; table: the sequence's block table; len: its tokens, the new one included (it goes to
   position len - 1). Returns 0, -1 for shapes it cannot take, -2 without memory. */
int decode_layer(uint16_t *x, int D, const uint16_t *in_norm, const uint16_t *post_norm, float eps,
                 const uint16_t *wqkv, const uint16_t *bqkv, int H, int KV, int hd,
                 const uint16_t *cos, const uint16_t *sin, uint16_t *k, uint16_t *v, int64_t NB, int BS,
                 const int64_t *table, int64_t len, const uint16_t *wo, const uint16_t *bo,
                 const uint16_t *wgu, const uint16_t *wd, int I, float scale, int threads) {
    int G = H / KV, nqkv = (H + 2 * KV) * hd, E = D > H * hd ? D : H * hd;
    if (G > MAXG || hd > MAXD || G * KV != H || hd % 2) return -1;
    float *hf = malloc(sizeof(float) * (size_t)(E > I ? E : I));
    uint16_t *qkv = malloc(sizeof(uint16_t) * (size_t)nqkv), *o = malloc(sizeof(uint16_t) * (size_t)H * hd);
    uint16_t *gu = malloc(sizeof(uint16_t) * 2 * (size_t)I), *y = malloc(sizeof(uint16_t) * (size_t)D);
    int rc = hf && qkv && o && gu && y ? 0 : -2;
    if (rc == 0) {
        int64_t pos = len - 1, block = table[pos / BS];
        int64_t lens[1] = {len};
        #pragma omp parallel num_threads(threads)
        {
            #pragma omp single
            rms_norm(x, in_norm, D, eps, hf);
            gemv_rows(wqkv, hf, bqkv, NULL, 0, qkv, 1, D, nqkv);
            #pragma omp single
            {
                for (int h = 0; h < H + KV; h++) rotate(qkv + (int64_t)h * hd, cos, sin, hd);
                for (int h = 0; h < KV; h++) {  /* the new token's K and V at row (h, block, pos % BS) */
                    int64_t row = ((int64_t)h * NB + block) * BS + pos % BS;
                    memcpy(k + row * hd, qkv + (int64_t)(H + h) * hd, sizeof(uint16_t) * hd);
                    memcpy(v + row * hd, qkv + (int64_t)(H + KV + h) * hd, sizeof(uint16_t) * hd);
                }
            }
            #pragma omp for schedule(static)
            for (int h = 0; h < KV; h++)
                attend_head(1, qkv, 0, hd, k, v, table, lens, o, 0, h, H, KV, hd, NB, BS, 0, scale);
            #pragma omp single
            for (int i = 0; i < H * hd; i++) hf[i] = widen(o[i]);
            gemv_rows(wo, hf, bo, x, 0, y, 1, H * hd, D);
            #pragma omp single
            {
                memcpy(x, y, sizeof(uint16_t) * D);
                rms_norm(x, post_norm, D, eps, hf);
            }
            gemv_rows(wgu, hf, NULL, NULL, 0, gu, 1, D, 2 * I);
            #pragma omp single
            for (int i = 0; i < I; i++) hf[i] = widen(round_bf16(widen(round_bf16(silu(widen(gu[i])))) * widen(gu[I + i])));
            gemv_rows(wd, hf, NULL, x, 0, y, 1, I, D);
        }
        memcpy(x, y, sizeof(uint16_t) * D);
    }
    free(hf); free(qkv); free(o); free(gu); free(y);
    return rc;
}
"""

C_SOURCE = cpu_decode.C_SOURCE + cpu_gemv.C_SOURCE + LAYER_SOURCE


# RMS norm of many rows (a prefill's, or a decode batch's op by op): RowSteps
ROWS_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAXD 256  /* head_dim */
""" + cpu_gemv.BF16_SOURCE + STEPS_SOURCE + r"""
/* out[t] = bf16(x[t] / rms(x[t]) * w), T rows of D (x at stride ldx, out contiguous), rows in parallel */
int rms_norm_rows(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t T, int D, float eps, uint16_t *out,
                  int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (T > 8)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xt = x + t * ldx;
        uint16_t *o = out + t * D;
        float r = rms_scale(xt, D, eps);
        for (int i = 0; i < D; i++) o[i] = round_bf16(widen(xt[i]) * r * widen(w[i]));
    }
    return 0;
}

"""


class RowSteps:
    """steps.rms_norm(x, weight, eps) -> bf16(x / rms(x) * weight) for the rows of x [T, D] bf16: what
    Model.rms_norm computes (F.rms_norm: float32 inside, one rounding; the sum in another order, so a
    value near a rounding boundary can land one bf16 unit away), in one vectorised C loop per row,
    rows over torch's threads. torch's CPU rms_norm on bf16 runs as six operators with float32
    copies between them: 1.0 ms for 512 x 768 on one core of an Intel Xeon with AMX, against 0.18 ms
    here, twice per layer of a prefill (docs/reference-engine.md)."""

    def __init__(self, lib: ctypes.CDLL):
        self.fn = lib.rms_norm_rows

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        t, d = x.shape
        out = torch.empty(t, d, dtype=torch.bfloat16)
        self.fn(x.data_ptr(), x.stride(0), weight.data_ptr(), t, d, eps, out.data_ptr(), torch.get_num_threads())
        return out


def rows_probe() -> tuple[RowSteps | None, str | None]:
    """(the kernel, None) when it builds and gives F.rms_norm's bf16 values to one unit in the last
    place (rows of an odd width, strided rows, a weight of mixed signs); else (None, why)."""
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    kernel, why = built(lambda: RowSteps(compile_library("rms_norm_rows", ROWS_SOURCE, [p, i64, p, i64, i, f, p, i])),
                        "RMS norm kernel")
    if kernel is None:
        return None, why
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 203, generator=g) * 3).bfloat16()[:, :197]
    w = torch.randn(197, generator=g).bfloat16()
    got, want = kernel.rms_norm(x, w, 1e-5).float(), F.rms_norm(x, (197,), w, 1e-5).float()
    ulp = want.abs().clamp(min=1e-30) * 2.0 ** -7  # one bf16 unit (8 bits of mantissa)
    if not bool(((got - want).abs() <= ulp).all()):
        return None, f"the RMS norm kernel disagrees with F.rms_norm (max difference {(got - want).abs().max().item():.3g})"
    return kernel, None


def build() -> ctypes.CDLL:
    """The compiled kernel for this machine (built on first use, then cached). Raises
    RuntimeError with the reason when it cannot be built."""
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    return compile_library("decode_layer", C_SOURCE,
                           [p, i, p, p, f, p, p, i, i, i, p, p, p, p, i64, i, p, i64, p, p, p, p, i, f, i])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeLayer:
    """kernel(x, layer, cos, sin, k, v, table, length, eps) -> layer(x), x: [1, D] bf16 (a new tensor).
    `layer`: a model.LayerWeights that `layer_takes` accepted; cos, sin: the token's [hd] rows;
    k, v: the layer's pool tensors; table: int64 block table; length: tokens with the new one."""

    max_rows = 1  # one token (a decode step at batch 1)

    def __init__(self, lib: ctypes.CDLL):
        self.fn = lib.decode_layer

    def __call__(self, x: torch.Tensor, layer, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, table: torch.Tensor, length: int, eps: float) -> torch.Tensor:
        kv_heads, nb, bs, hd = k.shape
        d = x.shape[-1]
        heads = layer.o.shape[1] // hd
        inter = layer.down.shape[1]
        x = x.reshape(d).clone()
        rc = self.fn(x.data_ptr(), d, layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), eps,
                     layer.qkv.weight.data_ptr(), _ptr(layer.qkv.bias), heads, kv_heads, hd,
                     cos.data_ptr(), sin.data_ptr(), k.data_ptr(), v.data_ptr(), nb, bs, table.data_ptr(), length,
                     layer.o.weight.data_ptr(), _ptr(layer.o.bias), layer.gate_up.weight.data_ptr(),
                     layer.down.weight.data_ptr(), inter, hd ** -0.5, torch.get_num_threads())
        if rc == -2:
            raise MemoryError("cpu_layer: no memory for a decode layer's buffers")
        if rc != 0:
            raise ValueError(f"cpu_layer: shapes it cannot take (heads {heads}, kv_heads {kv_heads}, head_dim {hd})")
        return x.view(1, d)


def layer_takes(model, i: int) -> bool:
    """Whether layer i of `model` is a plain pre-norm layer whose four products run on the C
    matrix-vector kernel (the layers DecodeLayer computes exactly as Model.forward does)."""
    from adapters.reference.kernels_cpu import WidenedLinear

    layer = model.layers[i]
    return plain_decoder_layer(model, i) and all(isinstance(m, WidenedLinear) and m.gemv is not None
                                                 for m in (layer.qkv, layer.o, layer.gate_up, layer.down))


def plain_decoder_layer(model, i: int) -> bool:
    """Whether layer i of `model` is a plain pre-norm bf16 layer (LLaMA's, with Q/K/V and output
    biases allowed): no qk-norm, MoE, latent attention, window, sinks, MLP biases or a family's own
    layer code. What the fused layers (this module's and cpu_amx.py's) compute; they check the
    products' kernels themselves."""
    from adapters.reference.model import Model

    layer, cls = model.layers[i], type(model)
    return (model.dtype == torch.bfloat16 and layer.qkv is not None and layer.gate_up is not None
            and layer.gate_up.bias is None and layer.down.bias is None
            and layer.q_norm is None and layer.moe is None and layer.mla is None and layer.sinks is None
            and not layer.local_rope and layer.attn_out_norm is None and model.cfg.window(i) is None
            and all(getattr(cls, name) is getattr(Model, name)
                    for name in ("rms_norm", "rotate", "attention_input", "attention_output_and_mlp", "forward")))


def probe(dtype: torch.dtype) -> tuple[DecodeLayer | None, str | None]:
    """(the kernel, None) when it builds here and computes a random layer as the plain torch ops
    do (one bf16 unit in the last place at most); else (None, why)."""
    if dtype != torch.bfloat16:
        return None, f"no fused decode layer for {dtype} (bf16 only)"
    kernel, why = built(lambda: DecodeLayer(build()), "fused decode layer")
    if kernel is None:
        return None, why
    from types import SimpleNamespace

    from adapters.reference.attention import decode_attention, length_mask
    from adapters.reference.kv_cache import KVPool

    g = torch.Generator().manual_seed(0)
    d, heads, kv_heads, hd, inter, eps = 96, 6, 2, 16, 40, 1e-5

    def rand(*shape, s=0.2):
        return (torch.randn(*shape, generator=g) * s).bfloat16()

    w = SimpleNamespace(weight=rand((heads + 2 * kv_heads) * hd, d), bias=rand((heads + 2 * kv_heads) * hd))
    layer = SimpleNamespace(input_norm=1 + rand(d), post_norm=1 + rand(d), qkv=w,
                            o=SimpleNamespace(weight=rand(d, heads * hd), bias=rand(d), shape=(d, heads * hd)),
                            gate_up=SimpleNamespace(weight=rand(2 * inter, d)),
                            down=SimpleNamespace(weight=rand(d, inter), shape=(d, inter)))
    pool = KVPool(1, 6, 4, kv_heads, hd, "auto", dtype, torch.device("cpu"))
    pool.prepare(set(range(6)))
    pool.k.copy_(rand(*pool.k.shape, s=1.0))
    pool.v.copy_(rand(*pool.v.shape, s=1.0))
    table, length = torch.tensor([4, 1, 5, 2]), 15  # the new token at position 14: block 5, offset 2
    cos, sin = rand(hd, s=1.0), rand(hd, s=1.0)
    x = rand(1, d, s=1.0)
    kp, vp = pool.k.clone(), pool.v.clone()
    got = kernel(x, layer, cos, sin, kp[0], vp[0], table, length, eps)
    # the plain torch ops of Model.forward's layer, on the same inputs
    qkv = F.linear(F.rms_norm(x, (d,), layer.input_norm, eps), w.weight, w.bias)
    qk = qkv[:, :(heads + kv_heads) * hd].view(1, heads + kv_heads, hd)
    qk = torch.addcmul(qk * cos, qk.roll(hd // 2, dims=-1), sin)
    q, k = qk.split([heads, kv_heads], dim=1)
    v = qkv[:, (heads + kv_heads) * hd:].view(1, kv_heads, hd)
    pool.write(0, pool.rows(table[[3]], torch.tensor([2])), k, v)
    kc, vc = pool.gather(0, table[None], length)
    o = decode_attention(q, kc, vc, length_mask(torch.tensor([length]), kc.shape[2]))
    h = x + F.linear(o, layer.o.weight, layer.o.bias)
    gate, up = F.linear(F.rms_norm(h, (d,), layer.post_norm, eps), layer.gate_up.weight).chunk(2, dim=-1)
    want = h + F.linear(F.silu(gate).mul_(up), layer.down.weight)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    if not torch.equal(kp, pool.k) and not (kp.float() - pool.k.float()).abs().max() <= 0.02:
        return None, "the fused decode layer wrote other keys than the plain path"
    if not err < 2e-2:
        return None, f"the fused decode layer disagrees with the plain path (relative error {err:.2e})"
    return kernel, None

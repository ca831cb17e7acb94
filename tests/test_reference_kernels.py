"""The reference engine's device-specific fast paths, checked on a CPU against the plain path:

- the private oneDNN ops (kernels_cpu.py): the probe succeeds on the torch this project pins,
  every op is probed, and the fallback computes the same numbers;
- the CUDA path's attention (kernels_cuda.py: SDPA prefill, the block-table-driven decode) runs
  on a CPU too, and must match transformers like the plain path does;
- the Triton decode kernel, under Triton's interpreter (TRITON_INTERPRET=1), against the
  PyTorch paged decode;
- the CUDA-graph bookkeeping (cuda_graphs.py): buckets, padding, static buffers and replays,
  with `FakeGraphBackend`, a stand-in that re-runs the recorded function instead of replaying
  a CUDA graph;
- the GPU pool sizing (gpu_memory_utilization) with a faked device memory report.

Real-GPU tests are marked `gpu` and skip without CUDA."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from adapters.base import ModelSpec, Request, now_ns
from adapters.reference import llm_engine as engine_module
from adapters.reference import cpu_amx, cpu_decode, cpu_gemv, cpu_layer, kernels, kernels_cpu
from adapters.reference.config import EngineConfig
from adapters.reference.cuda_graphs import BUCKETS, DecodeGraphs, bucket_for, buckets_up_to
from adapters.reference.engine import ReferenceEngine
from adapters.reference.llm_engine import activation_reserve
from adapters.reference.kernels_cuda import CudaStepAttention, paged_decode_torch
from adapters.reference.kv_cache import KVPool
from adapters.reference.model import Linear, ModelConfig
from adapters.reference.scheduler import Chunk
from harness.core.env import cpu_flags

REPO = Path(__file__).resolve().parent.parent
LENGTHS = (5, 17, 33, 40)
STEPS = 10
MAX_LEN = 128


def make_prompts(lengths, seed=0, vocab=4096):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def spec(tiny_ckpt) -> ModelSpec:
    return ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="float32", max_model_len=MAX_LEN)


def run(engine_or_spec, options=None, prompts=None, steps=STEPS):
    engine = engine_or_spec
    if isinstance(engine_or_spec, ModelSpec):
        engine = ReferenceEngine()
        engine.load(engine_or_spec, options or {})
    pre = engine.prefill(prompts or make_prompts(LENGTHS), return_logits=True)
    dec = engine.decode(steps, return_logits=True)
    return engine, pre, dec


def assert_same(a, b, tol=1e-4):
    (_, pa, da), (_, pb, db) = a, b
    errors = [rel_err(pa.logits, pb.logits)] + [rel_err(x, y) for x, y in zip(da.logits, db.logits)]
    assert max(errors) < tol, errors
    assert pa.first_tokens == pb.first_tokens and da.tokens == db.tokens


@pytest.fixture(scope="module")
def plain(spec):
    engine, pre, dec = run(spec, {"kernels": "plain"})
    engine.close()
    return engine, pre, dec


# ---- the private oneDNN API ---------------------------------------------------

# oneDNN's bf16 linear needs these (its own error names them); on a CPU without them (an AVX2-only
# AMD EPYC, say) the probe must refuse bf16 and the engine take the plain path.
CPU_FLAGS = set(cpu_flags())
HAVE_AMX = cpu_amx.cpu_has_amx() is None
ONEDNN_BF16 = "avx_ne_convert" in CPU_FLAGS or {"avx512bw", "avx512vl", "avx512dq"} <= CPU_FLAGS
NO_ONEDNN_BF16 = ("this CPU lacks what oneDNN's bf16 linear needs (avx_ne_convert, or avx512bw + avx512vl + "
                  "avx512dq): the reference engine widens bf16 products to float32 here (kernels_cpu.WidenedLinear)")


@pytest.mark.skipif(not torch.__version__.startswith("2.13"),
                    reason=f"the pinned torch is 2.13 (CPU); this is {torch.__version__}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_probe_succeeds_on_the_pinned_torch(dtype):
    """If this fails, torch moved or changed one of its private mkldnn ops: the engine still runs
    (on the plain path), but slower. Update kernels_cpu.py. Where the CPU cannot run oneDNN's bf16
    linear, the probe must say so and the engine fall back."""
    if dtype == torch.bfloat16 and not ONEDNN_BF16:
        why = kernels_cpu.probe(dtype)
        assert why is not None and "bfloat16" in why, why
        chosen = kernels.select(torch.device("cpu"), dtype, EngineConfig())
        assert chosen.details["linear"].startswith("widened")
        assert isinstance(chosen.make_linear(torch.ones(4, 8, dtype=dtype)), kernels_cpu.WidenedLinear)
        if HAVE_CC:  # its 1-row products by the C kernel (cpu_gemv.py)
            assert "by the C kernel" in chosen.details["linear"], chosen.details
        return
    assert kernels_cpu.probe(dtype) is None
    linear = kernels.select(torch.device("cpu"), dtype, EngineConfig()).details["linear"]
    if dtype == torch.bfloat16 and HAVE_AMX and HAVE_CC:  # decode products on the AMX tiles (cpu_amx.py)
        assert linear.startswith("amx tiles") and linear.endswith("onednn-packed for more"), linear
    else:
        assert linear == "onednn-packed"


@pytest.mark.parametrize("op", ["_reorder_linear_weight", "_linear", "_linear_add"])
def test_every_private_op_is_probed(monkeypatch, op):
    def moved(*args, **kwargs):
        raise AttributeError("'_OpNamespace' 'mkldnn' object has no attribute (moved)")
    monkeypatch.setattr(kernels_cpu, op, moved)
    why = kernels_cpu.probe(torch.float32)
    assert why and "mkldnn" in why


def test_probe_catches_wrong_numbers(monkeypatch):
    monkeypatch.setattr(kernels_cpu, "_linear_add", lambda x, r, p, b: kernels_cpu._linear(x, p, b))
    why = kernels_cpu.probe(torch.float32)
    assert why and "binary" in why and "disagrees" in why


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_fallback_gives_the_same_numbers(tiny_ckpt, monkeypatch, dtype, tol):
    if dtype == "bfloat16" and not ONEDNN_BF16:
        pytest.skip(NO_ONEDNN_BF16 + ", so there is no fast path to compare with")
    spec = ModelSpec(path=str(tiny_ckpt), name="tiny", dtype=dtype, max_model_len=MAX_LEN)
    monkeypatch.setattr(cpu_amx, "probe", lambda: (None, "refused by the test"))  # oneDNN for every product
    fast = run(spec)
    assert fast[0].kernels.details["linear"] == "onednn-packed"
    assert isinstance(fast[0].model.layers[0].qkv, kernels_cpu.PackedLinear)
    fast[0].close()
    monkeypatch.setattr(kernels_cpu, "probe", lambda dtype: "forced to fail by the test")
    slow = run(spec)
    info = slow[0].kernels.details
    assert info["linear"] == "torch" and info["linear_fallback_reason"] == "forced to fail by the test"
    assert isinstance(slow[0].model.layers[0].qkv, Linear)
    assert slow[0].kv_cache_info().extra["kernels"]["linear"] == "torch"
    slow[0].close()
    errors = [rel_err(fast[1].logits, slow[1].logits)] + [rel_err(a, b) for a, b in zip(fast[2].logits, slow[2].logits)]
    assert max(errors) < tol, errors


def test_kernels_recorded_and_plain_matches(spec, plain):
    engine, pre, dec = run(spec)
    info = engine.kv_cache_info().extra["kernels"]
    assert info["kernels"] == "cpu" and info["cpu_flags"] and info["linear"] == "onednn-packed"
    assert_same((engine, pre, dec), plain)
    engine.close()


# ---- bf16 weights on a CPU without bf16 arithmetic (kernels_cpu.WidenedLinear) -----------

@pytest.mark.parametrize("rows", [1, 2, 7, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_widened_linear_is_the_bf16_product_rounded_once(rows, bias):
    """Rows >= WIDEN_ROWS: float32 on the packed float32 copy, rounded once to bf16; fewer rows:
    torch's own bf16 product. Both within one bf16 rounding of the exact (float64) result."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 80, generator=g) * 0.1).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 80, generator=g).bfloat16()
    r = torch.randn(rows, 96, generator=g).bfloat16()
    wide, plain = kernels_cpu.WidenedLinear(w, b), Linear(w, b)
    assert wide.nbytes == plain.nbytes and wide.shape == plain.shape
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    f32 = x.float() @ w.float().T + (0 if b is None else b.float())
    cases = ((wide(x), plain(x), exact, f32), (wide.add(x, r), plain.add(x, r), exact + r.double(), f32 + r.float()))
    for got, want, reference, in_float32 in cases:
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        if rows >= kernels_cpu.WIDEN_ROWS:  # float32 (up to oneDNN's order of summation), rounded once
            assert torch.allclose(got.float(), in_float32.bfloat16().float(), rtol=8e-3, atol=1e-6)
        else:
            assert torch.equal(got, want)
        assert rel_err(got, reference) < 8e-3 and rel_err(want, reference) < 8e-3


def force_widening(monkeypatch):
    """Where oneDNN has bf16 kernels, make its probe refuse bf16 (only) so that the engine widens."""
    real = kernels_cpu.probe
    monkeypatch.setattr(kernels_cpu, "probe", lambda dtype: real(dtype) if dtype == torch.float32 else "no bf16 (the test)")


def assert_bf16_engines_agree(fast, slow, rows):
    """Same first tokens; logits within bf16 rounding at the prefill and at each sequence's steps
    while both engines decoded the same tokens."""
    assert fast[1].first_tokens == slow[1].first_tokens
    errors = [rel_err(fast[1].logits, slow[1].logits)]
    for row in range(rows):
        for i, (a, b) in enumerate(zip(fast[2].logits, slow[2].logits)):
            if i and fast[2].tokens[i - 1][row] != slow[2].tokens[i - 1][row]:
                break
            errors.append(rel_err(a[row], b[row]))
    assert len(errors) > 2 * rows and max(errors) < 3e-2, errors


def test_widened_engine_matches_the_plain_bf16_engine(tiny_ckpt, monkeypatch):
    """The engine in bf16 with every product widened (forced here where oneDNN has bf16 kernels:
    the probe refuses bf16 only) against kernels=plain in bf16."""
    force_widening(monkeypatch)
    spec = ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="bfloat16", max_model_len=MAX_LEN)
    fast = run(spec)
    assert fast[0].kernels.details["linear"].startswith("widened")
    assert isinstance(fast[0].model.layers[0].qkv, kernels_cpu.WidenedLinear)
    fast[0].close()
    slow = run(spec, {"kernels": "plain"})
    slow[0].close()
    assert_bf16_engines_agree(fast, slow, len(LENGTHS))


# ---- the bf16 matrix-vector kernel (cpu_gemv.py) -------------------------------------------

HAVE_CC = shutil.which(os.environ.get("CC", "cc")) is not None or shutil.which("gcc") is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler here: the engine uses torch's bf16 product")


def gemv_kernel() -> cpu_gemv.HalfGemv:
    kernel, why = cpu_gemv.probe(torch.bfloat16)
    assert why is None and kernel is not None, why
    return kernel


@needs_cc
@pytest.mark.parametrize("n,k,rows,bias,residual", [
    (1280, 768, 1, False, False),  # the small preset's qkv
    (37, 75, 1, True, True),  # odd K (a tail after the vector loop), N not a multiple of the 4-row block
    (3, 5, 1, True, True),  # N below one block, K below one vector
    (97, 1031, 1, False, True),
    (13, 200, 3, True, False),  # several rows (the engine widens 2 or more; the kernel takes any)
])
def test_bf16_gemv_matches_the_plain_path(n, k, rows, bias, residual):
    """WidenedLinear through the C kernel against the plain path (torch's bf16 product) and the
    exact (float64) result, random inputs, x and the residual strided views: float32 sums in
    another order, rounded once, so at most one bf16 step from torch's float32 product rounded."""
    kernel = gemv_kernel()
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, k + 5, generator=g).bfloat16()[:, 5:]
    r = torch.randn(rows, n + 2, generator=g).bfloat16()[:, 1:n + 1] if residual else None
    wide, plain = kernels_cpu.WidenedLinear(w, b, min_rows=rows + 1, gemv=kernel), Linear(w, b)
    assert wide.gemv is kernel
    got, want = (wide(x), plain(x)) if r is None else (wide.add(x, r), plain.add(x, r))
    exact = x.double() @ w.double().T + (0 if b is None else b.double()) + (0 if r is None else r.double())
    in_float32 = x.float() @ w.float().T + (0 if b is None else b.float()) + (0 if r is None else r.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (rows, n)
    assert torch.allclose(got.float(), in_float32.bfloat16().float(), rtol=2 ** -7, atol=1e-5)
    assert rel_err(got, exact) < 8e-3 and rel_err(want, exact) < 8e-3


@needs_cc
@pytest.mark.parametrize("rows", [1, 2])
def test_bf16_gemv_rounds_like_torch(rows):
    """Small integers: every float32 sum is exact in any order, so the kernel must give torch's
    float32 product rounded to bf16 bit for bit; many sums lie halfway between two bf16 numbers
    (ties to even)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randint(-8, 9, (203, 517), generator=g).bfloat16()
    x = torch.randint(-8, 9, (rows, 517), generator=g).bfloat16()
    b = torch.randint(-100, 101, (203,), generator=g).bfloat16()
    r = torch.randint(-100, 101, (rows, 203), generator=g).bfloat16()
    in_float32 = x.float() @ w.float().T + b.float() + r.float()
    assert (in_float32 % 2 == 1)[in_float32.abs() > 256].sum() > 20  # ties (odd integers above 2^8)
    assert torch.equal(gemv_kernel()(x, w, b, r), in_float32.bfloat16())


@needs_cc
@pytest.mark.parametrize("bug,fragment", [
    ("u += 0x7fffu + ((u >> 16) & 1u);", "u += 0;"),  # truncates instead of rounding
    ("if (bias) v += widen(bias[n]);", ""),  # bias left out
    ("else for (int n = n0; n < n1; n++) s[n - n0] = dot_row(w + (int64_t)n * K, xm, K);",
     "else for (int n = n0; n < n1; n++) s[n - n0] = 0.f;"),  # the rows after the last full block left out
])
def test_gemv_probe_refuses_a_wrong_kernel(monkeypatch, tmp_path, bug, fragment):
    assert bug in cpu_gemv.C_SOURCE
    monkeypatch.setenv("INFER_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_gemv, "C_SOURCE", cpu_gemv.C_SOURCE.replace(bug, fragment))
    kernel, why = cpu_gemv.probe(torch.bfloat16)
    assert kernel is None and "disagrees" in why, why


@needs_cc
def test_engine_decodes_batch_1_through_the_gemv_kernel(tiny_ckpt, monkeypatch):
    """bf16 on a CPU without oneDNN bf16 (forced where it has it): the 1-row products of a decode
    step at batch 1 run in the C kernel; the engine agrees with kernels=plain, which never uses it."""
    force_widening(monkeypatch)
    spec = ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="bfloat16", max_model_len=MAX_LEN)
    engine = ReferenceEngine()
    engine.load(spec, {})
    details = engine.kernels.details
    assert "by the C kernel (cpu_gemv.py)" in details["linear"] and "gemv_fallback_reason" not in details
    layer = engine.model.layers[0]
    assert all(lin.gemv is not None for lin in (layer.qkv, layer.o, layer.gate_up, layer.down, engine.model.lm_head))
    rows = []  # rows of each product the kernel computes (a spy: it calls the kernel)
    real_call = cpu_gemv.HalfGemv.__call__
    monkeypatch.setattr(cpu_gemv.HalfGemv, "__call__", lambda self, x, *a: rows.append(x.shape[0]) or real_call(self, x, *a))
    prompts = make_prompts([23])
    fast = run(engine, prompts=prompts)
    # the LM head of every decode step (its layers' products run inside the fused decode layer,
    # cpu_layer.py, which calls the same C code), and the prefill's on its last token (the last
    # layer's output projection and MLP after the sampled row is picked, and the LM head)
    assert "decode_layer_fallback_reason" not in details and "one C call" in details["decode_layer"]
    assert rows == [1] * (STEPS + 4)
    engine.close()
    slow = run(spec, {"kernels": "plain"}, prompts=prompts)
    assert isinstance(slow[0].model.layers[0].qkv, Linear)
    slow[0].close()
    assert_bf16_engines_agree(fast, slow, 1)


def test_gemv_falls_back_when_it_cannot_build(tiny_ckpt, monkeypatch, tmp_path):
    """No compiler (CC names a file that does not exist): the 1-row products stay with torch, the
    reason is recorded, the engine still agrees with kernels=plain."""
    force_widening(monkeypatch)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    spec = ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="bfloat16", max_model_len=MAX_LEN)
    prompts = make_prompts([23])
    fast = run(spec, prompts=prompts)
    details = fast[0].kernels.details
    assert "could not be built" in details["gemv_fallback_reason"] and "no-such-cc" in details["gemv_fallback_reason"]
    assert "1-row products by torch" in details["linear"]
    assert fast[0].model.layers[0].qkv.gemv is None
    fast[0].close()
    slow = run(spec, {"kernels": "plain"}, prompts=prompts)
    slow[0].close()
    assert_bf16_engines_agree(fast, slow, 1)


# ---- the fused decode layer (cpu_layer.py) --------------------------------------------------

@needs_cc
def test_fused_decode_layer_matches_the_layer_op_by_op(tiny_ckpt, monkeypatch):
    """bf16, batch 1, widened products on the C kernel: every layer of every decode step runs in
    one C call (a spy counts them), and the engine gives the logits and tokens of the same engine
    without it (its probe refused: each layer op by op through torch and the same C products),
    to bf16 rounding of the RMS norm's sum (summed in another order): logits compared while the
    tokens agree (a near tie may flip on another CPU)."""
    force_widening(monkeypatch)
    spec = ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="bfloat16", max_model_len=MAX_LEN)
    calls = []
    real_call = cpu_layer.DecodeLayer.__call__
    monkeypatch.setattr(cpu_layer.DecodeLayer, "__call__", lambda self, *a: calls.append(1) or real_call(self, *a))
    prompts = make_prompts([29])
    engine = ReferenceEngine()
    engine.load(spec, {})
    calls.clear()  # the probe's call at load
    fast = run(engine, prompts=prompts, steps=24)
    layers = len(engine.model.layers)
    assert len(calls) == layers * 24
    fast[0].close()
    monkeypatch.setattr(cpu_layer, "probe", lambda dtype: (None, "refused by the test"))
    slow = run(spec, prompts=prompts, steps=24)
    assert slow[0].kernels.details["decode_layer"] == "per operation (refused by the test)"
    slow[0].close()
    assert len(calls) == layers * 24  # not called again
    assert_bf16_engines_agree(fast, slow, 1)


@needs_cc
def test_fused_decode_layer_with_attention_biases(tmp_path, monkeypatch):
    """Q/K/V and output-projection biases (LLaMA's attention_bias; Qwen 2 has the first three), set
    to random values: the fused layer adds them where the op-by-op layer does (a spy counts its
    calls), and the two engines agree."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    force_widening(monkeypatch)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, attention_bias=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "biased")
    spec = ModelSpec(path=str(tmp_path / "biased"), name="biased", dtype="bfloat16", max_model_len=MAX_LEN)
    calls = []
    real_call = cpu_layer.DecodeLayer.__call__
    monkeypatch.setattr(cpu_layer.DecodeLayer, "__call__", lambda self, *a: calls.append(1) or real_call(self, *a))
    engine = ReferenceEngine()
    engine.load(spec, {})
    assert engine.model.layers[0].o.bias is not None
    calls.clear()
    prompts = make_prompts([21], vocab=500)
    fast = run(engine, prompts=prompts, steps=12)
    assert len(calls) == 2 * 12
    engine.close()
    monkeypatch.setattr(cpu_layer, "probe", lambda dtype: (None, "refused by the test"))
    slow = run(spec, prompts=prompts, steps=12)
    slow[0].close()
    assert_bf16_engines_agree(fast, slow, 1)


@needs_cc
def test_fused_decode_layer_only_at_one_decode_token(tiny_ckpt, monkeypatch):
    """Batch 2 decode steps and prefills run op by op (the spy sees no call); the layers a family
    changes (qk-norm here) are refused by layer_takes."""
    force_widening(monkeypatch)
    spec = ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="bfloat16", max_model_len=MAX_LEN)
    calls = []
    real_call = cpu_layer.DecodeLayer.__call__
    monkeypatch.setattr(cpu_layer.DecodeLayer, "__call__", lambda self, *a: calls.append(1) or real_call(self, *a))
    engine = ReferenceEngine()
    engine.load(spec, {})
    calls.clear()  # the probe's call at load
    run(engine, prompts=make_prompts([12, 20]), steps=3)
    assert calls == []
    model = engine.model
    assert all(cpu_layer.layer_takes(model, i) for i in range(len(model.layers)))
    model.layers[0] = dataclasses.replace(model.layers[0], q_norm=torch.ones(model.cfg.head_dim, dtype=torch.bfloat16))
    assert not cpu_layer.layer_takes(model, 0) and cpu_layer.layer_takes(model, 1)
    engine.close()


@needs_cc
@pytest.mark.parametrize("bug,fragment", [
    ("+ t[i + h] * widen(sin[i]));", "+ t[i] * widen(sin[i]));"),
    ("int64_t row = ((int64_t)h * NB + block) * BS + pos % BS;", "int64_t row = ((int64_t)h * NB + block) * BS;"),
    ("static float silu(float g) { return g / (1.f + expf(-g)); }", "static float silu(float g) { return g; }"),
    ("gemv_rows(wo, hf, bo, x, 0, y, 1, H * hd, D);", "gemv_rows(wo, hf, bo, NULL, 0, y, 1, H * hd, D);"),
    ("gemv_rows(wo, hf, bo, x, 0, y, 1, H * hd, D);", "gemv_rows(wo, hf, NULL, x, 0, y, 1, H * hd, D);"),
])
def test_decode_layer_probe_refuses_a_wrong_kernel(monkeypatch, tmp_path, bug, fragment):
    """A rotation without its half turn, the new key written to the block's first slot, SiLU left
    out, the residual or the output bias left out: the probe catches each and the engine keeps the
    layer op by op."""
    assert bug in cpu_layer.C_SOURCE
    monkeypatch.setenv("INFER_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_layer, "C_SOURCE", cpu_layer.C_SOURCE.replace(bug, fragment))
    kernel, why = cpu_layer.probe(torch.bfloat16)
    assert kernel is None and ("disagrees" in why or "other keys" in why), why


# ---- AMX: products, decode attention and whole decode layers of a batch (cpu_amx.py) ----------

needs_amx = pytest.mark.skipif(not (HAVE_AMX and HAVE_CC), reason=(
    f"{cpu_amx.cpu_has_amx() or 'no C compiler here'}: the engine keeps oneDNN's products and the fused C "
    "decode attention on this CPU (the AMX kernels are built and chosen only where the CPU has AMX)"))


@pytest.mark.parametrize("flags,kind", [
    ({"avx2", "fma"}, "avx2"),
    ({"avx2", "avx512f", "avx512bw", "avx512vl"}, "avx512"),
    ({"avx2", "avx512f", "avx512bw", "avx512_bf16"}, "avx512_bf16"),
    ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}, "amx"),
    ({"amx_tile", "amx_int8"}, "other"),  # AMX without bf16 tiles or AVX-512 bf16: nothing here uses it
    (set(), "other"),
])
def test_cpu_kind_names_each_kind(flags, kind):
    assert kernels.cpu_kind(flags) == kind


def test_amx_probe_refuses_a_cpu_without_amx(monkeypatch):
    """A CPU without the AMX flags (an AVX2-only or AVX-512-only one): no build is tried, the reason
    names the missing flags, and the engine keeps oneDNN's products."""
    import harness.core.env as env

    monkeypatch.setattr(env, "cpu_flags", lambda: ["avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"])
    monkeypatch.setattr(cpu_amx, "build", lambda: pytest.fail("built on a CPU without AMX"))
    kernel, why = cpu_amx.probe()
    assert kernel is None and "amx_tile" in why and "amx_bf16" in why, why


def amx_kernels() -> cpu_amx.AmxKernels:
    kernel, why = cpu_amx.probe()
    assert why is None and kernel is not None, why
    return kernel


@needs_amx
@pytest.mark.parametrize("n,k,rows,bias,residual", [
    (1280, 768, 16, False, False),  # the small preset's qkv at batch 16
    (64, 64, 1, True, True),  # one m-block, four n-blocks
    (48, 96, 5, False, True),  # a tail of n-blocks
    (80, 32, 37, True, False),  # a pair of m-blocks, then an odd one; 4 + 1 n-blocks
    (112, 64, 64, True, True),  # four m-blocks (the most rows it takes)
])
def test_amx_product_matches_torch(n, k, rows, bias, residual):
    """AmxLinear for at most MAX_ROWS rows: bit for bit torch's float32 product rounded once to bf16 on
    integer inputs (every sum exact), and within one bf16 rounding of float64 on random ones."""
    amx = amx_kernels()
    g = torch.Generator().manual_seed(3)
    ints = lambda *shape: torch.randint(-8, 9, shape, generator=g).bfloat16()  # noqa: E731
    w, x = ints(n, k), ints(rows, k + 3)[:, 3:]  # x's rows strided
    b, r = (ints(n) * 16 if bias else None), (ints(rows, n) * 16 if residual else None)
    lin = cpu_amx.AmxLinear(w, b, kernel=amx)
    assert lin.tiles is not None and lin.shape == (n, k) and lin.weight is None
    got = lin.add(x, r) if residual else lin(x)
    want = (x.float() @ w.float().T + (0 if b is None else b.float()) + (0 if r is None else r.float())).bfloat16()
    assert torch.equal(got, want)
    w, x = (torch.randn(n, k, generator=g) * 0.1).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    lin = cpu_amx.AmxLinear(w, b, kernel=amx)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert rel_err(lin(x), exact) < 8e-3


@needs_amx
def test_amx_linear_leaves_large_products_and_odd_shapes_to_onednn():
    """More than MAX_ROWS rows (a prefill) go to oneDNN's packed copy; a weight whose shape the tiles
    cannot take (K not a multiple of 32) has no tiles and always goes there."""
    amx = amx_kernels()
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(64, 96, generator=g) * 0.1).bfloat16()
    lin, onednn = cpu_amx.AmxLinear(w, kernel=amx), kernels_cpu.PackedLinear(w)
    x = torch.randn(cpu_amx.MAX_ROWS + 1, 96, generator=g).bfloat16()
    assert torch.equal(lin(x), onednn(x))
    odd = cpu_amx.AmxLinear(w[:, :80].contiguous(), kernel=amx)
    assert odd.tiles is None and torch.equal(odd(x[:3, :80]), kernels_cpu.PackedLinear(w[:, :80].contiguous())(x[:3, :80]))


@needs_amx
@pytest.mark.parametrize("bs,heads,kv_heads,d,lens", [
    (16, 6, 2, 64, [70, 1, 80]),
    (32, 12, 4, 64, [300, 17, 33, 200]),  # blocks of 32 tokens
    (16, 8, 1, 128, [5, 100]),  # head_dim 128: two passes of 64
    (16, 4, 4, 96, [31, 32, 33]),  # head_dim 96: a last pass of 32
    (16, 16, 1, 32, [300]),  # 16 query heads on one KV head
])
def test_amx_decode_attention_matches_plain(bs, heads, kv_heads, d, lens):
    """The AMX paged decode against the plain decode (gather + matmul), shuffled block tables, within
    bf16 rounding, and closer to float64 than the plain path (which rounds the probabilities)."""
    from adapters.reference.attention import decode_attention, length_mask

    amx = amx_kernels()
    g = torch.Generator().manual_seed(5)
    blocks = sum(-(-n // bs) for n in lens) + 2
    pool = KVPool(1, blocks, bs, kv_heads, d, "auto", torch.bfloat16, torch.device("cpu"))
    pool.prepare(set(range(blocks)))
    pool.k.copy_(torch.randn(pool.k.shape, generator=g).bfloat16())
    pool.v.copy_(torch.randn(pool.v.shape, generator=g).bfloat16())
    order, width, tables = torch.randperm(blocks, generator=g).tolist(), max(-(-n // bs) for n in lens), []
    for n in lens:
        mine, order = order[:-(-n // bs)], order[-(-n // bs):]
        tables.append(mine + mine[:1] * (width - len(mine)))
    tables, lens = torch.tensor(tables), torch.tensor(lens)
    q = (torch.randn(len(lens), heads, d, generator=g) * 2).bfloat16()
    kc, vc = pool.gather(0, tables, int(lens.max()))
    mask = length_mask(lens, kc.shape[2])
    assert amx.supports_pool(pool, torch.bfloat16)
    got = amx.decode(q, pool, 0, tables, lens)
    want = decode_attention(q, kc, vc, mask)
    exact = decode_attention(q.double(), kc.double(), vc.double(), mask.double())
    assert rel_err(got, want) < 2e-2 and rel_err(got, exact) <= rel_err(want, exact)


@needs_amx
@pytest.mark.parametrize("bug,fragment", [
    ("+ t[i + h] * widen(sin[i]));", "+ t[i] * widen(sin[i]));"),
    ("int64_t slot = (((int64_t)j * NB + block) * BS + pos[m] % BS) * hd;",
     "int64_t slot = (((int64_t)j * NB + block) * BS) * hd;"),  # the new K/V in the block's first slot
    ("static float silu(float g) { return g / (1.f + expf(-g)); }", "static float silu(float g) { return g; }"),
    ("product(h, E, M, wo, H * hd, D, bo, x, D, x, D);", "product(h, E, M, wo, H * hd, D, NULL, x, D, x, D);"),
    ("product(h, E, M, wo, H * hd, D, bo, x, D, x, D);", "product(h, E, M, wo, H * hd, D, bo, NULL, D, x, D);"),
    ("lens[m], scale, h + m * E", "lens[0], scale, h + m * E"),  # every row with the first row's length
    ("if (t + 1 < len) b =", "if (t + 1 < len && 0) b ="),  # odd tokens' values left out
    ("_tile_stored(3, acc, 64); epilogue(acc, rows, nb * 16 + 48",
     "_tile_stored(2, acc, 64); epilogue(acc, rows, nb * 16 + 48"),  # the fourth n-block's sums lost
    ("if (r) v += widen(r[n]);", ""),  # the residual left out of every product
])
def test_amx_probe_refuses_a_wrong_kernel(monkeypatch, tmp_path, bug, fragment):
    """RoPE without its half turn, the new K/V in the wrong slot, SiLU left out, the output bias or the
    residual left out, every row attending over the first row's length, half the values lost in the
    attention, a lost accumulator tile, no residual in the products: the probe catches each."""
    assert bug in cpu_amx.C_SOURCE
    monkeypatch.setenv("INFER_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_amx, "C_SOURCE", cpu_amx.C_SOURCE.replace(bug, fragment))
    kernel, why = cpu_amx.probe()
    assert kernel is None and ("disagrees" in why or "other keys" in why), why


def amx_spy(monkeypatch) -> list[int]:
    """Rows of every AmxDecodeLayer call (the kernel still runs)."""
    rows = []
    real_call = cpu_amx.AmxDecodeLayer.__call__
    monkeypatch.setattr(cpu_amx.AmxDecodeLayer, "__call__", lambda self, x, *a: rows.append(x.shape[0]) or real_call(self, x, *a))
    return rows


@needs_amx
@pytest.mark.parametrize("lengths", [[29], [12, 40, 7], [9 + i for i in range(17)]])
def test_engine_decodes_whole_layers_on_amx(tiny_ckpt, monkeypatch, lengths):
    """bf16 on an AMX CPU: every layer of every decode step runs in one AMX layer call (batch 1, 3 and
    17: two m-blocks), recorded in the details; tokens and logits agree with the same engine with
    the AMX kernels refused (each layer op by op on oneDNN and the fused C decode attention) while
    the tokens agree."""
    spec = ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="bfloat16", max_model_len=MAX_LEN)
    rows = amx_spy(monkeypatch)
    engine = ReferenceEngine()
    engine.load(spec, {})
    details = engine.kernels.details
    assert details["cpu_kind"] == "amx" and "amx tiles" in details["decode_layer"] and "amx tiles" in details["linear"]
    rows.clear()  # the probe's call at load
    steps, layers = 12, len(engine.model.layers)
    fast = run(engine, prompts=make_prompts(lengths), steps=steps)
    assert rows == [len(lengths)] * (layers * steps)
    engine.close()
    monkeypatch.setattr(cpu_amx, "probe", lambda: (None, "refused by the test"))
    slow = run(spec, prompts=make_prompts(lengths), steps=steps)
    assert slow[0].kernels.details["linear"] == "onednn-packed" and "decode_layer" not in slow[0].kernels.details
    slow[0].close()
    assert len(rows) == layers * steps  # not called again
    assert_bf16_engines_agree(fast, slow, len(lengths))


@needs_amx
def test_amx_layers_not_taken_where_they_do_not_apply(tiny_ckpt, monkeypatch):
    """Prefill steps, blocks of 8 tokens (the tiles read 16 rows of a block) and float32 never call the
    AMX layer; a qk-norm layer is refused by `takes` while the others are taken."""
    rows = amx_spy(monkeypatch)
    spec = ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="bfloat16", max_model_len=MAX_LEN)
    engine = ReferenceEngine()
    engine.load(spec, {"block_size": 8})
    rows.clear()
    run(engine, prompts=make_prompts([12, 20]), steps=3)
    assert rows == []
    model = engine.model
    assert all(cpu_amx.AmxDecodeLayer.takes(model, i) for i in range(len(model.layers)))
    model.layers[0] = dataclasses.replace(model.layers[0], q_norm=torch.ones(model.cfg.head_dim, dtype=torch.bfloat16))
    assert not cpu_amx.AmxDecodeLayer.takes(model, 0) and cpu_amx.AmxDecodeLayer.takes(model, 1)
    engine.close()
    engine = ReferenceEngine()
    engine.load(dataclasses.replace(spec, dtype="float32"), {})
    assert "amx" not in engine.kernels.details["linear"]
    rows.clear()
    run(engine, prompts=make_prompts([12, 20]), steps=3)
    assert rows == []
    engine.close()


# ---- greedy sampling on the CPU (cpu_decode.Greedy) ------------------------------------------

@needs_cc
def test_greedy_kernel_is_torch_argmax():
    """The first largest value of each row (integers: many ties), the first NaN, an all -inf row,
    the largest in the tail after the last 64, a row of equal values: torch.argmax's indices."""
    kernel, why = cpu_decode.greedy_probe()
    assert why is None, why
    g = torch.Generator().manual_seed(6)
    x = torch.randint(-50, 50, (7, 32001), generator=g).float()
    x[1, 20000], x[1, 3] = float("nan"), float("nan")
    x[2] = float("-inf")
    x[3, 32000] = 1e4
    x[4] = 7.0
    x[5, 31999] = float("inf")
    assert kernel(x) == x.argmax(dim=-1).tolist()
    assert kernel(x[:, :100]) == x[:, :100].argmax(dim=-1).tolist()


@needs_cc
def test_greedy_probe_refuses_a_wrong_kernel(monkeypatch, tmp_path):
    """The last largest value instead of the first: the probe catches it."""
    bug = "for (; i < n; i++) if (x[i] == mx) return i;"
    assert bug in cpu_decode.GREEDY_SOURCE
    monkeypatch.setenv("INFER_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_decode, "GREEDY_SOURCE", cpu_decode.GREEDY_SOURCE.replace(
        bug, "int64_t last = 0; for (i = 0; i < n; i++) if (x[i] == mx) last = i; return last;"))
    kernel, why = cpu_decode.greedy_probe()
    assert kernel is None and "disagrees" in why, why


# ---- the RMS norm of bf16 rows (cpu_layer.RowSteps) ----------------------------------------

@needs_cc
@pytest.mark.parametrize("rows,width", [(1, 768), (512, 768), (37, 197)])
def test_rms_norm_kernel_is_torchs_to_one_unit(rows, width):
    """F.rms_norm's bf16 values to one unit in the last place (the sum runs in another order), rows
    strided or not; a model's bf16 prefill calls it for every 2-D norm (a spy) and still agrees with
    kernels=plain (the engine tests above compare whole runs)."""
    kernel, why = cpu_layer.rows_probe()
    assert why is None, why
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(rows, width + 5, generator=g) * 3).bfloat16()[:, 5:]
    w = torch.randn(width, generator=g).bfloat16()
    got, want = kernel.rms_norm(x, w, 1e-5).float(), F.rms_norm(x, (width,), w, 1e-5).float()
    assert ((got - want).abs() <= want.abs() * 2.0 ** -7).all()
    assert (got != want).float().mean() < 0.01  # almost all bit for bit


@needs_cc
def test_rms_norm_kernel_runs_the_norms_of_a_bf16_prefill(tiny_ckpt, monkeypatch):
    calls = []
    real = cpu_layer.RowSteps.rms_norm
    monkeypatch.setattr(cpu_layer.RowSteps, "rms_norm", lambda self, x, *a: calls.append(x.shape[0]) or real(self, x, *a))
    spec = ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="bfloat16", max_model_len=MAX_LEN)
    engine = ReferenceEngine()
    engine.load(spec, {})
    assert engine.kernels.details["rms_norm"].startswith("C kernel") and engine.model.steps is not None
    calls.clear()
    engine.prefill(make_prompts([30]))
    layers = len(engine.model.layers)
    assert calls == [30] * (2 * layers - 1) + [1, 1]  # the last layer's MLP and the final norm: the sampled row
    engine.close()


@needs_cc
def test_rms_norm_probe_refuses_a_wrong_kernel(monkeypatch, tmp_path):
    bug = "o[i] = round_bf16(widen(xt[i]) * r * widen(w[i]));"
    assert bug in cpu_layer.ROWS_SOURCE
    monkeypatch.setenv("INFER_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_layer, "ROWS_SOURCE", cpu_layer.ROWS_SOURCE.replace(bug, "o[i] = round_bf16(widen(xt[i]) * r);"))
    kernel, why = cpu_layer.rows_probe()
    assert kernel is None and "disagrees" in why, why


# ---- the fused CPU decode kernel (cpu_decode.py) -----------------------------------------

@pytest.mark.skipif(not HAVE_CC, reason="no C compiler here: the engine uses the plain decode path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_decode_builds_and_is_chosen(dtype):
    kernel, why = cpu_decode.probe(dtype)
    assert why is None and kernel is not None
    details = kernels.select(torch.device("cpu"), dtype, EngineConfig()).details
    if dtype == torch.bfloat16 and HAVE_AMX:  # AMX tiles where the pool suits them, else this kernel
        assert details["decode_attention"].startswith("amx tiles") and "fused C kernel" in details["decode_attention"]
    else:
        assert details["decode_attention"].startswith("fused C kernel")
    assert kernels.select(torch.device("cpu"), dtype, EngineConfig(kv_dtype="int8")).details[
        "decode_fallback_reason"] == "kv_dtype=int8"


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler here")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bs,heads,kv_heads,d,lens", [
    (16, 12, 4, 64, (290, 1, 17)),  # the small preset's shape
    (4, 4, 4, 40, (9, 30, 3)),  # MHA, tiny blocks, head_dim not a multiple of 16
    (128, 8, 1, 128, (128, 70, 1)),  # one KV head (G = 8), a block of more than a chunk
    (300, 6, 2, 32, (300, 299, 64)),  # a contiguous region: one block of max_model_len
])
def test_fused_cpu_decode_matches_paged_torch(dtype, tol, bs, heads, kv_heads, d, lens):
    kernel, why = cpu_decode.probe(dtype)
    assert why is None
    g = torch.Generator().manual_seed(1)
    n = -(-max(lens) // bs)
    nb = 3 * n + 2
    pool = KVPool(2, nb, bs, kv_heads, d, "auto", dtype, torch.device("cpu"))
    pool.prepare(set(range(nb)))
    pool.k.copy_(torch.randn(pool.k.shape, generator=g).to(dtype))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g).to(dtype))
    tables = torch.stack([torch.randperm(nb, generator=g)[:n] for _ in lens])
    lens = torch.tensor(lens)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, d, generator=g).to(dtype)
    q = qkv[:, :heads]  # a strided view, as the model hands it over
    want = paged_decode_torch(q, pool, 1, tables, lens).float()
    got = kernel(q, pool, 1, tables, lens).float()
    assert rel_err(got, want) < tol


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler here")
def test_loading_the_fused_kernel_keeps_denormals(tmp_path):
    """The kernel is built with -ffast-math; linking it so would set flush-to-zero for the whole
    process at load (gcc's crtfastmath), changing every float op of torch and numpy after it."""
    code = textwrap.dedent("""
        import torch
        from adapters.reference import cpu_decode
        tiny = torch.tensor([1e-40], dtype=torch.float32)
        assert (tiny * 1.0).item() != 0.0
        cpu_decode.build()
        print((tiny * 1.0).item())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parent.parent, env=dict(os.environ, INFER_BENCH_CACHE=str(tmp_path)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.strip()) != 0.0, "loading the kernel flushed denormals to zero"


def test_fused_cpu_decode_falls_back_when_it_cannot_build(spec, plain, monkeypatch):
    def no_compiler():
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    monkeypatch.setattr(cpu_decode, "build", no_compiler)
    engine, pre, dec = run(spec)
    details = engine.kernels.details
    assert details["decode_attention"].startswith("plain")
    assert "no C compiler" in details["decode_fallback_reason"]
    assert_same((engine, pre, dec), plain)
    engine.close()


# ---- the CPU prefill attention (kernels.CpuStepAttention: SDPA) ---------------------------

CPU_MODES = {
    "paged": {},
    "paged-block4": {"block_size": 4},
    "contiguous": {"kv_layout": "contiguous"},
    "none": {"kv_cache": "none"},
    "chunked-prefill": {"max_num_batched_tokens": 7, "block_size": 4},
}


@pytest.mark.parametrize("slices", ["whole", "row-slices"])
@pytest.mark.parametrize("mode", CPU_MODES)
def test_cpu_sdpa_prefill_matches_plain(spec, plain, monkeypatch, mode, slices):
    """Fresh chunks in one causal SDPA call; chunks after a cached context (chunked prefill) one
    row slice at a time under the plain path's masks ("row-slices": a score budget small enough
    for slices of 1-3 rows)."""
    if slices == "row-slices":
        real = kernels.select

        def small_budget(device, dtype, cfg):
            chosen = real(device, dtype, cfg)
            chosen.attention = partial(chosen.attention, score_budget=256)
            return chosen
        monkeypatch.setattr(kernels, "select", small_budget)
    engine, pre, dec = run(spec, CPU_MODES[mode])
    assert engine.kernels.details["prefill_attention"].startswith("sdpa")
    assert_same((engine, pre, dec), plain)
    engine.close()


def test_cpu_sdpa_prefill_after_a_cached_prefix(spec):
    base = make_prompts([48], seed=1)[0]
    prompts = [base[:40] + [7, 8, 9], base[:33] + [5], base + [11]]
    results = []
    for options in ({"kernels": "plain", "block_size": 4}, {"block_size": 4}):
        engine = ReferenceEngine()
        engine.load(spec, options)
        engine.prefill([base]), engine.release()
        results.append(run(engine, prompts=prompts))
        assert engine.kv_cache_info().prefix_cache_hits > 0
        engine.close()
    assert_same(*results)


# ---- the CUDA path's attention, on a CPU ---------------------------------------------------

def cuda_kernels_on_cpu(monkeypatch, decode_fn=paged_decode_torch):
    """kernels.select returns the CUDA path's attention for a CPU (no graphs, plain linears)."""
    chosen = kernels.Kernels("cuda-on-cpu", Linear, None, partial(CudaStepAttention, decode_fn=decode_fn),
                             details={"kernels": "cuda-on-cpu"})
    monkeypatch.setattr(kernels, "select", lambda device, dtype, cfg: chosen)


MODES = {
    "paged": {},
    "paged-block4": {"block_size": 4},
    "contiguous": {"kv_layout": "contiguous"},
    "none": {"kv_cache": "none"},
    "chunked-prefill": {"max_num_batched_tokens": 7, "block_size": 4},
}


@pytest.mark.parametrize("mode", MODES)
def test_cuda_attention_matches_plain(spec, plain, monkeypatch, mode):
    """SDPA prefill (fresh groups with is_causal; after a cached prefix or a chunk, a lower-right
    mask over the pool) and the block-table decode compute what the plain path computes."""
    cuda_kernels_on_cpu(monkeypatch)
    engine, pre, dec = run(spec, MODES[mode])
    assert engine.kernels.name == "cuda-on-cpu"
    assert_same((engine, pre, dec), plain)
    engine.close()


def test_cuda_attention_after_a_cached_prefix(spec, monkeypatch):
    base = make_prompts([48], seed=1)[0]
    prompts = [base[:40] + [7, 8, 9], base[:33] + [5], base + [11]]
    results = []
    for use_cuda in (False, True):
        if use_cuda:
            cuda_kernels_on_cpu(monkeypatch)
        engine = ReferenceEngine()
        engine.load(spec, {"block_size": 4})
        engine.prefill([base]), engine.release()
        results.append(run(engine, prompts=prompts))
        assert engine.kv_cache_info().prefix_cache_hits > 0
        engine.close()
    assert_same(*results)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_paged_decode_torch_is_the_plain_decode(kv_dtype):
    """The block-table-driven PyTorch decode (the Triton kernel's reference) against a direct,
    token-by-token reading of each sequence's blocks."""
    g = torch.Generator().manual_seed(0)
    pool = KVPool(2, 12, 4, 2, 16, kv_dtype, torch.float32, torch.device("cpu"))
    pool.prepare(set(range(12)))
    blocks = torch.arange(12).repeat_interleave(4)
    rows = pool.rows(blocks, torch.arange(4).repeat(12))
    k, v = torch.randn(48, 2, 16, generator=g), torch.randn(48, 2, 16, generator=g)
    pool.write(1, rows, k, v)
    tables = torch.tensor([[7, 2, 9, 0], [3, 3, 3, 3], [11, 10, 1, 5]])
    lens = torch.tensor([13, 2, 16])
    q = torch.randn(3, 6, 16, generator=g)
    got = paged_decode_torch(q, pool, 1, tables, lens)
    kd, vd = pool.gather(1, torch.arange(12)[None], 48)  # every slot, dequantised: [kv, 1, 48, d]
    for b in range(3):
        slots = [int(tables[b, p // 4]) * 4 + p % 4 for p in range(int(lens[b]))]
        kb, vb = kd[:, 0, slots], vd[:, 0, slots]  # [kv, len, d]
        qb = q[b].view(2, 3, 16)
        p = (qb @ kb.transpose(-1, -2) / 4.0).softmax(-1)
        want = (p @ vb).reshape(-1)
        assert rel_err(got[b], want) < 1e-5


TRITON_CHECK = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {repo!r})
    from adapters.reference.kv_cache import KVPool
    from adapters.reference.kernels_cuda import paged_decode_torch, paged_decode_triton
    g = torch.Generator().manual_seed(0)
    worst = {{}}
    for kv_dtype, dtype, bs, heads, kv_heads, d in (("auto", torch.float32, 16, 8, 2, 64),
                                                     ("auto", torch.float32, 4, 4, 4, 32),
                                                     ("int8", torch.float32, 16, 6, 2, 48),
                                                     ("auto", torch.float16, 16, 8, 2, 64)):
        pool = KVPool(1, 9, bs, kv_heads, d, kv_dtype, dtype, torch.device("cpu"), scratch_blocks=1)
        pool.prepare(set(range(9)))
        n = 9 * bs
        rows = pool.rows(torch.arange(9).repeat_interleave(bs), torch.arange(bs).repeat(9))
        pool.write(0, rows, torch.randn(n, kv_heads, d, generator=g).to(dtype),
                   torch.randn(n, kv_heads, d, generator=g).to(dtype))
        tables = torch.stack([torch.randperm(9, generator=g)[:6] for _ in range(3)])
        lens = torch.tensor([6 * bs, 1, 2 * bs + 3])
        q = torch.randn(3, heads + 2 * kv_heads, d, generator=g).to(dtype)[:, :heads]  # strided, as in the model
        want = paged_decode_torch(q, pool, 0, tables, lens).float()
        for splits in (1, 3):
            got = paged_decode_triton(q, pool, 0, tables.to(torch.int32), lens.to(torch.int32), splits=splits).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            key = f"{{kv_dtype}}-{{dtype}}-bs{{bs}}"
            worst[key] = max(worst.get(key, 0.0), err)
    print(worst)
    assert all(e < (2e-2 if "float16" in k else 1e-5) for k, e in worst.items()), worst

    # the whole engine with the CUDA path's kernels (SDPA prefill, Triton decode) on this CPU
    from adapters.base import ModelSpec
    from adapters.reference import kernels, kernels_cuda
    from adapters.reference.config import EngineConfig
    from adapters.reference.engine import ReferenceEngine
    spec = ModelSpec(path={ckpt!r}, name="tiny", dtype="float32", max_model_len=64)
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 30)]
    out = {{}}
    for name in ("plain", "triton"):
        if name == "triton":
            fields = kernels_cuda.select(torch.device("cpu"), torch.float32, EngineConfig())
            assert fields["details"]["decode_attention"] == "triton paged", fields["details"]
            fields["decode_graphs"] = False
            kernels.select = lambda device, dtype, cfg: kernels.Kernels(**fields)
        e = ReferenceEngine()
        e.load(spec, {{"block_size": 4, "kernels": "plain" if name == "plain" else "auto"}})
        pre = e.prefill(prompts, return_logits=True)
        dec = e.decode(4, return_logits=True)
        out[name] = (pre, dec)
        e.close()
    (pa, da), (pb, db) = out["plain"], out["triton"]
    assert pa.first_tokens == pb.first_tokens and da.tokens == db.tokens
    errs = [((x - y).abs().max() / y.abs().max()).item() for x, y in zip([pa.logits] + da.logits, [pb.logits] + db.logits)]
    assert max(errs) < 1e-4, errs
""")


@pytest.mark.slow
def test_triton_decode_kernel_under_the_interpreter(tiny_ckpt):
    """The Triton kernel's math on a CPU (Triton's interpreter), against paged_decode_torch:
    block sizes below and at a tile, GQA and MHA, a head_dim that is not a power of two, int8,
    fp16, and context splits; then the engine with the CUDA path's kernels (SDPA prefill, Triton
    decode) against the plain path. (The interpreter's tl.dot gives wrong bf16 products, and fp8
    needs a GPU: scripts/gpu_check.py runs both there.)"""
    pytest.importorskip("triton", reason="Triton is not installed here (pip install triton)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK.format(repo=str(REPO), ckpt=str(tiny_ckpt))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


# ---- CUDA graphs: the bookkeeping, with a stand-in for the graph ----------------------------

class FakeGraphBackend:
    """A stand-in for CudaGraphBackend on a CPU: `capture` runs the step once and keeps the
    function; `replay` runs it again. Static buffers, padding and bucket choice are exercised as
    on a GPU; nothing is recorded."""

    def __init__(self):
        self.captured, self.replayed = [], 0

    def capture(self, fn):
        fn()
        self.captured.append(fn)
        return fn

    def replay(self, fn):
        self.replayed += 1
        fn()


def test_buckets():
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(20) == (1, 2, 4, 8, 16, 20)
    assert buckets_up_to(10_000)[-1] == BUCKETS[-1] == 256
    b = buckets_up_to(64)
    assert [bucket_for(n, b) for n in (1, 3, 5, 9, 17, 63, 64, 65)] == [1, 4, 8, 16, 24, 64, 64, None]


def graphed_engine(spec, options=None, max_batch=8):
    """A CPU engine whose pure decode steps go through DecodeGraphs with FakeGraphBackend."""
    engine = ReferenceEngine()
    engine.load(spec, options or {})
    cfg, mcfg = engine.cfg, engine.model.cfg
    engine.pool = KVPool(mcfg.num_layers, engine.pool.num_blocks, engine.block_size, mcfg.num_kv_heads,
                         mcfg.head_dim, cfg.kv_dtype, engine.model.dtype, engine.device, scratch_blocks=1)
    backend = FakeGraphBackend()
    engine.graphs = DecodeGraphs(engine.model, engine.pool, paged_decode_torch, max_batch, spec.max_model_len, backend)
    engine.graphs.capture()
    engine.runner = type(engine.runner)(engine.model, engine.pool, engine.runner.attention, engine.graphs)
    return engine, backend


@pytest.mark.parametrize("options", [{}, {"block_size": 4}, {"kv_dtype": "int8"}])
def test_graphed_decode_matches_eager(spec, plain, options):
    engine, backend = graphed_engine(spec, options)
    assert engine.graphs.buckets == (1, 2, 4, 8) and len(backend.captured) == 4  # each captured once
    prompts = make_prompts(LENGTHS)
    pre = engine.prefill(prompts, return_logits=True)
    dec = engine.decode(STEPS, return_logits=True)
    stats = engine.kv_cache_info().extra["cuda_graphs"]
    assert stats["replays"] == {4: STEPS} and stats["padded_rows"] == 0  # 4 sequences: bucket 4
    assert backend.replayed == STEPS
    if options.get("kv_dtype") is None:
        assert_same((engine, pre, dec), plain)
    else:  # the same quantised numbers as the eager engine
        eager, epre, edec = run(spec, options)
        assert_same((engine, pre, dec), (eager, epre, edec))
        eager.close()
    engine.close()


def test_graph_padding_rows_stay_in_the_scratch_block(spec, plain):
    """3 sequences replay bucket 4: the padded row writes only into the scratch block, and the
    real rows' results are those of the eager engine."""
    engine, _ = graphed_engine(spec, {"block_size": 4})
    pool = engine.pool
    prompts = make_prompts(LENGTHS[:3])
    pre = engine.prefill(prompts, return_logits=True)
    owned = {b for s in engine._live for b in s.block_table}
    free = [b for b in range(pool.num_blocks) if b not in owned]
    before = pool.k[:, :, free].clone()
    pool.k[:, :, pool.scratch_block] = 7.0  # a sentinel: the padded row overwrites its slot 0 only
    dec = engine.decode(6, return_logits=True)
    stats = engine.graphs.stats()
    assert stats["replays"] == {4: 6} and stats["padded_rows"] == 6
    owned_now = {b for s in engine._live for b in s.block_table}
    untouched = [i for i, b in enumerate(free) if b not in owned_now]
    assert torch.equal(pool.k[:, :, free][:, :, untouched], before[:, :, untouched])
    scratch = pool.k[:, :, pool.scratch_block]  # [layers, kv_heads, block_size, d]
    assert (scratch[:, :, 0] != 7.0).all() and (scratch[:, :, 1:] == 7.0).all()
    eager, epre, edec = run(spec, {"block_size": 4}, prompts=prompts, steps=6)
    assert_same((engine, pre, dec), (eager, epre, edec))
    eager.close(), engine.close()


def test_graphs_skip_steps_they_cannot_take(spec):
    """Prefill chunks, mixed steps and batches above the largest bucket run eagerly."""
    engine, backend = graphed_engine(spec, {"block_size": 4}, max_batch=2)
    prompts = make_prompts((6, 7, 8), seed=2)
    requests = [Request(f"r{i}", p, 5) for i, p in enumerate(prompts)]
    events = list(engine.serve(requests, now_ns()))
    assert len(events) == 15
    replayed = engine.graphs.stats()["replays"]
    assert backend.replayed == sum(replayed.values()) and set(replayed) <= {1, 2}
    assert sum(replayed.values()) < 4 * 3  # the 3-sequence decode steps ran eagerly
    eager = ReferenceEngine()
    eager.load(spec, {"block_size": 4})
    want = sorted((e.request_id, e.index, e.token_id) for e in eager.serve(requests, now_ns()))
    assert sorted((e.request_id, e.index, e.token_id) for e in events) == want
    eager.close(), engine.close()


def test_graphs_fits_rules(spec):
    engine, _ = graphed_engine(spec, {"block_size": 4}, max_batch=4)
    engine.prefill(make_prompts((10, 11)))
    g, seqs = engine.graphs, engine._live
    decode = [Chunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs]
    assert g.fits(decode)
    assert not g.fits([Chunk(seqs[0], 0, seqs[0].num_tokens)])  # a prefill chunk
    assert not g.fits(decode * 3)  # 6 > the largest bucket (4)
    seqs[0].score_from = 3
    assert not g.fits(decode)
    seqs[0].score_from = None
    assert not g.fits([])
    engine.close()


# ---- GPU pool sizing -----------------------------------------------------------------------

def test_gpu_memory_utilization_budget(monkeypatch, tiny_ckpt):
    cfg, mcfg = EngineConfig(), ModelConfig.from_dir(tiny_ckpt)
    reserve = activation_reserve(cfg, mcfg, torch.bfloat16)
    total = 100 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - (20 << 30), total))
    budget, source, info = engine_module._cuda_kv_budget(torch.device("cuda"), cfg, mcfg, torch.bfloat16)
    assert budget == int(total * 0.9) - (20 << 30) - reserve  # of TOTAL memory, minus what is in use
    assert "gpu_memory_utilization=0.9" in source and info["used_before_pool_bytes"] == 20 << 30
    cfg.gpu_memory_utilization = 0.2  # 20 GiB of 100 are in use already: nothing left
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.2.*already in use.*Raise it above"):
        engine_module._cuda_kv_budget(torch.device("cuda"), cfg, mcfg, torch.bfloat16)


def test_gpu_budget_counts_the_allocators_cached_free_memory_as_free(monkeypatch, tiny_ckpt):
    """An engine closed in this process leaves its pool in torch's cache: the driver reports it
    in use, but the next pool reuses it (scripts/gpu_check.py's second engine was refused)."""
    cfg, mcfg = EngineConfig(), ModelConfig.from_dir(tiny_ckpt)
    reserve = activation_reserve(cfg, mcfg, torch.bfloat16)
    total, cached = 100 << 30, 70 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - cached - (1 << 30), total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: cached + (1 << 30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 30)  # the new weights
    budget, _, info = engine_module._cuda_kv_budget(torch.device("cuda"), cfg, mcfg, torch.bfloat16)
    assert info["used_before_pool_bytes"] == 1 << 30
    assert budget == int(total * 0.9) - (1 << 30) - reserve


def test_gpu_memory_utilization_option_is_checked(spec):
    problems = ReferenceEngine.check_options({"gpu_memory_utilization": 0}, spec)
    assert problems and "gpu_memory_utilization" in problems[0]
    problems = ReferenceEngine.check_options({"gpu_memory_fraction": 0.5}, spec)
    assert problems and "unknown option" in problems[0] and "gpu_memory_utilization" in problems[0]


# ---- on a real GPU ---------------------------------------------------------------------------

CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device here")
def test_cuda_engine_matches_transformers_in_fp32(tiny_ckpt):
    from adapters.hf import HFEngine

    spec = ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="float32", device="cuda", max_model_len=MAX_LEN,
                     max_batch_size=4)
    hf = HFEngine()
    hf.load(spec, {})
    want = (hf, hf.prefill(make_prompts(LENGTHS), return_logits=True), hf.decode(STEPS, return_logits=True))
    hf.close()
    engine, pre, dec = run(spec, {"max_num_seqs": 8})
    details = engine.kernels.details
    assert details["kernels"] == "cuda" and details["cuda_graphs"]
    assert engine.graphs.stats()["replays"], "decode steps did not replay CUDA graphs"
    assert_same((engine, pre.__class__(pre.first_tokens, 0, 0, pre.logits.cpu()),
                 dec.__class__(dec.tokens, dec.steps, [x.cpu() for x in dec.logits])),
                (hf, want[1].__class__(want[1].first_tokens, 0, 0, want[1].logits.cpu()),
                 want[2].__class__(want[2].tokens, want[2].steps, [x.cpu() for x in want[2].logits])))
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device here")
@pytest.mark.parametrize("kv_dtype,dtype", [("auto", torch.bfloat16), ("auto", torch.float32), ("int8", torch.bfloat16)])
def test_triton_decode_on_the_gpu(kv_dtype, dtype):
    pytest.importorskip("triton", reason="Triton is not installed here")
    from adapters.reference.kernels_cuda import paged_decode_triton

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    pool = KVPool(1, 40, 16, 8, 128, kv_dtype, dtype, dev, scratch_blocks=1)
    rows = pool.rows(torch.arange(40, device=dev).repeat_interleave(16), torch.arange(16, device=dev).repeat(40))
    pool.write(0, rows, torch.randn(640, 8, 128, generator=g, device=dev, dtype=dtype),
               torch.randn(640, 8, 128, generator=g, device=dev, dtype=dtype))
    tables = torch.stack([torch.randperm(40, device=dev)[:20] for _ in range(4)])
    lens = torch.tensor([320, 1, 33, 200], device=dev)
    q = torch.randn(4, 48, 128, generator=g, device=dev, dtype=dtype)[:, :32]
    want = paged_decode_torch(q, pool, 0, tables, lens)
    for splits in (1, 5):
        got = paged_decode_triton(q, pool, 0, tables, lens, splits=splits)
        assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)

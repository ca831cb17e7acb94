"""CPU fast path: matrix products on weights packed once for oneDNN.

torch.compile's CPU backend packs frozen weights into oneDNN's blocked layout at compile time;
this module does the same by hand, at load. A matrix product then reads the weight as it is
instead of reordering it on every call: for the small row counts of decode steps that was a
third faster on the `small` preset (bf16, 16 rows, AMD EPYC and Intel Xeon), and a residual add
is fused into the product (`PackedLinear.add`).

The ops are torch's *private* mkldnn ops. Each one sits behind exactly one function below, and
`probe()` calls every one of them on a tiny weight at load time and compares the result with
plain `F.linear`: if any is missing, has moved, or disagrees, the engine uses the plain path
(model.Linear) and records why (LoadInfo.details["kernels"]). tests/test_reference_kernels.py
fails loudly if the probe stops succeeding on the torch this project pins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 16  # oneDNN picks the packed layout for this many rows (a decode batch)


# ---- the private API: one function per op ------------------------------------------------

def _reorder_linear_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """torch.ops.mkldnn._reorder_linear_weight: the weight in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """torch.ops.mkldnn._linear_pointwise (the unary overload, no post-op): x @ W.T + b."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _linear_add(x: torch.Tensor, residual: torch.Tensor, packed: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """torch.ops.mkldnn._linear_pointwise.binary with "add": residual + x @ W.T + b."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")


def probe(dtype: torch.dtype) -> str | None:
    """None when every private op above works for `dtype` and agrees with F.linear; else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g).to(dtype)
    b = torch.randn(24, generator=g).to(dtype)
    x = torch.randn(5, 40, generator=g).to(dtype)
    r = torch.randn(5, 24, generator=g).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    try:
        packed = _reorder_linear_weight(w, PACK_BATCH_HINT)
        checks = {"_linear_pointwise": (_linear(x, packed, b), F.linear(x, w, b)),
                  "_linear_pointwise (no bias)": (_linear(x, packed, None), F.linear(x, w)),
                  "_linear_pointwise.binary add": (_linear_add(x, r, packed, b), r + F.linear(x, w, b))}
    except (RuntimeError, AttributeError, TypeError) as e:
        return f"torch.ops.mkldnn is unusable for {dtype} here ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    for name, (got, want) in checks.items():
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        if got.shape != want.shape or not err < tol:
            return f"torch.ops.mkldnn.{name} disagrees with F.linear for {dtype} (relative error {err:.2e})"
    return None


class PackedLinear:
    """model.Linear's interface (`__call__`, `add`, `shape`, `nbytes`) on a packed weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.bias, self.shape = bias, tuple(weight.shape)
        self.nbytes = weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())
        self.packed = _reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.weight = None  # the packed copy replaces it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.packed, self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T + b, the add fused into the product."""
        return _linear_add(x, residual, self.packed, self.bias)


# ---- bf16 weights on a CPU without bf16 arithmetic -----------------------------------------

WIDEN_ROWS = 2  # products of at least this many rows run in float32 (WidenedLinear)


class WidenedLinear:
    """model.Linear's interface for half-precision weights on a CPU whose oneDNN has no bf16 (or
    fp16) kernels (an AVX2-only CPU: no AVX-512, no avx_ne_convert; `probe` refuses the dtype).

    There torch's bf16 product is a generic loop, about 8x slower than float32 through oneDNN
    whatever the row count (AMD EPYC, AVX2 only, 2 cores: docs/reference-engine.md, "Prefill at
    the matrix limit"). So a product of `min_rows` rows or more (a prefill, a decode batch)
    widens its input to float32, multiplies by a float32 copy of the weight packed for oneDNN,
    and rounds the result once to the model's dtype: the same arithmetic as torch's bf16 product
    (float32 accumulation, one rounding), in another order. Fewer rows (a decode step at batch
    1) read the model's own weight: those products are bound by memory, and the half-precision
    weight is half the bytes. They go to `gemv` (cpu_gemv.HalfGemv, a C kernel that widens the
    bf16 weight in registers) when the engine's probe accepted it, else to torch's product.

    The cost is memory: the float32 copy beside the weight (3x the weights' bytes in all).
    `nbytes` counts the model's weight, what a small-batch decode step reads."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, min_rows: int = WIDEN_ROWS,
                 gemv=None):
        self.weight, self.bias, self.min_rows = weight, bias, min_rows
        self.shape = tuple(weight.shape)
        self.nbytes = weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())
        self.wide = PackedLinear(weight.float(), None if bias is None else bias.float())
        self.gemv = gemv if gemv is not None and gemv.supports(weight) else None

    def _gemv_takes(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        return (self.gemv is not None and x.dim() == 2 and x.dtype == self.weight.dtype
                and (residual is None or (residual.dtype == x.dtype and residual.shape == (x.shape[0], self.shape[0]))))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.min_rows:
            if self._gemv_takes(x):
                return self.gemv(x, self.weight, self.bias)
            return F.linear(x, self.weight, self.bias)
        return self.wide(x.float()).to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T + b (in float32, rounded once; by torch's bf16 product with two
        roundings for fewer than `min_rows` rows without the C kernel)."""
        if x.shape[0] < self.min_rows:
            if self._gemv_takes(x, residual):
                return self.gemv(x, self.weight, self.bias, residual)
            out = torch.addmm(residual, x, self.weight.t())
            return out if self.bias is None else out + self.bias
        return self.wide.add(x.float(), residual.float()).to(x.dtype)

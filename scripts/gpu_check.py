"""Every GPU check the issues ask for, in one short script (for a session that is lent a GPU).

    python scripts/gpu_check.py [OUT_DIR]

1. the reference engine and the transformers adapter on CUDA, fp32, tiny preset: greedy tokens
   of a batch of unequal prompts must be identical, and prefill logits agree within 1e-4;
2. the NVML memory sampler: samples at 100 Hz while a tensor is allocated on the device, and
   reports the process's device memory and torch's allocator peak;
3. a short sweep through the harness on CUDA (reference + hf, small preset, bf16) with its
   report, when hydra-core and plotly are importable.

It prints what it measured and exits non-zero if a check fails. Nothing here has run yet: the
sessions so far had no GPU (see the closing notes).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path


def check_engines(ckpt: Path) -> None:
    import torch

    from adapters.base import ModelSpec
    from adapters.hf import HFEngine
    from adapters.reference.engine import ReferenceEngine

    prompts = [[5 + i for i in range(n)] for n in (7, 16, 33, 64)]
    results = {}
    for cls in (ReferenceEngine, HFEngine):
        e = cls()
        e.load(ModelSpec(path=str(ckpt), name="tiny", dtype="float32", device="cuda", max_model_len=256,
                         max_batch_size=4, max_batch_tokens=256), {})
        pre = e.prefill(prompts, return_logits=True)
        dec = e.decode(31)
        results[cls.name] = (pre.logits, [[pre.first_tokens[b]] + [s[b] for s in dec.tokens] for b in range(4)],
                             pre.latency_s, sorted(dec.step_latencies_s)[15])
        e.close()
    (lr, tr, pr, sr), (lh, th, ph, sh) = results["reference"], results["hf"]
    rel = float((lr - lh).abs().max() / lh.abs().max())
    print(f"engines on CUDA: tokens identical={tr == th}, prefill logits max rel diff {rel:.2e}, "
          f"prefill ms ref {pr * 1e3:.2f} / hf {ph * 1e3:.2f}, median step ms ref {sr * 1e3:.2f} / hf {sh * 1e3:.2f}")
    assert tr == th and rel < 1e-4
    torch.cuda.empty_cache()


def check_sampler() -> None:
    import torch

    from harness.core.memory import MemorySampler
    s = MemorySampler(100, "cuda").start()
    x = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    time.sleep(1.0)
    r = s.stop()
    del x
    print(f"sampler: source={r.source} samples={r.samples} peak={r.peak_bytes / 2**20:.0f} MiB "
          f"device_peak={None if r.device_peak_used_bytes is None else r.device_peak_used_bytes / 2**20:.0f} MiB "
          f"torch_peak={r.torch_peak_allocated_bytes} overhead={r.overhead_frac:.4f} note={r.note}")
    assert r.source == "nvml" and r.peak_bytes >= 512 << 20


def check_sweep(out: Path) -> None:
    cmd = [sys.executable, "-m", "harness.cli", "engines=[reference,hf]", "model=small", "dtype=bfloat16",
           "device=cuda", "workload.batch_sizes=[1,16]", "workload.prompt_lens=[256,1024]", "workload.output_len=64",
           f"hydra.run.dir={out / 'sweep'}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0


def main() -> int:
    from harness.checkpoint import ensure_checkpoint
    from harness.core.presets import load_preset

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    ckpt = ensure_checkpoint(load_preset("tiny"), out / "models")
    failed = []
    for name, fn in (("engines", lambda: check_engines(ckpt)), ("sampler", check_sampler),
                     ("sweep", lambda: check_sweep(out))):
        try:
            fn()
        except Exception as e:  # report every check, then fail
            print(f"{name}: FAILED: {type(e).__name__}: {e}")
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

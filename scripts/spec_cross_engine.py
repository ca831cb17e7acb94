"""Cross-engine truth for speculative decoding with a draft model: the reference engine,
transformers (hf) and vLLM, at batch 1, the same target, draft, k and prompts, greedy drafting and verification. Each engine
decodes every prompt with and without speculation through its adapter's step API; the script
prints whether speculation changed any token (per engine), and per request the accepted tokens
both ways:

- from the steps: decode tokens - steps (every step emits its accepted draft tokens + 1), read
  from DecodeResult.emitted: a property of the two models once the settings are equal;
- from the engine's counters (Engine.spec_decode_stats before and after the request): vLLM counts
  a request's last step before it cuts the output at max_tokens, so its count may be higher there.

The settings are equal by construction: the same k on every engine, greedy drafting and greedy
verification, transformers' assistant on a constant schedule of k tokens with no confidence
threshold (adapters/hf.py), the draft's greedy tokens on all three.

    .venv/bin/python scripts/spec_cross_engine.py [--draft DIR | --noisy 0.5] [--target DIR]
        [--requests 12] [--prompt-len 128] [--output-len 64] [-k 4]

Target: the shipped tiny-trained (default). Draft: a checkpoint directory, or (--noisy S, the
default) tiny-trained with Gaussian noise of S x each weight matrix's own standard deviation added
(seed 0): a draft that shares the tokenizer and disagrees with the target now and then. Prompts:
the target's held-out code (heldout.npy). vLLM runs in its own environment
($INFER_BENCH_VLLM_PYTHON or .venv-vllm/bin/python).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # tests_support.noisy_draft: the draft the tests use too


def run_engine(engine: str, target: str, draft: str, k: int, prompts: list[list[int]], n: int) -> dict:
    """In this process: the engine without and with speculation, each prompt at batch 1."""
    from adapters.base import ModelSpec
    extra: dict = {}
    if engine == "hf":
        from adapters.hf import HFEngine as Engine
    elif engine == "reference":
        from adapters.reference.engine import ReferenceEngine as Engine
    else:
        from adapters.vllm.engine import VLLMEngine as Engine
        extra = {"block_size": 32, "kv_cache_memory_bytes": 64 << 20}
    longest = max(map(len, prompts)) + n + k + 1
    out = {}
    for method in ("none", "draft"):
        options = dict(extra)
        if method == "draft":
            options.update(speculative_method="draft", num_speculative_tokens=k, draft_model=draft)
        e = Engine()
        e.load(ModelSpec(path=target, name="target", dtype="float32", max_model_len=longest,
                         threads=len(os.sched_getaffinity(0))), options)
        rows = []
        try:
            for p in prompts:
                before = e.spec_decode_stats()
                pre = e.prefill([p], max_new_tokens=n)
                dec = e.decode(n - 1)
                e.release()
                after = e.spec_decode_stats()
                rows.append({"tokens": pre.first_tokens + [r[0] for r in dec.tokens],
                             "emitted": [r[0] for r in dec.emitted] if dec.emitted else None,
                             "counted": None if after is None else after.accepted_tokens - before.accepted_tokens})
        finally:
            e.close()
        out[method] = rows
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(REPO / "harness" / "shipped" / "tiny-trained"))
    ap.add_argument("--draft", default=None)
    ap.add_argument("--noisy", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # the vLLM side, in its environment
    ap.add_argument("--prompts", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        prompts = json.loads(Path(a.prompts).read_text())
        Path(a.out).write_text(json.dumps(run_engine(a.engine, a.target, a.draft, a.k, prompts, a.output_len)))
        return 0

    import numpy as np
    target = Path(a.target)
    held = np.load(target / "heldout.npy")
    step = (len(held) - a.prompt_len) // max(a.requests, 1)
    prompts = [held[i * step: i * step + a.prompt_len].tolist() for i in range(a.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        from tests_support import noisy_draft
        draft = a.draft or str(noisy_draft(target, tmp / "draft", a.noisy))
        (tmp / "prompts.json").write_text(json.dumps(prompts))
        vpy = os.environ.get("INFER_BENCH_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        subprocess.run([vpy, __file__, "--engine", "vllm", "--target", str(target), "--draft", draft, "-k", str(a.k),
                        "--output-len", str(a.output_len), "--prompts", str(tmp / "prompts.json"),
                        "--out", str(tmp / "vllm.json")], check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        print("vllm done", file=sys.stderr, flush=True)
        res = {"reference": run_engine("reference", str(target), draft, a.k, prompts, a.output_len)}
        print("reference done", file=sys.stderr, flush=True)
        res["hf"] = run_engine("hf", str(target), draft, a.k, prompts, a.output_len)
        res["vllm"] = json.loads((tmp / "vllm.json").read_text())
    print(f"target {target.name}, draft {'noisy x' + str(a.noisy) if not a.draft else a.draft}, k={a.k}, "
          f"{a.requests} requests of {a.prompt_len} -> {a.output_len} tokens, batch 1, fp32")
    for e, r in res.items():
        same = sum(x["tokens"] == y["tokens"] for x, y in zip(r["none"], r["draft"]))
        print(f"{e}: speculation left {same}/{len(prompts)} outputs unchanged")
    names = list(res)
    base = res[names[0]]["none"]
    for e in names[1:]:
        same = sum(x["tokens"] == y["tokens"] for x, y in zip(base, res[e]["none"]))
        print(f"{names[0]} and {e} without speculation: {same}/{len(prompts)} outputs identical")

    def accepted(row: dict) -> int:  # decode tokens - steps: what the request was given
        return sum(row["emitted"]) - len(row["emitted"])

    print("request  steps " + "/".join(names) + "  accepted from steps " + "/".join(names) + "  counted "
          + "/".join(names))
    same_steps = same_counts = same_counted = 0
    for i in range(len(prompts)):
        rows = [res[e]["draft"][i] for e in names]
        counts = [accepted(r) for r in rows]
        same_counts += len(set(counts)) == 1
        same_steps += all(r["emitted"] == rows[0]["emitted"] for r in rows)
        same_counted += len({r["counted"] for r in rows}) == 1
        print(f"{i:7d}  {'/'.join(str(len(r['emitted'])) for r in rows):>{len(names) * 3 + 6}}  "
              f"{'/'.join(map(str, counts)):>{len(names) * 4 + 16}}  {'/'.join(str(r['counted']) for r in rows)}")
    n = len(prompts)
    acc = sum(accepted(r) for r in res[names[0]]["draft"])
    print(f"identical accepted counts on {', '.join(names)}: {same_counts}/{n} ({same_counts / n:.0%}); identical "
          f"per-step emission: {same_steps}/{n}; identical counters: {same_counted}/{n}; {acc} of the "
          f"{n * (a.output_len - 1)} decode tokens were accepted draft tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())

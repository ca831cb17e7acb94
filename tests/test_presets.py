"""Model presets and their materialisation as Hugging Face checkpoints."""

import json
import subprocess
import sys

import pytest

from harness.core.presets import load_preset, preset_names, shape_from_hf_config

PUBLISHED = {  # layers, hidden, heads, kv heads (published configs)
    "llama-2-7b": (32, 4096, 32, 32), "llama-2-13b": (40, 5120, 40, 40), "llama-2-70b": (80, 8192, 64, 8),
    "llama-3-8b": (32, 4096, 32, 8), "llama-3-70b": (80, 8192, 64, 8), "mistral-7b": (32, 4096, 32, 8),
    "qwen2.5-7b": (28, 3584, 28, 4),
}


def test_all_presets_present():
    assert set(PUBLISHED) | {"tiny", "small"} <= set(preset_names())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes(name):
    s = load_preset(name)
    assert (s.num_hidden_layers, s.hidden_size, s.num_attention_heads, s.num_key_value_heads) == PUBLISHED[name]
    assert s.head_dim * s.num_attention_heads == s.hidden_size


def test_parameter_counts():
    assert 4.5e6 < load_preset("tiny").num_parameters() < 5.5e6
    assert 115e6 < load_preset("small").num_parameters() < 135e6
    assert 6.6e9 < load_preset("llama-2-7b").num_parameters() < 6.9e9  # 6.74 B
    assert 7.4e9 < load_preset("qwen2.5-7b").num_parameters() < 7.8e9  # 7.62 B


def test_materialised_checkpoint_loads(tiny_ckpt):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt)
    shape = load_preset("tiny")
    assert sum(p.numel() for p in model.parameters()) == shape.num_parameters()
    assert shape_from_hf_config(tiny_ckpt).num_key_value_heads == 4
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2 and len(tok) == shape.vocab_size
    ids = tok("w10 w11 w4095")["input_ids"]
    assert ids[-3:] == [10, 11, 4095]
    with torch.no_grad():
        assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, shape.vocab_size)


def test_seed_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    from harness.checkpoint import write_checkpoint
    tiny = load_preset("tiny")
    a = load_file(write_checkpoint(tiny, tmp_path / "a", seed=1) / "model.safetensors")
    b = load_file(write_checkpoint(tiny, tmp_path / "b", seed=1) / "model.safetensors")
    c = load_file(write_checkpoint(tiny, tmp_path / "c", seed=2) / "model.safetensors")
    k = "model.layers.0.self_attn.q_proj.weight"
    assert (a[k] == b[k]).all() and not (a[k] == c[k]).all()


def test_qwen_shape_config_roundtrip(tmp_path):
    from transformers import AutoConfig
    s = load_preset("qwen2.5-7b")
    d = s.hf_config_dict()
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    cfg.save_pretrained(tmp_path)
    back = shape_from_hf_config(tmp_path)
    assert back.attention_bias and back.num_key_value_heads == 4 and back.rope_theta == 1e6
    assert back.architecture == "qwen2"


def test_model_cli(tmp_path):
    out = tmp_path / "m"
    r = subprocess.run([sys.executable, "-m", "harness.model_cli", "--preset", "tiny", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 4
    r = subprocess.run([sys.executable, "-m", "harness.model_cli", "--preset", "tiny", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not empty" in r.stderr
    r = subprocess.run([sys.executable, "-m", "harness.model_cli", "--preset", "huge", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--preset huge" in r.stderr and "Traceback" not in r.stderr


READ_SHAPE = """
import json, sys
from dataclasses import asdict
from harness.core.presets import shape_from_hf_config
shape = shape_from_hf_config(sys.argv[1])
print(json.dumps({"shape": asdict(shape), "transformers": "transformers" in sys.modules}))
"""


def test_a_config_is_read_once_and_again_when_it_changes(tmp_path):
    """The shape of a checkpoint is kept after the first read (no transformers import on the next
    command); a changed config.json is read again."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = load_preset("tiny").hf_config_dict()
    (ckpt / "config.json").write_text(json.dumps(cfg))
    env = {**__import__("os").environ, "INFER_BENCH_CACHE": str(tmp_path / "cache")}

    def read():
        r = subprocess.run([sys.executable, "-c", READ_SHAPE, str(ckpt)], capture_output=True, text=True,
                           env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first, second = read(), read()
    assert first["transformers"] and not second["transformers"]
    assert first["shape"] == second["shape"] and second["shape"]["num_hidden_layers"] == cfg["num_hidden_layers"]
    (ckpt / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1}))
    third = read()
    assert third["transformers"] and third["shape"]["num_hidden_layers"] == cfg["num_hidden_layers"] + 1

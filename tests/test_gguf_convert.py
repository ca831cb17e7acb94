"""The GGUF converter (adapters/llamacpp/convert.py) without llama.cpp: the q/k permutation's
mathematics, what it writes (read back with gguf-py's reader), the tokenizer encodings, the cache,
and the reasons a checkpoint cannot be converted. Running the files in llama.cpp: tests/test_llamacpp.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from adapters.llamacpp import convert
from harness.checkpoint import SHIPPED_DIR, ensure_checkpoint
from harness.core.presets import load_preset, preset_names

gguf = pytest.importorskip("gguf")


def rope_halves(x: np.ndarray, pos: int, theta: float = 10000.0) -> np.ndarray:
    """Hugging Face's rotary embedding of one head's vector: dimension i pairs with i + d/2."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[: d // 2], x[d // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c])


def rope_pairs(x: np.ndarray, pos: int, theta: float = 10000.0) -> np.ndarray:
    """llama.cpp's NORM rotary embedding: dimension 2j pairs with 2j + 1."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2], out[1::2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("n_head,head_dim", [(4, 32), (2, 8)])
def test_permuted_projections_give_llama_cpp_the_same_attention_scores(n_head, head_dim):
    """Scores q·k with HF's weights and rotate-half RoPE equal those with the permuted weights and
    llama.cpp's adjacent-pair RoPE, for every head and pair of positions; unpermuted weights do not."""
    rng = np.random.default_rng(0)
    hidden = 16
    wq = rng.standard_normal((n_head * head_dim, hidden))
    wk = rng.standard_normal((n_head * head_dim, hidden))
    x1, x2 = rng.standard_normal(hidden), rng.standard_normal(hidden)
    pq, pk = convert.permute_qk(wq, n_head), convert.permute_qk(wk, n_head)
    worst_wrong = 0.0
    for h in range(n_head):
        sl = slice(h * head_dim, (h + 1) * head_dim)
        for p1, p2 in [(5, 2), (17, 0), (3, 3)]:
            ref = rope_halves((wq @ x1)[sl], p1) @ rope_halves((wk @ x2)[sl], p2)
            ours = rope_pairs((pq @ x1)[sl], p1) @ rope_pairs((pk @ x2)[sl], p2)
            assert ours == pytest.approx(ref, rel=1e-9, abs=1e-9)
            wrong = rope_pairs((wq @ x1)[sl], p1) @ rope_pairs((wk @ x2)[sl], p2)
            worst_wrong = max(worst_wrong, abs(wrong - ref))
    assert worst_wrong > 1e-3  # the permutation is needed: without it the scores differ


def read(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(path)
    kv = {}
    for f in r.fields.values():
        if not f.types:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.STRING:
                kv[f.name] = [bytes(f.parts[i]).decode() for i in f.data]
            else:
                kv[f.name] = [int(f.parts[i][0]) for i in f.data]
        elif f.types[0] == gguf.GGUFValueType.STRING:
            kv[f.name] = bytes(f.parts[f.data[0]]).decode()
        else:
            kv[f.name] = f.parts[f.data[0]].tolist()[0]
    tensors = {t.name: t for t in r.tensors}
    return kv, tensors


def test_tiny_trained_as_gguf_has_the_bpe_tokenizer_and_the_llama_keys(tmp_path):
    ckpt = SHIPPED_DIR / "tiny-trained"
    cfg = json.loads((ckpt / "config.json").read_text())
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    rec = convert.write_gguf(ckpt, tmp_path / "m.gguf", "f32")
    kv, tensors = read(tmp_path / "m.gguf")
    assert kv["general.architecture"] == "llama" and kv["tokenizer.ggml.model"] == "gpt2"
    assert kv["tokenizer.ggml.pre"] == "gpt-2"  # tokenizers' ByteLevel regex is llama.cpp's GPT-2 split
    assert kv["tokenizer.ggml.merges"][:3] == [" ".join(m) for m in tj["model"]["merges"][:3]]
    assert kv["tokenizer.ggml.tokens"][:4] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert kv["tokenizer.ggml.token_type"][:5] == [3, 3, 3, 3, 1]  # control, then normal
    assert kv["tokenizer.ggml.add_bos_token"] is False  # its post-processor adds nothing
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert kv["llama.rope.dimension_count"] == cfg["head_dim"] and kv["llama.attention.head_count_kv"] == 2
    assert kv["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"])
    assert "output.weight" in tensors and rec["qk_permuted"] and not rec["tied_embeddings"]
    from safetensors.numpy import load_file
    hf = load_file(ckpt / "model.safetensors")
    q = np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(hf["model.layers.0.self_attn.q_proj.weight"].shape)
    assert np.array_equal(q, convert.permute_qk(hf["model.layers.0.self_attn.q_proj.weight"], 4))
    v = np.asarray(tensors["blk.0.attn_v.weight"].data).reshape(hf["model.layers.0.self_attn.v_proj.weight"].shape)
    assert np.array_equal(v, hf["model.layers.0.self_attn.v_proj.weight"])


def test_tied_embeddings_leave_the_output_tensor_out(tmp_path):
    convert.write_gguf(SHIPPED_DIR / "tiny-trained-target", tmp_path / "m.gguf", "bf16")
    kv, tensors = read(tmp_path / "m.gguf")
    assert "output.weight" not in tensors and "token_embd.weight" in tensors
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # norms stay f32


@pytest.mark.parametrize("weights,bytes_per_32", [("q8_0", 34), ("q4_0", 18)])
def test_block_types_have_their_block_sizes(tmp_path, weights, bytes_per_32):
    convert.write_gguf(SHIPPED_DIR / "tiny-trained", tmp_path / "m.gguf", weights)
    _, tensors = read(tmp_path / "m.gguf")
    t = tensors["blk.0.ffn_down.weight"]  # 128 x 352
    assert t.n_bytes == 128 * 352 // 32 * bytes_per_32
    deq = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(128, 352)
    from safetensors.numpy import load_file
    orig = load_file(SHIPPED_DIR / "tiny-trained" / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    err = np.abs(deq - orig).max() / np.abs(orig).max()
    assert err < (0.01 if weights == "q8_0" else 0.15)


def test_word_level_presets_become_word_pieces_with_their_special_ids(tmp_path, tiny_ckpt):
    rec = convert.write_gguf(tiny_ckpt, tmp_path / "m.gguf", "f16")
    kv, _ = read(tmp_path / "m.gguf")
    assert kv["tokenizer.ggml.model"] == "bert"
    toks = kv["tokenizer.ggml.tokens"]
    assert toks[:4] == ["<pad>", "<s>", "</s>", "<unk>"] and toks[4] == "\u2581w4" and len(toks) == 4096
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"], kv["tokenizer.ggml.unknown_token_id"],
            kv["tokenizer.ggml.padding_token_id"]) == (1, 2, 3, 0)
    assert kv["tokenizer.ggml.add_bos_token"] is False and kv["tokenizer.ggml.add_sep_token"] is False
    assert kv["tokenizer.ggml.seperator_token_id"] == 2  # not llama.cpp's default 102, an ordinary word here
    assert rec["text_prompts"] is False


def bpe_checkpoint(tmp_path: Path, pre_tokenizer, normalizer=None) -> Path:
    """tiny-trained with its tokenizer's pre-tokenizer replaced."""
    d = tmp_path / "ckpt"
    shutil.copytree(SHIPPED_DIR / "tiny-trained", d)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["pre_tokenizer"], tj["normalizer"] = pre_tokenizer, normalizer
    (d / "tokenizer.json").write_text(json.dumps(tj))
    return d


def split_then_bytes(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}


def test_split_regexes_of_known_tokenizers_get_llama_cpp_pre_tokenizers(tmp_path):
    v = convert.read_vocabulary(bpe_checkpoint(tmp_path / "a", split_then_bytes(convert.QWEN2_SPLIT), {"type": "NFC"}), 4096)
    assert (v.model, v.pre) == ("gpt2", "qwen2")
    v = convert.read_vocabulary(bpe_checkpoint(tmp_path / "b", split_then_bytes(convert.LLAMA3_SPLIT)), 4096)
    assert v.pre == "llama-bpe"


@pytest.mark.parametrize("pre", [
    {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True},  # a space llama.cpp would not add
    {"type": "Metaspace", "replacement": "\u2581"},
    split_then_bytes(r"\S+"),
])
def test_a_pre_tokenizer_llama_cpp_cannot_match_is_a_reason_not_a_crash(tmp_path, pre):
    d = bpe_checkpoint(tmp_path, pre)
    why = convert.checkpoint_problem(d)
    assert why is not None and "pre-tokenizer" in why
    with pytest.raises(convert.ConversionError, match="pre-tokenizer"):
        convert.write_gguf(d, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists() or (tmp_path / "m.gguf").stat().st_size == 0


def test_gguf_cache_is_keyed_by_the_checkpoint_and_the_weights(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(SHIPPED_DIR / "tiny-trained", d)
    a = convert.ensure_gguf(d, tmp_path / "cache", "q8_0")
    b = convert.ensure_gguf(d, tmp_path / "cache", "q8_0")
    assert not a.cached and b.cached and a.path == b.path and a.record["weights"] == "q8_0"
    c = convert.ensure_gguf(d, tmp_path / "cache", "f16")
    assert c.path != a.path
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (d / "config.json").write_text(json.dumps(cfg))
    e = convert.ensure_gguf(d, tmp_path / "cache", "q8_0")
    assert not e.cached and e.path != a.path
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").glob("*.gguf")) == sorted(
        p.name for p in (a.path, c.path, e.path))  # no half-written file beside them


# families the converter writes (llama, mistral without a window, qwen2, qwen3) and every other preset's reason
CONVERTIBLE = {"llama", "mistral", "qwen2", "qwen3"}


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_is_convertible_or_says_why(name):
    shape = load_preset(name)
    why = convert.unsupported_reason(shape)
    plain = (shape.architecture in CONVERTIBLE and not shape.num_experts and set(shape.layer_kinds()) == {"full"}
             and not shape.attention_sinks and (not shape.qk_norm or shape.architecture == "qwen3")
             and (shape.rope_scaling or {}).get("rope_type") in (None, "default"))
    assert (why is None) == plain, (name, why)
    if why is not None:
        assert why.startswith("infer-bench's GGUF converter writes") and "lacks" in why


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-gemma3", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-qwen3-next"])
def test_an_unsupported_family_checkpoint_raises_conversion_error(tmp_path, family_ckpts, name):
    with pytest.raises(convert.ConversionError, match="cannot be converted for llama.cpp"):
        convert.write_gguf(family_ckpts[name], tmp_path / "m.gguf")


def test_infer_bench_model_writes_a_gguf_or_exits_2_naming_the_option(tmp_path, capsys):
    from harness.model_cli import main
    cache = tmp_path / "cache"
    out = tmp_path / "copy.gguf"
    assert main(["--gguf", "--path", str(SHIPPED_DIR / "tiny-trained"), "--weights", "q4_0", "--model-cache-dir",
                 str(cache), "--out", str(out)]) == 0
    assert out.is_file() and len(list((cache / "gguf").glob("tiny-trained-q4_0-*.gguf"))) == 1
    assert main(["--gguf", "--preset", "tiny-gemma3", "--model-cache-dir", str(cache)]) == 2
    assert "--preset tiny-gemma3" in capsys.readouterr().err and not list(cache.glob("tiny-gemma3*"))
    assert main(["--gguf", "--path", str(SHIPPED_DIR / "tiny-trained"), "--weights", "q5_k"]) == 2
    assert "--weights q5_k" in capsys.readouterr().err


def test_a_gguf_option_that_is_no_gguf_exits_2_naming_it(tmp_path):
    from harness.cli import check_jobs
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    problems = check_jobs(["engines=[llamacpp]", "model=tiny-trained", f"engine_options.llamacpp.gguf={bad}"])
    assert any(p.startswith(f"engine_options.llamacpp.gguf={bad}: not a GGUF file") for p in problems), problems
    truncated = tmp_path / "cut.gguf"
    convert.write_gguf(SHIPPED_DIR / "tiny-trained", tmp_path / "m.gguf", "q8_0")
    truncated.write_bytes((tmp_path / "m.gguf").read_bytes()[:5000])
    problems = check_jobs(["engines=[llamacpp]", "model=tiny-trained", f"engine_options.llamacpp.gguf={truncated}"])
    assert any("gguf-py cannot read it" in p for p in problems), problems
    problems = check_jobs(["engines=[llamacpp]", "model=tiny-trained", f"engine_options.llamacpp.gguf={tmp_path / 'm.gguf'}"])
    assert not any("engine_options.llamacpp.gguf" in p for p in problems), problems  # an intact file passes
    problems = check_jobs(["engines=[llamacpp]", "model=tiny-trained", "engine_options.llamacpp.weights=q5_k"])
    assert any(p.startswith("engine_options.llamacpp.weights=q5_k") for p in problems), problems

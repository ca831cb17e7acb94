"""Materialise a model preset as a local Hugging Face checkpoint with random weights.

Every engine then loads the identical model from disk, and nothing is downloaded. Weights are
drawn with a fixed seed; a small word-level tokenizer is built locally with the `tokenizers`
library, so that engines which want a tokenizer find one.

A preset used by a run is materialised once into the cache directory (keyed by the shape and
the seed) and reused afterwards. The directory appears atomically (written under a temporary
name, then renamed), so a killed run never leaves a half-written model behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from harness.core.presets import ModelShape

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3: pad, bos, eos, unk
FIRST_ORDINARY_ID = len(SPECIAL_TOKENS)


def shape_key(shape: ModelShape, seed: int) -> str:
    blob = json.dumps({"shape": shape.to_dict(), "seed": seed, "format": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _build_tokenizer(vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(FIRST_ORDINARY_ID, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)


def write_checkpoint(shape: ModelShape, out: Path, seed: int = 0, device: str = "cpu") -> Path:
    """Write config.json, model.safetensors and a tokenizer for `shape` into `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = shape.hf_config_dict()
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    dtype = getattr(torch, shape.dtype)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    _build_tokenizer(shape.vocab_size, out)
    (out / "infer_bench_preset.json").write_text(json.dumps({"preset": shape.to_dict(), "seed": seed}, indent=2))
    return out


def cached_path(shape: ModelShape, cache_dir: Path, seed: int = 0) -> Path:
    return cache_dir / f"{shape.name}-{shape_key(shape, seed)}"


def ensure_checkpoint(shape: ModelShape, cache_dir: Path, seed: int = 0) -> Path:
    """The cached checkpoint for (shape, seed), materialised on first use."""
    target = cached_path(shape, cache_dir, seed)
    if (target / "config.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{target.name}.lock", "w") as lock:  # one writer across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
        try:
            write_checkpoint(shape, tmp, seed)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target

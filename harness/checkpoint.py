"""Materialise a model preset as a local Hugging Face checkpoint with random weights.

Every engine then loads the identical model from disk, and nothing is downloaded. Weights are
drawn with a fixed seed; a small word-level tokenizer is built locally with the `tokenizers`
library, so that engines which want a tokenizer find one.

A preset used by a run is materialised once into the cache directory (keyed by the shape and
the seed) and reused afterwards. The directory appears atomically (written under a temporary
name, then renamed), so a killed run never leaves a half-written model behind.

Trained presets are shipped with the project (SHIPPED_DIR/<preset>: the checkpoint that
`infer-bench-model --train --preset <preset>` wrote, its training record and a SHA256SUMS
file), so every machine scores the same weights and nothing trains on first use. A run takes the
shipped checkpoint while it matches the preset (shape, training settings, seed and
harness.core.train.TRAIN_FORMAT, `shipped_checkpoint`); a preset changed since (or a training
code change that bumped TRAIN_FORMAT) is trained into the cache instead, under the name
`trained_name` gives it. A trained preset that reuses another's tokenizer (`train.tokenizer_from`:
a speculative-decoding target and its draft) takes its shipped checkpoint only while that
preset's shipped checkpoint is taken too and the tokenizer files are the same bytes; trained into
the cache, its name covers which tokenizer it reused.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from harness.core.presets import ModelShape

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3: pad, bos, eos, unk
FIRST_ORDINARY_ID = len(SPECIAL_TOKENS)


def shape_key(shape: ModelShape, seed: int) -> str:
    blob = json.dumps({"shape": shape.to_dict(), "seed": seed, "format": CHECKPOINT_FORMAT}, sort_keys=True)
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


# Random weights that decide something. With transformers' default init (every weight N(0, 0.02))
# attention is nearly uniform - positions hardly matter - and the next-token logits nearly tie, so
# a rounding difference flips a greedy token and a wrong RoPE goes unseen. The presets are drawn
# with per-weight standard deviations set from the hidden size d instead:
#   q_proj, k_proj  sqrt(ATTN_LOGIT_STD / d): attention scores of standard deviation ATTN_LOGIT_STD
#   v_proj, o_proj  sqrt(BRANCH_GAIN / d): the attention branch adds about as much as the stream holds
#   lm_head         LOGIT_STD / sqrt(d): next-token logits of standard deviation LOGIT_STD
#   attention biases (attention_bias shapes) N(0, BIAS_STD), not zero
#   latent attention's q_a/q_b/kv_a projections sqrt(ATTN_LOGIT_STD / fan-in), kv_b sqrt(BRANCH_GAIN / fan-in)
#   (they follow RMSNorms; only DeepSeek-style checkpoints have them, so no other preset changes)
#   MoE router      ROUTER_LOGIT_STD / sqrt(d), in presets stored in bf16/fp16 only: router logits of
#                   that standard deviation, so that rounding seldom flips which experts a token
#                   takes. With the default init (logits of std 0.3, near-equal top-2 weights) one
#                   flip moved a token's hidden state by 10 %, and transformers' own bf16 run differed
#                   from its float32 run by 1.04 nats (mean KL 7.3e-3) on tiny-qwen3-next's parity
#                   prompts. float32 presets keep the default init, where a router bug shows most.
# docs/metrics.md ("Parity") gives the margins and parity errors they lead to.
ATTN_LOGIT_STD = 2.5
BRANCH_GAIN = 1.0
LOGIT_STD = 3.2
BIAS_STD = 0.1
ROUTER_LOGIT_STD = 5.0
CHECKPOINT_FORMAT = 3  # bump when the weights drawn for a preset change


def _decisive_init(model: Any, shape: ModelShape, seed: int) -> None:
    import torch
    d = shape.hidden_size
    std = {"q_proj": (ATTN_LOGIT_STD / d) ** 0.5, "k_proj": (ATTN_LOGIT_STD / d) ** 0.5,
           "v_proj": (BRANCH_GAIN / d) ** 0.5, "o_proj": (BRANCH_GAIN / d) ** 0.5, "lm_head": LOGIT_STD / d ** 0.5}
    # latent attention (DeepSeek): q and k come out of low-rank projections behind an RMSNorm, so
    # their standard deviation is set from each matrix's own input size (fan-in)
    fan_in = {"q_a_proj": ATTN_LOGIT_STD ** 0.5, "q_b_proj": ATTN_LOGIT_STD ** 0.5,
              "kv_a_proj_with_mqa": ATTN_LOGIT_STD ** 0.5, "kv_b_proj": BRANCH_GAIN ** 0.5}
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    experts = shape.num_experts if shape.dtype in ("bfloat16", "float16") else 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (experts and name.endswith((".gate.weight", ".router.weight")) and p.dim() == 2
                    and p.shape[0] == experts):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device) * ROUTER_LOGIT_STD / d ** 0.5)
                continue
            mla = next((k for k in fan_in if f".{k}." in name), None)
            if mla is not None and name.endswith(".weight"):
                s = fan_in[mla] / p.shape[-1] ** 0.5
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device) * s)
                continue
            kind = next((k for k in std if f"{k}." in name or name.startswith(k)), None)
            if kind is None:
                continue
            s = BIAS_STD if name.endswith(".bias") else std[kind]
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device) * s)


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
    _decisive_init(model, shape, seed)
    model = model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    _build_tokenizer(shape.vocab_size, out)
    (out / PRESET_FILE).write_text(json.dumps({"preset": shape.to_dict(), "seed": seed}, indent=2))
    return out


def cached_path(shape: ModelShape, cache_dir: Path, seed: int = 0) -> Path:
    """Where a run finds the checkpoint of (shape, seed): a trained preset's shipped checkpoint
    where it matches, else the model cache's directory for it (materialised on first use)."""
    if shape.trained:  # named after the Python version and the hash of what it was trained on
        from harness.core.train import TrainConfig, trained_name
        shipped = shipped_checkpoint(shape, seed)
        if shipped is not None:
            return shipped
        src, tokenizer = tokenizer_source(shape, cache_dir, seed), None
        if src is not None:  # which tokenizer: the shipped one's bytes, or the cached preset's (hashed) name
            tokenizer = f"shipped:{_sha256(src / 'tokenizer.json')}" if src.parent == SHIPPED_DIR else src.name
        return cache_dir / trained_name(shape, TrainConfig.from_mapping(shape.train), seed, tokenizer=tokenizer)
    return cache_dir / f"{shape.name}-{shape_key(shape, seed)}"


def tokenizer_source(shape: ModelShape, cache_dir: Path, seed: int = 0) -> Path | None:
    """Where a run finds the checkpoint whose tokenizer trained preset `shape` reuses
    (`train.tokenizer_from`); None where it trains its own."""
    from harness.core.presets import load_preset
    name = (shape.train or {}).get("tokenizer_from")
    return None if name is None else cached_path(load_preset(name), cache_dir, seed)


# ---- shipped checkpoints ------------------------------------------------------------------

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"  # package data: harness/shipped/<preset>/
PRESET_FILE = "infer_bench_preset.json"  # the preset a checkpoint was written from, and its seed
CHECKSUMS_FILE = "SHA256SUMS"  # `sha256sum -c SHA256SUMS` checks a checkpoint directory


def _same_shape(stored: dict[str, Any], shape: ModelShape) -> bool:
    """Whether a stored preset dict describes `shape`. Read back through ModelShape, so a field
    added to ModelShape since (with its default) matches; one since removed does not."""
    try:
        then = ModelShape(**stored)
    except TypeError:
        return False
    a, b = then.to_dict(), shape.to_dict()
    a.pop("train", None), b.pop("train", None)
    return a == b


def shipped_mismatch(shape: ModelShape, seed: int = 0, root: Path | None = None) -> str | None:
    """Why the shipped checkpoint of trained preset `shape` is not the one a run of (shape, seed)
    takes (None: it is): missing, written from another shape, other training settings, another
    seed, or an older TRAIN_FORMAT."""
    from harness.core.train import TRAIN_FORMAT, TRAINING_FILE, TrainConfig
    d = (root or SHIPPED_DIR) / shape.name
    if not ((d / "config.json").is_file() and (d / PRESET_FILE).is_file() and (d / TRAINING_FILE).is_file()):
        return f"no shipped checkpoint in {d}"
    stored = json.loads((d / PRESET_FILE).read_text())
    record = json.loads((d / TRAINING_FILE).read_text())
    if not _same_shape(stored.get("preset") or {}, shape):
        return f"{d} was written from another shape of {shape.name} (its {PRESET_FILE})"
    try:
        same_train = TrainConfig.from_mapping(record.get("train")) == TrainConfig.from_mapping(shape.train)
    except (TypeError, ValueError):
        same_train = False
    if not same_train:
        return f"{d} was trained with other settings than the preset's train: mapping"
    if stored.get("seed") != seed or record.get("seed") != seed:
        return f"{d} was trained with seed {record.get('seed')}, not {seed}"
    if record.get("format") != TRAIN_FORMAT:
        return f"{d} was trained by TRAIN_FORMAT {record.get('format')}, the training code is at {TRAIN_FORMAT}"
    src_name = (shape.train or {}).get("tokenizer_from")
    if src_name is not None:  # a target reuses its draft's tokenizer: the shipped draft's, byte for byte
        from harness.core.presets import load_preset
        from harness.core.train import TOKENIZER_FILES
        why = shipped_mismatch(load_preset(src_name), seed, root)
        if why is not None:
            return f"{d} reuses {src_name}'s tokenizer, whose shipped checkpoint runs do not take ({why})"
        src = (root or SHIPPED_DIR) / src_name
        if any(not (d / n).is_file() or (d / n).read_bytes() != (src / n).read_bytes() for n in TOKENIZER_FILES):
            return f"{d}'s tokenizer files are not those of {src}, whose tokenizer the preset reuses"
    return None


def shipped_checkpoint(shape: ModelShape, seed: int = 0, root: Path | None = None) -> Path | None:
    """The shipped checkpoint of trained preset `shape`, if it is the one (shape, seed) trains."""
    return None if shipped_mismatch(shape, seed, root) else (root or SHIPPED_DIR) / shape.name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_checksums(ckpt: Path) -> Path:
    """SHA256SUMS over every file of the checkpoint directory (sorted; sha256sum's format)."""
    files = sorted(p for p in ckpt.iterdir() if p.is_file() and p.name != CHECKSUMS_FILE)
    (ckpt / CHECKSUMS_FILE).write_text("".join(f"{_sha256(p)}  {p.name}\n" for p in files))
    return ckpt / CHECKSUMS_FILE


def checksum_problems(ckpt: Path) -> list[str]:
    """What does not match the checkpoint's SHA256SUMS: a file changed, missing, or not listed.
    Empty: every file is as recorded."""
    sums = ckpt / CHECKSUMS_FILE
    if not sums.is_file():
        return [f"{sums} is missing"]
    listed = {}
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest
    problems = [f"{name}: missing" if not (ckpt / name).is_file() else f"{name}: its SHA-256 is not the recorded one"
                for name, digest in listed.items()
                if not (ckpt / name).is_file() or _sha256(ckpt / name) != digest]
    problems += [f"{p.name}: not in {CHECKSUMS_FILE}" for p in sorted(ckpt.iterdir())
                 if p.is_file() and p.name != CHECKSUMS_FILE and p.name not in listed]
    return problems


def random_baseline(shape: ModelShape, seed: int = 0) -> Any:
    """Scores, on given windows, of the random-weight preset of `shape` (as write_checkpoint
    draws it): the baseline a trained preset's figures are set beside."""
    def score(windows: Any) -> dict[str, float]:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from harness.core.train import model_scores
        cfg_dict = shape.hf_config_dict()
        config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _decisive_init(model, shape, seed)
        return model_scores(model, windows)
    return score


def checkpoint_baseline(path: Path) -> Any:
    """Scores, on given windows, of the checkpoint in `path` (transformers, float32)."""
    def score(windows: Any) -> dict[str, float]:
        import torch
        from transformers import AutoModelForCausalLM

        from harness.core.train import model_scores
        return model_scores(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), windows)
    return score


def write_trained(shape: ModelShape, out: Path, seed: int = 0, progress: bool = True,
                  cache_dir: Path | None = None) -> Path:
    """Train a trained preset into `out` (harness.core.train), beside its random-weight twin and,
    for a preset that reuses another's tokenizer, that preset (materialised first where it is
    neither shipped nor in `cache_dir`, the model cache by default)."""
    from harness.core.paths import model_cache_dir
    from harness.core.presets import load_preset
    from harness.core.train import TrainConfig, train_checkpoint
    cfg = TrainConfig.from_mapping(shape.train)
    twin = ModelShape(**{**shape.to_dict(), "train": None})
    baselines = {"random_preset": random_baseline(twin, seed)}
    src = None
    if cfg.tokenizer_from is not None:
        src = ensure_checkpoint(load_preset(cfg.tokenizer_from), cache_dir or model_cache_dir(None), seed)
        baselines[cfg.tokenizer_from] = checkpoint_baseline(src)
    train_checkpoint(shape, out, cfg, seed, progress=progress, baselines=baselines, tokenizer_dir=src)
    (out / PRESET_FILE).write_text(json.dumps({"preset": shape.to_dict(), "seed": seed}, indent=2))
    write_checksums(out)
    return out


def ensure_checkpoint(shape: ModelShape, cache_dir: Path, seed: int = 0) -> Path:
    """The cached checkpoint for (shape, seed), materialised on first use (a trained preset is
    trained: minutes)."""
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
            if shape.trained:
                write_trained(shape, tmp, seed, cache_dir=cache_dir)
            else:
                write_checkpoint(shape, tmp, seed)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target

"""Trained presets: a Llama-architecture model trained here, from scratch, on the Python standard
library's own source, so that parity and KV quantisation are judged on a real, peaked next-token
distribution instead of random weights (docs/metrics.md, "Quality").

The corpus is a fixed, deterministic selection of the running interpreter's standard library:
every `.py` file under `sysconfig`'s stdlib directory except site-packages, test suites and
IDLE, in sorted order of their relative paths. A file is held out (never trained on) when a
hash of the seed and its relative path falls under `heldout_frac`, so the split is by file and
stays the same for every file that two Python versions share. A BPE tokenizer (the `tokenizers`
library, byte-level) is trained on the training files; the model then takes `steps` AdamW steps
on random windows of the training token stream, drawn with the seed.

The checkpoint directory is a standard Hugging Face checkpoint (config.json, model.safetensors,
tokenizer files) plus:
  - `heldout.npy`: the held-out files' token ids, one stream (files joined by </s>): the
    quality workload's text;
  - `training.json`: the corpus (Python version, its files, digest), the training settings, the
    loss curve, wall time, and the held-out perplexity beside two baselines (the unigram
    perplexity of the same tokenizer, and the same architecture with its initial random
    weights) and the median top-1/top-2 log-probability margin.

The same interpreter (the same stdlib files) and seed give the same corpus and the same
weights (on the same torch build and thread count); a different Python version gives a
different corpus, and the cache directory's name says which: `<preset>-py<version>-<hash>`,
the hash covering the corpus digest, the shape, the training settings and the seed.

So that every machine scores the same weights, tiny-trained's checkpoint is shipped with the
project (harness/shipped/, harness.checkpoint.shipped_checkpoint); runs take it instead of
training. Bump TRAIN_FORMAT with any change here that changes what training produces: the
shipped checkpoint then no longer matches, its test fails, and it is retrained and replaced
(docs/metrics.md, "Quality").
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from harness.core.presets import ModelShape

TRAIN_FORMAT = 1  # bump when what a trained preset is changes (corpus rule, tokenizer, loop)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, as the random presets
EOS_ID = 2
HELDOUT_FILE = "heldout.npy"
TRAINING_FILE = "training.json"
# directories of the stdlib left out of the corpus: test suites (huge, repetitive), IDLE, and
# installed packages
EXCLUDED_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "turtledemo"}


@dataclass(frozen=True)
class TrainConfig:
    """How a trained preset is trained (a preset's `train:` mapping)."""

    steps: int = 150
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 3e-3
    warmup_steps: int = 15
    min_lr_frac: float = 0.1  # cosine decay to this share of lr
    weight_decay: float = 0.01
    heldout_frac: float = 0.05
    max_files: int | None = None  # the first N files of the sorted list only (smoke tests)
    eval_windows: int = 16  # held-out windows of seq_len tokens evaluated at the end
    log_every: int = 5

    @classmethod
    def from_mapping(cls, data: dict[str, Any] | None) -> "TrainConfig":
        data = dict(data or {})
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown training setting(s) {', '.join(unknown)}; known: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**data)


# ---- the corpus ---------------------------------------------------------------------------

def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_tag() -> str:
    return "py" + platform.python_version()


def corpus_files(root: Path | None = None, max_files: int | None = None) -> list[str]:
    """The corpus: relative paths of the stdlib's .py files (see the module doc), sorted."""
    root = root or stdlib_dir()
    rel = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                 if not EXCLUDED_PARTS & set(p.relative_to(root).parts[:-1]))
    return rel[:max_files] if max_files else rel


def is_heldout(rel: str, seed: int, frac: float) -> bool:
    h = hashlib.sha256(f"{seed}:{rel}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64 < frac


def split_files(files: list[str], seed: int, frac: float) -> tuple[list[str], list[str]]:
    """(training files, held-out files), split by file. At least one file lands on each side."""
    held = [f for f in files if is_heldout(f, seed, frac)]
    held_set = set(held)
    train = [f for f in files if f not in held_set]
    if not held and len(files) > 1:
        held, train = train[-1:], train[:-1]
    return train, held


def read_text(root: Path, rel: str) -> str:
    return (root / rel).read_text(encoding="utf-8", errors="replace")


def corpus_digest(root: Path, files: list[str]) -> str:
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def trained_name(shape: ModelShape, cfg: TrainConfig, seed: int, root: Path | None = None) -> str:
    """`<preset>-py<version>-<hash>`: the cache directory of a trained preset. The hash covers the
    corpus's digest, the shape, the training settings, the seed and TRAIN_FORMAT."""
    root = root or stdlib_dir()
    files = corpus_files(root, cfg.max_files)
    shape_fields = {k: v for k, v in shape.to_dict().items() if k != "train"}
    blob = json.dumps({"corpus": corpus_digest(root, files), "shape": shape_fields, "train": asdict(cfg),
                       "seed": seed, "format": TRAIN_FORMAT}, sort_keys=True)
    return f"{shape.name}-{python_tag()}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


# ---- the tokenizer ------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int, out: Path) -> Any:
    """A byte-level BPE tokenizer trained on `texts`, saved into `out` as transformers files.
    Returns the `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    return tok


def encode_stream(tok: Any, texts: list[str]) -> np.ndarray:
    """Token ids of `texts`, each followed by </s>, as one int32 stream."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids
        ids.append(EOS_ID)
    return np.asarray(ids, dtype=np.int32)


# ---- measurements -------------------------------------------------------------------------

def eval_windows(stream: np.ndarray, seq_len: int, n: int) -> np.ndarray:
    """Up to n non-overlapping windows of seq_len tokens, evenly spread over the stream: [n, seq_len]."""
    total = len(stream) // seq_len
    if total == 0:
        return np.asarray(stream[None, :], dtype=np.int64)
    picks = np.unique(np.linspace(0, total - 1, num=min(n, total)).round().astype(int))
    return np.stack([stream[i * seq_len:(i + 1) * seq_len] for i in picks]).astype(np.int64)


def unigram_perplexity(train_ids: np.ndarray, heldout_ids: np.ndarray, vocab_size: int) -> float:
    """Perplexity on the held-out tokens of the tokenizer's unigram distribution, estimated from
    the training stream with add-one smoothing: the baseline a model must beat by using context."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[heldout_ids].mean()))


def model_scores(model: Any, windows: np.ndarray) -> dict[str, float]:
    """Teacher-forced perplexity of `model` over the windows (every position after the first)
    and the median top-1/top-2 log-probability margin of its next-token distributions."""
    import torch
    nll, count, margins = 0.0, 0, []
    model.eval()
    with torch.no_grad():
        for w in windows:
            x = torch.as_tensor(w, dtype=torch.long)[None]
            logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), dim=-1)
            target = x[0, 1:]
            nll -= float(logp.gather(1, target[:, None]).sum())
            count += len(target)
            top = logp.topk(2, dim=-1).values
            margins.append((top[:, 0] - top[:, 1]).numpy())
    return {"perplexity": math.exp(nll / max(count, 1)), "tokens": count,
            "median_margin": float(np.median(np.concatenate(margins))) if margins else float("nan")}


# ---- training -----------------------------------------------------------------------------

@dataclass
class TrainResult:
    out: Path
    record: dict[str, Any] = field(default_factory=dict)


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def train_checkpoint(shape: ModelShape, out: Path, cfg: TrainConfig, seed: int = 0,
                     root: Path | None = None, progress: bool = True,
                     baselines: dict[str, Callable[[np.ndarray], dict[str, float]]] | None = None) -> TrainResult:
    """Train `shape` on the stdlib corpus and write the checkpoint into `out` (see the module doc).
    `baselines`: extra models to score on the same held-out windows, by name (e.g. the random
    preset of the same vocabulary), recorded beside the trained model's figures."""
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM

    t_start = time.perf_counter()
    root = root or stdlib_dir()
    out.mkdir(parents=True, exist_ok=True)
    files = corpus_files(root, cfg.max_files)
    if len(files) < 2:
        raise ValueError(f"the standard library at {root} has {len(files)} .py files: nothing to train on")
    train_files, held_files = split_files(files, seed, cfg.heldout_frac)
    train_texts = [read_text(root, f) for f in train_files]
    held_texts = [read_text(root, f) for f in held_files]

    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts, shape.vocab_size, out)
    train_ids = encode_stream(tok, train_texts)
    held_ids = encode_stream(tok, held_texts)
    tokenizer_s = time.perf_counter() - t0
    np.save(out / HELDOUT_FILE, held_ids)

    cfg_dict = shape.hf_config_dict()
    cfg_dict.update(bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0, torch_dtype="float32")
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    windows = eval_windows(held_ids, cfg.seq_len, cfg.eval_windows)
    initial = model_scores(model, windows)

    seq = min(cfg.seq_len, len(train_ids) - 1)
    gen = torch.Generator().manual_seed(seed)
    stream = torch.as_tensor(train_ids, dtype=torch.long)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    curve: list[dict[str, float]] = []
    model.train()
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"training {shape.name}", unit="step", disable=not progress,
               dynamic_ncols=True)
    for step in bar:
        starts = torch.randint(0, len(stream) - seq - 1 + 1, (cfg.batch_size,), generator=gen)
        x = torch.stack([stream[s:s + seq + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = float(loss.detach())
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            curve.append({"step": step, "loss": round(value, 4), "lr": _lr_at(step, cfg),
                          "elapsed_s": round(time.perf_counter() - t0, 2)})
        bar.set_postfix(loss=f"{value:.3f}")
    bar.close()
    train_s = time.perf_counter() - t0

    final = model_scores(model, windows)
    model.save_pretrained(out, safe_serialization=True)
    extra = {name: fn(windows) for name, fn in (baselines or {}).items()}
    unigram = unigram_perplexity(train_ids, windows[:, 1:].reshape(-1), shape.vocab_size)
    record = {
        "preset": shape.name,
        "format": TRAIN_FORMAT,
        "seed": seed,
        "corpus": {"python": platform.python_version(), "stdlib": str(root), "files": len(files),
                   "file_list": files, "train_files": len(train_files), "heldout_files": held_files,
                   "digest": corpus_digest(root, files), "train_tokens": int(len(train_ids)),
                   "heldout_tokens": int(len(held_ids))},
        "train": asdict(cfg),
        "tokens_seen": cfg.steps * cfg.batch_size * seq,
        "loss_curve": curve,
        "heldout": {"windows": int(len(windows)), "window_len": int(windows.shape[1]), **final},
        "unigram_perplexity": unigram,
        "initial_model": initial,  # this architecture with its initial random weights
        "baselines": extra,
        "wall_s": {"tokenizer": round(tokenizer_s, 1), "train": round(train_s, 1),
                   "total": round(time.perf_counter() - t_start, 1)},
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    (out / TRAINING_FILE).write_text(json.dumps(record, indent=2))
    return TrainResult(out, record)


def summary_lines(record: dict[str, Any]) -> list[str]:
    """What a trained checkpoint's training.json says, for the terminal."""
    h = record["heldout"]
    lines = [f"held-out perplexity {h['perplexity']:.2f} over {h['tokens']} tokens "
             f"({h['windows']} windows of {h['window_len']}); unigram perplexity {record['unigram_perplexity']:.1f} "
             f"(ratio {h['perplexity'] / record['unigram_perplexity']:.3f}); initial random weights "
             f"{record['initial_model']['perplexity']:.1f}",
             f"median top-1/top-2 log-prob margin {h['median_margin']:.3f} (initial random weights "
             f"{record['initial_model']['median_margin']:.4f})"]
    for name, b in (record.get("baselines") or {}).items():
        lines.append(f"  {name}: perplexity {b['perplexity']:.1f}, median margin {b['median_margin']:.4f} "
                     f"(trained/{name} margin ratio {h['median_margin'] / b['median_margin']:.1f}x)")
    c = record["corpus"]
    lines.append(f"corpus: Python {c['python']} stdlib, {c['train_files']} training files "
                 f"({c['train_tokens']} tokens), {len(c['heldout_files'])} held out ({c['heldout_tokens']} tokens); "
                 f"{record['tokens_seen']} tokens seen in {record['train']['steps']} steps; wall "
                 f"{record['wall_s']['total']} s")
    return lines

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

A preset may reuse another trained preset's tokenizer instead (`tokenizer_from`: the target of
speculative decoding whose draft is that preset, so token ids mean the same in both): its
tokenizer files are copied byte for byte, and it must have been trained on the same split (its
training.json's held-out files are this run's) and have this preset's vocabulary size.

The weights train in float32; `save_dtype: bfloat16` rounds them to bfloat16 for storage (half
the size on disk; config.json keeps float32, the dtype they are computed in), and the held-out
figures recorded are then those of the rounded weights, beside the float32 ones before rounding.

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

from harness.core.shapes import ModelShape

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
    tokenizer_from: str | None = None  # a trained preset whose tokenizer this one reuses (None: train one)
    save_dtype: str = "float32"  # the dtype the weights are stored in: float32 or bfloat16 (rounded once trained)

    @classmethod
    def from_mapping(cls, data: dict[str, Any] | None) -> "TrainConfig":
        data = dict(data or {})
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown training setting(s) {', '.join(unknown)}; known: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        if data.get("save_dtype", "float32") not in SAVE_DTYPES:
            raise ValueError(f"train.save_dtype={data['save_dtype']}: choose one of {', '.join(SAVE_DTYPES)}")
        return cls(**data)

    def identity(self) -> dict[str, Any]:
        """The settings that name a trained checkpoint: every field, except the ones added since
        the first trained preset while they keep their defaults, so that the cache names of
        checkpoints trained before those fields existed stay the same."""
        d = asdict(self)
        for name, default in LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d


SAVE_DTYPES = ("float32", "bfloat16")
LATER_FIELDS = {"tokenizer_from": None, "save_dtype": "float32"}  # TrainConfig fields added since TRAIN_FORMAT 1


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


def trained_name(shape: ModelShape, cfg: TrainConfig, seed: int, root: Path | None = None,
                 tokenizer: str | None = None) -> str:
    """`<preset>-py<version>-<hash>`: the cache directory of a trained preset. The hash covers the
    corpus's digest, the shape, the training settings, the seed and TRAIN_FORMAT, and `tokenizer`
    (what identifies a reused tokenizer, for a preset with `tokenizer_from`)."""
    root = root or stdlib_dir()
    files = corpus_files(root, cfg.max_files)
    shape_fields = {k: v for k, v in shape.to_dict().items() if k != "train"}
    ident: dict[str, Any] = {"corpus": corpus_digest(root, files), "shape": shape_fields, "train": cfg.identity(),
                             "seed": seed, "format": TRAIN_FORMAT}
    if tokenizer is not None:
        ident["tokenizer"] = tokenizer
    blob = json.dumps(ident, sort_keys=True)
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what transformers' save_pretrained writes here


def tokenizer_source_problems(shape: ModelShape, source: ModelShape, field: str) -> list[str]:
    """Why the preset `source` cannot lend its tokenizer to the trained preset `shape`
    (`train.tokenizer_from`; `field` names the setting in the messages): it is not trained, has
    another vocabulary size, or another split of the corpus."""
    if not source.trained:
        return [f"{field}: {source.name} is not a trained preset (it has no train: settings), so it has no "
                "tokenizer of its own to lend. Name a trained preset, e.g. tiny-trained."]
    problems = []
    if source.vocab_size != shape.vocab_size:
        problems.append(f"{field}: {source.name}'s tokenizer has {source.vocab_size} tokens, this preset's "
                        f"vocab_size is {shape.vocab_size}. Set vocab_size: {source.vocab_size}.")
    mine, theirs = TrainConfig.from_mapping(shape.train), TrainConfig.from_mapping(source.train)
    if (mine.heldout_frac, mine.max_files) != (theirs.heldout_frac, theirs.max_files):
        problems.append(f"{field}: {source.name} splits the corpus with heldout_frac={theirs.heldout_frac}, "
                        f"max_files={theirs.max_files}; this preset with heldout_frac={mine.heldout_frac}, "
                        f"max_files={mine.max_files}. Use {source.name}'s, so both hold out the same files.")
    return problems


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reuse_tokenizer(src: Path, vocab_size: int, held_files: list[str], out: Path) -> Any:
    """Copy the tokenizer of the trained checkpoint in `src` into `out`, byte for byte, and return
    it as a `tokenizers.Tokenizer`. ValueError where it cannot be this preset's: another vocabulary
    size, or trained on another split of the corpus (its held-out files are not `held_files`)."""
    from tokenizers import Tokenizer

    missing = [n for n in (*TOKENIZER_FILES, TRAINING_FILE) if not (src / n).is_file()]
    if missing:
        raise ValueError(f"{src} is not a trained checkpoint whose tokenizer can be reused: it lacks "
                         f"{', '.join(missing)}")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the tokenizer in {src} has {tok.get_vocab_size()} tokens, the preset's vocab_size is "
                         f"{vocab_size}: set vocab_size to {tok.get_vocab_size()}")
    theirs = json.loads((src / TRAINING_FILE).read_text())["corpus"]["heldout_files"]
    if theirs != held_files:
        raise ValueError(f"the tokenizer in {src} was trained on another split of the corpus ({len(theirs)} "
                         f"held-out files, {len(held_files)} here): give this preset its seed and heldout_frac")
    for name in TOKENIZER_FILES:
        (out / name).write_bytes((src / name).read_bytes())
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
                     baselines: dict[str, Callable[[np.ndarray], dict[str, float]]] | None = None,
                     tokenizer_dir: Path | None = None) -> TrainResult:
    """Train `shape` on the stdlib corpus and write the checkpoint into `out` (see the module doc).
    `baselines`: extra models to score on the same held-out windows, by name (e.g. the random
    preset of the same vocabulary), recorded beside the trained model's figures.
    `tokenizer_dir`: the checkpoint of `cfg.tokenizer_from`, whose tokenizer is reused."""
    import torch
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

    if (cfg.tokenizer_from is None) != (tokenizer_dir is None):
        raise ValueError(f"train.tokenizer_from={cfg.tokenizer_from} needs the directory of that preset's "
                         "checkpoint (tokenizer_dir), and only then")
    t0 = time.perf_counter()
    if tokenizer_dir is not None:
        tok = reuse_tokenizer(tokenizer_dir, shape.vocab_size, held_files, out)
    else:
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
    t0 = time.perf_counter()
    curve = _optimise(model, train_ids, seq, cfg, seed, f"training {shape.name}", progress)
    train_s = time.perf_counter() - t0
    final, before_rounding = _save(model, out, cfg, windows)
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
        **({"heldout_float32": before_rounding} if cfg.save_dtype != "float32" else {}),
        **({"tokenizer": {"from": cfg.tokenizer_from,
                          **{name: file_sha256(out / name) for name in TOKENIZER_FILES}}}
           if cfg.tokenizer_from else {}),
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


def _optimise(model: Any, train_ids: np.ndarray, seq: int, cfg: TrainConfig, seed: int, desc: str,
              progress: bool) -> list[dict[str, float]]:
    """`cfg.steps` AdamW steps of `model` on random windows of `seq + 1` tokens of the training
    stream (seeded), the learning rate by `_lr_at`, gradients clipped at 1; the loss curve."""
    import torch
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(seed)
    stream = torch.as_tensor(train_ids, dtype=torch.long)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    curve: list[dict[str, float]] = []
    model.train()
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=not progress, dynamic_ncols=True)
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
    return curve


def _save(model: Any, out: Path, cfg: TrainConfig, windows: np.ndarray) -> tuple[dict[str, float], dict[str, float]]:
    """Write the trained model into `out` at `cfg.save_dtype`; (its held-out scores as stored,
    before rounding to that dtype)."""
    import torch

    final = before_rounding = model_scores(model, windows)
    if cfg.save_dtype != "float32":
        # the weights as stored (rounded once), computed in float32: the figures recorded are theirs
        stored = getattr(torch, cfg.save_dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(stored).float())
        final = model_scores(model, windows)
        model.to(stored).save_pretrained(out, safe_serialization=True)
        written = json.loads((out / "config.json").read_text())
        written["dtype"] = "float32"  # the dtype the model computes in; its stored weights are exact in it
        (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    else:
        model.save_pretrained(out, safe_serialization=True)
    return final, before_rounding


def summary_lines(record: dict[str, Any]) -> list[str]:
    """What a trained checkpoint's training.json says, for the terminal."""
    h = record["heldout"]
    lines = [f"held-out perplexity {h['perplexity']:.2f} over {h['tokens']} tokens "
             f"({h['windows']} windows of {h['window_len']}); unigram perplexity {record['unigram_perplexity']:.1f} "
             f"(ratio {h['perplexity'] / record['unigram_perplexity']:.3f}); initial random weights "
             f"{record['initial_model']['perplexity']:.1f}",
             f"median top-1/top-2 log-prob margin {h['median_margin']:.3f} (initial random weights "
             f"{record['initial_model']['median_margin']:.4f})"]
    if "heldout_float32" in record:
        lines.append(f"weights stored in {record['train']['save_dtype']} (the figures above are theirs, computed in "
                     f"float32); before rounding: perplexity {record['heldout_float32']['perplexity']:.2f}, median "
                     f"margin {record['heldout_float32']['median_margin']:.3f}")
    if record.get("tokenizer"):
        lines.append(f"tokenizer: {record['tokenizer']['from']}'s, reused (token ids mean the same in both)")
    for name, b in (record.get("baselines") or {}).items():
        lines.append(f"  {name}: perplexity {b['perplexity']:.1f}, median margin {b['median_margin']:.4f} "
                     f"(trained/{name} margin ratio {h['median_margin'] / b['median_margin']:.1f}x)")
    c = record["corpus"]
    lines.append(f"corpus: Python {c['python']} stdlib, {c['train_files']} training files "
                 f"({c['train_tokens']} tokens), {len(c['heldout_files'])} held out ({c['heldout_tokens']} tokens); "
                 f"{record['tokens_seen']} tokens seen in {record['train']['steps']} steps; wall "
                 f"{record['wall_s']['total']} s")
    return lines

"""The speculative workload's prompts: content with real structure, each request naming its
category (docs/metrics.md, "Speculative decoding"). Acceptance depends on what is decoded, so
the grid runs every point on each of:

- `code`: the trained presets' held-out text - the Python standard library files that training
  never saw (harness.core.train's split by file, seed 0, 5 %). On a checkpoint trained here its
  own `heldout.npy` (those files' token ids); on any other model the same files read from this
  interpreter's stdlib and tokenised with the model's tokenizer.
- `prose`: English text no trained preset saw (they trained on `.py` files only): the licence
  texts Debian's `base-files` installs under /usr/share/common-licenses (GPL-3, Apache-2.0,
  MPL-2.0, GFDL-1.3: every Debian or Ubuntu machine has them), tokenised with the model's
  tokenizer; where that directory is absent, the interpreter's own LICENSE.txt (the PSF licence
  and Python's history, beside the stdlib; not a `.py` file, so not in the corpus).
- `random`: token ids drawn uniformly from the model's ordinary ids (the run's token range):
  the lower bound, where nothing repeats.

Request i of a category gets the window of `length` tokens at an offset drawn from the run's
seed and (category, i): the same prompts in every run, at every batch size, for every method and
engine - so a speculative point and its baseline serve identical requests.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workloads.prompts import seed_for, synthetic_prompts

CONTENTS = ("code", "prose", "random")
LICENSES_DIR = Path("/usr/share/common-licenses")
PROSE_FILES = ("GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3")
HELDOUT_SEED, HELDOUT_FRAC = 0, 0.05  # the trained presets' split (harness.core.train.TrainConfig)
# A tokenizer that maps more than this share of the text to its unknown token cannot encode it
# (a random-weight preset's word-level tokenizer): the category means nothing on that model.
MAX_UNKNOWN_SHARE = 0.05


@dataclass
class Content:
    """One category's token stream (None for `random`), where it came from, and a digest of it; a
    dataset's category has its prompts instead (token ids each, workloads/spec_dataset.py)."""

    category: str
    ids: np.ndarray | None
    source: str
    digest: str
    prompts: list[list[int]] | None = None


def dataset_content(path: str, category: str, model_path: str, tok: Any = None) -> Content:
    """A category of a user's dataset (workloads/spec_dataset.py): its prompts, tokenised raw with
    the model's tokenizer (no chat template). ValueError when none gives a token."""
    from workloads.spec_dataset import read_categories, texts_digest
    cats, fmt = read_categories(path)
    texts = cats.get(category)
    if not texts:
        raise ValueError(f"workload.dataset={path} has no category {category!r} (its categories: {', '.join(cats)})")
    tok = tok or _tokenizer(model_path)
    ids = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    ids = [i for i in ids if i]
    if not ids:
        raise ValueError(f"workload.dataset={path}: category {category!r}: every prompt tokenises to nothing")
    return Content(category, None, f"{path} ({fmt}), category {category}: {len(ids)} prompts, tokenised with the "
                   "model's tokenizer, no chat template", texts_digest(texts), ids)


def dataset_encoding_problems(path: str, model_path: str) -> list[str]:
    """Bad input: a dataset category whose prompts the model's tokenizer cannot encode (empty, or
    mostly its unknown token: a random-weight preset's word-level tokenizer)."""
    from workloads.spec_dataset import read_categories
    try:
        tok = _tokenizer(model_path)
    except Exception as e:
        return [f"workload.dataset={path} needs the model's tokenizer, which did not load from {model_path} "
                f"({type(e).__name__}: {e}). Use a model with a tokenizer."]
    problems = []
    for cat in read_categories(path)[0]:
        try:
            c = dataset_content(path, cat, model_path, tok)
        except ValueError as e:
            problems.append(f"{e}. Give prompts with text.")
            continue
        share = unknown_share(tok, np.asarray([t for p in c.prompts for t in p]))  # type: ignore[union-attr]
        if share > MAX_UNKNOWN_SHARE:
            problems.append(f"workload.dataset={path}: category {cat} means nothing on this model: its tokenizer maps "
                            f"{share:.0%} of the text to its unknown token. Use a trained model (model=tiny-trained).")
    return problems


def prose_files() -> list[Path]:
    """The prose texts present here, in a fixed order (see the module doc); empty when none."""
    found = [LICENSES_DIR / f for f in PROSE_FILES if (LICENSES_DIR / f).is_file()]
    if found:
        return found
    own = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    return [own] if own.is_file() else []


def heldout_code_files() -> tuple[Path, list[str]]:
    """(stdlib directory, the held-out files of the trained presets' split) of this interpreter."""
    from harness.core.train import corpus_files, split_files, stdlib_dir
    root = stdlib_dir()
    return root, split_files(corpus_files(root), HELDOUT_SEED, HELDOUT_FRAC)[1]


def _tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path)


def _encode(tok: Any, texts: list[str]) -> np.ndarray:
    """Token ids of the texts, each followed by the tokenizer's end-of-sequence id where it has one."""
    ids: list[int] = []
    for t in texts:
        ids += tok(t, add_special_tokens=False)["input_ids"]
        if tok.eos_token_id is not None:
            ids.append(int(tok.eos_token_id))
    return np.asarray(ids, dtype=np.int64)


def unknown_share(tok: Any, ids: np.ndarray) -> float:
    unk = tok.unk_token_id
    return float(np.mean(ids == unk)) if unk is not None and len(ids) else 0.0


def load_content(category: str, model_path: str, tok: Any = None) -> Content:
    """The token stream of `category` for the checkpoint at `model_path` (see the module doc).
    Raises ValueError naming what is missing."""
    if category == "random":
        return Content(category, None, "uniform token ids of the model's ordinary range", "random")
    if category == "code":
        held = Path(model_path) / "heldout.npy"
        if held.is_file():
            ids = np.load(held).astype(np.int64)
            return Content(category, ids, f"{held} (held-out stdlib files, trained here)", _digest(ids))
        root, files = heldout_code_files()
        if not files:
            raise ValueError(f"content=code: no held-out stdlib file under {root}")
        tok = tok or _tokenizer(model_path)
        ids = _encode(tok, [(root / f).read_text(encoding="utf-8", errors="replace") for f in files])
        return Content(category, ids, f"{len(files)} held-out stdlib files of {root}, tokenised with the model's "
                       "tokenizer", _digest(ids))
    if category == "prose":
        files = prose_files()
        if not files:
            raise ValueError(f"content=prose: no English text found ({LICENSES_DIR}/{{{','.join(PROSE_FILES)}}} "
                             "and the interpreter's LICENSE.txt are all absent)")
        tok = tok or _tokenizer(model_path)
        ids = _encode(tok, [f.read_text(encoding="utf-8", errors="replace") for f in files])
        return Content(category, ids, ", ".join(str(f) for f in files) + ", tokenised with the model's tokenizer",
                       _digest(ids))
    raise ValueError(f"unknown content category {category!r}: one of {', '.join(CONTENTS)}")


def _digest(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16]


def prompts(content: Content, n: int, length: int, seed: int, token_range: tuple[int, int, tuple[int, ...]],
            first: int = 0) -> list[list[int]]:
    """Prompts first .. first + n - 1 of the category: windows of `length` tokens of its stream,
    each at an offset drawn from (seed, category, index); for `random`, uniform ids of
    `token_range` (low, high, avoid)."""
    out = []
    for i in range(first, first + n):
        key = f"speculative/{content.category}/{i}"
        if content.ids is None:
            low, high, avoid = token_range
            out.append(synthetic_prompts(1, length, low, high, avoid, seed=seed, key=key)[0])
            continue
        if len(content.ids) <= length:
            raise ValueError(f"content={content.category}: its text has {len(content.ids)} tokens, fewer than a "
                             f"prompt of {length}; shorten workload.prompt_len")
        off = int(np.random.default_rng(seed_for(seed, key)).integers(0, len(content.ids) - length))
        out.append([int(t) for t in content.ids[off:off + length]])
    return out


def encoding_problems(model_path: str, categories: list[str]) -> list[str]:
    """Bad input: a text category the model's tokenizer cannot encode (more than
    MAX_UNKNOWN_SHARE of its tokens unknown: a random-weight preset's word-level tokenizer)."""
    text = [c for c in categories if c in ("code", "prose")]
    if not text:
        return []
    try:
        tok = _tokenizer(model_path)
    except Exception as e:
        return [f"workload.contents={categories}: {', '.join(text)} need the model's tokenizer, which did not load "
                f"from {model_path} ({type(e).__name__}: {e}). Use contents=[random], or a model with a tokenizer."]
    problems = []
    for c in text:
        if c == "code" and (Path(model_path) / "heldout.npy").is_file():
            continue
        try:
            content = load_content(c, model_path, tok)
        except ValueError as e:
            problems.append(f"workload.contents: {e}.")
            continue
        share = unknown_share(tok, content.ids)  # type: ignore[arg-type]
        if share > MAX_UNKNOWN_SHARE:
            problems.append(f"workload.contents: content={c} means nothing on this model: its tokenizer maps "
                            f"{share:.0%} of the text to its unknown token ({model_path} has a word-level "
                            "tokenizer of random weights?). Use a trained model (model=tiny-trained) or "
                            "contents=[random].")
    return problems

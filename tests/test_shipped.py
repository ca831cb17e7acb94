"""The trained presets shipped with the project (harness/shipped/tiny-trained and its speculative
target harness/shipped/tiny-trained-target): their files are the ones their SHA256SUMS record,
each is the checkpoint its preset trains (so runs take it and nothing trains on first use), and a
preset or training code changed since does not take it. The lookup reads the stored preset back
through ModelShape, so a field added to ModelShape since (with its default) keeps the match. The
target reuses the draft's tokenizer: the same bytes, the same vocabulary, the same held-out ids,
and it no longer matches once the draft's shipped tokenizer changes."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import harness.core.train as train
from harness.checkpoint import (CHECKSUMS_FILE, PRESET_FILE, SHIPPED_DIR, cached_path, checksum_problems,
                                shipped_checkpoint, shipped_mismatch, write_checksums)
from harness.core.presets import load_preset
from harness.core.train import HELDOUT_FILE, TRAINING_FILE, corpus_files, split_files

SHIPPED = SHIPPED_DIR / "tiny-trained"
DRAFT, TARGET = "tiny-trained", "tiny-trained-target"  # the speculative pair: one tokenizer
TARGET_DIR = SHIPPED_DIR / TARGET
PRESETS = [DRAFT, TARGET]


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the shipped checkpoints' directory, to change."""
    root = tmp_path / "shipped"
    for name in PRESETS:
        shutil.copytree(SHIPPED_DIR / name, root / name)
    return root


@pytest.mark.parametrize("name", PRESETS)
def test_the_shipped_files_are_the_recorded_ones(name: str) -> None:
    assert checksum_problems(SHIPPED_DIR / name) == []


@pytest.mark.parametrize("name", PRESETS)
def test_runs_take_the_shipped_checkpoint_of_the_preset(name: str, tmp_path: Path) -> None:
    shape = load_preset(name)
    assert shipped_mismatch(shape) is None
    assert cached_path(shape, tmp_path / "empty-cache") == SHIPPED_DIR / name  # nothing to train, whatever the cache holds


@pytest.mark.parametrize("name", PRESETS)
def test_the_shipped_record_is_complete(name: str) -> None:
    """What training.json holds for the shipped weights: the corpus and its file list, the Python it
    was trained on, the seed, the settings of the preset, the loss curve and the held-out figures."""
    d = SHIPPED_DIR / name
    record = json.loads((d / TRAINING_FILE).read_text())
    shape = load_preset(name)
    files = record["corpus"]["file_list"]
    assert len(files) == record["corpus"]["files"] and files == sorted(files)
    train_files, held = split_files(files, record["seed"], shape.train["heldout_frac"])
    assert held == record["corpus"]["heldout_files"] and len(train_files) == record["corpus"]["train_files"]
    assert record["corpus"]["python"].count(".") == 2 and record["seed"] == 0
    assert record["train"]["steps"] == shape.train["steps"] == record["loss_curve"][-1]["step"] + 1
    assert record["loss_curve"][-1]["loss"] < record["loss_curve"][0]["loss"]
    held_ids = np.load(d / HELDOUT_FILE)
    assert len(held_ids) == record["corpus"]["heldout_tokens"] and held_ids.max() < shape.vocab_size


def test_a_changed_missing_or_unlisted_file_is_named(copy: Path) -> None:
    d = copy / "tiny-trained"
    held = np.load(d / HELDOUT_FILE)
    held[0] ^= 1
    np.save(d / HELDOUT_FILE, held)
    (d / "tokenizer.json").unlink()
    (d / "notes.txt").write_text("not part of the checkpoint")
    assert sorted(checksum_problems(d)) == [f"{HELDOUT_FILE}: its SHA-256 is not the recorded one",
                                            f"notes.txt: not in {CHECKSUMS_FILE}", "tokenizer.json: missing"]
    write_checksums(d)
    assert checksum_problems(d) == []


def test_a_preset_changed_since_is_trained_into_the_cache_instead(copy: Path, tmp_path: Path) -> None:
    shape = load_preset("tiny-trained")
    assert shipped_checkpoint(shape, root=copy) == copy / "tiny-trained"
    wider = dataclasses.replace(shape, hidden_size=256)
    longer = dataclasses.replace(shape, train={**shape.train, "steps": shape.train["steps"] + 1})
    assert "another shape" in shipped_mismatch(wider, root=copy)
    assert "other settings" in shipped_mismatch(longer, root=copy)
    assert "seed 0, not 1" in shipped_mismatch(shape, seed=1, root=copy)
    path = cached_path(longer, tmp_path)
    assert path.parent == tmp_path and path.name.startswith(f"tiny-trained-py{sys.version_info.major}.")


@pytest.mark.parametrize("name", PRESETS)
def test_a_change_of_the_training_code_leaves_the_shipped_checkpoint(name: str, copy: Path, monkeypatch) -> None:
    monkeypatch.setattr(train, "TRAIN_FORMAT", train.TRAIN_FORMAT + 1)
    assert "TRAIN_FORMAT" in shipped_mismatch(load_preset(name), root=copy)


def test_a_field_added_to_the_shape_since_keeps_the_match_and_one_removed_does_not(copy: Path) -> None:
    shape = load_preset("tiny-trained")
    meta = copy / "tiny-trained" / PRESET_FILE
    stored = json.loads(meta.read_text())
    older = {**stored, "preset": {k: v for k, v in stored["preset"].items() if k not in ("sliding_window",
                                                                                         "rope_scaling")}}
    meta.write_text(json.dumps(older))  # written before ModelShape had these two (defaults: None)
    assert shipped_mismatch(shape, root=copy) is None
    meta.write_text(json.dumps({**stored, "preset": {**stored["preset"], "a_field_since_removed": 1}}))
    assert "another shape" in shipped_mismatch(shape, root=copy)


@pytest.mark.parametrize("name", PRESETS)
def test_the_corpus_rule_still_selects_the_shipped_corpus_files(name: str) -> None:
    """On the Python the shipped checkpoint was trained on, today's corpus rule picks its files;
    elsewhere the stdlib differs and only the rule's exclusions are checked."""
    record = json.loads((SHIPPED_DIR / name / TRAINING_FILE).read_text())
    files = record["corpus"]["file_list"]
    assert not any(set(f.split("/")[:-1]) & train.EXCLUDED_PARTS for f in files)
    if record["corpus"]["python"] == ".".join(map(str, sys.version_info[:3])):
        assert corpus_files() == files


# ---- the speculative pair: tiny-trained-target and its draft tiny-trained -------------------

def test_the_target_and_its_draft_share_one_tokenizer_and_vocabulary() -> None:
    """Token ids mean the same in both: the tokenizer files are the same bytes (the ones the
    target's record names), the vocabulary sizes are equal, and the held-out text (the same files)
    is the same ids."""
    from transformers import AutoConfig, AutoTokenizer
    draft, target = load_preset(DRAFT), load_preset(TARGET)
    assert target.train["tokenizer_from"] == DRAFT
    assert draft.vocab_size == target.vocab_size
    assert AutoConfig.from_pretrained(SHIPPED).vocab_size == AutoConfig.from_pretrained(TARGET_DIR).vocab_size
    record = json.loads((TARGET_DIR / TRAINING_FILE).read_text())
    for name in train.TOKENIZER_FILES:
        assert (TARGET_DIR / name).read_bytes() == (SHIPPED / name).read_bytes(), name
        assert record["tokenizer"][name] == train.file_sha256(SHIPPED / name)
    assert record["corpus"]["heldout_files"] == json.loads((SHIPPED / TRAINING_FILE).read_text())["corpus"]["heldout_files"]
    assert np.array_equal(np.load(TARGET_DIR / HELDOUT_FILE), np.load(SHIPPED / HELDOUT_FILE))
    text = "class Spam(object):\n    def eggs(self, n=3):\n        return [self] * n  # ham\n"
    ids = AutoTokenizer.from_pretrained(SHIPPED)(text)["input_ids"]
    assert AutoTokenizer.from_pretrained(TARGET_DIR)(text)["input_ids"] == ids and max(ids) < draft.vocab_size


def test_the_target_is_larger_and_clearly_better_than_its_draft() -> None:
    """The target's held-out perplexity, beside the draft's on the same windows (its record scores
    the shipped draft too): well below it, else acceptance measures nothing. The draft's figure there
    is the draft's own record's (the same windows, the same weights)."""
    draft, target = load_preset(DRAFT), load_preset(TARGET)
    assert target.num_parameters() >= 4 * draft.num_parameters()
    record = json.loads((TARGET_DIR / TRAINING_FILE).read_text())
    own = json.loads((SHIPPED / TRAINING_FILE).read_text())["heldout"]
    beside = record["baselines"][DRAFT]
    assert beside["tokens"] == own["tokens"] and beside["perplexity"] == pytest.approx(own["perplexity"], rel=1e-4)
    assert record["heldout"]["perplexity"] < 0.8 * beside["perplexity"]


def test_the_target_stores_bfloat16_weights_computed_in_float32() -> None:
    from safetensors import safe_open
    import torch
    with safe_open(str(TARGET_DIR / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
        count = sum(f.get_tensor(k).numel() for k in f.keys())
    assert dtypes == {torch.bfloat16} and count == load_preset(TARGET).num_parameters()  # tied: one embedding
    assert json.loads((TARGET_DIR / "config.json").read_text())["dtype"] == load_preset(TARGET).dtype == "float32"
    record = json.loads((TARGET_DIR / TRAINING_FILE).read_text())
    assert record["train"]["save_dtype"] == "bfloat16" and "heldout_float32" in record


@pytest.mark.slow
def test_the_recorded_target_figures_are_those_of_the_shipped_weights() -> None:
    """transformers, loading the shipped (bfloat16-stored) target in float32, scores the recorded
    held-out windows to the recorded perplexity."""
    import torch
    from transformers import AutoModelForCausalLM
    record = json.loads((TARGET_DIR / TRAINING_FILE).read_text())
    cfg = train.TrainConfig.from_mapping(record["train"])
    windows = train.eval_windows(np.load(TARGET_DIR / HELDOUT_FILE), cfg.seq_len, cfg.eval_windows)
    model = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32)
    assert train.model_scores(model, windows)["perplexity"] == pytest.approx(record["heldout"]["perplexity"], rel=1e-4)


def test_the_target_leaves_its_shipped_checkpoint_when_the_draft_does_or_its_tokenizer_changes(
        copy: Path, tmp_path: Path, monkeypatch) -> None:
    """The target's shipped checkpoint is taken only beside its draft's, with the draft's tokenizer
    byte for byte; trained into the cache instead, its name follows the draft's tokenizer."""
    import harness.checkpoint
    target = load_preset(TARGET)
    assert shipped_mismatch(target, root=copy) is None
    tok = copy / DRAFT / "tokenizer.json"
    original = tok.read_bytes()
    tok.write_bytes(original.replace(b'"<unk>"', b'"<UNK>"'))
    assert "tokenizer files are not those of" in shipped_mismatch(target, root=copy)
    tok.write_bytes(original)
    (copy / DRAFT / TRAINING_FILE).unlink()
    assert "reuses tiny-trained's tokenizer, whose shipped checkpoint runs do not take" in shipped_mismatch(target, root=copy)

    monkeypatch.setattr(harness.checkpoint, "SHIPPED_DIR", copy)
    shutil.copy(SHIPPED / TRAINING_FILE, copy / DRAFT / TRAINING_FILE)
    shutil.rmtree(copy / TARGET)  # the target to train, its draft shipped
    first = cached_path(target, tmp_path)
    assert first.parent == tmp_path and first.name.startswith(f"{TARGET}-py")
    tok.write_bytes(original.replace(b'"<unk>"', b'"<UNK>"'))  # another shipped draft tokenizer: another name
    assert cached_path(target, tmp_path).name != first.name

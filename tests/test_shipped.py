"""The trained preset shipped with the project (harness/shipped/tiny-trained): its files are the
ones its SHA256SUMS records, it is the checkpoint the preset trains (so runs take it and nothing
trains on first use), and a preset or training code changed since does not take it. The lookup
reads the stored preset back through ModelShape, so a field added to ModelShape since (with its
default) keeps the match."""

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


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the shipped checkpoints' directory, to change."""
    root = tmp_path / "shipped"
    shutil.copytree(SHIPPED, root / "tiny-trained")
    return root


def test_the_shipped_files_are_the_recorded_ones() -> None:
    assert checksum_problems(SHIPPED) == []


def test_runs_take_the_shipped_checkpoint_of_the_preset(tmp_path: Path) -> None:
    shape = load_preset("tiny-trained")
    assert shipped_mismatch(shape) is None
    assert cached_path(shape, tmp_path / "empty-cache") == SHIPPED  # nothing to train, whatever the cache holds


def test_the_shipped_record_is_complete() -> None:
    """What training.json holds for the shipped weights: the corpus and its file list, the Python it
    was trained on, the seed, the settings of the preset, the loss curve and the held-out figures."""
    record = json.loads((SHIPPED / TRAINING_FILE).read_text())
    shape = load_preset("tiny-trained")
    files = record["corpus"]["file_list"]
    assert len(files) == record["corpus"]["files"] and files == sorted(files)
    train_files, held = split_files(files, record["seed"], shape.train["heldout_frac"])
    assert held == record["corpus"]["heldout_files"] and len(train_files) == record["corpus"]["train_files"]
    assert record["corpus"]["python"].count(".") == 2 and record["seed"] == 0
    assert record["train"]["steps"] == shape.train["steps"] == record["loss_curve"][-1]["step"] + 1
    assert record["loss_curve"][-1]["loss"] < record["loss_curve"][0]["loss"]
    held_ids = np.load(SHIPPED / HELDOUT_FILE)
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


def test_a_change_of_the_training_code_leaves_the_shipped_checkpoint(copy: Path, monkeypatch) -> None:
    monkeypatch.setattr(train, "TRAIN_FORMAT", train.TRAIN_FORMAT + 1)
    assert "TRAIN_FORMAT" in shipped_mismatch(load_preset("tiny-trained"), root=copy)


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


def test_the_corpus_rule_still_selects_the_shipped_corpus_files() -> None:
    """On the Python the shipped checkpoint was trained on, today's corpus rule picks its files;
    elsewhere the stdlib differs and only the rule's exclusions are checked."""
    record = json.loads((SHIPPED / TRAINING_FILE).read_text())
    files = record["corpus"]["file_list"]
    assert not any(set(f.split("/")[:-1]) & train.EXCLUDED_PARTS for f in files)
    if record["corpus"]["python"] == ".".join(map(str, sys.version_info[:3])):
        assert corpus_files() == files

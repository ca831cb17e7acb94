"""Trained presets (harness.core.train): the corpus rule, the split by file, the cache name, and a
seconds-long smoke training whose checkpoint transformers loads. The full tiny-trained preset is
never trained here (minutes): it is shipped (harness/shipped/, tests/test_shipped.py), made by
`infer-bench-model --train --preset tiny-trained --out DIR`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from harness.checkpoint import checksum_problems
from harness.core.parity import thresholds
from harness.core.presets import ModelShape, load_preset
from harness.core.train import (HELDOUT_FILE, TRAINING_FILE, TrainConfig, corpus_files, split_files,
                                train_checkpoint, trained_name, unigram_perplexity)
from workloads.parity import PROMPT_LENS, TRAINED_PROMPT_LENS, Parity, heldout_prompts, trained_here

REPO = Path(__file__).resolve().parent.parent
# a seconds-long training: a one-layer model on the first files of the stdlib
SMOKE_SHAPE = ModelShape(name="smoke-trained", architecture="llama", num_hidden_layers=1, hidden_size=64,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
                         vocab_size=512, max_position_embeddings=512, train={})
SMOKE = TrainConfig(steps=16, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=2, max_files=10,
                    heldout_frac=0.25, eval_windows=4, log_every=3)


def smoke_train(out: Path, seed: int = 0) -> dict:
    return train_checkpoint(SMOKE_SHAPE, out, SMOKE, seed=seed, progress=False).record


@pytest.fixture(scope="module")
def smoke_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smoke-trained") / "ckpt"
    smoke_train(out)
    return out


def fake_stdlib(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_corpus_is_sorted_and_leaves_out_tests_and_packages(tmp_path: Path) -> None:
    root = fake_stdlib(tmp_path, {"b.py": "b", "a.py": "a", "json/decoder.py": "d", "test/test_a.py": "t",
                                  "site-packages/pkg/x.py": "x", "idlelib/run.py": "i", "json/tests/t.py": "t",
                                  "notes.txt": "n"})
    assert corpus_files(root) == ["a.py", "b.py", "json/decoder.py"]
    assert corpus_files(root, max_files=2) == ["a.py", "b.py"]


def test_split_is_by_file_and_stable_when_files_are_added() -> None:
    files = [f"m{i:03d}.py" for i in range(400)]
    train, held = split_files(files, seed=0, frac=0.1)
    assert set(train) | set(held) == set(files) and not set(train) & set(held)
    assert 20 <= len(held) <= 60                       # about 10 % of the files
    more = sorted(files + [f"new{i}.py" for i in range(50)])
    _, held2 = split_files(more, seed=0, frac=0.1)
    assert set(held) <= set(held2)                     # a file's side does not depend on the other files
    _, held_other_seed = split_files(files, seed=1, frac=0.1)
    assert set(held_other_seed) != set(held)


def test_cache_name_says_python_version_and_changes_with_the_corpus(tmp_path: Path) -> None:
    shape = load_preset("tiny-trained")
    cfg = TrainConfig.from_mapping(shape.train)
    root = fake_stdlib(tmp_path, {"a.py": "x = 1\n", "b.py": "y = 2\n"})
    name = trained_name(shape, cfg, 0, root)
    assert name.startswith(f"tiny-trained-py{sys.version_info.major}.{sys.version_info.minor}.")
    assert trained_name(shape, cfg, 0, root) == name                 # deterministic
    assert trained_name(shape, cfg, 1, root) != name                 # another seed
    (root / "b.py").write_text("y = 3\n")                            # another Python's stdlib
    assert trained_name(shape, cfg, 0, root) != name


def test_bad_training_settings_are_named() -> None:
    with pytest.raises(ValueError, match="unknown training setting.*stepz"):
        TrainConfig.from_mapping({"stepz": 3})


def test_unigram_perplexity_of_a_uniform_stream_is_the_vocabulary() -> None:
    ids = np.arange(64).repeat(10)
    assert unigram_perplexity(ids, ids, 64) == pytest.approx(64)
    # a stream of one token: the held-out token it never saw costs more than one it saw
    seen = np.zeros(100, dtype=int)
    assert unigram_perplexity(seen, np.array([0]), 8) < unigram_perplexity(seen, np.array([5]), 8)


def test_smoke_training_writes_a_checkpoint_transformers_loads(smoke_ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    record = json.loads((smoke_ckpt / TRAINING_FILE).read_text())
    curve = [p["loss"] for p in record["loss_curve"]]
    assert len(curve) >= 3 and curve[-1] < curve[0]              # it learned something
    assert record["heldout"]["perplexity"] < record["initial_model"]["perplexity"]
    assert record["corpus"]["heldout_files"] and record["corpus"]["python"] == ".".join(map(str, sys.version_info[:3]))
    held = np.load(smoke_ckpt / HELDOUT_FILE)
    assert held.dtype == np.int32 and len(held) == record["corpus"]["heldout_tokens"] and held.max() < 512
    model = AutoModelForCausalLM.from_pretrained(smoke_ckpt)
    assert model.config.num_hidden_layers == 1 and model.config.vocab_size == 512
    tok = AutoTokenizer.from_pretrained(smoke_ckpt)
    text = "def f(x):\n    return x  # é\n"
    assert tok.decode(tok(text)["input_ids"]) == text            # byte-level BPE: lossless
    assert tok.convert_tokens_to_ids(["<pad>", "<s>", "</s>", "<unk>"]) == [0, 1, 2, 3]


@pytest.mark.slow
def test_same_seed_same_weights(smoke_ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    smoke_train(tmp_path / "again")
    a, b = load_file(smoke_ckpt / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_model_cli_train_refuses_random_presets_and_stray_steps(tmp_path: Path) -> None:
    for args, says in ((["--train", "--preset", "tiny"], "not a trained preset"),
                       (["--preset", "tiny", "--steps", "3", "--out", str(tmp_path / "x")], "--steps 3"),
                       (["--preset", "tiny"], "--out is missing")):
        r = subprocess.run([sys.executable, "-m", "harness.model_cli", *args], capture_output=True, text=True,
                           cwd=REPO, timeout=120)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


@pytest.mark.slow
def test_model_cli_trains_a_preset_into_out(tmp_path: Path) -> None:
    """The command line's whole route on the real corpus (two steps: the tokenizer and the
    baselines are what takes the time): a loadable checkpoint and the figures printed."""
    out = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-m", "harness.model_cli", "--train", "--preset", "tiny-trained", "--steps", "2",
                        "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "held-out perplexity" in r.stdout and "unigram perplexity" in r.stdout and "random_preset" in r.stdout
    record = json.loads((out / TRAINING_FILE).read_text())
    assert record["train"]["steps"] == 2 and record["corpus"]["files"] > 100
    assert json.loads((out / "infer_bench_preset.json").read_text())["preset"]["name"] == "tiny-trained"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file() and (out / HELDOUT_FILE).is_file()
    assert checksum_problems(out) == []  # what a shipped checkpoint's test checks: its SHA256SUMS


def test_model_cli_does_not_retrain_the_shipped_preset(tmp_path: Path) -> None:
    from harness.checkpoint import shipped_mismatch
    assert shipped_mismatch(load_preset("tiny-trained")) is None  # else the command would train (minutes)
    r = subprocess.run([sys.executable, "-m", "harness.model_cli", "--train", "--preset", "tiny-trained",
                        "--model-cache-dir", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "shipped with infer-bench" in r.stdout and "every file as recorded in SHA256SUMS" in r.stdout, r.stdout
    assert "held-out perplexity" in r.stdout and not any(tmp_path.iterdir())  # printed its record, trained nothing


def _parity_row(engine: str, model_path: Path, top_lp: list[list[float]]) -> dict:
    n = len(top_lp)
    return {"workload": "parity", "status": "ok", "engine": engine, "dtype": "bfloat16", "model_path": str(model_path),
            "point": {"prompt_lens": [8], "tokens": n}, "parity_tokens": [[5] * n],
            "parity_scores": [{"top_ids": [list(range(8))] * n, "top_logprobs": top_lp,
                               "target_logprobs": [lp[0] for lp in top_lp]}]}


def test_parity_judges_a_checkpoint_trained_here_by_the_trained_thresholds(smoke_ckpt: Path, tmp_path: Path) -> None:
    """Same scores, two checkpoints: one trained here (training.json, held-out text) is held to the
    tighter trained-checkpoint thresholds, any other to the random-weight presets'. The scores
    differ by a mean KL between the two bf16 bounds, so only the trained checkpoint fails."""
    random_dir = tmp_path / "random"
    random_dir.mkdir()
    (random_dir / "config.json").write_text("{}")
    assert trained_here(str(smoke_ckpt)) and not trained_here(str(random_dir))
    held = np.load(smoke_ckpt / HELDOUT_FILE)
    prompts = heldout_prompts(str(smoke_ckpt), [8, 16])
    assert [len(p) for p in prompts] == [8, 16] and prompts[1] == list(map(int, held[len(held) - 17:len(held) - 1]))

    base_lp = [[-0.1 - 2.0 * i for i in range(8)] for _ in range(4)]
    eng_lp = [[v + (0.1 if i == 0 else -0.1) for i, v in enumerate(lp)] for lp in base_lp]
    trained_kl, random_kl = thresholds("bfloat16", True)[1], thresholds("bfloat16", False)[1]
    for model_path, expected in ((random_dir, "ok"), (smoke_ckpt, "failed")):
        rows = [_parity_row("reference", model_path, base_lp), _parity_row("hf", model_path, eng_lp)]
        Parity().finalize_row(rows[1], rows)
        assert trained_kl < rows[1]["parity_mean_kl"] < random_kl, rows[1]["parity_mean_kl"]  # between the two bounds
        assert rows[1]["status"] == expected, rows[1].get("error")
        assert rows[1]["parity_thresholds"]["set"] == ("trained checkpoint" if expected == "failed" else "random weights")


def _parity_lens(*overrides: str) -> tuple[list[int], int]:
    """The parity prompt lengths a run plans, and the run's max_model_len."""
    from harness.cli import compose_job
    from harness.config import build_plan
    plan = build_plan(compose_job(["engines=[reference]", *overrides]))
    return next(w.cfg.prompt_lens for w in plan.workloads if w.workload.name == "parity"), plan.max_model_len


def test_parity_prompts_are_longer_on_a_model_trained_here(smoke_ckpt: Path) -> None:
    """Where prompt_lens is not given: up to 512 tokens on random weights, up to 2048 on a
    trained preset (a 1 % RoPE error leaves bf16's rounding only there), cut to a trained
    checkpoint's positions; lengths given are kept."""
    assert _parity_lens("model=tiny", "workload=parity")[0] == PROMPT_LENS
    assert _parity_lens("model=tiny-trained", "workload=parity") == (TRAINED_PROMPT_LENS, 2048 + 32 + 1)
    assert _parity_lens("model=tiny-trained", "workload=parity", "workload.prompt_lens=[64]")[0] == [64]
    # the parity check a run adds after its main workload follows the model too
    main = ("workload.batch_sizes=[1]", "workload.prompt_lens=[16]", "workload.output_len=4")
    assert _parity_lens("model=tiny-trained", *main)[0] == TRAINED_PROMPT_LENS
    assert _parity_lens("model=tiny", *main)[0] == PROMPT_LENS
    # a checkpoint trained here, by path: its 512 positions hold prompts of at most 512 - 32 - 1
    lens, _ = _parity_lens("model=local", f"model.path={smoke_ckpt}", "workload=parity")
    assert lens == [128, 512 - 32 - 1], lens


def test_parity_runs_on_the_trained_preset_where_it_is_cached(tmp_path: Path, monkeypatch) -> None:
    """workload=parity with no model named takes tiny-trained where its checkpoint is shipped (as
    it is) or trained and cached here, and never trains it for a default; a model named is kept."""
    import harness.checkpoint
    from harness.checkpoint import cached_path
    from harness.cli import PARITY_MODEL, parity_model
    args = ["workload=parity", f"model_cache_dir={tmp_path}"]
    assert parity_model(args) == args + [f"model={PARITY_MODEL}"]  # the shipped checkpoint
    monkeypatch.setattr(harness.checkpoint, "SHIPPED_DIR", tmp_path / "nothing-shipped")
    assert parity_model(args) == args  # neither shipped nor trained here: random weights
    cached = cached_path(load_preset(PARITY_MODEL), tmp_path)
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert parity_model(args) == args + [f"model={PARITY_MODEL}"]
    assert parity_model(args + ["model=tiny"]) == args + ["model=tiny"]
    assert parity_model(["workload=sweep", f"model_cache_dir={tmp_path}"]) == ["workload=sweep", f"model_cache_dir={tmp_path}"]


def test_a_preset_reusing_a_tokenizer_copies_it_and_stores_bfloat16(smoke_ckpt: Path, tmp_path: Path) -> None:
    """A second smoke model with the first one's tokenizer (tokenizer_from, as a speculative
    target beside its draft) and its weights stored in bfloat16: the tokenizer files are the
    same bytes, the held-out stream the same ids, the stored weights bfloat16 that transformers
    computes in float32, and the figures recorded are those of the stored weights."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from harness.core.train import TOKENIZER_FILES, eval_windows, model_scores
    cfg = dataclasses.replace(SMOKE, tokenizer_from="smoke-trained", save_dtype="bfloat16", steps=4)
    out = tmp_path / "target"
    record = train_checkpoint(SMOKE_SHAPE, out, cfg, progress=False, tokenizer_dir=smoke_ckpt).record
    assert all((out / n).read_bytes() == (smoke_ckpt / n).read_bytes() for n in TOKENIZER_FILES)
    assert np.array_equal(np.load(out / HELDOUT_FILE), np.load(smoke_ckpt / HELDOUT_FILE))
    assert record["tokenizer"]["from"] == "smoke-trained"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    windows = eval_windows(np.load(out / HELDOUT_FILE), SMOKE.seq_len, SMOKE.eval_windows)
    assert model_scores(model, windows)["perplexity"] == pytest.approx(record["heldout"]["perplexity"], rel=1e-5)
    assert record["heldout_float32"]["perplexity"] != record["heldout"]["perplexity"]  # rounding moved it


def test_a_tokenizer_of_another_split_or_size_is_refused(smoke_ckpt: Path, tmp_path: Path) -> None:
    other_split = dataclasses.replace(SMOKE, tokenizer_from="smoke-trained", heldout_frac=0.1)
    with pytest.raises(ValueError, match="another split of the corpus"):
        train_checkpoint(SMOKE_SHAPE, tmp_path / "a", other_split, progress=False, tokenizer_dir=smoke_ckpt)
    wider = dataclasses.replace(SMOKE_SHAPE, vocab_size=1024)
    with pytest.raises(ValueError, match="has 512 tokens.*set vocab_size to 512"):
        train_checkpoint(wider, tmp_path / "b", dataclasses.replace(SMOKE, tokenizer_from="smoke-trained"),
                         progress=False, tokenizer_dir=smoke_ckpt)
    with pytest.raises(ValueError, match="tokenizer_from=None needs"):  # a directory but no setting
        train_checkpoint(SMOKE_SHAPE, tmp_path / "c", SMOKE, progress=False, tokenizer_dir=smoke_ckpt)


def test_cache_name_covers_the_reused_tokenizer_and_the_new_settings(tmp_path: Path) -> None:
    shape = load_preset("tiny-trained")
    cfg = TrainConfig.from_mapping(shape.train)
    root = fake_stdlib(tmp_path, {"a.py": "x = 1\n", "b.py": "y = 2\n"})
    name = trained_name(shape, cfg, 0, root)
    assert trained_name(shape, cfg, 0, root, tokenizer="shipped:aa") != trained_name(shape, cfg, 0, root,
                                                                                     tokenizer="shipped:bb")
    assert trained_name(shape, dataclasses.replace(cfg, save_dtype="bfloat16"), 0, root) != name
    assert trained_name(shape, dataclasses.replace(cfg, tokenizer_from="x"), 0, root) != name


def test_bad_tokenizer_from_or_save_dtype_is_named() -> None:
    """A preset's train.tokenizer_from is checked when the preset is read: one clear message naming
    the field and the fix (exit 2 on the command line), nothing trained."""
    from harness.core.errors import UserError
    from harness.core.presets import shape_from_mapping
    with open(REPO / "conf" / "model" / "tiny-trained-target.yaml") as f:
        target = yaml.safe_load(f)
    assert shape_from_mapping(target).train["tokenizer_from"] == "tiny-trained"
    cases = [({"vocab_size": 8192}, "tiny-trained's tokenizer has 4096 tokens.*Set vocab_size: 4096"),
             ({"train": {**target["train"], "tokenizer_from": "nope"}}, "no such preset.*tiny-trained"),
             ({"train": {**target["train"], "tokenizer_from": "tiny"}}, "tiny is not a trained preset"),
             ({"train": {**target["train"], "tokenizer_from": "tiny-trained-target"}}, "cannot reuse its own"),
             ({"train": {**target["train"], "heldout_frac": 0.1}}, "heldout_frac=0.05.*heldout_frac=0.1")]
    for change, says in cases:
        with pytest.raises(UserError, match=f"model.train.tokenizer_from=.*{says}"):  # the field, then the fix
            shape_from_mapping({**target, **change})
    with pytest.raises(ValueError, match="save_dtype=float16: choose one of float32, bfloat16"):
        TrainConfig.from_mapping({"save_dtype": "float16"})
    r = subprocess.run([sys.executable, "-m", "harness.cli", "model=tiny-trained-target", "model.vocab_size=8192",
                        "engines=[reference]"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "Set vocab_size: 4096" in r.stderr and "Traceback" not in r.stderr, r.stderr

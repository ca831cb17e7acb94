"""Shared fixtures: locally materialised checkpoints (random weights, fixed seed); the --must-run option
(tests/plugins/must_run.py); the `alone` marker under pytest-xdist (tests/plugins/alone.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.checkpoint import ensure_checkpoint
from harness.core.presets import load_preset
from plugins import alone, must_run
from plugins.alone import pytest_runtest_protocol, pytest_unconfigure  # noqa: F401  (the `alone` marker)
from plugins.must_run import pytest_addoption  # noqa: F401  (--must-run GLOB)

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    must_run.pytest_configure(config)
    alone.pytest_configure(config)


def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("INFER_BENCH_CACHE")
    return Path(env) / "models" if env else tmp_path_factory.getbasetemp() / "model-cache"


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _cache_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_ckpt(model_cache: Path) -> Path:
    """The `tiny` preset (~5 M parameters, fp32) as a local Hugging Face checkpoint."""
    return ensure_checkpoint(load_preset("tiny"), model_cache)


@pytest.fixture(scope="session")
def small_ckpt(model_cache: Path) -> Path:
    """The `small` preset (~125 M parameters, bf16)."""
    return ensure_checkpoint(load_preset("small"), model_cache)


@pytest.fixture(scope="module")
def driver():
    """Headless Chromium for the browser tests (reports.browser); skipped, saying why, where none runs."""
    from reports import browser
    why = browser.missing()
    if why:
        pytest.skip(f"no headless browser: {why}")
    d = browser.chromium(1400, 1000)
    yield d
    d.quit()


TINY_FAMILIES = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3", "tiny-gemma3", "tiny-gpt-oss",
                 "tiny-qwen3-next")


@pytest.fixture(scope="session")
def family_ckpts(model_cache: Path) -> dict[str, Path]:
    """Every tiny family preset (MoE, latent attention, sliding windows, hybrid linear attention,
    qk-norm) as a local checkpoint, materialised once per session (well under a second each)."""
    return {name: ensure_checkpoint(load_preset(name), model_cache) for name in TINY_FAMILIES}

"""Where the project's files live: the Hydra configs and the model cache."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"


def model_cache_dir(configured: str | None = None) -> Path:
    """Directory for materialised model presets: config value, $INFER_BENCH_CACHE, or ~/.cache."""
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get("INFER_BENCH_CACHE")
    if env:
        return Path(env).expanduser() / "models"
    return Path.home() / ".cache" / "infer-bench" / "models"

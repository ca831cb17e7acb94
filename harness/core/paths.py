"""Where the project's files live: the Hydra configs and the model cache."""

from __future__ import annotations

import os
from pathlib import Path

import conf

# The directory that holds the `harness` package: the repository in a checkout or an editable
# install, site-packages in an installed copy.
REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = Path(conf.__file__).resolve().parent


def model_cache_dir(configured: str | None = None) -> Path:
    """Directory for materialised model presets: config value, $INFER_BENCH_CACHE, or ~/.cache."""
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get("INFER_BENCH_CACHE")
    if env:
        return Path(env).expanduser() / "models"
    return Path.home() / ".cache" / "infer-bench" / "models"

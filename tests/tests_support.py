"""Helpers shared by tests (not fixtures)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

from harness.core.paths import REPO_ROOT


def documented_fields() -> set[str]:
    """Field names listed (first column, in backticks) in docs/results-schema.md."""
    names: set[str] = set()
    for line in (REPO_ROOT / "docs" / "results-schema.md").read_text().splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([a-z0-9_]+)`", line.split("|")[1]))
    return names


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_python() -> Path | None:
    """An interpreter whose environment has vLLM: $INFER_BENCH_VLLM_PYTHON, else the project's
    .venv-vllm (make venv builds it), else this interpreter if it has vLLM; None when there is none."""
    env = os.environ.get("INFER_BENCH_VLLM_PYTHON")
    if env and Path(env).exists():
        return Path(env)
    local = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if local.exists():
        return local
    return Path(sys.executable) if vllm_available() else None

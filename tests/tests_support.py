"""Helpers shared by tests (not fixtures)."""

from __future__ import annotations

import importlib.util
import re

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

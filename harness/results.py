"""Results: one JSON object per line in results.jsonl, appended and flushed as each point
finishes, so a run killed at any moment keeps every finished row and the file still parses.

The schema (every field, unit and definition) is in docs/results-schema.md.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
RESULTS_FILE = "results.jsonl"
STATUSES = ("ok", "failed", "unavailable", "skipped")

# Fields every row carries (None where they do not apply).
BASE_FIELDS: dict[str, Any] = {
    "schema_version": SCHEMA_VERSION,
    "run_id": None, "timestamp": None,
    "engine": None, "engine_version": None, "model": None, "model_path": None,
    "workload": None, "point": None, "point_key": None,
    "batch_size": None, "prompt_len": None, "output_len": None,
    "dtype": None, "device": None, "status": None, "error": None,
    "prefill_latency_s": None, "prefill_tok_s": None,
    "decode_step_latency_s": None, "output_tok_s": None,
    "peak_memory_bytes": None, "kv_cache_bytes": None,
}


def make_row(**fields: Any) -> dict[str, Any]:
    row = dict(BASE_FIELDS)
    row.update(fields)
    if row["status"] not in STATUSES:
        raise ValueError(f"row status {row['status']!r} not in {STATUSES}")
    return row


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class ResultsWriter:
    """Appends rows to a JSONL file: one write, flush and fsync per row."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(_clean(row), default=str) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def results_files(paths: list[str | Path]) -> list[Path]:
    """Expand run directories (single runs and multiruns) into their results.jsonl files."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(p.rglob(RESULTS_FILE))
        elif p.exists():
            out.append(p)
    return out


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of one results file. A torn last line (a run killed mid-write) is skipped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # only the final line may be torn
                continue
            raise
    return rows


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace a file in one step (write a temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

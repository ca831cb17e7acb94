"""Results: one JSON object per line in results.jsonl, appended and flushed as each point
finishes, so a run killed at any moment keeps every finished row and the file still parses.

The schema (every field, unit and definition) is in docs/results-schema.md. `load_results` is
the one way results are read back (compare, the report, the multirun summary): it finds the
files, reads them, checks the schema version and picks up each run's environment.json.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.errors import UserError

SCHEMA_VERSION = 1
RESULTS_FILE = "results.jsonl"
ENVIRONMENT_FILE = "environment.json"
CONFIG_FILE = "config.resolved.yaml"
STATUSES = ("ok", "failed", "unavailable", "skipped", "unverified")

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


@dataclass
class RunFile:
    """One results file, its rows, and what its run directory recorded about the run."""

    path: Path
    rows: list[dict[str, Any]]
    environment: dict[str, Any] | None = None
    config_text: str | None = None
    other_version_rows: int = 0  # rows of another schema version, left out

    @property
    def directory(self) -> Path:
        return self.path.parent


def _read_json_file(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_results(paths: list[str | Path], what: str = "results",
                 other_versions: str = "refuse") -> list[RunFile]:
    """Every results file under `paths` (files, run directories, multirun directories), read.

    Rows of another schema version are refused (UserError: this version reads only its own) or,
    with other_versions="drop", left out and counted in `RunFile.other_version_rows`. Every
    problem (missing path, no results, unreadable file) is reported at once, naming `what`."""
    problems = []
    for p in map(Path, paths):
        if not p.exists():
            problems.append(f"{what} {p}: no such file or directory. Give results.jsonl files or run directories.")
        elif p.is_dir() and not results_files([p]):
            problems.append(f"{what} {p}: no {RESULTS_FILE} in this directory or below it. "
                            "Give a results file or an infer-bench run directory.")
    if problems:
        raise UserError(problems)
    files = list(dict.fromkeys(f.resolve() for f in results_files(list(paths))))
    if not files:
        raise UserError(f"no {what} given.")
    out = []
    for f in files:
        try:
            rows = [r for r in read_rows(f) if isinstance(r, dict)]
        except (OSError, UnicodeDecodeError) as e:
            problems.append(f"{what} {f}: cannot read ({e}).")
            continue
        except ValueError as e:
            problems.append(f"{what} {f}: not a results file (a line is not JSON: {e}).")
            continue
        other = [r for r in rows if r.get("schema_version") != SCHEMA_VERSION]
        if other and other_versions == "refuse":
            versions = sorted({str(r.get("schema_version")) for r in other})
            problems.append(f"{what} {f}: rows of results schema version {', '.join(versions)}; this infer-bench "
                            f"reads version {SCHEMA_VERSION} only. Re-run with this version (no migration exists "
                            "for older files).")
            continue
        rows = [r for r in rows if r.get("schema_version") == SCHEMA_VERSION]
        try:
            config_text = (f.parent / CONFIG_FILE).read_text(encoding="utf-8")
        except OSError:
            config_text = None
        out.append(RunFile(f, rows, _read_json_file(f.parent / ENVIRONMENT_FILE), config_text, len(other)))
    if problems:
        raise UserError(problems)
    return out

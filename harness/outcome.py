"""What a run (or a multirun's jobs) ends with: the exit code and the report.

Hydra's main returns nothing to its caller, so each job records its exit code here, and the
multirun callback adds what jobs in other processes reported. Process-global by necessity.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.core.errors import EXIT_OK
from reports import write_report

EXIT: dict[str, int] = {"code": EXIT_OK}


def record_exit(code: int) -> None:
    EXIT["code"] = max(EXIT["code"], code)


def write_run_report(out_dir: Path) -> None:
    """The HTML report next to the results. A report problem never loses measured results."""
    try:
        path = write_report([out_dir], out_dir / "report.html")
        print(f"report: {path}")
    except Exception as e:
        print(f"report: not written ({type(e).__name__}: {e})", file=sys.stderr)

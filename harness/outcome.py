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
# A multirun job's exit code, written into its own output directory: jobs that ran in other
# processes (hydra/launcher=joblib) cannot record theirs in this process's EXIT.
JOB_EXIT_FILE = "exit_code"


def record_exit(code: int) -> None:
    EXIT["code"] = max(EXIT["code"], code)


def write_job_exit(out_dir: Path, code: int) -> None:
    """Leave a multirun job's exit code where the multirun's end reads it (jobs_exit)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / JOB_EXIT_FILE).write_text(f"{code}\n")


def jobs_exit(sweep_dir: Path) -> int:
    """The highest exit code the jobs under a multirun's sweep directory left (write_job_exit)."""
    codes = [int(p.read_text().strip() or EXIT_OK) for p in sweep_dir.rglob(JOB_EXIT_FILE)]
    return max(codes, default=EXIT_OK)


def write_run_report(out_dir: Path) -> None:
    """The HTML report next to the results. A report problem never loses measured results."""
    try:
        path = write_report([out_dir], out_dir / "report.html")
        print(f"report: {path}")
    except Exception as e:
        print(f"report: not written ({type(e).__name__}: {e})", file=sys.stderr)

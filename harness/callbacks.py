"""Hydra callbacks: at the end of a multirun, one combined table (and report) over all jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from harness.core.errors import UserError
from harness.core.results import load_results
from harness.outcome import jobs_exit, record_exit, write_run_report
from workloads import get_workload, workload_names


class MultirunSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        record_exit(jobs_exit(sweep_dir))  # first: jobs may have run in other processes (joblib), rows or none
        try:
            files = load_results([sweep_dir], "multirun")
        except UserError as e:
            print(f"multirun: {e.problems[0]}")
            return
        rows = [r for f in files for r in f.rows]
        if not rows:
            print(f"multirun: no results under {sweep_dir}")
            return
        by_workload: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            by_workload.setdefault(r.get("workload") or "?", []).append(r)
        print(f"\nmultirun: {len(files)} results files, {len(rows)} rows")
        for name, wrows in by_workload.items():
            if name not in workload_names():
                continue
            print(f"\n== {name} ==")
            print(get_workload(name).summary(wrows))
        write_run_report(sweep_dir)

"""The harness's own worker code, shipped to the worker with its command.

An engine's environment (another venv, a conda env, a container image) does not have
infer-bench installed. Before a run starts its workers, the harness copies the packages a
worker imports - `harness/core`, `harness/protocol.py`, `harness/worker.py`, `harness/worker_job.py`,
`harness/engines.py`, `adapters`,
`workloads` and the configs in `conf` - into `<run_dir>/.worker-src/`, with a small start
script that puts that directory first on `sys.path`. A worker is then started as
`<interpreter or launch prefix> <run_dir>/.worker-src/infer_bench_worker.py`; a container needs
the run directory (and the model) mounted at the same path (the launch placeholders `{run_dir}`,
`{src}` and `{model}` give them).

The copy also records exactly which code measured the run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import adapters
import conf
import harness
import workloads

START_SCRIPT = "infer_bench_worker.py"
_START = '''"""Start an infer-bench worker from the source shipped beside this file (harness.bundle)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness.worker import main  # noqa: E402

main()
'''
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")


def _package_dir(module) -> Path:
    return Path(module.__file__).resolve().parent


def ship(run_dir: Path) -> Path:
    """Copy the worker's code into `run_dir/.worker-src` (replacing an older copy); returns the
    start script's path."""
    dest = Path(run_dir) / ".worker-src"
    if dest.exists():
        shutil.rmtree(dest)
    src = _package_dir(harness)
    (dest / "harness").mkdir(parents=True)
    for name in ("__init__.py", "protocol.py", "worker.py", "worker_job.py", "engines.py"):
        shutil.copy2(src / name, dest / "harness" / name)
    shutil.copytree(src / "core", dest / "harness" / "core", ignore=_IGNORE)
    for pkg in (adapters, workloads, conf):
        shutil.copytree(_package_dir(pkg), dest / pkg.__name__, ignore=_IGNORE)
    script = dest / START_SCRIPT
    script.write_text(_START)
    return script

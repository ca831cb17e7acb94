"""Locks that keep two runs from measuring, or writing, on top of each other.

- The run directory: a run (or a resume) holds `<run_dir>/.infer-bench.lock` while it writes.
  A second run into the same directory stops at once (exit 2), naming the live process. The
  lock is an flock, released by the kernel when its holder dies, so a stale lock (its process
  gone) is simply taken over.
- A GPU: two jobs on one device would measure each other; a job holds the device's lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from harness.core.errors import UserError

RUN_LOCK = ".infer-bench.lock"


def lock_run_dir(run_dir: Path) -> IO[str]:
    """Hold the run directory's lock until the returned file is closed (or the process ends)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / RUN_LOCK, "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        try:
            holder = json.loads(f.read() or "{}")
        except ValueError:
            holder = {}
        f.close()
        who = (f"process {holder.get('pid', '?')} ({holder.get('command', '?')}, started {holder.get('started', '?')})"
               if holder else "another process")
        raise UserError(f"hydra.run.dir={run_dir}: {who} is writing into this run directory now. Wait for it to "
                        "finish (or stop it), or give this run another directory.") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "command": " ".join(sys.argv)[:300],
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S")}))
    f.flush()
    return f


def lock_device(device: str) -> IO[str] | None:
    """Hold a lock on a GPU for the whole job: two jobs on one device would measure each other."""
    if not device.startswith("cuda"):
        return None
    index = device.split(":")[1] if ":" in device else "0"
    f = open(Path(tempfile.gettempdir()) / f"infer-bench-cuda{index}.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UserError(f"device={device}: another infer-bench job is running on this GPU. Two jobs on one "
                        "device would measure each other: wait for it, pick another device, or run the "
                        "multirun with hydra.launcher.n_jobs=1.") from None
    return f

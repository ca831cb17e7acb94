"""Keeps a launched server from outliving the process that launched it.

    python supervise.py PARENT_PID GRACE_S -- COMMAND...

Started as the leader of a new session (so the server and everything it starts share one
process group). It runs COMMAND in that group and exits with its exit status. If PARENT_PID goes
away (the harness's engine process was killed, e.g. by the point timeout, and could not stop the
server itself), it sends SIGTERM to the whole group, then SIGKILL after GRACE_S seconds. A
SIGTERM it receives (the harness stopping the group) it leaves to the server and waits for it.

Standard library only, run by file path: nothing is added to the server's environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _stop_group(grace_s: float) -> None:
    pgid = os.getpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.1)
        except ChildProcessError:
            break
    os.killpg(pgid, signal.SIGKILL)  # ends this process too


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: supervise.py PARENT_PID GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    parent, grace = int(argv[0]), float(argv[1])
    signal.signal(signal.SIGTERM, lambda *_: None)  # the group's SIGTERM is for the server; wait for it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = subprocess.Popen(argv[3:])
    except OSError as e:
        print(f"[infer-bench] cannot start the server command: {e}", file=sys.stderr, flush=True)
        return 127
    while True:
        try:
            code = child.wait(timeout=0.5)
            return code if code >= 0 else 128 - code
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:
            try:  # (the output pipe may have lost its reader with the harness)
                print("[infer-bench] the harness process is gone: stopping the server", file=sys.stderr, flush=True)
            except OSError:
                pass
            _stop_group(grace)
            os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A launched server's command as shell lines anyone can copy and run (the terminal summary of
workload=tune and the report's tuning section print the best configuration's this way)."""

from __future__ import annotations

import shlex
from typing import Any


def launch_script(command: str | None, env: dict[str, Any] | None = None, files: dict[str, str] | None = None,
                  indent: str = "") -> str:
    """Each options file the harness wrote (`files`: name -> text) as a here-document to the path
    the command names, then the environment it set (a variable it removed as env's `-u VAR`) and
    the command (already shell-quoted, as the rows' `launch_command`)."""
    lines: list[str] = []
    argv = shlex.split(command or "")
    for name, text in (files or {}).items():
        path = next((a for a in argv if a == name or a.endswith("/" + name)), name)
        lines += [f"cat > {shlex.quote(path)} <<'EOF'", *str(text).rstrip("\n").splitlines(), "EOF"]
    set_ = [f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items() if v is not None]
    unset = [f"-u {k}" for k, v in (env or {}).items() if v is None]
    head = ("env " + " ".join(unset + set_) + " ") if unset else (" ".join(set_) + " " if set_ else "")
    lines.append(head + (command or ""))
    return "\n".join(indent + x for x in lines)

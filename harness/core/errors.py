"""Errors a user can cause, reported as one clear message and exit code 2."""

from __future__ import annotations

EXIT_OK = 0
EXIT_POINT_FAILED = 1
EXIT_BAD_INPUT = 2


class UserError(Exception):
    """Bad input: a message that names the field and the fix. Never a traceback."""

    prog: str | None = None  # an error of one command's own (a subclass) names that command

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))

    def render(self, prog: str = "infer-bench") -> str:
        """The message command `prog` prints on stderr (every command line renders its errors
        here): `prog: error: ...`, or the problems one a line; an error with its own `prog`
        names that command instead."""
        prog = self.prog or prog
        if len(self.problems) == 1:
            return f"{prog}: error: {self.problems[0]}"
        lines = [f"{prog}: {len(self.problems)} problems in the input:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

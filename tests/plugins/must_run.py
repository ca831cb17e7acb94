"""`--must-run GLOB`: the session fails when a test that must run on this machine was skipped.

A suite that skips says why, and a skip is right where the machine lacks what the test needs (a
GPU, TensorRT-LLM). But where the project's own set-up provides it - the shipped trained preset,
vLLM in .venv-vllm - a skip hides a check that did not run, and the run would still be green. CI
names those tests (the Makefile's `test`):

    pytest --must-run 'tests/test_train_parity.py::*'

GLOB is matched (fnmatch) against each test's node id. The session exits 1 (pytest's "tests
failed") when a matching test was skipped - an expected failure (xfail) ran and is not a skip -
or when no test matched GLOB at all (the tests were removed, renamed or deselected: the check
compared nothing), and the terminal summary says which, each line starting `MUST-RUN`.
Registered by tests/conftest.py.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--must-run", action="append", default=[], metavar="GLOB",
                     help="fail the session when a test whose node id matches GLOB (fnmatch) was skipped, or when "
                          "no test matches GLOB (repeatable; CI names the suites that must run on this machine)")


def pytest_configure(config: pytest.Config) -> None:
    globs = config.getoption("--must-run", default=None)
    if globs and not hasattr(config, "workerinput"):  # a distributed run's controller collects the reports
        config.pluginmanager.register(MustRun(globs), "infer-bench-must-run")


class MustRun:
    def __init__(self, globs: list[str]) -> None:
        self.globs = list(globs)
        self.seen: set[str] = set()
        self.skipped: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        matched = [g for g in self.globs if fnmatch.fnmatchcase(report.nodeid, g)]
        if not matched:
            return
        self.seen.update(matched)
        if report.skipped and not hasattr(report, "wasxfail"):
            why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped[report.nodeid] = why.removeprefix("Skipped: ")

    def problems(self) -> list[str]:
        """Why the check fails (empty: it passes)."""
        return [f"{nodeid}: skipped ({reason})" for nodeid, reason in self.skipped.items()] + \
            [f"--must-run {g}: no test ran that matches it (removed, renamed or deselected?)"
             for g in self.globs if g not in self.seen]

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.problems() and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        found = self.problems()
        if found:
            terminalreporter.section("must-run tests that did not run", sep="=", red=True, bold=True)
            for line in found:
                terminalreporter.line(f"MUST-RUN {line}")
            terminalreporter.line("the session fails: these tests must run on this machine (--must-run); "
                                  "a skip would hide a check that did not run")

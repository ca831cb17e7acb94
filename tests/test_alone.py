"""The `alone` marker (tests/plugins/alone.py) under pytest-xdist: a small suite of sleeping tests
runs on two workers; each writes when it started and ended. The shared tests overlap each other
(the run was parallel), and no test overlaps the `alone` one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parent / "plugins"

CONFTEST = f"""
import sys
sys.path.insert(0, {str(PLUGINS.parent)!r})
from plugins import alone
from plugins.alone import pytest_runtest_protocol, pytest_unconfigure  # noqa: F401
def pytest_configure(config):
    config.addinivalue_line("markers", "alone: nothing beside it")
    alone.pytest_configure(config)
"""

SUITE = """
import json, os, time
import pytest

def stamp(name, seconds):
    t0 = time.time()
    time.sleep(seconds)
    with open(os.environ["STAMPS"], "a") as f:
        f.write(json.dumps({"name": name, "start": t0, "end": time.time()}) + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_shared(i):
    stamp(f"shared{i}", 0.4)

@pytest.mark.alone
def test_by_itself():
    stamp("alone", 0.8)

@pytest.mark.parametrize("i", range(6, 10))
def test_shared_after(i):
    stamp(f"shared{i}", 0.4)
"""


NEIGHBOUR = """
import json, os, time
import pytest

@pytest.mark.parametrize("i", range(40))
def test_neighbour(i):
    t0 = time.time()
    time.sleep(0.2)
    with open(os.environ["STAMPS"], "a") as f:
        f.write(json.dumps({"name": f"neighbour{i}", "start": t0, "end": time.time()}) + "\\n")
"""


def start_suite(tmp_path: Path, suite: str, *args: str, locks: Path | None = None) -> subprocess.Popen:
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (pip install -e '.[dev]')")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / f"test_{suite}.py").write_text({"suite": SUITE, "neighbour": NEIGHBOUR}[suite])
    env = {k: v for k, v in os.environ.items() if k != "INFER_BENCH_TEST_LOCKS"}
    env["STAMPS"] = str(tmp_path / "stamps.jsonl")
    if locks is not None:
        env["INFER_BENCH_TEST_LOCKS"] = str(locks)
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
                             str(tmp_path / f"test_{suite}.py")], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def finished(p: subprocess.Popen) -> None:
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 0, out[-3000:]


def stamps(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "stamps.jsonl").read_text().splitlines()]


def run_suite(tmp_path: Path, *args: str) -> list[dict]:
    finished(start_suite(tmp_path, "suite", "-n", "2", *args))
    return stamps(tmp_path)


def overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_an_alone_test_has_nothing_beside_it_and_the_rest_run_two_at_a_time(tmp_path):
    rows = run_suite(tmp_path)
    alone = next(r for r in rows if r["name"] == "alone")
    shared = [r for r in rows if r["name"] != "alone"]
    assert len(shared) == 10
    beside = [r["name"] for r in shared if overlap(r, alone)]
    assert not beside, f"ran beside the alone test: {beside}"
    assert any(overlap(a, b) for i, a in enumerate(shared) for b in shared[i + 1:]), "the run was not parallel"


def test_a_second_session_given_the_same_locks_stays_out_of_the_alone_test(tmp_path):
    """As vLLM's own tests beside the main suite (make test): a plain one-process session named the
    same INFER_BENCH_TEST_LOCKS holds the shared lock for each of its tests."""
    locks = tmp_path / "locks"
    beside = start_suite(tmp_path, "neighbour", locks=locks)  # 40 tests of 0.2 s: running throughout
    deadline = time.monotonic() + 60
    while not (tmp_path / "stamps.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    main = start_suite(tmp_path, "suite", "-n", "2", locks=locks)
    finished(main)
    finished(beside)
    rows = stamps(tmp_path)
    alone = next(r for r in rows if r["name"] == "alone")
    neighbours = [r for r in rows if r["name"].startswith("neighbour")]
    assert len(neighbours) == 40
    assert not [r["name"] for r in neighbours if overlap(r, alone)]
    others = [r for r in rows if r["name"].startswith("shared")]
    assert any(overlap(a, b) for a in neighbours for b in others), "the two sessions never ran side by side"

"""The `alone` marker (tests/plugins/alone.py) under pytest-xdist: a small suite of sleeping tests
runs on two workers; each writes when it started and ended. The shared tests overlap each other
(the run was parallel), and no test overlaps the `alone` one."""

from __future__ import annotations

import json
import subprocess
import sys
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


def run_suite(tmp_path: Path, *args: str) -> list[dict]:
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (pip install -e '.[dev]')")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_suite.py").write_text(SUITE)
    stamps = tmp_path / "stamps.jsonl"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", *args,
                        str(tmp_path / "test_suite.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "STAMPS": str(stamps)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [json.loads(line) for line in stamps.read_text().splitlines()]


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

"""infer-bench installed as a package, not from the source tree: `pip install` of the
built wheel into a fresh virtual environment, then `infer-bench` run from another directory finds
its Hydra configs (shipped as package data in `conf`) and runs. The fresh environment borrows
this one's third-party packages through a .pth file, so nothing is downloaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from harness.core.paths import REPO_ROOT

pytestmark = pytest.mark.slow


def test_a_non_editable_install_finds_its_configs_from_anywhere(tmp_path, tiny_ckpt, model_cache):
    src = tmp_path / "src"  # built from a copy: setuptools writes build/ into the tree it builds
    shutil.copytree(REPO_ROOT, src, ignore=shutil.ignore_patterns(".venv*", ".git", "runs", "build", "*.egg-info",
                                                                    "__pycache__", ".pytest_cache"))
    wheels = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(wheels), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = wheels.glob("infer_bench-*.whl")
    env_dir = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    site = next(env_dir.glob("lib/python*/site-packages"))
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([str(env_dir / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["INFER_BENCH_CACHE"] = str(model_cache.parent)
    where = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import conf, harness; print(harness.__file__); "
                            "print(conf.__file__)"], cwd=elsewhere, capture_output=True, text=True, env=env)
    assert str(site) in where.stdout and str(REPO_ROOT) not in where.stdout, where.stdout + where.stderr
    out = tmp_path / "run"
    r = subprocess.run([str(env_dir / "bin" / "infer-bench"), "engines=[hf]", "model=tiny", "quiet=true",
                        "roofline=false", "parity=false", "workload.batch_sizes=[1]", "workload.prompt_lens=[8]",
                        "workload.output_len=2", "workload.min_repeats=1", "workload.min_duration_s=0",
                        f"hydra.run.dir={out}"], cwd=elsewhere, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [x["status"] for x in rows] == ["ok"]
    assert rows[0]["worker_python"].startswith(str(env_dir))  # the worker ran from the installed copy too

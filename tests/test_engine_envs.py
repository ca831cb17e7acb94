"""Engines in environments of their own: the worker under another interpreter or a launch prefix,
speaking the versioned protocol; and every way that can go wrong (the bad inputs)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import psutil
import pytest

from harness.cli import check_jobs
from harness.core.results import read_rows
from harness.protocol import PROTOCOL_VERSION
from tests_support import vllm_python

HERE = Path(__file__).resolve().parent
BASE = ["model=tiny", "quiet=true", "roofline=false", "parity=false", "workload.batch_sizes=[1]",
        "workload.prompt_lens=[8]", "workload.output_len=2", "workload.min_repeats=1", "workload.warmup=1",
        "workload.min_duration_s=0"]


def run(args, cache, timeout=600):
    env = {**os.environ, "INFER_BENCH_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def cache(tiny_ckpt, model_cache):
    return model_cache.parent


@pytest.fixture(scope="module")
def second_python(tmp_path_factory):
    """Another interpreter: a new venv with none of the harness installed, seeing this venv's
    third-party packages through a .pth file (so torch and transformers import there)."""
    d = tmp_path_factory.mktemp("second-env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d)], check=True)
    site = next(d.glob("lib/python*/site-packages"))
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return d / "bin" / "python"


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """An interpreter with nothing installed (no numpy, no torch)."""
    d = tmp_path_factory.mktemp("bare-env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d)], check=True)
    return d / "bin" / "python"


def test_python_that_does_not_exist_is_refused_at_validation(tmp_path):
    problems = check_jobs(["engines=[hf]", f"++engine_options.hf.python={tmp_path / 'nope' / 'python'}"])
    assert any(p.startswith("engine_options.hf.python=") and "no such file" in p for p in problems), problems
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n")  # exists, not executable
    problems = check_jobs(["engines=[hf]", f"++engine_options.hf.python={script}"])
    assert any("engine_options.hf.python=" in p and "not executable" in p for p in problems), problems


def test_python_and_launch_together_and_a_bad_launch_are_refused():
    problems = check_jobs(["engines=[hf]", f"++engine_options.hf.python={sys.executable}",
                           "++engine_options.hf.launch=[python3]"])
    assert any("give one" in p for p in problems), problems
    problems = check_jobs(["engines=[hf]", "++engine_options.hf.launch=[docker,run,'{image}',python3]"])
    assert any("unknown placeholder" in p and "{image}" in p for p in problems), problems


def test_the_cli_adds_open_mapping_keys_without_a_plus(cache, tmp_path):
    r = run(["engines=[hf]", f"engine_options.hf.python={tmp_path / 'missing'}", *BASE,
             f"hydra.run.dir={tmp_path / 'run'}"], cache)
    assert r.returncode == 2 and "engine_options.hf.python=" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_hf_through_a_second_interpreter(second_python, cache, tmp_path):
    out = tmp_path / "run"
    r = run(["engines=[hf]", f"engine_options.hf.python={second_python}", *BASE, f"hydra.run.dir={out}"], cache)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = [x for x in read_rows(out / "results.jsonl") if x["workload"] == "sweep"]
    assert row["status"] == "ok" and row["worker_python"] == str(second_python)
    assert row["worker_launch"] == [str(second_python)]
    assert row["worker_versions"]["engine"] and row["worker_versions"]["python"]
    assert (out / ".worker-src" / "infer_bench_worker.py").exists()  # the harness shipped its own code


@pytest.mark.slow
def test_an_interpreter_without_the_packages_is_unavailable_naming_both(bare_python, cache, tmp_path):
    out = tmp_path / "run"
    r = run(["engines=[reference,hf]", f"engine_options.hf.python={bare_python}", *BASE, f"hydra.run.dir={out}"],
            cache)
    rows = read_rows(out / "results.jsonl")
    hf = [x for x in rows if x["engine"] == "hf"]
    assert [x["status"] for x in hf] == ["unavailable"], r.stderr[-2000:]
    assert str(bare_python) in hf[0]["error"] and "missing there" in hf[0]["error"]
    assert any(x["engine"] == "reference" and x["status"] == "ok" for x in rows)  # the rest of the run went on


@pytest.mark.slow
def test_a_launch_prefix_that_cannot_start_or_dies_in_the_handshake_fails_with_its_output(cache, tmp_path):
    out = tmp_path / "run"
    r = run(["engines=[hf]", "engine_options.hf.launch=[/nonexistent/launcher,python3]", *BASE,
             f"hydra.run.dir={out}"], cache)
    (row,) = read_rows(out / "results.jsonl")
    assert r.returncode == 1 and row["status"] == "failed"
    assert "/nonexistent/launcher" in row["error"] and "could not start" in row["error"]
    out2 = tmp_path / "run2"
    r = run(["engines=[hf]", "engine_options.hf.launch=[sh,-c,'echo the launcher broke >&2; exit 3']", *BASE,
             f"hydra.run.dir={out2}"], cache)
    (row,) = read_rows(out2 / "results.jsonl")
    assert r.returncode == 1 and row["status"] == "failed"
    assert "died during the handshake (exit code 3)" in row["error"] and "the launcher broke" in row["error"]
    assert "sh -c" in row["error"]  # the command is named


@pytest.mark.slow
def test_a_protocol_mismatch_fails_naming_both_versions(cache, tmp_path):
    out = tmp_path / "run"
    fake = HERE / "fake_worker_other_protocol.py"
    r = run(["engines=[hf]", f"engine_options.hf.launch=[{sys.executable},{fake}]", *BASE,
             f"hydra.run.dir={out}"], cache)
    (row,) = read_rows(out / "results.jsonl")
    assert r.returncode == 1 and row["status"] == "failed"
    assert f"the harness speaks version {PROTOCOL_VERSION}" in row["error"] and "version 0" in row["error"]
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(fake) in " ".join(p.info["cmdline"] or [])]


@pytest.mark.vllm
def test_vllm_from_its_own_environment_and_hf_through_it(cache, tmp_path):
    py = vllm_python()
    if py is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm; or set INFER_BENCH_VLLM_PYTHON)")
    out = tmp_path / "run"
    r = run(["engines=[vllm,hf]", f"engine_options.vllm.python={py}", f"engine_options.hf.python={py}",
             "dtype=float32", *BASE, f"hydra.run.dir={out}"], cache, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x["engine"]: x for x in read_rows(out / "results.jsonl") if x["workload"] == "sweep"}
    assert rows["vllm"]["status"] == "ok" and rows["hf"]["status"] == "ok"
    assert rows["vllm"]["worker_python"] == rows["hf"]["worker_python"] == str(py)
    assert "vllm" in (rows["vllm"]["worker_versions"]["engine"] or "")


@pytest.mark.vllm
def test_a_kernel_refusing_the_dtype_on_this_cpu_gives_skipped_rows_with_the_reason(tmp_path, model_cache):
    """vLLM-CPU's latent-attention backend on a CPU with AMX takes only bfloat16: a float32 run of
    a latent-attention model is a `skipped` row per point with vLLM's reason and the fix, and the
    run goes on (exit 0), not a failed row with a traceback. AMX is real on a Xeon with AMX and
    simulated elsewhere (tests/cpu_kind: torch's AMX probe, which vLLM's selection reads, answers
    yes in the vLLM worker; the refusal comes before any AMX kernel could run)."""
    py = vllm_python()
    if py is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm; or set INFER_BENCH_VLLM_PYTHON)")
    out = tmp_path / "run"
    env = {**os.environ, "INFER_BENCH_CACHE": str(model_cache.parent), "INFER_BENCH_AS_CPU": "amx",
           "PYTHONPATH": os.pathsep.join([str(HERE / "cpu_kind"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[vllm]", f"engine_options.vllm.python={py}",
                        *[a for a in BASE if not a.startswith("model=")], "model=tiny-deepseek-v3", "dtype=float32",
                        "workload.batch_sizes=[1,2]", f"hydra.run.dir={out}"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [x for x in read_rows(out / "results.jsonl") if x["engine"] == "vllm"]
    assert len(rows) == 2 and {x["status"] for x in rows} == {"skipped"}, rows
    for row in rows:
        assert "AMX_MLA" in row["error"] and "takes only bfloat16" in row["error"] and "dtype=bfloat16" in row["error"]
        assert "Traceback" not in row["error"]
    assert "Traceback" not in r.stderr

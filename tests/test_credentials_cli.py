"""Credentials end to end through the `infer-bench` CLI: an endpoint that demands a
bearer key, the key passed by environment variable; nothing the run writes or prints contains
it; a literal key on the command line exits 2 without echoing it; a wrong key gives a failed row
that says 401, not a crash.

The CLI side (endpoints.<name> in conf/config.yaml, engines=[<endpoint>]) is wired by the lead;
until it is, these tests fail at the CLI's validation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.core.paths import REPO_ROOT
from harness.core.results import RESULTS_FILE, read_rows

pytestmark = pytest.mark.slow
KEY = "ib-cli-" + os.urandom(12).hex()


@pytest.fixture(scope="module")
def secured_server(tiny_ckpt):
    """infer-bench-serve demanding `Authorization: Bearer KEY` (its own variable)."""
    proc = subprocess.Popen([sys.executable, "-m", "harness.serve", "model=local", f"model.path={tiny_ckpt}",
                             "port=0", "max_model_len=256", "api_key_env=IB_SERVE_KEY"], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "IB_SERVE_KEY": KEY})
    for line in proc.stdout:
        if " at http://" in line:
            url = line.split(" at ", 1)[1].split()[0]
            break
    else:
        raise AssertionError("infer-bench-serve did not start")
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)


def infer_bench(run_dir: Path, *overrides: str, key: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "IB_CLI_KEY"}
    if key is not None:
        env["IB_CLI_KEY"] = key
    return subprocess.run([sys.executable, "-m", "harness.cli", *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=600)


def common(url: str) -> list[str]:
    return ["engines=[mine]", f"endpoints.mine.url={url}", "endpoints.mine.kind=infer-bench",
            "endpoints.mine.api_key_env=IB_CLI_KEY", "model=tiny", "workload=serving",
            "workload.num_requests=4", "workload.request_rates=[inf]", "workload.input_len=16",
            "workload.output_len=4", "workload.warmup_requests=1", "parity=false", "roofline=false", "quiet=true"]


def everything_written(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file())


def test_a_key_by_variable_works_and_appears_nowhere(secured_server, tmp_path):
    run = tmp_path / "run"
    r = infer_bench(run, *common(secured_server), key=KEY)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [row for row in read_rows(run / RESULTS_FILE) if row.get("engine") == "mine"]
    assert rows and all(row["status"] == "ok" for row in rows)
    assert all(row["auth"] == {"method": "env", "variable": "IB_CLI_KEY"} for row in rows)
    assert all(row["transport"] == "http" and row["tls_verify"] is True for row in rows)
    assert KEY not in r.stdout + r.stderr
    assert KEY not in everything_written(run)


def test_a_literal_key_on_the_command_line_exits_2_without_echo(secured_server, tmp_path):
    r = infer_bench(tmp_path / "run", *common(secured_server), f"endpoints.mine.api_key={KEY}", key=KEY)
    assert r.returncode == 2
    assert "api_key_env" in r.stderr and "Traceback" not in r.stderr
    assert KEY not in r.stdout + r.stderr
    assert not (tmp_path / "run" / RESULTS_FILE).exists() or KEY not in everything_written(tmp_path / "run")


def test_a_wrong_key_gives_a_failed_row_saying_401(secured_server, tmp_path):
    run = tmp_path / "run"
    wrong = "wrong-" + os.urandom(8).hex()
    r = infer_bench(run, *common(secured_server), key=wrong)
    assert r.returncode == 1, r.stderr[-3000:]
    rows = [row for row in read_rows(run / RESULTS_FILE) if row.get("engine") == "mine"]
    assert rows and all(row["status"] == "failed" for row in rows)
    assert all("401 Unauthorized" in row["error"] for row in rows), json.dumps(rows)[:2000]
    assert "Traceback" not in r.stdout + r.stderr
    for secret in (KEY, wrong):
        assert secret not in r.stdout + r.stderr and secret not in everything_written(run)

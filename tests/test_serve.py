"""infer-bench-serve: the reference engine behind the OpenAI completions API (harness/serve.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from fake_servers import children, wait_children_gone
from harness.core.paths import REPO_ROOT


def start(ckpt, *overrides: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """infer-bench-serve on a free port; (process, base URL) once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "harness.serve", "model=local", f"model.path={ckpt}", "port=0",
                             "max_model_len=256", *overrides], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if " at http://" in line:
            return proc, line.split(" at ", 1)[1].split()[0].removesuffix("/v1")
    proc.wait()
    raise AssertionError("infer-bench-serve did not start:\n" + "".join(lines))


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.serve", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    before = children()
    proc, url = start(tiny_ckpt, "api_key_env=IB_TEST_SERVE_KEY", env={"IB_TEST_SERVE_KEY": "k-123456789"})
    yield url, {"Authorization": "Bearer k-123456789"}
    rc, out = stop(proc)
    assert rc == 0, out
    assert not wait_children_gone(before)


# ---- bad input: exit 2, one message, no traceback ---------------------------------------------------

def test_a_port_in_use_exits_2_with_a_clear_message():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = run_cli("model=tiny", f"port={port}")
    assert r.returncode == 2
    assert f"port={port}: 127.0.0.1:{port} is already in use" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.parametrize("args,expect", [
    (["dtype=float64"], "dtype=float64: not one of"),
    (["model=no-such-model"], "unknown model preset"),
    (["engine_options.block_size=0"], "engine_options.block_size=0"),
    (["port=70000"], "port=70000: must be at most 65535"),
    (["--port", "1"], "not an override"),
    (["api_key_env=IB_SURELY_UNSET_VAR"], "api_key_env=IB_SURELY_UNSET_VAR: the variable is not set"),
])
def test_bad_input_exits_2_naming_the_field(args, expect):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert expect in r.stderr and "Traceback" not in r.stderr


def test_plan_takes_a_bin_checkpoint_and_names_a_directory_without_weights(tiny_ckpt, tmp_path):
    """infer-bench-serve resolves the checkpoint, device and dtype as a run does (harness.config)."""
    from harness.core.errors import UserError
    from harness.serve import build_plan, compose
    for name in ("bin", "empty"):
        (tmp_path / name).mkdir()
        shutil.copy(tiny_ckpt / "config.json", tmp_path / name / "config.json")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    plan = build_plan(compose(["model=local", f"model.path={tmp_path / 'bin'}", "device=cpu"]))
    assert (plan.device, plan.dtype) == ("cpu", "float32")
    with pytest.raises(UserError) as e:
        build_plan(compose(["model=local", f"model.path={tmp_path / 'empty'}", "device=tpu"]))
    assert any("no weights" in p for p in e.value.problems), e.value.problems
    assert any(p.startswith("device=tpu: unknown device") for p in e.value.problems), e.value.problems


# ---- the API --------------------------------------------------------------------------------------------

def test_v1_needs_the_key_and_health_does_not(server, tiny_ckpt):
    url, auth = server
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    models = httpx.get(url + "/v1/models", headers=auth).json()
    assert models["data"][0]["id"] == tiny_ckpt.name and models["data"][0]["max_model_len"] == 256
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json()["version"].startswith("infer-bench-serve")


def test_text_and_token_id_prompts_give_the_same_tokens(server):
    url, auth = server
    body = {"max_tokens": 5, "return_token_ids": True, "ignore_eos": True}
    a = httpx.post(url + "/v1/completions", headers=auth, json={**body, "prompt": "w5 w6 w7 w8"}).json()
    b = httpx.post(url + "/v1/completions", headers=auth, json={**body, "prompt": [5, 6, 7, 8]}).json()
    assert a["choices"][0]["prompt_token_ids"] == [5, 6, 7, 8]
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"] and len(b["choices"][0]["token_ids"]) == 5
    assert a["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                          "prompt_tokens_details": {"cached_tokens": 0}}  # 4 tokens: no whole block to share
    assert a["choices"][0]["finish_reason"] == "length"
    assert a["choices"][0]["text"] == " ".join(f"w{t}" for t in a["choices"][0]["token_ids"])


def test_streaming_sends_one_token_per_chunk_then_usage_then_done(server):
    url, auth = server
    body = {"prompt": [9, 10, 11], "max_tokens": 4, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", headers=auth, json=body) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    tokens = [c["choices"][0]["token_ids"] for c in chunks if c["choices"]]
    assert [len(t) for t in tokens] == [1, 1, 1, 1]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [9, 10, 11]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    plain = httpx.post(url + "/v1/completions", headers=auth, json={**body, "stream": False}).json()
    assert plain["choices"][0]["token_ids"] == [t[0] for t in tokens]


@pytest.mark.parametrize("body,status,expect", [
    ({"prompt": [1, 2], "max_tokens": 300}, 400, "exceeds this server's max_model_len (256)"),
    ({"prompt": [1, 2], "model": "other"}, 404, "does not exist"),
    ({"prompt": [[1, 2], [3, 4]]}, 400, "one prompt per request"),
    ({"prompt": [], "max_tokens": 2}, 400, "non-empty"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "positive integer"),
    ({"prompt": [1, 2], "n": 2}, 400, "n and best_of must be 1"),
])
def test_bad_requests_get_4xx_with_the_reason(server, body, status, expect):
    url, auth = server
    r = httpx.post(url + "/v1/completions", headers=auth, json=body)
    assert r.status_code == status and expect in r.json()["error"]["message"]


def test_a_client_that_leaves_aborts_its_request(server):
    url, auth = server
    body = {"prompt": [3, 4, 5], "max_tokens": 200, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", headers=auth, json=body) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                break
    before = _metric(url, "infer_bench_generation_tokens_total")
    deadline = time.monotonic() + 20
    while _metric(url, "infer_bench_num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(url, "infer_bench_num_requests_running") == 0
    assert _metric(url, "infer_bench_generation_tokens_total") < 200 + before - 3  # it stopped early


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def test_prompt_logprobs_are_teacher_forced_scores(server):
    url, auth = server
    r = httpx.post(url + "/v1/completions", headers=auth,
                   json={"prompt": [5, 6, 7, 8], "max_tokens": 1, "prompt_logprobs": 2}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 4
    for p, entry in enumerate(plp[1:], start=1):
        ranked = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] is not None)
        assert [k for k, _ in ranked] == [1, 2] and ranked[0][1] >= ranked[1][1]
        assert str([5, 6, 7, 8][p]) in entry  # the prompt's own token is always there


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_stop_it_cleanly(tiny_ckpt, sig):
    before = children()
    proc, url = start(tiny_ckpt)
    assert httpx.get(url + "/health").status_code == 200
    rc, out = stop(proc, sig)
    assert rc == 0 and "infer-bench-serve: stopped" in out and "Traceback" not in out
    assert not wait_children_gone(before)

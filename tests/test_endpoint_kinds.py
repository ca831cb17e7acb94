"""Each shipped server preset, launched as it ships (every flag of conf/endpoint/<name>.yaml and
every flag the harness adds), against a STRICT PROTOCOL FAKE of that server
(tests/fake_servers_strict.py: its strict command line, its request validation, its streaming
and its readiness, each citing the server source it imitates). Only the program is swapped: the
arguments are the preset's. One test (or more) per finding of the audit of the presets against
the servers' own code; each failed on the code before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from adapters.base import ModelSpec, Request, RequestFailed, TokenEvent, now_ns
from adapters.endpoint import check_endpoint, endpoint_engine_class
from adapters.endpoint.options import launch_extras
from fake_servers import children, wait_children_gone
from harness.core.kvcalc import bytes_per_token
from harness.core.paths import REPO_ROOT
from harness.core.presets import shape_from_hf_config

STRICT = str(Path(__file__).with_name("fake_servers_strict.py"))


def preset(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / f"{name}.yaml").read_text())


def faked(name: str, **over):
    """The engine class of the shipped preset `name`, its program replaced by the strict fake of
    its kind (`{python} -m pkg.module ARGS` or `program ARGS` -> `{python} fake KIND ARGS`)."""
    raw = preset(name)
    launch = raw["launch"]
    args = launch[3:] if launch[:2] == ["{python}", "-m"] else launch[1:]
    raw["launch"] = ["{python}", STRICT, raw["kind"], *args]
    raw.pop("python", None)
    raw.update({"ready_timeout_s": 40, "request_timeout_s": 30, "stop_grace_s": 5, "metrics_interval_s": 0.05})
    env = {**raw.get("env", {}), **over.pop("env", {})}
    raw.update(over, env=env)
    cfg, problems = check_endpoint(name, raw)
    assert not problems, problems
    return endpoint_engine_class(name, cfg)


def spec(path, run_dir=None, max_len=512, device="cpu", dtype="float32") -> ModelSpec:
    return ModelSpec(str(path), "tiny", dtype, device, max_len, run_dir=str(run_dir) if run_dir else None)


def failures(events):
    return {e.request_id: e.reason for e in events if isinstance(e, RequestFailed)}


def tokens(events, rid):
    return [e for e in events if isinstance(e, TokenEvent) and e.request_id == rid]


@pytest.fixture(scope="module", autouse=True)
def no_leftovers():
    before = children()
    yield
    assert not wait_children_gone(before), "a fake server outlived the module"


# ---- SGLang -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    """The sglang-serve preset on the strict SGLang fake, with a 1.5 s warm-up during which its
    /health is 503 and /v1/models already 200. max_model_len is exactly the longest prompt plus
    its output, as the workloads set it. One request is sent the moment load() returns."""
    run_dir = tmp_path_factory.mktemp("sglang")
    eng = faked("sglang-serve", env={"FAKE_SGLANG_WARMUP_S": "1.5"})()
    eng.load(spec("/models/tiny", run_dir, max_len=32), {})
    eng.begin_point()
    first = list(eng.serve([Request("first", list(range(24)), 8)], now_ns()))
    fields = eng.end_point()
    yield eng, first, fields, run_dir
    eng.close()


def test_sglang_is_ready_only_when_its_health_says_so(sglang):
    """Audit item 10: /v1/models answers 200 during SGLang's warm-up; only /health tells."""
    _, first, _, _ = sglang
    assert not failures(first)


def test_sglang_longest_request_gets_every_token(sglang):
    """Audit item 2: SGLang caps output at context_length - 2 - prompt; the preset gives it
    max_model_len + 2, so a request of exactly max_model_len gets all its tokens."""
    eng, first, fields, _ = sglang
    assert [e.token_id for e in tokens(first, "first")] == list(range(1000, 1008))
    assert fields["token_count_source"] == "token_ids" and fields["output_tokens_server"] == 8
    assert fields["output_token_ids"] == "from the server"  # SGLang 0.5.23 has return_token_ids
    assert "--context-length 34" in fields["launch_command"]


def test_sglang_gauges_move_during_a_point(sglang):
    """Audit item 9: SGLang refreshes its gauges every --decode-log-interval decode steps
    (default 40); the preset sets 1, so a short point's telemetry shows its running requests."""
    eng, _, _, _ = sglang
    eng.begin_point()
    events = list(eng.serve([Request(f"r{i}", [7, 8, 9, i], 10) for i in range(3)], now_ns()))
    fields = eng.end_point()
    assert not failures(events)
    running = [v for _, v in fields["server_metrics"]["sglang:num_running_reqs"]]
    assert max(running) >= 1


def test_sglang_version_prefix_counters_and_flush(sglang):
    """Audit item 12: no /version (the version is in /server_info); the prefix-cache hit series
    (cached_tokens / prompt_tokens); /flush_cache between points."""
    eng, _, _, _ = sglang
    assert eng.server.version == "0.5.23-fake"
    eng.reset_prefix_cache()
    assert eng.server.prefix_reset == "yes"
    eng.begin_point()
    list(eng.serve([Request("a", [5, 6, 7, 8], 2)], now_ns()))
    list(eng.serve([Request("b", [5, 6, 7, 8], 2)], now_ns()))  # the same prompt again: a hit
    eng.end_point()
    info = eng.kv_cache_info()
    assert info.prefix_cache_hits == 4 and info.prefix_cache_queries >= 8


def test_sglang_standard_options_land_where_they_mean(tmp_path):
    """Audit item 7: max_num_batched_tokens is a per-step budget: SGLang's --max-prefill-tokens
    (and the chunk no larger, decode mixed in), not --chunked-prefill-size alone. The new
    standard options reach SGLang's own flags (its /server_info echoes its arguments)."""
    eng = faked("sglang-serve")()
    opts = {"max_num_batched_tokens": 512, "gpu_memory_utilization": 0.85, "tensor_parallel_size": 1,
            "max_num_seqs": 16}
    try:
        eng.load(spec("/models/tiny", tmp_path, max_len=64), opts)
        info = eng.server.get(eng.server.root + "/server_info").json()
        assert info["max_prefill_tokens"] == 512 and info["chunked_prefill_size"] == 512 and info["enable_mixed_chunk"]
        assert info["mem_fraction_static"] == 0.85 and info["tp_size"] == 1 and info["max_running_requests"] == 16
        eng.begin_point()
        fields = eng.end_point()
        assert fields["server_options"]["gpu_memory_utilization"] == 0.85
        assert fields["options_differing_from_defaults"]["max_num_seqs"]["value"] == 16
    finally:
        eng.close()
    off = launch_extras("sglang", {"chunked_prefill": False, "max_num_batched_tokens": 256}, "unused").args
    assert "--enable-mixed-chunk" not in off and off[off.index("--chunked-prefill-size") + 1] == "-1"


# ---- TensorRT-LLM ----------------------------------------------------------------------------------------

KV_BYTES = 3 << 20


@pytest.fixture(scope="module")
def trtllm(tiny_ckpt, tmp_path_factory):
    """The trtllm-serve preset on the strict trtllm-serve fake, with a small per-step token
    budget, an fp8 KV cache and a KV pool given in bytes."""
    run_dir = tmp_path_factory.mktemp("trtllm")
    eng = faked("trtllm-serve")()
    eng.load(spec(tiny_ckpt, run_dir, max_len=64), {"max_num_batched_tokens": 16, "kv_dtype": "fp8",
                                                     "kv_cache_bytes": KV_BYTES})
    yield eng, run_dir
    eng.close()


def test_trtllm_tokens_in_chunks_without_text_are_counted(trtllm):
    """Audit item 3: trtllm-serve sends chunks with empty text (EOS under ignore_eos, partial
    characters); the harness asks it for usage on every chunk and counts from that."""
    eng, _ = trtllm
    eng.begin_point()
    events = list(eng.serve([Request("a", [1, 2, 3], 9), Request("b", [4, 5, 6], 7)], now_ns()))
    fields = eng.end_point()
    assert not failures(events)
    assert len(tokens(events, "a")) == 9 and len(tokens(events, "b")) == 7
    assert fields["token_count_source"] == "usage" and not fields["token_count_mismatch"]
    # audit item 12: no token ids from trtllm-serve: the rows say the ids are unknown (-1)
    assert fields["output_token_ids"].startswith("unknown") and {e.token_id for e in events if isinstance(e, TokenEvent)} == {-1}


def test_trtllm_prompts_longer_than_the_step_budget_are_served(trtllm):
    """Audit item 4: max_num_tokens without chunked prefill makes trtllm-serve refuse every
    longer prompt (400); the harness turns chunked prefill on (recorded as differing)."""
    eng, _ = trtllm
    eng.begin_point()
    events = list(eng.serve([Request("long", list(range(40)), 4)], now_ns()))
    fields = eng.end_point()
    assert not failures(events), failures(events)
    assert fields["options_differing_from_defaults"]["chunked_prefill"] == {"value": True, "default": False}


def test_trtllm_pool_in_bytes_is_at_the_kv_dtype_and_the_dtype_is_given(trtllm, tiny_ckpt):
    """Audit items 5 and 11: kv_cache_bytes becomes max_tokens at the KV dtype's bytes per token
    (fp8: half the model dtype's); the server is given the run's dtype (it has no --dtype flag)."""
    eng, run_dir = trtllm
    eng.begin_point()
    fields = eng.end_point()
    (text,) = fields["server_extra_options"].values()
    extra = yaml.safe_load(text)
    pool = extra["kv_cache_config"]["max_tokens"] * bytes_per_token(shape_from_hf_config(str(tiny_ckpt)), "fp8")
    assert KV_BYTES - pool < bytes_per_token(shape_from_hf_config(str(tiny_ckpt)), "fp8")
    assert extra["dtype"] == "float32"
    assert "[server] [fake trtllm 1.1.0] dtype=float32" in (run_dir / "logs" / "trtllm-serve.log").read_text()
    assert "--extra_llm_api_options" in fields["server_argv"]


def test_trtllm_metrics_are_read_from_its_prometheus_path(trtllm):
    """Audit item 12: trtllm-serve's /metrics is JSON; its Prometheus text is /prometheus/metrics."""
    eng, _ = trtllm
    assert eng.server.metrics_on
    eng.begin_point()
    list(eng.serve([Request("m", [1, 2], 12)], now_ns()))
    series = eng.end_point()["server_metrics"]
    assert "trtllm_num_requests_running" in series and "trtllm_kv_cache_utilization" in series


def test_trtllm_unknown_request_fields_are_refused_before_the_run():
    """Audit item 3: trtllm-serve answers 400 to a field it does not know; extra_body may not add one."""
    raw = {**preset("trtllm-serve"), "extra_body": {"return_token_ids": True}}
    cfg, problems = check_endpoint("t", raw)
    assert cfg is None and any("extra_body" in p and "return_token_ids" in p for p in problems), problems


def test_trtllm_block_size_needs_version_1_1(tmp_path):
    """Audit item 1: kv_cache_config.tokens_per_block exists only from TensorRT-LLM 1.1; an
    older server refuses the key and does not start (the strict fake at 1.0 does the same)."""
    cls = faked("trtllm-serve")
    (problem,) = cls.check_options({"block_size": 64}, spec("/m"))
    assert "1.1" in problem and "server_version" in problem
    old = faked("trtllm-serve", server_version="1.0.0")
    assert old.check_options({"block_size": 64}, spec("/m"))
    new = faked("trtllm-serve", server_version="1.1.0")
    assert new.check_options({"block_size": 64}, spec("/m")) == []
    eng = new()
    try:
        eng.load(spec("/models/tiny", tmp_path), {"block_size": 64})
        assert eng.server.alive()
    finally:
        eng.close()


# ---- vLLM --------------------------------------------------------------------------------------------

def test_vllm_on_cpu_launches_as_before_and_counts_multi_token_chunks(tmp_path):
    """device=cpu: the preset's CPU settings (eager, 0.3 of memory, VLLM_CPU_KVCACHE_SPACE);
    under load the fake sends several tokens per chunk and every token is counted with its id.
    No min_tokens is sent (audit item 8: ignore_eos alone forces the length)."""
    eng = faked("vllm-serve")()
    try:
        eng.load(spec("/models/tiny", tmp_path), {})
        eng.begin_point()
        events = list(eng.serve([Request(f"r{i}", [3, 4, i], 12) for i in range(4)], now_ns()))
        fields = eng.end_point()
        assert not failures(events)
        assert all([e.token_id for e in tokens(events, f"r{i}")] == list(range(1000, 1012)) for i in range(4))
        assert fields["tokens_per_chunk_max"] > 1 and fields["token_count_source"] == "token_ids"
        assert fields["output_token_ids"] == "from the server"
        argv = fields["server_argv"]
        assert "--enforce-eager" in argv and argv[argv.index("--gpu-memory-utilization") + 1] == "0.3"
        assert fields["server_settings"]["cuda_graphs"] is False
        assert fields["options_differing_from_defaults"]["gpu_memory_utilization"]["value"] == 0.3
        assert eng.server.process.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        body = eng.bodies.completion([1], 3)
        assert "min_tokens" not in body and body["ignore_eos"] is True
    finally:
        eng.close()


def test_vllm_on_a_gpu_runs_with_its_own_defaults():
    """Audit item 6: on a GPU no --enforce-eager, no 0.3, no VLLM_CPU_KVCACHE_SPACE (the dry-run
    plan of the shipped preset); the new options map onto vLLM's flags."""
    eng = faked("vllm-serve")()
    plan = eng.launch_plan(spec("/models/m", device="cuda", dtype="bfloat16"), {}, port=8000)
    assert "--enforce-eager" not in plan.command and "0.3" not in plan.command
    assert "VLLM_CPU_KVCACHE_SPACE" not in plan.env and plan.differing == {}
    plan = eng.launch_plan(spec("/models/m", device="cuda"), {"gpu_memory_utilization": 0.85,
                                                              "tensor_parallel_size": 2, "chunked_prefill": False},
                           port=8000)
    c = plan.command
    assert c[c.index("--gpu-memory-utilization") + 1] == "0.85" and c[c.index("--tensor-parallel-size") + 1] == "2"
    assert "--no-enable-chunked-prefill" in c


def test_dry_run_prints_the_command_and_starts_nothing(tmp_path, capsys):
    from adapters.endpoint.engine import EndpointError
    eng = faked("vllm-serve", dry_run=True)()
    with pytest.raises(EndpointError, match="dry run"):
        eng.load(spec("/models/tiny", tmp_path), {})
    assert eng.server.process is None and "--enforce-eager" in capsys.readouterr().out
    eng.close()


def test_a_report_warns_when_servers_ran_with_different_memory_shares(tmp_path):
    """Two vLLM servers (strict fakes) launched with different memory fractions: their rows say
    so, and the report's HTTP section warns that the comparison measures the settings too."""
    from test_report_fakes import http_serving_rows
    from test_report_sections import notes, page
    rows = []
    for name, share in (("vllm-a", 0.5), ("vllm-b", 0.8)):
        eng = faked("vllm-serve")()
        try:
            eng.load(spec("/models/tiny", tmp_path / name, device="cpu"), {"gpu_memory_utilization": share})
            eng.begin_point()
            fields = eng.end_point()
        finally:
            eng.close()
        assert fields["server_settings"]["gpu_memory_utilization"] == share
        keep = ("server_argv", "server_settings", "options_differing_from_defaults", "launch_command", "server_options")
        rows += http_serving_rows(engine=name, **{k: fields[k] for k in keep})
    html = page(tmp_path, rows)
    (warning,) = notes(html, "http-settings-differ")
    assert "memory share: vllm-a 0.5, vllm-b 0.8" in warning
    assert "cuda_graphs" not in warning  # both eager on CPU: not a difference
    assert not notes(page(tmp_path, rows[:2], name="one"), "http-settings-differ")


@pytest.mark.vllm
def test_vllm_own_parser_takes_every_mapped_flag():
    """Every standard option's flag, as the harness writes it for a GPU launch, parsed by vLLM's
    own command-line parser (in vLLM's environment): each lands on the engine argument it means."""
    from tests_support import vllm_parse, vllm_python
    py = vllm_python()
    if py is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm)")
    opts = {"kv_dtype": "fp8", "block_size": 32, "prefix_caching": False, "kv_cache_bytes": 10 ** 9,
            "gpu_memory_utilization": 0.8, "tensor_parallel_size": 2, "chunked_prefill": False, "max_num_seqs": 64,
            "max_num_batched_tokens": 4096}
    plan = faked("vllm-serve")().launch_plan(spec("/models/m", device="cuda", dtype="bfloat16"), opts, port=8000)
    ns = vllm_parse(py, plan.command[plan.command.index("--model"):])
    assert {k: ns[k] for k in ("kv_cache_dtype", "block_size", "enable_prefix_caching", "kv_cache_memory_bytes",
                               "gpu_memory_utilization", "tensor_parallel_size", "enable_chunked_prefill",
                               "max_num_seqs", "max_num_batched_tokens", "enforce_eager")} == {
        "kv_cache_dtype": "fp8", "block_size": 32, "enable_prefix_caching": False, "kv_cache_memory_bytes": 10 ** 9,
        "gpu_memory_utilization": 0.8, "tensor_parallel_size": 2, "enable_chunked_prefill": False,
        "max_num_seqs": 64, "max_num_batched_tokens": 4096, "enforce_eager": False}


def test_sglang_flush_is_refused_while_a_request_runs_and_the_row_says_why(sglang):
    """SGLang's /flush_cache answers 400 while requests run or wait: the reset is reported as
    not done, with the reason, never taken as done."""
    eng = sglang[0]
    gen = eng.serve([Request("x", [1, 2, 3], 30)], now_ns())
    next(gen)  # a token arrived: the request is running
    eng.reset_prefix_cache()
    list(gen)
    assert eng.server.prefix_reset.startswith("no: POST /flush_cache answered HTTP 400") and "SGLang refuses" in eng.server.prefix_reset


def test_servers_each_at_their_own_defaults_raise_no_settings_warning(tmp_path):
    """On a GPU each server at its own defaults is the fair setting: no warning, although their
    defaults differ (vLLM 0.92 of memory, trtllm-serve 0.9 of the free memory) and the harness
    turns trtllm's chunked prefill on (as the others have it). One server given another memory
    share is named."""
    from test_report_fakes import http_serving_rows
    from test_report_sections import notes, page

    def rows_of(name, options):
        plan = faked(name)().launch_plan(spec("/models/m", device="cuda", dtype="bfloat16"), options, port=8000)
        return http_serving_rows(engine=name, server_settings=plan.settings)

    base = rows_of("vllm-serve", {}) + rows_of("trtllm-serve", {})
    assert not notes(page(tmp_path, base + rows_of("sglang-serve", {}), name="fair"), "http-settings-differ")
    (warning,) = notes(page(tmp_path, base + rows_of("sglang-serve", {"gpu_memory_utilization": 0.5}), name="tuned"),
                       "http-settings-differ")
    assert "memory share: vllm-serve default, trtllm-serve default, sglang-serve 0.5" in warning
    (warning,) = notes(page(tmp_path, rows_of("vllm-serve", {}) + rows_of("sglang-serve", {"chunked_prefill": False}),
                            name="chunk"), "http-settings-differ")
    assert "chunked prefill: vllm-serve True, sglang-serve False" in warning


def test_every_kind_record_holds_together():
    """A kind is one record: its options are standard ones, its launch defaults and its declared
    defaults are about options it takes, the metric samples it reads by meaning are among those
    it keeps, and its mapping runs on no options."""
    from adapters.endpoint.kinds import KINDS, LaunchContext
    from adapters.endpoint.options import STANDARD_ENDPOINT_OPTIONS
    for kind in KINDS.values():
        assert set(kind.options) <= set(STANDARD_ENDPOINT_OPTIONS), kind.name
        assert set(kind.launch_defaults) <= set(kind.options) and set(kind.defaults) <= set(kind.options), kind.name
        assert kind.ready_paths and all(p.startswith("/") for p in kind.ready_paths + kind.version_paths)
        if kind.metrics is not None:
            read = {kind.metrics.usage, kind.metrics.hits, kind.metrics.queries, kind.metrics.preemptions} - {None}
            assert read <= set(kind.metrics.series), kind.name
        kind.map_options({}, LaunchContext("/tmp/unused.yaml"))

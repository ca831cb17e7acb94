"""KV tiers through the servers: the standard options kv_offload / kv_offload_bytes mapped onto each
kind's own settings (vLLM --kv-offloading-size/--kv-offloading-backend, SGLang
--enable-hierarchical-cache/--hicache-size, trtllm kv_cache_config.host_cache_size), and what each
tier supplied read from /metrics by the names of the kinds record (adapters/tiers.py). The servers
here are the STRICT PROTOCOL FAKES of tests/fake_servers_strict.py (their parsers and /metrics as
the servers' sources have them; their tiers a small deterministic cache with its own totals at
/fake/tier_truth); vLLM's own parser and metrics code run under the `vllm` marker."""

from __future__ import annotations

import subprocess

import pytest
import yaml

import fake_servers_strict as fakes
from adapters.base import Request, TokenEvent, now_ns
from adapters.endpoint.kinds import KINDS, LaunchContext, given
from adapters.endpoint.options import STANDARD_ENDPOINT_OPTIONS, launch_extras
from adapters.tiers import VLLM_CPU_OFFLOAD_REFUSAL, tier_counts
from fake_servers import children, wait_children_gone
from test_endpoint_kinds import faked, spec
from tests_support import vllm_python

GIB = 1 << 30
TIERED = {"kv_offload": True, "kv_offload_bytes": 3 * 10**9}  # a whole number of GB (SGLang) and bytes


@pytest.fixture(scope="module", autouse=True)
def no_leftovers():
    before = children()
    yield
    assert not wait_children_gone(before), "a fake server outlived the module"


def _settings(kind: str, options: dict) -> dict:
    """The tier settings a kind's launch gives its server, as the strict fake of that server reads them."""
    extras = launch_extras(kind, options, LaunchContext("/tmp/kv-tiers-opts.yaml"))
    if kind == "vllm":
        ns = fakes.vllm_parser().parse_args(["--port", "1", *extras.args])
        return {"bytes": None if ns.kv_offloading_size is None else ns.kv_offloading_size * GIB,
                "backend": ns.kv_offloading_backend}
    if kind == "sglang":
        ns = fakes.sglang_parser().parse_args(["--port", "1", *extras.args])
        return {"on": ns.enable_hierarchical_cache, "bytes": ns.hicache_size * 10**9 if ns.hicache_size else None}
    (text,) = extras.files.values() if extras.files else ("{}",)
    return {"bytes": (yaml.safe_load(text).get("kv_cache_config") or {}).get("host_cache_size")}


def test_each_kind_gives_the_second_tier_its_capacity_in_the_servers_own_unit():
    """3e9 bytes: vLLM's GiB float (x 2^30 gives the bytes back), SGLang's whole gigabytes of 1e9,
    trtllm's bytes; with kv_offload false nothing at all (the servers' defaults: no tier)."""
    assert _settings("vllm", TIERED) == {"bytes": 3 * 10**9, "backend": "native"}
    assert _settings("sglang", TIERED) == {"on": True, "bytes": 3 * 10**9}
    assert _settings("trtllm", TIERED) == {"bytes": 3 * 10**9}
    for kind in ("vllm", "sglang", "trtllm"):
        off = {"kv_offload": False, "kv_offload_bytes": 3 * 10**9}
        assert given(off) == {} and launch_extras(kind, off, "/tmp/x.yaml").args in ([], [
            "--extra_llm_api_options", "/tmp/x.yaml"]), kind
    assert _settings("sglang", {"kv_offload": True}) == {"on": True, "bytes": None}  # SGLang's ratio 2.0


def test_the_fake_trtllm_takes_the_host_pool_key(tmp_path):
    """trtllm's options file with host_cache_size passes the strict fake's llm_args check (extra=forbid)."""
    path = tmp_path / "o.yaml"
    extras = launch_extras("trtllm", TIERED, LaunchContext(str(path)))
    path.write_text(extras.files[str(path)])
    args = fakes.trtllm_parser().parse_args(["/m", "--port", "1", *extras.args])
    assert fakes.trtllm_llm_args(args, "1.1.0")["kv_cache_config"]["host_cache_size"] == 3 * 10**9


@pytest.mark.parametrize("kind, options, expect", [
    ("vllm", {"kv_offload": True}, "kv_offload_bytes: vLLM's kv_offloading_size has no default"),
    ("trtllm", {"kv_offload": True}, "kv_offload_bytes: TensorRT-LLM's host_cache_size has no default"),
    ("sglang", {"kv_offload": True, "kv_offload_bytes": 1536 * 10**6}, "whole gigabytes of 1e9 bytes"),
    ("sglang", {"kv_offload": True, "prefix_caching": False}, "kv_offload=true with prefix_caching=false"),
    ("vllm", {**TIERED, "prefix_caching": False}, "kv_offload=true with prefix_caching=false"),
    ("vllm", {"kv_offload": True, "kv_offload_bytes": "1GiB"}, "kv_offload_bytes=1GiB: must be a positive integer"),
    ("sglang", {"kv_offload": "yes"}, "kv_offload=yes: use true or false"),
])
def test_bad_tier_options_name_the_field(kind, options, expect):
    name = {"vllm": "vllm-serve", "sglang": "sglang-serve", "trtllm": "trtllm-serve"}[kind]
    problems = faked(name).check_options(options, spec("/m", device="cuda"))
    assert any(expect in p and f"engine_options.{name}." in p for p in problems), problems


def test_vllm_serve_on_a_cpu_is_refused_with_vllms_own_reason():
    problems = faked("vllm-serve").check_options(TIERED, spec("/m", device="cpu"))
    assert any(VLLM_CPU_OFFLOAD_REFUSAL in p for p in problems), problems
    assert faked("vllm-serve").check_options(TIERED, spec("/m", device="cuda")) == []


def test_every_tier_record_reads_samples_its_kind_keeps():
    """Each kind with a tier record keeps (scrapes) every sample name it reads, and takes the two
    tier options; the infer-bench kind has none yet and does not claim them."""
    for kind in KINDS.values():
        m = kind.tier_metrics
        if m is None:
            assert "kv_offload" not in kind.options, kind.name
            continue
        assert {"kv_offload", "kv_offload_bytes"} <= set(kind.options) <= set(STANDARD_ENDPOINT_OPTIONS)
        assert set(m.names) <= set(kind.metrics.series), (kind.name, set(m.names) - set(kind.metrics.series))
        assert m.tier_of(next(v for v, t in m.tiers if t == 1)) == 1 and m.tier_of("no-such-tier") is None


def _conversation(eng, block: int) -> list[list[int]]:
    """Six prompts of four sessions whose second turns come back after the first tier (2 blocks)
    was overrun: each second turn's history is a second-tier hit."""
    sessions = [[100 * s + i for i in range(2 * block + 1)] for s in range(4)]
    prompts = sessions + [sessions[0] + [7] * block, sessions[1] + [8] * block]
    for i, p in enumerate(prompts):
        events = list(eng.serve([Request(f"r{i}", p, 2)], now_ns()))
        assert len([e for e in events if isinstance(e, TokenEvent)]) == 2
    return prompts


@pytest.mark.parametrize("name, block", [("vllm-serve", 32), ("sglang-serve", 4), ("trtllm-serve", None)])
def test_tier_counters_from_metrics_equal_what_the_server_did(tmp_path, name, block):
    """A server with a second tier (kv_offload, 3 GB) serves sessions that overrun its first tier
    (FAKE_DEVICE_BLOCKS=2): kv_cache_info().extra["kv_tiers"] read from /metrics by the record's
    names equals the fake server's own totals: tokens from each tier, what moved each way; the
    second tier supplied some. The point's row keeps the tier series."""
    eng = faked(name, env={"FAKE_DEVICE_BLOCKS": "2"})()
    try:
        # trtllm: its own block of 32 (tokens_per_block needs a declared server version)
        eng.load(spec("/models/tiny", tmp_path, max_len=512, device="cuda"),
                 {**TIERED, **({"block_size": block} if block else {})})
        assert eng.capabilities().kv_offload
        eng.begin_point()
        _conversation(eng, block or 32)
        got = eng.kv_cache_info().extra["kv_tiers"]
        fields = eng.end_point()
        truth = eng.server.get(eng.server.root + "/fake/tier_truth").json()
    finally:
        eng.close()
    assert truth["hit_tokens"]["2"] > 0 and truth["tokens_written"] > 0, truth
    # the two tiers the fake has, every other series the server declares (vLLM's disk, p2p) at zero
    assert {k: v for k, v in got["hit_tokens"].items() if k in ("1", "2") or v} == truth["hit_tokens"], (got, truth)
    for k in ("bytes_written", "bytes_read", "tokens_written", "tokens_read"):
        if got[k] is not None:
            assert got[k] == truth[k], k
    moved = {k for k in ("bytes_written", "bytes_read", "tokens_written", "tokens_read") if got[k] is not None}
    assert moved and not got["missing"], got
    assert fields["server_options"]["kv_offload"] is True
    hits = KINDS[eng.endpoint.kind].tier_metrics.hits
    assert hits in fields["server_metrics"]


def test_a_server_without_a_tier_reports_none(tmp_path):
    eng = faked("vllm-serve")()
    try:
        eng.load(spec("/models/tiny", tmp_path), {})
        assert "kv_tiers" not in eng.kv_cache_info().extra
    finally:
        eng.close()


def test_counts_a_server_does_not_export_are_none_not_zero():
    """A /metrics text without the tier series (a server version that lacks them) gives None and
    names what is missing; a declared counter family without samples counts as zero."""
    text = "# TYPE vllm:kv_offload_load_bytes counter\n"
    got = tier_counts(KINDS["vllm"].tier_metrics, text)
    assert got["bytes_read"] == 0 and got["hit_tokens"] is None and got["bytes_written"] is None
    assert "vllm:prompt_tokens_cached_by_source_total" in got["missing"]


# ---- vLLM's own code -----------------------------------------------------------------------------------

VLLM_PYTHON = vllm_python()


@pytest.mark.vllm
def test_vllm_own_parser_takes_the_offloading_flags():
    """The launch command with a second tier, parsed by vLLM's own command-line parser: 3e9 bytes
    land on kv_offloading_size in GiB (x 2^30 = the bytes) with the native backend."""
    from tests_support import vllm_parse
    if VLLM_PYTHON is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm)")
    plan = faked("vllm-serve")().launch_plan(spec("/models/m", device="cuda", dtype="bfloat16"), TIERED, port=8000)
    ns = vllm_parse(VLLM_PYTHON, plan.command[plan.command.index("--model"):])
    assert round(ns["kv_offloading_size"] * GIB) == 3 * 10**9 and ns["kv_offloading_backend"] == "native"


@pytest.mark.vllm
def test_the_record_reads_what_vllms_own_metrics_code_writes():
    """vLLM's own offloading metrics (OffloadPromMetrics with the CPU offloading spec, observing a
    transfer-stats payload built by its OffloadingConnectorStats) and its by-source hit counter,
    written as vLLM's stat logger writes it (the name from its loggers.py, the label values from
    its CacheHitSource), read back by the record: every byte, second and token where it was put."""
    if VLLM_PYTHON is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm)")
    code = (
        "import inspect, types\n"
        "import prometheus_client\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.offloading import metrics as om\n"
        "from vllm.v1.metrics import loggers\n"
        "from vllm.v1.metrics.cache_hit_source import CacheHitSource\n"
        "cfg = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={}))\n"
        "prom = om.OffloadPromMetrics(cfg, {prometheus_client.Counter: prometheus_client.Counter,"
        " prometheus_client.Gauge: prometheus_client.Gauge, prometheus_client.Histogram: prometheus_client.Histogram},"
        " ['model_name', 'engine'], {0: ['m', '0']})\n"
        "s = om.OffloadingConnectorStats()\n"
        "s.increase_counter(om._TransferMetricName.STORE_BYTES, 4096)\n"
        "s.increase_counter(om._TransferMetricName.LOAD_BYTES, 1024)\n"
        "s.increase_counter(om._TransferMetricName.STORE_TIME, 0.25)\n"
        "s.increase_counter(om._TransferMetricName.LOAD_TIME, 0.125)\n"
        "prom.observe(s.data, 0)\n"
        "assert 'name=\"vllm:prompt_tokens_cached_by_source\"' in inspect.getsource(loggers)\n"
        "c = prometheus_client.Counter('vllm:prompt_tokens_cached_by_source', 'x', ['model_name', 'engine', 'source'])\n"
        "for src, n in ((CacheHitSource.DEVICE, 160), (CacheHitSource.HOST, 48)):\n"
        "    c.labels('m', '0', src.value).inc(n)\n"
        "print(prometheus_client.generate_latest().decode())\n")
    r = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = tier_counts(KINDS["vllm"].tier_metrics, r.stdout)
    assert got["hit_tokens"] == {"1": 160, "2": 48}
    assert (got["bytes_written"], got["bytes_read"], got["write_time_s"], got["read_time_s"]) == (4096, 1024, 0.25, 0.125)

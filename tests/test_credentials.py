"""Credentials: keys by reference only, refused literally without being echoed, TLS
verified by default, and one redaction step that no secret survives."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.base import ModelSpec, Request, now_ns
from adapters.endpoint import check_endpoint, endpoint_engine_class
from adapters.endpoint.engine import EndpointError
from fake_servers import FakeBehaviour, children, fake_app, serving, wait_children_gone
from harness.core.paths import REPO_ROOT
from harness.core.redact import DEFAULT, MASK, Redactor, is_sensitive_key, looks_like_credential

SECRET = "sk-test-" + "Zq7" * 8  # shaped like an OpenAI key
SPEC = ModelSpec(path="/nonexistent", name="fake", dtype="float32", device="cpu", max_model_len=512)
FAKE = str(Path(__file__).with_name("fake_servers.py"))


# ---- the redactor: patterns ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,secret", [
    ("Authorization: Bearer abc.DEF-123_xyz", "abc.DEF-123_xyz"),
    ('{"Authorization": "Basic dXNlcjpwYXNz"}', "dXNlcjpwYXNz"),
    ("curl -H 'authorization: token ghx0123456789'", "ghx0123456789"),
    ("api_key=hunter2hunter2 max_tokens=5", "hunter2hunter2"),
    ('{"api_key": "plain-words-key", "n": 1}', "plain-words-key"),
    ("api-key: my_secret_value", "my_secret_value"),
    ("OPENAI_API_KEY=abcdefgh1234", "abcdefgh1234"),
    ("HF_TOKEN=some-token-value", "some-token-value"),
    ("password = correcthorse", "correcthorse"),
    ("client_secret: 'shh-it-is-secret'", "shh-it-is-secret"),
    ("x-api-key: kkkkkkkk", "kkkkkkkk"),
    ("vllm serve m --api-key s3cr3t-value --port 8000", "s3cr3t-value"),
    ("--api-key=s3cr3t-value", "s3cr3t-value"),
    ("endpoints.mine.api_key=s3cr3t-value", "endpoints.mine.api_key=s3cr3t-value"[23:]),
    ("https://alice:pa55word@example.com/v1", "pa55word"),
    ("postgres://u:p%40ss@db:5432/x", "p%40ss"),
    ("GET /v1/models?api_key=querysecret&x=1", "querysecret"),
    (f"error near {SECRET} in line", SECRET),
    ("hf_" + "a1" * 15, "hf_" + "a1" * 15),
    ("ghp_" + "Ab3" * 10, "ghp_" + "Ab3" * 10),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", "dozjgNryP4J3"),
])
def test_patterns_mask_credentials(text, secret):
    out = DEFAULT.text(text)
    assert secret not in out and MASK in out


@pytest.mark.parametrize("text", [
    "max_tokens=32 min_tokens=32 token_ids=[1, 2]", "kv_est_bytes_per_token=2048", "api_key_env=MY_VAR",
    "api_key_file=/run/secrets/key", "eos_token: </s>", "a bearer token is sent", "tokenizer=/models/tiny",
    "--max-num-batched-tokens 8192 --port 8000", "token_count_mismatch: false", "password: null",
    "https://example.com:8443/v1", "api_key: ${oc.env:KEY}", "--api-key {api_key}",
])
def test_patterns_leave_what_is_not_a_credential(text):
    assert DEFAULT.text(text) == text


def test_obj_masks_credential_keys_deeply_and_keeps_the_rest():
    row = {"engine": "mine", "auth": {"method": "env", "variable": "MY_KEY"}, "bytes_per_token": 2048,
           "headers": {"Authorization": "Bearer xyzxyzxyz", "X-Api-Key": "abc", "Accept": "text/event-stream"},
           "launch": ["vllm", "serve", "--api-key", "topsecret", "--port", "8000"],
           "nested": [{"password": "p"}, ("token", "fine"), {"hf_token": "hf-x"}], "token": None}
    out = DEFAULT.obj(row)
    assert out["auth"] == row["auth"] and out["bytes_per_token"] == 2048 and out["token"] is None
    assert out["headers"] == {"Authorization": MASK, "X-Api-Key": MASK, "Accept": "text/event-stream"}
    assert out["launch"] == ["vllm", "serve", "--api-key", MASK, "--port", "8000"]
    assert out["nested"][0] == {"password": MASK} and out["nested"][2] == {"hf_token": MASK}
    assert isinstance(out["nested"][1], tuple)
    assert row["headers"]["X-Api-Key"] == "abc"  # a copy: the input is untouched


@pytest.mark.parametrize("key,sensitive", [
    ("api_key", True), ("X-Api-Key", True), ("Authorization", True), ("HF_TOKEN", True), ("secret", True),
    ("access_token", True), ("db.password", True), ("api_key_env", False), ("api_key_file", False),
    ("max_tokens", False), ("bytes_per_token", False), ("eos_token", False), ("auth", False), ("tokenizer", False),
])
def test_which_keys_name_a_credential(key, sensitive):
    assert is_sensitive_key(key) is sensitive


# ---- the redactor: the run's own secrets -----------------------------------------------------------------

def test_the_redactor_reads_the_secrets_the_endpoints_refer_to(tmp_path, monkeypatch):
    monkeypatch.setenv("IB_K1", "plainkeywithoutanyshape")
    monkeypatch.setenv("IB_H1", "header value/with+chars")
    (tmp_path / "key").write_text("file-held-key\n")
    r = Redactor.from_endpoints({"a": {"api_key_env": "IB_K1"}, "b": {"api_key_file": str(tmp_path / "key"),
                                                                      "headers_env": {"X-Org": "IB_H1"}}})
    text = ("k=plainkeywithoutanyshape f=file-held-key h=header value/with+chars "
            "u=header%20value%2Fwith%2Bchars j=\"header value\\/with+chars\"")
    out = r.text(text)
    for s in ("plainkeywithoutanyshape", "file-held-key", "header value/with+chars", "header%20value%2Fwith%2Bchars"):
        assert s not in out
    assert "plainkeywithoutanyshape" not in repr(r)
    assert r.obj({"x": ["a plainkeywithoutanyshape b"]}) == {"x": ["a *** b"]}


def test_the_hub_token_of_the_environment_is_masked_whatever_the_endpoints(tmp_path):
    token = "plain Hub token/without+any shape"  # not shaped like hf_...: only the literal pass catches it
    r = Redactor.from_endpoints({}, environ={"HF_TOKEN": token})
    text = f"downloading with {token} (url {token.replace(' ', '%20').replace('/', '%2F').replace('+', '%2B')})"
    assert "plain Hub token" not in r.text(text) and "%20Hub%20token" not in r.text(text)
    assert r.obj({"argv": [f"x={token}"]}) != {"argv": [f"x={token}"]}
    legacy = Redactor.from_endpoints([], environ={"HUGGING_FACE_HUB_TOKEN": "legacy-name-token-value"})
    assert "legacy-name-token-value" not in legacy.text("t legacy-name-token-value")
    assert Redactor.from_endpoints({}, environ={}).text(text) == text


def test_an_unset_variable_or_missing_file_is_nothing_to_mask(tmp_path, monkeypatch):
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    r = Redactor.from_endpoints([{"api_key_env": "IB_SURELY_UNSET"}, {"api_key_file": str(tmp_path / "none")}])
    assert r.text("nothing here") == "nothing here" and repr(r) == "Redactor(0 secret forms)"


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(secrets=st.lists(st.text(min_size=1, max_size=24), min_size=1, max_size=3),
       parts=st.lists(st.text(max_size=30), min_size=1, max_size=5), data=st.data())
def test_no_secret_survives_in_text_or_data(secrets, parts, data):
    r = Redactor(secrets)
    picks = [data.draw(st.sampled_from(secrets)) for _ in parts]
    text = "".join(p + s for p, s in zip(parts, picks))
    out = r.text(text)
    assert not any(s in out for s in secrets)
    redacted = r.obj({"a": [text, {"b": (text, 1)}], text: None, "api_key": text})
    assert not any(s in x for s in secrets for x in _strings(redacted))


def _strings(o):
    if isinstance(o, str):
        yield o
    elif isinstance(o, dict):
        for k, v in o.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(o, (list, tuple)):
        for v in o:
            yield from _strings(v)


@given(secret=st.text(alphabet="*#~%abc", min_size=1, max_size=8), prefix=st.text(alphabet="*#~%abc", max_size=8))
def test_masks_never_complete_a_secret(secret, prefix):
    out = Redactor([secret]).text(prefix + secret + prefix)
    assert secret not in out


# ---- validation: literal credentials are refused and never echoed -------------------------------------------

@pytest.mark.parametrize("raw,field", [
    ({"url": "http://127.0.0.1:8000/v1", "api_key": SECRET}, "endpoints.mine.api_key"),
    ({"url": "http://127.0.0.1:8000/v1", "token": "plainvalue123"}, "endpoints.mine.token"),
    ({"url": "http://127.0.0.1:8000/v1", "headers": {"Authorization": f"Bearer {SECRET}"}},
     "endpoints.mine.headers.Authorization"),
    ({"url": "http://127.0.0.1:8000/v1", "headers": {"X-Api-Key": "plainvalue123"}}, "endpoints.mine.headers.X-Api-Key"),
    ({"url": "http://127.0.0.1:8000/v1", "headers": {"X-Custom": SECRET}}, "endpoints.mine.headers.X-Custom"),
    ({"url": "http://bob:plainvalue123@127.0.0.1:8000/v1"}, "endpoints.mine.url"),
    ({"url": "http://127.0.0.1:8000/v1?api_key=plainvalue123"}, "endpoints.mine.url"),
    ({"launch": ["vllm", "--api-key", "plainvalue123", "--port", "{port}"]}, "endpoints.mine.launch[2]"),
    ({"launch": ["vllm", "--api-key=plainvalue123", "--port", "{port}"]}, "endpoints.mine.launch[1]"),
    ({"launch": ["x", "{port}"], "env": {"HF_TOKEN": "plainvalue123"}}, "endpoints.mine.env.HF_TOKEN"),
    ({"url": "http://127.0.0.1:8000/v1", "extra_body": {"api_key": "plainvalue123"}},
     "endpoints.mine.extra_body.api_key"),
])
def test_literal_credentials_are_refused_without_echo(raw, field):
    cfg, problems = check_endpoint("mine", raw)
    assert cfg is None
    text = "\n".join(problems)
    assert SECRET not in text and "plainvalue123" not in text
    assert any(p.startswith(field) for p in problems), problems
    assert "api_key_env" in text or "headers_env" in text or "environment" in text


def test_a_key_given_by_reference_is_accepted(monkeypatch, tmp_path):
    monkeypatch.setenv("IB_OK_KEY", SECRET)
    (tmp_path / "k").write_text(SECRET)
    for ref in ({"api_key_env": "IB_OK_KEY"}, {"api_key_file": str(tmp_path / "k")},
                {"headers_env": {"X-Api-Key": "IB_OK_KEY"}}):
        cfg, problems = check_endpoint("mine", {"url": "https://127.0.0.1:8000/v1", **ref})
        assert problems == [] and cfg is not None


def test_the_shipped_presets_are_clean():
    for path in sorted((REPO_ROOT / "conf" / "endpoint").glob("*.yaml")):
        cfg, problems = check_endpoint(path.stem, yaml.safe_load(path.read_text()))
        assert problems == [], (path.name, problems)
        assert cfg.launched and "{port}" in " ".join(cfg.launch)


# ---- end to end: a server that demands a bearer key -----------------------------------------------------------

@pytest.fixture
def no_leftovers():
    before = children()
    yield
    assert not wait_children_gone(before)


def _files_text(root: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file())


def test_key_from_a_variable_reaches_a_real_server_and_no_file_holds_it(tiny_ckpt, tmp_path, monkeypatch,
                                                                        no_leftovers):
    key = "ib-" + os.urandom(12).hex()
    monkeypatch.setenv("IB_SERVER_KEY", key)
    monkeypatch.setenv("IB_CLIENT_KEY", key)
    raw = yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / "infer-bench-serve.yaml").read_text())
    raw["launch"] = raw["launch"] + ["api_key_env=IB_SERVER_KEY", "log_level=info"]
    cfg, problems = check_endpoint("secured", {**raw, "api_key_env": "IB_CLIENT_KEY"})
    assert not problems
    eng = endpoint_engine_class("secured", cfg)()
    spec = ModelSpec(str(tiny_ckpt), "tiny", "float32", "cpu", 128, run_dir=str(tmp_path))
    try:
        eng.load(spec, {})
        eng.begin_point()
        events = list(eng.serve([Request("a", [5, 6, 7], 4)], now_ns()))
        fields = eng.end_point()
        # the wrong key (another client attached to the same server): a failed load that says 401
        monkeypatch.setenv("IB_WRONG_KEY", "wrong-" + key)
        wrong_cfg, problems = check_endpoint("wrong", {"url": eng.server.base, "kind": "infer-bench",
                                                       "api_key_env": "IB_WRONG_KEY"})
        assert not problems
        wrong = endpoint_engine_class("wrong", wrong_cfg)()
        with pytest.raises(EndpointError, match="401 Unauthorized") as err:
            wrong.load(spec, {})
        wrong.close()
    finally:
        eng.close()
    assert len(events) == 4 and fields["failed_requests"] == 0
    assert fields["auth"] == {"method": "env", "variable": "IB_CLIENT_KEY"}
    assert key not in json.dumps(fields)
    assert "(Bearer key required)" in (tmp_path / "logs" / "secured.log").read_text()
    assert key not in _files_text(tmp_path)
    assert key not in str(err.value) and "wrong-" not in str(err.value)


def test_key_from_a_file_and_in_the_launch_template_stays_out_of_rows_and_logs(tmp_path, no_leftovers):
    key = "file-" + os.urandom(10).hex()
    (tmp_path / "key.txt").write_text(key + "\n")
    cfg, problems = check_endpoint("filed", {
        "launch": ["{python}", FAKE, "ok", "--port", "{port}", "--api-key", "{api_key}"], "kind": "vllm",
        "api_key_file": str(tmp_path / "key.txt")})
    assert not problems
    eng = endpoint_engine_class("filed", cfg)()
    run = tmp_path / "run"
    try:
        eng.load(ModelSpec("/x", "fake", "float32", "cpu", 64, run_dir=str(run)), {})
        eng.begin_point()
        assert len(list(eng.serve([Request("a", [5, 6], 3)], now_ns()))) == 3
        fields = eng.end_point()
    finally:
        eng.close()
    assert fields["auth"] == {"method": "file", "path": str(tmp_path / "key.txt")}
    assert "--api-key ***" in fields["launch_command"] and key not in json.dumps(fields)
    assert key not in _files_text(run)


# ---- TLS --------------------------------------------------------------------------------------------------------

def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "infer-bench test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_is_verified_by_default_a_ca_can_be_added_and_not_verifying_is_stated(tmp_path):
    cert, key = _self_signed(tmp_path)
    with serving(fake_app(FakeBehaviour()), ssl_certfile=str(cert), ssl_keyfile=str(key)) as url:
        assert url.startswith("https://")
        cfg, _ = check_endpoint("tls", {"url": url + "/v1", "kind": "vllm"})
        eng = endpoint_engine_class("tls", cfg)()
        with pytest.raises(EndpointError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed|SSL"):
            eng.load(SPEC, {})
        eng.close()
        for extra, verified in (({"ca_bundle": str(cert)}, True), ({"verify_tls": False}, False)):
            cfg, problems = check_endpoint("tls", {"url": url + "/v1", "kind": "vllm", **extra})
            assert not problems
            eng = endpoint_engine_class("tls", cfg)()
            eng.load(SPEC, {})
            eng.begin_point()
            assert len(list(eng.serve([Request("a", [1, 2], 3)], now_ns()))) == 3
            assert eng.end_point()["tls_verify"] is verified
            eng.close()


def test_credential_shapes():
    assert looks_like_credential(SECRET) and looks_like_credential("Bearer abcdefgh")
    assert not looks_like_credential("text/event-stream") and not looks_like_credential("sk-short")

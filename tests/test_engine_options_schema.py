"""Engine options as workloads' configs are: one `options_cls` per in-process engine, checked by
harness.core.schema.check (every problem at once, each naming engine_options.<engine>.<field>),
and conf/engine/<engine>.yaml generated from it."""

from __future__ import annotations

import sys
import types
from dataclasses import asdict, dataclass

import pytest
import yaml

import adapters
from adapters.base import Engine, ModelSpec
from adapters.engine_yaml import CONF, in_process_engines, render
from harness import cli
from harness.cli import check_jobs

ENGINES = in_process_engines()


@pytest.mark.parametrize("engine", ENGINES, ids=[e.name for e in ENGINES])
def test_conf_engine_yaml_is_what_the_options_class_generates(engine):
    """Edit the dataclass, then run `python -m adapters.engine_yaml`: the file cannot drift."""
    text = (CONF / f"{engine.name}.yaml").read_text()
    assert text == render(engine), f"conf/engine/{engine.name}.yaml is stale: run python -m adapters.engine_yaml"
    assert yaml.safe_load(text) == asdict(engine.options_cls())


@pytest.mark.parametrize("engine", ENGINES, ids=[e.name for e in ENGINES])
def test_the_shipped_defaults_pass_the_schema(engine):
    """conf/engine/<engine>.yaml as shipped is valid: a field whose default is null passes even when
    it has choices (trtllm's capacity_scheduler_policy: null once failed 'not one of ...')."""
    defaults = yaml.safe_load((CONF / f"{engine.name}.yaml").read_text())
    assert engine.typed_options(defaults)[1] == []


def test_an_unavailable_engine_is_not_a_config_problem_but_its_bad_option_is():
    """engines=auto on a CPU: TensorRT-LLM cannot run (no GPU, not installed) and says so in its
    row; its shipped options are no problem. A bad value of one of its options still is."""
    assert check_jobs(["engines=auto"]) == []
    problems = check_jobs(["engines=auto", "engine_options.trtllm.capacity_scheduler_policy=SOMETIMES"])
    assert problems and all(p.startswith("engine_options.trtllm.capacity_scheduler_policy=SOMETIMES") for p in problems)


@pytest.mark.parametrize("engine", ENGINES, ids=[e.name for e in ENGINES])
def test_every_problem_at_once_each_named(engine):
    """Two bad fields and one unknown one: three problems, each under engine_options.<engine>."""
    fields = list(asdict(engine.options_cls()))
    bad = {fields[0]: [1, 2], fields[-1]: {"x": 1}, "no_such_option": 1}  # a list, a dict: no field takes them
    spec = ModelSpec(path="", name="tiny", device="cuda" if engine.name == "trtllm" else "cpu")
    problems = engine.check_options(bad, spec)
    for name in (fields[0], fields[-1], "no_such_option"):
        assert any(p.startswith(f"engine_options.{engine.name}.{name}") for p in problems), (name, problems)
    assert engine.typed_options({})[0] == engine.options_cls()


def test_reference_block_size_zero_is_named_by_the_run_check():
    problems = check_jobs(["engines=[reference]", "engine_options.reference.block_size=0"])
    assert any(p.startswith("engine_options.reference.block_size=0") for p in problems), problems


def test_vllm_max_num_seqs_negative_is_named_by_the_run_check():
    # python= a worker interpreter: the options are checked here whether or not vLLM is installed
    problems = check_jobs(["engines=[vllm]", f"engine_options.vllm.python={sys.executable}",
                           "engine_options.vllm.max_num_seqs=-1"])
    assert any(p.startswith("engine_options.vllm.max_num_seqs=-1") for p in problems), problems


def test_the_command_exits_2_naming_both_fields(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["infer-bench", "engines=[reference,vllm]",
                                      "engine_options.reference.block_size=0",
                                      f"engine_options.vllm.python={sys.executable}",
                                      "engine_options.vllm.max_num_seqs=-1"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "engine_options.reference.block_size=0" in err and "engine_options.vllm.max_num_seqs=-1" in err
    assert "Traceback" not in err


def test_a_registered_engine_with_options_gets_its_file_without_another_edit(monkeypatch):
    """The generated files follow the adapters' REGISTRY: an engine registered there with an
    options_cls is rendered; one without options, or one added through the environment, is not."""
    @dataclass
    class NewOptions:
        """Options of an engine registered by this test."""
        depth: int = 3

    class NewEngine(Engine):  # never instantiated: only its class attributes are read
        name = "new_engine"
        options_cls = NewOptions

    class NoOptions(Engine):
        name = "no_options"

    module = types.ModuleType("engine_registered_by_test")
    module.NewEngine, module.NoOptions = NewEngine, NoOptions  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(adapters.REGISTRY, "new_engine", f"{module.__name__}:NewEngine")
    monkeypatch.setitem(adapters.REGISTRY, "no_options", f"{module.__name__}:NoOptions")
    monkeypatch.setenv(adapters.EXTRA_ENGINES_ENV, f"plugin={module.__name__}:NewEngine")
    engines = in_process_engines()
    assert engines == ENGINES + [NewEngine]
    assert "\ndepth: 3" in render(NewEngine)

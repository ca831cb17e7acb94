"""harness.engines: the engine resolver and capability check that the run's plan and the
engine's worker share."""

from __future__ import annotations

from adapters import engine_class
from adapters.base import Capabilities
from harness.engines import capability_problems, resolve_engine


class FakeCpuFloat32Engine:
    """A FAKE engine class (only its capabilities): float32 on CPU."""

    @classmethod
    def capabilities(cls, options=None):
        return Capabilities(dtypes=("float32",), devices=("cpu",))


def test_capability_problems_name_the_dtype_and_the_device():
    assert capability_problems(FakeCpuFloat32Engine, {}, "fake", "float32", "cpu") == []
    problems = capability_problems(FakeCpuFloat32Engine, {}, "fake", "bfloat16", "cuda:1")
    assert len(problems) == 2
    assert problems[0].startswith("dtype=bfloat16: engine fake cannot run it") and "float32" in problems[0]
    assert problems[1].startswith("device=cuda:1: engine fake runs only on cpu")


def test_resolve_engine_gives_the_registered_class_or_the_endpoints_problems():
    assert resolve_engine("reference") == (engine_class("reference"), [])
    cls, problems = resolve_engine("mine", {"kind": "vllm"})  # neither url nor launch
    assert cls is None and problems and all(p.startswith("endpoints.mine") for p in problems), problems

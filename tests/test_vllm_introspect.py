"""The vLLM adapter against the INSTALLED vLLM's own definitions (no engine start): every argument
it passes is a field of `vllm.EngineArgs`, the defaults it documents as "vLLM's own" are vLLM's, and
every private object adapters/vllm/introspect.py reads is where it looks for it. A failure here
names what vLLM moved. Needs only `import vllm` (skipped otherwise)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect

import pytest

from adapters.base import ModelSpec
from adapters.vllm import introspect
from adapters.vllm.options import GPU_MEMORY_UTILIZATION, engine_kwargs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not in this environment: make test runs these under vLLM's own (.venv-vllm/bin/python -m pytest)"),
]

CPU = ModelSpec(path="/m", name="tiny", dtype="float32", device="cpu", max_model_len=1024,
                max_batch_size=300, max_batch_tokens=20_000)
GPU = ModelSpec(path="/m", name="tiny", dtype="bfloat16", device="cuda", max_model_len=1024)
EVERY_OPTION = {"block_size": 64, "max_num_seqs": 8, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.5,
                "kv_cache_memory_bytes": 1 << 28, "enforce_eager": True, "log_stats": False, "max_logprobs": 40}


def _engine_args_fields() -> dict[str, dataclasses.Field]:
    from vllm import EngineArgs
    return {f.name: f for f in dataclasses.fields(EngineArgs)}


def test_every_argument_the_adapter_passes_is_an_engine_args_field():
    fields = _engine_args_fields()
    for spec in (CPU, GPU):
        for opts in ({}, EVERY_OPTION):
            unknown = set(engine_kwargs(spec, opts)) - set(fields)
            assert not unknown, f"vllm.EngineArgs has no field(s) {sorted(unknown)}"


def test_the_documented_vllm_defaults_are_vllms():
    fields = _engine_args_fields()
    # async scheduling: vLLM decides (None -> on for a GPU with the in-process executor), so the
    # adapter must pass False explicitly
    assert fields["async_scheduling"].default is None
    assert fields["gpu_memory_utilization"].default == GPU_MEMORY_UTILIZATION
    assert fields["enforce_eager"].default is False  # vLLM's own: CUDA graphs / torch.compile
    assert fields["max_logprobs"].default == 20  # options.py: "null = vLLM's default (20)"
    assert fields["logprobs_mode"].default == "raw_logprobs"


def test_cpu_platform_forces_async_scheduling_off():
    """vllm/platforms/cpu.py turns async scheduling off whatever it is asked: the reason the CPU
    build never showed the batch-queue problem."""
    from vllm.platforms.cpu import CpuPlatform
    src = inspect.getsource(CpuPlatform.check_and_update_config)
    assert "async_scheduling = False" in src


def test_the_engine_core_objects_introspect_reads_exist():
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import InprocClient
    assert callable(EngineCore.step) and callable(EngineCore.step_with_batch_queue)
    init = inspect.getsource(EngineCore.__init__)
    for attr in ("self.batch_queue", "self.step_fn", "self.scheduler"):
        assert attr in init, f"EngineCore.__init__ no longer sets {attr}"
    assert "self.engine_core = EngineCore(" in inspect.getsource(InprocClient.__init__)
    from vllm.v1.core.block_pool import BlockPool
    assert callable(BlockPool.get_num_free_blocks)
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    assert {"num_blocks", "kv_cache_tensors", "kv_cache_groups"} <= {f.name for f in dataclasses.fields(KVCacheConfig)}
    assert {"kv_cache_spec", "layer_names"} <= {f.name for f in dataclasses.fields(KVCacheGroupSpec)}
    assert "size" in {f.name for f in dataclasses.fields(KVCacheTensor)}


def test_allowed_cpus_come_from_vllms_topology_probe():
    import os
    cpus, one_per_core = introspect.allowed_cpus()
    assert sorted(c[0] for c in cpus) == sorted(os.sched_getaffinity(0))
    assert isinstance(one_per_core, bool)


def test_prompt_logprobs_put_the_actual_token_first_with_its_rank():
    """What adapters/vllm/engine.py's _scores relies on: position 0 is None, then per position the
    prompt token with its own rank, then the top k (ranks 1..k)."""
    from vllm.logprobs import append_logprobs_for_next_position, create_prompt_logprobs
    plp = create_prompt_logprobs(flat_logprobs=False)
    append_logprobs_for_next_position(plp, [42, 7, 9], [-5.0, -0.1, -0.2], [None] * 3, rank=17, num_logprobs=2)
    assert plp[0] is None
    assert {t: (lp.logprob, lp.rank) for t, lp in plp[1].items()} == {42: (-5.0, 17), 7: (-0.1, 1), 9: (-0.2, 2)}

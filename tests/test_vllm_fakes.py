"""The vLLM adapter's GPU behaviours against FAKE vLLM modules: no vLLM needed, no GPU.

`FakeLLM` stands in for `vllm.LLM` with the object shapes the adapter reads (llm_engine,
vllm_config, engine_core.engine_core with batch_queue/step_fn/scheduler). `FakeEngineCore`
reproduces what vLLM's engine core does on a GPU with async scheduling: it steps through a
two-batch queue (EngineCore.step_with_batch_queue), so the first step() returns nothing and each
later step returns the batch scheduled one step earlier. Every fake token is the number of the
step whose (fake) forward pass computed it, so a test can tell which step's work a returned token
belongs to. These fakes test OUR logic; the real engine is tested in tests/test_vllm.py.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from adapters.base import ModelSpec

GIB = 1 << 30


@dataclass
class FakeSamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    ignore_eos: bool = False
    detokenize: bool = True
    output_kind: object = None
    prompt_logprobs: int | None = None


@dataclass
class FakeRequest:
    rid: str
    prompt: list[int]
    max_tokens: int
    num_computed_tokens: int = 0
    out: list[int] = field(default_factory=list)


class FakeEngineCore:
    """Fake of vLLM's EngineCore: one forward pass per step over every live request (whole prompt
    at once, then one token each). With `batch_queue` the outputs of a step come back one step late."""

    def __init__(self, use_batch_queue: bool) -> None:
        self.batch_queue = deque(maxlen=2) if use_batch_queue else None
        self.step_fn = self.step_with_batch_queue if use_batch_queue else self.step
        self.requests: dict[str, FakeRequest] = {}
        self.steps = 0
        self.num_blocks = 101
        self.scheduler = SimpleNamespace(
            requests=self.requests,
            kv_cache_manager=SimpleNamespace(
                block_pool=SimpleNamespace(num_gpu_blocks=self.num_blocks, get_num_free_blocks=self._free),
                coordinator=SimpleNamespace(single_type_managers=[SimpleNamespace(req_to_blocks={})]),
                kv_cache_config=SimpleNamespace(
                    num_blocks=self.num_blocks,
                    kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=1024, block_size=16),
                                                     layer_names=["l0", "l1"])],
                    kv_cache_tensors=[SimpleNamespace(size=self.num_blocks * 2048)])))

    def _free(self) -> int:
        used = sum(-(-(len(r.prompt) + len(r.out)) // 16) for r in self.requests.values())
        return self.num_blocks - 1 - used

    def _forward(self) -> list:
        self.steps += 1
        outs = []
        for r in list(self.requests.values()):
            r.num_computed_tokens = len(r.prompt) + len(r.out)
            r.out.append(self.steps)  # the token says which step computed it
            done = len(r.out) >= r.max_tokens
            outs.append(SimpleNamespace(request_id=r.rid, finished=done, prompt_logprobs=None,
                                        outputs=[SimpleNamespace(token_ids=[self.steps])]))
            if done:
                del self.requests[r.rid]
        return outs

    def step(self):
        return self._forward()

    def step_with_batch_queue(self):
        self.batch_queue.appendleft(self._forward())
        if len(self.batch_queue) < 2:
            return []  # the first step only fills the queue
        return self.batch_queue.pop()


class FakeLLMEngine:
    def __init__(self, kwargs: dict, use_batch_queue: bool) -> None:
        self.core = FakeEngineCore(use_batch_queue)
        self.engine_core = SimpleNamespace(engine_core=self.core, shutdown=lambda: None)
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=16, cache_dtype="auto", kv_cache_size_tokens=1600,
                                         num_gpu_blocks=self.core.num_blocks, enable_prefix_caching=True),
            model_config=SimpleNamespace(max_model_len=kwargs["max_model_len"], dtype="torch.bfloat16",
                                         max_logprobs=20, logprobs_mode="raw_logprobs"),
            scheduler_config=SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=4096,
                                             enable_chunked_prefill=True,
                                             async_scheduling=use_batch_queue),
            parallel_config=SimpleNamespace(tensor_parallel_size=1))

    def add_request(self, rid, prompt, params, arrival_time=None):
        self.core.requests[rid] = FakeRequest(rid, list(prompt["prompt_token_ids"]), params.max_tokens)

    def step(self):
        return self.core.step_fn()

    def abort_request(self, ids):
        for rid in ids:
            self.core.requests.pop(rid, None)


class FakeLLM:
    """Fake of vllm.LLM. `honours_async_flag`: like vLLM 0.32/0.33 on a GPU, the batch queue is used
    unless async_scheduling=False is passed; False: a vLLM that uses it whatever it is told."""

    started: list[dict] = []
    honours_async_flag = True
    model: object = None  # what apply_model hands its function: set per test (None: a model of no modules)

    def __init__(self, **kwargs) -> None:
        FakeLLM.started.append(kwargs)
        queue = kwargs.get("async_scheduling") is not False or not FakeLLM.honours_async_flag
        self.llm_engine = FakeLLMEngine(kwargs, use_batch_queue=queue)

    def get_metrics(self):
        return []

    def apply_model(self, func):
        """vllm.LLM.apply_model: `func` on the model of each worker (one here): FakeLLM.model."""
        return [func(FakeLLM.model)]

    def reset_prefix_cache(self):
        return True


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def fake_vllm(monkeypatch):
    """FAKE vllm modules in sys.modules for the duration of a test (the real ones are restored)."""
    FakeLLM.started, FakeLLM.honours_async_flag = [], True
    FakeLLM.model = _plain_model()
    kinds = SimpleNamespace(DELTA="delta", FINAL_ONLY="final")
    monkeypatch.setitem(sys.modules, "vllm", _module("vllm", LLM=FakeLLM, SamplingParams=FakeSamplingParams))
    monkeypatch.setitem(sys.modules, "vllm.inputs", _module("vllm.inputs", TokensPrompt=dict))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params",
                        _module("vllm.sampling_params", RequestOutputKind=kinds))
    import adapters.vllm.engine as eng
    monkeypatch.setattr(eng, "device_memory", lambda device: (140 * GIB, 141 * GIB), raising=False)
    # the FAKE vLLM's kernel selection takes every dtype (the real one is asked in tests/test_vllm_families.py)
    monkeypatch.setattr(eng.introspect, "cpu_kernel_refusal", lambda engine_kwargs: None)
    return eng


def _plain_model():
    import torch
    return torch.nn.Sequential(torch.nn.Linear(2, 2))


def _latent_model(broken: bool):
    """A FAKE model with one latent-attention layer (the attributes vLLM's MLA layers have), whose
    rotary op (a FAKE of vLLM's RotaryEmbedding: interleaved pairs, plain theta 10000) either
    rotates what it is given or, `broken`, rotates a 3-D query as if every row were position 0's
    neighbour - the kind of fault the probe is for."""
    import torch

    class FakeRope(torch.nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            ang = torch.arange(64, dtype=torch.float32)[:, None] * inv[None, :]
            self.register_buffer("cos_sin_cache", torch.cat([ang.cos(), ang.sin()], -1))

        def forward_native(self, pos, q, k):
            cos, sin = self.cos_sin_cache[pos].chunk(2, -1)

            def rot(x):
                c, s = cos.view(len(pos), *([1] * (x.dim() - 2)), -1), sin.view(len(pos), *([1] * (x.dim() - 2)), -1)
                out = x.clone()
                out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
                out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
                return out
            return rot(q), rot(k)

        def forward(self, pos, q, k):
            if broken and q.dim() == 3:
                return self.forward_native(torch.ones_like(pos), q, k)[0], self.forward_native(pos, q, k)[1]
            return self.forward_native(pos, q, k)

    layer = torch.nn.Module()
    layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads = 8, 16, 4
    layer.rotary_emb = FakeRope(16)
    model = torch.nn.Module()
    model.attn = layer
    return model


def test_a_model_this_vllm_computes_wrongly_is_refused_with_the_probes_line(fake_vllm):
    FakeLLM.model = _latent_model(broken=True)
    e = fake_vllm.VLLMEngine()
    with pytest.raises(fake_vllm.EngineUnavailable, match=r"computes this model wrongly.*FakeRope.*rotates the "
                       r"\[tokens, heads, 16\] query.*run_despite_faults=true"):
        e.load(GPU, {})
    assert e._llm is None  # closed: no engine left behind
    info = fake_vllm.VLLMEngine().load(GPU, {"run_despite_faults": True})  # memory and speed studies
    assert len(info.details["output_faults"]) == 1 and "max error" in info.details["output_faults"][0]


def test_a_latent_model_whose_rotary_op_is_right_loads_with_no_fault(fake_vllm):
    FakeLLM.model = _latent_model(broken=False)
    info = fake_vllm.VLLMEngine().load(GPU, {})
    assert info.details["output_faults"] == []


GPU = ModelSpec(path="/nonexistent", name="fake", dtype="bfloat16", device="cuda", max_model_len=256)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def test_async_scheduling_is_turned_off_and_each_step_returns_its_own_batch(fake_vllm):
    e = fake_vllm.VLLMEngine()
    info = e.load(GPU, {})
    core = e._engine.engine_core.engine_core
    pre = e.prefill(PROMPTS)
    assert core.steps == 1 and pre.first_tokens == [1, 1]  # prefill = one forward pass, its own tokens
    dec = e.decode(3)
    # step i of decode() returned the tokens its own forward pass (engine step i + 2) computed
    assert dec.tokens == [[2, 2], [3, 3], [4, 4]] and len(dec.steps) == 3
    assert FakeLLM.started[-1]["async_scheduling"] is False
    assert info.details["scheduling"] == "sync" and e.kv_cache_info().extra["scheduling"] == "sync"
    e.close()


def test_load_refuses_an_engine_core_that_still_steps_through_a_batch_queue(fake_vllm):
    FakeLLM.honours_async_flag = False
    e = fake_vllm.VLLMEngine()
    with pytest.raises(RuntimeError, match="batch queue"):
        e.load(GPU, {})


def test_cuda_graphs_by_default_on_a_gpu_and_recorded(fake_vllm):
    e = fake_vllm.VLLMEngine()
    info = e.load(GPU, {})
    assert FakeLLM.started[-1]["enforce_eager"] is False
    assert info.details["enforce_eager"] is False and info.details["cuda_graphs"] is True
    e.close()


def test_gpu_memory_utilization_over_free_memory_is_refused_before_start_up(fake_vllm, monkeypatch):
    monkeypatch.setattr(fake_vllm, "device_memory", lambda device: (40 * GIB, 141 * GIB), raising=False)
    e = fake_vllm.VLLMEngine()
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.9.*gpu_memory_utilization=0\.28"):
        e.load(GPU, {})
    assert FakeLLM.started == []  # vLLM was never started


def test_prefill_passes_the_real_output_bound(fake_vllm):
    e = fake_vllm.VLLMEngine()
    e.load(GPU, {})
    e.prefill(PROMPTS, max_new_tokens=3)
    assert [r.max_tokens for r in e._engine.engine_core.engine_core.requests.values()] == [3, 3]
    e.decode(2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        e.decode(1)
    e.close()


@pytest.fixture
def torch_threads():
    import torch
    before = torch.get_num_threads()
    yield
    torch._C.set_num_threads(before)


@pytest.mark.parametrize("options,threads,policy", [
    ({}, 2, "equal"),
    ({"reserve_scheduler_core": True}, 1, "vllm-reserved-core"),
    ({"cpu_threads": 1}, 1, "explicit"),
])
def test_cpu_threads_follow_the_runs_equal_share(fake_vllm, torch_threads, options, threads, policy):
    import torch
    spec = ModelSpec(path="/nonexistent", name="fake", dtype="float32", device="cpu", max_model_len=256, threads=2)
    e = fake_vllm.VLLMEngine()
    info = e.load(spec, options)
    assert info.compute_threads == threads == torch.get_num_threads()
    assert info.details["thread_policy"] == policy
    e.close()


# ---- prompt logprobs in vLLM's documented shape: list, None first, dict token -> Logprob ----------
def _lp(logprob, rank):
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_scores_read_vllms_prompt_logprobs_actual_token_first():
    from adapters.vllm.engine import prompt_scores
    seq = [7, 8, 9]
    plp = [None,
           {8: _lp(-0.5, 1), 3: _lp(-1.5, 2)},  # actual token 8 is the best: one entry for it
           {9: _lp(-4.0, 7), 5: _lp(-0.2, 1), 6: _lp(-0.9, 2)}]  # actual token 9 ranks 7th
    s = prompt_scores(seq, 1, 2, plp)
    assert s.top_ids == [[8, 3], [5, 6]] and s.top_logprobs == [[-0.5, -1.5], [-0.2, -0.9]]
    assert s.target_logprobs == [-0.5, -4.0]
    assert prompt_scores(seq, 2, 1, plp).top_ids == [[5]]
    assert prompt_scores(seq, 3, 1, None).target_logprobs == []  # nothing to score
    with pytest.raises(RuntimeError, match="actual token"):
        prompt_scores(seq, 1, 1, [None, {3: _lp(-1.0, 1)}, {5: _lp(-0.2, 1)}])

"""The reference engine's LoRA adapters (adapters/reference/lora.py): the slots' arithmetic against
each row's own x A^T B^T (PEFT's definition), slots loaded and evicted least recently used first,
the row mask. The engine serving adapters end to end: tests/test_lora_engines.py."""

from __future__ import annotations

import pytest
import torch

from adapters.reference.lora import GROUPS, PARTS, HostAdapter, Slots
from harness.checkpoint import shipped_checkpoint
from harness.core.presets import load_preset
from harness.lora_cli import make_adapters

pytest.importorskip("peft", reason="peft writes the test's adapters (pip install peft)")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from adapters.reference.model import ModelConfig
    ckpt = shipped_checkpoint(load_preset("tiny-trained"))
    out = tmp_path_factory.mktemp("ads")
    written = make_adapters(ckpt, load_preset("tiny-trained"), "tiny-trained", out, ["a0", "a1", "a2"], 8, 16,
                            ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], 0, 2.0)
    cfg = ModelConfig.from_dir(ckpt)
    return cfg, {n: HostAdapter.read(n, p, cfg, 8) for n, p in written}, dict(written)


def test_each_row_gets_its_own_adapters_product(setup):
    """For a batch of rows with adapters a0, none, a1, a0: the slots' product equals each row's
    x A^T B^T times alpha / r, computed from the PEFT files directly, and nothing for the base row."""
    from safetensors.torch import load_file
    cfg, host, paths = setup
    slots = Slots(cfg, host, 2, 8, torch.float32, torch.device("cpu"))
    s0, s1 = slots.acquire("a0", set()), slots.acquire("a1", set())
    rows = [s0, None, s1, s0]
    mask = slots.mask(rows)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, cfg.hidden_size, generator=g)
    y = slots.add(torch.zeros(4, cfg.num_heads * cfg.head_dim + 2 * cfg.num_kv_heads * cfg.head_dim), x, mask, 1, "qkv")
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    for i, name in enumerate(["a0", None, "a1", "a0"]):
        if name is None:
            assert torch.count_nonzero(y[i]) == 0
            continue
        t = load_file(f"{paths[name]}/adapter_model.safetensors")
        pre = "base_model.model.model.layers.1.self_attn."
        want_q = x[i] @ t[pre + "q_proj.lora_A.weight"].T @ t[pre + "q_proj.lora_B.weight"].T * 2.0
        want_v = x[i] @ t[pre + "v_proj.lora_A.weight"].T @ t[pre + "v_proj.lora_B.weight"].T * 2.0
        torch.testing.assert_close(y[i, :q], want_q, rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(y[i, q:q + kv]) == 0  # k_proj: not targeted
        torch.testing.assert_close(y[i, q + kv:], want_v, rtol=1e-5, atol=1e-5)


def test_slots_load_into_free_ones_then_evict_the_least_recently_used_idle_one(setup):
    cfg, host, _ = setup
    slots = Slots(cfg, host, 2, 8, torch.float32, torch.device("cpu"))
    assert (slots.acquire("a0", set()), slots.acquire("a1", set())) == (0, 1) and slots.loads == 2
    assert slots.acquire("a0", set()) == 0 and slots.loads == 2  # resident: no load; a1 is now the LRU
    assert slots.acquire("a2", set()) == 1 and (slots.loads, slots.evictions) == (3, 1)
    assert slots.resident == ["a0", "a2"]
    assert slots.acquire("a1", busy={0, 1}) is None  # both slots serve running sequences: it waits
    assert slots.acquire("a1", busy={1}) == 0 and slots.evictions == 2
    assert slots.stats()["resident"] == ["a1", "a2"]
    with pytest.raises(ValueError, match="not among lora_adapters"):
        slots.acquire("nope", set())


def test_a_batch_without_adapters_has_no_mask_and_every_group_is_as_wide(setup):
    cfg, host, _ = setup
    slots = Slots(cfg, host, 3, 8, torch.float32, torch.device("cpu"))
    assert slots.mask([None, None]) is None
    s = slots.acquire("a2", set())
    m = slots.mask([None, s])
    assert m.shape == (2, 3 * PARTS * 8) and m[1].sum() == PARTS * 8 and m[0].sum() == 0
    assert all(slots.a[0][g].shape[1] == 3 * PARTS * 8 for g in GROUPS)


# ---- the engine ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(setup, tmp_path_factory):
    """The reference engine with three adapters in one slot, and transformers with PEFT, fp32."""
    from adapters.base import ModelSpec
    from adapters.hf import HFEngine
    from adapters.reference.engine import ReferenceEngine
    cfg, _, paths = setup
    ads = [{"name": n, "path": p, "rank": 8} for n, p in paths.items()]
    spec = ModelSpec(str(shipped_checkpoint(load_preset("tiny-trained"))), "tiny-trained", "float32", "cpu", 256,
                     threads=2)
    ref, hf = ReferenceEngine(), HFEngine()
    ref.load(spec, {"lora_adapters": ads, "max_loras": 1, "block_size": 8})
    hf.load(spec, {"lora_adapters": ads})
    yield ref, hf
    ref.close()
    hf.close()


def _serve(engine, reqs):
    from adapters.base import now_ns
    got, cached = {r.request_id: [] for r in reqs}, {}
    for ev in engine.serve(reqs, now_ns()):
        got[ev.request_id].append(ev.token_id)
        if ev.cached_tokens is not None:
            cached[ev.request_id] = ev.cached_tokens
    return got, cached


def test_mixed_adapters_in_one_slot_are_served_as_transformers_serves_them(engines):
    """Three adapters and the base model, one slot: requests wait for the slot in turn, each is
    served by its own adapter (transformers with PEFT gives the same tokens, fp32), and the slot was
    loaded and evicted as they took turns."""
    from adapters.base import Request
    ref, hf = engines
    prompts = [[5 + (7 * i + 31 * j) % 4000 for i in range(20 + j)] for j in range(6)]
    names = [None, "a0", "a1", "a2", "a0", None]
    reqs = [Request(f"r{j}", p, 6, adapter=a) for j, (p, a) in enumerate(zip(prompts, names))]
    before = ref.lora_stats()
    got, _ = _serve(ref, reqs)
    want, _ = _serve(hf, reqs)
    assert got == want
    after = ref.lora_stats()
    assert after["loads"] - before["loads"] >= 3 and after["evictions"] - before["evictions"] >= 2
    assert len({tuple(got[f"r{j}"]) for j in range(4)}) == 4  # every adapter changes the output


def test_a_prefix_computed_with_one_adapter_is_not_reused_by_another(engines):
    from adapters.base import Request
    ref, _ = engines
    ref.reset_prefix_cache()
    prompt = [40 + i for i in range(33)]
    _, first = _serve(ref, [Request("x", prompt, 2, adapter="a0")])
    _, same = _serve(ref, [Request("y", prompt, 2, adapter="a0")])
    _, other = _serve(ref, [Request("z", prompt, 2, adapter="a1")])
    _, base = _serve(ref, [Request("b", prompt, 2)])
    assert first["x"] == 0 and same["y"] == 32 and other["z"] == 0 and base["b"] == 0


def test_scores_with_an_adapter_agree_with_transformers(engines):
    ref, hf = engines
    seqs = [[11 + (3 * i) % 4000 for i in range(40)], [900 + (5 * i) % 3000 for i in range(25)]]
    a = ref.score(seqs, [10, 5], 4, adapter="a2")
    b = hf.score(seqs, [10, 5], 4, adapter="a2")
    base = ref.score(seqs, [10, 5], 4)
    for x, y, z in zip(a, b, base):
        assert x.top_ids == y.top_ids
        assert max(abs(u - v) for u, v in zip(x.target_logprobs, y.target_logprobs)) < 1e-4
        assert max(abs(u - v) for u, v in zip(x.target_logprobs, z.target_logprobs)) > 1e-2

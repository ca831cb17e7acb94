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
    assert all(slots.a[0][g].shape[0] == 3 * PARTS * 8 for g in GROUPS)

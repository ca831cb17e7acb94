"""The reference engine on today's families (issue 38): qk-norm (Qwen3), mixture of experts
(Qwen3-MoE, Mixtral, DeepSeek-V3's routed and shared experts), sliding windows (Mistral's, and
Qwen3's alternating `layer_types`) and DeepSeek-V3's latent attention.

Each family is a tiny random-weight checkpoint made here with transformers' own config class
(seconds on a CPU). Parity is the project's float32 bar (harness.core.parity): greedy tokens
equal to transformers' token for token, and teacher-forced log-probabilities within
THRESHOLDS["float32"]. Each family also has an injected bug of its own that parity must catch,
made by swapping one of our own functions for a plausibly wrong variant."""

from __future__ import annotations

import math

import pytest
import torch

from adapters.base import ModelSpec
from adapters.hf import HFEngine
from adapters.reference import attention as ref_attention
from adapters.reference import model as ref_model
from adapters.reference.engine import ReferenceEngine
from harness.core.parity import compare_scores, greedy_agreement, verdict
from workloads.parity import greedy_tokens

VOCAB = 256
PROMPT_LENS = (24, 61, 150)  # one prompt past the sliding models' window of 48
TOKENS = 12


def _common(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                tie_word_embeddings=False, initializer_range=0.2)
    base.update(kw)
    return base


def family_configs():
    from transformers import DeepseekV3Config, MistralConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    return {
        "qwen3": Qwen3Config(**_common()),
        "qwen3-moe": Qwen3MoeConfig(**_common(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
        "mixtral": MixtralConfig(**_common(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
        "mistral-window": MistralConfig(**_common(sliding_window=48)),
        # YaRN: 4x a trained context of 64 positions (the prompts run past it); with mscale / mscale_all_dim
        # on DeepSeek (its softmax scale corrected too)
        "qwen3-yarn": Qwen3Config(**_common(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 64})),
        "deepseek-v3-yarn": DeepseekV3Config(**_common(
            num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, first_k_dense_replace=2, n_routed_experts=4,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                             "mscale": 0.707, "mscale_all_dim": 0.707})),
        "qwen3-alternating": Qwen3Config(**_common(num_hidden_layers=4, use_sliding_window=True, sliding_window=48,
                                                   layer_types=["sliding_attention", "full_attention"] * 2)),
        # latent attention; every layer dense
        "deepseek-v3": DeepseekV3Config(**_common(num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=24,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                                                  first_k_dense_replace=2, n_routed_experts=4)),
        "deepseek-v3-no-q-lora": DeepseekV3Config(**_common(num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=None,
                                                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                                            first_k_dense_replace=2, n_routed_experts=4)),
        # latent attention and, after layer 0, routed experts: 8 in 4 groups, the 2 best groups eligible,
        # top-2 of those, weights renormalised and scaled, one shared expert (the fixture gives the gate a
        # correction bias: transformers initialises it to zeros, where the biased choice would change nothing)
        "deepseek-v3-moe": DeepseekV3Config(**_common(num_hidden_layers=3, num_key_value_heads=4, head_dim=8,
                                                      kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
                                                      qk_nope_head_dim=16, v_head_dim=12, first_k_dense_replace=1,
                                                      n_routed_experts=8, num_experts_per_tok=2,
                                                      moe_intermediate_size=32, n_shared_experts=1, n_group=4,
                                                      topk_group=2, norm_topk_prob=True,
                                                      routed_scaling_factor=2.5)),
    }


@pytest.fixture(scope="session")
def family_ckpt(tmp_path_factory):
    """name -> a random-weight checkpoint directory of that family (made once per session)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("families")
    made: dict = {}

    def get(name: str):
        if name not in made:
            torch.manual_seed(1234)
            m = AutoModelForCausalLM.from_config(family_configs()[name], dtype=torch.float32)
            with torch.no_grad():
                for key, buf in m.named_buffers():
                    if key.endswith("e_score_correction_bias"):  # DeepSeek's gate: zeros from transformers
                        buf.normal_(0.0, 0.3)
            m.save_pretrained(root / name)
            made[name] = root / name
        return made[name]
    return get


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def run(engine_cls, path, ps, teacher=None, options=None):
    e = engine_cls()
    e.load(ModelSpec(path=str(path), name=path.name, dtype="float32", max_model_len=max(map(len, ps)) + TOKENS + 8,
                     threads=2), options or {})
    try:
        greedy = greedy_tokens(e, ps, TOKENS)
        t = teacher or greedy
        scores = e.score([p + x for p, x in zip(ps, t)], [len(p) for p in ps], 8)
    finally:
        e.close()
    return greedy, [{"top_ids": s.top_ids, "top_logprobs": s.top_logprobs, "target_logprobs": s.target_logprobs}
                    for s in scores]


_hf_runs: dict = {}


def hf_baseline(path):
    if str(path) not in _hf_runs:
        _hf_runs[str(path)] = run(HFEngine, path, prompts())
    return _hf_runs[str(path)]


def parity_problems(path, options=None) -> tuple[list[str], dict]:
    """Why the reference engine fails float32 parity against transformers on `path` (empty: it passes)."""
    base_greedy, base_scores = hf_baseline(path)
    greedy, scores = run(ReferenceEngine, path, prompts(), teacher=base_greedy, options=options)
    fields = compare_scores(base_scores, scores, "float32")
    agree = greedy_agreement(base_greedy, greedy)
    problems = []
    if agree["agreement"] != 1.0:
        problems.append(f"greedy tokens differ (first at step {agree['first_divergence']})")
    why = verdict(fields, "float32")[1]
    if why:
        problems.append(why)
    return problems, {**fields, **agree}


FAMILIES = ["qwen3", "qwen3-moe", "mixtral", "mistral-window", "qwen3-alternating", "deepseek-v3",
            "deepseek-v3-no-q-lora", "deepseek-v3-moe", "qwen3-yarn", "deepseek-v3-yarn"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers_in_float32(family, family_ckpt):
    problems, fields = parity_problems(family_ckpt(family))
    assert not problems, (problems, fields)


def test_family_on_the_plain_path_and_chunked(family_ckpt):
    """The plain kernels and chunked prefill (context read back from the pool) agree too."""
    for family in ("qwen3-moe", "qwen3-alternating", "deepseek-v3"):
        problems, fields = parity_problems(family_ckpt(family), {"kernels": "plain", "max_num_batched_tokens": 40})
        assert not problems, (family, problems, fields)


# ---- injected bugs: each must fail parity ------------------------------------------------------

def test_qk_norm_skipped_fails(family_ckpt, monkeypatch):
    path = family_ckpt("qwen3")
    hf_baseline(path)
    real = ref_model.Model.__init__

    def no_qk_norm(self, *a, **kw):
        real(self, *a, **kw)
        for layer in self.layers:
            layer.q_norm = None  # Q and K rotated as projected: the norms skipped
    monkeypatch.setattr(ref_model.Model, "__init__", no_qk_norm)
    problems, fields = parity_problems(path)
    assert problems, fields


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_router_without_renormalisation_fails(family, family_ckpt, monkeypatch):
    path = family_ckpt(family)
    hf_baseline(path)  # the honest baseline, before the bug goes in
    real = ref_model.route
    monkeypatch.setattr(ref_model, "route", lambda logits, k, renormalise: real(logits, k, False))
    problems, fields = parity_problems(path)
    assert problems, fields


def _biased_weights(real):
    """DeepSeek's routing weights taken from the biased choice scores (renormalised, scaled)."""
    def route(logits, bias, k, n_group, topk_group, renormalise, scaling):
        _, ids = real(logits, bias, k, n_group, topk_group, renormalise, scaling)
        w = (logits.float().sigmoid() + bias).gather(1, ids)
        return w / w.sum(dim=-1, keepdim=True) * scaling, ids
    return route


DEEPSEEK_ROUTER_BUGS = {
    "weights from the biased scores": _biased_weights,
    "no renormalisation": lambda real: lambda lg, b, k, g, tg, renorm, sc: real(lg, b, k, g, tg, False, sc),
    "bias left out of the choice":
        lambda real: lambda lg, b, k, g, tg, renorm, sc: real(lg, b * 0, k, g, tg, renorm, sc),
    "groups not limited": lambda real: lambda lg, b, k, g, tg, renorm, sc: real(lg, b, k, g, g, renorm, sc),
    "scaling factor left out": lambda real: lambda lg, b, k, g, tg, renorm, sc: real(lg, b, k, g, tg, renorm, 1.0),
}


@pytest.mark.parametrize("bug", list(DEEPSEEK_ROUTER_BUGS))
def test_deepseek_router_bugs_fail(bug, family_ckpt, monkeypatch):
    path = family_ckpt("deepseek-v3-moe")
    hf_baseline(path)  # the honest baseline, before the bug goes in
    monkeypatch.setattr(ref_model, "route_sigmoid", DEEPSEEK_ROUTER_BUGS[bug](ref_model.route_sigmoid))
    problems, fields = parity_problems(path)
    assert problems, fields


def test_deepseek_shared_expert_left_out_fails(family_ckpt, monkeypatch):
    path = family_ckpt("deepseek-v3-moe")
    hf_baseline(path)
    real = ref_model.Model.__init__

    def no_shared(self, *a, **kw):
        real(self, *a, **kw)
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.shared = None
    monkeypatch.setattr(ref_model.Model, "__init__", no_shared)
    problems, fields = parity_problems(path)
    assert problems, fields


def window_off_by_one_problems(path, monkeypatch) -> tuple[list[str], dict]:
    """parity_problems on the plain kernels with every window one token too wide (the honest
    transformers baseline taken first)."""
    hf_baseline(path)
    real = ref_attention.visible_from
    monkeypatch.setattr(ref_attention, "visible_from", lambda pos, window: real(pos, window + 1))
    return parity_problems(path, {"kernels": "plain"})


@pytest.mark.parametrize("family", ["mistral-window", "qwen3-alternating"])
def test_window_off_by_one_fails(family, family_ckpt, monkeypatch):
    problems, fields = window_off_by_one_problems(family_ckpt(family), monkeypatch)
    assert problems, fields


# ---- the windowed group's blocks in the paged cache ---------------------------------------------

def load(path, max_len=400, **options):
    e = ReferenceEngine()
    e.load(ModelSpec(path=str(path), name=path.name, dtype="float32", max_model_len=max_len, threads=2),
           {"block_size": 16, **options})
    return e


def groups_of(e):
    return {r["kind"]: r for r in e.kv_cache_info().extra["kv_groups"]}


def window_blocks_held(path, window: int) -> tuple[list[int], list[int]]:
    """One sequence of 20, 100 and 300 prompt tokens and 5 decode steps at a time (block 16): the
    blocks the `sliding(window)` group holds after each, and that group's per-sequence bound each
    time; asserts meanwhile that the full group holds every block of the context."""
    e = load(path)
    kind = f"sliding({window})"
    try:
        held, bounds = [], []
        for n in (20, 100, 300):
            e.prefill([[3 + i % 200 for i in range(n)]])
            e.decode(5)
            g = groups_of(e)
            assert g["full"]["blocks_in_use"] == -(-(n + 5) // 16)  # prompt + 5 tokens with K/V
            held.append(g[kind]["blocks_in_use"])
            bounds.append(g[kind]["max_blocks_per_sequence"])
            e.release()
        return held, bounds
    finally:
        e.close()


def test_a_window_holds_its_blocks_flat_while_full_layers_grow(family_ckpt):
    held, bounds = window_blocks_held(family_ckpt("qwen3-alternating"), 48)
    assert all(h <= b == 4 for h, b in zip(held, bounds))
    assert held[1:] == [4, 4]


@pytest.mark.parametrize("family", ["qwen3-alternating", "mistral-window", "deepseek-v3", "qwen3"])
def test_the_kv_estimate_matches_the_blocks_each_group_holds(family, family_ckpt):
    """kv_memory's comparison (workloads/kv_memory.group_comparison) on the engine's own groups,
    at computed lengths 63 (63 - 48 + 1 = 16: the reference engine, which frees a window's blocks
    from L after the step, holds one block fewer than vLLM, which frees them from L - 1) and 100.
    With vLLM's rule the windowed groups would be a block off."""
    from harness.core.presets import shape_from_hf_config
    from workloads.kv_memory import group_comparison
    path = family_ckpt(family)
    shape = shape_from_hf_config(path)
    e = load(path)
    try:
        e.prefill([[3 + i % 200 for i in range(60)], [5 + i % 190 for i in range(97)]])
        e.decode(3)  # 63 and 100 tokens with K/V
        info = e.kv_cache_info()
    finally:
        e.close()
    rows = group_comparison(shape, info.kv_dtype, "float32", info, [63, 100])
    assert rows and all(r["match"] is True for r in rows), rows
    assert sum(r["layers"] for r in rows) == shape.num_hidden_layers
    for g in info.extra["groups"]:
        g.pop("free_lag")
    as_vllm = {r["kind"]: r for r in group_comparison(shape, info.kv_dtype, "float32", info, [63, 100])}
    if "sliding" in as_vllm:
        r = as_vllm["sliding"]
        assert r["match"] is False and r["est_blocks"] == r["engine_blocks"] + 1, r
    else:  # nothing is freed: the rule does not matter
        assert all(r["match"] is True for r in as_vllm.values())


def test_a_shared_prefix_longer_than_the_window_reuses_only_the_window(family_ckpt):
    """The second prompt shares 160 tokens (10 blocks) with the first: the full group reuses all
    10, the windowed group only the blocks its window needs, and the tokens are those of an
    engine without prefix caching."""
    path = family_ckpt("qwen3-alternating")
    a = [3 + (7 * i) % 200 for i in range(170)]
    b = a[:160] + [5, 6, 7, 8, 9, 10, 11, 12]
    plain = load(path, prefix_caching=False)
    try:
        want = greedy_tokens(plain, [b], 8)
    finally:
        plain.close()
    e = load(path)
    try:
        greedy_tokens(e, [a], 4)  # leaves a's blocks registered and evictable
        before = e.kv_cache_info().prefix_cache_hits
        first = e.prefill([b]).first_tokens
        g = groups_of(e)
        hits = e.kv_cache_info().prefix_cache_hits - before
        assert hits == 10
        # the windowed group holds the window's blocks only: the next query (position 168) sees
        # from 121, block 7 on
        assert g["sliding(48)"]["blocks_in_use"] <= 4 and g["full"]["blocks_in_use"] == 11
        got = [e.decode(1).tokens[0][0] for _ in range(7)]
        e.release()
    finally:
        e.close()
    assert first + got == want[0]


def check_online_api(path) -> None:
    """Requests of different lengths joining while others decode give the fixed batch's tokens,
    and every block goes back."""
    from adapters.base import Request

    ps = prompts()
    e = load(path, max_num_batched_tokens=64)
    try:
        want = greedy_tokens(e, ps, 6)
        e.add_request(Request("r0", ps[0], 6))
        got: dict = {"r0": [], "r1": [], "r2": []}
        steps = 0
        while e.has_work() or steps < 3:
            if steps == 2:
                e.add_request(Request("r1", ps[1], 6))
            if steps == 3:
                e.add_request(Request("r2", ps[2], 6))
            for ev in e.step():
                got[ev.request_id].append(ev.token_id)
            steps += 1
        assert [got["r0"], got["r1"], got["r2"]] == want
        assert e.kv_cache_info().blocks_in_use == 0  # every block went back
    finally:
        e.close()


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen3-alternating", "deepseek-v3"])
def test_online_api_with_continuous_batching(family, family_ckpt):
    check_online_api(family_ckpt(family))


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3-moe"])
def test_the_engine_reports_the_experts_a_step_touched(family, family_ckpt):
    e = load(family_ckpt(family))
    try:
        e.prefill([[5]])  # one token: top-2 of 8 experts in each sparse layer
        moe = e.kv_cache_info().extra["moe"]
        # qwen3-moe: layers 0 and 2 (layer 1 is dense); deepseek-v3-moe: layers 1 and 2 (layer 0 is dense)
        assert moe["experts_touched_last_step"] == [2, 2]
        e.prefill(prompts())
        e.decode(1)
        touched = e.kv_cache_info().extra["moe"]["experts_touched_last_step"]
        assert len(touched) == 2 and all(2 <= t <= 6 for t in touched)  # 3 tokens x top-2
    finally:
        e.close()


def test_deepseek_routing_respects_the_group_limit():
    """Every token's chosen experts lie in its topk_group best groups (a group's score: the sum
    of its two best biased scores), although the best experts overall often lie elsewhere."""
    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(512, 16, generator=g), torch.randn(16, generator=g) * 0.3
    weights, ids = ref_model.route_sigmoid(logits, bias, 3, 4, 2, True, 2.5)
    choice = (logits.sigmoid() + bias).view(512, 4, 4)
    best_groups = choice.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    assert ((ids // 4)[:, :, None] == best_groups[:, None, :]).any(-1).all()
    # and they are the best 3 of the eligible experts: none left out scores higher
    flat = choice.view(512, 16)
    eligible = ((torch.arange(16) // 4)[None, :, None] == best_groups[:, None, :]).any(-1)
    left_out = eligible.scatter(1, ids, False)
    assert (flat.gather(1, ids).min(-1).values >= flat.masked_fill(~left_out, -1e9).max(-1).values).all()
    unlimited = (logits.sigmoid() + bias).topk(3, dim=-1).indices
    assert (ids.sort().values != unlimited.sort().values).any(-1).float().mean() > 0.2
    assert torch.allclose(weights.sum(-1), torch.full((512,), 2.5))
    chosen = logits.sigmoid().gather(1, ids)  # the weights: un-biased scores, renormalised, scaled
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True) * 2.5, rtol=1e-6, atol=0)


def test_deepseek_fused_expert_tensors_load_as_the_per_expert_ones(family_ckpt, tmp_path):
    """transformers' fused 3-D expert tensors ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) give
    the same tokens and scores as the per-expert checkpoint they were stacked from."""
    import shutil

    from safetensors.torch import load_file, save_file
    path = family_ckpt("deepseek-v3-moe")
    fused = tmp_path / "fused"
    shutil.copytree(path, fused)
    tensors = load_file(str(path / "model.safetensors"))
    for i in (1, 2):
        p = f"model.layers.{i}.mlp.experts."
        n = sum(1 for k in tensors if k.startswith(p) and k.endswith(".down_proj.weight"))
        gate = [tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(n)]
        up = [tensors.pop(f"{p}{e}.up_proj.weight") for e in range(n)]
        tensors[p + "gate_up_proj"] = torch.stack([torch.cat([a, b]) for a, b in zip(gate, up)])
        tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(n)])
    save_file(tensors, str(fused / "model.safetensors"), metadata={"format": "pt"})
    ps = prompts()
    assert run(ReferenceEngine, fused, ps) == run(ReferenceEngine, path, ps)


# ---- latent attention -----------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["expand", "absorb"])
def test_latent_rope_dimensions_swapped_fails(form, family_ckpt, monkeypatch):
    """The latent split with its rope part taken from the front instead of the back."""
    path = family_ckpt("deepseek-v3")
    hf_baseline(path)
    monkeypatch.setattr(ref_model, "split_latent", lambda kv, rank, rope: (kv[..., rope:rope + rank], kv[..., :rope]))
    problems, fields = parity_problems(path, {"mla_attention": form})
    assert problems, fields


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3-no-q-lora", "deepseek-v3-moe"])
def test_expanded_latent_decode_matches_transformers_in_float32(family, family_ckpt):
    """The default (mla_attention=absorb: kv_b folded into the query and the output) is what the
    family tests above check; the expanded form (every cached latent up-projected per step, as
    transformers does) gives the same tokens and float32 scores; and chunked on the plain kernels."""
    for options in ({"mla_attention": "expand"},
                    {"mla_attention": "expand", "kernels": "plain", "max_num_batched_tokens": 40}):
        problems, fields = parity_problems(family_ckpt(family), options)
        assert not problems, (options, problems, fields)


@pytest.mark.parametrize("form", ["expand", "absorb"])
def test_the_absorbed_decode_reads_the_latents_without_expanding_them(form, family_ckpt, monkeypatch):
    """With absorb no decode step up-projects the cached latents (prefill still does); with expand
    every decode step does."""
    from adapters.reference import mla

    e = load(family_ckpt("deepseek-v3"), mla_attention=form)
    try:
        e.prefill([list(range(3, 43)), list(range(5, 20))])
        expanded = []
        real = mla.MLAStepAttention.expand
        monkeypatch.setattr(mla.MLAStepAttention, "expand",
                            lambda self, layer, latent: expanded.append(latent.shape) or real(self, layer, latent))
        e.decode(3)
        assert (expanded == []) == (form == "absorb"), expanded
    finally:
        e.close()


def test_the_latent_cache_holds_rank_plus_rope_per_token_and_layer(family_ckpt):
    e = load(family_ckpt("deepseek-v3"))
    try:
        e.prefill([list(range(3, 43))])
        e.decode(3)
        info = e.kv_cache_info()
        latent = 2 * (32 + 8) * 4  # layers x (kv_lora_rank + qk_rope_head_dim) x float32 bytes
        assert info.bytes_per_token == latent == info.extra["latent"]["bytes_per_token"]
        assert info.pool_bytes == e.pool.latent.numel() * 4 == info.num_blocks * 16 * latent
        # dense K/V of every head: layers x heads x (16 + 8 key + 12 value) x 4
        assert info.extra["latent"]["dense_equivalent_bytes_per_token"] == 2 * 4 * 36 * 4
        assert info.blocks_in_use == 3 and info.tokens_stored == 43
    finally:
        e.close()


def test_deepseek_with_another_scoring_function_is_refused_in_one_line(family_ckpt, tmp_path):
    """transformers scores DeepSeek-V3's router with a sigmoid whatever config.json says; a config
    naming softmax means something else, so the engine refuses it rather than guess."""
    import json
    import shutil

    path = tmp_path / "ds"
    shutil.copytree(family_ckpt("deepseek-v3-moe"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "scoring_func": "softmax"}))
    with pytest.raises(ValueError, match=r"^[^\n]*scoring_func softmax is not supported by the reference engine"):
        ref_model.ModelConfig.from_dir(path)
    (path / "config.json").write_text(json.dumps({**cfg, "scoring_func": "sigmoid"}))
    assert ref_model.ModelConfig.from_dir(path).moe.scoring == "sigmoid"


@pytest.mark.parametrize("options", [{"kv_cache": "none"}, {"kv_layout": "contiguous"}])
@pytest.mark.parametrize("family", ["qwen3-alternating", "deepseek-v3"])
def test_no_cache_and_contiguous_modes(family, options, family_ckpt):
    problems, fields = parity_problems(family_ckpt(family), options)
    assert not problems, (problems, fields)


def test_kv_cache_bytes_is_checked_against_the_latent_size(family_ckpt):
    """A pool sized for the latent (80 values per token and layer) is enough; the dense K/V size is not needed."""
    path = family_ckpt("deepseek-v3")
    spec = ModelSpec(path=str(path), name=path.name, dtype="float32", max_model_len=64, threads=2)
    latent_one_sequence = 64 * 2 * 40 * 4  # max_model_len x layers x (32 + 8) x 4 bytes
    assert ReferenceEngine.check_options({"kv_cache_bytes": latent_one_sequence}, spec) == []
    problems = ReferenceEngine.check_options({"kv_cache_bytes": latent_one_sequence - 1}, spec)
    assert len(problems) == 1 and "320 bytes per token" in problems[0]


# ---- YaRN RoPE --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bug", ["attention factor left out", "frequencies not blended", "score factor left out"])
def test_yarn_bugs_fail(bug, family_ckpt, monkeypatch):
    """Each part of YaRN matters: cos/sin times the attention factor, the frequencies kept /
    interpolated / blended by dim, and (DeepSeek, mscale_all_dim) the softmax scale's correction."""
    family = "deepseek-v3-yarn" if bug == "score factor left out" else "qwen3-yarn"
    path = family_ckpt(family)
    hf_baseline(path)
    if bug == "attention factor left out":
        monkeypatch.setattr(ref_model, "rope_attention_factor", lambda cfg: 1.0)
    elif bug == "frequencies not blended":  # every frequency interpolated (plain linear scaling)
        monkeypatch.setattr(ref_model, "yarn_inv_freq", lambda inv_freq, s, theta, n: inv_freq / float(s["factor"]))
    else:
        monkeypatch.setattr(ref_model, "mla_score_factor", lambda rope: 1.0)
    problems, fields = parity_problems(path)
    assert problems, fields


def test_yarn_factors_are_transformers():
    """The factors the engine multiplies by are the ones transformers' own YaRN computes
    (DeepSeek: its attention factor is mscale / mscale_all_dim, 1 when they are equal; the softmax
    correction mscale(factor, mscale_all_dim) squared)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for family in ("qwen3-yarn", "deepseek-v3-yarn"):
        hf = family_configs()[family]
        inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        cfg = ref_model.ModelConfig(architecture="x", num_layers=1, hidden_size=hf.hidden_size, num_heads=4,
                                    num_kv_heads=2, head_dim=inv_freq.numel() * 2, intermediate_size=1, vocab_size=1,
                                    rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=dict(hf.rope_parameters),
                                    max_position_embeddings=hf.max_position_embeddings, tie_word_embeddings=False)
        assert torch.allclose(ref_model.rope_inv_freq(cfg), inv_freq, rtol=1e-6)
        assert ref_model.rope_attention_factor(cfg) == pytest.approx(attention)
    assert ref_model.rope_attention_factor(cfg) == pytest.approx(1.0)  # DeepSeek's equal mscales
    assert ref_model.mla_score_factor(dict(family_configs()["deepseek-v3-yarn"].rope_parameters)) == \
        pytest.approx((0.1 * 0.707 * math.log(4.0) + 1) ** 2)

"""The engine: model, KV pool, block manager, scheduler and runner wired together, and the
online API that a server drives. It knows nothing of the harness's `Engine` interface
(engine.py is the thin adapter onto it; harness/serve.py drives it directly).

    LLMEngine(model, cfg)  loads the weights, sizes the KV pool from the memory budget, builds
                           the scheduler and the runner (and, on CUDA, captures decode graphs);
                           load_time_s, compute_threads and details say how it went
    add_request(request)   the request joins at the next step (`request.arrival_s` is ignored:
                           the caller decides when it arrives)
    step()                 one scheduler step; returns a `TokenEvent` for every token it produced,
                           stamped with now_ns() after the step (device synchronised). A request's
                           blocks are freed the step it produces its last token (finished=True).
                           A first token carries `cached_tokens`: the prompt tokens the prefix
                           cache supplied when the request was (last) admitted.
    has_work()             whether a step would compute anything
    abort(request_id)      drop a request now and free its blocks (unknown ids are ignored)
    score(...)             teacher-forced log-probabilities, through the same paged path
    kv_cache_info()        pool, blocks, fragmentation, prefix-cache and preemption counters
    spec_decode_stats()    speculative decoding's counters since load (speculative.py), or None

With speculative decoding a step may give a sequence several tokens (one event each, the same
timestamp); never more than its request's max_new_tokens.

An in-process driver with its own sequences (the adapter's fixed batch) uses the pieces the
online API is built on: new_sequence(), scheduler.add(), run_step(), sync().

Options: see config.py (and conf/engine/reference.yaml).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

import torch

from adapters.base import KVCacheInfo, ModelSpec, Request, SpecDecodeStats, TokenEvent, TokenScores, now_ns
from adapters.reference import kernels
from adapters.reference.attention import SCORE_BUDGET, StepAttention
from adapters.reference.block_manager import BlockManager
from adapters.reference.config import CPU_DEFAULT_KV_BYTES, EngineConfig, cross_field_problems
from adapters.reference.kv_cache import KVPool, bytes_per_token, check_kv_dtype
from adapters.reference.kv_tiers import SecondTier, TierStats, make_tier
from adapters.reference.layer_groups import (
    GroupedBlockManager, GroupedPool, GroupedStepAttention, bytes_per_token_of, group_blocks, layer_groups,
)
from adapters.reference.lora import HostAdapter, Slots
from adapters.reference.mla import LatentPool, MLAStepAttention, latent_bytes_per_token
from adapters.reference.gemma import GemmaModel
from adapters.reference.model import Model, ModelConfig
from adapters.reference.runner import ModelRunner, StepOutput
from adapters.reference.scheduler import Scheduler, Sequence
from adapters.reference.speculative import (
    DraftModelProposer, NgramProposer, Speculator, draft_bytes_per_token, draft_problems, load_draft,
)
from harness.core.version import __version__
from harness.core.kvcalc import canonical_kv_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def version() -> str:
    return f"{__version__} (torch {torch.__version__})"


# ---- the KV pool's size ---------------------------------------------------------------------------

def _one_sequence_bytes(cfg: EngineConfig, bpt: int, max_model_len: int) -> int:
    """KV bytes of one sequence of max_model_len tokens, in whole blocks (or one region)."""
    block = max_model_len if cfg.contiguous else cfg.block_size
    return -(-max_model_len // block) * block * bpt


def budget_problem(cfg: EngineConfig, bpt: int, max_model_len: int, budget: int, source: str) -> str | None:
    """Why a pool of `budget` bytes cannot hold one sequence of `max_model_len` tokens, or None."""
    need = _one_sequence_bytes(cfg, bpt, max_model_len)
    if budget >= need:
        return None
    return (f"{source}: the KV pool ({budget} bytes) must hold at least one sequence of "
            f"max_model_len={max_model_len} tokens, {need} bytes at {bpt} bytes per token. "
            f"Give engine_options.reference.kv_cache_bytes >= {need}.")


def activation_reserve(cfg: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype) -> int:
    """Device bytes kept out of the KV pool for one step's activations: twice the largest step's
    per-token intermediates (hidden states, fused QKV, the MLP's gate/up products; twice for the
    temporaries around them: float32 norms, rotations, SDPA) in the model's dtype, float32 logits
    of the rows a step keeps (score() keeps at most `score_rows`), and 256 MiB for CUDA graphs,
    cuBLAS workspaces and the allocator's slack."""
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = cfg.max_num_batched_tokens
    per_token = (4 * mcfg.hidden_size + 2 * (mcfg.num_heads + 2 * mcfg.num_kv_heads) * mcfg.head_dim
                 + 3 * mcfg.intermediate_size) * elem
    rows = max(min(tokens, score_rows(mcfg.vocab_size)), min(tokens, cfg.max_num_seqs))
    return 2 * tokens * per_token + 3 * rows * mcfg.vocab_size * 4 + (256 << 20)


def score_rows(vocab_size: int) -> int:
    """Tokens per step while scoring: their float32 logits stay under 256 MiB."""
    return max(64, (256 << 20) // (4 * vocab_size))


def _cuda_kv_budget(device: torch.device, cfg: EngineConfig, mcfg: ModelConfig,
                    dtype: torch.dtype) -> tuple[int, str, dict[str, Any]]:
    """KV pool bytes on a GPU, as vLLM's gpu_memory_utilization means it: the engine may fill
    that share of the device's total memory; what is in use now (our weights, other processes)
    and an activation reserve come off it. Errors name the option and the fix. Memory that torch's
    caching allocator holds but no tensor uses (an engine closed in this process) counts as free:
    the pool's allocation reuses it, and the driver sees it as taken."""
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    used, u = total - free, cfg.gpu_memory_utilization
    reserve = activation_reserve(cfg, mcfg, dtype)
    budget = int(total * u) - used - reserve
    opt = "engine_options.reference.gpu_memory_utilization"
    if budget <= 0:
        need = (used + reserve) / total
        raise ValueError(f"{opt}={u}: {u:.0%} of the device's {total / 2**30:.1f} GiB leaves no room for the KV "
                         f"cache: {used / 2**30:.1f} GiB are already in use (weights and other processes) and "
                         f"{reserve / 2**30:.1f} GiB are kept for activations. Raise it above {need:.2f}, free device "
                         "memory, or give engine_options.reference.kv_cache_bytes.")
    if budget > free - reserve:  # cannot happen unless memory was freed meanwhile; never over-commit
        raise ValueError(f"{opt}={u}: the KV pool would need {budget / 2**30:.1f} GiB but only "
                         f"{(free - reserve) / 2**30:.1f} GiB are free beside the activation reserve. Lower it.")
    source = (f"{opt}={u} ({u} x {total} total bytes - {used} in use - {reserve} activation reserve)")
    return budget, source, {"total_bytes": total, "used_before_pool_bytes": used, "utilization": u,
                            "activation_reserve_bytes": reserve, "kv_budget_bytes": budget}


def model_class(cfg: ModelConfig) -> type[Model]:
    """The decoder class for this config: model.Model, or gemma.GemmaModel for Gemma 3."""
    return GemmaModel if cfg.gemma is not None else Model


def _spin(seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
    """Busy-wait until `clock` has advanced `seconds`: the calibration handicap costs CPU time as
    slower code would. A sleep does not: on a busy machine a sleeping thread waits for its core
    back, and a "25 %" sleep measured as +60-80 % per step in A/B jobs beside other work."""
    until = clock() + seconds
    while clock() < until:
        pass


def handicap_clock(device: torch.device) -> Callable[[], float]:
    """The clock the calibration handicap (EngineConfig.step_delay_frac) is sized by: on a CPU the
    calling thread's CPU time (time.thread_time), so that a "5 %" handicap is 5 % more CPU work
    whatever else runs on the machine (sized by wall time, a step preempted by other work asked
    for a longer wait: "5 %" measured 1.10-1.16 in block A/B jobs under load, 2026-12-05); on an
    accelerator wall time, since the step's work is not on this thread."""
    return time.thread_time if device.type == "cpu" else time.perf_counter


class LLMEngine:
    """The loaded engine. `cfg` is a checked EngineConfig (the adapter checks the fields; the
    checks that need the device are made here); `model.threads` sets torch's threads unless
    `cfg.num_threads` does."""

    def __init__(self, model: ModelSpec, cfg: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.device = torch.device(model.device)
        self.handicap_clock = handicap_clock(self.device)  # step_delay_frac's clock
        problems = cross_field_problems(cfg)
        why = check_kv_dtype(cfg.kv_dtype, self.device)
        if why:
            problems.append(f"engine_options.reference.kv_dtype={cfg.kv_dtype}: {why}.")
        if problems:
            raise ValueError(" ".join(problems))
        # equal resources: the run's share of threads, unless the user set num_threads
        threads = cfg.num_threads or model.threads
        if threads:
            torch.set_num_threads(threads)
        self.cfg, self.spec = cfg, model
        mcfg = ModelConfig.from_dir(model.path)
        dtype = DTYPES[model.dtype]
        self.kernels = kernels.select(self.device, dtype, cfg)
        self.model: Model | None = model_class(mcfg)(mcfg, model.path, dtype, self.device, max_len=model.max_model_len,
                                         make_linear=self.kernels.make_linear, rows=self.kernels.rows)
        self.model.steps = self.kernels.steps
        # what load() reports (LoadInfo.details)
        self.details: dict[str, Any] = {"options": vars(cfg).copy(), "architecture": mcfg.architecture,
                                        "kernels": dict(self.kernels.details)}
        max_len = max(model.max_model_len, 1)
        self.block_size = max_len if cfg.contiguous else cfg.block_size
        # sliding windows: one block table per group of layers with the same window (layer_groups.py)
        self.groups = layer_groups(mcfg.windows) if mcfg.windows else None
        # no graphs for windows (their tables change shape) nor experts (routing reads counts on the host)
        graphs = (self.kernels.decode_graphs and cfg.use_cache and self.groups is None and mcfg.moe is None
                  and mcfg.mla is None)
        if self.groups:
            self.details["kv_groups"] = [{"kind": g.kind, "layers": list(g.layers)} for g in self.groups]
        # speculative decoding: the draft model's weights load before the KV pools are sized
        self.draft: Model | None = None
        if cfg.speculative_method == "draft":
            self.draft = self._load_draft(mcfg, dtype, max_len)
        self.pool: KVPool | None = None
        self.blocks: BlockManager | None = None
        self.draft_blocks = 0  # blocks of the draft's pool (as many as the target's, its share of the budget)
        if cfg.use_cache:
            self._make_pool(mcfg, dtype, max_len, scratch=1 if graphs else 0)
        self.tier: SecondTier | None = self._make_tier() if cfg.kv_offload else None
        self.speculator = self._speculator() if cfg.speculative else None
        self.lora: Slots | None = self._load_lora(mcfg, dtype) if cfg.lora_adapters else None
        # a fixed batch (the adapter's prefill()) is admitted whole: at least the run's largest batch may run
        max_seqs = max(cfg.max_num_seqs, model.max_batch_size)
        self.scheduler = Scheduler(self.blocks, max_seqs, cfg.max_num_batched_tokens,
                                   lookahead=cfg.num_speculative_tokens if self.speculator else 0,
                                   on_release=self.speculator.release if self.speculator else None, lora=self.lora)
        self.graphs = self._capture_graphs(max_seqs, max_len) if graphs else None
        attention = self.kernels.attention
        sinks = [layer.sinks for layer in self.model.layers] if mcfg.attention_sinks else None
        if sinks is not None:  # the fused kernels have no sink term: the plain path computes it (attention.py)
            budget = kernels.GPU_SCORE_BUDGET if self.device.type == "cuda" else SCORE_BUDGET
            attention = partial(StepAttention, score_budget=budget)
            self.details["attention_sinks"] = "plain attention (attention.softmax_with_sink); the fused kernels have none"
        if self.groups:
            attention = partial(GroupedStepAttention, groups=self.groups, full_attention=attention, sinks=sinks)
        elif sinks is not None:
            attention = partial(attention, sinks=sinks)
        if mcfg.mla is not None:
            attention = partial(MLAStepAttention, kv_b=[layer.mla["kv_b"] for layer in self.model.layers], mla=mcfg.mla,
                                form=cfg.mla_attention)
        self.runner: ModelRunner | None = ModelRunner(self.model, self.pool, attention, self.graphs, self.kernels.greedy,
                                                      self.lora)
        self._requests: dict[str, Sequence] = {}  # the online API's live requests, by id
        self._grammars: Any = None  # structured output's compiler (grammar.Grammars), made on first use
        self._next_id = 0
        self.sync()
        self.details["num_blocks"] = self.pool.num_blocks if self.pool else 0
        self.compute_threads = torch.get_num_threads()
        self.load_time_s = time.perf_counter() - t0

    def _load_lora(self, mcfg: ModelConfig, dtype: torch.dtype) -> Slots:
        """Every adapter of `lora_adapters` read into host memory, and `max_loras` slots (lora.py)."""
        if mcfg.mla is not None or mcfg.moe is not None or mcfg.gemma is not None:
            raise ValueError("engine_options.reference.lora_adapters: the reference engine applies LoRA to dense "
                             f"LLaMA-style layers; {mcfg.architecture} has latent, expert or Gemma layers.")
        ads = self.cfg.lora_adapters
        rank = self.cfg.max_lora_rank or max(int(a.get("rank") or 1) for a in ads)
        host = {a["name"]: HostAdapter.read(a["name"], a["path"], mcfg, rank) for a in ads}
        slots = Slots(mcfg, host, self.cfg.max_loras or len(ads), rank, dtype, self.device)
        self.details["lora"] = {"adapters": list(host), "max_loras": slots.max_loras, "max_lora_rank": rank,
                                "max_cpu_loras": "every adapter in host memory (read at load)",
                                "batching": "each row's own adapter: a row mask over the resident slots (lora.py)",
                                "fused_decode_layer": "not used in a step with an adapter's row"}
        return slots

    def lora_stats(self) -> dict[str, Any] | None:
        return self.lora.stats() if self.lora is not None else None

    def _load_draft(self, mcfg: ModelConfig, dtype: torch.dtype, max_len: int) -> Model:
        """The draft model (speculative_method=draft), checked against the target (speculative.py)."""
        path = self.cfg.draft_model
        dcfg = load_draft(path, mcfg)
        problems = draft_problems(path, mcfg.vocab_size, self.spec.path)  # the tokenizers, now both on disk
        if problems:
            raise ValueError(problems[0])
        draft = model_class(dcfg)(dcfg, path, dtype, self.device, max_len=max_len,
                                  make_linear=self.kernels.make_linear, rows=self.kernels.rows)
        draft.steps = self.kernels.steps
        self.details["draft_model"] = {"path": path, "architecture": dcfg.architecture, "layers": dcfg.num_layers,
                                       "hidden_size": dcfg.hidden_size, "weights_bytes": draft.num_bytes()}
        return draft

    def _speculator(self) -> Speculator:
        cfg = self.cfg
        if self.draft is None:
            proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        else:
            proposer = DraftModelProposer(self.draft, self.draft_blocks, self.block_size, cfg.kv_dtype,
                                          self.kernels.attention)
        self.details["speculative"] = {"method": cfg.speculative_method, "k": cfg.num_speculative_tokens,
                                       "draft_pool_blocks": self.draft_blocks if self.draft is not None else None}
        return Speculator(proposer, cfg.num_speculative_tokens, self.sync)

    def _make_pool(self, mcfg: ModelConfig, dtype: torch.dtype, max_len: int, scratch: int) -> None:
        """The KV pool and its block manager, sized from kv_cache_bytes, or the device's memory
        budget. `scratch`: blocks beyond the budget's (the padded rows of graphed decode steps).
        With a draft model, the budget holds both pools, the draft's with as many blocks as
        the target's (a full-attention target's; a windowed one's full group, at least)."""
        cfg = self.cfg
        bpt = bytes_per_token(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, cfg.kv_dtype, dtype)
        if mcfg.mla is not None:
            bpt = latent_bytes_per_token(mcfg.num_layers, mcfg.mla, dtype, cfg.kv_dtype)
        draft_bpt = 0 if self.draft is None else draft_bytes_per_token(self.draft.cfg, cfg.kv_dtype, dtype)
        budget, source = cfg.kv_cache_bytes, f"engine_options.reference.kv_cache_bytes={cfg.kv_cache_bytes}"
        if budget is None and self.device.type == "cuda":
            budget, source, self.details["gpu_memory"] = _cuda_kv_budget(self.device, cfg, mcfg, dtype)
            budget -= scratch * bpt * self.block_size
        elif budget is None:  # CPU: 1 GiB, but no more than max_num_seqs sequences could use
            one_sequence = _one_sequence_bytes(cfg, bpt, max_len)
            budget = max(one_sequence, min(CPU_DEFAULT_KV_BYTES, cfg.max_num_seqs * one_sequence))
        why = budget_problem(cfg, bpt + draft_bpt, max_len, budget, source)
        if why:
            raise ValueError(why)
        if draft_bpt:
            self.draft_blocks = budget // ((bpt + draft_bpt) * self.block_size)
            budget -= self.draft_blocks * draft_bpt * self.block_size
        if self.groups:
            bpts = bytes_per_token_of(self.groups, mcfg.num_kv_heads, mcfg.head_dim, cfg.kv_dtype, dtype)
            counts = group_blocks(self.groups, budget, bpts, self.block_size,
                                  max(cfg.max_num_seqs, self.spec.max_batch_size), cfg.max_num_batched_tokens)
            self.pool = GroupedPool(self.groups, counts, self.block_size, mcfg.num_kv_heads, mcfg.head_dim,
                                    cfg.kv_dtype, dtype, self.device)
            self.blocks = GroupedBlockManager(self.groups, counts, self.block_size, cfg.use_prefix_cache)
            return
        num_blocks = budget // (bpt * self.block_size)
        if mcfg.mla is not None:
            self.pool = LatentPool(mcfg.num_layers, num_blocks, self.block_size, mcfg.mla, dtype, self.device,
                                   cfg.kv_dtype)
            self.blocks = BlockManager(num_blocks, self.block_size, cfg.use_prefix_cache)
            return
        self.pool = KVPool(mcfg.num_layers, num_blocks, self.block_size, mcfg.num_kv_heads,
                           mcfg.head_dim, cfg.kv_dtype, dtype, self.device, scratch_blocks=scratch)
        self.blocks = BlockManager(num_blocks, self.block_size, cfg.use_prefix_cache)

    def _make_tier(self) -> SecondTier:
        """The second KV tier behind the pool (kv_tiers.py), its block manager's `tier`."""
        cfg = self.cfg
        if self.groups:
            raise ValueError("engine_options.reference.kv_offload: a second KV tier is not done yet for models with "
                             "sliding-window layer groups (each group has blocks of its own); use kv_offload=false "
                             "for this model.")
        tier = make_tier(self.pool, self.block_size, self.device, cfg.kv_offload_bytes, cfg.kv_offload_medium,
                         cfg.kv_offload_dir)
        self.blocks.tier = tier
        self.details["kv_offload"] = {"medium": tier.store.describe(), "capacity_bytes": tier.capacity_bytes,
                                      "slots": tier.store.slots, "slot_bytes": tier.store.slot_bytes}
        return tier

    def _capture_graphs(self, max_seqs: int, max_len: int) -> Any:
        """CUDA graphs of decode steps, one per batch bucket (cuda_graphs.py), captured now."""
        from adapters.reference.cuda_graphs import CudaGraphBackend, DecodeGraphs  # CUDA only

        graphs = DecodeGraphs(self.model, self.pool, self.kernels.decode_fn, max_seqs, max_len,
                              CudaGraphBackend(self.device))
        t = time.perf_counter()
        graphs.capture()
        self.details["kernels"]["cuda_graph_capture_s"] = round(time.perf_counter() - t, 3)
        self.details["kernels"]["cuda_graph_buckets"] = list(graphs.buckets)
        return graphs

    def close(self) -> None:
        """Drop every sequence and the device tensors (the runner holds the pool and the graphs)."""
        if self.model is not None:
            self.release()
        if getattr(self, "tier", None) is not None:  # the disk tier's file goes with its descriptor
            self.tier.close()
        self.tier = None
        self.model = self.pool = self.blocks = self.graphs = self.runner = self.draft = self.speculator = None  # frees device memory

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- steps ---------------------------------------------------------------------------
    def new_sequence(self, prompt: list[int], stop_len: int, request_id: str | None = None) -> Sequence:
        """A sequence not yet scheduled (scheduler.add() queues it), checked against the model."""
        if not prompt:
            raise ValueError("an empty prompt: every sequence needs at least one token.")
        if stop_len > self.model.rope_len:
            raise ValueError(f"a sequence of {stop_len} tokens exceeds the model's {self.model.rope_len} positions.")
        self._next_id += 1
        return Sequence(self._next_id, list(prompt), stop_len, request_id=request_id)

    def run_step(self, keep_logits: bool = False) -> StepOutput:
        """Schedule and run one step; record what it computed and sampled. With speculative
        decoding (speculative.py) the proposer first fills the drafts of the decoding sequences,
        the one pass verifies them, and each sequence keeps the tokens the target accepts: the
        K/V of the rejected ones count as not computed and their blocks go back."""
        t0 = time.perf_counter()
        c0 = self.handicap_clock() if self.cfg.step_delay_frac else 0.0
        chunks = self.scheduler.schedule()
        verifying = self.speculator is not None and self.speculator.propose(chunks)
        t1 = time.perf_counter() if verifying else t0
        out = self.runner.run(chunks, keep_logits)
        if self.model.cfg.moe is not None:  # per sparse layer, the experts this step read
            self.experts_touched = self.model.experts_touched()
        if verifying:
            self.sync()
            self.speculator.counters.verify_time_s += time.perf_counter() - t1
        if self.cfg.step_delay_frac:  # the calibration handicap (config.py): a real, proportional slowdown
            self.sync()
            _spin(self.cfg.step_delay_frac * (self.handicap_clock() - c0), self.handicap_clock)
        for c in chunks:
            c.seq.num_computed = c.end if self.pool is not None else 0
        for s in out.sampled:
            seq = s.chunk.seq
            if seq.draft:  # keep what the target accepts: the rejected positions' K/V are void
                s.emitted = self.speculator.accept(s)
                seq.num_computed -= len(seq.draft) + 1 - len(s.emitted)
                seq.draft = []
            else:
                s.emitted = [s.token]
            seq.tokens.extend(s.emitted)
            seq.logits = s.logits
            if seq.grammar is not None and seq.num_outputs > 0:  # structured output: a finished reply stops
                if not seq.grammar.accept_token(s.token):
                    raise RuntimeError(f"request {seq.request_id}: the grammar refused token {s.token}, which its "
                                       "own mask allowed")
                if seq.grammar.is_terminated():
                    seq.stop_len = seq.num_tokens
        if self.blocks is not None:
            for c in chunks:
                if c.draft_room:  # the slots past the accepted tokens go back
                    self.blocks.shrink(c.seq, c.seq.num_computed)
                self.blocks.register_full_blocks(c.seq)
        if self.speculator is not None:
            self.speculator.after_step(chunks)
        return out

    # ---- the online API: what a server drives ------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue `request`; it joins at the next step. `request.arrival_s` is ignored."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id} is already live; request ids must be unique.")
        if request.max_new_tokens < 1:
            raise ValueError(f"request {request.request_id}: max_new_tokens must be at least 1.")
        seq = self.new_sequence(request.prompt_ids, len(request.prompt_ids) + request.max_new_tokens,
                                request.request_id)
        seq.adapter = self._adapter(request.adapter)
        if request.constraint is not None:
            seq.grammar = self._grammar(request)
        self.scheduler.add(seq)
        self._requests[request.request_id] = seq

    def _adapter(self, name: str | None) -> str | None:
        """`name`, checked: None (the base model) or one of lora_adapters."""
        if name is not None and (self.lora is None or name not in self.lora.adapters):
            loaded = ", ".join(self.lora.adapters) if self.lora else "none"
            raise ValueError(f"reference: adapter {name} is not among engine_options.reference.lora_adapters "
                             f"(loaded: {loaded})")
        return name

    def _grammar(self, request: Request) -> Any:
        """The request's grammar matcher (grammar.py), its grammar compiled once per constraint."""
        if self.speculator is not None:
            raise ValueError(f"request {request.request_id}: a constraint (structured output) with speculative "
                             "decoding: the reference engine does not verify drafts against a grammar; run "
                             "structured output with speculative_method=none.")
        if self._grammars is None:
            from adapters.reference.grammar import Grammars  # xgrammar: only for structured output
            self._grammars = Grammars(self.spec.path, self.model.cfg.vocab_size)
        return self._grammars.matcher(request.constraint)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenEvent]:
        """One scheduler step: an event for every token it produced, stamped after the device
        finished. Finished requests leave (their blocks are freed) before this returns."""
        if not self.scheduler.has_work():
            return []
        out = self.run_step()
        self.sync()
        t = now_ns()
        events = []
        for s in out.sampled:
            seq = s.chunk.seq
            done = not seq.wants_step
            if done and self._requests.get(seq.request_id) is seq:
                self.scheduler.finish(seq)
                del self._requests[seq.request_id]
            first = seq.num_outputs - len(s.emitted)  # a speculative step may give several tokens
            for j, token in enumerate(s.emitted):
                index = first + j
                events.append(TokenEvent(seq.request_id, index, token, t, finished=done and j == len(s.emitted) - 1,
                                         cached_tokens=seq.num_cached if index == 0 else None,
                                         reloaded_tokens=seq.num_reloaded if index == 0 and self.tier else None))
        return events

    def abort(self, request_id: str) -> None:
        """Drop a live request now, freeing its blocks. Unknown (or finished) ids are ignored."""
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq)

    def release(self) -> None:
        """Drop every live request, freeing its blocks."""
        for seq in self._requests.values():
            self.scheduler.finish(seq)
        self._requests = {}

    # ---- teacher-forced scores ---------------------------------------------------------
    def score(self, sequences: list[list[int]], start: list[int], top_k: int,
              adapter: str | None = None) -> list[TokenScores]:
        """For each position p in [start[i], len(seq)) (with LoRA `adapter`, or the base model): the next-token distribution given
        seq[:p], from ONE teacher-forced pass through the normal paged path (chunks through the
        block table, the prefix cache supplying what it can before the first scored position).
        The sequence without its last token is prefilled with the logits of every position
        from start[i] - 1 kept; log_softmax in float32 over the whole vocabulary. It needs the
        engine to itself: live requests are dropped first."""
        self.check_score_args(sequences, start, top_k)
        self.release()
        results = [TokenScores([], [], []) for _ in sequences]
        work = []  # (sequence, its full token list, its TokenScores, start)
        for full, s0, res in zip(sequences, start, results):
            if s0 == len(full):
                continue  # nothing to score
            seq = self.new_sequence(full[:-1], len(full), request_id=None)
            seq.score_from = s0 - 1
            seq.adapter = self._adapter(adapter)
            work.append((seq, full, res, s0))
            self.scheduler.add(seq)
        try:
            rows = self._scored_rows(work, top_k)
        finally:
            for seq, *_ in work:
                self.scheduler.finish(seq)
            self.release()
        for seq, full, res, s0 in work:
            got = rows[id(seq)]
            for p in range(s0 - 1, len(full) - 1):
                ids, lps, tgt = got[p]
                res.top_ids.append(ids)
                res.top_logprobs.append(lps)
                res.target_logprobs.append(tgt)
        return results

    def check_score_args(self, sequences: list[list[int]], start: list[int], top_k: int) -> None:
        if len(start) != len(sequences):
            raise ValueError(f"score(): {len(sequences)} sequences but {len(start)} start positions.")
        vocab = self.model.cfg.vocab_size
        if not 1 <= top_k <= vocab:
            raise ValueError(f"score(): top_k={top_k} must be between 1 and the vocabulary size {vocab}.")
        for i, (seq, s0) in enumerate(zip(sequences, start)):
            if not 1 <= s0 <= len(seq):
                raise ValueError(f"score(): start[{i}]={s0} must be in [1, {len(seq)}] (position 0 has "
                                 "no context to predict it from).")

    def _scored_rows(self, work: list[tuple], top_k: int) -> dict[int, dict[int, tuple]]:
        """Steps until the scheduled scoring work is done: per sequence (by id()), per position,
        (top-k ids, their log-probabilities, the target's log-probability)."""
        by_seq = {id(seq): (full, res, s0) for seq, full, res, s0 in work}
        rows: dict[int, dict[int, tuple]] = {id(seq): {} for seq, *_ in work}
        budget = self.scheduler.budget  # steps of fewer tokens: their logits stay small
        self.scheduler.budget = min(budget, score_rows(self.model.cfg.vocab_size))
        try:
            while self.scheduler.has_work():
                out = self.run_step()
                for sc in out.scored:
                    full, _, s0 = by_seq[id(sc.chunk.seq)]
                    logp = sc.logits.float().log_softmax(dim=-1)
                    top = logp.topk(top_k, dim=-1)
                    targets = torch.tensor([full[p + 1] for p in sc.positions], device=logp.device)
                    target = logp.gather(1, targets[:, None])[:, 0]
                    ids, lps, tgt = top.indices.tolist(), top.values.tolist(), target.tolist()
                    for j, p in enumerate(sc.positions):  # a recomputed position (preemption) overwrites
                        rows[id(sc.chunk.seq)][p] = (ids[j], lps[j], tgt[j])
                for sampled in out.sampled:  # done: its blocks go back (and its place in the batch)
                    self.scheduler.finish(sampled.chunk.seq)
        finally:
            self.scheduler.budget = budget
        return rows

    # ---- statistics ------------------------------------------------------------------------
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters since load (adapters.speculative.SpecCounter); None without it."""
        return self.speculator.counters.stats() if self.speculator is not None else None

    def kv_cache_info(self) -> KVCacheInfo:
        if self.model is None:  # closed
            return KVCacheInfo()
        cfg = self.cfg
        kv_dtype = cfg.kv_dtype if cfg.kv_dtype != "auto" else canonical_kv_dtype(self.spec.dtype)
        extra: dict[str, Any] = {"kv_cache": cfg.kv_cache, "kv_layout": cfg.kv_layout,
                                 "prefix_caching": cfg.use_prefix_cache, "kernels": dict(self.kernels.details)}
        if self.graphs is not None:
            extra["cuda_graphs"] = self.graphs.stats()
        m = self.model.cfg.mla
        if m is not None:
            n_layers, dtype = self.model.cfg.num_layers, DTYPES[self.spec.dtype]
            extra["latent"] = {
                "kv_lora_rank": m.kv_lora_rank, "qk_rope_head_dim": m.qk_rope_head_dim,
                "bytes_per_token": latent_bytes_per_token(n_layers, m, dtype, cfg.kv_dtype),
                # what K and V of every head would take, stored alike (int8: a scale per token and head
                # for K and for V): heads x (qk_nope + qk_rope + v_head_dim) values per layer
                "dense_equivalent_bytes_per_token": bytes_per_token(n_layers, self.model.cfg.num_heads, m.qk_head_dim,
                                                                    cfg.kv_dtype, dtype) // 2
                + bytes_per_token(n_layers, self.model.cfg.num_heads, m.v_head_dim, cfg.kv_dtype, dtype) // 2}
        if self.model.cfg.moe is not None:
            extra["moe"] = {"num_experts": self.model.cfg.moe.num_experts, "top_k": self.model.cfg.moe.top_k,
                            "experts_touched_last_step": getattr(self, "experts_touched", None)}
        if self.pool is None:
            return KVCacheInfo(kv_dtype=kv_dtype, pool_bytes=0, tokens_stored=0, slots_allocated=0,
                               preemptions=self.scheduler.preemptions, extra=extra)
        bs, blocks = self.block_size, self.blocks
        if self.groups:  # per layer group (layer_groups.py): slots and tokens summed over the groups
            rows = blocks.group_rows(self.scheduler.running, self.pool)
            extra["kv_groups"] = rows
            extra["slots_count_in"] = "layer-group slots, summed over the groups (a token once per group holding it)"
            stored = sum(r["tokens_stored"] for r in rows)
        else:
            filled: dict[int, int] = {}  # block id -> slots holding a token (shared blocks once)
            for seq in self.scheduler.running:
                for i, b in enumerate(seq.block_table):
                    filled[b] = max(filled.get(b, 0), min(bs, max(0, seq.num_computed - i * bs)))
            stored = sum(filled.values())
        allocated = blocks.num_used * bs
        extra.update(
            reserved_bytes=self.pool.nbytes,  # allocated up front, whatever is in use
            pool_tokens=blocks.num_blocks * bs,
            unused_slots=allocated - stored,  # internal fragmentation (paged) / reserved but unused (contiguous)
            unused_slot_frac=(allocated - stored) / allocated if allocated else 0.0,
            cached_free_blocks=len(blocks.evictable),
            prefix_cache_evictions=blocks.stats.evictions,
            prefix_hit_rate=(blocks.stats.prefix_hits / blocks.stats.prefix_queries
                             if blocks.stats.prefix_queries else None),
            prefix_counts_in="blocks",
        )
        if self.tier is not None:
            extra["kv_tiers"] = self.tier.info(blocks.stats.prefix_hits)
        if cfg.contiguous:
            extra["region_tokens"] = bs  # each sequence reserves one region of max_model_len slots
        else:
            extra["groups"] = self._harness_groups(rows if self.groups else None)
        return KVCacheInfo(
            kv_dtype=kv_dtype, block_size=None if cfg.contiguous else bs, num_blocks=blocks.num_blocks,
            bytes_per_block=self.pool.bytes_per_token * bs, pool_bytes=self.pool.nbytes,
            bytes_per_token=self.pool.bytes_per_token, blocks_in_use=blocks.num_used,
            blocks_peak=blocks.stats.peak_used, tokens_stored=stored, slots_allocated=allocated,
            prefix_cache_queries=blocks.stats.prefix_queries if cfg.use_prefix_cache else None,
            prefix_cache_hits=blocks.stats.prefix_hits if cfg.use_prefix_cache else None,
            preemptions=self.scheduler.preemptions, extra=extra)

    def _harness_groups(self, rows: list[dict] | None) -> list[dict[str, Any]]:
        """The paged cache's layer groups in harness.core.kvcalc's form (as vLLM's adapter reports
        them; workloads/kv_memory.group_comparison sets them beside the estimate): kind, window,
        layers, block size, page_size_bytes (one block of one layer), bytes per token over the
        group's layers, and the blocks the group holds now. free_lag 0: a windowed group frees the
        blocks before its window after the step that computed token L, from L (kvcalc.blocks_now)."""
        bs, n_layers = self.block_size, self.model.cfg.num_layers
        if rows is None:  # one pool for every layer
            kind = "latent" if self.model.cfg.mla is not None else "full"
            groups = [(kind, None, n_layers, self.pool.bytes_per_token, self.blocks.num_used)]
        else:
            groups = [("full" if g.window is None else "sliding", g.window, len(g.layers), r["bytes_per_token"],
                       r["blocks_in_use"]) for g, r in zip(self.groups, rows)]
        return [{"kind": kind, "window": window, "layers": layers, "block_size": bs,
                 "page_size_bytes": bpt * bs // layers, "bytes_per_token": bpt, "blocks_held": held, "free_lag": 0}
                for kind, window, layers, bpt, held in groups]

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes, and start the counters (hits, peak, preemptions) afresh."""
        if self.blocks is not None:
            self.blocks.reset_prefix_cache()
            self.blocks.stats = type(self.blocks.stats)(peak_used=self.blocks.num_used)
        if self.tier is not None:  # its blocks went with the prefix cache's (BlockManager.reset_prefix_cache)
            self.tier.stats = TierStats()
        self.scheduler.preemptions = 0

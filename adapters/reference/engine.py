"""The reference engine behind the harness's `Engine` interface.

    load()            model weights, then the KV pool sized from the memory budget
    prefill()/decode()  a fixed batch, driven through the same scheduler as serve()
    score()           teacher-forced log-probabilities, through the same paged path
    serve()           continuous batching: requests join at their scheduled arrival, and leave
                      (freeing their blocks) the step they produce their last token
    kv_cache_info()   pool, blocks, fragmentation, prefix-cache and preemption counters

The online API (what a server drives; serve() is built on it):

    add_request(request)  the request joins at the next step (`request.arrival_s` is ignored:
                          the caller decides when it arrives)
    step()                one scheduler step; returns a `TokenEvent` for every token it produced,
                          stamped with now_ns() after the step (device synchronised). A request's
                          blocks are freed the step it produces its last token (finished=True).
    has_work()            whether a step would compute anything
    abort(request_id)     drop a request now and free its blocks (unknown ids are ignored)

It shares the scheduler with prefill()/decode(): prefill() and release() drop every live
sequence, online requests included.

Options: see config.py (and conf/engine/reference.yaml).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from adapters.base import (
    Capabilities, DecodeResult, Engine, KVCacheInfo, LoadInfo, ModelSpec, PrefillResult, Request,
    RequestSource, StepTiming, TokenEvent, TokenScores, as_source, now_ns, wait_until,
)
from adapters.reference import kernels
from adapters.reference.block_manager import BlockManager
from adapters.reference.config import CPU_DEFAULT_KV_BYTES, KV_DTYPES, OPTIONS, EngineConfig, cross_field_problems
from adapters.reference.kv_cache import KVPool, bytes_per_token, check_kv_dtype
from adapters.reference.model import Model, ModelConfig
from adapters.reference.runner import ModelRunner, StepOutput
from adapters.reference.scheduler import Scheduler, Sequence

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _one_sequence_bytes(cfg: EngineConfig, bpt: int, max_model_len: int) -> int:
    """KV bytes of one sequence of max_model_len tokens, in whole blocks (or one region)."""
    block = max_model_len if cfg.contiguous else cfg.block_size
    return -(-max_model_len // block) * block * bpt


def _budget_problem(cfg: EngineConfig, bpt: int, max_model_len: int, budget: int, source: str) -> str | None:
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
    and an activation reserve come off it. Errors name the option and the fix."""
    free, total = torch.cuda.mem_get_info(device)
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


def _spin(seconds: float) -> None:
    """Busy-wait `seconds`: the calibration handicap costs CPU time as slower code would. A sleep
    does not: on a busy machine a sleeping thread waits for its core back, and a "25 %" sleep
    measured as +60-80 % per step in A/B jobs beside other work."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


class ReferenceEngine(Engine):
    name = "reference"
    options_cls = EngineConfig

    @classmethod
    def version(cls) -> str | None:
        from harness import __version__
        return f"{__version__} (torch {torch.__version__})"

    @classmethod
    def capabilities(cls, options: dict[str, Any] | None = None) -> Capabilities:
        cfg, _ = cls.typed_options(options)
        paged = cfg.use_cache and not cfg.contiguous  # block size and prefix sharing apply
        return Capabilities(kv_dtypes=KV_DTYPES, prefix_caching=paged, chunked_prefill=cfg.use_cache,
                            no_cache_mode=True, contiguous_layout=True, continuous_batching=True,
                            paged=paged, logits=True, scores=True, options=OPTIONS)

    @classmethod
    def check_options(cls, options: dict[str, Any], model: ModelSpec) -> list[str]:
        cfg, problems = cls.typed_options(options)
        problems += cross_field_problems(cfg) if not problems else []
        why = check_kv_dtype(cfg.kv_dtype, torch.device(model.device))
        if why:
            problems.append(f"engine_options.reference.kv_dtype={cfg.kv_dtype}: {why}. "
                            "Use kv_dtype=int8 or auto.")
        if cfg.kv_cache_bytes is not None and cfg.use_cache and not problems:
            shape = _shape_of(model)
            if shape is not None:
                bpt = bytes_per_token(shape.num_hidden_layers, shape.num_key_value_heads, shape.head_dim,
                                      cfg.kv_dtype, _DTYPES[model.dtype])
                why = _budget_problem(cfg, bpt, max(model.max_model_len, 1), cfg.kv_cache_bytes,
                                      f"engine_options.reference.kv_cache_bytes={cfg.kv_cache_bytes}")
                problems += [why] if why else []
        return problems

    def __init__(self) -> None:
        self.model: Model | None = None
        self.pool: KVPool | None = None
        self.blocks: BlockManager | None = None
        self._live: list[Sequence] = []  # the fixed batch of prefill()/decode()
        self._requests: dict[str, Sequence] = {}  # the online API's live requests, by id
        self._next_id = 0
        self.graphs = None

    # ---- life cycle --------------------------------------------------------------------
    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo:
        t0 = time.perf_counter()
        cfg, problems = self.typed_options(options)
        problems += cross_field_problems(cfg) if not problems else []
        self.device = torch.device(model.device)
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
        dtype = _DTYPES[model.dtype]
        self.kernels = kernels.select(self.device, dtype, cfg)
        self.model = Model(mcfg, model.path, dtype, self.device, max_len=model.max_model_len,
                           make_linear=self.kernels.make_linear, rows=self.kernels.rows)
        details: dict[str, Any] = {"options": vars(cfg).copy(), "architecture": mcfg.architecture,
                                   "kernels": dict(self.kernels.details)}

        bpt = bytes_per_token(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, cfg.kv_dtype, dtype)
        max_len = max(model.max_model_len, 1)
        self.block_size = max_len if cfg.contiguous else cfg.block_size
        graphs = self.kernels.decode_graphs and cfg.use_cache
        scratch = 1 if graphs else 0  # a block for the padded rows of graphed decode steps
        budget, source = cfg.kv_cache_bytes, f"engine_options.reference.kv_cache_bytes={cfg.kv_cache_bytes}"
        one_sequence = _one_sequence_bytes(cfg, bpt, max_len)
        if budget is None and self.device.type == "cuda" and cfg.use_cache:
            budget, source, details["gpu_memory"] = _cuda_kv_budget(self.device, cfg, mcfg, dtype)
            budget -= scratch * bpt * self.block_size
        elif budget is None:  # CPU: 1 GiB, but no more than max_num_seqs sequences could use
            budget = max(one_sequence, min(CPU_DEFAULT_KV_BYTES, cfg.max_num_seqs * one_sequence))
        if cfg.use_cache:
            why = _budget_problem(cfg, bpt, max_len, budget, source)
            if why:
                raise ValueError(why)
            num_blocks = budget // (bpt * self.block_size)
            self.pool = KVPool(mcfg.num_layers, num_blocks, self.block_size, mcfg.num_kv_heads,
                               mcfg.head_dim, cfg.kv_dtype, dtype, self.device, scratch_blocks=scratch)
            self.blocks = BlockManager(num_blocks, self.block_size, cfg.use_prefix_cache)
        # a fixed batch (prefill()) is admitted whole: at least the run's largest batch may run
        max_seqs = max(cfg.max_num_seqs, model.max_batch_size)
        self.scheduler = Scheduler(self.blocks, max_seqs, cfg.max_num_batched_tokens)
        self.graphs = None
        if graphs:
            from adapters.reference.cuda_graphs import CudaGraphBackend, DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.pool, self.kernels.decode_fn, max_seqs, max_len,
                                       CudaGraphBackend(self.device))
            t = time.perf_counter()
            self.graphs.capture()
            details["kernels"]["cuda_graph_capture_s"] = round(time.perf_counter() - t, 3)
            details["kernels"]["cuda_graph_buckets"] = list(self.graphs.buckets)
        self.runner = ModelRunner(self.model, self.pool, self.kernels.attention, self.graphs)
        self._sync()
        details["num_blocks"] = self.pool.num_blocks if self.pool else 0
        return LoadInfo(load_time_s=time.perf_counter() - t0, weights_bytes=self.model.num_bytes(),
                        kv_pool_bytes=self.pool.nbytes if self.pool else 0, engine_version=self.version(),
                        compute_threads=torch.get_num_threads(), details=details)

    def close(self) -> None:
        if self.model is not None:
            self.release()
        self.model = self.pool = self.blocks = self.graphs = self.runner = None  # frees device memory

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- steps ---------------------------------------------------------------------------
    def _new_sequence(self, prompt: list[int], stop_len: int, request_id: str | None = None) -> Sequence:
        if not prompt:
            raise ValueError("an empty prompt: every sequence needs at least one token.")
        if stop_len > self.model.rope_len:
            raise ValueError(f"a sequence of {stop_len} tokens exceeds the model's {self.model.rope_len} positions.")
        self._next_id += 1
        return Sequence(self._next_id, list(prompt), stop_len, request_id=request_id)

    def _step(self, keep_logits: bool = False) -> StepOutput:
        """Schedule and run one step; record what it computed and sampled."""
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        out = self.runner.run(chunks, keep_logits)
        if self.cfg.step_delay_frac:  # the calibration handicap (config.py): a real, proportional slowdown
            self._sync()
            _spin(self.cfg.step_delay_frac * (time.perf_counter() - t0))
        for c in chunks:
            c.seq.num_computed = c.end if self.pool is not None else 0
        for s in out.sampled:
            s.chunk.seq.tokens.append(s.token)
            s.chunk.seq.logits = s.logits
        if self.blocks is not None:
            for c in chunks:
                self.blocks.register_full_blocks(c.seq)
        return out

    def _run_batch(self, keep_logits: bool) -> tuple[int, int]:
        """Steps until every live sequence reached its stop length; the span they took."""
        self._sync()
        start = now_ns()
        while self.scheduler.has_work():
            self._step(keep_logits)
        self._sync()
        return start, now_ns()

    # ---- offline path: one fixed batch ---------------------------------------------------
    def prefill(self, prompts: list[list[int]], return_logits: bool = False,
                max_new_tokens: int | None = None) -> PrefillResult:
        """`max_new_tokens` is accepted and ignored: decode() raises each sequence's stop
        length one step at a time, so nothing needs declaring up front."""
        self.release()
        if len(prompts) > self.scheduler.max_num_seqs:
            raise ValueError(f"a batch of {len(prompts)} sequences exceeds max_num_seqs="
                             f"{self.scheduler.max_num_seqs}; raise engine_options.reference.max_num_seqs.")
        self._live = [self._new_sequence(p, len(p) + 1) for p in prompts]
        for seq in self._live:
            self.scheduler.add(seq)
        start, end = self._run_batch(return_logits)
        logits = torch.stack([s.logits for s in self._live]) if return_logits else None
        return PrefillResult([s.tokens[-1] for s in self._live], start, end, logits)

    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult:
        if not self._live:
            raise RuntimeError("decode() before prefill()")
        tokens, timings, all_logits = [], [], []
        for _ in range(steps):
            for seq in self._live:
                seq.stop_len = seq.num_tokens + 1
                if seq.stop_len > self.model.rope_len:
                    raise ValueError(f"decode past the model's {self.model.rope_len} positions.")
            start, end = self._run_batch(return_logits)
            tokens.append([s.tokens[-1] for s in self._live])
            timings.append(StepTiming(start, end, len(self._live)))
            if return_logits:
                all_logits.append(torch.stack([s.logits for s in self._live]))
        return DecodeResult(tokens, timings, all_logits if return_logits else None)

    def release(self) -> None:
        for seq in self._live + list(self._requests.values()):
            self.scheduler.finish(seq)
        self._live, self._requests = [], {}

    # ---- the online API: what a server drives ------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue `request`; it joins at the next step. `request.arrival_s` is ignored."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id} is already live; request ids must be unique.")
        if request.max_new_tokens < 1:
            raise ValueError(f"request {request.request_id}: max_new_tokens must be at least 1.")
        seq = self._new_sequence(request.prompt_ids, len(request.prompt_ids) + request.max_new_tokens,
                                 request.request_id)
        self.scheduler.add(seq)
        self._requests[request.request_id] = seq

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenEvent]:
        """One scheduler step: an event for every token it produced, stamped after the device
        finished. Finished requests leave (their blocks are freed) before this returns."""
        if not self.scheduler.has_work():
            return []
        out = self._step()
        self._sync()
        t = now_ns()
        events = []
        for s in out.sampled:
            seq = s.chunk.seq
            done = not seq.wants_step
            if done and self._requests.get(seq.request_id) is seq:
                self.scheduler.finish(seq)
                del self._requests[seq.request_id]
            events.append(TokenEvent(seq.request_id, seq.num_outputs - 1, s.token, t, finished=done))
        return events

    def abort(self, request_id: str) -> None:
        """Drop a live request now, freeing its blocks. Unknown (or finished) ids are ignored."""
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq)

    # ---- serving: continuous batching ----------------------------------------------------
    def serve(self, requests: list[Request] | RequestSource, start_ns: int) -> Iterator[TokenEvent]:
        """Requests join when they become due (a list: at their scheduled arrival, start_ns +
        arrival_s; a closed loop: as slots free): add_request() and step() in a loop, sleeping
        while nothing is due and nothing runs."""
        self.release()
        source = as_source(requests, start_ns)
        try:
            while not source.exhausted() or self.has_work():
                for r in source.due(now_ns()):
                    if r.max_new_tokens < 1:
                        raise ValueError(f"request {r.request_id}: max_new_tokens must be at least 1.")
                    self.add_request(r)
                if not self.has_work():
                    nxt = source.next_due_ns()
                    if nxt is None:  # nothing runs and nothing can become due
                        return
                    wait_until(nxt)
                    continue
                yield from self.step()
        finally:  # a consumer that stops early must not leave blocks behind
            for request_id in list(self._requests):
                self.abort(request_id)

    # ---- teacher-forced scores ---------------------------------------------------------
    def score(self, sequences: list[list[int]], start: list[int], top_k: int) -> list[TokenScores]:
        """For each position p in [start[i], len(seq)): the next-token distribution given
        seq[:p], from ONE teacher-forced pass through the normal paged path (chunks through the
        block table, the prefix cache supplying what it can before the first scored position).
        The sequence without its last token is prefilled with the logits of every position
        from start[i] - 1 kept; log_softmax in float32 over the whole vocabulary."""
        if len(start) != len(sequences):
            raise ValueError(f"score(): {len(sequences)} sequences but {len(start)} start positions.")
        vocab = self.model.cfg.vocab_size
        if not 1 <= top_k <= vocab:
            raise ValueError(f"score(): top_k={top_k} must be between 1 and the vocabulary size {vocab}.")
        for i, (seq, s0) in enumerate(zip(sequences, start)):
            if not 1 <= s0 <= len(seq):
                raise ValueError(f"score(): start[{i}]={s0} must be in [1, {len(seq)}] (position 0 has "
                                 "no context to predict it from).")
        self.release()
        results = [TokenScores([], [], []) for _ in sequences]
        work = []  # (sequence, its full token list, its TokenScores, start)
        for full, s0, res in zip(sequences, start, results):
            if s0 == len(full):
                continue  # nothing to score
            seq = self._new_sequence(full[:-1], len(full), request_id=None)
            seq.score_from = s0 - 1
            work.append((seq, full, res, s0))
            self._live.append(seq)
            self.scheduler.add(seq)
        by_seq = {id(seq): (full, res, s0) for seq, full, res, s0 in work}
        rows: dict[int, dict[int, tuple]] = {id(seq): {} for seq, *_ in work}
        budget = self.scheduler.budget  # steps of fewer tokens: their logits stay small
        self.scheduler.budget = min(budget, score_rows(self.model.cfg.vocab_size))
        try:
            while self.scheduler.has_work():
                out = self._step()
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
            self.release()
        for seq, full, res, s0 in work:
            got = rows[id(seq)]
            for p in range(s0 - 1, len(full) - 1):
                ids, lps, tgt = got[p]
                res.top_ids.append(ids)
                res.top_logprobs.append(lps)
                res.target_logprobs.append(tgt)
        return results

    # ---- statistics ------------------------------------------------------------------------
    def kv_cache_info(self) -> KVCacheInfo:
        from harness.core.kvcalc import canonical_kv_dtype

        if self.model is None:
            return KVCacheInfo()
        cfg = self.cfg
        kv_dtype = cfg.kv_dtype if cfg.kv_dtype != "auto" else canonical_kv_dtype(self.spec.dtype)
        extra: dict[str, Any] = {"kv_cache": cfg.kv_cache, "kv_layout": cfg.kv_layout,
                                 "prefix_caching": cfg.use_prefix_cache, "kernels": dict(self.kernels.details)}
        if self.graphs is not None:
            extra["cuda_graphs"] = self.graphs.stats()
        live = self.scheduler.running
        if self.pool is None:
            return KVCacheInfo(kv_dtype=kv_dtype, pool_bytes=0, tokens_stored=0, slots_allocated=0,
                               preemptions=self.scheduler.preemptions, extra=extra)
        bs, blocks = self.block_size, self.blocks
        filled: dict[int, int] = {}  # block id -> slots holding a token (shared blocks once)
        for seq in live:
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
        if cfg.contiguous:
            extra["region_tokens"] = bs  # each sequence reserves one region of max_model_len slots
        return KVCacheInfo(
            kv_dtype=kv_dtype, block_size=None if cfg.contiguous else bs, num_blocks=blocks.num_blocks,
            bytes_per_block=self.pool.bytes_per_token * bs, pool_bytes=self.pool.nbytes,
            bytes_per_token=self.pool.bytes_per_token, blocks_in_use=blocks.num_used,
            blocks_peak=blocks.stats.peak_used, tokens_stored=stored, slots_allocated=allocated,
            prefix_cache_queries=blocks.stats.prefix_queries if cfg.use_prefix_cache else None,
            prefix_cache_hits=blocks.stats.prefix_hits if cfg.use_prefix_cache else None,
            preemptions=self.scheduler.preemptions, extra=extra)

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes, and start the counters (hits, peak, preemptions) afresh."""
        if self.blocks is not None:
            self.blocks.reset_prefix_cache()
            self.blocks.stats = type(self.blocks.stats)(peak_used=self.blocks.num_used)
        if self.model is not None:
            self.scheduler.preemptions = 0


def _shape_of(model: ModelSpec):
    """The model's shape before it is loaded: its config.json, or the preset of that name."""
    from harness.core.presets import load_preset, shape_from_hf_config
    try:
        if model.path and (Path(model.path) / "config.json").is_file():
            return shape_from_hf_config(model.path)
        return load_preset(model.name)
    except Exception:
        return None

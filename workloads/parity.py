"""Parity: does every engine compute the same model? An ordinary workload that every run adds
after its main workload (`parity=false` turns it off), run by each engine on fixed prompts.

In the engine's process the point (1) generates `tokens` greedy tokens for each prompt, run as
one batch of unequal lengths, and (2) where the engine can score sequences, scores the prompts
followed by the baseline engine's greedy continuation (teacher forcing: the harness hands the
baseline's tokens to every later engine), keeping the top-k log-probabilities per position.

In the harness's process the row is compared with the baseline's: the first engine of the run
that produced a parity row (the reference engine runs first). The comparisons and thresholds
are harness.core.parity's; in float32 any greedy difference fails the row as well.

On a checkpoint trained here (harness.core.train: it carries training.json and its held-out
text) the prompts are windows of the held-out text instead of random tokens, and the tighter
trained-checkpoint thresholds apply: its distributions are peaked, so a smaller error shows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from adapters.base import Engine, Request, TokenEvent, now_ns
from harness.core.parity import compare_scores, greedy_agreement, verdict
from harness.core.schema import spec
from harness.core.train import HELDOUT_FILE, TRAINING_FILE
from workloads.base import Point, RunContext, Workload

WORKLOAD = "parity"
# Dtypes in which greedy agreement decides nothing (random-weight logits are nearly tied: one
# rounding flip changes a token and all after it). An engine compared only by greedy agreement in
# these is `unverified`, never `ok`.
GREEDY_UNDECIDED = ("bfloat16", "float16")


# The parity prompts' lengths when workload.prompt_lens is not given: random tokens of up to 512
# on random weights; on a checkpoint trained here, windows of its held-out text of up to 2048,
# where a 1 % RoPE error leaves bf16's rounding (at 512 it does not: docs/metrics.md, "Parity on
# the trained preset").
PROMPT_LENS = [64, 128, 256, 512]
TRAINED_PROMPT_LENS = [128, 512, 1024, 2048]


@dataclass
class ParityConfig:
    name: str = spec(WORKLOAD)
    prompt_lens: list[int] | None = spec(
        None, ge=1, nonempty=True,
        help="one prompt of each length, run as one batch (long: a position error grows with it); "
             "null: by model - [64,128,256,512], or [128,512,1024,2048] on a checkpoint trained here")
    tokens: int = spec(32, ge=1, le=4096, help="greedy tokens per prompt (and teacher-forced positions scored)")
    top_k: int = spec(8, ge=2, le=20, help="log-probabilities compared per position (vLLM returns at most 20)")
    adapters: dict[str, Any] | None = spec(None, help="LoRA adapters {NAME: DIR} (the run's workload.lora): one more "
                                                      "point per adapter, every engine scoring with it")


def greedy_tokens(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The first n greedy output tokens of every prompt, run as one batch."""
    pre = engine.prefill(prompts, max_new_tokens=n)
    dec = engine.decode(n - 1) if n > 1 else None
    engine.release()
    steps = dec.tokens if dec else []
    return [[pre.first_tokens[b]] + [step[b] for step in steps] for b in range(len(prompts))]


def served_tokens(engine: Engine, prompts: list[list[int]], n: int, adapter: str) -> list[list[int]]:
    """The first n greedy tokens of every prompt with LoRA `adapter`, all requests at once through
    serve() (the path every engine takes a request's adapter on)."""
    reqs = [Request(f"parity{i}", list(p), n, adapter=adapter) for i, p in enumerate(prompts)]
    got: dict[str, dict[int, int]] = {r.request_id: {} for r in reqs}
    for ev in engine.serve(reqs, now_ns()):
        if not isinstance(ev, TokenEvent):
            raise RuntimeError(f"parity request {ev.request_id} with adapter {adapter} failed: {ev.reason}")
        got[ev.request_id][ev.index] = ev.token_id
    return [[got[r.request_id][i] for i in sorted(got[r.request_id])] for r in reqs]


def trained_here(model_path: str | None) -> bool:
    """Whether the checkpoint was trained here (harness.core.train): it records its training and
    keeps its held-out text. Such a checkpoint gets held-out prompts and the trained thresholds."""
    return bool(model_path) and (Path(model_path) / TRAINING_FILE).is_file() and \
        (Path(model_path) / HELDOUT_FILE).is_file()


def trained_model(model_cfg: dict[str, Any]) -> bool:
    """Whether the run's model is trained here: a preset that trains (a `train:` mapping), or a
    checkpoint directory with its training record and held-out text."""
    return bool(model_cfg.get("train")) or trained_here(model_cfg.get("path") or None)


def with_prompt_lens(cfg: ParityConfig, model_cfg: dict[str, Any], max_positions: int | None = None) -> ParityConfig:
    """`cfg` with its prompt lengths decided: as given, else by model - PROMPT_LENS, or
    TRAINED_PROMPT_LENS on a model trained here (`trained_model`) - each cut to what the model's
    positions (less the scored tokens) and a trained checkpoint's held-out text hold."""
    if cfg.prompt_lens is not None:
        return cfg
    trained = trained_model(model_cfg)
    lens = TRAINED_PROMPT_LENS if trained else PROMPT_LENS
    room = [max_positions - cfg.tokens - 1] if max_positions else []
    path = model_cfg.get("path") or None
    if trained and trained_here(path):
        room.append(len(np.load(Path(path) / HELDOUT_FILE, mmap_mode="r")))
    if room:
        lens = sorted({max(1, min(s, min(room))) for s in lens})
    return replace(cfg, prompt_lens=list(lens))


def heldout_prompts(model_path: str, lens: list[int]) -> list[list[int]]:
    """One window of the checkpoint's held-out text per length, from evenly spread places."""
    held = np.load(Path(model_path) / HELDOUT_FILE)
    if len(held) <= max(lens):
        raise ValueError(f"{model_path}: its held-out text ({len(held)} tokens) is shorter than the longest parity "
                         f"prompt ({max(lens)}); shorten workload.prompt_lens")
    starts = np.linspace(0, len(held) - max(lens) - 1, num=len(lens)).astype(int)
    return [list(map(int, held[s:s + n])) for s, n in zip(starts, lens)]


def _baseline(rows: list[dict[str, Any]], engine: str | None = None, adapter: str | None = None) -> dict[str, Any] | None:
    """The run's baseline parity row: the first ok parity row (not `engine`'s own) of the same LoRA
    adapter (None: the base model)."""
    for r in rows:
        if r.get("workload") == WORKLOAD and r.get("status") == "ok" and r.get("parity_tokens") and \
                r.get("engine") != engine and (r.get("point") or {}).get("adapter") == adapter:
            return r
    return None


def _adapter(point: Point | dict[str, Any]) -> str | None:
    params = point.params if isinstance(point, Point) else (point.get("point") or {})
    return params.get("adapter")


class Parity(Workload):
    name = WORKLOAD
    config_cls = ParityConfig
    roofline = False

    def plan(self, cfg: ParityConfig) -> list[Point]:
        base = {"prompt_lens": list(cfg.prompt_lens or PROMPT_LENS), "tokens": cfg.tokens, "top_k": cfg.top_k}
        # with LoRA adapters: the same prompts once more per adapter, every engine scoring with it
        return [Point(self.name, base)] + [Point(self.name, {**base, "adapter": name, "adapter_path": path})
                                           for name, path in (cfg.adapters or {}).items()]

    def unsupported(self, point: Point, caps: Any) -> str | None:
        if _adapter(point) and not caps.lora:
            return caps.lora_unsupported or "the engine serves no LoRA adapters here"
        return None

    def engine_overrides(self, point: Point, caps: Any) -> dict[str, Any]:
        if not _adapter(point):
            return {}
        from workloads.lora import overrides
        return overrides({"adapters": {point.params["adapter"]: point.params["adapter_path"]}, "max_loras": 1,
                          "max_cpu_loras": 1, "max_lora_rank": None})

    def max_model_len(self, cfg: ParityConfig) -> int:
        # the scored sequence is prompt + tokens, and an engine that scores through generation
        # (vLLM's prompt log-probabilities) needs room for one more
        return max(cfg.prompt_lens or PROMPT_LENS) + cfg.tokens + 1

    def max_prefill_batch(self, cfg: ParityConfig) -> tuple[int, int]:
        lens = cfg.prompt_lens or PROMPT_LENS
        return len(lens), sum(lens)

    def prompts(self, point: Point, ctx: RunContext) -> list[list[int]]:
        n = point.params["tokens"]
        lens = [min(s, max(1, ctx.max_model_len - n - 1)) for s in point.params["prompt_lens"]]
        if trained_here(ctx.model_path):
            return heldout_prompts(ctx.model_path, lens)
        return [ctx.prompts(1, s, f"parity/{i}")[0] for i, s in enumerate(lens)]

    def point_inputs(self, point: Point, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        base = _baseline(rows, adapter=_adapter(point))
        return {"teacher": base["parity_tokens"], "baseline": base["engine"]} if base else None

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: ParityConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        n, k = point.params["tokens"], point.params["top_k"]
        prompts = self.prompts(point, ctx)
        adapter = _adapter(point)
        greedy = greedy_tokens(engine, prompts, n) if adapter is None else served_tokens(engine, prompts, n, adapter)
        inputs = inputs or {}
        teacher = inputs.get("teacher") or greedy
        row: dict[str, Any] = {"parity_tokens": greedy, "parity_prompt_lens": [len(p) for p in prompts],
                               "parity_teacher": inputs.get("baseline") or "own greedy tokens"}
        try:
            seqs, starts = [p + t for p, t in zip(prompts, teacher)], [len(p) for p in prompts]
            scores = engine.score(seqs, starts, k) if adapter is None else engine.score(seqs, starts, k, adapter=adapter)
        except NotImplementedError as e:
            row["parity_scores"] = None
            row["parity_note"] = str(e)
            return row
        row["parity_scores"] = [{"top_ids": s.top_ids, "top_logprobs": [[round(v, 6) for v in lp] for lp in s.top_logprobs],
                                 "target_logprobs": [round(v, 6) for v in s.target_logprobs]} for s in scores]
        return row

    def finalize_row(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        if row.get("status") != "ok" or not row.get("parity_tokens"):
            return
        params = row.get("point") or {}
        expected = len(params.get("prompt_lens") or row.get("parity_prompt_lens") or []) * int(params.get("tokens") or 0)
        row["positions_expected"] = expected
        problems: list[str] = []
        unverified: str | None = None
        base = _baseline(rows, row["engine"], _adapter(row))
        if base is None:  # this engine is the baseline: its own tokens and scores must be complete
            row.update(parity_baseline=row["engine"], agreement=1.0, first_divergence=None)
            got = sum(len(t) for t in row["parity_tokens"])
            if got < expected:
                problems.append(f"the baseline produced {got} of the {expected} greedy tokens asked for")
            if row.get("parity_scores") is not None:
                row["positions_compared"] = sum(len(s["target_logprobs"]) for s in row["parity_scores"])
            else:
                row["positions_compared"] = got
        elif any(t < 0 for seq in row["parity_tokens"] for t in seq) and row.get("parity_scores") is None:
            # a server that streams text without token ids (trtllm-serve gives -1): nothing to compare
            row.update(parity_baseline=base["engine"], agreement=None, first_divergence=None, positions_compared=0)
            unverified = (f"{row['engine']} returns no token ids (-1) and cannot be scored teacher-forced: "
                          "its output cannot be compared token by token. Use an endpoint kind that returns token "
                          "ids or log-probabilities")
            expected = 0  # not a shortfall of compared positions: nothing could be compared at all
        else:
            row["parity_baseline"] = base["engine"]
            row.update(greedy_agreement(base["parity_tokens"], row["parity_tokens"]))
            if row["dtype"] == "float32" and (row["agreement"] or 0.0) < 1.0:
                problems.append(f"greedy tokens differ from {base['engine']}'s in float32 (first divergence at "
                                f"step {row['first_divergence']}, agreement {row['agreement'] or 0.0:.3f})")
            if row.get("parity_scores") is not None and base.get("parity_scores"):  # [] is scored: nothing
                row.update(compare_scores(base["parity_scores"], row["parity_scores"], row["dtype"]))
                row["parity_thresholds"], why = verdict(row, row["dtype"], trained_here(row.get("model_path")))
                if why:
                    problems.append(f"teacher-forced log-probabilities differ from {base['engine']}'s beyond the "
                                    f"{row['dtype']} thresholds: {why}")
            else:
                who = row["engine"] if row.get("parity_scores") is None else base["engine"]
                row.setdefault("parity_note", f"{who} cannot score sequences: greedy agreement only")
                row["positions_compared"] = sum(min(len(b), len(t)) for b, t in
                                                zip(base["parity_tokens"], row["parity_tokens"]))
                if row["dtype"] in GREEDY_UNDECIDED:
                    unverified = (f"{who} cannot be scored teacher-forced, and in {row['dtype']} greedy "
                                  f"agreement ({(row['agreement'] or 0.0) * 100:.1f}%) decides nothing: a rounding "
                                  "flip changes a token and everything after it. Run parity with dtype=float32, or "
                                  "use an engine or endpoint kind that returns log-probabilities (vllm, infer-bench)")
        if row.get("positions_compared", 0) < expected:
            problems.append(f"compared {row.get('positions_compared', 0)} of the {expected} positions expected "
                            f"({len(params.get('prompt_lens') or [])} prompts x {params.get('tokens')} tokens)")
        if problems:
            row["status"], row["error"] = "failed", "; ".join(problems)
        elif unverified:
            row["status"], row["error"] = "unverified", unverified

    def summary(self, rows: list[dict[str, Any]]) -> str:
        lines = []
        for r in rows:
            if r.get("workload") != self.name:
                continue
            if _adapter(r):  # a LoRA adapter's point: its engine named with the adapter
                r = {**r, "engine": f"{r['engine']}+{_adapter(r)}"}
            if r.get("agreement") is None:
                lines.append(f"parity    {r['engine']:<9} {r['status']}: {(r.get('error') or '').splitlines()[0]}")
                continue
            if r["status"] == "unverified":
                lines.append(f"parity    {r['engine']:<9} UNVERIFIED: {r.get('error')}")
                continue
            div = r.get("first_divergence")
            line = (f"parity    {r['engine']:<9} greedy {r['agreement'] * 100:5.1f}% equal to {r['parity_baseline']}'s"
                    + ("" if div is None else f" (first divergence at step {div})"))
            if r.get("parity_mean_kl") is not None:
                top1 = r.get("parity_top1_agreement")
                line += (f"; teacher-forced: max |dlogp| {r['parity_max_abs_err']:.2g}, mean KL "
                         f"{r['parity_mean_kl']:.2g}, top-1 {'-' if top1 is None else f'{top1 * 100:.1f}%'} of "
                         f"{r['parity_confident_positions']} confident positions")
            if r.get("positions_expected"):
                line += f"; {r.get('positions_compared', 0)}/{r['positions_expected']} positions compared"
            lines.append(line + ("" if r["status"] == "ok" else f"  [{r['status'].upper()}: {r.get('error')}]"))
        return "\n".join(lines)

"""Speculative decoding, measured and verified (docs/metrics.md, "Speculative decoding").

A grid over method x k x batch size x content. Every point serves the same requests through the
engine's `serve()` - the one path every engine has, servers included - in a closed loop at
concurrency = batch size: B requests in flight, each one that finishes replaced at once, until
max(min_requests, rounds x B) requests have been served (after a warm-up round of B requests).
A speculative step may emit several tokens per sequence, so the row's figures are per output
token: TPOT (per request, then the median), output tok/s, tokens per step; and the engine's
spec-decode counters (`Engine.spec_decode_stats`, read before and after the point): drafts,
proposed and accepted tokens, acceptance per draft position, draft time.

Method `none` (no speculation) is measured at every (batch, content) point, before the
speculative points, on the same engine in the same run; in the harness's process each
speculative row is then completed against it (`finalize_row`):

- **speed-up** = TPOT without / TPOT with speculation (medians over the requests), its interval
  a bootstrap over the requests paired by request id (the same prompt both times);
- **the lossless check**: with greedy verification every request's output must be, token for
  token, the baseline's output for the same request. A difference makes the row `failed`, naming
  the request, the first differing position and both tokens; a row that cannot be compared (its
  baseline missing or failed, outputs not recorded, other prompts) is `unverified`. Both fail the
  run's exit code.

The speculative options go to the engine by their standard names (adapters.base.STANDARD_OPTIONS:
speculative_method, num_speculative_tokens, draft_model, prompt_lookup_min, prompt_lookup_max),
the engine reloading when they change; the points are ordered so that it reloads once per
(method, k). A method the engine lacks (Capabilities.speculative_methods) or a batch beyond
Capabilities.speculative_max_batch is a skipped row with the reason. The draft model is a preset
or a checkpoint directory; the harness materialises a preset (as it does the target) and the
engine gets the directory (RunContext.models).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.base import Capabilities, Engine, Request, now_ns
from harness.core.errors import UserError
from harness.core.metrics import RequestTrace, serving_metrics
from harness.core.presets import load_preset, preset_names, shape_from_hf_config
from harness.core.schema import spec
from harness.core.specdecode import (BASELINE, FAIL, UNVERIFIED, accepted_agreement, counters_check, counters_delta,
                                     lossless, lossless_passed, spec_fields)
from workloads.base import Collector, Point, RunContext, Workload, kv_memory_fields
from workloads.serving import ClosedLoopSource
from workloads.spec_content import (CONTENTS, Content, dataset_content, dataset_encoding_problems, encoding_problems,
                                    load_content, prompts)
from workloads.spec_dataset import read_categories

WORKLOAD = "speculative"
METHODS = ("ngram", "draft", "eagle", "mtp")
# point parameters that say how a point speculates; the rest say what it serves (its baseline's)
METHOD_PARAMS = ("method", "k", "draft", "prompt_lookup_min", "prompt_lookup_max")
# a text every tokenizer check encodes: the same ids on both sides, or the tokenizers differ
PROBE_TEXT = ("def speculative(k: int) -> list[str]:\n    return [f'{i}' for i in range(k)]  # draft, verify\n"
              "The quick brown fox jumps over the lazy dog. Licensed under the Apache License, Version 2.0.\n")


@dataclass
class SpeculativeConfig:
    name: str = spec(WORKLOAD)
    methods: list[str] = spec(["ngram", "draft"], choices=METHODS, nonempty=True,
                              help="speculative methods measured; none (no speculation, the baseline) is always measured")
    num_speculative_tokens: list[int] = spec([2, 4], ge=1, nonempty=True, help="k: tokens proposed per step, one "
                                                                                 "point each")
    batch_sizes: list[int] = spec([1, 4, 16], ge=1, nonempty=True,
                                  help="sequences decoding at once: the closed loop's concurrency")
    contents: list[str] = spec(list(CONTENTS), choices=CONTENTS, nonempty=True,
                               help="what the prompts are: held-out code, prose no preset saw, uniform random ids")
    draft_model: str | None = spec("tiny-trained", help="method draft: a model preset or a checkpoint directory "
                                                        "sharing the target's tokenizer")
    prompt_lookup_min: int = spec(2, ge=1, help="method ngram: the shortest n-gram matched")
    prompt_lookup_max: int = spec(4, ge=1, help="method ngram: the longest n-gram matched")
    prompt_len: int = spec(128, ge=1, help="prompt tokens per request")
    output_len: int = spec(64, ge=2, help="output tokens per request (forced: greedy, EOS ignored)")
    rounds: int = spec(2, ge=1, help="requests per slot: a point serves max(min_requests, rounds x batch size)")
    min_requests: int = spec(8, ge=2, help="requests per point, at least (the TPOT and speed-up intervals need them)")
    dataset: str | None = spec(None, help="prompts from your own traffic instead of the built-in contents: a JSONL "
                                          "with a `category` field (SpecBench, MT-Bench), ShareGPT, chat JSONL, or "
                                          "hf:ORG/NAME[/FILE]; acceptance and speed-up per category")
    categories: list[str] | None = spec(None, help="with a dataset: the categories measured (null: all of them)")


def draft_reference_problems(ref: str | None, target_vocab: int, target_name: str) -> list[str]:
    """Plan-time problems with workload.draft_model: it must be a preset or a checkpoint directory
    (config.json), with the target's vocabulary size."""
    if ref is None:
        return ["workload.draft_model is missing: method draft needs a draft model. Give a preset sharing the "
                "target's tokenizer (workload.draft_model=tiny-trained) or a checkpoint directory, or leave draft "
                "out of workload.methods."]
    if ref in preset_names():
        vocab, what = load_preset(ref).vocab_size, f"preset {ref}"
    else:
        p = Path(ref).expanduser()
        if not (p / "config.json").is_file():
            return [f"workload.draft_model={ref}: no such model preset or checkpoint directory (a directory with "
                    f"config.json). Give a preset ({', '.join(preset_names())}) or the path of a Hugging Face "
                    "checkpoint."]
        try:
            vocab, what = shape_from_hf_config(p, "workload.draft_model").vocab_size, str(p)
        except UserError as e:
            return e.problems
    if vocab != target_vocab:
        return [f"workload.draft_model={ref}: its vocabulary has {vocab} tokens ({what}), the target's {target_vocab} "
                f"({target_name}). A draft must share the target's tokenizer: give a draft trained with it."]
    return []


def tokenizer_problems(target_dir: str, draft_dir: str, ref: str) -> list[str]:
    """After both checkpoints are on disk: the draft's tokenizer must be the target's (the same
    vocabulary, and the same ids for the same text)."""
    from transformers import AutoTokenizer
    toks = []
    for d, who in ((target_dir, "the target"), (draft_dir, f"workload.draft_model={ref}")):
        try:
            toks.append(AutoTokenizer.from_pretrained(d))
        except Exception as e:
            return [f"workload.draft_model={ref}: the tokenizer of {who} did not load from {d} ({type(e).__name__}: "
                    f"{e}). A draft must share the target's tokenizer."]
    t, d = toks
    if t.get_vocab() != d.get_vocab():
        return [f"workload.draft_model={ref}: its tokenizer ({draft_dir}) is not the target's ({target_dir}): their "
                "vocabularies differ. A draft must share the target's tokenizer: give a draft trained with it."]
    a, b = t(PROBE_TEXT, add_special_tokens=False)["input_ids"], d(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if a != b:
        return [f"workload.draft_model={ref}: its tokenizer ({draft_dir}) splits text differently from the "
                f"target's ({target_dir}), though the vocabularies match. A draft must share the target's tokenizer."]
    return []


def baseline_params(params: dict[str, Any]) -> dict[str, Any]:
    """The point of the same requests without speculation."""
    out = {k: v for k, v in params.items() if k not in METHOD_PARAMS}
    return {"method": "none", **out}


def prompts_digest(reqs: list[Request]) -> str:
    h = hashlib.sha256()
    for r in reqs:
        h.update(json.dumps([r.request_id, r.prompt_ids, r.max_new_tokens]).encode())
    return h.hexdigest()[:16]


def decode_steps(traces: list[RequestTrace]) -> dict[str, int]:
    """Per request, the engine steps that gave it its tokens after the first: the distinct times
    its decode tokens were stamped with (an in-process engine stamps the tokens one step gave a
    sequence with that step's time)."""
    return {t.request_id: len(set(t.token_times_ns[1:])) for t in traces}


def emitted_figures(done: list[RequestTrace], steps: dict[str, int] | None, method: str, k: int | None,
                    counted: int | None) -> tuple[dict[str, int] | None, float | None, str | None]:
    """(accepted tokens each request was given - decode tokens - decode steps -, tokens per step,
    where that came from). From the token times where they group tokens by step: a step gives a
    sequence 1 .. k + 1 tokens, and the engine's counters (`counted`) may exceed what was given
    only by the tokens accepted past a request's last one (at most k per request: an engine may
    count them, and drops them as a server drops tokens past max_tokens). Else tokens per step
    from the counters: decode tokens / (decode tokens - accepted)."""
    decode = sum(t.n_out - 1 for t in done)
    if method == "none":
        return None, 1.0, "no speculation"
    if steps is not None and k and done:
        got = {t.request_id: (t.n_out - 1) - steps[t.request_id] for t in done}
        per_step_ok = all(steps[t.request_id] * (k + 1) >= t.n_out - 1 for t in done)
        total = sum(got.values())
        if per_step_ok and (counted is None or 0 <= counted - total <= k * len(done)):
            n_steps = sum(steps[t.request_id] for t in done)
            return got, decode / n_steps if n_steps else None, "token times"
    if counted is not None and decode > counted:
        return None, decode / (decode - counted), "counters"
    return None, None, None


def _stats(engine: Engine) -> dict[str, Any] | None:
    s = engine.spec_decode_stats()
    return None if s is None else s.to_dict()


class Speculative(Workload):
    name = WORKLOAD
    config_cls = SpeculativeConfig
    compared_metrics = ("tpot_s", "output_tok_s")
    summary_columns = [
        ("method", "method", "s"), ("k", "k", "d"), ("batch_size", "batch", "d"), ("content", "content", "s"),
        ("tpot_s", "TPOT ms", "ms"), ("output_tok_s", "out tok/s", ".1f"), ("tokens_per_step", "tok/step", ".2f"),
        ("mean_acceptance_length", "accept len", ".2f"), ("acceptance_rate", "accept rate", ".2f"),
        ("speedup", "speed-up", ".2f"), ("speedup_ci_text", "95% CI", "s"), ("lossless", "lossless", "s"),
    ]

    def summary(self, rows: list[dict[str, Any]]) -> str:
        shown = [{**r, "speedup_ci_text": f"{r['speedup_ci'][0]:.2f}-{r['speedup_ci'][1]:.2f}"} if r.get("speedup_ci")
                 else r for r in rows]
        return super().summary(shown)

    def __init__(self) -> None:
        self._content: dict[tuple[str, str], Content] = {}

    # ---- the plan (harness) -------------------------------------------------------------
    def _requests(self, cfg: SpeculativeConfig, b: int) -> int:
        return max(cfg.min_requests, cfg.rounds * b)

    def plan(self, cfg: SpeculativeConfig) -> list[Point]:
        """Method none at every (batch, content) first (the baselines), then each (method, k)
        over the same (batch, content) points: the engine reloads once per (method, k)."""
        def point(method: str, b: int, c: str, k: int | None = None) -> Point:
            p: dict[str, Any] = {"method": method, "batch_size": b, "content": c, "prompt_len": cfg.prompt_len,
                                 "output_len": cfg.output_len, "num_requests": self._requests(cfg, b)}
            if method != "none":
                p["k"] = k
            if method == "draft":
                p["draft"] = cfg.draft_model
            if method == "ngram":
                p.update(prompt_lookup_min=cfg.prompt_lookup_min, prompt_lookup_max=cfg.prompt_lookup_max)
            return Point(self.name, p)

        batches, contents = sorted(set(cfg.batch_sizes)), list(dict.fromkeys(cfg.contents))
        if cfg.dataset:  # the dataset's categories instead of the built-in contents
            contents = self.dataset_categories(cfg)
        points = [point("none", b, c) for b in batches for c in contents]
        for m in dict.fromkeys(cfg.methods):
            for k in sorted(set(cfg.num_speculative_tokens)):
                points += [point(m, b, c, k) for b in batches for c in contents]
        if cfg.dataset:  # the points of a dataset name it (their prompts are its)
            points = [Point(p.workload, {**p.params, "dataset": cfg.dataset}) for p in points]
        return points

    def dataset_categories(self, cfg: SpeculativeConfig) -> list[str]:
        """The categories of cfg.dataset measured (workload.categories, else all), in file order."""
        cats = list(read_categories(cfg.dataset)[0])
        return [c for c in cats if c in cfg.categories] if cfg.categories else cats

    def max_model_len(self, cfg: SpeculativeConfig) -> int:
        # a verifying pass writes up to k positions past the last accepted token
        return cfg.prompt_len + cfg.output_len + max(cfg.num_speculative_tokens) + 1

    def max_prefill_batch(self, cfg: SpeculativeConfig) -> tuple[int, int]:
        b = max(cfg.batch_sizes)
        return b, b * cfg.prompt_len

    def check(self, cfg: SpeculativeConfig, shape: Any) -> list[str]:
        problems = []
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            problems.append(f"workload.prompt_lookup_min={cfg.prompt_lookup_min} is more than workload."
                            f"prompt_lookup_max={cfg.prompt_lookup_max}: the shortest n-gram matched cannot be longer "
                            "than the longest. Lower prompt_lookup_min or raise prompt_lookup_max.")
        if "draft" in cfg.methods:
            problems += draft_reference_problems(cfg.draft_model, shape.vocab_size, shape.name)
        if cfg.categories is not None and not cfg.dataset:
            problems.append("workload.categories without workload.dataset: categories name a dataset's prompts. Give "
                            "workload.dataset=FILE, or leave categories out.")
        if cfg.dataset:
            try:
                cats = read_categories(cfg.dataset)[0]
            except UserError as e:
                return problems + e.problems
            unknown = [c for c in (cfg.categories or []) if c not in cats]
            if unknown:
                problems.append(f"workload.categories: {', '.join(unknown)} names nothing in workload.dataset="
                                f"{cfg.dataset} (its categories: {', '.join(cats)}). Name some of those.")
        return problems + super().check(cfg, shape)

    def models(self, cfg: SpeculativeConfig) -> list[str]:
        return [cfg.draft_model] if "draft" in cfg.methods and cfg.draft_model else []

    def check_models(self, cfg: SpeculativeConfig, model_path: str, models: dict[str, str]) -> list[str]:
        problems = encoding_problems(model_path, list(cfg.contents)) if not cfg.dataset else \
            dataset_encoding_problems(cfg.dataset, model_path)
        for ref in self.models(cfg):
            problems += tokenizer_problems(model_path, models[ref], ref)
        return problems

    # ---- in the engine's process --------------------------------------------------------
    def unsupported(self, point: Point, caps: Capabilities) -> str | None:
        m, b = point.params["method"], point.params["batch_size"]
        if m == "none":
            return None
        if m not in caps.speculative_methods:
            can = ", ".join(caps.speculative_methods) or "none"
            return f"the engine cannot speculate with method {m} (its methods: {can})"
        if caps.speculative_max_batch is not None and b > caps.speculative_max_batch:
            return (f"the engine speculates at batch sizes up to {caps.speculative_max_batch} only; this point "
                    f"decodes {b} sequences at once")
        return None

    def engine_overrides(self, point: Point, caps: Capabilities) -> dict[str, Any]:
        p = point.params
        if not caps.speculative_methods:  # an engine that cannot speculate runs only method none, as it is
            return {}
        if p["method"] == "none":
            return {"speculative_method": "none"}
        out: dict[str, Any] = {"speculative_method": p["method"], "num_speculative_tokens": p["k"]}
        if p["method"] == "draft":
            out["draft_model"] = p["draft"]  # the harness's worker maps it to the directory (RunContext.models)
        if p["method"] == "ngram":
            out.update(prompt_lookup_min=p["prompt_lookup_min"], prompt_lookup_max=p["prompt_lookup_max"])
        return out

    def content(self, category: str, ctx: RunContext, dataset: str | None = None) -> Content:
        key = (category, ctx.model_path, dataset)
        if key not in self._content:
            self._content[key] = (load_content(category, ctx.model_path) if dataset is None
                                  else dataset_content(dataset, category, ctx.model_path))
        return self._content[key]

    def requests(self, params: dict[str, Any], ctx: RunContext, n: int, first: int = 0) -> list[Request]:
        content = self.content(params["content"], ctx, params.get("dataset"))
        if params.get("dataset"):  # request i: the category's i-th prompt (cycling), cut to prompt_len
            ps = [content.prompts[i % len(content.prompts)][:params["prompt_len"]] for i in range(first, first + n)]
        else:
            ps = prompts(content, n, params["prompt_len"], ctx.seed, (ctx.token_low, ctx.token_high, ctx.avoid_ids),
                         first)
        return [Request(f"r{first + i}", p, params["output_len"]) for i, p in enumerate(ps)]

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: SpeculativeConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        p = point.params
        b, n = p["batch_size"], p["num_requests"]
        endpoint = engine.load_generator
        # warm-up: one round of B requests of the same category (prompts the point does not serve)
        self._serve(engine, self.requests(p, ctx, b, first=100_000), b, endpoint)
        reqs = self.requests(p, ctx, n)
        expected = {r.request_id: r.max_new_tokens for r in reqs}
        before = _stats(engine)
        sampler = ctx.sampler().start()
        traces, per_request, timings = self._serve(engine, reqs, b, endpoint,
                                                   per_request_stats=b == 1 and before is not None)
        mem = sampler.stop()
        after = _stats(engine)
        row = serving_metrics(traces, None, expected)
        if not row["completed"]:
            raise RuntimeError(f"no request of the point completed: {row['failed_request_reasons']}")
        done = [t for t in traces if not t.error and t.n_out == expected[t.request_id]]
        delta = counters_delta(before, after)
        row.update(spec_fields(delta, row["duration_s"]))
        if timings:  # the server's own per-response counts of the measured requests (not the warm-up's)
            row.update(server_timings=timings, **counters_check(delta, timings))
        steps = None if endpoint else decode_steps(done)
        emitted, tps, source = emitted_figures(done, steps, p["method"], p.get("k"), row.get("spec_accepted_tokens"))
        if emitted is None and p["method"] != "none" and not endpoint:
            row["spec_note"] = ("the token times do not group a request's tokens by engine step (or disagree with "
                                "the engine's counters): tokens per step from the counters, no per-request counts")
        info = engine.kv_cache_info()
        row.update(
            method=p["method"], k=p.get("k"), draft=p.get("draft"), content=p["content"],
            content_source=self.content(p["content"], ctx, p.get("dataset")).source,
            content_digest=self.content(p["content"], ctx, p.get("dataset")).digest,
            concurrency=b, load_mode="closed", tokens_per_step=tps, tokens_per_step_source=source,
            measured_output_tokens=row["total_output_tokens"],
            prompts_sha256=prompts_digest(reqs),
            request_output_ids={t.request_id: t.token_ids for t in done},  # a failed request: not compared
            request_tpot_s={t.request_id: t.tpot_s for t in done if t.tpot_s is not None},
            accepted_per_request=emitted, accepted_per_request_counters=per_request, kv_info=info.to_dict(),
            **mem.row_fields(),
            **kv_memory_fields(info, peak=True))
        if p["method"] != "none" and delta is None:
            row["spec_note"] = "the engine reported no speculative-decoding counters for this point"
        elif p["method"] != "none" and not delta["drafts"]:  # type: ignore[index]
            row["spec_note"] = "the engine proposed no draft during this point (n-gram lookup found no match?)"
        return row

    def _serve(self, engine: Engine, reqs: list[Request], concurrency: int, endpoint: bool,
               per_request_stats: bool = False
               ) -> tuple[list[RequestTrace], dict[str, int] | None, dict[str, Any] | None]:
        """Serve `reqs` in a closed loop at `concurrency`: (traces, accepted tokens per request
        from the engine's counters read as each request ends - only at concurrency 1, where one
        request runs at a time, and only in-process; a server's own per-response timings of
        these requests summed, where it sends them)."""
        if endpoint:
            out = engine.serve_load(reqs, closed=True, concurrency=concurrency)
            return out["traces"], None, out.get("server_timings")
        start = now_ns() + 5_000_000
        source = ClosedLoopSource(reqs, start, concurrency)
        collector = Collector(reqs, start, source)
        expected = {r.request_id: r.max_new_tokens for r in reqs}
        per_request: dict[str, int] = {}
        last = _stats(engine) if per_request_stats else None
        events = engine.serve(source, start)
        try:
            for ev in events:
                collector.feed(ev)
                tr = collector.trace(ev.request_id)
                if per_request_stats and (tr.error or tr.n_out >= expected[ev.request_id]):
                    # the next request is admitted only after this (closed loop, concurrency 1)
                    now = _stats(engine)
                    per_request[ev.request_id] = int((now or {}).get("accepted_tokens") or 0) - \
                        int((last or {}).get("accepted_tokens") or 0)
                    last = now
        finally:
            events.close()
        return collector.traces(), (per_request or None) if per_request_stats else None, None

    # ---- completing a row (harness) -----------------------------------------------------
    def _baseline_row(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        want = baseline_params(row.get("point") or {})
        return next((r for r in reversed(rows) if r.get("engine") == row.get("engine")
                     and r.get("workload") == self.name and r.get("point") == want), None)

    def finalize_row(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """Speed-up and the lossless check against the same engine's row without speculation
        (same point, same requests, same run). Fails closed: a speculative row whose baseline is
        missing, did not finish or recorded no outputs is `unverified`, never `ok`."""
        point = row.get("point") or {}
        if row.get("status") != "ok":
            return
        if point.get("method") == "none":
            row.update(lossless=BASELINE, lossless_detail="the engine without speculation: what the others are "
                       "compared with", speedup=None, speedup_ci=None)
            return
        base = self._baseline_row(row, rows)
        if base is None or base.get("status") != "ok":
            why = ("no row of this engine without speculation at this point (method none runs first: was it "
                   "left out of a resumed run?)" if base is None else
                   f"the row without speculation at this point is {base.get('status')}: "
                   f"{(base.get('error') or '').splitlines()[0] if base.get('error') else 'no reason given'}")
            self._unverified(row, why)
            return
        self._speedup(row, base)
        if base.get("prompts_sha256") != row.get("prompts_sha256"):
            self._unverified(row, f"its prompts ({row.get('prompts_sha256')}) are not those of the run without "
                                  f"speculation ({base.get('prompts_sha256')})")
            return
        result = lossless(base.get("request_output_ids"), row.get("request_output_ids"),
                          f"{row['engine']} without speculation")
        row.update(result.fields())
        self._good_requests(row, lossless_passed(base.get("request_output_ids"), row.get("request_output_ids"),
                                                 result.verdict))
        if result.verdict == FAIL:
            row["status"], row["error"] = "failed", f"lossless check failed: {result.detail}"
        elif result.verdict == UNVERIFIED:
            row["status"], row["error"] = "unverified", f"lossless check could not compare: {result.detail}"

    def _unverified(self, row: dict[str, Any], why: str) -> None:
        row.update(lossless=UNVERIFIED, lossless_detail=why, lossless_requests=0, lossless_tokens=0,
                   lossless_mismatch=None)
        self._good_requests(row, [])
        row["status"], row["error"] = "unverified", f"lossless check could not compare: {why}"

    @staticmethod
    def _good_requests(row: dict[str, Any], passed: list[str]) -> None:
        """Only the requests that passed the lossless check are good (their tokens are what a cost
        per good million tokens counts; harness.core.cost)."""
        outputs = row.get("request_output_ids") or {}
        row.update(good_verdict="lossless check", good_requests=len(passed),
                   good_output_tokens=sum(len(outputs[r]) for r in passed),
                   good_input_tokens=len(passed) * int((row.get("point") or {}).get("prompt_len") or 0))

    def _speedup(self, row: dict[str, Any], base: dict[str, Any]) -> None:
        """TPOT without / with speculation: medians over the requests both rows completed, the
        interval a paired bootstrap over those requests (unpaired when fewer than 2 pairs)."""
        import numpy as np

        from harness.core.bootstrap import paired_ratio_ci, ratio_ci
        on, off = row.get("request_tpot_s") or {}, base.get("request_tpot_s") or {}
        pairs = [rid for rid in off if rid in on and off[rid] and on[rid]]
        row["baseline_tpot_s"] = base.get("tpot_s")
        if len(pairs) >= 2:
            a, b = [off[r] for r in pairs], [on[r] for r in pairs]
            row["speedup"] = float(np.median(a) / np.median(b))
            ci = paired_ratio_ci(a, b)
            row["speedup_pairing"] = "paired by request"
        elif off and on:
            a, b = list(off.values()), list(on.values())
            row["speedup"] = float(np.median(a) / np.median(b))
            ci = ratio_ci([a, b], lambda x, y: x / y)
            row["speedup_pairing"] = "unpaired"
        else:
            row["speedup"], ci, row["speedup_pairing"] = None, None, None
        row["speedup_pairs"] = len(pairs)
        row["speedup_ci"] = list(ci) if ci else None

    def run_problems(self, rows: list[dict[str, Any]]) -> list[str]:
        """Fail closed over the run: speculative points were planned but not one of them passed the
        lossless check (every one skipped - no engine here speculates -, failed or unverified)."""
        spec = [r for r in rows if (r.get("point") or {}).get("method") not in (None, "none")]
        if not spec or any(r.get("lossless") == "pass" for r in spec):
            return []
        why = sorted({f"{r['engine']}: {(r.get('error') or r.get('status') or '').splitlines()[0]}" for r in spec})
        return [f"speculative: the lossless check verified no speculative point ({len(spec)} planned; "
                + "; ".join(why[:4]) + (" ..." if len(why) > 4 else "") + ")"]

    # ---- the terminal summary -----------------------------------------------------------
    def post_summary(self, rows: list[dict[str, Any]]) -> str:
        mine = [r for r in rows if r.get("workload") == self.name]
        lines = []
        spec_rows = [r for r in mine if (r.get("point") or {}).get("method") not in (None, "none")
                     and r.get("status") in ("ok", "failed", "unverified")]
        if spec_rows:
            by = {v: sum(1 for r in spec_rows if r.get("lossless") == v) for v in ("pass", "fail", "unverified")}
            lines.append(f"lossless: {by['pass']} speculative point(s) token-for-token identical to the engine without "
                         f"speculation, {by['fail']} different, {by['unverified']} not compared")
            for r in spec_rows:
                if r.get("lossless") in (FAIL, UNVERIFIED):
                    lines.append(f"  {r['engine']} {r['point'].get('method')} k={r['point'].get('k')} batch "
                                 f"{r['point'].get('batch_size')} {r['point'].get('content')}: {r.get('lossless_detail')}")
        for g in accepted_agreement(mine):
            share = g["identical_share"]
            lines.append(f"accepted tokens per request, {g['method']} k={g['k']} {g['content']} at batch 1: "
                         f"{g['identical']}/{g['requests']} requests identical on {', '.join(g['engines'])}"
                         + ("" if share is None else f" ({share:.0%})")
                         + ("" if g["first_difference"] is None else f"; first difference {g['first_difference']}"))
        notes = sorted({r["spec_note"] for r in mine if r.get("spec_note")})
        lines += [f"note: {n}" for n in notes]
        return "\n".join(lines)

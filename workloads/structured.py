"""Structured output: a share of the requests carries a constraint (a JSON schema, a regex, a
choice list, a grammar), and every constrained reply is validated (docs/metrics.md, "Structured
output").

The grid is constraint kind x share (0 to 1, the requests that carry their constraint). Request
i of a kind has the same prompt at every share (its constraint's prompt, tokenised with the
model's tokenizer); which requests carry their constraint is a fixed draw (seeded by the run's
seed), the first round(share x n) of one permutation. Each point serves its requests through the
engine's `serve()` in a closed loop at `concurrency`, after a warm-up round that sends every
constraint of the kind once (so the point measures cached grammars; the compile cost has a point
of its own). A constrained request stops at a complete reply (the end-of-sequence token, not
ignored); a free one has its length forced as everywhere else.

Every reply is judged against its request's constraint (harness.core.constraints.Validator):
conforming, truncated (stopped at max tokens on a valid prefix), non-conforming, unparseable -
the constrained replies in the row's `structured_*` counts, the free ones in `free_*` (what the
model writes without the constraint, on the same prompts). The text judged is the tokenizer's
decoding of the reply's token ids, special tokens left out; the server's own text where it sends no
ids (trtllm-serve).

In the harness's process each row with a share > 0 is completed against the same engine's
share-0 row of the kind (`finalize_row`):
- overhead: TPOT and output tok/s with the constraints over without (`tpot_ratio`,
  `output_tok_s_ratio`), the same prompts;
- "constraint applied": among the requests whose free reply did not conform, the constrained
  reply must conform (or be truncated on a valid prefix). If none does, the row fails with
  "constraint not applied" (a server that ignores the field answers with free text: vllm#53975);
  if some constrained reply does not conform, the row fails naming how many. Where every free
  reply conformed already the check cannot tell, and says so.

The compile point (`compile_cost: true`) sends, one request at a time, each JSON schema of the
dataset made new to the engine (a `$comment` nonce: the same constraint, a string no cache has
seen), then the same schema again after the prefix cache was reset: first-request TTFT with a
new schema against a cached one, and their paired difference (`compile_cost_s`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from adapters.base import Capabilities, Engine, Request, now_ns
from harness.core.constraints import KINDS, Constraint, Validator, load_constraints, tally
from harness.core.errors import UserError
from harness.core.metrics import RequestTrace, good_fields, serving_metrics
from harness.core.schema import spec
from harness.core.stats import summarize
from workloads.base import Collector, Point, RunContext, Workload
from workloads.serving import ClosedLoopSource

WORKLOAD = "structured"
GOOD = ("conforming", "truncated")
DEFAULT_PROMPT = "Answer in the requested format."


@dataclass
class StructuredConfig:
    name: str = spec(WORKLOAD)
    kinds: list[str] = spec(["json", "regex", "choice"], choices=KINDS, nonempty=True,
                            help="constraint kinds measured: json (schema), regex, choice (list), grammar (EBNF)")
    shares: list[float] = spec([0.0, 1.0], nonempty=True,
                               help="shares of requests (0 to 1) that carry their constraint, one point each; 0 is "
                                    "always measured (the free replies and the overhead's baseline)")
    dataset: str = spec("shipped", help="shipped (schemas of three sizes, regexes, choices, grammars made here), a "
                                        "JSONL of constraints, or hf:ORG/NAME[/FILE] in json-mode-eval's format")
    num_requests: int = spec(12, ge=1, help="requests per point")
    concurrency: int = spec(4, ge=1, help="requests in flight (closed loop)")
    output_len: int = spec(96, ge=2, help="max tokens of a reply (a constrained one stops at its end)")
    disable_any_whitespace: bool = spec(True, help="JSON without free whitespace between tokens (vLLM's option of "
                                                  "that name; a small model spends its tokens on newlines otherwise)")
    compile_cost: bool = spec(True, help="measure first-request TTFT with a new JSON schema against the same schema "
                                         "cached (a point of its own)")
    compile_schemas: int = spec(4, ge=1, help="compile point: new schemas sent (one request each, then again cached)")
    compile_output_len: int = spec(8, ge=1, help="compile point: max tokens of its requests (TTFT is what it times)")


class Structured(Workload):
    name = WORKLOAD
    config_cls = StructuredConfig
    compared_metrics = ("tpot_s", "output_tok_s")
    summary_columns = [
        ("kind", "kind", "s"), ("share", "share", ".2f"), ("structured_conforming", "conform", "d"),
        ("structured_truncated", "trunc", "d"), ("structured_non_conforming", "non-conf", "d"),
        ("structured_unparseable", "unparse", "d"), ("free_conforming", "free conf", "d"),
        ("tpot_s", "TPOT ms", "ms"), ("output_tok_s", "out tok/s", ".1f"), ("tpot_ratio", "TPOT x", ".2f"),
        ("constraint_applied", "applied", "s"), ("compile_ttft_new_s", "TTFT new ms", "ms"),
        ("compile_ttft_cached_s", "TTFT cached ms", "ms"), ("compile_cost_s", "compile ms", "ms"),
    ]

    def __init__(self) -> None:
        self._constraints: dict[tuple[str, str], list[Constraint]] = {}
        self._tok: Any = None
        self.validator = Validator()

    # ---- the plan (harness) -----------------------------------------------------------------
    def check(self, cfg: StructuredConfig, shape: Any) -> list[str]:
        problems = [f"workload.shares: {s} is outside [0, 1]: a share is the fraction of requests that carry a "
                    "constraint; give values from 0 to 1." for s in cfg.shares if not 0.0 <= float(s) <= 1.0]
        try:
            cs = load_constraints(cfg.dataset, tuple(cfg.kinds))
        except UserError as e:
            return problems + e.problems
        missing = [k for k in cfg.kinds if not any(c.kind == k for c in cs)]
        if missing:
            problems.append(f"workload.kinds: {', '.join(missing)} has no constraint in workload.dataset="
                            f"{cfg.dataset}. Leave it out of workload.kinds, or give a dataset that has some.")
        if cfg.compile_cost and not any(c.kind == "json" for c in cs):
            problems.append(f"workload.compile_cost=true: workload.dataset={cfg.dataset} has no JSON schema to compile "
                            "(with the kinds asked for). Set compile_cost=false or add json to workload.kinds.")
        return problems + super().check(cfg, shape)

    def plan(self, cfg: StructuredConfig) -> list[Point]:
        base = {"dataset": cfg.dataset, "num_requests": cfg.num_requests, "concurrency": cfg.concurrency,
                "output_len": cfg.output_len, "disable_any_whitespace": cfg.disable_any_whitespace}
        shares = sorted({0.0} | {float(s) for s in cfg.shares})
        points = [Point(self.name, {"kind": k, "share": s, **base}) for k in dict.fromkeys(cfg.kinds) for s in shares]
        if cfg.compile_cost:
            points.append(Point(self.name, {"kind": "json", "compile": True, "dataset": cfg.dataset,
                                            "num_schemas": cfg.compile_schemas, "output_len": cfg.compile_output_len,
                                            "disable_any_whitespace": cfg.disable_any_whitespace}))
        return points

    def max_model_len(self, cfg: StructuredConfig) -> int:
        return 512 + max(cfg.output_len, cfg.compile_output_len)

    def max_prefill_batch(self, cfg: StructuredConfig) -> tuple[int, int]:
        return cfg.concurrency, cfg.concurrency * 512

    # ---- in the engine's process ------------------------------------------------------------
    def unsupported(self, point: Point, caps: Capabilities) -> str | None:
        p = point.params
        if (p.get("share") or p.get("compile")) and p["kind"] not in caps.structured_output:
            can = ", ".join(caps.structured_output) or "none"
            return f"the engine takes no {p['kind']} constraint (structured output: {can})"
        return None

    def engine_overrides(self, point: Point, caps: Capabilities) -> dict[str, Any]:
        # an engine that must prepare for constraints (vLLM loads its tokenizer) does so at every
        # point, share 0 included: the overhead compares the same engine
        return {"structured_output": True} if "structured_output" in caps.options else {}

    def constraints(self, dataset: str, kind: str) -> list[Constraint]:
        if (dataset, kind) not in self._constraints:
            self._constraints[(dataset, kind)] = load_constraints(dataset, (kind,))
        return self._constraints[(dataset, kind)]

    def tokenizer(self, ctx: RunContext) -> Any:
        if self._tok is None:
            from transformers import AutoTokenizer
            self._tok = AutoTokenizer.from_pretrained(ctx.model_path)
        return self._tok

    def _prompt_ids(self, c: Constraint, ctx: RunContext) -> list[int]:
        ids = self.tokenizer(ctx)(c.prompt or DEFAULT_PROMPT, add_special_tokens=False)["input_ids"][:512]
        if not ids:
            raise ValueError(f"constraint {c.name}: its prompt is empty after tokenization")
        return list(ids)

    def requests(self, p: dict[str, Any], ctx: RunContext) -> tuple[list[Request], dict[str, Constraint]]:
        """The point's requests (request i: constraint i mod the kind's count) and each one's
        constraint; the constrained ones carry it (Request.constraint)."""
        cs = self.constraints(p["dataset"], p["kind"])
        n = p["num_requests"]
        chosen = set(np.random.default_rng(ctx.seed).permutation(n)[:round(p["share"] * n)].tolist())
        reqs, of = [], {}
        for i in range(n):
            c = cs[i % len(cs)]
            rid = f"r{i}"
            of[rid] = c
            reqs.append(Request(rid, self._prompt_ids(c, ctx), p["output_len"],
                                constraint=c.to_request(p["disable_any_whitespace"]) if i in chosen else None))
        return reqs, of

    def _serve(self, engine: Engine, reqs: list[Request], concurrency: int) -> tuple[list[RequestTrace], dict[str, str]]:
        """Closed loop at `concurrency` through serve(): (traces, text the engine sent per request)."""
        start = now_ns() + 2_000_000
        source = ClosedLoopSource(reqs, start, concurrency)
        collector = Collector(reqs, start, source)
        texts: dict[str, str] = {}
        events = engine.serve(source, start)
        try:
            for ev in events:
                collector.feed(ev)
                if getattr(ev, "text", None) is not None:
                    texts[ev.request_id] = ev.text
        finally:
            events.close()
        return collector.traces(), texts

    def _text(self, tr: RequestTrace, texts: dict[str, str], ctx: RunContext) -> str:
        """The reply judged: its token ids decoded, special tokens left out (the stop token too:
        vLLM's text skips it, infer-bench-serve's keeps it); the server's text where it sent no ids."""
        if tr.token_ids and all(t >= 0 for t in tr.token_ids):
            return self.tokenizer(ctx).decode(tr.token_ids, skip_special_tokens=True)
        if tr.request_id in texts:
            return texts[tr.request_id]
        raise RuntimeError(f"request {tr.request_id}: the engine returned neither token ids nor text")

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: StructuredConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        p = point.params
        if p.get("compile"):
            return self._compile_point(engine, p, ctx)
        reqs, of = self.requests(p, ctx)
        if p["share"] > 0:  # warm-up: every constraint of the kind once, so the point measures cached grammars
            warm = [Request(f"w{i}", self._prompt_ids(c, ctx), p["output_len"],
                            constraint=c.to_request(p["disable_any_whitespace"]))
                    for i, c in enumerate(self.constraints(p["dataset"], p["kind"]))]
            self._serve(engine, warm, p["concurrency"])
        sampler = ctx.sampler().start()
        traces, texts = self._serve(engine, reqs, p["concurrency"])
        mem = sampler.stop()
        row = serving_metrics(traces)
        if not row["completed"]:
            raise RuntimeError(f"no request of the point completed: {row['failed_request_reasons']}")
        constrained = {r.request_id for r in reqs if r.constraint is not None}
        verdicts, why, lengths = {}, {}, {}
        for tr in traces:
            if tr.error or not tr.token_times_ns:
                continue
            hit = tr.n_out >= p["output_len"]
            verdicts[tr.request_id], reason = self.validator.verdict(of[tr.request_id], self._text(tr, texts, ctx), hit)
            lengths[tr.request_id] = tr.n_out
            if reason and tr.request_id in constrained and verdicts[tr.request_id] not in GOOD:
                why[tr.request_id] = reason
        mine = [v for r, v in verdicts.items() if r in constrained]
        free = [v for r, v in verdicts.items() if r not in constrained]
        # good: a free request, or a constrained one whose reply passed (harness.core.cost counts these)
        passed = {r for r, v in verdicts.items() if r not in constrained or v in GOOD}
        row.update(good_fields([t for t in traces if t.request_id in verdicts], None, passed, "structured-output check"))
        row.update({f"structured_{k}": v for k, v in tally(mine).items()})
        row.update({f"free_{k}": v for k, v in tally(free).items()})
        row.update(kind=p["kind"], share=p["share"], concurrency=p["concurrency"], load_mode="closed",
                   constrained_requests=len(constrained), request_verdicts=verdicts,
                   request_constrained=sorted(constrained), request_output_tokens=lengths,
                   structured_failures=dict(list(why.items())[:5]),
                   constraint_names=sorted({c.name for c in of.values()}),
                   disable_any_whitespace=p["disable_any_whitespace"], **mem.row_fields())
        return row

    def _compile_point(self, engine: Engine, p: dict[str, Any], ctx: RunContext) -> dict[str, Any]:
        cs = [c for c in self.constraints(p["dataset"], "json")]
        nonce = uuid.uuid4().hex[:12]
        new, cached = [], []
        for i in range(p["num_schemas"]):
            c = cs[i % len(cs)].with_nonce(f"{nonce}-{i}")
            ttft = []
            for rep in range(2):
                engine.reset_prefix_cache()  # the second request must not find its prompt cached
                r = Request(f"c{i}-{rep}", self._prompt_ids(c, ctx), p["output_len"],
                            constraint=c.to_request(p["disable_any_whitespace"]))
                (tr,), _ = self._serve(engine, [r], 1)
                if tr.error or not tr.token_times_ns:
                    raise RuntimeError(f"compile point: request {r.request_id} failed: {tr.error or 'no token'}")
                ttft.append(tr.ttft_s)
            new.append(ttft[0])
            cached.append(ttft[1])
        diffs = [a - b for a, b in zip(new, cached)]
        return {"kind": "json", "compile": True, "num_requests": 2 * len(new), "completed": 2 * len(new),
                "compile_ttft_new_s": float(np.median(new)), "compile_ttft_cached_s": float(np.median(cached)),
                "compile_cost_s": float(np.median(diffs)), "compile_cost_s_samples": diffs,
                "compile_ttft_new_s_samples": new, "compile_ttft_cached_s_samples": cached,
                "compile_cost_s_p90": summarize(diffs)["p90"], "disable_any_whitespace": p["disable_any_whitespace"]}

    # ---- completing a row (harness) ---------------------------------------------------------
    def _baseline(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        want = {**(row.get("point") or {}), "share": 0.0}
        return next((r for r in reversed(rows) if r.get("engine") == row.get("engine")
                     and r.get("workload") == self.name and r.get("point") == want), None)

    def finalize_row(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """Overhead and the "constraint applied" check against the share-0 row (module docstring)."""
        point = row.get("point") or {}
        if row.get("status") != "ok" or point.get("compile") or not point.get("share"):
            return
        verdicts = row.get("request_verdicts") or {}
        mine = [r for r in row.get("request_constrained") or [] if r in verdicts]
        bad = [r for r in mine if verdicts[r] not in GOOD]
        base = self._baseline(row, rows)
        if base is not None and base.get("status") == "ok":
            for m, ratio in (("tpot_s", "tpot_ratio"), ("output_tok_s", "output_tok_s_ratio"), ("ttft_s", "ttft_ratio")):
                if row.get(m) and base.get(m):
                    row[ratio] = row[m] / base[m]
            row["baseline_tpot_s"], row["baseline_output_tok_s"] = base.get("tpot_s"), base.get("output_tok_s")
            free = base.get("request_verdicts") or {}
            free_bad = [r for r in mine if r in free and free[r] not in GOOD]
            fixed = [r for r in free_bad if verdicts[r] in GOOD]
            row.update(constraint_check_requests=len(free_bad), constraint_check_fixed=len(fixed))
            if free_bad and not fixed:
                row.update(constraint_applied="no", status="failed", error=(
                    f"constraint not applied: on the same {len(free_bad)} prompt(s) whose free reply does not conform, "
                    f"the constrained replies conform no better ({len(bad)} of {len(mine)} constrained replies do not "
                    f"conform; e.g. {next(iter((row.get('structured_failures') or {}).values()), '?')}). The engine "
                    "ignored the constraint field?"))
                return
            if not free_bad:
                row["constraint_applied"] = "cannot tell"
                row["constraint_note"] = ("every free reply conformed already on these prompts: the check cannot tell "
                                          "a constraint applied from one ignored")
            else:
                row["constraint_applied"] = "yes"
        else:
            row["constraint_applied"] = "unverified"
            row["constraint_note"] = "no share-0 row of this engine and kind to compare with"
        if bad:
            row.update(status="failed", error=f"{len(bad)} of {len(mine)} constrained replies do not conform: "
                       + "; ".join(f"{r}: {w}" for r, w in list((row.get("structured_failures") or {}).items())[:3]))

    def run_problems(self, rows: list[dict[str, Any]]) -> list[str]:
        mine = [r for r in rows if r.get("workload") == self.name and (r.get("point") or {}).get("share")]
        if mine and not any(r.get("status") == "ok" for r in mine):
            return [f"structured: no constrained point passed ({len(mine)} planned: "
                    + "; ".join(sorted({f"{r['engine']}: {(r.get('error') or r.get('status') or '').splitlines()[0]}"
                                        for r in mine})[:4]) + ")"]
        return []

    def post_summary(self, rows: list[dict[str, Any]]) -> str:
        mine = [r for r in rows if r.get("workload") == self.name]
        lines = [f"note: {r['engine']} {r.get('kind')} share {r.get('share')}: {r['constraint_note']}"
                 for r in mine if r.get("constraint_note")]
        return "\n".join(sorted(set(lines)))

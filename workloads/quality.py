"""Quality beside speed: what a dtype or a quantised KV cache costs in next-token quality, measured
on real text with a trained model (model=tiny-trained; docs/metrics.md, "Quality").

For every KV dtype the engine has (auto, int8, fp8), one point: the engine scores fixed windows
of the checkpoint's held-out text (heldout.npy, written by harness.core.train) teacher-forced -
every position predicted from the true tokens before it - with the KV cache filled in chunks of
`chunk` tokens (engines whose per-step token budget is an option: the reference engine, vLLM), so
the positions after the first chunk read their context back from the (quantised) cache, as decode
steps do. The row has the perplexity of the actual tokens and, against the baseline (the
reference engine's float32 scores of the same windows with its KV cache in float32), the top-1
agreement and the mean KL; each also over the long-context positions (`long_from` and later in
every window), where KV error accumulates. Beside them: the KV cache's bytes per token and a
short decode's output tokens/s at the same settings.

The baseline comes from a float32 run (`dtype=float32`, the reference engine among the engines,
kv_dtype auto); its scores are kept in the model cache (`.quality/`), so a later bfloat16 run of
the same windows compares against them. A row without a baseline says so in `quality_note`.
Engines that cannot return log-probabilities are skipped with the reason.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adapters.base import Capabilities, Engine
from harness.core.kvcalc import bytes_per_token, kv_dtype_of
from harness.core.paths import model_cache_dir
from harness.core.quality import compare, median_margin, perplexity
from harness.core.schema import spec
from harness.core.train import HELDOUT_FILE, eval_windows
from workloads.base import Point, RunContext, Workload

WORKLOAD = "quality"
BASELINE_ENGINE = "reference"
BASELINE_DTYPE = "float32"
KNOWN_KV = ("fp32", "float32", "fp16", "float16", "bf16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8",
            "q8_0", "q4_0")  # the last two: llama.cpp's block types


@dataclass
class QualityConfig:
    name: str = spec(WORKLOAD)
    kv_dtypes: list[str] = spec(["auto", "int8", "fp8"], nonempty=True,
                                help="KV-cache dtypes to score (auto = the model's dtype); each engine runs those it has")
    windows: int = spec(16, ge=1, le=256, help="held-out windows scored (evenly spread over the held-out text)")
    window_len: int = spec(512, ge=8, help="tokens per window (the trained preset was trained on windows this long)")
    long_from: int = spec(384, ge=1, help="window positions from here on are the long-context ones")
    chunk: int = spec(256, ge=1, help="KV filled this many tokens per step while scoring (engines with a step budget)")
    top_k: int = spec(8, ge=2, le=20, help="log-probabilities kept per position (vLLM returns at most 20)")
    decode_batch: int = spec(4, ge=1, help="sequences of the short decode that measures output tokens/s")
    decode_prompt_len: int = spec(64, ge=1, help="their prompt length (decode_batch x this must fit in chunk)")
    decode_steps: int = spec(32, ge=1, help="decode steps timed")


def _heldout(model_path: str) -> np.ndarray:
    path = Path(model_path) / HELDOUT_FILE
    if not path.is_file():
        raise ValueError(f"{model_path} has no held-out text ({HELDOUT_FILE}): the quality workload needs a "
                         "checkpoint trained here (model=tiny-trained, or infer-bench-model --train)")
    return np.load(path)


def windows_of(model_path: str, n: int, length: int) -> list[list[int]]:
    return [list(map(int, w)) for w in eval_windows(_heldout(model_path), length, n)]


def _model_digest(model_path: str) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors", HELDOUT_FILE):
        p = Path(model_path) / name
        h.update(name.encode() + b"\0" + (p.read_bytes() if p.is_file() else b"") + b"\0")
    return h.hexdigest()


def baseline_file(model_path: str, params: dict[str, Any], cache: Path | None = None) -> Path:
    """Where the baseline's scores of these windows of this checkpoint are kept."""
    key = json.dumps({"model": _model_digest(model_path), "windows": params["windows"],
                      "window_len": params["window_len"], "top_k": params["top_k"]}, sort_keys=True)
    return (cache or model_cache_dir(None)) / ".quality" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json.gz"


def is_baseline(row: dict[str, Any]) -> bool:
    return (row.get("engine") == BASELINE_ENGINE and row.get("dtype") == BASELINE_DTYPE
            and (row.get("point") or {}).get("kv_dtype") == "auto" and row.get("status") == "ok")


class Quality(Workload):
    name = WORKLOAD
    config_cls = QualityConfig
    summary_columns = [
        ("kv_dtype", "kv dtype", "s"), ("kv_bytes_per_token", "KV B/token", "d"),
        ("output_tok_s", "out tok/s", ".1f"), ("quality_perplexity", "ppl", ".3f"),
        ("quality_delta_perplexity", "Δppl", "+.4f"), ("quality_top1_agreement", "top-1 agree", ".4f"),
        ("quality_mean_kl", "mean KL", ".2e"), ("quality_perplexity_long", "ppl long", ".3f"),
        ("quality_top1_agreement_long", "top-1 long", ".4f"), ("quality_mean_kl_long", "KL long", ".2e"),
    ]
    baseline_cache: Path | None = None  # tests point it elsewhere; None: the model cache

    def check(self, cfg: QualityConfig, shape: Any) -> list[str]:
        problems = []
        if shape.train is None and shape.hf_architecture is None:
            problems.append(f"model={shape.name}: the quality workload needs a model trained here (random weights "
                            "have no quality to lose). Use model=tiny-trained (or small-trained), or model=local "
                            "model.path=DIR with a checkpoint from infer-bench-model --train.")
        if cfg.long_from >= cfg.window_len:
            problems.append(f"workload.long_from={cfg.long_from}: must be below workload.window_len={cfg.window_len}.")
        if cfg.decode_batch * cfg.decode_prompt_len > cfg.chunk:
            problems.append(f"workload.decode_batch x workload.decode_prompt_len = "
                            f"{cfg.decode_batch * cfg.decode_prompt_len} tokens: more than workload.chunk={cfg.chunk} "
                            "(the short decode's prefill must fit in one step). Lower them or raise chunk.")
        problems += [f"workload.kv_dtypes: unknown KV dtype '{d}'. Use auto, int8 or fp8 (or fp16/bf16/fp32; "
                     "llama.cpp's q8_0, q4_0)."
                     for d in cfg.kv_dtypes if d != "auto" and d.lower() not in KNOWN_KV]
        return problems or super().check(cfg, shape)

    def plan(self, cfg: QualityConfig) -> list[Point]:
        return [Point(self.name, {"kv_dtype": d, "windows": cfg.windows, "window_len": cfg.window_len,
                                  "long_from": cfg.long_from, "chunk": cfg.chunk, "top_k": cfg.top_k})
                for d in dict.fromkeys(cfg.kv_dtypes)]

    def max_model_len(self, cfg: QualityConfig) -> int:
        # vLLM scores through generation and needs room for one more token
        return max(cfg.window_len + 1, cfg.decode_prompt_len + cfg.decode_steps + 1)

    def max_prefill_batch(self, cfg: QualityConfig) -> tuple[int, int]:
        return cfg.decode_batch, cfg.decode_batch * cfg.decode_prompt_len

    def unsupported(self, point: Point, caps: Capabilities) -> str | None:
        if not caps.scores:
            return ("the engine cannot return log-probabilities (no teacher-forced scores), so its quality "
                    "cannot be measured")
        d = point.params["kv_dtype"]
        if d != "auto" and d not in caps.kv_dtypes:
            return f"the engine cannot store the KV cache as {d} (it supports {', '.join(caps.kv_dtypes)})"
        return None

    def engine_overrides(self, point: Point, caps: Capabilities) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if point.params["kv_dtype"] != "auto" or len(caps.kv_dtypes) > 1:
            out["kv_dtype"] = point.params["kv_dtype"]
        if "max_num_batched_tokens" in caps.options:
            out["max_num_batched_tokens"] = point.params["chunk"]
        return out

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: QualityConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        p = point.params
        windows = windows_of(ctx.model_path, p["windows"], p["window_len"])
        scores = engine.score(windows, [1] * len(windows), p["top_k"])
        packed = [{"top_ids": s.top_ids, "top_logprobs": [[round(v, 6) for v in lp] for lp in s.top_logprobs],
                   "target_logprobs": [round(v, 6) for v in s.target_logprobs]} for s in scores]
        # a short decode at the same settings: what the KV dtype costs or gains in speed
        prompts = [w[:cfg.decode_prompt_len] for w in windows[:cfg.decode_batch]]
        while len(prompts) < cfg.decode_batch:
            prompts.append(prompts[len(prompts) % len(windows)])
        pre = engine.prefill(prompts, max_new_tokens=cfg.decode_steps + 1)
        dec = engine.decode(cfg.decode_steps)
        info = engine.kv_cache_info()
        engine.release()
        step = float(np.median(dec.step_latencies_s))
        kv_dtype = kv_dtype_of(ctx.dtype, info.kv_dtype)
        return {
            "kv_dtype": kv_dtype, "kv_bytes_per_token": info.bytes_per_token,
            "kv_est_bytes_per_token": bytes_per_token(ctx.shape, kv_dtype),
            "quality_windows": len(windows), "quality_window_len": p["window_len"], "quality_long_from": p["long_from"],
            "quality_perplexity": perplexity(packed), "quality_perplexity_long": perplexity(packed, 1, p["long_from"]),
            "quality_margin_p50": median_margin(packed),
            "quality_scores": packed,
            "decode_batch": cfg.decode_batch, "decode_steps": cfg.decode_steps,
            "prefill_latency_s": pre.latency_s, "decode_step_latency_s": step,
            "decode_step_latency_s_samples": dec.step_latencies_s,
            "output_tok_s": cfg.decode_batch / step if step > 0 else None,
        }

    # ---- in the harness's process -------------------------------------------------------
    def finalize_row(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        scores = row.pop("quality_scores", None)
        if row.get("status") != "ok" or scores is None:
            return
        params = row.get("point") or {}
        path = baseline_file(row["model_path"], params, self.baseline_cache)
        if is_baseline(row):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{row.get('run_id', 'x')}.tmp")
            with gzip.open(tmp, "wt") as f:
                json.dump(scores, f)
            tmp.replace(path)
        try:
            with gzip.open(path, "rt") as f:
                base = json.load(f)
        except OSError:
            row["quality_baseline"] = None
            row["quality_note"] = (f"no baseline yet: run the quality workload with dtype={BASELINE_DTYPE} and the "
                                   f"{BASELINE_ENGINE} engine first (its float32 scores of these windows are kept in "
                                   f"{path.parent}); perplexity only")
            return
        row["quality_baseline"] = f"{BASELINE_ENGINE} {BASELINE_DTYPE} kv auto"
        row.update(compare(base, scores, 1, params.get("long_from")))
        row["quality_baseline_perplexity"] = perplexity(base)
        if row.get("quality_perplexity") is not None and row["quality_baseline_perplexity"]:
            row["quality_delta_perplexity"] = row["quality_perplexity"] - row["quality_baseline_perplexity"]

    def post_summary(self, rows: list[dict[str, Any]]) -> str:
        notes = sorted({r["quality_note"] for r in rows if r.get("workload") == self.name and r.get("quality_note")})
        return "\n".join(f"quality: {n}" for n in notes)

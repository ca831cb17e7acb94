"""LoRA adapters: what a PEFT directory holds, checked against the base model, and how the requests
of a point are assigned to adapters (docs/metrics.md, "LoRA adapters").

- **An adapter** is a PEFT LoRA directory: `adapter_config.json` (peft_type LORA, r, lora_alpha,
  target_modules) and `adapter_model.safetensors`, whose tensors are
  `base_model.model.model.layers.<i>.<block>.<module>.lora_A.weight` of shape [r, in] and
  `... .lora_B.weight` of shape [out, r]. `read_adapter` reads both (the tensors' shapes only,
  from the safetensors header) and `shape_problems` checks them against the base model's
  `ModelShape`: every module one of `MODULES`, its in/out sizes the model's, its layer one of the
  model's, its rank the config's r. What no engine here applies the same way (DoRA, a LoRA bias,
  modules saved whole, per-module ranks) is refused with the field and the fix.
- **The entries** of a split are the base model (`BASE`) and the adapters, in that order.
  `shares` gives each entry's configured probability: `uniform` and `round_robin` share equally,
  `zipf` by rank^-alpha (the list's order is the rank), `weighted` as given. A `base_share`
  takes that share for the base model and leaves the rest to the adapters; without one the base
  model is one more entry like an adapter (ranked first for zipf); 0 sends it nothing.
- **The assignment** (`assign`) of n requests: `round_robin` is deterministic (smooth weighted
  round robin: after i requests every entry has floor or ceil of share x i; equal shares cycle
  in order), the others draw with the given generator (seeded by the run's seed and the point,
  so every engine gets the same request -> adapter assignment).
- **The served split** (`split_test`): round robin must match its exact counts; a random split is
  tested with Pearson's chi-squared goodness of fit (scipy) against the configured shares.

Pure: numpy and the standard library here, safetensors and scipy imported where used (the
harness's process reads adapters and tests splits; a worker only assigns).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.core.shapes import ModelShape

BASE = "base"  # the base model's entry in splits and per-adapter rows (no adapter)
SPLITS = ("round_robin", "uniform", "weighted", "zipf")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections an adapter may target: those every engine here applies LoRA to (vLLM, transformers
# through PEFT, the reference engine), in LLaMA-style decoder layers
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION + MLP
SPLIT_ALPHA = 1e-3  # a random split's chi-squared p-value below this: the served split is not the configured one
TENSOR_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as read from its PEFT directory."""

    name: str
    path: str  # the local directory
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    source: str | None = None  # the reference as given (a Hub id with its commit), when not `path`

    @property
    def scaling(self) -> float:
        """What x·A·B is multiplied by: alpha / r (alpha / sqrt(r) with rsLoRA), as PEFT does."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def option(self) -> dict[str, Any]:
        """The engine option's entry (STANDARD_OPTIONS lora_adapters): name, directory, rank."""
        return {"name": self.name, "path": self.path, "rank": self.rank}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_refs(items: Any, field: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The adapters as given - a mapping {name: REF}, or a list of `name=REF` strings or {name, path}
    mappings, REF a PEFT directory or a Hub id ORG/NAME - as (name, ref) pairs in order; problems for
    a malformed entry, a bad or reserved name and a name used twice."""
    if items is None:
        return [], []
    if isinstance(items, dict):
        items = [{"name": str(k), "path": v} for k, v in items.items()]
    if not isinstance(items, (list, tuple)):
        return [], [f"{field}={items!r}: give the adapters as {{NAME: PATH, ...}} (PATH a PEFT directory or a Hub "
                     "id ORG/NAME), or a list of {name: .., path: ..}."]
    out: list[tuple[str, str]] = []
    problems: list[str] = []
    for i, item in enumerate(items):
        if isinstance(item, str) and "=" in item:
            name, ref = item.split("=", 1)
        elif isinstance(item, dict) and set(item) <= {"name", "path"} and item.get("name") and isinstance(item.get("path"), str):
            name, ref = str(item["name"]), str(item["path"])
        else:
            problems.append(f"{field}[{i}]={item!r}: give {{name: .., path: ..}} (path a PEFT directory or a Hub id "
                            "ORG/NAME), or name=PATH.")
            continue
        name, ref = name.strip(), ref.strip()
        if not _NAME.match(name) or name == BASE:
            why = f"'{BASE}' names the base model" if name == BASE else "use letters, digits, '_', '-' and '.'"
            problems.append(f"{field}[{i}]: adapter name '{name}': {why}. Rename it.")
            continue
        if not ref:
            problems.append(f"{field}[{i}]: adapter '{name}' has no path. Give name=PATH.")
            continue
        if any(name == n for n, _ in out):
            problems.append(f"{field}[{i}]: adapter name '{name}' is used twice. Give each adapter its own name.")
            continue
        out.append((name, ref))
    return out, problems


def read_adapter(name: str, path: str, field: str, source: str | None = None) -> tuple[Adapter | None, dict[str, list[int]], list[str]]:
    """The adapter in PEFT directory `path` and its tensors' shapes; problems where it is not a PEFT
    LoRA directory an engine here can apply."""
    d = Path(path).expanduser()
    where = f"{field}: adapter '{name}' ({source or path})"
    if not d.is_dir():
        return None, {}, [f"{where}: no such directory. Give a PEFT adapter directory (with {CONFIG_FILE} and "
                          f"{WEIGHTS_FILE}; infer-bench-lora make writes one) or a Hub id ORG/NAME."]
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (d / f).is_file()]
    if missing:
        other = sorted(p.name for p in d.glob("adapter_model.*"))
        hint = (f" (it has {', '.join(other)}: convert it to safetensors with PEFT's save_pretrained)" if other
                else " (config.json there instead: that is a model, not an adapter)" if (d / "config.json").is_file()
                else "")
        return None, {}, [f"{where}: not a PEFT adapter directory: {', '.join(missing)} missing{hint}. Give the "
                          "directory PEFT's save_pretrained wrote."]
    try:
        cfg = json.loads((d / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        return None, {}, [f"{where}: {CONFIG_FILE} is not JSON ({e}). Write it again with PEFT."]
    problems = []
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        problems.append(f"{where}: peft_type is {cfg.get('peft_type')!r}, not LORA. Give a LoRA adapter.")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        problems.append(f"{where}: r={r!r} in {CONFIG_FILE} must be a positive integer.")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        problems.append(f"{where}: lora_alpha={alpha!r} in {CONFIG_FILE} must be a number.")
    for key, what in (("use_dora", "DoRA"), ("lora_bias", "a LoRA bias")):
        if cfg.get(key):
            problems.append(f"{where}: {key}=true ({what}): the engines here apply plain LoRA only. Give a plain "
                            "LoRA adapter.")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication"):
        if cfg.get(key):
            problems.append(f"{where}: {key} is set in {CONFIG_FILE}: not applied alike by every engine here. "
                            f"Save the adapter without {key}.")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):  # a regular expression: the tensors say which modules it matched
        targets = None
    try:
        from safetensors import safe_open
        with safe_open(str(d / WEIGHTS_FILE), framework="numpy") as f:
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # a truncated or foreign file: safetensors says why
        return None, {}, problems + [f"{where}: {WEIGHTS_FILE} cannot be read ({type(e).__name__}: {e}). Write it "
                                     "again with PEFT."]
    modules = sorted({m.group(3) for k in shapes if (m := TENSOR_KEY.match(k))})
    if problems:
        return None, shapes, problems
    return Adapter(name, str(d.resolve()), int(r), float(alpha), tuple(targets or modules),
                   bool(cfg.get("use_rslora")), source), shapes, []


def module_sizes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA-able projection of the model's decoder layers."""
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_key_value_heads * shape.head_dim
    h, i = shape.hidden_size, shape.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def shape_problems(adapter: Adapter, shapes: dict[str, list[int]], shape: ModelShape, field: str) -> list[str]:
    """Problems of the adapter's tensors against the base model: modules it cannot apply, sizes or
    layers the model does not have, a rank other than r. The first few, then a count."""
    where = f"{field}: adapter '{adapter.name}' ({adapter.source or adapter.path})"
    if shape.kv_lora_rank or shape.linear_attention or shape.num_experts:
        return [f"{where}: the base model {shape.name} has latent, linear or expert layers; LoRA adapters are "
                "measured on dense models with standard attention here. Use a dense model (llama, qwen, mistral)."]
    sizes = module_sizes(shape)
    found: dict[tuple[int, str], dict[str, list[int]]] = {}
    out: list[str] = []
    for key, dims in shapes.items():
        m = TENSOR_KEY.match(key)
        if m is None:
            out.append(f"tensor {key}: not a LoRA A/B matrix of a decoder layer's projection")
            continue
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
        found.setdefault((layer, module), {})[ab] = dims
    for (layer, module), ab in sorted(found.items()):
        if module not in sizes:
            out.append(f"layer {layer} {module}: not one of {', '.join(MODULES)}")
            continue
        if layer >= shape.num_hidden_layers:
            out.append(f"layer {layer} {module}: the model has {shape.num_hidden_layers} layers")
            continue
        n_in, n_out = sizes[module]
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            out.append(f"layer {layer} {module}: lora_{'A' if a is None else 'B'} is missing")
            continue
        if a != [adapter.rank, n_in] or b != [n_out, adapter.rank]:
            out.append(f"layer {layer} {module}: lora_A {a} and lora_B {b}, the model needs [{adapter.rank}, {n_in}] "
                       f"and [{n_out}, {adapter.rank}] (r={adapter.rank})")
    if not found and not out:
        out.append(f"{WEIGHTS_FILE} holds no LoRA matrices")
    if not out:
        return []
    more = f" (and {len(out) - 3} more)" if len(out) > 3 else ""
    return [f"{where} does not fit the base model {shape.name}: {'; '.join(out[:3])}{more}. Give an adapter trained "
            f"for this model (infer-bench-lora make --model ... writes one)."]


# ---- splits ------------------------------------------------------------------------------------------------

def entries(names: list[str], base_share: float | None, split: str, weights: dict[str, float] | None) -> list[str]:
    """The entries of the split in order: the base model first (unless it gets nothing), then the adapters."""
    base = (weights or {}).get(BASE, 0.0) > 0 if split == "weighted" else base_share is None or base_share > 0
    return ([BASE] if base else []) + list(names)


def shares(names: list[str], split: str, base_share: float | None = None, weights: dict[str, float] | None = None,
           alpha: float = 1.0) -> dict[str, float]:
    """Each entry's configured probability (summing to 1)."""
    if split == "weighted":
        w = dict(weights or {})
        return {e: float(w.get(e, 0.0)) for e in entries(names, None, split, w)}
    if base_share is None:  # the base model is one more entry, ranked first
        items = [BASE] + list(names)
        rest, lead = 1.0, []
    else:
        items = list(names)
        rest, lead = 1.0 - base_share, ([(BASE, float(base_share))] if base_share > 0 else [])
    if split == "zipf":
        raw = np.array([(k + 1) ** -alpha for k in range(len(items))], dtype=float)
    else:
        raw = np.ones(len(items), dtype=float)
    p = raw / raw.sum() * rest if len(items) else raw
    return dict(lead + [(e, float(v)) for e, v in zip(items, p)])


def split_problems(names: list[str], split: str, base_share: float | None, weights: Any, field: str) -> list[str]:
    """A weighted split's weights against the adapters: known names, no negative share, summing to 1."""
    problems = []
    if split == "weighted":
        if not isinstance(weights, dict) or not weights:
            return [f"{field}.weights: split=weighted needs the shares, e.g. {field}.weights={{base: 0.2, "
                    f"{names[0] if names else 'a'}: 0.8}} (summing to 1)."]
        unknown = [k for k in weights if k not in names and k != BASE]
        if unknown:
            problems.append(f"{field}.weights: {', '.join(map(str, unknown))} is not an adapter of {field}.adapters "
                            f"(known: {', '.join([BASE] + names)}). Fix the name.")
        bad = [k for k, v in weights.items() if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0]
        if bad:
            problems.append(f"{field}.weights: {', '.join(map(str, bad))} must be a number >= 0.")
        elif not math.isclose(sum(weights.values()), 1.0, abs_tol=1e-6):
            problems.append(f"{field}.weights: the shares sum to {sum(weights.values()):.6g}, not 1. Make them sum "
                            f"to 1 (the base model's share included, as `{BASE}`).")
        if base_share is not None:
            problems.append(f"{field}.base_share: with split=weighted the base model's share is `{BASE}` in "
                            f"{field}.weights. Drop base_share.")
    elif weights:
        problems.append(f"{field}.weights: only split=weighted takes weights (split={split}). Drop them or use "
                        "split=weighted.")
    return problems


def assign(shares_: dict[str, float], split: str, n: int, rng: np.random.Generator) -> list[str]:
    """The entry of each of n requests."""
    names = [e for e, p in shares_.items() if p > 0]
    p = np.array([shares_[e] for e in names], dtype=float)
    if not names:
        return []
    if split == "round_robin":
        credit = np.zeros(len(names))
        out = []
        for _ in range(n):  # smooth weighted round robin: the entry furthest behind its share goes next
            credit += p
            k = int(np.argmax(credit))
            credit[k] -= 1.0
            out.append(names[k])
        return out
    return [names[int(k)] for k in rng.choice(len(names), size=n, p=p / p.sum())]


def expected_round_robin(shares_: dict[str, float], n: int) -> dict[str, int]:
    """The exact counts round robin gives n requests."""
    got = {e: 0 for e in shares_}
    for e in assign(shares_, "round_robin", n, np.random.default_rng(0)):
        got[e] += 1
    return got


def split_test(shares_: dict[str, float], served: dict[str, int], split: str, assigned: int | None = None,
               alpha: float = SPLIT_ALPHA) -> dict[str, Any]:
    """The served split against the configured one: exact counts for round robin (of `assigned`
    requests, default the served total), Pearson's chi-squared goodness of fit otherwise (reject at
    p < alpha). Entries with no configured share must serve nothing. {test, statistic, p_value,
    dof, ok, detail}."""
    total = sum(served.values())
    extra = {e: c for e, c in served.items() if c and shares_.get(e, 0.0) <= 0}
    if split == "round_robin":
        want = expected_round_robin(shares_, assigned if assigned is not None else total)
        diff = {e: (served.get(e, 0), w) for e, w in want.items() if served.get(e, 0) != w}
        diff.update({e: (c, 0) for e, c in extra.items()})
        detail = "; ".join(f"{e} served {s}, round robin gives {w}" for e, (s, w) in diff.items())
        return {"test": "exact", "statistic": None, "p_value": None, "dof": None, "ok": not diff,
                "detail": detail or f"every entry served its round-robin count of {assigned or total}"}
    live = [e for e, p in shares_.items() if p > 0]
    if total == 0 or len(live) < 2:
        ok = not extra and total > 0
        return {"test": "chi2", "statistic": None, "p_value": None, "dof": 0, "ok": ok,
                "detail": "nothing served" if total == 0 else "one entry: nothing to test"}
    from scipy import stats
    obs = np.array([served.get(e, 0) for e in live], dtype=float)
    exp = np.array([shares_[e] for e in live], dtype=float)
    exp = exp / exp.sum() * obs.sum()
    stat, p = stats.chisquare(obs, exp)
    ok = bool(p >= alpha) and not extra
    worst = max(live, key=lambda e: abs(served.get(e, 0) - shares_[e] / sum(shares_[x] for x in live) * total))
    detail = (f"chi-squared {stat:.3g} on {len(live) - 1} degrees of freedom, p = {p:.3g} "
              f"({'>=' if p >= alpha else '<'} {alpha:g}); furthest from its share: {worst} "
              f"{served.get(worst, 0)} of {total} for {shares_[worst]:.3f}")
    if extra:
        detail += "; served with no share: " + ", ".join(f"{e} {c}" for e, c in extra.items())
    return {"test": "chi2", "statistic": float(stat), "p_value": float(p), "dof": len(live) - 1, "ok": ok,
            "detail": detail}


def first_difference(expected: list[int], got: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts); None: equal."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))

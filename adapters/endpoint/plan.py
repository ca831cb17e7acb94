"""A launch plan: what the harness would run to start an endpoint's server, without running it.

`launch_plan(...)` renders the endpoint's command template with the run's values, adds what the
kind's record maps the engine options to (adapters/endpoint/kinds.py, `launch_extras`: arguments,
environment, an options file) and the server's own flags (`server_flags`), the chat template
for api=chat, and the run's threads; it says which settings differ from the server's defaults
and the settings a report compares across servers. Device-aware: the endpoint's cpu_launch /
cpu_env / cpu_options apply only with device=cpu; on a GPU the server keeps its own defaults.

`LaunchPlan.dry_run_text()` is what a dry run prints (endpoints.<name>.dry_run, and
`python -m adapters.endpoint`). Pure but for the free port and the model's config.json.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.base import ModelSpec
from adapters.endpoint.config import EndpointConfig, chat_template_text, template_fields
from adapters.endpoint.flags import overridden_standards
from adapters.endpoint.kinds import KINDS, LaunchContext, ServerKind
from adapters.endpoint.launch import free_port, render
from adapters.endpoint.options import SERVER_FLAGS, given, launch_extras
from harness.core.kvcalc import bytes_per_token, kv_dtype_of
from harness.core.presets import shape_from_hf_config
from harness.core.redact import Redactor


@dataclass
class LaunchPlan:
    """What a launch runs: the command, the environment it changes (None: a variable removed),
    the files written first (path -> text), the options the server was given, those that
    differ from its own defaults, and the settings a report compares across servers."""

    command: list[str]
    env: dict[str, str | None]
    files: dict[str, str]
    options_used: dict[str, Any]
    differing: dict[str, Any]
    settings: dict[str, Any]

    def dry_run_text(self, name: str, redactor: Redactor) -> str:
        """What a dry run of endpoint `name` prints: the command, its environment, the files it
        would write, the options that differ from the server's defaults (redacted)."""
        lines = [f"endpoint {name} (dry run, nothing started): {redactor.text(shlex.join(self.command))}"]
        for k, v in self.env.items():
            lines.append(f"  env {k}={'(removed)' if v is None else redactor.text(v)}")
        for path, text in self.files.items():
            lines.append(f"  file {path}:\n" + "\n".join("    " + x for x in text.rstrip().splitlines()))
        lines.append(f"  options differing from the server's defaults: {self.differing or 'none'}")
        return "\n".join(lines)

    def write_files(self) -> None:
        for path, text in self.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)


def launch_plan(name: str, cfg: EndpointConfig, model: ModelSpec, options: dict[str, Any], port: int | None,
                api_key: Callable[[], str | None]) -> LaunchPlan:
    """The plan of endpoint `name` (config `cfg`) for `model` with engine options `options` on
    `port` (None: a free one). `api_key()` is asked only where the template uses {api_key}."""
    kind = KINDS[cfg.kind]
    on_cpu = str(model.device) == "cpu"
    port = port if port is not None else free_port(cfg.host)
    served = cfg.served_model_name or model.name
    cpus = model.cpus or tuple(sorted(os.sched_getaffinity(0)))  # the server inherits this process's cores
    values = {"python": cfg.python or sys.executable, "model": model.path, "port": port, "host": cfg.host,
              "dtype": model.dtype, "max_model_len": model.max_model_len,
              "context_length": model.max_model_len + kind.context_margin, "served_model_name": served,
              "device": model.device, "threads": model.threads or len(cpus), "cpus": ",".join(map(str, cpus))}
    if "api_key" in template_fields(cfg.launch or [])[0]:
        values["api_key"] = api_key()
    used = {**kind.launch_defaults, **(cfg.cpu_options if on_cpu else {}), **given(options)}
    # a server flag overrides the defaults the harness would give the same setting (the run's own
    # standard options beside such a flag are refused by option_problems)
    for k in overridden_standards(kind.flags, options.get(SERVER_FLAGS) or {}) - set(given(options)):
        used.pop(k, None)
    beside = Path(model.run_dir) if model.run_dir else Path(tempfile.gettempdir())  # where files are written
    ctx = LaunchContext(options_file=str(beside / f"endpoint-{name}-llm-api-options.yaml"), dtype=model.dtype,
                        device=str(model.device), kv_bytes_per_token=lambda kv: _kv_bytes_per_token(model, kv),
                        metrics=cfg.metrics is not False)
    extras = launch_extras(cfg.kind, used, ctx)
    if cfg.api == "chat":  # the chat template the harness counts with is the one the server applies
        extras.args += list(kind.chat_args)
        text = chat_template_text(cfg)
        if text is not None and kind.chat_template_arg:
            tpl = str(beside / f"endpoint-{name}-chat-template.jinja")
            extras.files[tpl] = text
            extras.args.append(kind.chat_template_arg.format(tpl))
        if cfg.tool_call_parser is not None:
            extras.args += [a.format(cfg.tool_call_parser) for a in kind.tool_parser_args]
    command = render(cfg.launch or [], values) + (list(cfg.cpu_launch) if on_cpu else []) + extras.args
    if kind.threads_option and model.threads:  # equal resources: the run's threads, unless the template says
        flag = kind.threads_option.split("{")[0]
        if not any(a.startswith(flag) for a in command):
            command.append(kind.threads_option.format(model.threads))
    fmt = {k2: v2 for k2, v2 in values.items() if k2 != "api_key"}
    env: dict[str, str | None] = {**{k: str(v).format_map(fmt) for k, v in cfg.env.items()},
                                  **({k: str(v).format_map(fmt) for k, v in cfg.cpu_env.items()} if on_cpu else {}),
                                  **extras.env}
    return LaunchPlan(command, env, extras.files, used, differing_from_defaults(kind, used, command),
                      server_settings(kind, used, command))


def _kv_bytes_per_token(model: ModelSpec, kv_dtype: str = "auto") -> int | None:
    """The model's KV bytes per token (config.json) at the KV dtype (`auto`: the model's),
    for options given in bytes."""
    try:
        shape = shape_from_hf_config(model.path)
        return bytes_per_token(shape, kv_dtype_of(model.dtype, kv_dtype))
    except Exception:
        return None


def differing_from_defaults(kind: ServerKind, used: dict[str, Any], command: list[str]) -> dict[str, Any]:
    """Each setting the harness gave the server that is not the server's own default:
    {option: {"value", "default"}} (default: the kind's record, or "unknown"), plus
    graph capture turned off by a launch argument; a server flag (`server_flags`) by its own
    name, against the default its record states."""
    out: dict[str, Any] = {}
    for k, v in given(used).items():
        if k == SERVER_FLAGS:
            continue
        d = kind.defaults.get(k, "unknown")
        if v != d:
            out[k] = {"value": v, "default": d}
    decl = {f.name: f for f in kind.flags}
    for k, v in (used.get(SERVER_FLAGS) or {}).items():
        if v is not None and k in decl and v != decl[k].default:
            out[k] = {"value": v, "default": decl[k].default if decl[k].default is not None else "unknown",
                      "server_flag": True}
    eager = [a for a in command if a in kind.eager_flags]
    if eager:
        out["cuda_graphs"] = {"value": False, "default": True, "flag": eager[0]}
    return out


def server_settings(kind: ServerKind, used: dict[str, Any], command: list[str]) -> dict[str, Any]:
    """The settings a report compares across servers (eager vs graphs, memory share, chunked
    prefill, parallelism, batch limits) for the options the kind takes: on/off settings as they
    are in effect; the others as given, or "default" for the server's own (each server's own
    default is the fair setting; `options_differing_from_defaults` says what it is)."""
    out: dict[str, Any] = {}
    standard = {k: v for k, v in given(used).items() if k != SERVER_FLAGS}
    for f in kind.flags:  # a server flag that is a standard option's setting counts as that option
        if f.value_of and (used.get(SERVER_FLAGS) or {}).get(f.name) is not None:
            standard[f.value_of] = used[SERVER_FLAGS][f.name]
    for k in ("gpu_memory_utilization", "chunked_prefill", "tensor_parallel_size", "max_num_seqs",
              "max_num_batched_tokens", "kv_cache_bytes"):
        if k not in kind.options:
            continue
        v, d = standard.get(k), kind.defaults.get(k)
        if isinstance(d, bool):  # on/off: the effective value, whoever chose it
            out[k] = d if v is None else v
        else:  # servers each at their own default compare equal ("default"), whatever it is
            out[k] = "default" if v is None or v == d else v
    if kind.graphs:
        out["cuda_graphs"] = not any(a in kind.eager_flags for a in command)
    return out

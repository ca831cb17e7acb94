"""An engine's class and whether it can run a dtype on a device: the one resolver the run's plan
(harness.config) and the engine's worker (harness.worker_job) share, so that the two sides
cannot disagree about an engine."""

from __future__ import annotations

from typing import Any

from adapters import engine_class
from adapters.base import Engine


def resolve_engine(name: str, endpoint: dict[str, Any] | None = None) -> tuple[type[Engine] | None, list[str]]:
    """(the engine class, []) of a registered engine, or of an HTTP endpoint bound to its config
    (`endpoint`: the raw endpoints.<name> mapping); (None, problems) when that config is wrong."""
    if endpoint is None:
        return engine_class(name), []
    from adapters.endpoint import endpoint_engine_class  # the HTTP client only where endpoints are used
    from adapters.endpoint.config import check_endpoint
    cfg, problems = check_endpoint(name, endpoint)
    return (endpoint_engine_class(name, cfg) if cfg is not None else None), problems


def capability_problems(cls: type[Engine], options: dict[str, Any], name: str, dtype: str, device: str) -> list[str]:
    """What keeps engine `name` (its class, with these options) from running `dtype` on `device`."""
    caps = cls.capabilities(options)
    problems: list[str] = []
    if dtype not in caps.dtypes:
        problems.append(f"dtype={dtype}: engine {name} cannot run it. Use one of {', '.join(caps.dtypes)}.")
    if device.split(":")[0] not in caps.devices:
        problems.append(f"device={device}: engine {name} runs only on {', '.join(caps.devices)}.")
    return problems

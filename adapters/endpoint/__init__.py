"""OpenAI-compatible servers as engines (`endpoints.<name>`, docs/endpoints.md).

`endpoint_engine_class(name, cfg)` gives an `Engine` subclass bound to one checked endpoint
config; its `name` is the endpoint's name (the `engine` of its rows). Its classmethods
(capabilities, check_options, unavailable_reason, version) need no running server.
"""

from __future__ import annotations

import re

from adapters.base import Engine
from adapters.endpoint.config import KINDS, EndpointConfig, check_endpoint
from adapters.endpoint.engine import EndpointEngine


def endpoint_engine_class(name: str, cfg: EndpointConfig) -> type[Engine]:
    """An EndpointEngine subclass for endpoint `name` with config `cfg` (from check_endpoint)."""
    ident = re.sub(r"\W", "_", name)
    return type(f"Endpoint_{ident}", (EndpointEngine,), {"name": name, "endpoint": cfg,
                                                          "__module__": __name__})


__all__ = ["EndpointConfig", "EndpointEngine", "KINDS", "check_endpoint", "endpoint_engine_class"]

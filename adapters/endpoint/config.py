"""`endpoints.<name>`: an OpenAI-compatible server the harness drives over HTTP.

An endpoint is either attached (`url`: a server somebody else started) or launched (`launch`:
a command template the harness runs, on a free loopback port, and stops at the end). `kind`
says which server it is: how the standard engine options map onto its flags, and which request
extensions it understands. Credentials are given by reference only (`api_key_env`,
`api_key_file`, `headers_env`): a literal key in the config is refused, and never echoed.
"""

from __future__ import annotations

import json
import os
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from adapters.chat import is_template_text, read_template
from harness.core.redact import DEFAULT as REDACT, is_sensitive_key, looks_like_credential
from adapters.endpoint.kinds import KIND_NAMES, KINDS as KIND_RECORDS
from adapters.endpoint.options import STANDARD_ENDPOINT_OPTIONS, option_problems, speculation_problems
from harness.core.schema import check, spec

KINDS = KIND_NAMES
PLACEHOLDERS = ("python", "model", "port", "host", "dtype", "max_model_len", "context_length", "served_model_name",
                "device", "threads", "cpus", "api_key")


@dataclass
class EndpointConfig:
    url: str | None = spec(None, help="attach: base URL of a running OpenAI-compatible server, "
                           "e.g. http://127.0.0.1:8000/v1")
    launch: list[str] | None = spec(None, help="launch: the server's command as a list, with placeholders "
                                    "{python} {model} {port} {host} {dtype} {max_model_len} {context_length} "
                                    "{served_model_name} {device} {threads} {cpus} {api_key} ({context_length}: "
                                    "max_model_len plus the tokens the kind's server keeps back, SGLang 2)")
    kind: str = spec("generic", choices=KINDS, help="which server: decides how options map to its flags "
                     "and which request extensions it knows")
    python: str | None = spec(None, help="interpreter for {python}; null: the harness's own")
    served_model_name: str | None = spec(None, help="model name in requests; null: launch: the model's "
                                         "name, attach: the first model /v1/models lists")
    host: str = spec("127.0.0.1", help="launch: the address the server listens on ({host})")
    ready_timeout_s: float = spec(600.0, gt=0, help="launch: seconds to wait for /health or /v1/models")
    request_timeout_s: float = spec(600.0, gt=0, help="seconds a request (a whole stream) may take")
    connect_timeout_s: float = spec(10.0, gt=0, help="seconds to open a connection")
    stop_grace_s: float = spec(15.0, gt=0, help="launch: seconds between SIGTERM and SIGKILL at stop")
    prompt_format: str = spec("auto", choices=("auto", "ids", "text"),
                              help="prompts as token ids or as text (auto: ids where the kind accepts them)")
    tokenizer: str | None = spec(None, help="tokenizer directory for text prompts; null: the model's directory")
    api: str = spec("completions", choices=("completions", "chat"),
                    help="completions: /v1/completions with the prompt (ids or text); chat: /v1/chat/completions "
                         "with the conversation's messages, the server applying the chat template")
    chat_template: str | None = spec(None, help="api=chat: a Jinja chat template (a file, or the template's text) "
                                     "for a checkpoint without one: a launched server gets it, token counts use it")
    chat_separator: str | None = spec(None, help="api=chat, a checkpoint without a chat template: the messages' "
                                      "texts joined with this string (a template made from it, as chat_template)")
    tool_call_parser: str | None = spec(None, help=(
        "api=chat, a launched server: the parser of its model's tool calls (vLLM: --enable-auto-tool-choice "
        "--tool-call-parser NAME, e.g. hermes); a request with tools and no tool_choice asks for 'auto', which vLLM "
        "refuses without it"))
    content_parts: list = spec([], help=(
        "api=chat: content-part types beside text (image_url, input_audio, ...) that the server's model takes: a "
        "conversation's message holding them is sent as logged; []: text only (a turn holding another part is not "
        "sent, counted)"))
    metrics: Any = spec("auto", choices=(True, False, "auto"),
                        help="scrape Prometheus /metrics during points (auto: when the server has it)")
    metrics_interval_s: float = spec(1.0, gt=0, help="seconds between /metrics scrapes during a point")
    max_concurrency: int | None = spec(None, ge=1, help="most requests in flight (client side); null: no limit")
    extra_body: dict = spec({}, help="fields merged into every request body")
    headers: dict = spec({}, help="extra HTTP headers (no credentials: use headers_env)")
    headers_env: dict = spec({}, help="headers whose values come from environment variables: {Header: VAR}")
    api_key_env: str | None = spec(None, help="environment variable holding the API key (sent as Bearer)")
    api_key_file: str | None = spec(None, help="file holding the API key (sent as Bearer)")
    ca_bundle: str | None = spec(None, help="PEM file of a CA to trust in addition to the system's")
    verify_tls: bool = spec(True, help="verify the server's TLS certificate (false is stated in every row)")
    env: dict = spec({}, help="launch: environment variables of the server (added to the harness's own; "
                     "values may use the launch placeholders, e.g. {cpus})")
    attached_options: dict = spec({}, help="attach: the standard options the server was started with "
                                  "(e.g. {prefix_caching: true}); points needing others are skipped")
    cpu_launch: list = spec([], help="launch: arguments appended only when the run's device is cpu "
                            "(e.g. vLLM's --enforce-eager); on a GPU the server runs with its own defaults")
    cpu_env: dict = spec({}, help="launch: environment variables set only when the run's device is cpu")
    cpu_options: dict = spec({}, help="launch: standard engine options used when the run's device is cpu and "
                             "the run does not set them (e.g. {gpu_memory_utilization: 0.3})")
    server_version: str | None = spec(None, help="the server's version where a mapping depends on it and the "
                                      "harness cannot see it (e.g. trtllm-serve 1.1.0 for block_size)")
    dry_run: bool = spec(False, help="launch: print the command, environment and option files the server "
                         "would get, and start nothing (the engine's points fail with that reason)")

    @property
    def launched(self) -> bool:
        return self.launch is not None

    @property
    def has_key(self) -> bool:
        return bool(self.api_key_env or self.api_key_file)

    def auth(self) -> Any:
        """How requests authenticate, for the rows: never the key itself."""
        if self.api_key_env:
            return {"method": "env", "variable": self.api_key_env}
        if self.api_key_file:
            return {"method": "file", "path": str(self.api_key_file)}
        return "none"


# ---- chat templates -----------------------------------------------------------------------------

def separator_template(sep: str) -> str:
    """A chat template that joins the messages' contents with `sep` (nothing else: no roles, no
    generation prompt)."""
    lit = json.dumps(sep)  # a JSON string is a Jinja string literal
    return "{% for m in messages %}{% if not loop.first %}{{ " + lit + " }}{% endif %}{{ m['content'] }}{% endfor %}"


def chat_template_text(cfg: EndpointConfig) -> str | None:
    """The chat template the config gives (a file's text, the text itself, or one made from the
    separator); None: the checkpoint's own."""
    if cfg.chat_separator is not None:
        return separator_template(cfg.chat_separator)
    return read_template(cfg.chat_template)


def checkpoint_has_chat_template(path: str | None) -> bool:
    """Whether the checkpoint directory's tokenizer has a chat template (tokenizer_config.json's
    `chat_template`, or chat_template.jinja / chat_template.json beside it). A preset (no
    directory yet) is materialised with a word-level tokenizer and no template: False."""
    if not path or not Path(path).is_dir():
        return False
    d = Path(path)
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def chat_problems(name: str, cfg: EndpointConfig, model_path: str | None, model_name: str) -> list[str]:
    """api=chat on a checkpoint with no chat template, and neither chat_template nor
    chat_separator given: the one problem, naming the field and the fix."""
    if cfg.api != "chat" or cfg.chat_template is not None or cfg.chat_separator is not None:
        return []
    tok = cfg.tokenizer or model_path
    if checkpoint_has_chat_template(tok):
        return []
    where = f"the tokenizer at {tok}" if tok else f"model {model_name} (a preset: its word-level tokenizer has none)"
    return [f"endpoints.{name}.api=chat: {where} has no chat template, so the server cannot build a chat prompt "
            f"and the harness cannot count its tokens. Give endpoints.{name}.chat_template=FILE (a Jinja template), "
            f"or endpoints.{name}.chat_separator=' ' (the messages joined with it), or use api=completions."]


# ---- credentials ---------------------------------------------------------------------------------

_SAFE = "api_key_env=VAR (an environment variable) or api_key_file=PATH (a file)"
_LITERAL_KEYS = ("api_key", "apikey", "key", "token", "password", "secret", "bearer")


def _credential_problems(name: str, raw: dict[str, Any]) -> list[str]:
    """Literal credentials anywhere in the config, each named by field, never echoed."""
    p = f"endpoints.{name}"
    out: list[str] = []
    for k in raw:
        if k in _LITERAL_KEYS or (is_sensitive_key(k) and k not in ("api_key_env", "api_key_file")):
            out.append(f"{p}.{k}: a literal credential is refused (it would be written into the run's files "
                       f"and logs). Use {p}.{_SAFE}.")
    headers = raw.get("headers")
    if isinstance(headers, dict):
        for h, v in headers.items():
            if is_sensitive_key(h) or looks_like_credential(str(v)):
                out.append(f"{p}.headers.{h}: the value looks like a credential and is refused. Put it in an "
                           f"environment variable and use {p}.headers_env: {{{h}: VAR}} "
                           f"(or {p}.{_SAFE} for a Bearer key).")
    url = raw.get("url")
    if isinstance(url, str):
        parts = urlsplit(url)
        if parts.password is not None or (parts.username and "@" in parts.netloc):
            out.append(f"{p}.url: the URL carries a user name/password (user:password@host); that is refused. "
                       f"Drop it from the URL and use {p}.{_SAFE}.")
        if any(is_sensitive_key(q.split("=", 1)[0]) for q in parts.query.split("&") if q):
            out.append(f"{p}.url: the URL's query string carries a credential; that is refused. "
                       f"Use {p}.{_SAFE}.")
    launch = raw.get("launch")
    if isinstance(launch, list):
        for i, item in enumerate(launch):
            if not isinstance(item, str):
                continue
            prev = launch[i - 1] if i else ""
            literal_after_flag = (isinstance(prev, str) and prev.startswith("-")
                                  and is_sensitive_key(prev.lstrip("-")) and "{" not in item)
            inline = re.match(r"^--?([A-Za-z0-9_-]+)=(.+)$", item)
            literal_inline = bool(inline and is_sensitive_key(inline.group(1)) and "{" not in inline.group(2))
            if literal_after_flag or literal_inline or looks_like_credential(item):
                out.append(f"{p}.launch[{i}]: a literal credential in the command is refused. Write the "
                           f"placeholder {{api_key}} there and give {p}.{_SAFE}.")
    for field in ("env", "extra_body"):
        d = raw.get(field)
        if isinstance(d, dict):
            for k, v in d.items():
                if (is_sensitive_key(k) and v not in (None, "")) or looks_like_credential(str(v)):
                    fix = ("export it in the harness's environment instead (a launched server inherits it)"
                           if field == "env" else f"use {p}.{_SAFE}")
                    out.append(f"{p}.{field}.{k}: a literal credential is refused; {fix}.")
    return out


def _drop_literals(raw: dict[str, Any]) -> dict[str, Any]:
    """The config without the literal credentials already reported, then pattern-redacted so
    that no other message can echo a secret."""
    clean = {k: v for k, v in raw.items()
             if not (k in _LITERAL_KEYS or (is_sensitive_key(k) and k not in ("api_key_env", "api_key_file")))}
    if isinstance(clean.get("headers"), dict):
        clean["headers"] = {h: v for h, v in clean["headers"].items()
                            if not (is_sensitive_key(h) or looks_like_credential(str(v)))}
    refs = {k: clean.pop(k) for k in ("headers_env", "api_key_env") if k in clean}  # names, not secrets
    out = REDACT.obj(clean)
    for k, v in refs.items():
        out[k] = ({h: (REDACT.text(x) if isinstance(x, str) else x) for h, x in v.items()}
                  if isinstance(v, dict) else (REDACT.text(v) if isinstance(v, str) else v))
    return out


# ---- the rest of the checks ----------------------------------------------------------------------

def template_fields(launch: list[str]) -> tuple[set[str], list[str]]:
    """(placeholder names used, problems with the template's syntax)."""
    names: set[str] = set()
    problems: list[str] = []
    for i, item in enumerate(launch):
        try:
            for _, field, spec_, conv in string.Formatter().parse(item):
                if field is None:
                    continue
                if spec_ or conv:
                    problems.append(f"[{i}]: '{{{field}...}}' uses a format spec or conversion; write plain "
                                    f"{{{field}}}.")
                names.add(field)
        except ValueError as e:
            problems.append(f"[{i}]: {e} (write a literal brace as {{{{ or }}}}).")
    return names, problems


def check_endpoint(name: str, raw: dict[str, Any] | None) -> tuple[EndpointConfig | None, list[str]]:
    """The typed config of `endpoints.<name>` and every problem, each naming
    `endpoints.<name>.<field>` and the fix. No message echoes a credential."""
    p = f"endpoints.{name}"
    raw = dict(raw or {})
    problems = _credential_problems(name, raw)
    cfg, probs = check(EndpointConfig, _drop_literals(raw), p)
    problems += [REDACT.text(x) for x in probs]
    if cfg is None:
        return None, problems
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        problems.append(f"{p}: the endpoint's name may use letters, digits, '_', '.' and '-' only.")
    if (cfg.url is None) == (cfg.launch is None):
        problems.append(f"{p}: give exactly one of {p}.url (attach to a running server) and {p}.launch "
                        "(a command the harness starts).")
    if cfg.url is not None:
        problems += _url_problems(p, cfg)
    if cfg.launch is not None:
        problems += _launch_problems(p, name, cfg)
    problems += _key_problems(p, cfg)
    problems += _path_problems(p, cfg)
    problems += _request_option_problems(p, cfg)
    if cfg.cpu_options and not problems:
        problems += [x.replace(f"engine_options.{name}.", f"{p}.cpu_options.")
                     for x in option_problems(name, cfg.kind, cfg.cpu_options, "cpu", server_version=cfg.server_version)]
    accepted = KIND_RECORDS[cfg.kind].accepted_fields
    if accepted is not None:
        unknown = sorted(set(cfg.extra_body) - set(accepted))
        if unknown:
            problems.append(f"{p}.extra_body: a kind={cfg.kind} server refuses requests with unknown fields "
                            f"(HTTP 400): {', '.join(unknown)}. Fields it knows: {', '.join(accepted)}.")
    return (cfg if not problems else None), problems


def _url_problems(p: str, cfg: EndpointConfig) -> list[str]:
    """An attached server's URL, and no launch-only environment."""
    problems = []
    parts = urlsplit(cfg.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        problems.append(f"{p}.url={REDACT.text(cfg.url)}: not an http(s) URL. Give the server's base URL, "
                        "e.g. http://127.0.0.1:8000/v1.")
    else:
        try:
            parts.port
        except ValueError:
            problems.append(f"{p}.url: the port is not a number. Give e.g. http://127.0.0.1:8000/v1.")
    if cfg.env:
        problems.append(f"{p}.env: only a launched server gets an environment; drop it for an attached one.")
    return problems


def _launch_problems(p: str, name: str, cfg: EndpointConfig) -> list[str]:
    """A launched server's command template, its environment and CPU arguments, and no
    attached-only options."""
    problems = []
    if not cfg.launch or not all(isinstance(x, str) and x for x in cfg.launch):
        problems.append(f"{p}.launch: give the command as a non-empty list of non-empty strings, e.g. "
                        "['{python}', '-m', 'vllm.entrypoints.openai.api_server', '--port', '{port}', ...].")
    else:
        names, probs = template_fields(cfg.launch)
        problems += [f"{p}.launch{x}" for x in probs]
        unknown = sorted(names - set(PLACEHOLDERS))
        if unknown:
            problems.append(f"{p}.launch: unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)}. "
                            f"Known: {', '.join('{' + k + '}' for k in PLACEHOLDERS)}.")
        if "port" not in names and not probs:
            problems.append(f"{p}.launch: the command must pass {{port}} to the server: the harness picks a "
                            "free port and waits for the server there.")
        if "api_key" in names and not cfg.has_key:
            problems.append(f"{p}.launch uses {{api_key}}: give {p}.{_SAFE} for its value.")
    for k, v in cfg.env.items():
        names, probs = template_fields([str(v)])
        bad = sorted(names - set(PLACEHOLDERS) | ({"api_key"} & names))
        if probs or bad:
            problems.append(f"{p}.env.{k}: placeholders there may be "
                            f"{', '.join('{' + x + '}' for x in PLACEHOLDERS if x != 'api_key')} "
                            "(write a literal brace as {{ or }}).")
    for i, item in enumerate(cfg.cpu_launch):
        if not isinstance(item, str) or not item:
            problems.append(f"{p}.cpu_launch[{i}]: give non-empty strings (arguments of the server).")
    if cfg.attached_options:
        problems.append(f"{p}.attached_options: only for an attached server (url); a launched one is "
                        f"started with engine_options.{name}.")
    return problems


def _key_problems(p: str, cfg: EndpointConfig) -> list[str]:
    """Where the API key and the secret headers come from: names of set variables, a readable
    file, never a value."""
    problems = []
    if cfg.api_key_env and cfg.api_key_file:
        problems.append(f"{p}: give one of api_key_env and api_key_file, not both.")
    if cfg.api_key_env is not None and looks_like_credential(cfg.api_key_env):
        problems.append(f"{p}.api_key_env: this looks like a key itself; give the NAME of the environment "
                        "variable that holds it.")
    elif cfg.api_key_env is not None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cfg.api_key_env):
            problems.append(f"{p}.api_key_env: give the NAME of an environment variable (letters, digits, '_'), "
                            "not its value.")
        elif not os.environ.get(cfg.api_key_env):
            problems.append(f"{p}.api_key_env={cfg.api_key_env}: the variable is not set (or empty) here. "
                            f"export {cfg.api_key_env}=... before running.")
    if cfg.api_key_file is not None:
        path = Path(cfg.api_key_file).expanduser()
        try:
            if not path.read_text().strip():
                problems.append(f"{p}.api_key_file={cfg.api_key_file}: the file is empty. Put the key in it.")
        except OSError as e:
            problems.append(f"{p}.api_key_file={cfg.api_key_file}: cannot read it ({e.strerror}). "
                            "Give a readable file holding the key.")
    for header, var in cfg.headers_env.items():
        if not isinstance(var, str) or looks_like_credential(var) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
            problems.append(f"{p}.headers_env.{header}: give the NAME of an environment variable.")
        elif not os.environ.get(var):
            problems.append(f"{p}.headers_env.{header}={var}: the variable is not set (or empty) here. "
                            f"export {var}=... before running.")
    for header, value in cfg.headers.items():
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            problems.append(f"{p}.headers.{header}: give a string value.")
    return problems


def _path_problems(p: str, cfg: EndpointConfig) -> list[str]:
    """The files and directories the config names: CA bundle, interpreter, tokenizer."""
    problems = []
    if cfg.ca_bundle is not None and not Path(cfg.ca_bundle).expanduser().is_file():
        problems.append(f"{p}.ca_bundle={cfg.ca_bundle}: no such file. Give a PEM file with the CA certificate.")
    if cfg.python is not None:
        exe = Path(cfg.python).expanduser()
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            problems.append(f"{p}.python={cfg.python}: not an executable file. Give the path of the interpreter "
                            "of the environment the server is installed in (e.g. /opt/vllm/bin/python).")
        elif cfg.launch is not None and "python" not in template_fields(cfg.launch)[0]:
            problems.append(f"{p}.python is set but {p}.launch does not use {{python}}.")
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).expanduser().is_dir():
        problems.append(f"{p}.tokenizer={cfg.tokenizer}: no such directory. Give a directory with the "
                        "tokenizer files (tokenizer.json ...).")
    return problems


def _request_option_problems(p: str, cfg: EndpointConfig) -> list[str]:
    """Request fields the harness sets itself, unknown option names, and launch-only settings
    on an attached server."""
    problems = []
    for key in ("extra_body",):
        reserved = sorted(set(getattr(cfg, key)) & {"prompt", "stream", "model"})
        if reserved:
            problems.append(f"{p}.{key}: {', '.join(reserved)} are set by the harness; drop them.")
    for field_ in ("attached_options", "cpu_options"):
        for k in getattr(cfg, field_):
            if k not in STANDARD_ENDPOINT_OPTIONS:
                problems.append(f"{p}.{field_}.{k}: unknown option. Known: {', '.join(STANDARD_ENDPOINT_OPTIONS)}.")
    problems += speculation_problems(f"{p}.attached_options.", cfg.attached_options)
    if (cfg.chat_template is not None or cfg.chat_separator is not None) and cfg.api != "chat":
        problems.append(f"{p}.chat_template / chat_separator apply to api=chat only; set {p}.api=chat or drop them.")
    if (cfg.tool_call_parser is not None or cfg.content_parts) and cfg.api != "chat":
        problems.append(f"{p}.tool_call_parser / content_parts apply to api=chat only; set {p}.api=chat or drop them.")
    kind = KIND_RECORDS.get(cfg.kind)
    if kind is not None and cfg.tool_call_parser is not None and cfg.launched and not kind.tool_parser_args:
        problems.append(f"{p}.tool_call_parser: the harness cannot give a kind={cfg.kind} server a tool-call parser; "
                        f"put its flags in {p}.launch, or drop it.")
    if kind is not None and kind.content_parts is not None:
        other = sorted(set(map(str, cfg.content_parts)) - set(kind.content_parts))
        if other:
            problems.append(f"{p}.content_parts: {', '.join(other)} are not parts a kind={cfg.kind} server's chat API "
                            f"takes ({', '.join(kind.content_parts) or 'text alone'}).")
    if cfg.chat_template is not None and cfg.chat_separator is not None:
        problems.append(f"{p}: give chat_template or chat_separator, not both.")
    if cfg.chat_template is not None and not is_template_text(cfg.chat_template) \
            and not Path(cfg.chat_template).expanduser().is_file():
        problems.append(f"{p}.chat_template={cfg.chat_template}: no such file (and not a Jinja template's text). "
                        "Give a .jinja file or the template itself.")
    if cfg.url is not None and (cfg.cpu_launch or cfg.cpu_env or cfg.cpu_options or cfg.dry_run):
        problems.append(f"{p}: cpu_launch, cpu_env, cpu_options and dry_run are for a launched server (launch); "
                        "drop them for an attached one.")
    return problems

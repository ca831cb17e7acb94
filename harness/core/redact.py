"""One redaction step for everything a run writes or prints.

Every artifact (environment.json, config.resolved.yaml, rows, report, summary, logs, terminal
messages) goes through a `Redactor` before it leaves the process. It masks:

- `Authorization` / `Proxy-Authorization` header values (and any `Bearer <token>`);
- values whose key names a credential: `api_key`, `x-api-key`, `token` (`hf_token`,
  `access_token`, ...), `password`, `secret`, `credentials`, `cookie`, ..., written as
  `key=value`, `key: value`, JSON `"key": "value"`, or a command-line `--api-key value`
  (keys that only mention a credential, like `api_key_env` or `bytes_per_token`, are left alone);
- the password of URLs with `user:password@`;
- strings shaped like well-known credentials (`sk-...`, `hf_...`, `ghp_...`, JWTs, ...);
- the literal values of the run's own secrets: what the endpoints' `api_key_env`, `api_key_file`
  and `headers_env` refer to, and the Hugging Face Hub token of the environment (`HF_TOKEN`,
  `ENV_SECRETS`: models and datasets named by their Hub id are downloaded with it), read by the
  Redactor itself, also URL-encoded and JSON-escaped. This last pass runs after every pattern and guarantees that no given secret
  survives as a substring of the output.

`DEFAULT` is the pattern-only redactor; `Redactor.from_endpoints(...)` adds a run's secrets.
This module sits in the bottom layer: it reads endpoint configs by duck typing (mappings or
objects with those attribute names) and imports nothing of the project above it.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

MASK = "***"
# Environment variables whose values are a run's secrets whatever its endpoints (the Hub token
# huggingface_hub downloads with: harness/core/hub.py reads HF_TOKEN only; the legacy name too).
ENV_SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")

# A key that names a credential (normalised: lower case, '-' -> '_'); `*_per_token` is a size.
_SENSITIVE_WORDS = r"api_?key|apikey|access_?key|secret_?key|private_?key|client_?secret|password|passwd|" \
                   r"secret|credentials?|authorization|cookie|set_cookie|token"
# ... except names of sizes and of a model's special tokens
_NOT_CREDENTIAL_TOKENS = tuple(f"{w}_token" for w in (
    "per", "bos", "eos", "pad", "unk", "sep", "cls", "mask", "first", "last", "next", "start", "end", "stop"))


def is_sensitive_key(key: Any) -> bool:
    """True if a mapping key or option name names a credential (`api_key`, `X-Api-Key`,
    `HF_TOKEN`, `password`, ...). Names that only refer to one (`api_key_env`) are not."""
    if not isinstance(key, str):
        return False
    k = key.strip().lower().replace("-", "_").lstrip("_")
    if not k or k.endswith(_NOT_CREDENTIAL_TOKENS):
        return False
    return re.fullmatch(rf"(?:[a-z0-9_.]*[_.])?(?:{_SENSITIVE_WORDS})", k) is not None


# Strings that are credentials by their shape alone.
_CREDENTIAL_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(?:"
    r"sk-[A-Za-z0-9_-]{16,}"                         # OpenAI-style keys (sk-..., sk-proj-...)
    r"|hf_[A-Za-z0-9]{20,}"                          # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"                 # Slack
    r"|AKIA[0-9A-Z]{16}"                             # AWS access key id
    r"|nvapi-[A-Za-z0-9_-]{20,}"                     # NVIDIA API catalog
    r"|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"  # JWT
    r")")


def looks_like_credential(value: Any) -> bool:
    """True if `value` is (or contains) something that is a credential by its shape: a known
    key format, or an `Authorization`-style `Bearer`/`Basic` value."""
    if not isinstance(value, str):
        return False
    return bool(_CREDENTIAL_SHAPES.search(value) or re.search(r"(?i)\b(?:bearer|basic)\s+\S{4,}", value))


# ---- the patterns -------------------------------------------------------------------------------

_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^\s:/@\"']*):(?P<pw>[^\s@/\"']+)@")
_AUTH_HEADER = re.compile(
    r"(?i)(?P<key>\b(?:proxy-)?authorization)(?P<q>[\"']?)(?P<sep>\s*[:=]\s*)(?P<vq>[\"']?)"
    r"(?:(?P<scheme>bearer|basic|token|digest|apikey)\s+)?(?P<val>[^\"'\r\n,}]+)")
_BEARER = re.compile(r"(?i)\b(?P<scheme>bearer|basic)\s+(?P<val>[A-Za-z0-9._~+/=-]{8,})")
# key=value, key: value, "key": "value", --key=value (the key is the whole identifier)
_KEY_VALUE = re.compile(
    r"(?<![A-Za-z0-9_-])(?P<kq>[\"']?)(?P<key>-{0,2}[A-Za-z][A-Za-z0-9_.-]*)(?P=kq)(?P<sep>[ \t]*[:=][ \t]*)"
    r"(?:(?P<vq>[\"'])(?P<qval>[^\"'\r\n]*)(?P=vq)|(?P<val>[^\s,;&\"'}\]]+))")
# a command line's --api-key VALUE
_FLAG_VALUE = re.compile(r"(?<![A-Za-z0-9_-])(?P<flag>--?[A-Za-z][A-Za-z0-9_-]*)(?P<sp>[ \t]+)(?P<val>[^\s-][^\s]*)")
_NOT_SECRET_VALUES = {"", "null", "none", "~", "true", "false", MASK}


def _is_placeholder(value: str) -> bool:
    v = value.strip().strip("\"'")
    return v.lower() in _NOT_SECRET_VALUES or v.startswith(("${", "{", "<", MASK))


def _sub_key_value(m: re.Match) -> str:
    key = m.group("key").lstrip("-")
    val = m.group("qval") if m.group("vq") else m.group("val")
    if not is_sensitive_key(key) or _is_placeholder(val) or key.lower().endswith("authorization"):
        return m.group(0)  # (Authorization values are masked by their own pattern, scheme kept)
    if m.group("vq"):
        return f"{m.group('kq')}{m.group('key')}{m.group('kq')}{m.group('sep')}{m.group('vq')}{MASK}{m.group('vq')}"
    return f"{m.group('kq')}{m.group('key')}{m.group('kq')}{m.group('sep')}{MASK}"


def _sub_flag_value(m: re.Match) -> str:
    if not is_sensitive_key(m.group("flag").lstrip("-")) or _is_placeholder(m.group("val")):
        return m.group(0)
    return f"{m.group('flag')}{m.group('sp')}{MASK}"


def _sub_auth(m: re.Match) -> str:
    scheme = f"{m.group('scheme')} " if m.group("scheme") else ""
    return f"{m.group('key')}{m.group('q')}{m.group('sep')}{m.group('vq')}{scheme}{MASK}"


def redact_patterns(s: str) -> str:
    """The pattern-only pass (no known secrets)."""
    s = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{m.group('user')}:{MASK}@", s)
    s = _AUTH_HEADER.sub(_sub_auth, s)
    s = _BEARER.sub(lambda m: f"{m.group('scheme')} {MASK}", s)
    s = _KEY_VALUE.sub(_sub_key_value, s)
    s = _FLAG_VALUE.sub(_sub_flag_value, s)
    s = _CREDENTIAL_SHAPES.sub(MASK, s)
    return s


def _mask_char(secrets: Iterable[str]) -> str:
    """A character that occurs in no secret: a mask made of it can never complete one."""
    used = set().union(*(set(s) for s in secrets)) if secrets else set()
    for c in "*#~%" + string.ascii_letters + string.digits:
        if c not in used:
            return c
    c = 0x2588  # beyond ASCII: some character is always free
    while chr(c) in used:
        c += 1
    return chr(c)


class Redactor:
    """Masks credentials in text and in nested data (dicts, lists). `secrets` are literal values
    to mask wherever they occur (shorter than 1 character: ignored)."""

    def __init__(self, secrets: Iterable[str] = ()):
        forms: set[str] = set()
        for s in secrets:
            if not isinstance(s, str) or not s:
                continue
            forms.add(s)
            forms.add(quote(s, safe=""))  # URL-encoded
            forms.add(json.dumps(s)[1:-1])  # JSON-escaped
        self._secrets = sorted(f for f in forms if f)
        self._mask = _mask_char(self._secrets) * 3 if self._secrets else MASK
        self._secret_re = (re.compile("|".join(re.escape(s) for s in sorted(self._secrets, key=len, reverse=True)))
                           if self._secrets else None)

    def __repr__(self) -> str:  # never show the secrets themselves
        return f"Redactor({len(self._secrets)} secret forms)"

    @classmethod
    def from_endpoints(cls, endpoints: Mapping[str, Any] | Iterable[Any] | None,
                       environ: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> "Redactor":
        """A redactor for a run: reads the secret values that the endpoint configs refer to
        (`api_key_env`, `api_key_file`, `headers_env`), from `environ` (default os.environ) and
        the files, and the Hub token of `environ` (`ENV_SECRETS`). `endpoints` is {name: config}
        or a list of configs (dataclasses or dicts)."""
        environ = os.environ if environ is None else environ
        items = endpoints.values() if isinstance(endpoints, Mapping) else (endpoints or [])
        secrets = list(extra)
        for var in ENV_SECRETS:
            if environ.get(var):
                secrets += [environ[var], environ[var].strip()]
        for cfg in items:
            secrets += secret_values(cfg, environ)
        return cls(secrets)

    def _literal(self, s: str) -> str:
        """Mask every (possibly overlapping) occurrence of every secret form: each maximal run
        of covered characters becomes one mask."""
        if self._secret_re is None:
            return s
        covered: list[tuple[int, int]] = []
        for form in self._secrets:
            start = s.find(form)
            while start != -1:
                covered.append((start, start + len(form)))
                start = s.find(form, start + 1)
        if not covered:
            return s
        covered.sort()
        out, pos, run_start, run_end = [], 0, covered[0][0], covered[0][1]
        for a, b in covered[1:]:
            if a <= run_end:
                run_end = max(run_end, b)
                continue
            out += [s[pos:run_start], self._mask]
            pos, run_start, run_end = run_end, a, b
        out += [s[pos:run_start], self._mask, s[run_end:]]
        return "".join(out)

    def text(self, s: str) -> str:
        if not isinstance(s, str):
            return s
        return self._literal(redact_patterns(s))

    def obj(self, o: Any) -> Any:
        """A deep copy of `o` with every string redacted and every credential-named key's value
        masked. Dicts, lists and tuples are walked; other values are returned as they are."""
        if isinstance(o, str):
            return self.text(o)
        if isinstance(o, Mapping):
            out = {}
            for k, v in o.items():
                key = self.text(k) if isinstance(k, str) else k
                if is_sensitive_key(k) and isinstance(v, str) and not _is_placeholder(v):
                    out[key] = self._literal(MASK)  # (a secret made of '*' is masked too)
                else:
                    out[key] = self.obj(v)
            return out
        if isinstance(o, (list, tuple)):
            items = [self.obj(v) for v in o]
            # a command line as a list: ["--api-key", "VALUE"]
            for i in range(len(items) - 1):
                if (isinstance(o[i], str) and o[i].startswith("-") and is_sensitive_key(o[i].lstrip("-"))
                        and isinstance(o[i + 1], str) and not _is_placeholder(o[i + 1])
                        and not o[i + 1].startswith("-")):
                    items[i + 1] = self._literal(MASK)
            return type(o)(items) if isinstance(o, tuple) else items
        return o

    def lines(self, text: str) -> str:
        """Text redacted line by line (a log)."""
        return "".join(self.text(line) for line in text.splitlines(keepends=True))


def _get(cfg: Any, name: str) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name)
    return getattr(cfg, name, None)


def secret_values(cfg: Any, environ: Mapping[str, str] | None = None) -> list[str]:
    """The secret values one endpoint config refers to (empty where a variable is unset or a
    file unreadable: nothing to mask then)."""
    environ = os.environ if environ is None else environ
    out: list[str] = []
    var = _get(cfg, "api_key_env")
    if isinstance(var, str) and environ.get(var):
        out.append(environ[var])
        out.append(environ[var].strip())
    path = _get(cfg, "api_key_file")
    if isinstance(path, str) and path:
        try:
            raw = Path(path).expanduser().read_text()
            out += [raw, raw.strip()]
        except OSError:
            pass
    for var in (_get(cfg, "headers_env") or {}).values() if isinstance(_get(cfg, "headers_env"), Mapping) else ():
        if isinstance(var, str) and environ.get(var):
            out += [environ[var], environ[var].strip()]
    return [s for s in dict.fromkeys(out) if s]


DEFAULT = Redactor()


def redact_text(s: str) -> str:
    """The pattern-only redaction of a string."""
    return DEFAULT.text(s)


"""Structured output: the constraints a request may carry, where they come from, and the verdict
on each reply (docs/metrics.md, "Structured output").

A constraint is one of
  json     a JSON schema (a dict): the reply must parse as JSON and validate against it (jsonschema)
  regex    a regular expression: the reply must match it whole (re.fullmatch)
  choice   a list of strings: the reply must be one of them
  grammar  an EBNF grammar in xgrammar's (GBNF-like) syntax, rule `root`: the reply must be a
           complete sentence of it (xgrammar's matcher)

Sources (`load_constraints`):
  shipped  harness/core/constraints.jsonl, made for this project: JSON schemas of
           three sizes, regexes, choice lists and grammars, each with a prompt
  a JSONL  one object per line: {"json_schema": {...} | "schema": {...} | "regex": "..." |
           "choice": [...] | "grammar": "...", "prompt": "..." (optional), "name": "..." (optional)}
  json-mode-eval's format (NousResearch/json-mode-eval on the Hub, `hf:` paths): `schema` a JSON
           string, `prompt` a list of chat messages (their contents joined) - read by the same rule

Every constraint is checked before anything runs (`constraint_problems`: the schema against the
JSON Schema meta-schema and xgrammar's converter, the regex and the grammar by xgrammar's
parsers, the choice list non-empty strings): bad input names the line and the fix.

The verdict of one reply (`verdict`): conforming; truncated (the reply stopped at its token
limit, `finish_reason=length`, and is a valid prefix of some conforming reply: xgrammar's
matcher accepts it); non-conforming (parses, but breaks the constraint); unparseable (json: not
JSON, and not a valid prefix). jsonschema and xgrammar are imported where used (xgrammar
imports torch).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.errors import UserError

KINDS = ("json", "regex", "choice", "grammar")
VERDICTS = ("conforming", "truncated", "non_conforming", "unparseable")
SHIPPED = Path(__file__).resolve().parent / "constraints.jsonl"
# the keys of a constraints JSONL line that name its kind (json-mode-eval's `schema` is a JSON string)
_KEYS = {"json_schema": "json", "schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """One constraint: its kind, its value (a schema dict, a regex, a list of choices, an EBNF
    grammar), a name, and the prompt that goes with it (None: the workload's own)."""

    kind: str
    value: Any
    name: str
    prompt: str | None = None

    def text(self) -> str:
        """The value as the engines take it: a schema as compact JSON, a choice list as JSON."""
        return self.value if isinstance(self.value, str) else json.dumps(self.value, separators=(",", ":"),
                                                                        sort_keys=True)

    def key(self) -> str:
        """Identity for caches: the kind and the value."""
        return f"{self.kind}:{self.text()}"

    def to_request(self, disable_any_whitespace: bool = False) -> dict[str, Any]:
        """What a Request carries (adapters.base.Request.constraint): plain data."""
        return {"kind": self.kind, "value": self.value, "name": self.name,
                "disable_any_whitespace": bool(disable_any_whitespace)}

    def with_nonce(self, nonce: str) -> Constraint:
        """A JSON schema an engine has not compiled yet that constrains exactly as this one: the
        same schema with `$comment` set to `nonce` (a comment keyword, no effect on validation)."""
        if self.kind != "json":
            raise ValueError("only a JSON schema takes a nonce")
        return Constraint(self.kind, {**self.value, "$comment": nonce}, f"{self.name}+{nonce}", self.prompt)


def from_request(d: dict[str, Any]) -> Constraint:
    return Constraint(d["kind"], d["value"], d.get("name") or d["kind"])


# ---- reading ---------------------------------------------------------------------------------------

def _prompt_text(v: Any) -> str | None:
    """A prompt: text, or chat messages (json-mode-eval) whose contents are joined by newlines."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(m, dict) for m in v):
        parts = [m.get("content") for m in v if isinstance(m.get("content"), str)]
        return "\n".join(parts) if parts else None
    return None


def parse_line(obj: Any, where: str) -> Constraint:
    """One constraint from a JSONL object (the module's docstring: which keys); UserError naming
    `where` when it names no kind, or several."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: not a JSON object. Each line is {{\"json_schema\"|\"regex\"|\"choice\"|"
                        "\"grammar\": ..., \"prompt\": ...}.")
    found = [k for k in _KEYS if k in obj]
    if len(found) != 1:
        raise UserError(f"{where}: {'no' if not found else 'more than one'} constraint key ({', '.join(found) or 'none'}"
                        f"). Give exactly one of {', '.join(_KEYS)} per line.")
    key = found[0]
    kind, value = _KEYS[key], obj[key]
    if kind == "json" and isinstance(value, str):  # json-mode-eval keeps the schema as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: `{key}` is a string that is not JSON ({e.msg} at {e.pos}). Give the schema "
                            "as an object, or as a string holding JSON.") from None
    name = obj.get("name") or f"{kind}-{where.rsplit(':', 1)[-1].strip()}"
    return Constraint(kind, value, str(name), _prompt_text(obj.get("prompt")))


def load_constraints(source: str, kinds: list[str] | tuple[str, ...] = KINDS,
                     field: str = "workload.dataset") -> list[Constraint]:
    """The constraints of `source` (`shipped`, or a JSONL path) whose kind is in `kinds`, in file
    order. UserError (every problem at once) for a missing file, bad lines or bad constraints, or
    no constraint of the kinds asked for."""
    path = SHIPPED if source == "shipped" else Path(source).expanduser()
    if not path.is_file():
        raise UserError(f"{field}={source}: no such file. Give `shipped` (the constraints made for this project), "
                        "a JSONL file of constraints, or hf:ORG/NAME[/FILE] (json-mode-eval's format).")
    out, problems = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{field}={source}: line {n}"
            try:
                c = parse_line(json.loads(line), where)
            except json.JSONDecodeError as e:
                problems.append(f"{where}: not JSON ({e.msg}). One JSON object per line.")
                continue
            except UserError as e:
                problems += e.problems
                continue
            problems += [f"{where}: {p}" for p in constraint_problems(c)]
            if c.kind in kinds:
                out.append(c)
    if problems:
        raise UserError(problems)
    if not out:
        raise UserError(f"{field}={source}: no constraint of the kinds asked for ({', '.join(kinds)}). Give a file "
                        "that has some, or set workload.kinds to the kinds it has.")
    return out


# ---- checking ---------------------------------------------------------------------------------------

def constraint_problems(c: Constraint) -> list[str]:
    """Why an engine could not take `c` (empty: none), each with the fix."""
    if c.kind == "choice":
        if not isinstance(c.value, list) or not c.value or not all(isinstance(x, str) and x for x in c.value):
            return ["`choice` must be a non-empty list of non-empty strings."]
        return []
    if c.kind == "json":
        if not isinstance(c.value, dict):
            return ["the JSON schema must be an object (a dict)."]
        import jsonschema
        try:
            jsonschema.validators.validator_for(c.value).check_schema(c.value)
        except jsonschema.SchemaError as e:
            return [f"invalid JSON schema: {e.message} (at {'/'.join(str(p) for p in e.absolute_path) or 'the top'}). "
                    "Fix the schema (it must validate against the JSON Schema meta-schema)."]
    elif not isinstance(c.value, str) or not c.value:
        return [f"`{c.kind}` must be a non-empty string."]
    elif c.kind == "regex":
        try:
            re.compile(c.value)
        except re.error as e:
            return [f"invalid regex {c.value!r}: {e}. Fix the pattern."]
    try:
        grammar_of(c)
    except RuntimeError as e:
        what = {"json": "xgrammar cannot convert this JSON schema", "regex": "xgrammar cannot parse this regex",
                "grammar": "invalid grammar (xgrammar's EBNF, with a rule `root`)"}[c.kind]
        return [f"{what}: {_xgrammar_message(e)}. Fix the {c.kind}."]
    return []


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)


def grammar_of(c: Constraint, any_whitespace: bool = True) -> Any:
    """The constraint as an xgrammar Grammar (a choice list: an alternation of its strings)."""
    import xgrammar as xg
    if c.kind == "json":
        return xg.Grammar.from_json_schema(json.dumps(c.value), any_whitespace=any_whitespace)
    if c.kind == "regex":
        return xg.Grammar.from_regex(c.value)
    if c.kind == "choice":
        return xg.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(s) for s in c.value))
    return xg.Grammar.from_ebnf(c.value)


# ---- an engine's grammars ----------------------------------------------------------------------

class Grammars:
    """An engine's grammar compiler over a checkpoint's tokenizer (xgrammar's TokenizerInfo, the
    model's vocabulary size: the logits' width) and its compiled grammars, cached by constraint;
    `matcher(constraint)` gives a request its own GrammarMatcher, stopping on the tokenizer's
    end-of-sequence id (adapters/reference/grammar.py, adapters/hf.py)."""

    def __init__(self, model_path: str, vocab_size: int):
        import xgrammar as xg
        from transformers import AutoTokenizer
        self.xg = xg
        tok = AutoTokenizer.from_pretrained(model_path)
        if tok.eos_token_id is None:
            raise ValueError(f"structured output needs an end-of-sequence token to stop on; the tokenizer of "
                             f"{model_path} has none")
        self.eos_token_id = int(tok.eos_token_id)
        self.info = xg.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=[tok.eos_token_id])
        self.compiler = xg.GrammarCompiler(self.info)
        self.vocab_size = vocab_size
        self.compiled: dict[str, Any] = {}

    def compiled_for(self, constraint: dict[str, Any]) -> Any:
        """The constraint's CompiledGrammar (compiled once; disable_any_whitespace: compact JSON)."""
        c = from_request(constraint)
        compact = bool(constraint.get("disable_any_whitespace"))
        key = json.dumps([c.key(), compact])
        if key not in self.compiled:
            self.compiled[key] = self.compiler.compile_grammar(grammar_of(c, any_whitespace=not compact))
        return self.compiled[key]

    def matcher(self, constraint: dict[str, Any]) -> Any:
        return self.xg.GrammarMatcher(self.compiled_for(constraint))


# ---- the verdict on a reply ----------------------------------------------------------------------

class Validator:
    """Verdicts for replies, with each constraint's string matcher compiled once (xgrammar, over a
    vocabulary of no token: it matches strings, not tokens)."""

    def __init__(self) -> None:
        self._compiled: dict[str, Any] = {}
        self._compiler: Any = None

    def _prefix_ok(self, c: Constraint, text: str) -> bool:
        """`text` is the start of some conforming reply (any whitespace allowed in JSON)."""
        import xgrammar as xg
        if self._compiler is None:
            self._compiler = xg.GrammarCompiler(xg.TokenizerInfo([""]), cache_enabled=False)
        if c.key() not in self._compiled:
            self._compiled[c.key()] = self._compiler.compile_grammar(grammar_of(c))
        m = xg.GrammarMatcher(self._compiled[c.key()], terminate_without_stop_token=True)
        return bool(m.accept_string(text)) if text else True

    def verdict(self, c: Constraint, text: str, hit_length: bool) -> tuple[str, str | None]:
        """(verdict, why) for reply `text`; `hit_length`: it stopped at its token limit."""
        if c.kind == "json":
            try:
                obj = json.loads(text)
            except ValueError as e:
                if hit_length and self._prefix_ok(c, text):
                    return "truncated", "stopped at the token limit inside valid JSON"
                return "unparseable", f"not JSON: {e}"
            import jsonschema
            err = jsonschema.validators.validator_for(c.value)(c.value).iter_errors(obj)
            first = next(iter(err), None)
            return ("conforming", None) if first is None else ("non_conforming", f"schema: {first.message[:200]}")
        if c.kind == "regex":
            if re.fullmatch(c.value, text):
                return "conforming", None
        elif c.kind == "choice":
            if text in c.value:
                return "conforming", None
        elif c.kind == "grammar":
            import xgrammar as xg
            self._prefix_ok(c, "")
            m = xg.GrammarMatcher(self._compiled[c.key()], terminate_without_stop_token=True)
            if m.accept_string(text) and m.is_completed():
                return "conforming", None
        if hit_length and self._prefix_ok(c, text):
            return "truncated", "stopped at the token limit on a valid prefix"
        return "non_conforming", f"{c.kind}: {text[:80]!r} does not match"


def tally(verdicts: list[str]) -> dict[str, int]:
    return {v: sum(1 for x in verdicts if x == v) for v in VERDICTS}

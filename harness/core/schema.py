"""Typed config schemas (dataclasses) and a checker that reports every problem at once.

Each config section is a dataclass whose fields carry their type, default, allowed range or
choices and a one-line help text (in `field(metadata=...)`). `check(cls, mapping, prefix)`
returns the typed object and a list of problems, each naming the field and the fix. Nothing
is run until the whole config is clean.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def spec(default: Any = MISSING, *, help: str = "", ge: float | None = None, gt: float | None = None,
         le: float | None = None, choices: tuple | None = None, nonempty: bool = False,
         tune: list | dict | None = None) -> Any:
    """A dataclass field with its documentation and constraints. `tune`: the values `workload=tune`
    searches for this option by default ([choices] or {low, high, log}); None: not searched."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "choices": choices, "nonempty": nonempty, "tune": tune}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: list(d) if isinstance(d, list) else dict(d),
                     metadata=meta)
    return field(default=default, metadata=meta)


def _type_name(tp: Any) -> str:
    if tp in (int, float, str, bool):
        return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[tp]
    origin = typing.get_origin(tp)
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return f"a list of {_type_name(inner).removeprefix('an ').removeprefix('a ')}s"
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        none = type(None) in typing.get_args(tp)
        return " or ".join(names) + (" (or null)" if none else "")
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any) -> tuple[bool, Any]:
    """(ok, value converted to tp). Accepts ints for floats; never bools for numbers."""
    if tp is Any:
        return True, value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return True, None
                continue
            ok, v = _coerce(arg, value)
            if ok:
                return True, v
        return False, value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return False, value
        (inner,) = typing.get_args(tp) or (Any,)
        out = []
        for item in value:
            ok, v = _coerce(inner, item)
            if not ok:
                return False, value
            out.append(v)
        return True, out
    if origin is dict:
        return isinstance(value, dict), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    return isinstance(value, tp), value


def _range_problem(name: str, value: Any, meta: dict) -> str | None:
    items = value if isinstance(value, list) else [value]
    if meta.get("nonempty") and isinstance(value, list) and not value:
        return f"{name}=[]: the list is empty. Give at least one value."
    for v in items:
        if v is None:  # it passed _coerce, so the type allows null: "not set", whatever the choices
            continue
        if isinstance(v, (str, bool)) or not isinstance(v, (int, float)):
            if meta.get("choices") and v not in meta["choices"]:
                return f"{name}={v}: not one of {', '.join(map(str, meta['choices']))}."
            continue
        if meta.get("gt") is not None and not v > meta["gt"]:
            return f"{name}={v}: must be greater than {meta['gt']:g}."
        if meta.get("ge") is not None and not v >= meta["ge"]:
            return f"{name}={v}: must be at least {meta['ge']:g}."
        if meta.get("le") is not None and not v <= meta["le"]:
            return f"{name}={v}: must be at most {meta['le']:g}."
        if meta.get("choices") and v not in meta["choices"]:
            return f"{name}={v}: not one of {', '.join(map(str, meta['choices']))}."
    return None


def check(cls: type[T], data: dict[str, Any] | None, prefix: str,
          ignore: tuple[str, ...] = ()) -> tuple[T | None, list[str]]:
    """Validate `data` against dataclass `cls`. Returns (instance or None, problems)."""
    data = dict(data or {})
    problems: list[str] = []
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields and key not in ignore:
            known = ", ".join(sorted(fields))
            problems.append(f"{prefix}.{key}: unknown setting. Known settings of {prefix}: {known}.")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        full = f"{prefix}.{name}"
        if name not in data or data[name] == "???":
            if f.default is MISSING and f.default_factory is MISSING:  # type: ignore[misc]
                problems.append(f"{full} is missing: set {full}=... ({f.metadata.get('help', '')}).")
            continue
        ok, v = _coerce(hints[name], data[name])
        if not ok:
            problems.append(f"{full}={data[name]!r}: must be {_type_name(hints[name])}."
                            + (f" ({f.metadata['help']})" if f.metadata.get("help") else ""))
            continue
        bad = _range_problem(full, v, dict(f.metadata))
        if bad:
            problems.append(bad)
            continue
        values[name] = v
    if problems:
        return None, problems
    return cls(**values), []


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, help) of every field, for documentation."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else "required")  # type: ignore[misc]
        out.append((f.name, _type_name(hints[f.name]), default, f.metadata.get("help", "")))
    return out


def tune_space(cls: type | None) -> dict[str, Any]:
    """The default search space a schema declares: {field: its `tune` values}, in field order."""
    if cls is None:
        return {}
    return {f.name: f.metadata["tune"] for f in dataclasses.fields(cls) if f.metadata.get("tune") is not None}


__all__ = ["spec", "check", "describe", "tune_space", "dataclass"]

"""conf/engine/<engine>.yaml, generated from each in-process engine's `options_cls`.

Hydra composes these files into `engine_options.<engine>` (so that overrides of a known option
need no `+`); the options' types, defaults, ranges and help live in the dataclass alone.
Regenerate after changing an options class: `python -m adapters.engine_yaml`
(tests/test_engine_options_schema.py fails while a file differs from what this writes).
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

from adapters import REGISTRY, engine_class
from adapters.base import Engine

CONF = Path(__file__).resolve().parent.parent / "conf" / "engine"
WIDTH = 118


def render(engine: type[Engine]) -> str:
    """The YAML text: the class docstring as a header, then `name: default  # help` per field."""
    cls = engine.options_cls
    assert cls is not None, f"{engine.name} declares no options_cls"
    head = [f"# GENERATED from {cls.__module__}.{cls.__qualname__} by `python -m adapters.engine_yaml`: edit the",
            "# dataclass, not this file. Override with engine_options." + engine.name + ".<option>=VALUE."]
    for para in (cls.__doc__ or "").strip().split("\n\n"):
        text = " ".join(line.strip() for line in para.splitlines())
        head += ["# " + line for line in textwrap.wrap(text, WIDTH - 2)]
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((f"{f.name}: {json.dumps(default)}", f.metadata.get("help", "")))
    pad = max(len(left) for left, _ in rows) + 2
    body = []
    for left, help_ in rows:
        lines = textwrap.wrap(help_, WIDTH - pad - 2) or [""]
        body.append(f"{left:<{pad}}# {lines[0]}".rstrip())
        body += [f"{'':<{pad}}#   {line}" for line in lines[1:]]
    return "\n".join(head + body) + "\n"


def in_process_engines() -> list[type[Engine]]:
    """Every engine of the adapters' REGISTRY that declares an options_cls, in registry order
    (importing an engine's module imports its options, not its engine package). Engines added
    through $INFER_BENCH_ENGINES are not this repository's: no file is written for them."""
    engines = [engine_class(name) for name in REGISTRY]
    return [e for e in engines if e.options_cls is not None]


def main() -> None:
    for engine in in_process_engines():
        path = CONF / f"{engine.name}.yaml"
        path.write_text(render(engine))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""What a launched endpoint would run, without running it (a dry run of a preset):

    python -m adapters.endpoint vllm-serve --device cuda --dtype bfloat16 --max-model-len 4096 \\
        --model /models/m [--option gpu_memory_utilization=0.9 ...] [--set python=/opt/vllm/bin/python]

PRESET is a name in conf/endpoint/ or a YAML file. Prints the command, the environment the
harness adds, the option files it would write and the settings that differ from the server's
own defaults. Nothing is started, and no GPU is needed to see what a GPU run would launch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from adapters.base import ModelSpec
from adapters.endpoint import check_endpoint, endpoint_engine_class
from harness.core.paths import REPO_ROOT


def _value(text: str):
    return yaml.safe_load(text)


def _pairs(items: list[str], what: str) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--{what} {item}: give NAME=VALUE (e.g. --{what} gpu_memory_utilization=0.9).")
        k, v = item.split("=", 1)
        out[k] = _value(v)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m adapters.endpoint", description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", help="a preset name of conf/endpoint/ (e.g. vllm-serve) or a YAML file")
    ap.add_argument("--device", default="cuda", help="cpu | cuda | cuda:N (default cuda)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--model", default="/models/model", help="the model directory")
    ap.add_argument("--option", action="append", default=[], help="an engine option, NAME=VALUE")
    ap.add_argument("--set", action="append", default=[], help="an endpoint setting, NAME=VALUE")
    a = ap.parse_args(argv)
    path = Path(a.preset)
    if not path.is_file():
        path = REPO_ROOT / "conf" / "endpoint" / f"{a.preset}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in (REPO_ROOT / "conf" / "endpoint").glob("*.yaml")))
        print(f"preset {a.preset}: no such preset or file. Known presets: {known}.", file=sys.stderr)
        return 2
    try:
        options, settings = _pairs(a.option, "option"), _pairs(a.set, "set")
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    name = path.stem
    raw = {**(yaml.safe_load(path.read_text()) or {}), **settings}
    if raw.get("python") == "auto":
        raw.pop("python")
    if raw.get("launch"):
        raw["dry_run"] = True  # what would be started, on another machine: its paths need not exist here
    cfg, problems = check_endpoint(name, raw)
    cls = endpoint_engine_class(name, cfg) if cfg is not None else None
    spec = ModelSpec(a.model, Path(a.model).name, a.dtype, a.device, a.max_model_len)
    if cls is not None:
        problems += cls.check_options(options, spec)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    print(cls().dry_run_text(spec, options))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

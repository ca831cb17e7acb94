"""What the endpoint engine would send, recorded once and compared ever after (a golden test):
for every server kind (kinds.py's records: vllm, sglang, trtllm, infer-bench, generic) and a fixed
set of points (no options on a CPU; every standard option on a GPU; each speculative method; a
second KV tier; the kind's own server flags; api=chat), the launch command line, its environment
and files, the settings the rows carry, the problems the option checks find, the dry-run text
(through the engine's load() and through `python -m adapters.endpoint`), and the JSON bodies of a
fixed point's requests (completions, chat, scores).

It was written against the engine before it was split into collaborators (issue 65) and must
pass unchanged after: a refactoring that changes a flag, an order, a body field or a word of the
dry run fails it. Nothing is started (dry runs and launch plans only).

The record is tests/golden/endpoint_kinds.json. A deliberate change of what the harness sends is
recorded again with `INFER_BENCH_GOLDEN=update pytest tests/test_endpoint_golden.py` and the diff
reviewed like code.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from adapters.base import ModelSpec
from adapters.endpoint import check_endpoint, endpoint_engine_class
from adapters.endpoint import __main__ as endpoint_cli
from harness.core.paths import REPO_ROOT

GOLDEN = Path(__file__).with_name("golden") / "endpoint_kinds.json"

PRESETS = {"vllm": "vllm-serve", "sglang": "sglang-serve", "trtllm": "trtllm-serve",
           "infer-bench": "infer-bench-serve", "llamacpp": "llamacpp-serve", "generic": None}
GENERIC = {"kind": "generic", "launch": ["my-server", "--model", "{model}", "--served-model-name",
                                         "{served_model_name}", "--host", "{host}", "--port", "{port}"]}

# the points: (name, device, engine options, endpoint settings); the options each kind does not
# take are part of the record too (the problems its checks find)
GPU_ALL = {"kv_dtype": "fp8", "block_size": 32, "prefix_caching": True, "kv_cache_bytes": 1 << 30,
           "gpu_memory_utilization": 0.8, "tensor_parallel_size": 2, "chunked_prefill": True,
           "max_num_seqs": 64, "max_num_batched_tokens": 4096}
GPU_OFF = {"prefix_caching": False, "chunked_prefill": False, "max_num_seqs": 8}
SPEC = {"ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 4},
        "draft": {"speculative_method": "draft", "num_speculative_tokens": 4, "draft_model": "/models/draft"},
        "eagle": {"speculative_method": "eagle", "num_speculative_tokens": 2, "draft_model": "/models/eagle"},
        "mtp": {"speculative_method": "mtp", "num_speculative_tokens": 1}}
OFFLOAD = {"prefix_caching": True, "kv_offload": True, "kv_offload_bytes": 2 * 10 ** 9}

# a fixed point's requests: (prompt ids, max_new_tokens, messages)
REQUESTS = [([11, 12, 13, 14, 15, 16], 4, None), ([21, 22, 23], 7, None)]
CHAT = [([31, 32], 3, [{"role": "system", "ids": [41, 42]}, {"role": "user", "ids": [43, 44, 45]}])]


def kv_dtype_for(kind: str) -> str:
    from adapters.endpoint.kinds import KINDS
    return next((d for d in KINDS[kind].kv_dtypes if d != "auto"), "auto")


def flag_values(kind: str) -> dict[str, Any]:
    """A value for each of the kind's own flags: the first searched one, else the other setting
    of an on/off flag."""
    from adapters.endpoint.kinds import KINDS
    out: dict[str, Any] = {}
    for f in KINDS[kind].flags:
        if isinstance(f.tune, list) and f.tune:
            out[f.name] = f.tune[0]
        elif f.type is bool and isinstance(f.default, bool):
            out[f.name] = not f.default
    return out


def points(kind: str) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    gpu_all = {**GPU_ALL, "kv_dtype": kv_dtype_for(kind)}
    out = [("cpu-default", "cpu", {}, {}),
           ("gpu-all", "cuda", gpu_all, {"server_version": "1.1.0"}),
           ("gpu-off", "cuda", GPU_OFF, {}),
           ("cpu-all", "cpu", {k: v for k, v in gpu_all.items() if k != "tensor_parallel_size"}, {})]
    out += [(f"spec-{m}", "cuda", o, {}) for m, o in SPEC.items()]
    out += [("offload", "cuda:1", OFFLOAD, {}),
            ("flags", "cuda", {"server_flags": flag_values(kind)}, {"server_version": "1.1.0"}),
            ("chat", "cuda", {}, {"api": "chat", "chat_separator": " "})]
    return out


def raw_config(kind: str, settings: dict[str, Any]) -> dict[str, Any]:
    name = PRESETS[kind]
    raw = yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / f"{name}.yaml").read_text()) if name else dict(GENERIC)
    raw.pop("python", None)
    return {**raw, "dry_run": True, **settings}


def field(plan: Any, name: str) -> Any:
    """A launch plan's field (a mapping before the split, a dataclass after)."""
    return plan[name] if isinstance(plan, dict) else getattr(plan, name)


def record_point(kind: str, device: str, options: dict[str, Any], settings: dict[str, Any], ckpt: Path,
                 run_dir: Path) -> dict[str, Any]:
    name = PRESETS[kind] or "generic"
    cfg, problems = check_endpoint(name, raw_config(kind, settings))
    assert cfg is not None, problems
    cls = endpoint_engine_class(name, cfg)
    spec = ModelSpec(str(ckpt), "tiny", "bfloat16" if device != "cpu" else "float32", device, 512, threads=2,
                     cpus=(0, 1), run_dir=str(run_dir))
    out: dict[str, Any] = {"config_problems": problems, "option_problems": cls.check_options(options, spec)}
    eng = cls()
    try:
        plan = eng.launch_plan(spec, options, port=8000)
        out["plan"] = {k: field(plan, k) for k in ("command", "env", "files", "options_used", "differing",
                                                   "settings")}
    except Exception as e:  # an option the mapping refuses: its message is the behaviour
        out["plan"] = f"{type(e).__name__}: {e}"
    try:
        eng.load(spec, options)
        out["dry_run"] = "load() did not stop at the dry run"
    except Exception as e:
        out["dry_run"] = f"{type(e).__name__}: {e}"
    finally:
        eng.close()
    return out


def classmethods(kind: str) -> dict[str, Any]:
    """What the engine class says without a server: launched (the preset) and attached (a url with
    declared options)."""
    out: dict[str, Any] = {}
    attached = {"kind": kind, "url": "http://127.0.0.1:9/v1",
                "attached_options": {"prefix_caching": True, "kv_dtype": kv_dtype_for(kind)}}
    for how, raw in (("launched", raw_config(kind, {})), ("attached", attached)):
        cfg, problems = check_endpoint(PRESETS[kind] or "generic", raw)
        assert cfg is not None, problems
        cls = endpoint_engine_class(PRESETS[kind] or "generic", cfg)
        flags, why = cls.tuning_flags()
        out[how] = {"capabilities": cls.capabilities({}).to_dict(), "tuning_flags": sorted(flags), "no_tuning": why,
                    "unavailable": cls.unavailable_reason(), "config_problems": problems}
    return out


def request_bodies(kind: str, settings: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    name = PRESETS[kind] or "generic"
    cfg, problems = check_endpoint(name, raw_config(kind, settings))
    assert cfg is not None, problems
    eng = endpoint_engine_class(name, cfg)()
    eng.spec = ModelSpec(str(ckpt), "tiny", "float32", "cpu", 512)
    eng.model_name = "served-tiny"
    requests = CHAT if settings.get("api") == "chat" else REQUESTS
    out: dict[str, Any] = {"path": eng.bodies.path}
    try:
        out["payloads"] = [list(eng.bodies.payload(ids, n, msgs)) for ids, n, msgs in requests]
    except Exception as e:
        out["payloads"] = f"{type(e).__name__}: {e}"
    from adapters.endpoint.kinds import KINDS
    if KINDS[kind].scores:
        out["scores"] = eng.bodies.scores([5, 6, 7, 8], 3)
    return out


def cli_text(kind: str, argv: list[str], tmp_path: Path, capsys) -> dict[str, Any]:
    name = PRESETS[kind]
    if name is None:
        path = tmp_path / "generic.yaml"
        path.write_text(yaml.safe_dump(GENERIC))
        name = str(path)
    rc = endpoint_cli.main([name, *argv])
    out, err = capsys.readouterr()
    return {"rc": rc, "stdout": out, "stderr": err}


def normalised(obj: Any, subs: dict[str, str]) -> Any:
    """The record with this machine's paths and the free port the CLI picked replaced by names."""
    text = json.dumps(obj, indent=1, sort_keys=True, default=str)
    for old, new in sorted(subs.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(old, new)
    return json.loads(text)


def port_free(text: str) -> str:
    """A dry run's free port (the OS picks it) written as <port>."""
    ports = set(re.findall(r"(?:--port[ =]|port=)(\d+)", text))
    for p in ports:
        text = re.sub(rf"\b{p}\b", "<port>", text)
    return text


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt: Path) -> Path:
    return tiny_ckpt


def test_every_kind_is_recorded():
    """A new server kind is recorded too (its preset here, then INFER_BENCH_GOLDEN=update)."""
    from adapters.endpoint.kinds import KINDS
    assert set(PRESETS) == set(KINDS)


def test_what_the_endpoint_engine_sends_is_unchanged(ckpt, tmp_path, capsys):
    run_dir = tmp_path / "run"
    record: dict[str, Any] = {}
    for kind in PRESETS:
        per: dict[str, Any] = {}
        for point, device, options, settings in points(kind):
            got = record_point(kind, device, options, settings, ckpt, run_dir)
            got["dry_run"] = port_free(got["dry_run"])
            per[point] = got
        per["classmethods"] = classmethods(kind)
        per["bodies"] = request_bodies(kind, {}, ckpt)
        per["bodies-chat"] = request_bodies(kind, {"api": "chat", "chat_separator": " "}, ckpt)
        per["cli-cpu"] = cli_text(kind, ["--device", "cpu", "--dtype", "float32", "--model", str(ckpt)],
                                  tmp_path, capsys)
        per["cli-gpu"] = cli_text(kind, ["--model", str(ckpt), "--max-model-len", "1024",
                                         "--option", "max_num_seqs=16", "--option", "prefix_caching=false",
                                         "--set", "server_version=1.1.0"], tmp_path, capsys)
        for k in ("cli-cpu", "cli-gpu"):
            per[k]["stdout"] = port_free(per[k]["stdout"])
        record[kind] = per
    subs = {str(ckpt): "<model>", ckpt.name: "<model-name>", str(run_dir): "<run_dir>", sys.executable: "<python>",
            tempfile.gettempdir() + "/": "<tmp>/", str(tmp_path): "<tmp_path>"}
    got = normalised(record, subs)
    if os.environ.get("INFER_BENCH_GOLDEN") == "update":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert GOLDEN.is_file(), f"no record at {GOLDEN}: write it with INFER_BENCH_GOLDEN=update (and review it)"
    want = json.loads(GOLDEN.read_text())
    assert set(got) == set(want)
    for kind in want:
        for point in want[kind]:
            assert got[kind][point] == want[kind][point], f"{kind} {point}"
        assert set(got[kind]) == set(want[kind]), kind

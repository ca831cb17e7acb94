"""`python -m adapters.llamacpp.serve --model DIR --dtype DTYPE [--weights W] [--draft-model DIR]
[--ctx-per-slot N] [--server PATH] -- LLAMA_SERVER_ARGS...`: the llamacpp-serve endpoint's launch
(conf/endpoint/llamacpp-serve.yaml). Converts the checkpoint (and a draft model) to GGUF with our
converter (cached), checks every argument against the built `llama-server --help`, then replaces
itself with llama-server (exec: the same process, so the harness's supervisor stops the server).

`-c` is `--ctx-per-slot` x the slots (`-np`, 1 unless given): llama-server splits its context over
its slots, and each request needs max_model_len of it. Exit 2 with one line on bad input (a
checkpoint the converter cannot write, a flag this build lacks, no llama-server)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from adapters.llamacpp import convert, env
from adapters.llamacpp.options import INSTALL_HINT

EXIT_BAD_INPUT = 2


def find_server(explicit: str | None = None) -> Path | None:
    """llama-server: --server, else $INFER_BENCH_LLAMA_SERVER, else the one of llama.cpp's environment
    (.venv-llamacpp or $INFER_BENCH_LLAMACPP_PYTHON), else this interpreter's."""
    from harness.core.paths import REPO_ROOT
    for cand in (explicit, os.environ.get("INFER_BENCH_LLAMA_SERVER")):
        if cand:
            return Path(cand) if Path(cand).is_file() else None
    py = env.environment_python(REPO_ROOT)
    found = env.server_binary(py) if py else None
    return found or env.server_binary()


@lru_cache(maxsize=4)
def help_flags(server: str) -> frozenset[str]:
    """Every flag spelling `llama-server --help` of this build lists (e.g. -np, --parallel)."""
    r = subprocess.run([server, "--help"], capture_output=True, text=True, timeout=60)
    names: set[str] = set()
    for line in (r.stdout + r.stderr).splitlines():
        s = line.strip()
        if not s.startswith("-"):
            continue
        head = re.split(r"\s{2,}(?=[^-\s])", s)[0]  # the flags' column: the description follows 2+ spaces
        names.update(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", head))
    return frozenset(names)


def unknown_flags(args: list[str], known: frozenset[str]) -> list[str]:
    return [a for a in args if a.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", a)
            and a.split("=", 1)[0] not in known]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        ours, server_args = argv[:i], argv[i + 1:]
    else:
        ours, server_args = argv, []
    ap = argparse.ArgumentParser(prog="python -m adapters.llamacpp.serve")
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--ctx-per-slot", type=int, default=None)
    ap.add_argument("--server", default=None)
    ap.add_argument("--cache-dir", default=None)
    a = ap.parse_args(ours)
    if "--ib-draft-model" in server_args:  # the kind's speculation mapping names the draft's checkpoint so
        i = server_args.index("--ib-draft-model")
        a.draft_model = server_args[i + 1]
        del server_args[i:i + 2]
    server = find_server(a.server)
    if server is None:
        print(f"llamacpp-serve: no llama-server found: {INSTALL_HINT}", file=sys.stderr)
        return EXIT_BAD_INPUT
    bad = unknown_flags(server_args, help_flags(str(server)))
    if bad:
        print(f"llamacpp-serve: this llama-server ({server}) has no flag {', '.join(bad)} (see its --help)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    from harness.core.paths import model_cache_dir
    cache = model_cache_dir(a.cache_dir)
    weights = convert.DTYPE_WEIGHTS.get(a.dtype, "f32") if a.weights == "auto" else a.weights
    try:
        main_gguf = convert.ensure_gguf(Path(a.model), cache, weights)
        draft = convert.ensure_gguf(Path(a.draft_model), cache, weights) if a.draft_model else None
    except convert.ConversionError as e:
        print(f"llamacpp-serve: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    slots = 1
    for flag in ("-np", "--parallel"):
        if flag in server_args:
            slots = max(1, int(server_args[server_args.index(flag) + 1]))
    cmd = [str(server), "-m", str(main_gguf.path)]
    if a.ctx_per_slot:
        cmd += ["-c", str(a.ctx_per_slot * slots)]
    if "-np" not in server_args and "--parallel" not in server_args:
        cmd += ["-np", "1"]
    if draft is not None:
        cmd += ["-md", str(draft.path)]
    cmd += server_args
    print(f"llamacpp-serve: GGUF {main_gguf.path} ({main_gguf.record['tokenizer']}; "
          f"{'cached' if main_gguf.cached else 'converted'})" + (f", draft {draft.path}" if draft else ""),
          file=sys.stderr, flush=True)
    print("llamacpp-serve: exec " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())

"""`infer-bench-kv`: print the KV-cache size of a model at a sequence length and batch size.

    infer-bench-kv model=llama-2-70b seq_len=4096 batch_size=8 kv_dtype=fp16
    infer-bench-kv model=local model.path=DIR seq_len=2048 block_size=16
    infer-bench-kv all seq_len=2048 batch_size=1     # every preset, one line each
"""

from __future__ import annotations

import json
import sys

from harness.core.errors import EXIT_BAD_INPUT, UserError
from harness.core.kvcalc import KVEstimate, estimate, human_bytes
from harness.core.presets import load_preset, preset_names, shape_from_hf_config

USAGE = __doc__.strip()
_KEYS = {"model", "model.path", "seq_len", "batch_size", "kv_dtype", "block_size", "format"}


def _int(args: dict[str, str], key: str, default: int | None) -> int | None:
    if key not in args:
        return default
    try:
        return int(args[key])
    except ValueError:
        raise UserError(f"{key}={args[key]}: not an integer. Give a whole number, e.g. {key}=2048.") from None


def parse(argv: list[str]) -> tuple[list[str] | None, dict[str, str]]:
    args: dict[str, str] = {}
    every = False
    for a in argv:
        if a == "all":
            every = True
            continue
        if "=" not in a:
            raise UserError(f"'{a}': arguments are key=value pairs ({', '.join(sorted(_KEYS))}) or 'all'.")
        k, v = a.split("=", 1)
        k = k.lstrip("-")
        if k not in _KEYS:
            raise UserError(f"'{k}': unknown argument. Known: {', '.join(sorted(_KEYS))}.")
        args[k] = v
    return (preset_names() if every else None), args


def format_estimate(e: KVEstimate) -> str:
    block = f", rounded up to blocks of {e.block_size}" if e.block_size else ""
    return "\n".join([
        f"model            {e.model}  ({e.layers} layers, {e.attention_heads} attention heads, "
        f"{e.kv_heads} KV heads, head_dim {e.head_dim})",
        f"KV dtype         {e.kv_dtype}",
        f"bytes per token  {e.bytes_per_token:,} ({human_bytes(e.bytes_per_token)})"
        f"  = 2 x {e.layers} x {e.kv_heads} x {e.head_dim} x element bytes"
        + (" + int8 scales" if e.kv_dtype == "int8" else ""),
        f"sequence         {e.seq_len} tokens{block} -> {e.tokens_per_sequence} per sequence",
        f"batch            {e.batch_size}",
        f"total            {e.total_bytes:,} bytes = {e.gb:.2f} GB = {e.gib:.2f} GiB",
    ])


def format_table(rows: list[KVEstimate]) -> str:
    head = f"{'model':<14}{'layers':>7}{'heads':>7}{'kv_heads':>9}{'head_dim':>9}{'per token':>12}" \
           f"{'seq':>7}{'batch':>6}{'bytes':>18}{'GB':>9}{'GiB':>9}"
    lines = [head, "-" * len(head)]
    for e in rows:
        lines.append(f"{e.model:<14}{e.layers:>7}{e.attention_heads:>7}{e.kv_heads:>9}{e.head_dim:>9}"
                     f"{human_bytes(e.bytes_per_token):>12}{e.seq_len:>7}{e.batch_size:>6}"
                     f"{e.total_bytes:>18,}{e.gb:>9.2f}{e.gib:>9.2f}")
    return "\n".join(lines)


def run(argv: list[str]) -> str:
    if not argv or argv[0] in ("-h", "--help", "help"):
        return USAGE
    every, args = parse(argv)
    seq_len = _int(args, "seq_len", 2048)
    batch = _int(args, "batch_size", 1)
    block = _int(args, "block_size", None)
    kv_dtype = args.get("kv_dtype", "fp16")
    as_json = args.get("format", "text") == "json"
    if every is not None:
        rows = [estimate(load_preset(n), seq_len, batch, kv_dtype, block) for n in every]
        return json.dumps([r.to_dict() for r in rows], indent=2) if as_json else format_table(rows)
    model = args.get("model")
    if model is None:
        raise UserError(f"model is missing: give model=<preset> ({', '.join(preset_names())}) "
                        "or model=local model.path=DIR.")
    if model == "local" or "model.path" in args:
        if "model.path" not in args:
            raise UserError("model.path is missing: with model=local give model.path=DIR.")
        shape = shape_from_hf_config(args["model.path"])
    else:
        shape = load_preset(model)
    e = estimate(shape, seq_len, batch, kv_dtype, block)
    return json.dumps(e.to_dict(), indent=2) if as_json else format_estimate(e)


def main(argv: list[str] | None = None) -> int:
    try:
        print(run(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())

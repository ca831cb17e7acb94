"""`infer-bench-kv`: print the KV-cache size of a model at a sequence length and batch size, by
layer group (full, sliding window, chunked local, latent, linear/state-space: each with its
formula and share), beside what the dense formula would say.

    infer-bench-kv model=llama-2-70b seq_len=4096 batch_size=8 kv_dtype=fp16
    infer-bench-kv model=local model.path=DIR seq_len=2048 block_size=16
    infer-bench-kv model=Qwen/Qwen3-8B seq_len=32768    # a Hub id: its config.json only, no weights
                                                        # (model=hub model.id=ID [model.revision=REV])
    infer-bench-kv all seq_len=2048 batch_size=1     # every preset, one line each
"""

from __future__ import annotations

import json
import sys

from harness.core.errors import EXIT_BAD_INPUT, UserError
from harness.core.hub import resolve_model
from harness.core.kvcalc import KVEstimate, estimate, human_bytes
from harness.core.presets import load_preset, preset_names, shape_from_hf_config

USAGE = __doc__.strip()
_KEYS = {"model", "model.path", "model.id", "model.revision", "seq_len", "batch_size", "kv_dtype", "block_size",
         "format"}


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
    block = f", rounded up to blocks of {e.block_size}" if e.block_size else " (exact tokens, no blocks)"
    kinds = ", ".join(f"{g.layers} {g.kind}" + (f" (W={g.window})" if g.kind == "sliding" else
                                               f" (C={g.window})" if g.kind == "chunked" else "") for g in e.groups)
    lines = [
        f"model            {e.model}  ({e.layers} layers: {kinds}; {e.attention_heads} attention heads, "
        f"{e.kv_heads} KV heads, head_dim {e.head_dim})",
        f"KV dtype         {e.kv_dtype}",
        f"sequence         {e.seq_len} tokens{block}",
        f"batch            {e.batch_size}",
        "",
        f"{'group':<22}{'layers':>7}  {'per token':>11}  {'per sequence':>13}  {'tokens/seq':>10}  "
        f"{'bytes':>18}  {'share':>6}  formula",
    ]
    for g in e.groups:
        name = g.kind + (f" W={g.window}" if g.kind == "sliding" else f" C={g.window}" if g.kind == "chunked" else "")
        share = g.total_bytes / e.total_bytes if e.total_bytes else 0.0
        per_seq = f"{g.state_bytes:,}" if g.kind == "linear" else "-"
        per_tok = "-" if g.kind == "linear" else f"{g.bytes_per_token:,}"
        lines.append(f"{name:<22}{g.layers:>7}  {per_tok:>11}  {per_seq:>13}  {g.tokens_per_sequence:>10}  "
                     f"{g.total_bytes:>18,}  {share:>6.1%}  {g.formula}; tokens {g.tokens_formula}")
    lines += [
        "",
        f"bytes per token  {e.bytes_per_token:,} ({human_bytes(e.bytes_per_token)}) in the attention layers that keep it",
        f"total            {e.total_bytes:,} bytes = {e.gb:.2f} GB = {e.gib:.2f} GiB",
        f"dense formula    2 x {e.layers} x {e.kv_heads} x {e.head_dim} x element bytes = {e.dense_bytes_per_token:,} "
        f"B/token, every layer the whole sequence -> {e.dense_total_bytes:,} bytes: "
        + ("the same" if e.dense_total_bytes == e.total_bytes else f"{e.dense_factor:.2f}x the estimate"
           + (" (it omits the linear layers' state)" if any(g.kind == "linear" for g in e.groups) else "")),
    ]
    return "\n".join(lines)


_LETTER = {"full": "F", "sliding": "S", "chunked": "C", "latent": "M", "linear": "R"}


def format_table(rows: list[KVEstimate]) -> str:
    head = f"{'model':<20}{'layers':>7}{'kv_heads':>9}{'head_dim':>9}  {'groups':<34}{'per token':>12}" \
           f"{'seq':>8}{'batch':>6}{'bytes':>18}{'GB':>9}{'GiB':>9}{'dense/est':>10}"
    lines = [head, "-" * len(head)]
    for e in rows:
        groups = " ".join(f"{g.layers}{_LETTER[g.kind]}" + (str(g.window) if g.window else "") for g in e.groups)
        lines.append(f"{e.model:<20}{e.layers:>7}{e.kv_heads:>9}{e.head_dim:>9}  {groups:<34}"
                     f"{human_bytes(e.bytes_per_token):>12}{e.seq_len:>8}{e.batch_size:>6}"
                     f"{e.total_bytes:>18,}{e.gb:>9.2f}{e.gib:>9.2f}{e.dense_factor:>10.2f}")
    lines.append("groups: F full, S sliding (window), C chunked (chunk), M latent (MLA), R linear / state-space (a state per sequence); "
                 "dense/est: the dense formula's figure over the estimate")
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
        raise UserError(f"model is missing: give model=<preset> ({', '.join(preset_names())}), model=ORG/NAME "
                        "(a Hugging Face Hub id) or model=local model.path=DIR.")
    if model == "hub" or "/" in model:  # a Hub id: config.json alone is fetched (or read from the cache)
        problems: list[str] = []
        hub = resolve_model({"id": args.get("model.id") if model == "hub" else model,
                             "revision": args.get("model.revision")}, problems, only=("config.json",))
        if hub is None or hub.shape is None:
            raise UserError(problems)
        shape = hub.shape
    elif model == "local" or "model.path" in args:
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

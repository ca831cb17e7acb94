"""`infer-bench-model --preset tiny --out DIR`: write a preset as a local HF checkpoint.

The checkpoint has random weights drawn with a fixed seed, a config.json, model.safetensors
and a locally built tokenizer; `AutoModelForCausalLM.from_pretrained(DIR)` loads it.

`infer-bench-model --train --preset tiny-trained --out DIR` trains a trained preset
(harness.core.train: the Python standard library's source, a BPE tokenizer, minutes on a CPU) into
DIR and prints its held-out perplexity beside the baselines. Without --out it trains into the
model cache, where runs find it; a preset shipped with the project (tiny-trained,
harness/shipped/) is not trained again: its record is printed (runs use the shipped checkpoint).

`infer-bench-model --gguf [--weights q8_0] (--preset NAME | --path DIR) [--out FILE]` writes the
checkpoint as a GGUF file for llama.cpp with infer-bench's converter (adapters/llamacpp/convert.py):
into the model cache (gguf/), where the llamacpp engines find it, and to FILE if given. A checkpoint
the converter cannot write exits 2 with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from harness.core.errors import EXIT_BAD_INPUT, UserError
from harness.core.presets import load_preset, preset_names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="infer-bench-model", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None, help=f"one of: {', '.join(preset_names())}")
    ap.add_argument("--gguf", action="store_true", help="write the checkpoint as a GGUF file for llama.cpp")
    ap.add_argument("--weights", default="f32", help="with --gguf: f32 | f16 | bf16 | q8_0 | q4_0 (default f32)")
    ap.add_argument("--path", default=None, help="with --gguf: a local Hugging Face checkpoint instead of a preset")
    ap.add_argument("--out", default=None, help="directory to write (created; must be empty if it exists); "
                    "with --train, default: the model cache, where runs look for the preset")
    ap.add_argument("--train", action="store_true", help="train a trained preset (e.g. tiny-trained)")
    ap.add_argument("--steps", type=int, default=None, help="with --train: training steps (default: the preset's)")
    ap.add_argument("--model-cache-dir", default=None, help="with --train or --gguf: the model cache (default ~/.cache/infer-bench)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--dtype", default=None, help="storage dtype (default: the preset's)")
    ap.add_argument("--device", default="cpu", help="where to initialise the weights (cpu, cuda)")
    args = ap.parse_args(argv)
    if args.gguf:
        return _gguf(args)
    try:
        if args.preset is None:
            raise UserError("--preset is missing: give one of " + ", ".join(preset_names()) + ".")
        if args.preset not in preset_names():
            raise UserError(f"--preset {args.preset}: unknown preset. Choose one of {', '.join(preset_names())}.")
        shape = load_preset(args.preset)
        if args.train and not shape.trained:
            trained = [n for n in preset_names() if load_preset(n).trained]
            raise UserError(f"--preset {args.preset}: not a trained preset (it has no train: settings). "
                            f"With --train use one of {', '.join(trained)}.")
        if args.steps is not None:
            if not args.train or args.steps < 1:
                raise UserError(f"--steps {args.steps}: give a positive number of steps, with --train.")
            shape = type(shape)(**{**shape.to_dict(), "train": {**(shape.train or {}), "steps": args.steps}})
        if args.out is None and not shape.trained:
            raise UserError("--out is missing: give the directory to write the checkpoint into.")
        if args.dtype:
            if args.dtype not in ("float32", "bfloat16", "float16"):
                raise UserError(f"--dtype {args.dtype}: use float32, bfloat16 or float16.")
            shape = type(shape)(**{**shape.to_dict(), "dtype": args.dtype})
        out = Path(args.out) if args.out else None
        if out is not None and out.exists() and any(out.iterdir()):
            raise UserError(f"--out {out}: the directory exists and is not empty. Choose a new directory.")
    except UserError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    if shape.trained:
        return _train(shape, out, args)
    from harness.checkpoint import write_checkpoint
    write_checkpoint(shape, out, seed=args.seed, device=args.device)
    n = shape.num_parameters()
    print(f"wrote {shape.name} ({n/1e6:.1f} M parameters, {shape.dtype}, seed {args.seed}) to {out}")
    return 0


def _gguf(args: argparse.Namespace) -> int:
    """--gguf: the checkpoint (a preset materialised in the model cache, or --path) as a GGUF file."""
    import shutil

    from adapters.llamacpp.convert import WEIGHT_TYPES, ConversionError, ensure_gguf, unsupported_reason
    from harness.checkpoint import ensure_checkpoint
    from harness.core.paths import model_cache_dir
    try:
        if (args.preset is None) == (args.path is None):
            raise UserError("--gguf: give the checkpoint as --preset NAME or --path DIR (one of them).")
        if args.weights not in WEIGHT_TYPES:
            raise UserError(f"--weights {args.weights}: the converter writes {', '.join(WEIGHT_TYPES)}.")
        if args.preset is not None and args.preset not in preset_names():
            raise UserError(f"--preset {args.preset}: unknown preset. Choose one of {', '.join(preset_names())}.")
        if args.path is not None and not (Path(args.path) / "config.json").is_file():
            raise UserError(f"--path {args.path}: no config.json there. Give a Hugging Face checkpoint directory.")
        if args.out is not None and Path(args.out).exists():
            raise UserError(f"--out {args.out}: the file exists. Choose a new file name.")
        if args.preset is not None and unsupported_reason(load_preset(args.preset)):
            raise UserError(f"--preset {args.preset}: {unsupported_reason(load_preset(args.preset))}.")
        cache = model_cache_dir(args.model_cache_dir)
        ckpt = Path(args.path) if args.path else ensure_checkpoint(load_preset(args.preset), cache, args.seed)
        try:
            conv = ensure_gguf(ckpt, cache, args.weights)
        except ConversionError as e:
            raise UserError(f"--gguf: {e}") from None
    except UserError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    rec = conv.record
    print(f"{'cached' if conv.cached else 'wrote'} {conv.path} ({rec['bytes'] / 2**20:.1f} MiB, {rec['architecture']}, "
          f"weights {rec['weights']}, tokenizer: {rec['tokenizer']})")
    for line in rec.get("fallbacks") or []:
        print(f"  {line}")
    if args.out:
        shutil.copyfile(conv.path, args.out)
        print(f"copied to {args.out}")
    return 0


def _train(shape, out: Path | None, args: argparse.Namespace) -> int:
    from harness.checkpoint import cached_path, checksum_problems, ensure_checkpoint, shipped_checkpoint, write_trained
    from harness.core.paths import model_cache_dir
    from harness.core.train import TRAINING_FILE, summary_lines
    t0 = time.perf_counter()
    cached = False
    if out is None:
        cache = model_cache_dir(args.model_cache_dir)
        target = cached_path(shape, cache, args.seed)
        cached = (target / "config.json").exists()
        if cached and target == shipped_checkpoint(shape, args.seed):
            problems = checksum_problems(target)
            print(f"{shape.name}: shipped with infer-bench in {target}; runs use it, nothing is trained. "
                  f"Checksums: {'; '.join(problems) if problems else 'every file as recorded in SHA256SUMS'}.")
            print(f"  to train a copy of your own: infer-bench-model --train --preset {shape.name} --out DIR, "
                  "then model=local model.path=DIR (docs/metrics.md, \"Quality\": when and how to replace the "
                  "shipped one)")
        elif cached:
            print(f"{shape.name}: already trained and cached in {target}")
        else:
            print(f"{shape.name}: training into {target} ...", flush=True)
        out = ensure_checkpoint(shape, cache, args.seed)
    else:
        print(f"{shape.name}: training into {out} ...", flush=True)
        write_trained(shape, out, args.seed, cache_dir=model_cache_dir(args.model_cache_dir))
    record = json.loads((out / TRAINING_FILE).read_text())
    for line in summary_lines(record):
        print(line)
    if not cached:
        print(f"wrote {shape.name} ({shape.num_parameters() / 1e6:.1f} M parameters, seed {args.seed}) to {out} "
              f"in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

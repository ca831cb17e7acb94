"""`infer-bench-model --preset tiny --out DIR`: write a preset as a local HF checkpoint.

The checkpoint has random weights drawn with a fixed seed, a config.json, model.safetensors
and a locally built tokenizer; `AutoModelForCausalLM.from_pretrained(DIR)` loads it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.core.errors import EXIT_BAD_INPUT, UserError
from harness.core.presets import load_preset, preset_names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="infer-bench-model", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True, help=f"one of: {', '.join(preset_names())}")
    ap.add_argument("--out", required=True, help="directory to write (created; must be empty if it exists)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--dtype", default=None, help="storage dtype (default: the preset's)")
    ap.add_argument("--device", default="cpu", help="where to initialise the weights (cpu, cuda)")
    args = ap.parse_args(argv)
    try:
        if args.preset not in preset_names():
            raise UserError(f"--preset {args.preset}: unknown preset. Choose one of {', '.join(preset_names())}.")
        shape = load_preset(args.preset)
        if args.dtype:
            if args.dtype not in ("float32", "bfloat16", "float16"):
                raise UserError(f"--dtype {args.dtype}: use float32, bfloat16 or float16.")
            shape = type(shape)(**{**shape.to_dict(), "dtype": args.dtype})
        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise UserError(f"--out {out}: the directory exists and is not empty. Choose a new directory.")
    except UserError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    from harness.checkpoint import write_checkpoint
    write_checkpoint(shape, out, seed=args.seed, device=args.device)
    n = shape.num_parameters()
    print(f"wrote {shape.name} ({n/1e6:.1f} M parameters, {shape.dtype}, seed {args.seed}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

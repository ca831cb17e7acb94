"""`infer-bench-lora make --model MODEL --out DIR`: LoRA adapters (PEFT directories) for any
preset or checkpoint, to run the multi-adapter workloads with (docs/metrics.md, "LoRA adapters").

    infer-bench-lora make --model tiny-trained --out adapters/ --count 4 --rank 8 \\
        --targets q_proj,v_proj --seed 0

writes DIR/lora0 ... DIR/lora<count-1>, each a PEFT LoRA directory (adapter_config.json,
adapter_model.safetensors) written by PEFT's own `save_pretrained`, and prints them as the
`workload.lora.adapters={NAME:PATH,...}` override to give a run. MODEL is a preset (its config, nothing is
materialised), a checkpoint directory or a Hub id (its config.json).

The matrices are random, drawn with the seed (adapter i with seed + i), and B is not zero (PEFT's
own initialisation zeroes B, so that a new adapter changes nothing; here every adapter must
change the outputs, or a request served by the wrong adapter could not be told from the right
one): A ~ N(0, 1/in), B ~ N(0, sigma) with sigma chosen so that the update s·B·A of each
projection (s = alpha / r) has `--strength` times the standard deviation of the projection's
own weight (read from a checkpoint's weights; 1/sqrt(in) for a preset that is not on disk).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from harness.core.errors import EXIT_BAD_INPUT, UserError
from harness.core.lora import MODULES, module_sizes
from harness.core.presets import load_preset, preset_names, shape_from_hf_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="infer-bench-lora", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make", help="write LoRA adapters (PEFT directories) for a model")
    mk.add_argument("--model", required=True, help="a preset, a checkpoint directory or a Hub id ORG/NAME")
    mk.add_argument("--out", required=True, help="directory to write the adapters into (created; lora<i> must not exist)")
    mk.add_argument("--count", type=int, default=1, help="adapters to write (default 1)")
    mk.add_argument("--rank", type=int, default=8, help="LoRA rank r (default 8)")
    mk.add_argument("--alpha", type=float, default=None, help="lora_alpha (default 2 x rank: scaling 2)")
    mk.add_argument("--targets", default="q_proj,v_proj", help=f"modules, comma-separated, of {','.join(MODULES)}")
    mk.add_argument("--seed", type=int, default=0, help="seed of adapter 0 (adapter i: seed + i)")
    mk.add_argument("--strength", type=float, default=2.0,
                    help="the update's standard deviation relative to the weight's (default 2: every output of tiny-trained changes within 6 tokens)")
    mk.add_argument("--prefix", default="lora", help="adapter names: PREFIX0, PREFIX1, ... (default lora)")
    args = ap.parse_args(argv)
    try:
        model_dir, shape, ref = _model(args.model)
        targets = _check_args(args)
        out = Path(args.out)
        names = [f"{args.prefix}{i}" for i in range(args.count)]
        taken = [n for n in names if (out / n).exists()]
        if taken:
            raise UserError(f"--out {out}: {', '.join(taken)} already exist there. Choose another --out or --prefix.")
    except UserError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    written = make_adapters(model_dir, shape, ref, out, names, args.rank, args.alpha or 2.0 * args.rank, targets,
                            args.seed, args.strength)
    for name, path in written:
        print(f"wrote {name}: {path} (r={args.rank}, {', '.join(targets)}, seed {args.seed + names.index(name)})")
    print("workload.lora.adapters={" + ",".join(f"{n}:{p}" for n, p in written) + "}")
    return 0


def _check_args(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.count < 1:
        problems.append(f"--count {args.count}: write at least 1 adapter.")
    if args.rank < 1:
        problems.append(f"--rank {args.rank}: the rank must be at least 1.")
    if args.strength <= 0:
        problems.append(f"--strength {args.strength}: give a positive number (0.5: half the weight's spread).")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in targets if t not in MODULES]
    if bad or not targets:
        problems.append(f"--targets {args.targets}: {', '.join(bad) or 'none given'}; choose from {', '.join(MODULES)}.")
    if problems:
        raise UserError(problems)
    return targets


def _model(ref: str) -> tuple[Path | None, Any, str]:
    """(checkpoint directory or None, ModelShape, the reference as recorded)."""
    if ref in preset_names():
        shape = load_preset(ref)
        from harness.checkpoint import shipped_checkpoint
        shipped = shipped_checkpoint(shape) if shape.trained else None
        return shipped, shape, ref
    path = Path(ref).expanduser()
    if path.is_dir():
        return path, shape_from_hf_config(path, field="--model"), str(path.resolve())
    if ref.count("/") == 1 and not path.exists():
        from harness.core.hub import resolve_model
        problems: list[str] = []
        hub = resolve_model({"id": ref}, problems, only=("config.json",))
        if hub is None:
            raise UserError([p.replace("model.id", "--model") for p in problems])
        return None, shape_from_hf_config(hub.path, field="--model"), ref
    raise UserError(f"--model {ref}: not a preset ({', '.join(preset_names())}), a checkpoint directory or a Hub id.")


def _weight_std(model_dir: Path | None, key: str, n_in: int) -> float:
    """The standard deviation of the base model's weight `key`, or 1/sqrt(in) without weights."""
    if model_dir is None:
        return 1.0 / math.sqrt(n_in)
    from safetensors import safe_open
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if key in st.keys():
                return float(st.get_tensor(key).float().std())
    return 1.0 / math.sqrt(n_in)


def make_adapters(model_dir: Path | None, shape: Any, ref: str, out: Path, names: list[str], rank: int, alpha: float,
                  targets: list[str], seed: int, strength: float) -> list[tuple[str, str]]:
    """Write one PEFT adapter per name into out/<name>; (name, directory) of each."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_dir is not None and (model_dir / "config.json").is_file():
        cfg = AutoConfig.from_pretrained(str(model_dir))
    else:
        cfg = AutoConfig.for_model(**shape.hf_config_dict())
    with torch.device("meta"):  # the module tree only: no weights are allocated
        model = AutoModelForCausalLM.from_config(cfg)
    sizes = module_sizes(shape)
    scaling = alpha / rank
    stds = {t: _weight_std(model_dir, f"model.layers.0.{'self_attn' if t in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}"
                           f".{t}.weight", sizes[t][0]) for t in targets}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, name in enumerate(names):
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                                      lora_dropout=0.0, bias="none"))
        g = torch.Generator().manual_seed(seed + i)
        for pname, p in list(peft_model.named_parameters()):
            if ".lora_A." not in pname and ".lora_B." not in pname:
                continue
            module = peft_model.get_submodule(pname.rsplit(".", 1)[0])
            target = next(t for t in targets if f".{t}." in pname)
            n_in = sizes[target][0]
            if ".lora_A." in pname:
                w = torch.randn(tuple(p.shape), generator=g) / math.sqrt(n_in)
            else:  # var(update) = s^2 r var(A) var(B) = (strength std(W))^2
                sigma = strength * stds[target] * math.sqrt(n_in) / (scaling * math.sqrt(rank))
                w = torch.randn(tuple(p.shape), generator=g) * sigma
            module.weight = torch.nn.Parameter(w.to(torch.float32), requires_grad=False)
        peft_model.peft_config["default"].base_model_name_or_path = ref
        peft_model.save_pretrained(str(out / name), save_embedding_layers=False)  # no look-up of the base model
        (out / name / "README.md").unlink(missing_ok=True)  # PEFT's model-card template: nothing of ours
        model = peft_model.unload()  # the bare module tree again for the next adapter
        written.append((name, str((out / name).resolve())))
    return written


if __name__ == "__main__":
    sys.exit(main())

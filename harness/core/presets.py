"""Model shapes: the presets in conf/model/ and users' own checkpoints (config.json).

A `ModelShape` carries exactly what the harness needs to know about a decoder: sizes for the
KV-cache estimator and the roofline, and enough to build a Hugging Face config when a preset is
materialised as a random-weight checkpoint (see `harness.checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from harness.core.errors import UserError
from harness.core.families import family_fields
from harness.core.paths import CONF_DIR, model_cache_dir
from harness.core.results import atomic_write_text

# ModelShape and the families a preset may name live in harness.core.shapes; re-exported here for
# the callers that import them from presets.
from harness.core.shapes import ARCHITECTURES, SHAPE_FIELDS, ModelShape  # noqa: E402,F401


# conf/model/ files that are not presets: your own checkpoint, and a model by its Hub id
NOT_PRESETS = ("local", "hub")


def preset_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem not in NOT_PRESETS)


def shape_from_mapping(data: dict[str, Any], prefix: str = "model") -> ModelShape:
    """Build a ModelShape from a preset mapping (extra keys such as `path` are ignored); a layer
    list that does not fit the shape is a UserError naming the field."""
    shape = ModelShape(**{k: v for k, v in data.items() if k in SHAPE_FIELDS}).check(prefix)
    _check_tokenizer_from(shape, prefix)
    return shape


def _check_tokenizer_from(shape: ModelShape, prefix: str) -> None:
    """A trained preset that reuses another's tokenizer (`train.tokenizer_from`) names a trained
    preset that can lend it (harness.core.train.tokenizer_source_problems); UserError if not."""
    name = (shape.train or {}).get("tokenizer_from")
    if name is None:
        return
    from harness.core.train import tokenizer_source_problems
    field = f"{prefix}.train.tokenizer_from={name}"
    def mapping(n: str) -> dict[str, Any]:
        with open(CONF_DIR / "model" / f"{n}.yaml") as f:
            return yaml.safe_load(f) or {}

    if name == shape.name or name not in preset_names():
        trained = [n for n in preset_names() if n != shape.name and mapping(n).get("train") is not None]
        raise UserError(f"{field}: {'a preset cannot reuse its own tokenizer' if name == shape.name else 'no such preset'}. "
                        f"Name a trained preset whose tokenizer to reuse: {', '.join(trained)}.")
    # the source read as its shape only (not checked for a tokenizer_from of its own: no recursion)
    source = ModelShape(**{k: v for k, v in mapping(name).items() if k in SHAPE_FIELDS})
    problems = tokenizer_source_problems(shape, source, field)
    if problems:
        raise UserError(problems)


def load_preset(name: str) -> ModelShape:
    path = CONF_DIR / "model" / f"{name}.yaml"
    if name in NOT_PRESETS or not path.exists():
        raise UserError(
            f"model={name}: unknown model preset. Choose one of {', '.join(preset_names())}, "
            "model=ORG/NAME for a model on the Hugging Face Hub, or model=local model.path=DIR for your own "
            "checkpoint."
        )
    with open(path) as f:
        return shape_from_mapping(yaml.safe_load(f), prefix=f"model={name} (conf/model/{name}.yaml): model")


def shape_from_hf_config(path: str | Path, field: str = "model.path") -> ModelShape:
    """Read the shape of a local Hugging Face checkpoint. config.json is read in one place only,
    here, through transformers' `AutoConfig` (so defaults such as rms_norm_eps are the
    architecture's own); UserError names what is wrong with the checkpoint."""
    p = Path(path).expanduser()
    directory = p if p.is_dir() else p.parent
    if not p.exists():
        raise UserError(f"{field}={path}: no such file or directory. Give the path of a local "
                        "Hugging Face checkpoint (a directory with config.json and *.safetensors).")
    if not (directory / "config.json").is_file():
        raise UserError(f"{field}={path}: no config.json there. Give the directory of a Hugging Face "
                        "causal-LM checkpoint (config.json + *.safetensors).")
    key = _shape_key(directory)
    cached = _cached_shape(key, directory) if key else None
    if cached is not None:
        return cached
    shape = _read_hf_config(directory, path, field)
    if key:
        try:
            atomic_write_text(_shape_cache_file(key), json.dumps(asdict(shape)))
        except OSError:
            pass  # a read-only cache only costs the next command the same seconds
    return shape


# transformers' AutoConfig imports torch and transformers' model registry: seconds on every
# command that names a checkpoint (the regression gate runs the CLI a dozen times a job). What it
# made of a config.json is kept, keyed by the file's bytes, transformers' version and this
# module's own source, so any change to either side reads the config again.
def _shape_key(directory: Path) -> str | None:
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        version = "none"
    try:
        parts = [(directory / "config.json").read_bytes(), version.encode(), Path(__file__).read_bytes(),
                 (Path(__file__).parent / "shapes.py").read_bytes(), (Path(__file__).parent / "families.py").read_bytes()]
    except OSError:
        return None
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:32]


def _shape_cache_file(key: str) -> Path:
    return model_cache_dir(None) / ".shapes" / f"{key}.json"


def _cached_shape(key: str, directory: Path) -> ModelShape | None:
    try:
        fields = json.loads(_shape_cache_file(key).read_text())
        return ModelShape(**{**fields, "name": directory.name})
    except (OSError, ValueError, TypeError):
        return None


def _read_hf_config(directory: Path, path: str | Path, field: str) -> ModelShape:
    # transformers is heavy and only needed for users' own checkpoints: imported here
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{field}={path}: config.json cannot be read as a transformers config ({first}). "
                        "Point to an intact Hugging Face causal-LM checkpoint.") from None
    archs = list(getattr(cfg, "architectures", None) or [])
    if not hasattr(cfg, "num_hidden_layers") and getattr(cfg, "text_config", None) is not None:
        cfg = cfg.text_config  # a multimodal wrapper (Gemma 3, Llama 4): its language model
    model_type = getattr(cfg, "model_type", "") or ""
    if not any(str(a).endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs):
        raise UserError(f"{field}={path}: config.json does not describe a causal language model "
                        f"(architectures={archs or 'missing'}). Use a *ForCausalLM checkpoint.")
    heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32"
    rope_params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if isinstance(rope_params.get("full_attention"), dict):  # Gemma 3: per layer type; the global layers'
        rope_params = dict(rope_params["full_attention"])
    rope = getattr(cfg, "rope_theta", None) or rope_params.get("rope_theta", 10000.0)
    rope_type = rope_params.get("rope_type") or rope_params.get("type") or "default"
    fam = family_fields(cfg, model_type, f"{field}={path}: config.json")
    window = fam.pop("sliding_window", None)
    return ModelShape(
        name=directory.name,
        architecture=model_type or "unknown",
        num_hidden_layers=int(cfg.num_hidden_layers),
        hidden_size=int(cfg.hidden_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        intermediate_size=int(fam.pop("intermediate_size", None) or getattr(cfg, "intermediate_size", None)
                              or 4 * int(cfg.hidden_size)),
        vocab_size=int(cfg.vocab_size),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", None) or 2048),
        rope_theta=float(rope),
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", None) or 1e-6),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(cfg, "attention_bias", model_type == "qwen2")),
        dtype=str(dtype).removeprefix("torch."),
        bos_token_id=_first_id(getattr(cfg, "bos_token_id", None)),
        eos_token_id=_first_id(getattr(cfg, "eos_token_id", None)),
        pad_token_id=_first_id(getattr(cfg, "pad_token_id", None)),
        hf_architecture=str(archs[0]),
        rope_scaling=None if rope_type == "default" else {**rope_params, "rope_type": rope_type},
        sliding_window=int(window) if window else None,
        **fam,
    ).check(f"{field}={path}: config.json")


def _first_id(v: Any) -> int | None:
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    return int(v) if isinstance(v, int) else None


@dataclass(frozen=True)
class TokenRange:
    """Token ids synthetic prompts may use: [low, high) minus `avoid` (sorted)."""

    low: int = 0
    high: int = 0
    avoid: tuple[int, ...] = ()


def prompt_token_range(shape: ModelShape, path: str | Path) -> TokenRange:
    """Token ids synthetic prompts may use: [0, vocab_size) minus the special tokens (the
    config's bos/eos/pad and the tokenizer's added tokens)."""
    avoid = {i for i in (shape.bos_token_id, shape.eos_token_id, shape.pad_token_id) if i is not None}
    try:
        tok = json.loads((Path(path) / "tokenizer_config.json").read_text())
        avoid |= {int(i) for i in (tok.get("added_tokens_decoder") or {})}
    except (OSError, ValueError, AttributeError):
        pass
    return TokenRange(0, shape.vocab_size, tuple(sorted(i for i in avoid if 0 <= i < shape.vocab_size)))


def resolve_shape(model_cfg: dict[str, Any]) -> ModelShape:
    """The shape for a `model` config group: a preset's own fields, or the checkpoint's config."""
    path = model_cfg.get("path")
    if path and path != "???":
        return shape_from_hf_config(path)
    name = model_cfg.get("name")
    if name == "local":
        raise UserError("model.path is missing: with model=local give model.path=DIR "
                        "(a local Hugging Face checkpoint directory).")
    return shape_from_mapping(model_cfg)

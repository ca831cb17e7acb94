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
from harness.core.paths import CONF_DIR, model_cache_dir
from harness.core.results import atomic_write_text

# Hugging Face architecture class and model_type for each family a preset may name.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    architecture: str  # llama | mistral | qwen2
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: str = "float32"  # dtype the checkpoint's weights are stored in
    # special tokens (a checkpoint's config.json; presets write 1, 2 and 0)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # what a checkpoint's config says beyond the sizes (None for presets: plain RoPE, full attention)
    hf_architecture: str | None = None  # e.g. LlamaForCausalLM
    rope_scaling: dict | None = field(default=None, hash=False)  # {"rope_type": linear | llama3 | ..., params}
    sliding_window: int | None = None  # the attention window, when the model uses one
    # a trained preset's `train:` settings (harness.core.train.TrainConfig); None: random weights
    train: dict | None = field(default=None, hash=False)

    # ---- derived sizes -------------------------------------------------------------------
    def num_parameters(self) -> int:
        """Exact parameter count of a LLaMA-family decoder with this shape."""
        h, d = self.hidden_size, self.head_dim
        q = self.num_attention_heads * d
        kv = self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h  # two RMSNorm weights
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_hidden_layers * per_layer + embed + head + h  # + final norm

    def hf_config_dict(self) -> dict[str, Any]:
        """A config.json for transformers, for this shape."""
        cls, model_type = ARCHITECTURES[self.architecture]
        cfg: dict[str, Any] = {
            "architectures": [cls],
            "model_type": model_type,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "bos_token_id": 1 if self.bos_token_id is None else self.bos_token_id,
            "eos_token_id": 2 if self.eos_token_id is None else self.eos_token_id,
            "pad_token_id": 0 if self.pad_token_id is None else self.pad_token_id,
            "torch_dtype": self.dtype,
            "use_cache": True,
        }
        if self.architecture == "llama":
            cfg["attention_bias"] = self.attention_bias
            cfg["mlp_bias"] = False
        elif self.architecture == "mistral":
            cfg["sliding_window"] = None
        elif self.architecture == "qwen2":
            cfg["use_sliding_window"] = False
            cfg["sliding_window"] = None
            cfg["max_window_layers"] = self.num_hidden_layers
        return cfg

    @property
    def trained(self) -> bool:
        """A preset whose weights are trained here (harness.core.train), not drawn at random."""
        return self.train is not None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["train"] is None:  # random presets: the dict (and their cache keys) as before
            del d["train"]
        return d


def preset_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem != "local")


_SHAPE_FIELDS = set(ModelShape.__dataclass_fields__)


def shape_from_mapping(data: dict[str, Any]) -> ModelShape:
    """Build a ModelShape from a preset mapping (extra keys such as `path` are ignored)."""
    return ModelShape(**{k: v for k, v in data.items() if k in _SHAPE_FIELDS})


def load_preset(name: str) -> ModelShape:
    path = CONF_DIR / "model" / f"{name}.yaml"
    if name == "local" or not path.exists():
        raise UserError(
            f"model={name}: unknown model preset. Choose one of {', '.join(preset_names())}, "
            "or use model=local model.path=DIR for your own checkpoint."
        )
    with open(path) as f:
        return shape_from_mapping(yaml.safe_load(f))


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
        parts = [(directory / "config.json").read_bytes(), version.encode(), Path(__file__).read_bytes()]
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
    cfg = getattr(cfg, "text_config", None) or cfg if not hasattr(cfg, "num_hidden_layers") else cfg
    archs = list(getattr(cfg, "architectures", None) or [])
    model_type = getattr(cfg, "model_type", "") or ""
    if not any(str(a).endswith("ForCausalLM") for a in archs):
        raise UserError(f"{field}={path}: config.json does not describe a causal language model "
                        f"(architectures={archs or 'missing'}). Use a *ForCausalLM checkpoint.")
    heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32"
    rope_params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    rope = getattr(cfg, "rope_theta", None) or rope_params.get("rope_theta", 10000.0)
    rope_type = rope_params.get("rope_type") or rope_params.get("type") or "default"
    window = getattr(cfg, "sliding_window", None)
    mistral = model_type == "mistral" or any(str(a).startswith("Mistral") for a in archs)
    uses_window = bool(window) and (mistral or bool(getattr(cfg, "use_sliding_window", False)))
    return ModelShape(
        name=directory.name,
        architecture=model_type if model_type in ARCHITECTURES else model_type or "unknown",
        num_hidden_layers=int(cfg.num_hidden_layers),
        hidden_size=int(cfg.hidden_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        intermediate_size=int(getattr(cfg, "intermediate_size", None) or 4 * int(cfg.hidden_size)),
        vocab_size=int(cfg.vocab_size),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", None) or 2048),
        rope_theta=float(rope),
        rms_norm_eps=float(cfg.rms_norm_eps),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(cfg, "attention_bias", model_type == "qwen2")),
        dtype=str(dtype).removeprefix("torch."),
        bos_token_id=_first_id(getattr(cfg, "bos_token_id", None)),
        eos_token_id=_first_id(getattr(cfg, "eos_token_id", None)),
        pad_token_id=_first_id(getattr(cfg, "pad_token_id", None)),
        hf_architecture=str(archs[0]),
        rope_scaling=None if rope_type == "default" else {**rope_params, "rope_type": rope_type},
        sliding_window=int(window) if uses_window else None,
    )


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

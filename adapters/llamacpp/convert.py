"""Our own GGUF converter: a Hugging Face checkpoint the harness runs -> a GGUF file llama.cpp loads.

Written on gguf-py (the `gguf` package: its writer, its tensor-name map and its quantizers), after
reading llama.cpp's loader (src/llama-vocab.cpp, src/llama-model.cpp) for what each key means; no
code of llama.cpp's own converter is used. Pure Python and numpy: it runs in the harness's
environment (`infer-bench-model --gguf`) and in llama.cpp's (the engine converts at load).

What is written (docs/engines/llamacpp.md, "The converter"):

- **Families**: llama (and mistral without a window) as llama.cpp's `llama`; qwen2 as `qwen2`;
  qwen3 as `qwen3` (its q/k norms). Anything else is unsupported, with the reason
  (`unsupported_reason`, checked when the run is planned).
- **Tensors**: named by gguf-py's tensor-name map. llama.cpp's `llama` architecture rotates
  adjacent pairs (rope type NORM) where Hugging Face's Llama rotates halves, so q_proj and k_proj
  rows (and their biases) are permuted per head from halves to pairs; qwen2/qwen3 rotate halves in
  llama.cpp too (NEOX) and are written as they are. A tied LM head is left out (llama.cpp then
  reads the embedding table).
- **Weights**: f32, f16, bf16, q8_0, q4_0 (gguf-py's quantizers; q8_0: 34 bytes per 32 values,
  q4_0: 18). Norms and biases stay f32; a matrix whose rows do not split into blocks of 32 is
  written f16 instead of a block type, and the sidecar says which.
- **Tokenizer**: byte-level BPE (`tiny-trained`, GPT-2-style checkpoints) as llama.cpp's `gpt2`
  model with the merges and the pre-tokenizer whose split equals ours (`gpt-2` for tokenizers'
  ByteLevel regex; `llama-bpe` and `qwen2` for those models' Split regexes); the synthetic presets'
  WordLevel vocabulary (whitespace-separated words) as llama.cpp's word-piece model (`bert`):
  every word stored as a word start ("\u2581" + word), so a text of the vocabulary's words
  tokenizes to the same ids and generated ids detokenize to the same words; llama.cpp's word-piece
  tokenizer adds its BOS and SEP around every text it tokenizes with special tokens, so the engines
  send these models token ids only. Control tokens (the checkpoint's special added tokens),
  bos/eos/unk/pad ids and add_bos / add_eos as the checkpoint's tokenizer says.
- **Cache**: `<model cache>/gguf/<checkpoint name>-<key>.gguf`, the key a digest of the
  checkpoint's files and the options; a sidecar `.json` records what was written.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CONVERTER_FORMAT = 1  # bump when what a GGUF holds for the same checkpoint and options changes
WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
BLOCK_TYPES = {"q8_0": (32, 34), "q4_0": (32, 18)}  # values per block, bytes per block
DTYPE_WEIGHTS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # weights=auto: the run's dtype
# Hugging Face model_type -> llama.cpp architecture
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
PERMUTED = {"llama"}  # llama.cpp rotates adjacent pairs (NORM): q/k rows permuted from HF's halves
WORD_START = "\u2581"  # llama.cpp's word-piece vocabulary marks a word's first piece so

# The Split regexes of two widely used byte-level BPE tokenizers (their tokenizer.json files) and
# the llama.cpp pre-tokenizer whose split is the same (src/llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_*).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PRE = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}


class ConversionError(ValueError):
    """The checkpoint cannot be written as a GGUF llama.cpp takes: the message says why."""


# ---- what can be converted ----------------------------------------------------------------

def unsupported_reason(shape: Any) -> str | None:
    """Why a model of this `harness.core.shapes.ModelShape` cannot be converted for llama.cpp (None:
    it can, as far as its shape tells; its tokenizer is checked at load). adapters.MODEL_CHECKS."""
    lacks: list[str] = []
    arch = shape.architecture
    if arch not in ARCHS:
        lacks.append(f"the {arch} family")
    kinds = sorted(set(shape.layer_kinds()) - {"full"})
    if kinds:
        lacks.append(f"{' and '.join(kinds)} attention layers")
    if shape.num_experts:
        lacks.append(f"routed experts ({shape.num_experts})")
    if shape.qk_norm and arch != "qwen3":
        lacks.append(f"qk-norm in the {arch} family")
    if shape.attention_sinks:
        lacks.append("attention sinks")
    rope = (shape.rope_scaling or {}).get("rope_type")
    if rope and rope != "default":
        lacks.append(f"rope_type {rope}")
    if (shape.hf_architecture or "ForCausalLM").endswith("ForConditionalGeneration"):
        lacks.append(f"the {shape.hf_architecture} checkpoint")
    if not lacks:
        return None
    return (f"infer-bench's GGUF converter writes {'/'.join(sorted(set(ARCHS)))} decoders for llama.cpp; "
            f"it lacks {', '.join(lacks)}")


# ---- reading the checkpoint ---------------------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I32": np.int32, "I64": np.int64}


def safetensors_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [ckpt / n for n in names]
    return sorted(ckpt.glob("*.safetensors"))


def read_tensors(ckpt: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the checkpoint as float32 (or its integer type), read from the safetensors
    files' own layout (8-byte header length, JSON header, raw little-endian data): numpy alone reads
    bfloat16 this way (as the high half of a float32)."""
    files = safetensors_files(ckpt)
    if not files:
        raise ConversionError(f"{ckpt}: no *.safetensors weights (the converter reads safetensors only)")
    for path in files:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            raw = np.asarray(data[start:end])
            if info["dtype"] == "BF16":
                arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif info["dtype"] in _ST_DTYPES:
                arr = raw.view(_ST_DTYPES[info["dtype"]])
            else:
                raise ConversionError(f"{path.name}: tensor {name} has dtype {info['dtype']}, which the converter "
                                      "does not read (F32, F16, BF16)")
            arr = arr.reshape(info["shape"])
            yield name, arr.astype(np.float32) if arr.dtype in (np.float16, np.float64) else arr


def _config(ckpt: Path) -> dict[str, Any]:
    p = ckpt / "config.json"
    if not p.is_file():
        raise ConversionError(f"{ckpt}: no config.json")
    return json.loads(p.read_text())


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _rope_type(cfg: dict[str, Any]) -> str | None:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return params.get("rope_type") or params.get("type")


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why this checkpoint directory cannot be converted (family, features, tokenizer); None: it can."""
    try:
        cfg = _config(ckpt)
        mt = cfg.get("model_type")
        if mt not in ARCHS:
            return f"its family {mt!r} (the converter writes {', '.join(sorted(ARCHS))})"
        if mt == "mistral" and cfg.get("sliding_window") not in (None, 0):
            return f"mistral with a sliding window of {cfg['sliding_window']} tokens"
        rope = _rope_type(cfg)
        if rope not in (None, "default"):
            return f"rope_type {rope} (the converter writes plain RoPE)"
        for key in ("num_local_experts", "num_experts"):
            if cfg.get(key):
                return f"routed experts ({key}={cfg[key]})"
        read_vocabulary(ckpt, int(cfg["vocab_size"]))
    except ConversionError as e:
        return str(e)
    return None


# ---- the tokenizer --------------------------------------------------------------------------

@dataclass
class Vocabulary:
    model: str  # llama.cpp's tokenizer.ggml.model: gpt2 | bert
    pre: str | None  # tokenizer.ggml.pre
    tokens: list[str]
    types: list[int]  # gguf.TokenType values
    merges: list[str] = field(default_factory=list)
    special: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad, sep -> id
    add_bos: bool = False
    add_eos: bool = False
    encoding: str = ""  # how the checkpoint's tokenizer is represented (the sidecar, the row)
    text_prompts: bool = True  # llama.cpp tokenizes text as the checkpoint does (else: token ids only)


def _special_ids(ckpt: Path, vocab: dict[str, int], cfg: dict[str, Any]) -> dict[str, int]:
    tc_path = ckpt / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    out: dict[str, int] = {}
    for role in ("bos", "eos", "unk", "pad"):
        tok = tc.get(f"{role}_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str) and tok in vocab:
            out[role] = vocab[tok]
        elif isinstance(cfg.get(f"{role}_token_id"), int):
            out[role] = int(cfg[f"{role}_token_id"])
    return out


def _adds(ckpt: Path, tj: dict[str, Any], role: str, token_id: int | None) -> bool:
    """Whether the checkpoint's tokenizer adds its `role` (bos | eos) token to a single text:
    tokenizer_config.json's add_<role>_token where it says, else tokenizer.json's post-processor."""
    tc_path = ckpt / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    if isinstance(tc.get(f"add_{role}_token"), bool):
        return tc[f"add_{role}_token"]
    post = tj.get("post_processor") or {}
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in procs:
        if p.get("type") == "TemplateProcessing" and token_id is not None:
            single = p.get("single") or []
            ids = [(p.get("special_tokens") or {}).get(s["SpecialToken"]["id"], {}).get("ids", [None])[0]
                   for s in single if "SpecialToken" in s]
            where = single[0] if role == "bos" else (single[-1] if single else None)
            if where and "SpecialToken" in where and token_id in ids:
                return True
    return False


def read_vocabulary(ckpt: Path, vocab_size: int) -> Vocabulary:
    """The checkpoint's tokenizer as llama.cpp's vocabulary keys, or ConversionError saying why it
    has no faithful encoding."""
    import gguf
    p = ckpt / "tokenizer.json"
    if not p.is_file():
        raise ConversionError(f"{ckpt}: no tokenizer.json (the converter reads the fast tokenizer's file)")
    tj = json.loads(p.read_text())
    model = tj.get("model") or {}
    kind = model.get("type")
    vocab: dict[str, int] = dict(model.get("vocab") or {}) if isinstance(model.get("vocab"), dict) else {}
    added = {t["content"]: t for t in tj.get("added_tokens") or []}
    for content, t in added.items():
        vocab[content] = t["id"]
    if not vocab:
        raise ConversionError(f"{p}: a {kind} tokenizer without a vocabulary the converter can read")
    if max(vocab.values()) >= vocab_size:
        raise ConversionError(f"{p}: token id {max(vocab.values())} is beyond the model's vocab_size {vocab_size}")
    cfg = _config(ckpt)
    special = _special_ids(ckpt, vocab, cfg)
    by_id: dict[int, str] = {i: t for t, i in vocab.items()}
    T = gguf.TokenType
    pre_tok = tj.get("pre_tokenizer") or {}
    if kind == "WordLevel":
        if pre_tok.get("type") not in ("WhitespaceSplit", "Whitespace") or tj.get("normalizer"):
            raise ConversionError(f"{p}: a WordLevel tokenizer with pre-tokenizer {pre_tok.get('type')} and "
                                  f"normalizer {tj.get('normalizer')} (the converter encodes whitespace-split words)")
        tokens, types = [], []
        for i in range(vocab_size):
            text = by_id.get(i)
            if text is None:
                tokens.append(f"[PAD{i}]"), types.append(T.UNUSED)
            elif text in added and added[text].get("special"):
                tokens.append(text), types.append(T.CONTROL)
            else:
                tokens.append(WORD_START + text), types.append(T.NORMAL)
        # llama.cpp's word-piece tokenizer appends SEP to any text it tokenizes with special tokens
        # (and its default SEP id is 102, an ordinary word here): name the checkpoint's EOS instead
        special["sep"] = special.get("eos", special.get("unk", 0))
        return Vocabulary("bert", None, tokens, [int(t) for t in types], special=special,
                          add_bos=_adds(ckpt, tj, "bos", special.get("bos")),
                          add_eos=_adds(ckpt, tj, "eos", special.get("eos")),
                          encoding="word-piece (bert): each WordLevel word as a word start; token ids only",
                          text_prompts=False)
    if kind != "BPE":
        raise ConversionError(f"{p}: a {kind} tokenizer (the converter writes byte-level BPE and WordLevel ones)")
    pre = _bpe_pre(pre_tok, tj.get("normalizer"))
    if pre is None:
        raise ConversionError(f"{p}: a BPE tokenizer whose pre-tokenizer ({json.dumps(pre_tok)[:200]}) is not one "
                              "llama.cpp splits the same way (byte-level with the GPT-2, Llama 3 or Qwen2 split)")
    if model.get("byte_fallback"):
        raise ConversionError(f"{p}: a BPE tokenizer with byte fallback (SentencePiece-style), not written yet")
    tokens, types = [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]"), types.append(T.UNUSED)
        elif text in added:
            tokens.append(text), types.append(T.CONTROL if added[text].get("special") else T.USER_DEFINED)
        else:
            tokens.append(text), types.append(T.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return Vocabulary("gpt2", pre, tokens, [int(t) for t in types], merges=merges, special=special,
                      add_bos=_adds(ckpt, tj, "bos", special.get("bos")),
                      add_eos=_adds(ckpt, tj, "eos", special.get("eos")),
                      encoding=f"byte-level BPE (gpt2), pre-tokenizer {pre}", text_prompts=True)


def _bpe_pre(pre_tok: dict[str, Any], normalizer: Any) -> str | None:
    """llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer's pre-tokenizer, where one splits
    text the same way; None where none does."""
    if pre_tok.get("type") == "ByteLevel":
        if pre_tok.get("use_regex", True) and not pre_tok.get("add_prefix_space", False) and normalizer is None:
            return "gpt-2"
        return None
    if pre_tok.get("type") == "Sequence":
        parts = pre_tok.get("pretokenizers") or []
        if (len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel"
                and not parts[1].get("use_regex", True) and not parts[1].get("add_prefix_space", False)
                and parts[0].get("behavior") == "Isolated" and not parts[0].get("invert")):
            name = SPLIT_PRE.get((parts[0].get("pattern") or {}).get("Regex"))
            if name == "qwen2" and normalizer not in (None, {"type": "NFC"}):
                return None
            if name == "llama-bpe" and normalizer is not None:
                return None
            return name
    return None


# ---- writing ------------------------------------------------------------------------------

def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q or k projection (or its bias) from Hugging Face's rotate-half order (each head's
    first half of dimensions pairs with its second half) to llama.cpp's adjacent pairs (NORM rope):
    within each head, row j of the first half and row j of the second half become rows 2j and 2j+1."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(arr: np.ndarray, weights: str, is_matrix: bool) -> tuple[np.ndarray, Any, str]:
    """(data, gguf raw dtype or None, the type written) for one tensor."""
    import gguf
    Q = gguf.GGMLQuantizationType
    if not is_matrix or weights == "f32":
        return np.ascontiguousarray(arr, dtype=np.float32), None, "f32"
    if weights == "f16":
        return arr.astype(np.float16), None, "f16"
    if weights == "bf16":
        return gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), Q.BF16), Q.BF16, "bf16"
    block = BLOCK_TYPES[weights][0]
    if arr.shape[-1] % block:
        return arr.astype(np.float16), None, "f16"
    qtype = Q.Q8_0 if weights == "q8_0" else Q.Q4_0
    return gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype), qtype, weights


_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "q4_0": "MOSTLY_Q4_0"}


def write_gguf(ckpt: Path, out: Path, weights: str = "f32", *, permute: bool = True) -> dict[str, Any]:
    """Write `ckpt` as a GGUF file `out` with weights of type `weights`; returns what was written (the
    sidecar's record). `permute=False` leaves the llama q/k rows in Hugging Face's order: a wrong
    GGUF, for the test that parity catches it."""
    import gguf
    if weights not in WEIGHT_TYPES:
        raise ConversionError(f"weights={weights}: not a type the converter writes ({', '.join(WEIGHT_TYPES)})")
    problem = checkpoint_problem(ckpt)
    if problem is not None:
        raise ConversionError(f"{ckpt} cannot be converted for llama.cpp: {problem}")
    cfg = _config(ckpt)
    arch = ARCHS[cfg["model_type"]]
    n_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    n_vocab = int(cfg["vocab_size"])
    tied = bool(cfg.get("tie_word_embeddings", False))
    vocab = read_vocabulary(ckpt, n_vocab)

    w = gguf.GGUFWriter(out, arch)
    w.add_name(ckpt.name)
    w.add_file_type(int(getattr(gguf.LlamaFileType, _FILE_TYPES[weights])))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(int(cfg.get("max_position_embeddings") or 2048))
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    for role, tid in vocab.special.items():
        getattr(w, f"add_{role}_token_id")(tid)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(vocab.add_eos)
    if vocab.model == "bert":
        w.add_add_sep_token(False)

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), n_layers)
    written: dict[str, str] = {}
    fallbacks: list[str] = []
    for name, arr in read_tensors(ckpt):
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ConversionError(f"{ckpt}: tensor {name} has no llama.cpp name in the {arch} architecture")
        if arch in PERMUTED and permute:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                arr = permute_qk(arr, n_head)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                arr = permute_qk(arr, n_kv)
        data, raw, kind = _encode(arr, weights, arr.ndim == 2)
        if kind != weights and arr.ndim == 2:
            fallbacks.append(f"{new}: {kind} (rows of {arr.shape[-1]} do not split into blocks of 32)")
        w.add_tensor(new, data, raw_dtype=raw)
        written[new] = kind
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"converter_format": CONVERTER_FORMAT, "architecture": arch, "weights": weights, "tied_embeddings": tied,
            "qk_permuted": arch in PERMUTED and permute, "tokenizer": vocab.encoding,
            "text_prompts": vocab.text_prompts, "add_bos": vocab.add_bos, "special_ids": vocab.special,
            "tensors": len(written), "fallbacks": fallbacks, "bytes": out.stat().st_size}


# ---- the cache ----------------------------------------------------------------------------

CHECKPOINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json")


def checkpoint_digest(ckpt: Path) -> str:
    """SHA-256 over the files a conversion reads (config, tokenizer, every safetensors file)."""
    h = hashlib.sha256()
    files = [ckpt / n for n in CHECKPOINT_FILES if (ckpt / n).is_file()] + safetensors_files(ckpt)
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def cache_key(ckpt: Path, weights: str) -> str:
    blob = json.dumps({"checkpoint": checkpoint_digest(ckpt), "weights": weights, "format": CONVERTER_FORMAT},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Converted:
    path: Path
    record: dict[str, Any]
    cached: bool

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


def ensure_gguf(ckpt: Path, cache_dir: Path, weights: str = "f32") -> Converted:
    """The GGUF of (checkpoint, weights) in `cache_dir`/gguf, written on first use (atomically, one
    writer across processes)."""
    ckpt = Path(ckpt)
    if weights not in WEIGHT_TYPES:
        raise ConversionError(f"weights={weights}: not a type the converter writes ({', '.join(WEIGHT_TYPES)})")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", ckpt.name)
    gdir = Path(cache_dir) / "gguf"
    target = gdir / f"{name}-{weights}-{cache_key(ckpt, weights)}.gguf"
    sidecar = target.with_suffix(".json")
    if target.is_file() and sidecar.is_file():
        return Converted(target, json.loads(sidecar.read_text()), True)
    gdir.mkdir(parents=True, exist_ok=True)
    with open(gdir / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file() and sidecar.is_file():
            return Converted(target, json.loads(sidecar.read_text()), True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=gdir)
        os.close(fd)
        try:
            record = write_gguf(ckpt, Path(tmp), weights)
            record.update({"checkpoint": str(ckpt), "checkpoint_digest": checkpoint_digest(ckpt)})
            sidecar.write_text(json.dumps(record, indent=2))
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return Converted(target, record, False)

"""Models and datasets named by their Hugging Face Hub id, resolved into the user's Hugging Face
cache with `huggingface_hub` (docs/design.md, step 2; README, "Models").

    model=hub model.id=ORG/NAME [model.revision=REV]     (the shorthand: model=ORG/NAME)
    workload.dataset=hf:ORG/NAME[@REV][/PATH/IN/REPO]      (a dataset repository's file)

- **Where**: the Hugging Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
  ~/.cache/huggingface/hub), the Hub at `HF_ENDPOINT` (default https://huggingface.co). All are
  read when a model is resolved, not when the library was imported.
- **What**: only what engines need, from the repository's top level (`NEEDED`: config,
  safetensors weights and their index, tokenizer files, chat template, generation config). The
  plan fetches every file but the weights (the plan needs the shape from config.json, the
  tokenizer and the chat template); the run fetches the weights (`HubModel.download`), with
  huggingface_hub's own progress bars. `infer-bench-kv` fetches config.json only.
- **Which**: `revision` (a branch, a tag or a commit; default the default branch, main) is resolved
  to a commit, which rows and environment.json record (`HubModel.row_fields`, `record`).
- **Token**: `HF_TOKEN` from the environment only (never the token file of `hf auth login`); the
  run's redaction masks its value in every artifact (harness/core/redact.py).
- **Offline**: with `HF_HUB_OFFLINE=1`, or when the Hub cannot be reached, the model comes from
  the cache: its `refs/<revision>` names the commit, its cached file listing says what must be
  there. A model that is not there (or not whole) is one problem naming `model.id` and what to do.
- **Refused before anything runs**: an id that is not one, an unknown id or revision, a gated or
  private repository the token cannot read (with the Hub's own reason), and a repository without
  safetensors weights.

huggingface_hub is imported inside the functions: only the harness's process resolves models, and
a worker that imports harness.core never pays for it.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from harness.core.errors import UserError
from harness.core.presets import ModelShape, shape_from_hf_config

# What engines read from a checkpoint, at the repository's top level (a repository's sub-folders
# hold other formats: gpt-oss's original/ and metal/, GGUF quantisations, ONNX exports).
NEEDED = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
          "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
          "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "*.tiktoken",
          "chat_template.jinja", "chat_template.json")
WEIGHTS = "*.safetensors"
OTHER_WEIGHTS = ("*.bin", "*.pth", "*.pt", "*.gguf", "*.ckpt", "*.h5", "*.msgpack", "*.onnx")
DEFAULT_REVISION = "main"
DEFAULT_ENDPOINT = "https://huggingface.co"
DATASET_PREFIX = "hf:"
DATASET_FILES = ("*.json", "*.jsonl")  # the dataset formats workloads/datasets.py reads
_COMMIT = re.compile(r"[0-9a-f]{40}")


# ---- where: the environment, read at call time ---------------------------------------------------

def _true(v: str | None) -> bool:
    return (v or "").strip().upper() in ("1", "ON", "YES", "TRUE")


@dataclass(frozen=True)
class HubEnv:
    """The Hub and the cache as the environment names them now (huggingface_hub's own constants
    are read once, at its import; a run reads them when it resolves)."""

    endpoint: str
    cache_dir: str
    offline: bool
    token: str | None = field(default=None, repr=False)

    @classmethod
    def current(cls) -> "HubEnv":
        env = os.environ
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                  "huggingface")
        cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
        return cls(endpoint=(env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
                   cache_dir=os.path.expandvars(os.path.expanduser(cache)),
                   offline=_true(env.get("HF_HUB_OFFLINE")) or _true(env.get("TRANSFORMERS_OFFLINE")),
                   token=env.get("HF_TOKEN") or None)

    def hf_token(self) -> str | bool:
        """For huggingface_hub: the token, or False (never the token file of `hf auth login`)."""
        return self.token or False

    def where(self) -> str:
        return f"the Hugging Face cache {self.cache_dir}"


# ---- errors, as one line naming the field and the fix ------------------------------------------------

def _network_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the Hub cannot be reached" (then the cache decides)."""
    from huggingface_hub.errors import OfflineModeIsEnabled
    out: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for mod in ("httpx2", "httpx"):  # huggingface_hub's HTTP client (httpx2 in 2.x)
        try:
            out.append(__import__(mod).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(out)


def _server_reason(e: BaseException) -> str:
    """The Hub's own words for an HTTP error (X-Error-Message or the body's error), else the
    exception's first line."""
    msg = getattr(e, "server_message", None)
    if msg:
        return " ".join(str(msg).split())
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _unreachable(e: BaseException) -> bool:
    from huggingface_hub.errors import HfHubHTTPError
    if isinstance(e, _network_errors()):
        return True
    resp = getattr(e, "response", None)
    return isinstance(e, HfHubHTTPError) and resp is not None and resp.status_code >= 500


def _token_hint(env: HubEnv) -> str:
    return "HF_TOKEN is set" if env.token else "HF_TOKEN is not set"


def _hub_problem(e: BaseException, field_: str, value: str, repo_id: str, revision: str, env: HubEnv,
                 kind: str = "model") -> str:
    """An error of the Hub's, as the problem to show (the field, the Hub's reason, the fix)."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    page = f"{env.endpoint}/{'datasets/' if kind == 'dataset' else ''}{repo_id}"
    if isinstance(e, GatedRepoError):
        return (f"{field_}={value}: the {kind} is gated on the Hub: {_server_reason(e)} Request access at {page}, "
                f"then set HF_TOKEN to a token of the account that has it ({_token_hint(env)}).")
    if isinstance(e, RevisionNotFoundError):
        where = f"model.revision={revision}" if kind == "model" else f"{field_}={value}"
        return (f"{where}: {kind} {repo_id} has no branch, tag or commit '{revision}' on the Hub "
                f"({env.endpoint}). Give a revision it has (see {page}/tree/main), or leave the revision out "
                "for its main branch.")
    if isinstance(e, RepositoryNotFoundError):
        return (f"{field_}={value}: the Hub ({env.endpoint}) has no {kind} '{repo_id}', or it is private and the "
                f"token cannot read it ({_token_hint(env)}). Check the id (it is ORG/NAME, as on {page}), or set "
                "HF_TOKEN to a token that can read it.")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if getattr(e, "response", None) is not None else "?"
        return (f"{field_}={value}: the Hub ({env.endpoint}) answered {status}: {_server_reason(e)} "
                f"({_token_hint(env)}).")
    return f"{field_}={value}: {type(e).__name__}: {_server_reason(e)}"


def check_repo_id(repo_id: Any, field_: str = "model.id") -> str | None:
    """None if `repo_id` is a Hub id, else the problem."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    if not isinstance(repo_id, str) or repo_id in ("", "???"):
        return (f"{field_} is missing: give the model's Hugging Face Hub id, e.g. model=hub model.id=Qwen/Qwen3-0.6B "
                "(or the shorthand model=Qwen/Qwen3-0.6B).")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        return (f"{field_}={repo_id}: not a Hugging Face Hub id ({e}). Give ORG/NAME as the Hub shows it, "
                "e.g. Qwen/Qwen3-0.6B.")
    return None


def _matches(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def needed_files(names: list[str]) -> list[str]:
    """The files of a repository listing that engines read (top level, `NEEDED`)."""
    return sorted(n for n in names if "/" not in n and _matches(n, NEEDED))


def _human(n: int | None) -> str:
    if n is None:
        return "size unknown"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"


# ---- model=ORG/NAME on a command line (Hydra) --------------------------------------------------------

def hub_shorthands(overrides: list[str]) -> list[str]:
    """The Hub ids that `model=` overrides name (ORG/NAME: a name with a slash, which no preset has),
    a multirun's sweep (`model=ORG/A,ORG/B`, `model=choice(...)`) included."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    out: list[str] = []
    for o in overrides:
        if not o.startswith("model="):
            continue
        try:
            (parsed,) = OverridesParser.create().parse_overrides([o])
            values = list(parsed.sweep_string_iterator()) if parsed.is_sweep_override() else \
                [parsed.get_value_element_as_str()]
        except Exception:  # Hydra says what is wrong with it when it composes
            continue
        out += [v for v in values if "/" in v and check_repo_id(v) is None]
    return list(dict.fromkeys(out))


def register_hub_shorthands(overrides: list[str]) -> None:
    """Make `model=ORG/NAME` mean `model=hub model.id=ORG/NAME`: Hydra reads a config-group choice
    with a slash as the config model/ORG/NAME, so each id the command line names becomes such a
    config in Hydra's ConfigStore (conf/model/hub.yaml's fields, packaged as `model`). The store is
    process-wide, and the joblib launcher hands it to its workers; model.revision=REV applies as
    for model=hub. (infer-bench and infer-bench-serve call it before composing.)"""
    from hydra.core.config_store import ConfigStore
    store = ConfigStore.instance()
    for repo_id in hub_shorthands(overrides):
        org, name = repo_id.split("/", 1)
        store.store(group=f"model/{org}", name=name, package="model",
                    node={"name": "hub", "id": repo_id, "revision": None, "path": None})


# ---- models ---------------------------------------------------------------------------------------------

@dataclass
class HubModel:
    """A model resolved on the Hub (or in the cache): its id, the revision asked and the commit it
    named, the snapshot directory, the files engines read (name -> bytes) and which of them are not
    in the cache yet."""

    id: str
    revision: str
    commit: str
    path: str
    files: dict[str, int | None]
    env: HubEnv
    from_cache: str | None = None  # why the Hub was not asked (offline, unreachable); None: it was
    shape: ModelShape | None = None
    only: tuple[str, ...] | None = None  # the files fetched so far (infer-bench-kv: config.json)

    @property
    def missing(self) -> list[str]:
        return [n for n in self.files if not (Path(self.path) / n).is_file()]

    @property
    def size_bytes(self) -> int | None:
        sizes = list(self.files.values())
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)

    def row_fields(self) -> dict[str, Any]:
        """What every row records about the model's origin."""
        return {"model_id": self.id, "model_revision": self.revision, "model_commit": self.commit}

    def record(self) -> dict[str, Any]:
        """environment.json's `model`: the origin, the snapshot and its files."""
        return {**self.row_fields(), "source": "huggingface_hub", "endpoint": self.env.endpoint,
                "snapshot": self.path, "files": dict(self.files), "size_bytes": self.size_bytes,
                "resolved_from_cache": self.from_cache}

    def describe(self) -> str:
        """The plan's line: id, revision -> commit, files and size, where, and what is to download."""
        missing = self.missing
        todo = sum(self.files[n] or 0 for n in missing)
        where = (f"all in the cache: {self.path}" if not missing else
                 f"{len(missing)} to download ({_human(todo)}) into {self.path}")
        how = f"; {self.from_cache}" if self.from_cache else ""
        return (f"model {self.id}: revision {self.revision} = commit {self.commit}, {len(self.files)} files, "
                f"{_human(self.size_bytes)} on disk ({where}){how}")

    def download(self, progress: bool = True) -> str:
        """The snapshot with every needed file (the weights too), downloaded where missing, with
        huggingface_hub's own progress bars; its directory. Raises UserError if it cannot."""
        if not self.missing:
            return self.path
        if self.from_cache:  # offline: resolve_model checked that nothing is missing
            raise UserError(f"model.id={self.id}: {len(self.missing)} files of commit {self.commit} are not in "
                            f"{self.env.where()} ({', '.join(self.missing[:3])}), and {self.from_cache}.")
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
        (enable_progress_bars if progress else disable_progress_bars)()
        _quiet_http_logs()
        try:
            path = snapshot_download(self.id, revision=self.commit, allow_patterns=list(self.files),
                                     cache_dir=self.env.cache_dir, token=self.env.hf_token(),
                                     endpoint=self.env.endpoint, library_name="infer-bench")
        except Exception as e:  # the network went away, the disk filled, the Hub changed its mind
            if isinstance(e, _network_errors()) or _unreachable(e):
                raise UserError(f"model.id={self.id}: the download from {self.env.endpoint} stopped "
                                f"({type(e).__name__}: {_server_reason(e)}). Run again to resume it; "
                                "what was downloaded is kept in the cache.") from None
            raise UserError(_hub_problem(e, "model.id", self.id, self.id, self.revision, self.env)) from None
        missing = [n for n in self.files if not (Path(path) / n).is_file()]
        if missing:
            raise UserError(f"model.id={self.id}: the download of commit {self.commit} left {', '.join(missing)} "
                            f"missing in {path}. Run again.")
        return str(path)


def _quiet_http_logs() -> None:
    """huggingface_hub's HTTP client logs every request at INFO, and a Hydra job logs INFO to the
    terminal: one line per file and redirect. The progress bars say enough."""
    for name in ("httpx2", "httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def is_hub_model(model_cfg: dict[str, Any]) -> bool:
    """`model=hub` (conf/model/hub.yaml) or the shorthand `model=ORG/NAME`."""
    return model_cfg.get("name") == "hub"


_RESOLVED: dict[tuple[Any, ...], HubModel] = {}


def resolve_model(model_cfg: dict[str, Any], problems: list[str], only: tuple[str, ...] | None = None,
                  env: HubEnv | None = None) -> HubModel | None:
    """`model=hub`'s model, resolved: on the Hub (its files listed, everything but the weights
    fetched, or only the files `only` names), else from the cache where the Hub is off or
    unreachable. Its shape comes from the snapshot's config.json (named after the id). None, with
    the problems appended, where it cannot be used."""
    env = env or HubEnv.current()
    _quiet_http_logs()
    repo_id = model_cfg.get("id")
    bad = check_repo_id(repo_id)
    if bad:
        problems.append(bad)
        return None
    revision = str(model_cfg.get("revision") or DEFAULT_REVISION)
    key = (repo_id, revision, only, env)
    if key in _RESOLVED:  # the plan is checked, then built again for the job: one look-up
        return _RESOLVED[key]
    try:
        hub = (_from_cache(repo_id, revision, env, "HF_HUB_OFFLINE=1 keeps infer-bench off the network", only)
               if env.offline else _from_hub(repo_id, revision, env, only))
        try:
            hub.shape = replace(shape_from_hf_config(hub.path, field="model.id"), name=repo_id)
        except UserError as e:
            raise UserError([p.replace(f"model.id={hub.path}", f"model.id={repo_id} (commit {hub.commit[:12]})")
                             for p in e.problems]) from None
    except UserError as e:
        problems += e.problems
        return None
    _RESOLVED[key] = hub
    return hub


def _from_hub(repo_id: str, revision: str, env: HubEnv, only: tuple[str, ...] | None) -> HubModel:
    from huggingface_hub import HfApi, snapshot_download
    api = HfApi(endpoint=env.endpoint, token=env.hf_token(), library_name="infer-bench")
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as e:
        if _unreachable(e):
            return _from_cache(repo_id, revision, env, f"the Hub at {env.endpoint} cannot be reached "
                                                       f"({type(e).__name__}: {_server_reason(e)})", only)
        raise UserError(_hub_problem(e, "model.id", repo_id, repo_id, revision, env)) from None
    listing = {s.rfilename: s.size for s in info.siblings or []}
    files = {n: listing[n] for n in needed_files(list(listing))}
    if only is None:  # a run loads the weights; the KV estimate reads config.json alone
        _check_files(repo_id, info.sha or revision, list(listing), files)
    elif not set(only) <= set(files):
        raise UserError(f"model.id={repo_id}: the repository (commit {(info.sha or revision)[:12]}) has no "
                        f"{', '.join(sorted(set(only) - set(files)))} at its top level: not a transformers checkpoint.")
    first = [n for n in files if (only is None and not fnmatch.fnmatchcase(n, WEIGHTS)) or (only and n in only)]
    from huggingface_hub.utils import disable_progress_bars
    disable_progress_bars()  # kilobytes: no bars while the plan is checked (the weights' download shows them)
    try:  # the small files now (the plan reads them); the weights when the run starts
        path = snapshot_download(repo_id, revision=revision, allow_patterns=first, cache_dir=env.cache_dir,
                                 token=env.hf_token(), endpoint=env.endpoint, library_name="infer-bench")
    except Exception as e:
        if _unreachable(e):
            return _from_cache(repo_id, revision, env, f"the Hub at {env.endpoint} cannot be reached "
                                                       f"({type(e).__name__}: {_server_reason(e)})", only)
        raise UserError(_hub_problem(e, "model.id", repo_id, repo_id, revision, env)) from None
    return HubModel(repo_id, revision, Path(path).name, str(path), files, env, None, only=only)


def _check_files(repo_id: str, commit: str, listing: list[str], files: dict[str, Any]) -> None:
    """A repository engines can load: config.json and safetensors weights at its top level."""
    problems = []
    if "config.json" not in files:
        problems.append(f"model.id={repo_id}: the repository (commit {commit[:12]}) has no config.json at its top "
                        "level: not a transformers checkpoint. Give the id of a causal-LM checkpoint.")
    if not any(fnmatch.fnmatchcase(n, WEIGHTS) for n in files):
        other = sorted(n for n in listing if _matches(n.rsplit("/", 1)[-1], OTHER_WEIGHTS))
        problems.append(f"model.id={repo_id}: the repository (commit {commit[:12]}) has no *.safetensors weights at its "
                        f"top level{' (it has ' + ', '.join(other[:4]) + ')' if other else ''}; infer-bench's engines "
                        "load safetensors. Pick a repository or revision that has them (often a branch or a "
                        "sibling repository), or convert the weights and use model=local model.path=DIR.")
    if problems:
        raise UserError(problems)


def _cached_commit(storage: Path, revision: str) -> str | None:
    if _COMMIT.fullmatch(revision):
        return revision if (storage / "snapshots" / revision).is_dir() else None
    ref = storage / "refs" / revision
    try:
        return ref.read_text().strip() or None
    except OSError:
        return None


def _storage(repo_id: str, repo_type: str, env: HubEnv) -> Path:
    from huggingface_hub.file_download import repo_folder_name
    return Path(env.cache_dir) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)


def _cached_listing(repo_id: str, commit: str, repo_type: str, env: HubEnv) -> list[str] | None:
    """The repository's files at `commit` as the cache recorded them (huggingface_hub's tree
    cache); None where it holds no listing."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError
    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=commit, repo_type=repo_type,
                                                     cache_dir=env.cache_dir)]
    except (CachedRepoTreeNotFoundError, OSError, ValueError):
        return None


def _from_cache(repo_id: str, revision: str, env: HubEnv, why: str, only: tuple[str, ...] | None) -> HubModel:
    """The model from the cache alone (offline, or the Hub unreachable)."""
    storage = _storage(repo_id, "model", env)
    commit = _cached_commit(storage, revision)
    snap = storage / "snapshots" / (commit or "-")
    if commit is None or not snap.is_dir():
        raise UserError(f"model.id={repo_id}: revision {revision} is not in {env.where()}, and {why}. Download it "
                        f"once with the network on (run without HF_HUB_OFFLINE, or `hf download {repo_id}"
                        f"{' --revision ' + revision if revision != DEFAULT_REVISION else ''}`), point HF_HOME / "
                        "HF_HUB_CACHE at the cache that has it, or give model=local model.path=DIR.")
    listing = _cached_listing(repo_id, commit, "model", env)
    present = sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file())
    names = needed_files(listing if listing is not None else present)
    if only is not None:
        names = [n for n in names if n in only]
    else:
        _check_files(repo_id, commit, listing or present, {n: None for n in names})
    files = {n: ((snap / n).stat().st_size if (snap / n).is_file() else None) for n in names}
    hub = HubModel(repo_id, revision, commit, str(snap), files, env, why, only=only)
    if hub.missing or not files:
        raise UserError(f"model.id={repo_id}: {env.where()} holds only part of revision {revision} (commit "
                        f"{commit[:12]}): {', '.join(hub.missing[:4]) or 'config.json'} missing, and {why}. Finish "
                        "the download with the network on (run again without HF_HUB_OFFLINE).")
    return hub


# ---- datasets ---------------------------------------------------------------------------------------------

@dataclass
class HubDataset:
    """A dataset file resolved on the Hub: the local file, and the fields rows record."""

    path: str
    id: str
    revision: str
    commit: str
    file: str
    from_cache: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def row_fields(self) -> dict[str, Any]:
        return {"dataset_id": self.id, "dataset_revision": self.revision, "dataset_commit": self.commit,
                "dataset_file": self.file}


def is_hub_dataset(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(DATASET_PREFIX)


def parse_dataset(value: str, field_: str = "workload.dataset") -> tuple[str, str, str | None]:
    """`hf:ORG/NAME[@REV][/PATH]` -> (repo id, revision, path in the repository or None)."""
    rest = value[len(DATASET_PREFIX):].strip("/")
    parts = rest.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise UserError(f"{field_}={value}: a Hub dataset is hf:ORG/NAME, hf:ORG/NAME/FILE (a file in the "
                        "repository) or hf:ORG/NAME@REVISION/FILE.")
    name, _, rev = parts[1].partition("@")
    repo_id = f"{parts[0]}/{name}"
    bad = check_repo_id(repo_id, field_)
    if bad:
        raise UserError(bad.replace(f"{field_}={repo_id}", f"{field_}={value}"))
    return repo_id, rev or DEFAULT_REVISION, "/".join(parts[2:]) or None


def _pick_file(value: str, repo_id: str, listing: list[str], path: str | None, field_: str) -> str:
    """The file of the repository a dataset names: the given path, else its only JSON / JSONL file."""
    if path is not None:
        if path not in listing:
            near = sorted(n for n in listing if _matches(n, DATASET_FILES))[:8]
            raise UserError(f"{field_}={value}: dataset {repo_id} has no file '{path}'"
                            + (f" (its JSON / JSONL files: {', '.join(near)})" if near else "") + ".")
        return path
    data = sorted(n for n in listing if _matches(n, DATASET_FILES))
    if len(data) == 1:
        return data[0]
    if not data:
        raise UserError(f"{field_}={value}: dataset {repo_id} holds no .json or .jsonl file (infer-bench reads "
                        "ShareGPT JSON, chat-format JSONL and trtllm-bench JSONL). Name a file: "
                        f"hf:{repo_id}/PATH.")
    raise UserError(f"{field_}={value}: dataset {repo_id} holds {len(data)} JSON / JSONL files "
                    f"({', '.join(data[:6])}{', ...' if len(data) > 6 else ''}); name one: hf:{repo_id}/{data[0]}.")


_DATASETS: dict[tuple[Any, ...], HubDataset] = {}


def resolve_dataset(value: str, field_: str = "workload.dataset", env: HubEnv | None = None) -> HubDataset:
    """A `hf:` dataset's file, downloaded into the cache (or found there offline). UserError
    naming the field where it cannot be had."""
    env = env or HubEnv.current()
    _quiet_http_logs()
    repo_id, revision, path = parse_dataset(value, field_)
    key = (value, env)
    if key in _DATASETS and Path(_DATASETS[key].path).is_file():
        return _DATASETS[key]
    out = (_dataset_from_cache(value, repo_id, revision, path, env, "HF_HUB_OFFLINE=1 keeps infer-bench off the "
                               "network", field_) if env.offline else
           _dataset_from_hub(value, repo_id, revision, path, env, field_))
    _DATASETS[key] = out
    return out


def _dataset_from_hub(value: str, repo_id: str, revision: str, path: str | None, env: HubEnv,
                      field_: str) -> HubDataset:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import enable_progress_bars
    enable_progress_bars()  # a dataset file can be large (ShareGPT: 670 MB): its bar shows
    api = HfApi(endpoint=env.endpoint, token=env.hf_token(), library_name="infer-bench")
    try:
        info = api.dataset_info(repo_id, revision=revision)
        name = _pick_file(value, repo_id, [s.rfilename for s in info.siblings or []], path, field_)
        snap = snapshot_download(repo_id, repo_type="dataset", revision=revision, allow_patterns=[name],
                                 cache_dir=env.cache_dir, token=env.hf_token(), endpoint=env.endpoint,
                                 library_name="infer-bench")
    except UserError:
        raise
    except Exception as e:
        if _unreachable(e):
            return _dataset_from_cache(value, repo_id, revision, path, env, f"the Hub at {env.endpoint} cannot be "
                                       f"reached ({type(e).__name__}: {_server_reason(e)})", field_)
        raise UserError(_hub_problem(e, field_, value, repo_id, revision, env, kind="dataset")) from None
    return HubDataset(str(Path(snap) / name), repo_id, revision, Path(snap).name, name)


def _dataset_from_cache(value: str, repo_id: str, revision: str, path: str | None, env: HubEnv, why: str,
                        field_: str) -> HubDataset:
    storage = _storage(repo_id, "dataset", env)
    commit = _cached_commit(storage, revision)
    snap = storage / "snapshots" / (commit or "-")
    if commit is not None and snap.is_dir():
        listing = _cached_listing(repo_id, commit, "dataset", env)
        present = sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file())
        try:
            name = _pick_file(value, repo_id, listing if listing is not None else present, path, field_)
        except UserError:
            name = None
        if name is not None and (snap / name).is_file():
            return HubDataset(str(snap / name), repo_id, revision, commit, name, why)
    raise UserError(f"{field_}={value}: that file of dataset {repo_id} (revision {revision}) is not in {env.where()}, "
                    f"and {why}. Download it once with the network on (run without HF_HUB_OFFLINE), or give "
                    f"{field_}=PATH of a local copy.")


def hub_datasets(cfg: Any, problems: list[str]) -> tuple[Any, dict[str, Any]]:
    """A workload config whose `dataset` names a Hub dataset (`hf:...`), with the cached file's path
    in its place (workers read local files only), and the fields its rows record. A config without
    one comes back as it is; one that cannot be had is None, with the problem appended."""
    value = getattr(cfg, "dataset", None) if cfg is not None else None
    if not is_hub_dataset(value):
        return cfg, {}
    try:
        ds = resolve_dataset(value)
    except UserError as e:
        problems += e.problems
        return None, {}
    return replace(cfg, dataset=ds.path), ds.row_fields()


# ---- LoRA adapters -----------------------------------------------------------------------------------------

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_ADAPTERS: dict[tuple[Any, ...], tuple[str, str]] = {}


def is_hub_adapter(ref: Any) -> bool:
    """A LoRA adapter reference that names a Hub repository (ORG/NAME[@REV]) rather than a directory
    here: no such path exists, and it is a valid repository id."""
    if not isinstance(ref, str) or Path(ref).expanduser().exists() or ref.startswith((".", "/", "~")):
        return False
    return ref.count("/") == 1 and check_repo_id(ref.split("@", 1)[0]) is None


def resolve_adapter(ref: str, field_: str, env: HubEnv | None = None) -> tuple[str, str]:
    """A LoRA adapter on the Hub (ORG/NAME[@REV]): (its snapshot directory with adapter_config.json and
    adapter_model.safetensors, the commit), downloaded into the cache, or found there offline (or when
    the Hub cannot be reached). UserError naming `field_` where it cannot be had."""
    env = env or HubEnv.current()
    _quiet_http_logs()
    repo_id, _, revision = ref.partition("@")
    revision = revision or DEFAULT_REVISION
    key = (ref, env)
    if key in _ADAPTERS and Path(_ADAPTERS[key][0]).is_dir():
        return _ADAPTERS[key]
    if env.offline:
        out = _adapter_from_cache(ref, repo_id, revision, env, "HF_HUB_OFFLINE=1 keeps infer-bench off the network",
                                  field_)
    else:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()  # an adapter is small
        try:
            snap = snapshot_download(repo_id, revision=revision, allow_patterns=list(ADAPTER_FILES),
                                     cache_dir=env.cache_dir, token=env.hf_token(), endpoint=env.endpoint,
                                     library_name="infer-bench")
            out = (str(snap), Path(snap).name)
        except Exception as e:
            if _unreachable(e):
                out = _adapter_from_cache(ref, repo_id, revision, env, f"the Hub at {env.endpoint} cannot be reached "
                                          f"({type(e).__name__}: {_server_reason(e)})", field_)
            else:
                raise UserError(_hub_problem(e, field_, ref, repo_id, revision, env)) from None
    missing = [f for f in ADAPTER_FILES if not (Path(out[0]) / f).is_file()]
    if missing:
        raise UserError(f"{field_}={ref}: the Hub repository {repo_id} (commit {out[1][:12]}) has no "
                        f"{', '.join(missing)} at its top level: not a PEFT LoRA adapter. Give an adapter's id, or a "
                        "directory PEFT's save_pretrained wrote.")
    _ADAPTERS[key] = out
    return out


def _adapter_from_cache(ref: str, repo_id: str, revision: str, env: HubEnv, why: str, field_: str) -> tuple[str, str]:
    storage = _storage(repo_id, "model", env)
    commit = _cached_commit(storage, revision)
    snap = storage / "snapshots" / (commit or "-")
    if commit is None or not all((snap / f).is_file() for f in ADAPTER_FILES):
        raise UserError(f"{field_}={ref}: adapter {repo_id} (revision {revision}) is not in {env.where()}, and {why}. "
                        "Download it once with the network on (run without HF_HUB_OFFLINE), or give the path of a "
                        "local copy.")
    return str(snap), commit

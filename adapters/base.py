"""The engine interface: every adapter implements `Engine`; plain data types cross it.

The semantics are fixed by docs/design.md ("The engine interface"):

- load(model, options)  load weights from a local HF-format directory, allocate the KV cache
- prefill(prompts)      run a batch of token-id lists until every sequence has its first token
- decode(steps)         advance every live sequence by `steps` tokens (one engine step per token;
                        with speculative decoding an engine step may emit several: DecodeResult)
- release()             drop the live sequences and free their KV blocks
- serve(requests, t0)   continuous batching: requests arrive at scheduled times (a list) or as a
                        RequestSource makes them due (a closed loop); yields one timestamped
                        `TokenEvent` for every output token (or a `RequestFailed`)
- score(seqs, start, k) teacher-forced log-probabilities of given sequences (parity)
- kv_cache_info()       what the engine can report about its KV cache (None where it cannot)
- capabilities(...)     which options it supports, so a workload can skip what it cannot do
- begin_point() / end_point()  bracket each measured point; end_point() returns extra row
                        fields the engine alone knows (a server's identity, its telemetry)
- close()

All times are `time.perf_counter_ns()` values of the process running the engine (one monotonic
clock per run). On a GPU an adapter synchronises the device before it reads the clock.
Decoding is greedy and ignores EOS: the harness forces output lengths.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from harness.core.schema import check as check_schema


def now_ns() -> int:
    """The one clock of the harness."""
    return time.perf_counter_ns()


# ---- what goes in -----------------------------------------------------------------------

@dataclass
class ModelSpec:
    """A model to load: a local Hugging Face directory plus how to run it."""

    path: str
    name: str
    dtype: str = "float32"  # float32 | bfloat16 | float16 (resolved: never "auto")
    device: str = "cpu"  # cpu | cuda | cuda:N
    max_model_len: int = 2048  # longest sequence (prompt + output) the run will need
    seed: int = 0
    # Largest batch the run will prefill at once (prefill()): engines that must admit a whole
    # batch in one step size their per-step limits from these when the user did not set them.
    max_batch_size: int = 1
    max_batch_tokens: int = 0
    # Equal resources: the compute threads every engine must use (None: the engine's default),
    # and the CPU cores the engine's process is pinned to (already pinned when load() runs).
    threads: int | None = None
    cpus: tuple[int, ...] | None = None
    # Where the run writes (logs/ under it); None outside a run.
    run_dir: str | None = None
    # The model's Hugging Face Hub id when it came from the Hub (model=ORG/NAME): `name` is then
    # that id, `path` its snapshot in the cache, and an attached endpoint is sent this id.
    model_id: str | None = None


@dataclass
class Request:
    """One request of a serving workload. `arrival_s` is its scheduled arrival, in seconds
    after the serve() call's `start_ns`; the request's clock starts then, not when the engine
    gets to it."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0
    # A conversation's turn (workloads/conversation.py): its messages in order, each as the chat
    # API carries it (a dataset's, as logged: adapters/chat.py) or {"role", "ids": token ids} (an
    # engine's own reply, a synthetic turn); `prompt_ids` is their concatenation or their chat
    # template's rendering. An endpoint with api=chat sends the messages to /v1/chat/completions
    # (ids as their text), with `tools` and `tool_choice` where the log has them; other engines
    # take `prompt_ids`. None: a plain prompt.
    messages: list[dict[str, Any]] | None = None
    # Structured output (harness.core.constraints): {"kind": json | regex | choice | grammar,
    # "value": the schema / regex / choices / EBNF, "name", "disable_any_whitespace"}. The engine
    # must only produce what it allows, and may stop before max_new_tokens once the reply is
    # complete (its last event `finished`); None: free text, the length forced as always.
    constraint: dict[str, Any] | None = None
    # the LoRA adapter that serves it, by its name in the engine's `lora_adapters` option
    # (workloads/lora.py); None: the base model
    adapter: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None


class RequestSource:
    """The requests of a serve() call as they become due. An engine's serve loop asks `due(now)`
    for the requests whose time has come (each handed out once), `next_due_ns()` for when to look
    again (None: nothing is scheduled until a request finishes - a closed loop), and `exhausted()`
    whether every request was handed out. The consumer of serve()'s events reports each request's
    end with `finished()`, so a closed loop (workloads.serving) can schedule the next one; an
    engine never needs to call it. A plain list of requests is a `ListSource`."""

    def due(self, now_ns: int) -> list[Request]:
        raise NotImplementedError

    def next_due_ns(self) -> int | None:
        raise NotImplementedError

    def exhausted(self) -> bool:
        raise NotImplementedError

    def finished(self, request_id: str, time_ns: int) -> None:
        """A request produced its last token (or failed)."""


class ListSource(RequestSource):
    """Open loop: requests due at their scheduled arrival (start_ns + arrival_s). With
    `max_concurrency`, at most that many are handed out before earlier ones finish (the others
    wait at the client; their clock still starts at the scheduled arrival)."""

    def __init__(self, requests: list[Request], start_ns: int, max_concurrency: int | None = None):
        self.start_ns = start_ns
        self.pending = sorted(requests, key=lambda r: r.arrival_s)
        self.max_concurrency = max_concurrency
        self.in_flight: set[str] = set()

    def _arrival_ns(self, r: Request) -> int:
        return self.start_ns + int(r.arrival_s * 1e9)

    def due(self, now_ns: int) -> list[Request]:
        out = []
        while self.pending and self._arrival_ns(self.pending[0]) <= now_ns and (
                self.max_concurrency is None or len(self.in_flight) < self.max_concurrency):
            r = self.pending.pop(0)
            self.in_flight.add(r.request_id)
            out.append(r)
        return out

    def next_due_ns(self) -> int | None:
        if not self.pending or (self.max_concurrency is not None and len(self.in_flight) >= self.max_concurrency):
            return None
        return self._arrival_ns(self.pending[0])

    def exhausted(self) -> bool:
        return not self.pending

    def finished(self, request_id: str, time_ns: int) -> None:
        self.in_flight.discard(request_id)


def as_source(requests: list[Request] | RequestSource, start_ns: int) -> RequestSource:
    """What a serve() loop iterates: the source it was given, or a list as an open loop."""
    return requests if isinstance(requests, RequestSource) else ListSource(list(requests), start_ns)


# ---- what comes out ---------------------------------------------------------------------

@dataclass
class LoadInfo:
    load_time_s: float
    weights_bytes: int | None = None  # bytes of the model's parameters as loaded
    kv_pool_bytes: int | None = None  # bytes allocated up front for the KV cache, if any
    engine_version: str | None = None
    compute_threads: int | None = None  # CPU threads the engine's forward pass uses
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class PrefillResult:
    """The first output token of every sequence in the batch, and how long it took."""

    first_tokens: list[int]
    start_ns: int
    end_ns: int
    logits: Any = None  # [batch, vocab] tensor, only when asked for (tests, parity)

    @property
    def latency_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass
class StepTiming:
    """One engine step: its wall-clock span and how many tokens it produced."""

    start_ns: int
    end_ns: int
    num_tokens: int

    @property
    def latency_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass
class DecodeResult:
    """`tokens[i][b]` is sequence b's i-th new token (i < the `steps` asked for).

    `steps` lists the engine steps that produced them. Without speculative decoding that is one
    step per token (`steps[i]` produced `tokens[i]`). With it, one engine step (draft, then one
    verifying forward pass) may emit 1 .. k + 1 tokens per sequence, so there are fewer steps
    than tokens: `emitted[j][b]` is how many tokens step j gave sequence b (0 once b has its
    `steps` tokens; tokens accepted beyond that are dropped, as a server drops them beyond
    max_tokens), and `steps[j].num_tokens` is their sum. `emitted` is None when every step gave
    every sequence exactly one token."""

    tokens: list[list[int]]
    steps: list[StepTiming]
    logits: list[Any] | None = None  # one [batch, vocab] tensor per step, only when asked for
    emitted: list[list[int]] | None = None

    @property
    def step_latencies_s(self) -> list[float]:
        return [s.latency_s for s in self.steps]


@dataclass
class TokenEvent:
    """One output token of one request, stamped when the engine produced it."""

    request_id: str
    index: int  # 0 for the first output token
    token_id: int
    time_ns: int
    finished: bool = False
    # prompt tokens the engine took from its prefix cache for this request, where it says so per
    # request (the reference engine and vLLM on the first token; a server's usage
    # prompt_tokens_details.cached_tokens on the last); None: not reported on this event
    cached_tokens: int | None = None
    # of `cached_tokens`, those reloaded from a second KV tier (evicted from the first tier
    # earlier, offloaded, and brought back instead of recomputed: `kv_offload`); None where the
    # engine does not say per request (on the event that carries cached_tokens)
    reloaded_tokens: int | None = None
    # the reply's text as the engine sent it, on a request's last event, where the engine gives text
    # and not token ids (a server without token ids: structured output validates this text)
    text: str | None = None
    # the prompt's token ids as the engine took them, where they are not the request's
    # prompt_ids (an endpoint with api=chat: the server's, else the client's chat-templated
    # prompt); None: the request's prompt_ids
    prompt_ids: list[int] | None = None


@dataclass
class RequestFailed:
    """serve() may yield this for a request that failed (a server's HTTP error, a stream that
    ended early); the serving workload counts it and measures the completed requests only."""

    request_id: str
    reason: str
    time_ns: int


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counters, cumulative since load (`Engine.spec_decode_stats`); a
    workload takes the difference over a point. The names follow vLLM's spec-decode metrics:

    - `drafts`: draft proposals verified (one per sequence per speculative step that proposed at
      least one token);
    - `draft_tokens`: tokens proposed over all drafts (at most k each; n-gram lookup may propose
      fewer, or none, when nothing matches);
    - `accepted_tokens`: proposed tokens the target accepted (the bonus token the verifying pass
      adds is not counted: each draft emits accepted + 1 tokens);
    - `accepted_per_pos[i]`: drafts whose token at position i (0-based) was accepted;
    - `draft_time_s`: time spent proposing (running the draft model, or the n-gram lookup),
      None where the engine cannot say; `verify_time_s` likewise for the target's passes.

    Derived (docs/metrics.md): acceptance rate = accepted_tokens / draft_tokens; mean acceptance
    length = 1 + accepted_tokens / drafts. `source` says where the counters come from
    ("engine": the engine's own counters; "metrics": a server's /metrics; "derived": the
    adapter counted them from what it saw); `aggregate_only` names what a server reports only in
    aggregate (e.g. SGLang's mean accept length, with no per-position counts)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_time_s: float | None = None
    verify_time_s: float | None = None
    source: str = "engine"
    aggregate_only: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TokenScores:
    """Teacher-forced scores of one sequence (`Engine.score`). Entry j describes position
    p = start + j: the engine's distribution of the token at p given tokens [0, p), as the
    `top_k` most likely token ids (best first) with their log-probabilities (natural log,
    normalised over the whole vocabulary, computed in float32), and the log-probability of the
    token actually at p."""

    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    target_logprobs: list[float]


@dataclass
class KVCacheInfo:
    """What an engine reports about its KV cache. None means "the engine cannot say"."""

    kv_dtype: str | None = None
    block_size: int | None = None  # tokens per block (None: not paged)
    num_blocks: int | None = None
    bytes_per_block: int | None = None
    pool_bytes: int | None = None  # bytes of KV storage the engine holds now
    bytes_per_token: int | None = None
    blocks_in_use: int | None = None
    blocks_peak: int | None = None
    tokens_stored: int | None = None  # tokens whose K/V are in the cache now
    slots_allocated: int | None = None  # token slots reserved for live sequences
    prefix_cache_queries: int | None = None  # blocks (or tokens, see `extra`) looked up
    prefix_cache_hits: int | None = None
    preemptions: int | None = None
    # True: the pool is allocated up front whatever is in use (paged engines); None: infer it
    # (a pool of blocks is reserved)
    reserved: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Capabilities:
    """What an engine (with its current options) can do. Workloads consult this and record a
    reason instead of running something the engine cannot do."""

    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    devices: tuple[str, ...] = ("cpu", "cuda")
    kv_dtypes: tuple[str, ...] = ("auto",)
    prefix_caching: bool = False
    chunked_prefill: bool = False
    no_cache_mode: bool = False  # can generate without a KV cache (recompute every step)
    contiguous_layout: bool = False  # can reserve max_model_len per sequence up front
    continuous_batching: bool = False  # serve() admits new requests while others decode
    paged: bool = False  # the KV cache is split into blocks (block_size applies)
    logits: bool = False  # prefill/decode can return logits (for correctness checks)
    scores: bool = False  # score() gives teacher-forced log-probabilities (parity)
    # speculative decoding methods this engine can run (values of STANDARD_OPTIONS'
    # speculative_method, "none" excluded); () = it cannot speculate
    speculative_methods: tuple[str, ...] = ()
    # the largest batch (sequences decoding at once) it can speculate at, None = no limit
    # (transformers' assisted generation: 1); a point beyond it is an `unsupported` row
    speculative_max_batch: int | None = None
    # KV tiers (`kv_offload`): evicted prefix-cache blocks can go to a second tier and come back
    # on a later hit; `kv_offload_unsupported` says why not where the engine has the option but
    # cannot use it here (None: it can, or it has no such option at all)
    kv_offload: bool = False
    kv_offload_unsupported: str | None = None
    # structured output: the constraint kinds its requests may carry (Request.constraint: json,
    # regex, choice, grammar); () = none
    structured_output: tuple[str, ...] = ()
    # LoRA adapters (`lora_adapters`): requests name their adapter (Request.adapter); `lora_slots`:
    # adapters live in a fixed number of slots (max_loras) with a load or evict when a request needs
    # one that is not resident; `lora_mixed_batch`: one batch mixes adapters (and the base model);
    # `lora_unsupported` says why not where the engine has the option but cannot use it here
    lora: bool = False
    lora_slots: bool = False
    lora_mixed_batch: bool = False
    lora_unsupported: str | None = None
    options: tuple[str, ...] = ()  # option names accepted in engine_options.<name>
    # the chat API (an endpoint with api=chat): requests go as their messages (and tools), the
    # server applies its chat template; else as prompt token ids
    chat_api: bool = False
    # the chat API's content parts beside text that the engine takes as logged (image_url,
    # input_audio, ...: endpoints.<name>.content_parts); a message with another is not sent
    content_parts: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EngineUnavailable(Exception):
    """The engine is not installed or needs hardware that is absent. The message says which,
    and how to fix it; the run records an `unavailable` row with it."""


class PointUnsupported(Exception):
    """The engine is here but cannot run this point as asked: a kernel it would pick on this
    hardware refuses the point's dtype or feature (vLLM-CPU's AMX latent attention takes only
    bfloat16). Raised by `load` before the engine is built; the message gives the engine's own
    reason and what to ask for instead. The point's row is `skipped` with it, not `failed`."""


# Options a workload may vary from point to point (the engine is reloaded with them), by these
# standard names. An adapter that calls one differently maps it in `Engine.option_names`; one
# that cannot do it says so in its capabilities (the point is then skipped, with the reason).
STANDARD_OPTIONS = {
    "kv_cache": "on | none (no KV cache: every step recomputes the whole sequence)",
    "kv_layout": "paged | contiguous (reserve max_model_len per sequence up front)",
    "kv_dtype": "auto | fp8 | int8 ... (KV-cache storage dtype)",
    "block_size": "tokens per KV block",
    "prefix_caching": "true | false",
    # speculative decoding (docs/metrics.md, "Speculative decoding"); greedy verification always
    "speculative_method": "none | ngram | draft | eagle | mtp (draft tokens proposed, the target verifies them in one pass)",
    "num_speculative_tokens": "k: tokens proposed per speculative step (>= 1)",
    "draft_model": "method draft: a model preset or a checkpoint directory sharing the target's tokenizer",
    "prompt_lookup_min": "method ngram: the shortest n-gram matched against the sequence's own tokens",
    "prompt_lookup_max": "method ngram: the longest n-gram matched (the longest match wins)",
    # KV tiers (docs/metrics.md, "KV tiers"): a second tier behind the KV pool (vLLM kv_offloading_size,
    # SGLang --enable-hierarchical-cache / --hicache-size, TensorRT-LLM kv_cache_config.host_cache_size)
    "kv_offload": "true | false: evicted prefix-cache blocks go to a second KV tier and are reloaded on a hit",
    "kv_offload_bytes": "the second tier's capacity in bytes (LRU within it: a full tier drops its oldest block)",
    "kv_cache_bytes": "the first tier's (the KV pool's) size in bytes",
    # structured output (workload=structured): an engine that must prepare for constraints (vLLM
    # loads its tokenizer) declares it among its options; the others take constraints as they are
    "structured_output": "true | false: requests may carry constraints (Request.constraint)",
    # LoRA adapters (docs/metrics.md, "LoRA adapters"): requests name theirs (Request.adapter)
    "lora_adapters": "the LoRA adapters to serve: a list of {name, path, rank}, path a PEFT directory; [] none",
    "max_loras": "adapters resident at once (the slots a batch's adapters must fit in)",
    "max_lora_rank": "the largest adapter rank the engine allocates for",
    "max_cpu_loras": "adapters kept in host memory beyond the slots (vLLM's max_cpu_loras)",
}


class Engine(ABC):
    """One inference engine behind the harness's interface."""

    name: ClassVar[str]
    option_names: ClassVar[dict[str, str]] = {}  # standard option name -> this engine's name
    # engine_options.<name>: a dataclass of harness.core.schema.spec() fields (type, default, range,
    # help), checked by harness.core.schema.check as workloads' config_cls are. None: the adapter
    # checks its options itself (the endpoint adapter).
    options_cls: ClassVar[type | None] = None

    @classmethod
    def typed_options(cls, options: dict[str, Any] | None) -> tuple[Any, list[str]]:
        """(options as an `options_cls` object, problems each naming `engine_options.<name>.<field>`).
        With problems, the object holds the defaults."""
        return parse_engine_options(cls.options_cls, cls.name, options)

    @classmethod
    def options_for(cls, standard: dict[str, Any]) -> dict[str, Any]:
        """A workload's standard option overrides, in this engine's own option names."""
        return {cls.option_names.get(k, k): v for k, v in standard.items()}

    # -- availability and capabilities (no engine import needed) ---------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the engine can run here, else why not and how to fix it. Must be cheap:
        look for the package, do not import it."""
        return None

    @classmethod
    @abstractmethod
    def capabilities(cls, options: dict[str, Any] | None = None) -> Capabilities: ...

    @classmethod
    def version(cls) -> str | None:
        return None

    @classmethod
    def check_options(cls, options: dict[str, Any], model: ModelSpec) -> list[str]:
        """Problems with `engine_options.<name>` for this model/device, each naming the field
        and the fix. Runs before anything is loaded. Subclasses extend it."""
        if cls.options_cls is not None:
            return cls.typed_options(options)[1]
        known = cls.capabilities(options).options
        return [f"engine_options.{cls.name}.{k}: unknown option. Known options: {', '.join(known) or 'none'}."
                for k in options if k not in known]

    # -- life cycle ----------------------------------------------------------------------
    @abstractmethod
    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo: ...

    @abstractmethod
    def prefill(self, prompts: list[list[int]], return_logits: bool = False,
                max_new_tokens: int | None = None) -> PrefillResult:
        """`max_new_tokens`, when given, is how many tokens each sequence will be asked for in
        total (the first one plus the decode steps to follow): engines that must declare an
        output bound up front (a server, TensorRT-LLM) use it; others may ignore it."""

    @abstractmethod
    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult: ...

    @abstractmethod
    def release(self) -> None: ...

    @abstractmethod
    def serve(self, requests: list[Request] | RequestSource, start_ns: int) -> Iterator[TokenEvent]:
        """Continuous batching: take requests as they become due (`as_source(requests, start_ns)`:
        a list is an open loop at the requests' scheduled arrivals) and yield a TokenEvent for every
        output token (or a RequestFailed). While nothing runs and nothing is due, wait until
        `next_due_ns()`; when that is None, no request can become due before one finishes, so a
        serve loop with nothing running ends only when the source is exhausted."""

    @abstractmethod
    def kv_cache_info(self) -> KVCacheInfo: ...

    def score(self, sequences: list[list[int]], start: list[int], top_k: int,
              adapter: str | None = None) -> list[TokenScores]:
        """Teacher-forced log-probabilities: for each sequence i and each position p in
        [start[i], len(sequences[i])), the distribution of the token at p given the sequence's
        tokens before p (the given tokens are fed, never the engine's own samples). Engines with
        `capabilities().scores` implement it; `adapter` (engines with `capabilities().lora`) scores
        with that LoRA adapter of `lora_adapters`."""
        raise NotImplementedError(f"{self.name} cannot score sequences (capabilities().scores is False)")

    def begin_point(self) -> None:
        """A measured point starts (the harness calls it before the workload runs)."""

    def end_point(self) -> dict[str, Any]:
        """The point ended: extra row fields only the engine knows (e.g. a server's identity and
        the telemetry it collected since begin_point()). Default: none."""
        return {}

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters since load; None where the engine does not speculate
        (or cannot say)."""
        return None

    def lora_stats(self) -> dict[str, Any] | None:
        """LoRA adapters' counters since load, where the engine serves adapters: `loads` (an adapter
        put into a slot) and `evictions` (one taken out to make room), cumulative (None where the
        engine cannot say), `max_loras` (the slots), `resident` (the adapters in slots now) and
        `source` (where the figures come from). None: no adapters."""
        return None

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (between measured points). Engines without one: no-op."""

    def close(self) -> None:
        """Free everything. Safe to call twice."""

    # -- optional: what only some engines have (the defaults say "not supported") -------------
    # True where the engine serves a whole point with a load generator of its own (`serve_load`:
    # an HTTP endpoint); the serving workloads then hand it the point instead of calling serve().
    load_generator: ClassVar[bool] = False

    def serve_load(self, requests: list[Request], *, closed: bool, concurrency: int = 1,
                   max_concurrency: int | None = None, ramp_up_s: float = 0.0, processes: int = 1,
                   should_stop: Callable[[list[tuple[int, int]], int], bool] | None = None,
                   backend: str = "local", ray_address: str | None = None) -> dict[str, Any]:
        """One serving point's requests through the engine's own load generator (engines with
        `load_generator`): open loop at their arrival offsets (`max_concurrency` caps those in
        flight) or closed loop (`concurrency` in flight, the slots started over `ramp_up_s`), over
        `processes` client processes (`backend` local, or ray at `ray_address`). `should_stop(
        [(scheduled, first token)], start_ns)` is asked every 0.1 s; True stops the point (its
        streams close). Returns {"start_ns", "traces" (harness.core.metrics.RequestTrace per
        request sent), "client" (row fields: send lag, loop lag, client CPU, achieved rate)}, and
        "server_timings" where the server times each response itself (llama-server's `timings`,
        summed over these requests)."""
        raise NotImplementedError(f"{self.name} has no load generator of its own (load_generator is False): "
                                  "it serves a point with serve()")

    @classmethod
    def tuning_flags(cls) -> tuple[dict[str, Any], str | None]:
        """For an engine without `options_cls` (a launched server): the flags workload=tune may
        search ({name: adapters.endpoint.flags.ServerFlag}), or none and why."""
        return {}, (f"{cls.name} takes no options the harness can set per trial; tune the engine in-process, or "
                    "run it per configuration with workload=capacity.")

    @classmethod
    def declared_version(cls) -> str | None:
        """The version that version-dependent checks go by (a server's may be declared in its
        config); default: `version()`."""
        return cls.version()


def is_pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def lora_adapter_problems(prefix: str, adapters: list[Any] | None, max_lora_rank: int | None = None) -> list[str]:
    """The standard `lora_adapters` option's entries checked the same way for every engine: each
    {name, path, rank}, and (where the engine takes `max_lora_rank`) within it; `prefix` is
    `engine_options.<engine>.`."""
    out = []
    for a in adapters or []:
        if not isinstance(a, dict) or not a.get("name") or not a.get("path"):
            out.append(f"{prefix}lora_adapters: {a!r}: each adapter is {{name, path, rank}} (a PEFT directory).")
        elif max_lora_rank is not None and int(a.get("rank") or 0) > max_lora_rank:
            out.append(f"{prefix}max_lora_rank={max_lora_rank}: adapter '{a['name']}' has rank {a.get('rank')}. "
                       "Raise max_lora_rank.")
    return out


def option_names(options_cls: type) -> tuple[str, ...]:
    """The option names an options dataclass declares (Capabilities.options)."""
    return tuple(f.name for f in fields(options_cls))


def parse_engine_options(options_cls: type, engine: str, options: Any) -> tuple[Any, list[str]]:
    """`options` (a dict, or already an `options_cls` object) checked against `options_cls` by
    harness.core.schema.check: (typed options, every problem at once, each naming
    `engine_options.<engine>.<field>`). On problems the object holds the defaults. A class may
    define `normalize(raw) -> raw` for what YAML reads differently from what was meant (a bare
    `on` is true)."""
    if isinstance(options, options_cls):
        return options, []
    raw = dict(options or {})
    normalize = getattr(options_cls, "normalize", None)
    if normalize is not None:
        raw = normalize(raw)
    known = option_names(options_cls)
    problems = [f"engine_options.{engine}.{k}: unknown option. Known options: {', '.join(known)}."
                for k in raw if k not in known]
    typed, more = check_schema(options_cls, {k: v for k, v in raw.items() if k in known}, f"engine_options.{engine}")
    problems += more
    return (typed if typed is not None and not problems else options_cls()), problems


def engine_options_or_raise(options_cls: type, engine: str, options: Any) -> Any:
    """The typed options; ValueError naming every problem (for code past the harness's check)."""
    typed, problems = parse_engine_options(options_cls, engine, options)
    if problems:
        raise ValueError(" ".join(problems))
    return typed


def wait_until(deadline_ns: int) -> None:
    """Sleep until the clock reaches `deadline_ns` (used by serve loops for arrivals)."""
    remaining = deadline_ns - now_ns()
    if remaining > 0:
        time.sleep(remaining / 1e9)

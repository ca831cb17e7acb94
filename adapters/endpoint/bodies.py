"""What an endpoint sends: the JSON body of each request, built from the workload's token ids.

One `RequestBodies` per endpoint engine (`EndpointEngine.bodies`). It knows the endpoint's config,
its kind's record (which request extensions the server takes) and the model name requests carry;
the engine does the HTTP. Every body asks for exactly the tokens the workload wants
(`max_tokens` plus `ignore_eos`, greedy) and streams its usage:

  completion(prompt, n)        POST /v1/completions: the prompt as token ids where the kind takes
                               them (or prompt_format=ids), else as text that the model's tokenizer
                               re-encodes to the same length (checked: `prompt`)
  chat_completion(messages, n, constraint, tools, tool_choice)
                               POST /v1/chat/completions (api=chat): the messages as the API carries
                               them (adapters/chat.py: as logged, or an engine's reply as its text),
                               the request's tools and tool_choice where it has them
  payload_ids(ids, n, messages, constraint, adapter, tools, tool_choice)
                               either, by the endpoint's `api`, with the prompt's token ids as the
                               client makes them (api=chat: the chat-templated prompt's)
  payload(ids, n, messages, constraint, adapter)
                               the same, with the prompt tokens counted
  scores(seq, top_k)           a non-streamed completion asking for `prompt_logprobs` (score());
                               its answer read by `prompt_logprobs_scores`

A new request field (a LoRA adapter's name, a response format, tools) goes into these bodies,
and into the kind's record where only some servers take it (kinds.py: `accepted_fields`,
`token_ids`, `continuous_usage`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.base import TokenScores
from adapters.chat import decoder, template_ids, wire
from adapters.endpoint.config import EndpointConfig, chat_template_text
from adapters.endpoint.kinds import KINDS, ServerKind


class RequestBodies:
    """The request bodies of endpoint `name` (config `cfg`). `model` is the model name requests
    carry (set by the engine once it knows it); `tokenizer_dir()` gives the model's directory
    for text prompts and chat templates when `cfg.tokenizer` names none."""

    def __init__(self, name: str, cfg: EndpointConfig, tokenizer_dir: Callable[[], str | None]):
        self.name, self.cfg = name, cfg
        self.model: str | None = None
        self._tokenizer_dir = tokenizer_dir
        self._tokenizer: Any = None

    @property
    def kind(self) -> ServerKind:
        return KINDS[self.cfg.kind]

    @property
    def chat(self) -> bool:
        return self.cfg.api == "chat"

    @property
    def path(self) -> str:
        """The API path the streams go to, below the base URL (…/v1)."""
        return "/chat/completions" if self.chat else "/completions"

    def tokenizer(self) -> Any:
        """The model's tokenizer (endpoints.<name>.tokenizer, else the model's directory); loaded
        once, on first use: only text prompts and api=chat need it."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # heavy: only for text prompts
            self._tokenizer = AutoTokenizer.from_pretrained(self.cfg.tokenizer or self._tokenizer_dir())
        return self._tokenizer

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` by the model's tokenizer (a reasoning text the server did not count)."""
        return len(self.tokenizer()(text, add_special_tokens=False)["input_ids"])

    def prompt(self, ids: list[int]) -> Any:
        """The `prompt` field: the ids, or their text when the server takes text (the text must
        re-encode to as many tokens, else the lengths would not be what the workload asks)."""
        fmt = self.cfg.prompt_format
        if fmt == "auto":
            fmt = "ids" if self.kind.prompt_ids else "text"
        if fmt == "ids":
            return list(ids)
        tok = self.tokenizer()
        text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        again = tok(text, add_special_tokens=False)["input_ids"]
        if len(again) != len(ids):
            raise ValueError(f"a prompt of {len(ids)} token ids decodes to text that the tokenizer re-encodes to "
                             f"{len(again)} tokens; lengths would not be what the workload asks. Use "
                             f"endpoints.{self.name}.prompt_format=ids if the server takes token ids.")
        return text

    def completion(self, prompt: Any, max_tokens: int, constraint: dict[str, Any] | None = None) -> dict[str, Any]:
        """/v1/completions. `ignore_eos` alone forces the length (no `min_tokens`: on vLLM and
        SGLang it costs a logits penalty every step and can change greedy tokens); only fields the
        kind knows. A constraint (structured output) goes in the kind's own fields, and the end of
        sequence ends the reply (`ignore_eos: false`: a complete reply stops there)."""
        kind = self.kind
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": int(max_tokens),
                                "temperature": 0.0, "stream": True, "ignore_eos": True,
                                "stream_options": {"include_usage": True}}
        if kind.token_ids:
            body["return_token_ids"] = True
        if kind.continuous_usage:  # usage on every chunk: tokens counted even in chunks without text
            body["stream_options"]["continuous_usage_stats"] = True
        body.update(kind.request_fields)
        self._constrain(body, constraint)
        body.update(self.cfg.extra_body)
        return body

    def _constrain(self, body: dict[str, Any], constraint: dict[str, Any] | None) -> None:
        if constraint is None:
            return
        kind = self.kind
        if kind.constraint_fields is None or constraint["kind"] not in kind.structured_kinds:
            raise ValueError(f"endpoint {self.name} (kind {kind.name}) takes no {constraint['kind']} constraint "
                             f"(the kinds it takes: {', '.join(kind.structured_kinds) or 'none'})")
        body.update(kind.constraint_fields(constraint))
        body["ignore_eos"] = False

    def chat_completion(self, messages: list[dict[str, Any]], max_tokens: int, constraint: dict[str, Any] | None = None,
                        tools: list[Any] | None = None, tool_choice: Any = None) -> dict[str, Any]:
        """/v1/chat/completions: the messages, greedy, exactly max_tokens (`ignore_eos`), usage in
        the stream; token ids where the kind sends them; a constraint as for completion(); the
        request's `tools` (and `tool_choice`) where it has them."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": int(max_tokens),
                                "temperature": 0.0, "stream": True, "ignore_eos": True,
                                "stream_options": {"include_usage": True}}
        if tools:
            body["tools"] = tools
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        if self.kind.token_ids:
            body["return_token_ids"] = True
        self._constrain(body, constraint)
        body.update(self.cfg.extra_body)
        return body

    def chat_messages(self, messages: list[dict[str, Any]] | None, prompt_ids: list[int]) -> list[dict[str, Any]]:
        """A request's messages as the API carries them (adapters.chat.wire); a plain prompt is one
        user message."""
        return wire(messages or [{"role": "user", "ids": prompt_ids}], decoder(self.tokenizer()))

    def payload_ids(self, prompt_ids: list[int], max_tokens: int, messages: list[dict[str, Any]] | None = None,
                    constraint: dict[str, Any] | None = None, adapter: str | None = None,
                    tools: list[Any] | None = None, tool_choice: Any = None) -> tuple[dict[str, Any], list[int]]:
        """(request body, the prompt's token ids as the client makes them). api=chat: the
        tokenizer's chat-templated prompt (the template of endpoints.<name>.chat_template /
        chat_separator, else the checkpoint's own), the tools included, with the generation prompt.
        `adapter`: the LoRA adapter that serves it, in the kind's field (`lora`)."""
        if not self.chat:
            return self.lora(self.completion(self.prompt(prompt_ids), max_tokens, constraint), adapter), prompt_ids
        msgs = self.chat_messages(messages, prompt_ids)
        ids = template_ids(self.tokenizer(), msgs, chat_template_text(self.cfg), tools)
        return self.lora(self.chat_completion(msgs, max_tokens, constraint, tools, tool_choice), adapter), ids

    def payload(self, prompt_ids: list[int], max_tokens: int, messages: list[dict[str, Any]] | None = None,
                constraint: dict[str, Any] | None = None, adapter: str | None = None) -> tuple[dict[str, Any], int]:
        """(request body, prompt tokens as the client counts them): payload_ids, counted."""
        body, ids = self.payload_ids(prompt_ids, max_tokens, messages, constraint, adapter)
        return body, len(ids)

    def lora(self, body: dict[str, Any], adapter: str | None) -> dict[str, Any]:
        """`body` served by LoRA adapter `adapter` (None: the base model, unchanged): vLLM takes the
        adapter's --lora-modules name as `model`, SGLang its --lora-paths name as `lora_path`."""
        if adapter is None:
            return body
        field = self.kind.lora_field
        if field is None:
            raise ValueError(f"endpoint {self.name} (kind {self.kind.name}) is not given LoRA adapters by the harness")
        body[field] = adapter
        return body

    def scores(self, seq: list[int], top_k: int, adapter: str | None = None) -> dict[str, Any]:
        """One sequence's teacher-forced log-probabilities: vLLM's `prompt_logprobs` extension
        (kinds with `scores`), one output token, not streamed; with a LoRA adapter's."""
        body: dict[str, Any] = {"model": self.model, "prompt": list(seq), "max_tokens": 1, "temperature": 0.0,
                                "prompt_logprobs": int(top_k), "stream": False}
        if self.kind.token_ids:
            body["return_token_ids"] = True
        return self.lora(body, adapter)


def max_tokens(prompt: list[int], max_new_tokens: int | None, max_model_len: int) -> int:
    """The tokens a request asks for: the workload's count, else what still fits in max_model_len."""
    if max_new_tokens is not None:
        return int(max_new_tokens)
    room = max_model_len - len(prompt)
    if room < 1:
        raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room below max_model_len={max_model_len}")
    return room


def prompt_logprobs_scores(seq: list[int], start: int, top_k: int, plp: list[Any]) -> TokenScores:
    """TokenScores from vLLM-format `prompt_logprobs` (one entry per prompt position: None for the
    first, else {token id: {"logprob": x, "rank": r, ...}} holding the top_k and the actual token)."""
    top_ids, top_lps, target = [], [], []
    for p in range(start, len(seq)):
        entry = plp[p]
        if not isinstance(entry, dict):
            raise RuntimeError(f"prompt_logprobs has no entry for position {p}")
        items = [(int(k), v) for k, v in entry.items()]
        ranked = sorted((it for it in items if _rank(it[1]) is not None and _rank(it[1]) <= top_k),
                        key=lambda it: _rank(it[1]))
        if len(ranked) < top_k:  # no ranks given: the most likely first
            ranked = sorted(items, key=lambda it: -_lp(it[1]))[:top_k]
        top_ids.append([i for i, _ in ranked[:top_k]])
        top_lps.append([_lp(v) for _, v in ranked[:top_k]])
        actual = entry.get(str(seq[p]), entry.get(seq[p]))  # type: ignore[call-overload]
        if actual is None:
            raise RuntimeError(f"prompt_logprobs at position {p} lacks the prompt's own token {seq[p]}")
        target.append(_lp(actual))
    return TokenScores(top_ids, top_lps, target)


def _lp(v: Any) -> float:
    return float(v["logprob"] if isinstance(v, dict) else v)


def _rank(v: Any) -> int | None:
    return int(v["rank"]) if isinstance(v, dict) and v.get("rank") is not None else None

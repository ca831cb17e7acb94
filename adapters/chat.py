"""Chat messages as the OpenAI chat API carries them, and their rendering by a chat template.

One place for what the conversation replay (workloads/conversation.py: in-process engines get the
template's rendering), the endpoint client (adapters/endpoint/bodies.py: api=chat sends the
messages and counts the templated prompt) and infer-bench-serve's /v1/chat/completions share:

  wire(messages, decode)      the messages as sent: the API's fields of each message as logged
                              (role, content: a string or a list of parts, name, tool_calls,
                              tool_call_id); a message given as token ids ({"role", "ids"}: an
                              engine's own reply, a synthetic turn) is sent as their text
  template_view(messages)     what a server hands its template: text parts joined by newlines
                              (content null: ""), tool-call arguments parsed from their JSON
                              string into an object. vLLM 0.32's renderer does the same before
                              templating (vllm/renderers/chat_utils.py: a "string" content format,
                              _postprocess_messages), so the client counts what the server prefills
  template_ids(tok, msgs, template, tools)
                              the prompt's token ids: the template applied to template_view(msgs)
                              with the request's tools and the generation prompt
  call_text(call)             a tool call as a model writes it under Hermes/Qwen-style templates,
                              {"name": ..., "arguments": ...}: what a tool-call reply's length is
                              counted from
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the fields of a chat message that the API defines; a log's other keys (a timestamp, a
# fine-tuning weight) are not part of the request
API_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")


def is_template_text(value: str) -> bool:
    """Whether a configured chat template is the template's text (else a file's path)."""
    return "{%" in value or "{{" in value


def read_template(value: str | None) -> str | None:
    """A chat template given as a Jinja file or as its text, as text (None: none given)."""
    if value is None or is_template_text(value):
        return value
    return Path(value).expanduser().read_text()


def decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """Token ids as the text a chat message carries (special tokens kept, spaces as they are)."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def wire(messages: list[dict[str, Any]], decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """The messages as the request carries them (module docstring)."""
    out = []
    for m in messages:
        if "ids" in m:
            out.append({"role": m["role"], "content": decode(m["ids"])})
        else:
            out.append({k: m[k] for k in API_FIELDS if k in m})
    return out


def text_of(content: Any) -> str:
    """A message's text as a server's string-content template sees it: a string as it is, text
    parts joined by newlines, null as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text")


def template_view(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them (module docstring)."""
    out = []
    for m in messages:
        v = {k: m[k] for k in ("role", "name", "tool_call_id") if k in m}
        v["content"] = text_of(m.get("content"))
        if m.get("tool_calls"):
            v["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                               for c in m["tool_calls"]]
        out.append(v)
    return out


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    args = function.get("arguments")
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    return args if isinstance(args, dict) else {}


def template_ids(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None,
                 tools: list[dict[str, Any]] | None = None, generation_prompt: bool = True) -> list[int]:
    """The token ids of `messages` under the chat template (the tokenizer's own unless given), the
    request's `tools` passed to it, with the generation prompt: what a chat server prefills."""
    kwargs = {"tools": tools} if tools else {}
    out = tokenizer.apply_chat_template(template_view(messages), chat_template=chat_template,
                                        add_generation_prompt=generation_prompt, tokenize=True, **kwargs)
    if hasattr(out, "keys"):  # a BatchEncoding (newer transformers)
        out = out["input_ids"]
    return [int(t) for t in out]


def call_text(call: dict[str, Any]) -> str:
    """One tool call as the model writes it: {"name": NAME, "arguments": ARGUMENTS}, the
    arguments as logged."""
    f = call["function"]
    return '{"name": ' + json.dumps(f["name"], ensure_ascii=False) + ', "arguments": ' + (f.get("arguments") or "{}") + "}"

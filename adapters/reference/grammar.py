"""Structured output in the reference engine: a request's constraint (adapters.base.Request
.constraint: a JSON schema, a regex, a choice list or an EBNF grammar) becomes an xgrammar
matcher on its sequence, and the sampler takes the greedy token among those the matcher allows.

- `Grammars` (one per engine): xgrammar's GrammarCompiler over the checkpoint's tokenizer
  (TokenizerInfo.from_huggingface, the model's vocabulary size: the logits' width, which may
  exceed the tokenizer's), its compiled grammars cached by constraint (a schema compiled once
  is reused: what a server's grammar cache does). `matcher(constraint)` gives a request its own
  GrammarMatcher, whose stop token is the tokenizer's end-of-sequence id.
- `mask_rows(logits, matchers)`: before the argmax, each constrained row of the step's
  sampled logits gets its matcher's next-token bitmask (fill_next_token_bitmask), applied in
  place (apply_token_bitmask_inplace: a disallowed token's logit becomes -inf).
- After the step the sequence's matcher accepts the sampled token (llm_engine.run_step); once
  it is terminated (it accepted the stop token at the end of a complete reply) the sequence stops
  there: a constrained request may end before max_new_tokens, with the stop token as its last
  output token (finish_reason "stop", as vLLM).

No speculation with a constraint (the drafts would need the matcher's rollback): add_request
refuses it. The JSON grammar allows any whitespace unless the request says
`disable_any_whitespace` (then xgrammar's compact form, as vLLM's option of that name).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from harness.core.constraints import Constraint, from_request, grammar_of


class Grammars:
    """The engine's grammar compiler and its compiled grammars (see the module's docstring)."""

    def __init__(self, model_path: str, vocab_size: int):
        import xgrammar as xg
        from transformers import AutoTokenizer
        self.xg = xg
        tok = AutoTokenizer.from_pretrained(model_path)
        if tok.eos_token_id is None:
            raise ValueError(f"structured output needs an end-of-sequence token to stop on; the tokenizer of "
                             f"{model_path} has none")
        self.info = xg.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=[tok.eos_token_id])
        self.compiler = xg.GrammarCompiler(self.info)
        self.vocab_size = vocab_size
        self.compiled: dict[str, Any] = {}

    def matcher(self, constraint: dict[str, Any]) -> Any:
        c: Constraint = from_request(constraint)
        compact = bool(constraint.get("disable_any_whitespace"))
        key = json.dumps([c.key(), compact])
        if key not in self.compiled:
            self.compiled[key] = self.compiler.compile_grammar(grammar_of(c, any_whitespace=not compact))
        return self.xg.GrammarMatcher(self.compiled[key])



def mask_rows(logits: torch.Tensor, matchers: list[tuple[int, Any]]) -> None:
    """Mask rows `i` of `logits` [rows, vocab] by their matchers' next-token bitmasks, in place
    (a disallowed token's logit becomes -inf)."""
    if not matchers:
        return
    import xgrammar as xg
    bitmask = xg.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for j, (_, m) in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, j)
    rows = [i for i, _ in matchers]
    sub = logits[rows].float()
    xg.apply_token_bitmask_inplace(sub, bitmask.to(sub.device))
    logits[rows] = sub.to(logits.dtype)

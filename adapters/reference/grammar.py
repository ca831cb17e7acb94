"""Structured output in the reference engine: a request's constraint (adapters.base.Request
.constraint: a JSON schema, a regex, a choice list or an EBNF grammar) becomes an xgrammar
matcher on its sequence, and the sampler takes the greedy token among those the matcher allows.

- `Grammars` (harness.core.constraints, one per engine; transformers' adapter uses it too):
  xgrammar's GrammarCompiler over the checkpoint's tokenizer
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

from typing import Any

import torch

from harness.core.constraints import Grammars  # noqa: F401  (the engine's compiler: llm_engine makes one)


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

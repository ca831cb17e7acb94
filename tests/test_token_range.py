"""The token ids synthetic prompts draw from (harness.core.presets.prompt_token_range), and how
the plan hands them to workers."""

from __future__ import annotations

import json

from harness.core.presets import prompt_token_range, shape_from_hf_config


def test_the_range_is_the_vocabulary_minus_the_special_and_added_tokens(tiny_ckpt, tmp_path):
    for name in ("config.json",):
        (tmp_path / name).write_text((tiny_ckpt / name).read_text())
    shape = shape_from_hf_config(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"7": {}, "3": {}, str(shape.vocab_size + 5): {}}}))
    r = prompt_token_range(shape, tmp_path)
    specials = {i for i in (shape.bos_token_id, shape.eos_token_id, shape.pad_token_id) if i is not None}
    assert (r.low, r.high) == (0, shape.vocab_size)
    assert set(r.avoid) == specials | {3, 7}  # an added id outside the vocabulary is dropped
    assert list(r.avoid) == sorted(r.avoid)

"""Deliberately broken engines, for tests only (never registered by the product): each is the
reference engine with one fault put in on purpose, so that a check that should catch the fault is
driven through the whole command line. Tests register them for a run through the environment:
INFER_BENCH_ENGINES="shifted=broken_engines:ShiftedBlockReads" with this folder on PYTHONPATH."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

from adapters.hf import HFEngine
from adapters.reference.engine import ReferenceEngine

# later prefill chunks read their context back from the KV pool, where the fault is
CHUNKED = {"max_num_batched_tokens": 64}


class ShiftedBlockReads(ReferenceEngine):
    """A broken engine (a fault put in on purpose): the reference engine whose KV pool, when it
    reads a sequence's cached context back, takes every block after the first from the slot of the
    block before it - a KV block read from the wrong offset. Writes are untouched."""

    def load(self, model, options):
        info = super().load(model, options)
        pool, gather = self.pool, self.pool.gather

        def shifted(layer, block_tables, length, *args, **kwargs):
            wrong = block_tables.clone()
            wrong[:, 1:] = block_tables[:, :-1]
            return gather(layer, wrong, length)
        pool.gather = shifted
        return info


class ChunkedShiftedBlockReads(ShiftedBlockReads):
    """ShiftedBlockReads with chunked prefill, so that the fault shows in scoring: later chunks read
    their context back from the pool."""

    def load(self, model, options):
        return super().load(model, {**options, **CHUNKED})


class RopeOff(ReferenceEngine):
    """The reference engine loading a copy of the checkpoint whose config says 1.01 x rope_theta:
    it rotates by the wrong angles, an error that grows with the position."""

    def load(self, model, options):
        self._copy = Path(tempfile.mkdtemp(prefix="rope-off-"))
        dest = self._copy / "model"
        shutil.copytree(model.path, dest)
        cfg = json.loads((dest / "config.json").read_text())
        cfg["rope_theta"] = cfg.get("rope_theta", 10000.0) * 1.01
        if isinstance(cfg.get("rope_parameters"), dict):
            cfg["rope_parameters"]["rope_theta"] = cfg["rope_theta"]
        (dest / "config.json").write_text(json.dumps(cfg))
        return super().load(dataclasses.replace(model, path=str(dest)), options)

    def close(self):
        super().close()
        shutil.rmtree(getattr(self, "_copy", ""), ignore_errors=True)


class CannotScore(ReferenceEngine):
    """The reference engine without teacher-forced scoring, as an OpenAI-compatible server that
    returns no prompt log-probabilities: parity can only compare its greedy tokens."""

    def score(self, sequences, start, top_k):
        raise NotImplementedError("this engine returns no log-probabilities (test engine)")


class ScoresTooFew(ReferenceEngine):
    """The reference engine whose scores stop half-way through each sequence (a truncated
    response): parity must count the positions it did not get."""

    def score(self, sequences, start, top_k):
        out = super().score(sequences, start, top_k)
        for s in out:
            half = len(s.target_logprobs) // 2
            s.top_ids, s.top_logprobs, s.target_logprobs = s.top_ids[:half], s.top_logprobs[:half], s.target_logprobs[:half]
        return out


class SetupRaises(ReferenceEngine):
    """The reference engine whose version() raises while its worker sets it up (a bug in shipped
    code, with every package present)."""

    @classmethod
    def version(cls):
        raise RuntimeError("version() is broken (test engine)")


class WrongAdapter(HFEngine):
    """A broken engine (a fault put in on purpose): transformers with PEFT adapters, which serves
    one request with the wrong adapter - the last request of the first batch that mixes adapters is
    run by the base model instead of its own adapter (or by the first request's adapter when it has
    none). A request served alone is served right."""

    def __init__(self):
        super().__init__()
        self._faulted = False

    def prefill(self, prompts, return_logits=False, max_new_tokens=None, adapters=None):
        if adapters and len(set(adapters)) > 1 and not self._faulted:
            self._faulted = True
            adapters = list(adapters)
            adapters[-1] = None if adapters[-1] is not None else adapters[0]
        return super().prefill(prompts, return_logits, max_new_tokens, adapters)

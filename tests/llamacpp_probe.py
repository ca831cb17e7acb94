"""Drive the llamacpp engine (adapters/llamacpp/engine.py) in llama.cpp's own environment for the tests
in the harness's (tests/test_llamacpp.py): run as a script under .venv-llamacpp's interpreter with the
checkout on PYTHONPATH, it reads one JSON request on stdin and prints one JSON answer as its last line.

Request: {"model": DIR, "dtype": float32, "options": {...}, "max_batch_size": B, "max_model_len": N,
          "ops": [{"op": "generate", "prompts": [[ids]], "steps": n}, {"op": "score", ...}, ...]}
Ops: generate (prefill + decode: tokens, the times), score (teacher-forced), serve (requests all due at
once: each request's tokens), kv (kv_cache_info), tokenize {text, special} and detokenize {ids} (llama.h's
own, on the loaded GGUF's vocabulary)."""

from __future__ import annotations

import ctypes
import json
import sys


def main() -> None:
    req = json.loads(sys.stdin.read())
    from adapters.base import ModelSpec, Request
    from adapters.llamacpp.engine import LlamaCppEngine
    eng = LlamaCppEngine()
    spec = ModelSpec(path=req["model"], name="probe", dtype=req.get("dtype", "float32"),
                     max_model_len=req.get("max_model_len", 1024), max_batch_size=req.get("max_batch_size", 4),
                     threads=req.get("threads", 2))
    out: dict = {}
    try:
        info = eng.load(spec, req.get("options") or {})
        out["load"] = {"details": info.details, "weights_bytes": info.weights_bytes, "kv_pool_bytes": info.kv_pool_bytes}
        results = []
        for op in req.get("ops", []):
            kind = op["op"]
            if kind == "generate":
                pre = eng.prefill(op["prompts"], max_new_tokens=op["steps"] + 1)
                dec = eng.decode(op["steps"])
                toks = [[pre.first_tokens[b]] + [s[b] for s in dec.tokens] for b in range(len(op["prompts"]))]
                kv = eng.kv_cache_info().to_dict()
                eng.release()
                results.append({"tokens": toks, "prefill_s": pre.latency_s, "steps_s": dec.step_latencies_s, "kv": kv})
            elif kind == "score":
                sc = eng.score(op["sequences"], op["start"], op["top_k"])
                results.append([{"top_ids": s.top_ids, "top_logprobs": s.top_logprobs, "target": s.target_logprobs}
                                for s in sc])
            elif kind == "serve":
                reqs = [Request(f"r{i}", p, op["max_new_tokens"]) for i, p in enumerate(op["prompts"])]
                got: dict[str, list[int]] = {}
                for ev in eng.serve(reqs, 0):
                    got.setdefault(ev.request_id, []).append(ev.token_id)
                results.append([got[f"r{i}"] for i in range(len(reqs))])
            elif kind == "kv":
                results.append(eng.kv_cache_info().to_dict())
            elif kind in ("tokenize", "detokenize"):
                results.append(_text(eng, op))
            else:
                raise ValueError(f"unknown op {kind}")
        out["results"] = results
    except Exception as e:  # the test shows it
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        eng.close()
    print(json.dumps(out))


def _text(eng, op: dict):
    L = eng._L
    if op["op"] == "tokenize":
        raw = op["text"].encode()
        buf = (L.llama_token * (len(raw) + 16))()
        n = L.llama_tokenize(eng.vocab, raw, len(raw), buf, len(buf), op.get("add_special", False),
                             op.get("special", False))
        return list(buf[:n])
    pieces = []
    for t in op["ids"]:
        b = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(eng.vocab, t, b, 64, 0, False)
        pieces.append(b.raw[:n].decode(errors="replace"))
    return "".join(pieces)


if __name__ == "__main__":
    main()

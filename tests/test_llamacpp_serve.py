"""llamacpp-serve: llama.cpp's llama-server as an endpoint kind, launched through adapters/llamacpp/serve.py.
The kind's flags against the built `llama-server --help`, bad input (a flag the build lacks, a checkpoint
the converter cannot write) exiting 2 without a server left behind, greedy tokens through the server
(-np 1) equal to the reference engine's in float32, and speculative decoding with its counters and the
lossless check. Needs `make llamacpp`; skipped, saying so, without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from adapters.endpoint.flags import LLAMACPP_FLAGS
from adapters.endpoint.kinds import LLAMACPP, llamacpp_speculative_args
from adapters.endpoint.kinds import Speculation
from adapters.llamacpp.serve import find_server, help_flags, unknown_flags
from harness.checkpoint import SHIPPED_DIR
from harness.core.paths import REPO_ROOT
from harness.core.results import read_rows
from tests_support import LLAMACPP_MISSING, llamacpp_python

pytestmark = pytest.mark.skipif(llamacpp_python() is None or find_server() is None, reason=LLAMACPP_MISSING)


def cli(args: list[str], cache: Path, run_dir: Path, timeout: float = 900):
    env = {**os.environ, "INFER_BENCH_CACHE": str(cache)}
    r = subprocess.run([sys.executable, "-m", "harness.cli", "quiet=true", "roofline=false", f"hydra.run.dir={run_dir}",
                        *args], capture_output=True, text=True, env=env, timeout=timeout)
    rows = read_rows(run_dir / "results.jsonl") if (run_dir / "results.jsonl").exists() else []
    return r, rows


@pytest.fixture(scope="module")
def cache(model_cache):
    return model_cache.parent


def llama_servers() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            if p.info["name"] == "llama-server" and any("infer-bench" in a or "/gguf/" in a for a in p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return out


def test_every_flag_the_harness_passes_is_in_the_built_help():
    """The records' flags, the launch template's and what the option mappings emit (KV types, slots,
    batch, prompt cache, both kinds of speculation) are all flags of this llama-server build."""
    known = help_flags(str(find_server()))
    assert {"--parallel", "-np", "--cache-type-k", "-ctk", "--cache-reuse", "-cram", "--metrics"} <= known
    assert not [f.name for f in LLAMACPP_FLAGS if f"--{f.name}" not in known]
    assert not [f.name for f in LLAMACPP_FLAGS if f.passed == "bool-pair" and f"--no-{f.name}" not in known]
    import yaml
    template = yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / "llamacpp-serve.yaml").read_text())["launch"]
    server_part = template[template.index("--") + 1:]
    from adapters.endpoint.kinds import LaunchContext
    emitted = []
    for o in ({"kv_dtype": "q4_0", "max_num_seqs": 4, "max_num_batched_tokens": 512, "prefix_caching": False},
              {"kv_dtype": "auto"}):
        emitted += LLAMACPP.map_options(o, LaunchContext(options_file="x", dtype="float32")).args
    for sp in (Speculation("ngram", 4, None, 3, 3), Speculation("draft", 4, "/d")):
        emitted += [a for a in llamacpp_speculative_args(sp) if a != "--ib-draft-model"]
    assert unknown_flags(server_part + emitted, known) == []
    assert unknown_flags(["--no-such-flag", "-t", "2", "--threads=2"], known) == ["--no-such-flag"]


def test_a_flag_the_build_lacks_and_an_unconvertible_checkpoint_exit_2(tmp_path, family_ckpts):
    base = [sys.executable, "-m", "adapters.llamacpp.serve", "--model", str(SHIPPED_DIR / "tiny-trained"),
            "--cache-dir", str(tmp_path)]
    r = subprocess.run(base + ["--", "--no-such-flag", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--no-such-flag" in r.stderr
    r = subprocess.run([sys.executable, "-m", "adapters.llamacpp.serve", "--model", str(family_ckpts["tiny-gemma3"]),
                        "--cache-dir", str(tmp_path), "--", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot be converted for llama.cpp" in r.stderr
    r = subprocess.run(base + ["--weights", "q5_k", "--", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "weights=q5_k" in r.stderr


def test_a_launch_that_fails_leaves_no_server_and_names_why(tmp_path, cache):
    """A server flag value llama-server refuses at start (a KV type this build does not know): the point
    fails with the server's own words, exit 1, and no llama-server is left running."""
    before = {p.pid for p in llama_servers()}
    r, rows = cli(["engines=[llamacpp-serve]", "model=tiny-trained", "workload=sweep", "parity=false",
                   "workload.batch_sizes=[1]", "workload.prompt_lens=[8]", "workload.output_len=2",
                   "workload.min_repeats=1", "workload.warmup=1",
                   "+engine_options.llamacpp-serve.server_flags={ubatch-size: 0}"], cache, tmp_path / "run")
    assert r.returncode == 2, r.stderr[-1500:]  # the record's bound (ge=1): refused before anything starts
    assert "engine_options.llamacpp-serve.server_flags.ubatch-size=0" in r.stderr
    assert {p.pid for p in llama_servers()} - before == set()


def test_greedy_tokens_through_the_server_equal_the_reference_engines(tmp_path, cache):
    """-np 1, f32 GGUF and f32 KV, flash attention off: every greedy token of parity's prompts equal to the
    reference engine's (float32 parity fails on any difference); token ids from the stream (__verbose.tokens)."""
    r, rows = cli(["engines=[reference,llamacpp-serve]", "model=tiny-trained", "workload=parity", "dtype=float32",
                   "engine_options.llamacpp-serve.max_num_seqs=1"], cache, tmp_path / "run")
    row = [x for x in rows if x["engine"] == "llamacpp-serve"][0]
    print({k: row.get(k) for k in ("status", "agreement", "positions_compared", "token_count_source", "error")})
    assert row["status"] == "ok" and row["agreement"] == 1.0, (row.get("error"), r.stderr[-2000:])
    assert row["token_count_source"] == "verbose_tokens" and row["output_token_ids"] == "from the server"
    argv = row["server_argv"]
    assert argv[argv.index("--parallel") + 1] == "1"
    assert not llama_servers()


def test_speculative_ngram_on_the_server_reads_its_counters_and_is_lossless(tmp_path, cache):
    """n-gram speculation through llama-server: every request of both points completes (llama-server closes
    the connection after each stream: the client opens one per request), every token's id comes from the
    stream (speculative ones too: __verbose.tokens), the output equals the run without speculation token for
    token, and acceptance is read from /metrics, agreeing with the measured responses' own timings."""
    r, rows = cli(["engines=[llamacpp-serve]", "model=tiny-trained", "workload=speculative", "dtype=float32",
                   "workload.methods=[ngram]", "workload.num_speculative_tokens=[3]", "workload.batch_sizes=[1]",
                   "workload.contents=[code]", "workload.prompt_lookup_min=3", "workload.prompt_lookup_max=3",
                   "workload.prompt_len=64", "workload.output_len=32", "workload.rounds=1", "workload.min_requests=4",
                   "parity=false"], cache, tmp_path / "run", timeout=600)
    spec = [x for x in rows if x.get("method") == "ngram"]
    assert spec, [(x["engine"], x.get("method"), x["status"], x.get("error")) for x in rows]
    row = spec[0]
    print({k: row.get(k) for k in ("status", "lossless", "lossless_requests", "lossless_tokens", "acceptance_rate",
                                   "mean_acceptance_length", "spec_draft_tokens", "spec_accepted_tokens", "spec_drafts",
                                   "spec_counters_source", "spec_counters_check", "server_timings", "spec_note",
                                   "failed_requests", "token_count_source", "error")})
    assert row["status"] == "ok", (row.get("error"), r.stderr[-2000:])
    for x in rows:
        assert x["completed"] == x["num_requests"] == 4 and not x["failed_requests"], x.get("failed_request_reasons")
        assert x["token_count_source"] == "verbose_tokens"
    assert row["lossless"] == "pass" and row["lossless_requests"] == 4 and row["lossless_tokens"] == 4 * 32
    assert row["spec_counters_source"] == "metrics" and row["spec_draft_tokens"] > 0  # llamacpp:spec_decode_*
    assert row["spec_accepted_tokens"] > 0  # code repeats: some drafts accepted, else the check shows little
    assert row["acceptance_rate"] == row["spec_accepted_tokens"] / row["spec_draft_tokens"]
    assert row["spec_counters_check"] == "agree"  # /metrics' difference = the measured responses' timings
    assert row["server_timings"]["requests"] == 4
    assert r.returncode == 0, r.stderr[-2000:]
    assert not llama_servers()

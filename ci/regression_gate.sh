#!/usr/bin/env bash
# The project's regression gate: the reference engine of the working tree against the baseline
# commit named in ci/baseline-ref, measured on this machine with infer-bench-ab --method blocks:
# both sides' engine workers alive at once, pinned to one core, alternating short blocks (one
# prefill + 15 decode steps at batch 1 and at batch 8) PAIRS (200) times per point, the order flipping
# every pair, three worker processes per side taking the pairs in turn; the verdict from a Yuen
# interval of the trimmed mean per-pair log-ratio of the worker's CPU time per block (at the
# threshold) and of the wall-clock decode step (at 4x it; prefill shown, not decisive).
# README "Regression checks in CI" gives the
# false-alarm and detection rates measured for these settings (scripts/ab_calibrate.py runs this
# script).
#   ci/regression_gate.sh [OUT_DIR [infer-bench-ab options ...]]
#       exit 0 unchanged/improved, 1 regressed or failed, 2 unusable
# Options after OUT_DIR go to infer-bench-ab after the gate's own (a later one wins), e.g.
# `--candidate-override engine_options.reference.step_delay_frac=0.05` or `--cpu 0`.
# HISTORY (default runs/history.duckdb; HISTORY= turns it off; docs/history.md): after the
# verdict, one ordinary infer-bench run of the working tree at the gate's workload is ingested
# into the performance history (the block pairs are not runs). The verdict is the A/B gate's alone.
# Move the baseline forward deliberately (an accepted slowdown, a landed improvement):
#   git rev-parse HEAD > ci/baseline-ref
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${1:-runs/ci-gate}
shift || true
PAIRS=${PAIRS:-200}
THRESHOLD=${THRESHOLD:-2.5%}
HISTORY=${HISTORY-runs/history.duckdb}
REF=$(tr -d '[:space:]' < ci/baseline-ref)
if ! git rev-parse --verify --quiet "$REF^{commit}" >/dev/null; then
    # a shallow clone may lack the baseline commit: fetch it
    git fetch --quiet --unshallow 2>/dev/null || git fetch --quiet origin "$REF" 2>/dev/null || true
fi
WORKLOAD=(engines=[reference] model=tiny dtype=float32 engine_options.reference.num_threads=1
          workload.batch_sizes=[1,8] workload.prompt_lens=[32] workload.output_len=16)
code=0
"$BIN/infer-bench-ab" --method blocks --baseline-ref "$REF" --pairs "$PAIRS" --threshold "$THRESHOLD" \
    --out "$OUT" "$@" -- "${WORKLOAD[@]}" || code=$?
if [ -n "$HISTORY" ] && [ -d "$OUT" ]; then
    "$BIN/infer-bench" "${WORKLOAD[@]}" workload.warmup=2 workload.min_repeats=8 workload.min_duration_s=1 \
        parity=false roofline=false quiet=true "hydra.run.dir=$OUT/history-run" >/dev/null \
        && "$BIN/infer-bench-history" --store "$HISTORY" ingest "$OUT/history-run" \
        || echo "ci/regression_gate.sh: the history run was not ingested into $HISTORY (the gate's verdict stands)" >&2
fi
exit "$code"

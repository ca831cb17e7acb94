#!/usr/bin/env bash
# The project's regression gate: the reference engine of the working tree against the baseline
# commit named in ci/baseline-ref, run interleaved on this machine (infer-bench-ab: A, B, B, A, ...
# paired per round), so the gate holds whatever CPU the CI machine has today. README "Regression
# checks in CI" gives the false-alarm and detection rates measured for these settings.
#   ci/regression_gate.sh [OUT_DIR]     exit 0 unchanged/improved, 1 regressed, 2 unusable
# Every run of the gate (both sides) is also ingested into the performance history HISTORY
# (default runs/history.duckdb; HISTORY= turns it off; docs/history.md). The verdict is the A/B
# gate's alone: the history is for the trend and its change points.
# Move the baseline forward deliberately (an accepted slowdown, a landed improvement):
#   git rev-parse HEAD > ci/baseline-ref
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${1:-runs/ci-gate}
ROUNDS=${ROUNDS:-8}
THRESHOLD=${THRESHOLD:-10%}
HISTORY=${HISTORY-runs/history.duckdb}
REF=$(tr -d '[:space:]' < ci/baseline-ref)
if ! git rev-parse --verify --quiet "$REF^{commit}" >/dev/null; then
    # a shallow clone may lack the baseline commit: fetch it
    git fetch --quiet --unshallow 2>/dev/null || git fetch --quiet origin "$REF" 2>/dev/null || true
fi
code=0
"$BIN/infer-bench-ab" --baseline-ref "$REF" --rounds "$ROUNDS" --threshold "$THRESHOLD" --out "$OUT" -- \
    engines=[reference] model=tiny dtype=float32 engine_options.reference.num_threads=1 \
    workload.batch_sizes=[1,8] workload.prompt_lens=[128] workload.output_len=32 \
    workload.warmup=2 workload.min_repeats=8 workload.min_duration_s=1 || code=$?
if [ -n "$HISTORY" ] && [ -d "$OUT" ]; then
    "$BIN/infer-bench-history" --store "$HISTORY" ingest "$OUT" \
        || echo "ci/regression_gate.sh: the runs were not all ingested into $HISTORY (the gate's verdict stands)" >&2
fi
exit "$code"

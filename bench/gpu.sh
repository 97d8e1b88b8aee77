#!/usr/bin/env bash
# Every GPU measurement of issue 15 on one H100/H200 node in under 10 minutes, written to OUT_DIR/gpu_results.md
# (bench/gpu.py says what each one is):
#   bash bench/gpu.sh OUT_DIR              Qwen3-8B and Qwen3.5-9B shapes, bfloat16
#   bash bench/gpu.sh OUT_DIR --tiny       tiny shapes on the CPU, a check of the script (tests/test_bench.py)
# Any further options go to bench/gpu.py (--shapes, --batch, --prompt, --new, ...).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bash bench/gpu.sh OUT_DIR [--tiny] [gpu.py options]" >&2
  exit 2
fi
out=$1
shift
exec python "$(dirname "$0")/gpu.py" --out "$out" "$@"

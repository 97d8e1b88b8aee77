#!/usr/bin/env bash
# The GPU node's measurements in one call (issue 50; bench/gpu.py says what each one is), written to
# OUT_DIR/gpu_results.md row by row as they are measured:
#   bash bench/gpu.sh OUT_DIR              Qwen3-8B shape, bfloat16: GRPO's decode path eager and as a
#                                          CUDA graph, a GRPO update padded and packed, a full-parameter
#                                          FSDP update and the vLLM sync's save (Qwen3-4B shape), launches
#                                          per decoded token; about 3 minutes on an H200 after start-up
#   bash bench/gpu.sh OUT_DIR --tiny       tiny shapes on the CPU, a check of the script (tests/test_bench.py)
# Any further options go to bench/gpu.py (--shapes, --sections, --compiled, --decode-prompt, ...).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bash bench/gpu.sh OUT_DIR [--tiny] [gpu.py options]" >&2
  exit 2
fi
out=$1
shift
exec python "$(dirname "$0")/gpu.py" --out "$out" "$@"

#!/usr/bin/env bash
# The GPU node's check in one call: bench/gpu.py's measurements (issue 50; gpu.py says what each one is),
# written to OUT_DIR/gpu_results.md row by row as they are measured, then bench/gpu_runs.py's end-to-end
# runs (issue 60: torchrun sft.py and grpo.py, LoRA and finetune: full, each resumed once, against the local
# rules judge, on the demo's small Qwen3 and a Qwen3-0.6B shape), one row each in OUT_DIR/gpu_runs.md:
#   bash bench/gpu.sh OUT_DIR              Qwen3-8B shape, bfloat16: GRPO's decode path eager and as a
#                                          CUDA graph (the LoRA on its side path and merged), a GRPO update
#                                          padded and packed, a full-parameter FSDP update and the vLLM
#                                          sync's save (Qwen3-4B shape), launches per decoded token; then
#                                          the 16 runs. Not yet run on a GPU: sized by estimate (about 4
#                                          minutes for gpu.py on an H200 after start-up, 20 s a run)
#   bash bench/gpu.sh OUT_DIR --tiny       tiny shapes on the CPU, a check of both scripts (tests/test_bench.py)
# Any further options go to bench/gpu.py (--shapes, --sections, --compiled, --decode-prompt, ...); run
# either script alone for one half. Exit 1 when either failed; both always run.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bash bench/gpu.sh OUT_DIR [--tiny] [gpu.py options]" >&2
  exit 2
fi
out=$1
shift
here=$(dirname "$0")
tiny=()
for arg in "$@"; do
  if [ "$arg" = --tiny ]; then tiny=(--tiny); fi
done
status=0
python "$here/gpu.py" --out "$out" "$@" || status=1
python "$here/gpu_runs.py" --out "$out" ${tiny[@]+"${tiny[@]}"} || status=1
exit $status
